"""The runtime role's privileges: sql/grants.sql for kafka2pg's own objects plus each pipeline's
target and staging tables; `kafka2pg grant` prints them or applies them as the objects' owner.
"""

from __future__ import annotations

import shlex

import psycopg
from psycopg import Connection, sql

from kafka2pg.config import Pipeline
from kafka2pg.database import connect, describe, pg_words, transaction
from kafka2pg.exceptions import ConfigError
from kafka2pg.locations import COMMAND, SQL_DIR
from kafka2pg.migrations import STAGING_PRIVILEGES, TARGET_PRIVILEGES, as_the_owner

GRANTS_FILE = SQL_DIR / "grants.sql"


def grant_script(conn: Connection, pipelines: list[Pipeline], role: str) -> sql.Composed:
    """sql/grants.sql and one templates/pipeline_grants.sql per pipeline, for `role` on this database."""
    grantee = sql.Identifier(role)
    database = conn.execute("SELECT current_database()").fetchone()[0]
    parts = [sql.SQL(GRANTS_FILE.read_text()).format(database=sql.Identifier(database), role=grantee)]
    template = sql.SQL((SQL_DIR / "templates" / "pipeline_grants.sql").read_text())
    for pipeline in pipelines:
        parts.append(
            template.format(
                schema=sql.Identifier(pipeline.target_schema),
                target=sql.Identifier(pipeline.target_schema, pipeline.target_table),
                staging=sql.Identifier("kafka2pg", pipeline.staging_table),
                target_privileges=sql.SQL(", ").join(map(sql.SQL, TARGET_PRIVILEGES)),
                staging_privileges=sql.SQL(", ").join(map(sql.SQL, STAGING_PRIVILEGES)),
                role=grantee,
            )
        )
    return sql.SQL("\n").join(parts)


def print_grants(database_url: str, pipelines: list[Pipeline], role: str) -> str:
    """The GRANT script `apply_grants` would run, as text; changes nothing."""
    with connect(database_url) as conn:
        return grant_script(conn, pipelines, role).as_string(conn)


def apply_grants(database_url: str, pipelines: list[Pipeline], role: str) -> None:
    """Grant `role` what kafka2pg's run-time steps need, in one transaction, as the connected role
    (which must own the objects: PostgreSQL grants only what the grantor may pass on)."""
    refused: list[str] = []
    with transaction(database_url) as conn:
        owner = conn.info.user
        if role == owner:
            # The ledger's owner: the role that ran the migrations (the schema may be a DBA's).
            found = conn.execute(
                "SELECT pg_get_userbyid(c.relowner) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = 'kafka2pg' AND c.relname = 'batches'"
            )
            ledger_owner = (found.fetchone() or (None,))[0]
            if ledger_owner is None:
                why = f"Run `{COMMAND} migrate` first, as the role that is to own kafka2pg's objects."
            elif ledger_owner == role:
                why = "It owns kafka2pg's objects and needs no grant."
            else:
                why = f"kafka2pg's objects are owned by role {ledger_owner!r}, which grants: {as_the_owner(pipelines)}."
            raise ConfigError(
                f"`{COMMAND} grant --role {role}`: that is the role this command connects as. {why} Give --role the "
                "runtime role, a separate LOGIN role the Airflow tasks and the Spark job connect as."
            )
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
            raise ConfigError(
                f"role {role!r} does not exist in PostgreSQL at {describe(database_url)}: create it first "
                f"(CREATE ROLE {sql.Identifier(role).as_string(conn)} LOGIN PASSWORD ...), then run "
                f"`{COMMAND} grant --role {shlex.quote(role)}` again."
            )
        # GRANT warns instead of failing when the grantor may pass on only part of a privilege.
        conn.add_notice_handler(lambda notice: _keep_warning(notice, refused))
        try:
            conn.execute(grant_script(conn, pipelines, role))
        except psycopg.errors.InsufficientPrivilege as exc:
            refused.append(pg_words(exc))
        if refused:
            raise ConfigError(
                f"`{COMMAND} grant` as role {owner!r} at {describe(database_url)} could not grant everything: "
                f"{'; '.join(refused)}. Nothing was granted. Run it as the role that owns kafka2pg's objects (the "
                f"one that ran `{COMMAND} migrate`): {as_the_owner(pipelines)}."
            )


def _keep_warning(notice: psycopg.errors.Diagnostic, refused: list[str]) -> None:
    if notice.severity_nonlocalized == "WARNING":
        refused.append(notice.message_primary or "")
