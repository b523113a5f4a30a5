"""PostgreSQL connections and the one transaction helper every write goes through.

Connection errors are translated into `DatabaseUnavailableError` naming host and database.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from kafka2pg.exceptions import (
    ConfigError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    InstallationError,
    SchemaNotReadyError,
    StatementTimeoutError,
    TableRefusesRowsError,
    without_secrets,
)
from kafka2pg.locations import COMMAND, SQL_DIR

log = logging.getLogger(__name__)


def migration_files() -> list[Path]:
    """The numbered migrations kafka2pg ships; an installation without them is an error, never "none pending"."""
    files = sorted(SQL_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    if not files:
        raise InstallationError("SQL migrations", SQL_DIR)
    return files


def describe(url: str) -> str:
    """host:port/dbname of a URL or key=value conninfo, without user or password (safe to log)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(a malformed connection string)"
    if password_misread(url):  # what libpq took for the host, port or database holds part of the password
        return "(a URL whose password libpq misreads)"
    host = params.get("host") or params.get("hostaddr") or "localhost"
    return f"{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"


def hide_password(text: str, url: str) -> str:
    """`text` with the parts of the password typed in `url` replaced by ***, when libpq misread
    the URL: a password with an unencoded `/`, `@`, `?` or `#` is read partly as the host, port
    or database, which messages about the connection then show (`describe` and `connect` show
    none of those parts then). A URL libpq reads as written shows no password anywhere: `text`
    is returned as it is."""
    if not password_misread(url):
        return text
    password = typed_password(url)
    pieces = {password, unquote(password)}
    pieces |= {p for piece in list(pieces) for p in re.split(r"[/@?#:]", piece)}
    return without_secrets(text, (piece for piece in pieces if len(piece) >= 3))


def typed_password(url: str) -> str:
    """The password as typed in a URL's user-info (everything up to the last `@`, so also a
    password libpq misreads); '' for none, or for a key=value conninfo."""
    if "://" not in url or "@" not in url:
        return ""
    rest = url.partition("://")[2]
    return rest[: rest.rfind("@")].partition(":")[2]


def password_misread(url: str) -> bool:
    """Whether libpq read part of a URL's user-info as its host, port or database."""
    if "://" not in url or "@" not in url:
        return False
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return False  # never quoted: see `_malformed`
    host, port, dbname = (str(params.get(k) or "") for k in ("host", "port", "dbname"))
    if "@" in host or "@" in port:  # the '@' that ended the user-info, read past: no host has one
        return True
    if "@" in dbname:  # a database may have one (`app%40prod`): misread if the password came out other
        return unquote(typed_password(url)) != str(params.get("password") or "")
    # A port that is no number: misread only where the user-info did not end at its '@' (a '/',
    # '?' or '#' in the password ended the authority before it); else the port is just wrong.
    authority = re.split(r"[/?#]", url.split("://", 1)[1], maxsplit=1)[0]
    return authority.count("@") != 1 and not all(p.isdigit() for p in port.split(",") if p)


# libpq refusing an option's value before it asks any server (`sslmode=bogus`, a port that is no
# number): no retry can mend it.
_INVALID_OPTION = re.compile(r"connection is bad: invalid ")


