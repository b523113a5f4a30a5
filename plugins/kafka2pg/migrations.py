"""Applies the numbered SQL migrations in sql/ and creates each pipeline's tables (`kafka2pg migrate`,
as the role owning them), and checks at run time, without DDL, that a pipeline's are all there.

Idempotent and serialised by an advisory lock, so concurrent runs cannot interleave DDL.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import Connection, sql

from kafka2pg.config import DEFAULT_POSTGRES_CONN_ID, Pipeline, Settings
from kafka2pg.database import connect, describe, migration_files, pg_words, transaction
from kafka2pg.exceptions import ConfigError, ObjectNameTakenError, SchemaNotReadyError
from kafka2pg.lifecycle import OPEN
from kafka2pg.locations import COMMAND, SQL_DIR

log = logging.getLogger(__name__)


def as_the_owner(pipelines: Sequence[Pipeline]) -> str:
    """How `migrate` and `grant` for `pipelines` run as the owner: their postgres connection wins
    over the variable."""
    ids = sorted({p.postgres_conn_id for p in pipelines}) or [DEFAULT_POSTGRES_CONN_ID]
    named = " or ".join(f"{conn_id!r} (e.g. {_env_assignment(conn_id)})" for conn_id in ids)
    return (
        f"give this command the owning role's postgres connection as {named} for this command alone, or "
        "KAFKA2PG_DATABASE_URL where no such connection is defined (a defined connection wins over it; a "
        "connection a custom secrets backend defines wins over the environment's: run the command where that "
        "backend is not configured)"
    )


def _env_assignment(conn_id: str) -> str:
    """How a shell gives a command Airflow's variable for `conn_id` (its id upper-cased, as
    Airflow looks it up; through `env` when the name is no shell variable's)."""
    name = f"AIRFLOW_CONN_{conn_id.upper()}"
    return name if re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) else f"env '{name}=…'"


_LOCK_KEY = 0x6B3270  # "k2p": one advisory lock for all kafka2pg DDL
MIGRATIONS_TABLE = ("public", "kafka2pg_migrations")

# Columns kafka2pg writes besides the pipeline's own (sql/templates/target_table.sql, staging_table.sql).
PROVENANCE = ("kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp")
RAW = ("raw_key", "raw_value", "raw_headers")
# The runtime role's privileges on a pipeline's tables (`kafka2pg grant`): promotion inserts into the
# target; replays, undo and `reset --archive-old-rows` delete from it; nothing updates it. Staging is
# written by COPY (INSERT), flagged by the quality gate (UPDATE) and cleared by batch (DELETE).
TARGET_PRIVILEGES = ("SELECT", "INSERT", "DELETE")
STAGING_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")
# The quarantine, shared by the pipelines (sql/grants.sql): promotion inserts, replays and undo
# delete, and the raw bytes of rows refused at promotion are filled in afterwards (UPDATE of
# those columns only).
QUARANTINE_TABLE = ("kafka2pg", "quarantine")
QUARANTINE_PRIVILEGES = ("SELECT", "INSERT", "DELETE", f"UPDATE ({', '.join(RAW)})")


def target_columns(pipeline: Pipeline) -> list[str]:
    """The target's columns promotion writes."""
    return [*(c.name for c in pipeline.columns), *PROVENANCE, "batch_id"]


def staging_columns(pipeline: Pipeline) -> list[str]:
    """The staging table's columns a chunk writes, after (batch_id, chunk), in COPY order."""
    return [*PROVENANCE, *(c.name for c in pipeline.columns), *RAW, "quarantine_reason"]


