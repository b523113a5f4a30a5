"""Applies the numbered SQL migrations in sql/ and creates each pipeline's tables.

Idempotent and serialised by an advisory lock, so concurrent runs cannot interleave DDL.
"""

from __future__ import annotations

import logging
from pathlib import Path

from psycopg import Connection, sql

from kafka2pg.config import PROJECT_ROOT, Pipeline
from kafka2pg.database import transaction
from kafka2pg.exceptions import ObjectNameTakenError

log = logging.getLogger(__name__)

SQL_DIR = PROJECT_ROOT / "sql"
_LOCK_KEY = 0x6B3270  # "k2p": one advisory lock for all kafka2pg DDL


def migration_files() -> list[Path]:
    return sorted(SQL_DIR.glob("[0-9][0-9][0-9][0-9]_*.sql"))


def migrate(database_url: str, pipelines: list[Pipeline]) -> list[str]:
    """Apply pending migrations and create missing pipeline tables; return what was applied."""
    applied: list[str] = []
    with transaction(database_url) as conn:
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
    return applied


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
    _ensure_index(
        conn,
        pipeline,
        ("kafka2pg", pipeline.staging_table),
        pipeline.staging_index,
        "staging_batch_index.sql",
        ("batch_id", "chunk"),
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
            "kafka2pg does not replace it; drop it and run `./kafka2pg migrate` to index %s",
            pipeline.name,
            ".".join(schema_table),
            name,
            ", ".join(columns),
            ", ".join(columns),
        )
        return
    raise ObjectNameTakenError(
        f"pipeline {pipeline.name!r}: cannot create index {schema_table[0]}.{name} on {'.'.join(schema_table)}: "
        f"that name is taken by {_RELKINDS.get(holder[0] if holder else '', 'another object')}. Rename or drop "
        "that one (or change the pipeline's target_table), then run `./kafka2pg migrate` again."
    )


_RELKINDS = {"r": "a table", "p": "a table", "i": "an index", "I": "an index", "S": "a sequence", "v": "a view"}


def _require_table(conn: Connection, pipeline: Pipeline, schema_table: tuple[str, str], what: str, field: str) -> None:
    """CREATE TABLE IF NOT EXISTS skips silently when any relation (an index, a view) has the name."""
    relkind = conn.execute(
        "SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", (sql.Identifier(*schema_table).as_string(conn),)
    ).fetchone()[0]
    if relkind in ("r", "p"):
        return
    raise ObjectNameTakenError(
        f"pipeline {pipeline.name!r}: its {what} {'.'.join(schema_table)} is {_RELKINDS.get(relkind, 'another object')}"
        f", not a table. Change the pipeline's {field} in the pipelines file (or rename that relation), then run "
        "`./kafka2pg migrate` again."
    )