def connect(url: str, *, autocommit: bool = False, connect_timeout: int = 10) -> psycopg.Connection:
    """Open a connection; `DatabaseUnavailableError` if PostgreSQL cannot be reached,
    `DatabaseRefusedError` if it refuses the connection's credentials, role or database,
    `ConfigError` if the connection string is malformed. No message (nor its chained cause)
    shows the password."""
    try:
        # UTF8 whatever the role's or database's client_encoding: a text PostgreSQL holds that a
        # LATIN1 client cannot (an emoji in a key) would otherwise fail every read of it, the gate's.
        connection = psycopg.connect(
            url, autocommit=autocommit, connect_timeout=connect_timeout, client_encoding="UTF8"
        )
        return session_settings(connection)
    except psycopg.ProgrammingError as exc:
        # psycopg quotes the offending part of the string, the password included: not re-raised.
        raise ConfigError(
            f"the PostgreSQL connection string is malformed ({_malformed(str(exc))}); fix the postgres connection "
            "(postgres_conn_id, default kafka2pg_postgres) or KAFKA2PG_DATABASE_URL"
        ) from None
    except psycopg.OperationalError as exc:
        if password_misread(url):  # libpq's words would quote what it read as host or port: not shown
            raise ConfigError(
                "the PostgreSQL connection URL cannot work: libpq read part of its password as the host, port or "
                "database. In a URL, percent-encode / @ ? # : in the password (%2F %40 %3F %23 %3A) and @ in the "
                "database name; fix the postgres connection (postgres_conn_id, default kafka2pg_postgres) or "
                "KAFKA2PG_DATABASE_URL"
            ) from None
        message = _one_line(exc)
        if _INVALID_OPTION.match(message):  # libpq's own check, no server asked
            raise ConfigError(
                f"the PostgreSQL connection string to {describe(url)} has an option libpq refuses "
                f"({message.removeprefix('connection is bad: ')}); fix the postgres connection (postgres_conn_id, "
                "default kafka2pg_postgres) or KAFKA2PG_DATABASE_URL"
            ) from None
        if refuses(message):
            raise DatabaseRefusedError(
                f"PostgreSQL at {describe(url)} refuses the connection: {_sentence(message)} Retrying cannot "
                "help: fix the user, password or database of the postgres connection (postgres_conn_id, default "
                "kafka2pg_postgres) or KAFKA2PG_DATABASE_URL, or the server's pg_hba.conf.",
                database=describe(url),
            ) from None
        raise DatabaseUnavailableError(
            f"PostgreSQL at {describe(url)} is unreachable: {_sentence(message)} Check that it runs and that the "
            "postgres connection (postgres_conn_id, default kafka2pg_postgres) or KAFKA2PG_DATABASE_URL is right.",
            database=describe(url),
        ) from None


# A transaction of kafka2pg never waits on its client for long (Kafka is asked outside them; a
# chunk's COPYs wait at most a Kafka read stall between them): one idle this long belongs to a
# process that is frozen (SIGSTOP, a hung VM, a network partition that kept the TCP connection)
# and still holds its locks, the batch's claim among them. PostgreSQL ends its session, so the
# next run can go on; the frozen process, if it wakes, finds its connection gone.
IDLE_IN_TRANSACTION_TIMEOUT_S = 600


def session_settings(conn: psycopg.Connection, name: str = "kafka2pg") -> psycopg.Connection:
    """Set the session's `idle_in_transaction_session_timeout` (IDLE_IN_TRANSACTION_TIMEOUT_S);
    READ COMMITTED, which kafka2pg's transactions are written for (a database's default of
    SERIALIZABLE failed concurrent chunk writers with serialization failures, run after run);
    the output styles psycopg reads (ISO dates and times, `postgres` intervals: a role or database
    whose DBA set `DateStyle = 'SQL, DMY'` gets timestamps psycopg cannot parse; the day/month
    order of dates written as text stays as set); UTC, in which admission bounds timestamps to
    years 1-9999 (in a zone west of UTC 0001-01-01T00:00Z is a year BC, which psycopg cannot
    read, and east of it 9999-12-31T23:30Z is year 10000); and, unless the connection string names one,
    its `application_name` (what pg_stat_activity and kafka2pg's lock-wait messages show)."""
    try:
        conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
            " set_config('DateStyle', 'ISO', false), set_config('IntervalStyle', 'postgres', false),"
            " set_config('TimeZone', 'UTC', false),"
            " set_config('default_transaction_isolation', 'read committed', false),"
            " CASE WHEN current_setting('application_name') = '' THEN set_config('application_name', %s, false) END",
            (f"{IDLE_IN_TRANSACTION_TIMEOUT_S}s", name),
        )
        if not conn.autocommit:
            conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


LOCK_WAIT_LOG_S = 15.0


