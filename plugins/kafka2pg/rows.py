"""The rows-moving primitives: staged rows into the target and quarantine, staging cleanup,
and the SQL predicate of offset ranges. They change rows only; the caller owns the
transaction, the locks and the batch's state."""

from __future__ import annotations

import logging

import psycopg
from psycopg import Connection, sql

from kafka2pg.config import Pipeline
from kafka2pg.database import DATA_ERRORS, isolate_refused
from kafka2pg.exceptions import KeyCollisionError
from kafka2pg.migrations import target_columns
from kafka2pg.planner import OffsetRange

log = logging.getLogger(__name__)

PROMOTION_REFUSED = "PostgreSQL refused the row at promotion: "  # the reason's start, then PostgreSQL's


def staged_counts(conn: Connection, pipeline: Pipeline, batch_id: int) -> dict[int, int]:
    """Rows per Kafka partition in the pipeline's staging table for one batch."""
    query = sql.SQL("SELECT kafka_partition, count(*) FROM {} WHERE batch_id = %s GROUP BY 1").format(
        sql.Identifier("kafka2pg", pipeline.staging_table)
    )
    return dict(conn.execute(query, (batch_id,)).fetchall())


def clear_staging(conn: Connection, pipeline: Pipeline, batch_id: int) -> None:
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE batch_id = %s").format(sql.Identifier("kafka2pg", pipeline.staging_table)),
        (batch_id,),
    )


def insert_target(conn: Connection, pipeline: Pipeline, batch_id: int) -> int:
    """Insert the batch's accepted staging rows into the target; rows the target refuses on data
    (a CHECK or a type the admission rules do not know of) are flagged to quarantine instead,
    with the database's reason, and the rest land. A unique violation on the business key or
    the provenance key raises `KeyCollisionError` (the quality gate has to judge it)."""
    accepted = sql.SQL("batch_id = %s AND quarantine_reason IS NULL")
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    collisions = _collision_indexes(conn, pipeline)
    try:
        with conn.transaction():  # a savepoint: a refused row leaves the promotion's transaction usable
            return _insert(conn, pipeline, batch_id, collisions, staging, accepted, (batch_id,))
    except DATA_ERRORS:
        return _insert_isolating(conn, pipeline, batch_id, collisions)


def _insert(
    conn: Connection,
    pipeline: Pipeline,
    batch_id: int,
    collisions: set[str],
    source: sql.Composable,
    where: sql.Composable,
    params: tuple,
) -> int:
    columns = [sql.Identifier(n) for n in target_columns(pipeline)]
    query = sql.SQL("INSERT INTO {target} ({cols}) SELECT {cols} FROM {source} WHERE {where}").format(
        target=sql.Identifier(pipeline.target_schema, pipeline.target_table),
        cols=sql.SQL(", ").join(columns),
        source=source,
        where=where,
    )
    try:
        return conn.execute(query, params).rowcount
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name not in collisions:
            raise  # a unique index of the user's own: the row's data, isolated like any other
        raise KeyCollisionError(pipeline.name, batch_id, exc.diag.constraint_name, exc.diag.message_detail) from exc


def _collision_indexes(conn: Connection, pipeline: Pipeline) -> set[str]:
    """Names of the target's primary key and of its unique indexes on exactly the business key."""
    rows = conn.execute(
        "SELECT c.relname, i.indisprimary, array(SELECT a.attname::text FROM unnest(i.indkey::int2[]) k(attnum)"
        " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum)"
        " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(%s)",
        (sql.Identifier(pipeline.target_schema, pipeline.target_table).as_string(conn),),
    ).fetchall()
    return {name for name, primary, columns in rows if primary or sorted(columns) == sorted(pipeline.business_key)}


_ISOLATING = sql.Identifier("pg_temp", "kafka2pg_isolating")


def _insert_isolating(conn: Connection, pipeline: Pipeline, batch_id: int, collisions: set[str]) -> int:
    """Insert the accepted rows range by range (bisecting them in (partition, offset) order,
    numbered in a temporary table so each range is an index lookup) and flag each row the
    target refuses to quarantine with the database's reason; returns the rows inserted."""
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_ISOLATING))
    conn.execute(
        sql.SQL(
            "CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT row_number() OVER (ORDER BY kafka_partition,"
            " kafka_offset) - 1 AS n, s.* FROM {} s WHERE batch_id = %s AND quarantine_reason IS NULL"
        ).format(_ISOLATING, staging),
        (batch_id,),
    )
    conn.execute(sql.SQL("CREATE INDEX ON {} (n)").format(_ISOLATING))
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(_ISOLATING)).fetchone()[0]
    in_range = sql.SQL("n >= %s AND n < %s")

    def write(start: int, stop: int) -> None:
        _insert(conn, pipeline, batch_id, collisions, _ISOLATING, in_range, (start, stop))

    table = f"{pipeline.target_schema}.{pipeline.target_table}"
    refused = isolate_refused(conn, write, rows, table=table)
    conn.execute(
        sql.SQL(
            "UPDATE {staging} s SET quarantine_reason = r.reason FROM {isolating} i"
            " JOIN unnest(%s::bigint[], %s::text[]) r(n, reason) USING (n)"
            " WHERE s.batch_id = %s AND s.kafka_partition = i.kafka_partition AND s.kafka_offset = i.kafka_offset"
        ).format(staging=staging, isolating=_ISOLATING),
        (
            list(refused),
            [PROMOTION_REFUSED + m for m in refused.values()],
            batch_id,
        ),
    )
    log.warning(
        "pipeline=%s batch_id=%s %s refused %s of %s row(s) on data; flagged to quarantine",
        pipeline.name,
        batch_id,
        table,
        len(refused),
        rows,
    )
    return rows - len(refused)


def insert_quarantine(conn: Connection, pipeline: Pipeline, batch_id: int) -> int:
    record = sql.SQL("jsonb_build_object({})").format(
        sql.SQL(", ").join(
            sql.SQL("{}, s.{}").format(sql.Literal(c.name), sql.Identifier(c.name)) for c in pipeline.columns
        )
    )
    query = sql.SQL(
        "INSERT INTO kafka2pg.quarantine (pipeline, batch_id, kafka_topic, kafka_partition, kafka_offset,"
        " kafka_timestamp, reason, raw_key, raw_value, raw_headers, record)"
        " SELECT %s, s.batch_id, s.kafka_topic, s.kafka_partition, s.kafka_offset, s.kafka_timestamp,"
        " s.quarantine_reason, s.raw_key, s.raw_value, s.raw_headers, {record} FROM {staging} s"
        " WHERE s.batch_id = %s AND s.quarantine_reason IS NOT NULL"
    ).format(record=record, staging=sql.Identifier("kafka2pg", pipeline.staging_table))
    return conn.execute(query, (pipeline.name, batch_id)).rowcount


def range_predicate(ranges: tuple[OffsetRange, ...], floors: dict[int, int], alias: str = "") -> sql.Composable:
    """SQL: a row's provenance lies in one of the ranges, in the partition's current generation."""
    prefix = f"{alias}." if alias else ""
    parts = [
        sql.SQL(
            "({p}kafka_partition = {partition} AND {p}kafka_offset >= {start} AND {p}kafka_offset < {end}"
            " AND {p}batch_id > {floor})"
        ).format(
            p=sql.SQL(prefix),
            partition=sql.Literal(r.partition),
            start=sql.Literal(r.start),
            end=sql.Literal(r.end),
            floor=sql.Literal(floors.get(r.partition, 0)),
        )
        for r in ranges
    ]
    return sql.SQL("({})").format(sql.SQL(" OR ").join(parts))
