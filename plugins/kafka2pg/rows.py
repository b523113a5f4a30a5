"""The rows-moving primitives: staged rows into the target and quarantine, staging cleanup,
and the SQL predicate of offset ranges. They change rows only; the caller owns the
transaction, the locks and the batch's state."""

from __future__ import annotations

import logging

import psycopg
from psycopg import Connection, sql

from kafka2pg.config import Column, Pipeline
from kafka2pg.database import DATA_ERRORS, NO_NESTED_LOOPS, isolate_refused, planner
from kafka2pg.exceptions import KeyCollisionError
from kafka2pg.lifecycle import BatchState
from kafka2pg.migrations import target_columns
from kafka2pg.planner import OffsetRange
from kafka2pg.task_log import printable

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


def clear_finished_staging(conn: Connection, pipeline: Pipeline) -> int:
    """Delete the staging rows of the pipeline's rejected and abandoned batches; how many. A
    rejected batch keeps its rows for inspection until a newer batch is planned (which reads its
    offsets again); an abandoned one's are normally dropped with it, but a fenced-off task's
    COPY can commit after that."""
    return conn.execute(
        sql.SQL(
            "DELETE FROM {} s USING kafka2pg.batches b WHERE b.batch_id = s.batch_id AND b.state IN ({}, {})"
        ).format(
            sql.Identifier("kafka2pg", pipeline.staging_table),
            sql.Literal(str(BatchState.REJECTED)),
            sql.Literal(str(BatchState.ABANDONED)),
        )
    ).rowcount


def records_read(conn: Connection, batch_id: int) -> dict[int, int]:
    """Per partition: the records the batch's stage read (each one staged, to land or be quarantined)."""
    rows = conn.execute(
        "SELECT kafka_partition, records_read FROM kafka2pg.batch_partitions WHERE batch_id = %s", (batch_id,)
    ).fetchall()
    return {p: n or 0 for p, n in rows}