@contextmanager
def waits_logged(url: str, conn: psycopg.Connection, purpose: str) -> Iterator[None]:
    """While the block runs, every LOCK_WAIT_LOG_S seconds: if `conn`'s statement waits on a lock,
    log which sessions hold it (pid, application, state and since when), from a connection of its own."""
    every_s = LOCK_WAIT_LOG_S
    done = threading.Event()
    waiting = conn.info.backend_pid

    def watch() -> None:
        while not done.wait(every_s):
            try:
                with psycopg.connect(url, autocommit=True, connect_timeout=10) as watcher:
                    holders = watcher.execute(
                        "SELECT pid, coalesce(nullif(application_name, ''), 'no application name'), state,"
                        " to_char(now() - coalesce(xact_start, state_change), 'HH24:MI:SS')"
                        " FROM pg_stat_activity WHERE pid = ANY(pg_blocking_pids(%s))",
                        (waiting,),
                    ).fetchall()
            except psycopg.Error:
                continue
            if holders and not done.is_set():  # not once the transaction has its lock and has ended
                log.warning(
                    "%s waits for a lock held by %s; a holder frozen while idle in its transaction is ended by "
                    "PostgreSQL after %s s (idle_in_transaction_session_timeout); one busy in a statement can be "
                    "ended with SELECT pg_terminate_backend(pid)",
                    purpose,
                    ", ".join(f"backend pid {pid} ({app}, {state} for {since})" for pid, app, state, since in holders),
                    IDLE_IN_TRANSACTION_TIMEOUT_S,
                )

    thread = threading.Thread(target=watch, name="kafka2pg-lock-wait-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


# What PostgreSQL says when it answers and refuses a connection for good (its English messages:
# a connection error carries no SQLSTATE). Anything else (refused, timed out, starting up, too
# many clients) may pass: a retry may succeed.
# pg_hba.conf's refusals: the client's host (or method) is not admitted, whatever its credentials.
_HBA_REFUSALS = ("no pg_hba.conf entry", "pg_hba.conf rejects connection")
_REFUSALS = (
    *_HBA_REFUSALS,
    "password authentication failed",
    "authentication failed for user",
    "does not exist",  # role "x" / database "x" does not exist
    "permission denied for database",
    "server requested a password but no password was supplied",
    "fe_sendauth: no password supplied",
)


def refuses(message: str) -> bool:
    """Whether libpq's message of a failed connection is PostgreSQL refusing it for good."""
    return any(refusal in message for refusal in _REFUSALS)


def refused_by_hba(message: str) -> bool:
    """Whether libpq's message of a refused connection is pg_hba.conf not admitting the client."""
    return any(refusal in message for refusal in _HBA_REFUSALS)


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else f"{text}."


def _malformed(message: str) -> str:
    """What is wrong with a connection string, in words that never quote it."""
    if "unexpected spaces" in message:
        return "it holds a space: in a URL, write a space in the password as %20"
    if "percent-encoded" in message:
        return "a % is not followed by two hex digits: in a URL, write a % in the password as %25"
    if 'missing "="' in message:
        return "it is neither a postgresql:// URL nor key=value pairs"
    if "invalid URI query parameter" in message or "invalid connection option" in message:
        return "it names a parameter libpq does not know"
    return "libpq cannot parse it"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def pg_words(exc: psycopg.Error) -> str:
    """PostgreSQL's words for a refused statement on one line: its message and SQLSTATE, without
    the statement's text psycopg adds (`LINE 1: ...` and a caret line under it)."""
    primary = exc.diag.message_primary
    if not primary:
        return _one_line(exc)
    return " ".join(primary.split()) + (f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else "")


@contextmanager
def transaction(url: str, *, waits: str | None = None) -> Iterator[psycopg.Connection]:
    """One connection, one transaction: commit on success, roll back on any exception.

    `waits` (what the transaction is for, as an operator reads it: "pipeline=orders undo of
    batch 7") logs every LOCK_WAIT_LOG_S seconds who holds a lock it waits for (`waits_logged`)."""
    conn = connect(url)
    try:
        with _statement_errors(url, conn, "its transaction was rolled back"), conn.transaction():
            with _interruptions_end_the_statement(conn), waits_logged(url, conn, waits) if waits else nullcontext():
                yield conn
    except psycopg.OperationalError as exc:
        if not conn.broken:
            raise
        raise DatabaseUnavailableError(
            f"lost the connection to PostgreSQL at {describe(url)} inside a transaction "
            f"({hide_password(str(exc).strip(), url)}). "
            "It was rolled back (or, if lost during COMMIT, may have committed); every kafka2pg step is "
            "safe to retry and finds out which.",
            database=describe(url),
        ) from exc
    finally:
        conn.close()


@contextmanager
def session(url: str) -> Iterator[psycopg.Connection]:
    """One autocommit connection, for reads that ask Kafka in between (no transaction held open);
    a missing table or privilege is a `SchemaNotReadyError`, as in `transaction`."""
    with _reads(url, connect(url, autocommit=True)) as conn:
        yield conn


@contextmanager
def snapshot(url: str) -> Iterator[psycopg.Connection]:
    """One read-only REPEATABLE READ transaction: every query sees the snapshot the first one
    took; ended at the close. Errors as in `session`."""
    with _reads(url, connect(url)) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        yield conn


@contextmanager
def _reads(url: str, conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """`conn` for reads: its errors as `_statement_errors` says them, an interruption ending its
    statement, closed at the end."""
    try:
        with _statement_errors(url, conn, "nothing was changed"), _interruptions_end_the_statement(conn):
            yield conn
    finally:
        conn.close()


@contextmanager
def _interruptions_end_the_statement(conn: psycopg.Connection) -> Iterator[None]:
    """A task interrupted while PostgreSQL runs its statement (Airflow's execution_timeout raises
    AirflowTaskTimeout, no Exception, wherever the task waits): the statement is cancelled and the
    connection closed, so the transaction ends now. psycopg cancels only for Ctrl-C; otherwise
    the backend would go on waiting in a lock queue, its client gone, until the lock came free
    (it notices a closed socket only when it next writes to it), holding the locks it has."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            if conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
                try:
                    conn.cancel_safe(timeout=5.0)
                except psycopg.Error as failed:  # the connection is closed next anyway
                    log.warning("could not cancel the interrupted statement: %s", failed)
            conn.close()
        raise


# What a statement meets on a database not migrated for it (a table, column or schema missing),
# and, with `NOT_GRANTED`, on one not ready for the role running it.
NOT_MIGRATED = (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn, psycopg.errors.InvalidSchemaName)
NOT_GRANTED = psycopg.errors.InsufficientPrivilege
NOT_READY_ERRORS = (*NOT_MIGRATED, NOT_GRANTED)


@contextmanager
def _statement_errors(url: str, conn: psycopg.Connection, outcome: str) -> Iterator[None]:
    """A table, column or privilege the statements need and `conn` lacks, as a `SchemaNotReadyError`
    saying what to run; a statement_timeout or a pooler as `statement_refusals` says; a server that takes no
    writes (a standby, default_transaction_read_only) as a retryable `DatabaseUnavailableError`
    saying why; `outcome`: what became of the statements' work."""
    try:
        with statement_refusals(url, conn, outcome):
            yield
    except NOT_MIGRATED as exc:
        raise _not_migrated(url, exc, outcome) from exc
    except NOT_GRANTED as exc:
        role = conn.info.user
        raise SchemaNotReadyError(
            f"PostgreSQL at {describe(url)} refused role {role!r} ({pg_words(exc)}); {outcome}. As the role "
            f"owning kafka2pg's tables, run `{COMMAND} grant --role {role}` with the pipelines file (again after "
            "adding a pipeline or applying a migration), then retry.",
            missing=(f"privilege: {exc.diag.message_primary}",),
            database=describe(url),
            role=role,
        ) from exc
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        setting = _read_setting(conn, "default_transaction_read_only")
        if setting is not None and setting[2]:
            why = "it is a standby (in recovery)"
        elif setting is not None and setting[0] == "on":
            why = f"default_transaction_read_only is on, {_SOURCES.get(setting[1], f'from {setting[1]}')}"
        else:
            why = "a read-only transaction"
        raise DatabaseUnavailableError(
            f"PostgreSQL at {describe(url)} accepts no writes from role {conn.info.user!r} ({_one_line(exc)}): {why}; "
            f"{outcome}. kafka2pg writes its ledger and rows there: point the postgres connection (postgres_conn_id, "
            "default kafka2pg_postgres) or KAFKA2PG_DATABASE_URL at the primary, or turn default_transaction_read_only "
            "off for the role. A retry succeeds once it reaches a primary (after a failover).",
            database=describe(url),
            role=conn.info.user,
        ) from exc


# Where a setting in force was set (pg_settings.source).
_SOURCES = {
    "database": "set for the database (ALTER DATABASE … SET)",
    "user": "set for the role (ALTER ROLE … SET)",
    "database user": "set for the role in this database (ALTER ROLE … IN DATABASE … SET)",
    "configuration file": "set for the whole server (postgresql.conf or ALTER SYSTEM)",
    "client": "set by the client's connection options (PGOPTIONS, or options=-c… in the connection string)",
    "session": "set in the session",
}


# What psycopg meets when its connection runs through a pooler that hands each transaction to
# any server connection: a statement it prepared on one server connection, missing on the next
# (or a name another client prepared there first).
_POOLED_AWAY = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)


@contextmanager
def statement_refusals(url: str, conn: psycopg.Connection, outcome: str) -> Iterator[None]:
    """A statement of `conn` cancelled by PostgreSQL's `statement_timeout` as a `StatementTimeoutError`
    saying what the limit is, where it was set and what to change; a statement psycopg prepared,
    gone or taken on the server connection (a pooler in transaction or statement pooling) as a
    `ConfigError` saying to pool sessions; `outcome`: what became of the statements' work. A
    cancel by hand (pg_cancel_backend) or with no limit set stays as it is."""
    try:
        yield
    except _POOLED_AWAY as exc:
        if "_pg3_" not in (exc.diag.message_primary or ""):  # not one of psycopg's own prepared statements
            raise
        raise ConfigError(
            f"the server connection under kafka2pg's connection to {describe(url)} changed between its transactions "
            f"({_one_line(exc)}): most likely a connection pooler that pools transactions or statements; "
            f"{outcome}. kafka2pg keeps session settings and prepared statements on its connections and needs "
            "session pooling: set pool_mode = session for kafka2pg's database or user in the pooler (PgBouncer: in "
            "its [databases] or [users] entry) with a reset between clients (PgBouncer: server_reset_query = "
            "DISCARD ALL), or point the postgres connection (postgres_conn_id, default kafka2pg_postgres) or "
            "KAFKA2PG_DATABASE_URL at PostgreSQL itself.",
            database=describe(url),
        ) from exc
    except psycopg.errors.QueryCanceled as exc:
        by_hand = "user request" in (exc.diag.message_primary or "")  # pg_cancel_backend
        setting = None if by_hand else _read_setting(conn, "statement_timeout")
        if setting is None or setting[0] == "0":  # no limit set: a cancel by hand or by a shutdown
            raise
        value, source, _ = setting
        role, database = conn.info.user, conn.info.dbname
        remedy = (
            "take it out of the connection's options or raise it there"
            if source == "client"
            else f"raise it for kafka2pg's role, e.g. ALTER ROLE {role} IN DATABASE {database} SET "
            "statement_timeout = '30min' (0: no limit; new connections get it)"
        )
        raise StatementTimeoutError(
            f"PostgreSQL cancelled a statement of kafka2pg ({_one_line(exc)}); {outcome}. The session's "
            f"statement_timeout is {value}, {_SOURCES.get(source, f'from {source}')}, and a statement of "
            "kafka2pg takes longer the larger its batch (a promotion writes the whole batch in one statement): "
            f"{remedy}, or lower the pipeline's max_records_per_batch. Retrying as it is will likely be cancelled "
            "again.",
            statement_timeout=value,
            source=source,
            role=role,
        ) from exc


def _read_setting(conn: psycopg.Connection, name: str) -> tuple[str, str, bool] | None:
    """After a statement of `conn` failed: the session's setting `name`, where it was set
    (pg_settings' source) and whether the server is a standby; None when the connection can no
    longer say."""
    if conn.closed or conn.broken:
        return None
    try:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()  # the failed statement's transaction: rolled back by its caller anyway
        return conn.execute(
            "SELECT current_setting(name), source, pg_is_in_recovery() FROM pg_settings WHERE name = %s", (name,)
        ).fetchone()
    except psycopg.Error:
        return None


def _not_migrated(url: str, exc: psycopg.Error, outcome: str) -> SchemaNotReadyError:
    """A table or column kafka2pg's code uses is missing: most likely a migration this version
    ships that the database lacks (code upgraded, `migrate` not run). Names those migrations."""
    pending = _pending_migrations(url)
    if pending:
        found = f"is not ready for this version of kafka2pg: pending migration(s) {', '.join(pending)}"
    else:  # every migration recorded: a pipeline's own tables, most likely (added since `migrate` ran)
        found = "lacks a table or column kafka2pg uses (a pipeline added since `migrate` ran, or one dropped)"
    return SchemaNotReadyError(
        f"PostgreSQL at {describe(url)} {found} "
        f"({pg_words(exc)}); {outcome}. Run `{COMMAND} migrate` with the URL of the role "
        f"that owns kafka2pg's objects (then `{COMMAND} grant --role <runtime role>` unless it is that role), and "
        "retry.",
        missing=tuple(f"migration {m}" for m in pending),
        database=describe(url),
    )


def _pending_migrations(url: str) -> list[str]:
    """The migrations shipped but not recorded in public.kafka2pg_migrations; [] if that cannot
    be read (the error being reported matters more than this detail of it)."""
    shipped = [p.name for p in migration_files()]
    try:
        with connect(url, autocommit=True) as conn:
            applied = {r[0] for r in conn.execute("SELECT name FROM public.kafka2pg_migrations")}
    except psycopg.errors.UndefinedTable:
        return shipped
    except (psycopg.Error, DatabaseUnavailableError):
        return []
    return [m for m in shipped if m not in applied]


@contextmanager
def planner(conn: psycopg.Connection, **settings: str) -> Iterator[None]:
    """Planner settings for one statement of the caller's transaction, restored after it. Turning
    hash and merge joins off (`INDEX_PROBES`) leaves a nested loop over an index; only for joins
    that have one (the setting discourages the other joins by a fixed cost, it does not forbid
    them, and a nested loop without an index can look cheaper than that cost)."""
    previous = {name: conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0] for name in settings}
    for name, value in settings.items():
        conn.execute("SELECT set_config(%s, %s, true)", (name, value))
    yield  # an error aborts the transaction, whose rollback restores them
    for name, value in previous.items():
        conn.execute("SELECT set_config(%s, %s, true)", (name, value))


