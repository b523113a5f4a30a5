"""Applies the numbered SQL migrations in sql/ and creates each pipeline's tables.

Idempotent and serialised by an advisory lock, so concurrent runs cannot interleave DDL.
"""

from __future__ import annotations

import logging
from pathlib import Path

from psycopg import sql

from kafka2pg.config import PROJECT_ROOT, Pipeline
from kafka2pg.database import transaction

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


def _create_pipeline_tables(conn, pipeline: Pipeline) -> None:
    target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(pipeline.target_schema)))
    conn.execute(_template("target_table.sql").format(table=target, columns=_column_list(pipeline, not_null=True)))
    if pipeline.business_key:
        conn.execute(
            _template("target_business_key.sql").format(
                index=sql.Identifier(f"{pipeline.target_table}_business_key"[:63]),
                table=target,
                columns=sql.SQL(", ").join(map(sql.Identifier, pipeline.business_key)),
            )
        )
    conn.execute(
        _template("staging_table.sql").format(
            table=sql.Identifier("kafka2pg", pipeline.staging_table),
            index=sql.Identifier(f"{pipeline.staging_table}_batch"[:63]),
            columns=_column_list(pipeline, not_null=False),
        )
    )