def shortfall(pipeline: Pipeline, batch_id: int, moved: int, read: int, undone: str) -> str | None:
    """Why a promotion (or a replay's finish) that moved `moved` staged rows into the target and the
    quarantine must roll back, when the batch read `read` records; None when every one moved."""
    if moved == read:
        return None
    return (
        f"pipeline {pipeline.name!r} batch {batch_id}: {moved} staged rows moved to the target and the quarantine "
        f"but the batch read {read} records; {undone}. Either its staging rows changed since the quality gate, "
        f"or {pipeline.target_schema}.{pipeline.target_table} does not keep every row inserted into it (a trigger "
        "or rule that skips rows)"
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
        pass
    inserted = _insert_isolating(conn, pipeline, batch_id, collisions)
    if not pipeline.business_key:
        return inserted
    # A refused row may be the copy of its business key the quality gate kept: the key's next
    # copy with other values stands in for it (a producer's retry, the same values, would be
    # refused the same way), for up to STAND_IN_PASSES copies refused in a row.
    for _ in range(STAND_IN_PASSES):
        stand_ins = _stand_ins(conn, pipeline, batch_id)
        if not stand_ins:
            break
        inserted += _insert_isolating(conn, pipeline, batch_id, collisions, only=stand_ins)
    _name_stand_ins(conn, pipeline, batch_id)
    return inserted


STAND_IN_PASSES = 3


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
        # PostgreSQL's detail quotes the key, a record's bytes: escaped for logs and pages, and the
        # error not chained (a traceback would print psycopg's words as they are).
        detail = exc.diag.message_detail
        raise KeyCollisionError(
            pipeline.name, batch_id, exc.diag.constraint_name, None if detail is None else printable(detail)
        ) from None


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
# The rows' numbers in it, beside the staging columns: upper case, so never a pipeline's column.
_ROW = sql.Identifier("Row")


def _insert_isolating(
    conn: Connection,
    pipeline: Pipeline,
    batch_id: int,
    collisions: set[str],
    only: list[tuple[int, int]] | None = None,
) -> int:
    """Insert the accepted rows (`only` these (partition, offset), if given) range by range
    (bisecting them in (partition, offset) order, numbered in a temporary table so each range is
    an index lookup) and flag each row the target refuses to quarantine with the database's
    reason; returns the rows inserted."""
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    chosen, params = sql.SQL(""), [batch_id]
    if only is not None:
        chosen = sql.SQL(
            " AND (s.kafka_partition, s.kafka_offset) IN (SELECT u.p, u.o FROM unnest(%s::int[], %s::bigint[]) u(p, o))"
        )
        params += [[p for p, _ in only], [o for _, o in only]]
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(_ISOLATING))
    conn.execute(
        sql.SQL(
            "CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT row_number() OVER (ORDER BY kafka_partition,"
            " kafka_offset) - 1 AS {}, s.* FROM {} s WHERE batch_id = %s AND quarantine_reason IS NULL{}"
        ).format(_ISOLATING, _ROW, staging, chosen),
        params,
    )
    conn.execute(sql.SQL("CREATE INDEX ON {} ({})").format(_ISOLATING, _ROW))
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(_ISOLATING)).fetchone()[0]
    in_range = sql.SQL("{row} >= %s AND {row} < %s").format(row=_ROW)

    def write(start: int, stop: int) -> None:
        _insert(conn, pipeline, batch_id, collisions, _ISOLATING, in_range, (start, stop))

    table = f"{pipeline.target_schema}.{pipeline.target_table}"
    # Stand-ins: a few rows, most alike the refused ones; their refusals say nothing of the table.
    refused = isolate_refused(conn, write, rows, table=table if only is None else None)
    with planner(conn, **NO_NESTED_LOOPS):
        conn.execute(
            sql.SQL(
                "UPDATE {staging} s SET quarantine_reason = r.reason FROM {isolating} i"
                " JOIN unnest(%s::bigint[], %s::text[]) r({row}, reason) USING ({row})"
                " WHERE s.batch_id = %s AND s.kafka_partition = i.kafka_partition AND s.kafka_offset = i.kafka_offset"
            ).format(staging=staging, isolating=_ISOLATING, row=_ROW),
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


# The start of the quality gate's reason for a business key's later copies in one batch.
WITHIN_BATCH_DUPLICATE = "duplicate business key within batch "
# What promotion appends to such a reason when the kept copy was refused: the two pieces around
# the partition and the offset of the copy that landed in its stead (`_name_stand_ins`).
STAND_IN_REFUSED = "; that copy was refused at promotion, partition "
STAND_IN_LANDED = " landed instead"


def _refused_keys(pipeline: Pipeline) -> sql.Composed:
    """The batch's business keys whose copy the gate kept was refused at promotion, with a copy
    the gate flagged as its duplicate and none promoted (columns: the keys)."""
    keys = sql.SQL(", ").join(map(sql.Identifier, pipeline.business_key))
    return sql.SQL(
        "SELECT {keys} FROM {staging} WHERE batch_id = %(batch)s GROUP BY {keys}"
        " HAVING bool_or(starts_with(quarantine_reason, {refused})) AND NOT bool_or(quarantine_reason IS NULL)"
        " AND bool_or(starts_with(quarantine_reason, {duplicate}))"
    ).format(
        keys=keys,
        staging=sql.Identifier("kafka2pg", pipeline.staging_table),
        refused=sql.Literal(PROMOTION_REFUSED),
        duplicate=sql.Literal(WITHIN_BATCH_DUPLICATE),
    )


def literal(value: object) -> sql.Composable:
    """`sql.Literal(value)`, but a text holding `%` spelled without one (decoded from hex by
    PostgreSQL): psycopg reads a `%` in a statement run with parameters as a placeholder, even
    inside a literal, and a pipeline's allowed values are the user's text ("50%")."""
    if isinstance(value, str) and "%" in value:
        return sql.SQL("convert_from(decode({}, 'hex'), 'UTF8')").format(sql.Literal(value.encode().hex()))
    return sql.Literal(value)


def rule_violations(column: Column, alias: str | None = None) -> list[tuple[sql.Composable, str]]:
    """A column's declared rules (`min`/`max`, `allowed`) as SQL conditions true for a row whose
    value violates them (NULL for a NULL value), each with the rule's words."""
    col = sql.Identifier(*([alias] if alias else []), column.name)
    rules: list[tuple[sql.Composable, str]] = []
    if column.ranged:
        low = sql.SQL("{} < {}").format(col, sql.Literal(column.minimum)) if column.minimum is not None else None
        high = sql.SQL("{} > {}").format(col, sql.Literal(column.maximum)) if column.maximum is not None else None
        rules.append(
            (
                sql.SQL(" OR ").join([c for c in (low, high) if c is not None]),
                column.range_words,
            )
        )
    if column.allowed is not None:
        # Compare typed values (the column's own type), never their text forms.
        values = sql.SQL(", ").join(literal(v) for v in column.allowed)
        typed = sql.SQL("{} <> ALL(ARRAY[{}]::{}[])").format(col, values, sql.SQL(column.type))
        rules.append((typed, column.allowed_words))
    return rules


def _passes_the_gate(pipeline: Pipeline, alias: str) -> sql.Composable:
    """SQL: the row has every required column and breaks no declared rule (what the gate checked
    of the rows it accepted, and so of a duplicate standing in for one)."""
    required = {*pipeline.required_columns, *pipeline.business_key}
    conditions = [sql.SQL("{} IS NOT NULL").format(sql.Identifier(alias, c)) for c in sorted(required)]
    conditions += [
        sql.SQL("({}) IS NOT TRUE").format(violated)
        for column in pipeline.columns
        for violated, _ in rule_violations(column, alias)
    ]
    return sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("TRUE")


def _values(pipeline: Pipeline, alias: str) -> sql.Composed:
    """ROW(...) of the pipeline's columns of the row `alias`."""
    return sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(alias, c.name) for c in pipeline.columns))