INDEX_PROBES = {"enable_hashjoin": "off", "enable_mergejoin": "off"}
# For a statement that joins a batch's staging rows with rows derived from them (its duplicates,
# its refused rows, the raw bytes read again for them) by provenance or business key. A batch
# staged since the table's statistics were gathered reads as one row to the planner, whose nested
# loop then visits every staged row of the batch once per row joined: 30,000 duplicates flagged
# took 3.5 minutes. Hash joins read each side once.
NO_NESTED_LOOPS = {"enable_nestloop": "off"}


# SQLSTATEs that mean "this row's data", never "this database": data exceptions (class 22),
# integrity violations (class 23) and program_limit_exceeded (an index row or a row too big).
DATA_ERRORS = (psycopg.errors.DataError, psycopg.errors.IntegrityError, psycopg.errors.ProgramLimitExceeded)


# Refusals past which isolating rows stops: at least this many, and more than half of the rows
# tried so far. A constraint only some records break never gets there; a table no row fits does,
# after a few hundred writes instead of one per row.
REFUSALS_BEFORE_BLAMING_THE_TABLE = 100


def isolate_refused(
    conn: psycopg.Connection, write: Callable[[int, int], None], rows: int, *, table: str | None
) -> dict[int, str]:
    """`write(start, stop)` rows [0, rows) in the caller's transaction, leaving out those PostgreSQL
    refuses on data: a write that fails is rolled back to its savepoint and split in halves down
    to single rows. Returns the refused rows' indexes with the database's reason (`refusal`);
    any other error propagates. k refused rows cost O(k log rows) writes. When most rows are
    refused, `TableRefusesRowsError` (the table named `table` is at fault; None: never)."""

    refused: dict[int, str] = {}
    _bisect(conn, write, 0, rows, refused, table)
    return refused