def migrate(database_url: str, pipelines: list[Pipeline]) -> list[str]:
    """Apply pending migrations and create missing pipeline tables; return what was applied."""
    applied: list[str] = []
    with transaction(database_url) as conn:
        try:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS public.kafka2pg_migrations ("
                " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r[0] for r in conn.execute("SELECT name FROM public.kafka2pg_migrations")}
            for path in migration_files():
                if path.name in done:
                    continue
                conn.execute(path.read_text())
                conn.execute("INSERT INTO public.kafka2pg_migrations (name) VALUES (%s)", (path.name,))
                applied.append(path.name)
                log.info("applied migration %s", path.name)
            for pipeline in pipelines:
                _create_pipeline_tables(conn, pipeline)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ConfigError(
                f"`{COMMAND} migrate` as role {conn.info.user!r} at {describe(database_url)}: {pg_words(exc)}; "
                "nothing was changed. Migrations create schemas, tables and indexes: run them as the role that "
                f"owns kafka2pg's objects, not the runtime role: {as_the_owner(pipelines)}."
            ) from exc
    return applied


@dataclass(frozen=True)
class TableFound:
    """What the catalog shows the connected role of one table a pipeline needs."""

    schema: str
    name: str
    relkind: str | None  # None: no such relation
    schema_usage: bool
    columns: frozenset[str]
    privileges: frozenset[str]  # of SELECT, INSERT, UPDATE, DELETE (on the whole table)
    types: tuple[tuple[str, str], ...] = ()  # (column, type as format_type shows it)
    updatable: frozenset[str] = frozenset()  # columns the role may UPDATE (by a grant on them or the table)

    def holds(self, privilege: str) -> bool:
        """Whether the role holds `privilege`: "INSERT" on the table, or "UPDATE (a, b)" on those columns."""
        name, _, columns = privilege.partition(" (")
        if not columns:
            return privilege in self.privileges
        return name in self.privileges or (name == "UPDATE" and set(columns.rstrip(")").split(", ")) <= self.updatable)


@dataclass(frozen=True)
class Readiness:
    """What a pipeline's run lacks in the database: each field lists one kind of missing thing."""

    pending: tuple[str, ...] = ()  # migration files not recorded in public.kafka2pg_migrations
    tables: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    privileges: tuple[str, ...] = ()
    retyped: tuple[str, ...] = ()  # staging columns whose type is no longer the declared one

    @property
    def missing(self) -> tuple[str, ...]:
        return (
            *(f"migration {m}" for m in self.pending),
            *(f"table {t}" for t in self.tables),
            *(f"column {c}" for c in self.columns),
            *self.privileges,
            *(f"staging {r}" for r in self.retyped),
        )


def _needs(pipeline: Pipeline) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(schema, table, columns, privileges) of each table a pipeline's run reads or writes itself."""
    return [
        (*MIGRATIONS_TABLE, ("name",), ("SELECT",)),
        (pipeline.target_schema, pipeline.target_table, tuple(target_columns(pipeline)), TARGET_PRIVILEGES),
        ("kafka2pg", pipeline.staging_table, ("batch_id", "chunk", *staging_columns(pipeline)), STAGING_PRIVILEGES),
        (*QUARANTINE_TABLE, RAW, QUARANTINE_PRIVILEGES),
    ]


def readiness(
    pipeline: Pipeline, found: dict[tuple[str, str], TableFound], applied: set[str] | None, migrations: list[str]
) -> Readiness:
    """What is missing, from the catalog's answer (`found`) and the recorded migrations (`applied`;
    None: the role cannot read them, which `found` then shows as a missing privilege)."""
    never_migrated = found[MIGRATIONS_TABLE].relkind is None
    pending = migrations if never_migrated else [m for m in migrations if applied is not None and m not in applied]
    tables, columns, privileges = [], [], []
    for schema, name, needed_columns, needed_privileges in _needs(pipeline):
        table = found[(schema, name)]
        qualified = f"{schema}.{name}"
        if table.relkind is None:
            if (schema, name) != MIGRATIONS_TABLE and not (never_migrated and (schema, name) == QUARANTINE_TABLE):
                tables.append(qualified)  # (a database never migrated: reported as every migration pending)
            continue
        if table.relkind not in ("r", "p"):
            tables.append(f"{qualified} (it is {_RELKINDS.get(table.relkind, 'another object')}, not a table)")
            continue
        if not (pending and (schema, name) == QUARANTINE_TABLE):  # a pending migration may add them
            columns += [f"{qualified}.{c}" for c in needed_columns if c not in table.columns]
        if not table.schema_usage:
            privileges.append(f"USAGE on schema {schema}")
        privileges += [f"{p} on {qualified}" for p in needed_privileges if not table.holds(p)]
    staging = found.get(("kafka2pg", pipeline.staging_table))
    retyped = retyped_columns(pipeline, dict(staging.types)) if staging is not None else []
    return Readiness(tuple(pending), tuple(tables), tuple(columns), tuple(dict.fromkeys(privileges)), tuple(retyped))


def require_ready(settings: Settings, pipeline: Pipeline) -> None:
    """Check, without DDL, that every migration is applied and the pipeline's target and staging
    tables and the quarantine are there with their columns and the connected role's privileges;
    two catalog queries.

    `SchemaNotReadyError` (terminal) names what is missing and who runs what: `kafka2pg migrate`
    (tables, migrations) or `kafka2pg grant` (privileges) as the owning role. Nothing is changed.
    """
    with connect(settings.database_url, autocommit=True) as conn:
        missing = readiness_error(settings, pipeline, conn, _RUN_STOPS)
    if missing is not None:
        raise missing


# What a run that finds the database not ready does.
_RUN_STOPS = " Nothing was changed and the run stops here (no retry)."


def readiness_error(
    settings: Settings, pipeline: Pipeline, conn: Connection, outcome: str = ""
) -> SchemaNotReadyError | None:
    """`require_ready`'s check over `conn` (autocommit, of the role to check): the error it would
    raise, its message ending with `outcome` before what to run, or None when ready."""
    needs = _needs(pipeline)
    rows = conn.execute(
        "SELECT current_user, r.schema, r.name, c.relkind::text,"
        " coalesce(has_schema_privilege(n.oid, 'USAGE'), false),"
        " array(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0"
        "       AND NOT a.attisdropped),"
        " array(SELECT p FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) p"
        "       WHERE has_table_privilege(c.oid, p)),"
        " array(SELECT ARRAY[a.attname::text, format_type(a.atttypid, a.atttypmod)] FROM pg_attribute a"
        "       WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),"
        " array(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0"
        "       AND NOT a.attisdropped AND has_column_privilege(c.oid, a.attnum, 'UPDATE'))"
        " FROM unnest(%s::text[], %s::text[]) r(schema, name)"
        " LEFT JOIN pg_namespace n ON n.nspname = r.schema"
        " LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = r.name",
        ([n[0] for n in needs], [n[1] for n in needs]),
    ).fetchall()
    role = rows[0][0]
    found = {
        (schema, name): TableFound(
            schema,
            name,
            kind,
            usage,
            frozenset(columns),
            frozenset(privileges),
            tuple(map(tuple, types)),
            frozenset(updatable),
        )
        for _, schema, name, kind, usage, columns, privileges, types, updatable in rows
    }
    ledger = found[MIGRATIONS_TABLE]
    applied = None
    if ledger.relkind is not None and ledger.schema_usage and "SELECT" in ledger.privileges:
        applied = {r[0] for r in conn.execute("SELECT name FROM public.kafka2pg_migrations")}
    ready = readiness(pipeline, found, applied, [p.name for p in migration_files()])
    if not ready.missing:
        return None
    return SchemaNotReadyError(
        _not_ready_message(settings, pipeline, role, ready, outcome),
        missing=ready.missing,
        pipeline=pipeline.name,
        role=role,
    )


def _not_ready_message(settings: Settings, pipeline: Pipeline, role: str, ready: Readiness, outcome: str) -> str:
    found = []
    if ready.pending:
        found.append(f"pending migration(s) {', '.join(ready.pending)}")
    if ready.tables:
        found.append(f"missing table(s) {', '.join(ready.tables)}")
    if ready.columns:
        found.append(f"missing column(s) {', '.join(ready.columns)}")
    if ready.privileges:
        found.append(f"role {role!r} lacks {', '.join(ready.privileges)}")
    if ready.retyped:
        found.append(f"the staging table's {'; '.join(ready.retyped)}")
    todo = []
    pipelines = f"KAFKA2PG_PIPELINES={settings.pipelines_file}"
    if ready.pending or ready.tables:
        todo.append(
            f"run `{COMMAND} migrate` ({pipelines}) with the URL of the role that owns kafka2pg's objects, "
            f"then, unless {role!r} is that role, `{COMMAND} grant --role {role}`"
        )
    if ready.columns:
        todo.append(
            f"`{COMMAND} migrate` creates missing tables but does not change existing ones: add the columns "
            "(ALTER TABLE ... ADD COLUMN, as the owner) or correct the pipeline's columns in the pipelines file"
        )
    if ready.retyped:
        todo.append(
            f"the pipelines file changed column types since `{COMMAND} migrate`: run it again ({pipelines}) as the "
            "owning role (it makes the staging table again once no batch is staged, and says which target columns "
            f"to change), then `{COMMAND} grant --role {role}` unless {role!r} is that role"
        )
    if ready.privileges and not (ready.pending or ready.tables):
        todo.append(
            f"run `{COMMAND} grant --role {role}` ({pipelines}) as the owning role; it is needed again after "
            "adding a pipeline or upgrading kafka2pg"
        )
    return (
        f"PostgreSQL at {describe(settings.database_url)} is not ready for pipeline {pipeline.name!r}: "
        f"{'; '.join(found)}.{outcome} To fix: {'; '.join(todo)}."
    )


def _template(name: str) -> sql.SQL:
    return sql.SQL((SQL_DIR / "templates" / name).read_text())


def _column_list(pipeline: Pipeline, *, not_null: bool) -> sql.Composed:
    return sql.SQL(",\n    ").join(
        sql.SQL("{} {}{}").format(
            sql.Identifier(c.name),
            sql.SQL(c.type),  # validated against a fixed list of type patterns in config
            sql.SQL(" NOT NULL" if not_null and c.required else ""),
        )
        for c in pipeline.columns
    )


def _create_pipeline_tables(conn: Connection, pipeline: Pipeline) -> None:
    target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(pipeline.target_schema)))
    conn.execute(_template("target_table.sql").format(table=target, columns=_column_list(pipeline, not_null=True)))
    _require_table(conn, pipeline, (pipeline.target_schema, pipeline.target_table), "target table", "target_table")
    if pipeline.business_key:
        _ensure_index(
            conn,
            pipeline,
            (pipeline.target_schema, pipeline.target_table),
            pipeline.business_key_index,
            "target_business_key.sql",
            pipeline.business_key,
            unique=True,
        )
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    conn.execute(_template("staging_table.sql").format(table=staging, columns=_column_list(pipeline, not_null=False)))
    _require_table(conn, pipeline, ("kafka2pg", pipeline.staging_table), "staging table", "name")
    _rebuild_staging_if_retyped(conn, pipeline, staging)
    changed = retyped_columns(pipeline, column_types(conn, pipeline.target_schema, pipeline.target_table))
    if changed:
        log.warning(
            "pipeline=%s %s.%s: %s; migrate changes no existing target column: ALTER TABLE ... ALTER COLUMN ... "
            "TYPE ... as its owner, or declare the column's type as it is, or the promotion casts or fails",
            pipeline.name,
            pipeline.target_schema,
            pipeline.target_table,
            "; ".join(changed),
        )
    _ensure_index(
        conn,
        pipeline,
        ("kafka2pg", pipeline.staging_table),
        pipeline.staging_index,
        "staging_batch_index.sql",
        ("batch_id", "chunk"),
    )