def _key_join(pipeline: Pipeline, left: str, right: str) -> sql.Composed:
    return sql.SQL(" AND ").join(
        sql.SQL("{}.{} = {}.{}").format(
            sql.Identifier(left), sql.Identifier(k), sql.Identifier(right), sql.Identifier(k)
        )
        for k in pipeline.business_key
    )


def _stand_ins(conn: Connection, pipeline: Pipeline, batch_id: int) -> list[tuple[int, int]]:
    """Accept again, for each key of `_refused_keys`, its first copy the gate flagged as a
    duplicate (in the gate's order: timestamp, partition, offset); returns their provenance."""
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    keys = sql.SQL(", ").join(sql.SQL("d.{}").format(sql.Identifier(k)) for k in pipeline.business_key)
    with planner(conn, **NO_NESTED_LOOPS):
        return conn.execute(
            sql.SQL(
                "UPDATE {staging} s SET quarantine_reason = NULL FROM (SELECT DISTINCT ON ({keys}) d.kafka_partition,"
                " d.kafka_offset FROM {staging} d JOIN ({refused}) r ON {join} WHERE d.batch_id = %(batch)s"
                " AND starts_with(d.quarantine_reason, {duplicate}) AND {passes}"
                " AND NOT EXISTS (SELECT FROM {staging} k WHERE k.batch_id = d.batch_id AND {same_key}"
                " AND starts_with(k.quarantine_reason, {refused_reason})"
                " AND ({kept}) IS NOT DISTINCT FROM ({candidate}))"
                " ORDER BY {keys}, d.kafka_timestamp NULLS FIRST, d.kafka_partition, d.kafka_offset) c"
                " WHERE s.batch_id = %(batch)s AND s.kafka_partition = c.kafka_partition"
                " AND s.kafka_offset = c.kafka_offset RETURNING s.kafka_partition, s.kafka_offset"
            ).format(
                staging=staging,
                keys=keys,
                refused=_refused_keys(pipeline),
                join=_key_join(pipeline, "d", "r"),
                duplicate=sql.Literal(WITHIN_BATCH_DUPLICATE),
                passes=_passes_the_gate(pipeline, "d"),
                same_key=_key_join(pipeline, "k", "d"),
                refused_reason=sql.Literal(PROMOTION_REFUSED),
                kept=_values(pipeline, "k"),
                candidate=_values(pipeline, "d"),
            ),
            {"batch": batch_id},
        ).fetchall()


def _name_stand_ins(conn: Connection, pipeline: Pipeline, batch_id: int) -> None:
    """Say in the reasons of the duplicates left whose kept copy was refused which copy landed instead."""
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    with planner(conn, **NO_NESTED_LOOPS):
        named = conn.execute(
            sql.SQL(
                "UPDATE {staging} s SET quarantine_reason = s.quarantine_reason || {stand_in} || a.kafka_partition"
                " || ' offset ' || a.kafka_offset || {landed}"
                " FROM {staging} a WHERE s.batch_id = %(batch)s AND a.batch_id = %(batch)s"
                " AND a.quarantine_reason IS NULL"
                " AND {join} AND starts_with(s.quarantine_reason, {duplicate})"
                " AND EXISTS (SELECT FROM {staging} r WHERE r.batch_id = %(batch)s AND {refused_join}"
                " AND starts_with(r.quarantine_reason, {refused}))"
            ).format(
                staging=staging,
                join=_key_join(pipeline, "a", "s"),
                refused_join=_key_join(pipeline, "r", "s"),
                duplicate=sql.Literal(WITHIN_BATCH_DUPLICATE),
                refused=sql.Literal(PROMOTION_REFUSED),
                stand_in=sql.Literal(STAND_IN_REFUSED),
                landed=sql.Literal(STAND_IN_LANDED),
            ),
            {"batch": batch_id},
        ).rowcount
    if named:
        log.warning(
            "pipeline=%s batch_id=%s the copy of a business key the gate kept was refused at promotion: the next "
            "copy landed instead (%s duplicate(s) left in quarantine say which)",
            pipeline.name,
            batch_id,
            named,
        )


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