def _bisect(
    conn: psycopg.Connection,
    write: Callable[[int, int], None],
    start: int,
    stop: int,
    refused: dict[int, str],
    table: str | None,
) -> None:
    if start >= stop:
        return
    try:
        with conn.transaction():
            write(start, stop)
        return
    except DATA_ERRORS as exc:
        if stop - start == 1:
            refused[start] = refusal(exc)
            if table and len(refused) >= REFUSALS_BEFORE_BLAMING_THE_TABLE and 2 * len(refused) > stop:
                raise TableRefusesRowsError(table, len(refused), stop, refused[start]) from exc
            return
    middle = (start + stop) // 2
    _bisect(conn, write, start, middle, refused, table)
    _bisect(conn, write, middle, stop, refused, table)


def refusal(exc: psycopg.Error) -> str:
    """The database's own words for a refused row: SQLSTATE, message, and the column if named."""
    diag = exc.diag
    column = diag.column_name
    context = (diag.context or "").split("\n")[0]
    if not column and ", column " in context:  # COPY names the column only in its context line
        column = context.split(", column ", 1)[1].split(":", 1)[0]
    constraint = f" (constraint {diag.constraint_name})" if diag.constraint_name else ""
    return f"{diag.sqlstate} {diag.message_primary}" + (f" (column {column})" if column else "") + constraint