def catalog_type(declared: str) -> str:
    """A declared column type as PostgreSQL's `format_type` shows it."""
    return {"timestamptz": "timestamp with time zone"}.get(declared, declared)


def column_types(conn: Connection, schema: str, table: str) -> dict[str, str]:
    """{column: type as `format_type` shows it} of a table (empty if there is none)."""
    rows = conn.execute(
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a"
        " WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
        (sql.Identifier(schema, table).as_string(conn),),
    ).fetchall()
    return dict(rows)


def retyped_columns(pipeline: Pipeline, types: dict[str, str]) -> list[str]:
    """The pipeline's columns whose type in `types` (a table's) is not the declared one, in words."""
    return [
        f"column {c.name} is {types[c.name]}, the pipeline declares {c.type}"
        for c in pipeline.columns
        if c.name in types and types[c.name] != catalog_type(c.type)
    ]


def _rebuild_staging_if_retyped(conn: Connection, pipeline: Pipeline, staging: sql.Identifier) -> None:
    """The staging table is kafka2pg's own: when the pipelines file changed a column's type, it is
    made again with the declared types, unless it holds a batch's rows (finish or undo it first)."""
    changed = retyped_columns(pipeline, column_types(conn, "kafka2pg", pipeline.staging_table))
    if not changed:
        return
    conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(staging))  # no chunk writes meanwhile
    held = conn.execute(
        sql.SQL(
            "SELECT DISTINCT s.batch_id, b.state FROM {} s JOIN kafka2pg.batches b USING (batch_id)"
            " WHERE b.state = ANY(%s) ORDER BY 1 LIMIT 5"
        ).format(staging),
        ([str(state) for state in OPEN],),
    ).fetchall()
    if held:  # rows of rejected or abandoned batches are only kept to look at: they go with the table
        raise ConfigError(
            f"pipeline {pipeline.name!r}: the pipelines file changed column types ({'; '.join(changed)}) while "
            f"kafka2pg.{pipeline.staging_table} holds the rows of open batch(es) "
            f"{', '.join(f'{b} ({state})' for b, state in held)}: finish them with the old types first (trigger "
            f"a run with the old pipelines file; a replay batch its run will not finish: `{COMMAND} abandon`), "
            f"then run `{COMMAND} migrate` again. Nothing was changed."
        )
    conn.execute(sql.SQL("DROP TABLE {}").format(staging))  # its index and grants with it
    conn.execute(_template("staging_table.sql").format(table=staging, columns=_column_list(pipeline, not_null=False)))
    log.warning(
        "pipeline=%s staging table made again with the declared types (%s); a runtime role needs "
        f"`{COMMAND} grant` again",
        pipeline.name,
        "; ".join(changed),
    )


