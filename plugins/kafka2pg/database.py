"""PostgreSQL connections and the one transaction helper every write goes through.

Connection errors are translated into `DatabaseUnavailableError` naming host and database.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import psycopg

from kafka2pg.exceptions import DatabaseUnavailableError, SchemaNotReadyError


def describe(url: str) -> str:
    """host:port/dbname of a URL, without user or password (safe to log)."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path or ''}"


def connect(url: str, *, autocommit: bool = False, connect_timeout: int = 10) -> psycopg.Connection:
    """Open a connection; `DatabaseUnavailableError` if PostgreSQL cannot be reached."""
    try:
        return psycopg.connect(url, autocommit=autocommit, connect_timeout=connect_timeout)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailableError(
            f"PostgreSQL at {describe(url)} is unreachable: {str(exc).strip()}. Check that it runs "
            "and that KAFKA2PG_DATABASE_URL is right."
        ) from exc


@contextmanager
def transaction(url: str) -> Iterator[psycopg.Connection]:
    """One connection, one transaction: commit on success, roll back on any exception."""
    conn = connect(url)
    try:
        with conn.transaction():
            yield conn
    except psycopg.errors.UndefinedTable as exc:
        raise SchemaNotReadyError(
            f"PostgreSQL at {describe(url)} lacks kafka2pg tables ({str(exc).strip()}): run `./kafka2pg migrate`"
        ) from exc
    except psycopg.OperationalError as exc:
        if not conn.broken:
            raise
        raise DatabaseUnavailableError(
            f"lost the connection to PostgreSQL at {describe(url)} inside a transaction ({str(exc).strip()}). "
            "It was rolled back (or, if lost during COMMIT, may have committed); every kafka2pg step is "
            "safe to retry and finds out which."
        ) from exc
    finally:
        conn.close()