def table_indexes(conn: Connection, table: sql.Identifier) -> list[tuple[bool, list[str | None]]]:
    """The table's valid indexes: whether each is a plain unique index (checked at each insert,
    no expression, predicate or included column), and its columns in order (None: an expression)."""
    return conn.execute(
        "SELECT i.indisunique AND i.indimmediate AND i.indpred IS NULL AND i.indexprs IS NULL"
        "       AND i.indnatts = i.indnkeyatts,"
        " array(SELECT a.attname::text FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, n)"
        "       LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum ORDER BY k.n)"
        " FROM pg_index i WHERE i.indrelid = to_regclass(%s) AND i.indisvalid",
        (table.as_string(conn),),
    ).fetchall()


def has_index(conn: Connection, table: sql.Identifier, columns: tuple[str, ...], *, unique: bool = False) -> bool:
    """Whether the table has an index on `columns`: for `unique`, a plain unique index on the same
    columns in any order (what the quality gate relies on); otherwise any index on them in order."""
    for plain_unique, indexed in table_indexes(conn, table):
        if unique and plain_unique and sorted(indexed) == sorted(columns):
            return True
        if not unique and indexed == list(columns):
            return True
    return False


def _ensure_index(
    conn: Connection,
    pipeline: Pipeline,
    schema_table: tuple[str, str],
    name: str,
    template: str,
    columns: tuple[str, ...],
    *,
    unique: bool = False,
) -> None:
    """Create the index `name` (in the table's schema) unless the table has one on these columns
    already, whatever its name: a database migrated by an earlier version keeps its index."""
    table = sql.Identifier(*schema_table)
    if has_index(conn, table, columns, unique=unique):
        return
    index = sql.Identifier(schema_table[0], name)
    conn.execute(
        _template(template).format(
            index=sql.Identifier(name), table=table, columns=sql.SQL(", ").join(map(sql.Identifier, columns))
        )
    )
    if has_index(conn, table, columns, unique=unique):
        return
    # CREATE INDEX IF NOT EXISTS skipped it: the name is taken.
    holder = conn.execute(
        "SELECT c.relkind, i.indrelid = to_regclass(%s) FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid"
        " WHERE c.oid = to_regclass(%s)",
        (table.as_string(conn), index.as_string(conn)),
    ).fetchone()
    if holder is not None and holder[1]:
        # The table's own index on other columns, e.g. of an earlier business_key (README, Known limits).
        log.warning(
            "pipeline=%s %s already has an index %s on other columns than %s (an earlier business_key?): "
            f"kafka2pg does not replace it; drop it and run `{COMMAND} migrate` to index %s",
            pipeline.name,
            ".".join(schema_table),
            name,
            ", ".join(columns),
            ", ".join(columns),
        )
        return
    taken_by = _RELKINDS.get(holder[0] if holder else "", "another object")
    raise ObjectNameTakenError(
        f"pipeline {pipeline.name!r}: cannot create index {schema_table[0]}.{name} on {'.'.join(schema_table)}: "
        f"that name is taken by {taken_by}. Rename or drop "
        f"that one (or change the pipeline's target_table), then run `{COMMAND} migrate` again.",
        pipeline=pipeline.name,
        relation=f"{schema_table[0]}.{name}",
        taken_by=taken_by,
    )


_RELKINDS = {"r": "a table", "p": "a table", "i": "an index", "I": "an index", "S": "a sequence", "v": "a view"}


def _require_table(conn: Connection, pipeline: Pipeline, schema_table: tuple[str, str], what: str, field: str) -> None:
    """CREATE TABLE IF NOT EXISTS skips silently when any relation (an index, a view) has the name."""
    relkind = conn.execute(
        "SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", (sql.Identifier(*schema_table).as_string(conn),)
    ).fetchone()[0]
    if relkind in ("r", "p"):
        return
    taken_by = _RELKINDS.get(relkind, "another object")
    raise ObjectNameTakenError(
        f"pipeline {pipeline.name!r}: its {what} {'.'.join(schema_table)} is {taken_by}"
        f", not a table. Change the pipeline's {field} in the pipelines file (or rename that relation), then run "
        f"`{COMMAND} migrate` again.",
        pipeline=pipeline.name,
        relation=".".join(schema_table),
        taken_by=taken_by,
        field=field,
    )
