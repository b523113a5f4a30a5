"""Promotion (DESIGN step 4): data, quarantine and ledger move together in ONE transaction.

Each partition's head advances only by compare-and-set from the head the batch was planned
at; any other outcome raises `LedgerConflictError` and the transaction rolls back whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg import Connection, sql

from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import DATA_ERRORS, isolate_refused, transaction
from kafka2pg.exceptions import BatchStateError, KeyCollisionError, LedgerConflictError
from kafka2pg.ledger import Batch, load_claimed, lock_partitions, raise_staging_lost, set_state, staging_lost
from kafka2pg.migrations import target_columns
from kafka2pg.planner import PartitionPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromoteResult:
    batch_id: int
    promoted: int
    quarantined: int
    already_promoted: bool
    message: str


def promote_batch(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None = None) -> PromoteResult:
    """Promote a validated batch; a second call for a promoted batch changes nothing.

    `epoch` is the run's claim (None: the current one): a fenced-off zombie run fails with
    `LedgerConflictError` here even if the heads have not moved yet.
    """
    try:
        return _promote(settings, pipeline, batch_id, epoch)
    except KeyCollisionError as exc:
        if not _send_back(settings, pipeline, batch_id, epoch):
            raise
        why = f"a business key is already in the target ({exc.__cause__ or exc})"
    except BatchStateError:
        if not _sent_back(settings, pipeline, batch_id, epoch):
            raise
        why = "an earlier attempt stopped after a key collision"  # a retry of the promote task
    # The gate left the promoted-key check to the target's unique index, which refused a key:
    # the check runs now, flags the promoted keys' rows to quarantine (or rejects the batch
    # under duplicate_policy: fail, raising QualityGateFailed), and the rest is promoted.
    log.warning("pipeline=%s batch_id=%s %s: running the deferred promoted-key check", pipeline.name, batch_id, why)
    from kafka2pg.quality import validate_batch

    validate_batch(settings, pipeline, batch_id, epoch, probe_promoted_keys=True)
    try:
        return _promote(settings, pipeline, batch_id, epoch)
    except KeyCollisionError:
        _send_back(settings, pipeline, batch_id, epoch)
        raise


def _send_back(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None) -> bool:
    """After a key collision: the validated batch goes back to `staged`. True when its gate had
    deferred the promoted-key check to promotion (so running it now explains the collision)."""
    from kafka2pg.quality import key_probe_deferred

    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        if batch.state != "validated":
            return False
        set_state(conn, batch, "staged", error="business key promoted since validation: validate again")
        return key_probe_deferred(conn, batch_id)


def _sent_back(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None) -> bool:
    """Whether the batch is `staged` by `_send_back` with its promoted-key check still deferred:
    an attempt stopped between the collision and the check (the check and then the promotion
    are what a retry of the promote task has left to do)."""
    from kafka2pg.quality import key_probe_deferred

    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        return batch.state == "staged" and key_probe_deferred(conn, batch_id)


def _promote(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None):
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        if batch.kind == "replay":
            from kafka2pg.replay import finish_replay

            replayed = finish_replay(conn, pipeline, batch)  # None: its staging rows were lost
            lost = replayed is None
        else:
            if batch.state == "promoted":
                message = f"batch {batch_id} was already promoted: nothing changed"
                return PromoteResult(batch_id, batch.rows_promoted or 0, batch.rows_quarantined or 0, True, message)
            if batch.state != "validated":
                raise BatchStateError(
                    f"batch {batch_id} of pipeline {pipeline.name!r} is {batch.state}; only a validated "
                    "batch can be promoted (the quality gate fails closed)"
                )
            lost = staging_lost(conn, pipeline, batch)
            if not lost:
                promoted, quarantined = _promote_rows(conn, pipeline, batch)
    if lost:
        raise_staging_lost(pipeline, batch_id)
    if batch.kind == "replay":
        return replayed
    table = f"{pipeline.target_schema}.{pipeline.target_table}"
    message = f"batch {batch_id} promoted: {promoted} rows to {table}, {quarantined} to quarantine"
    log.info("pipeline=%s %s", pipeline.name, message)
    return PromoteResult(batch_id, promoted, quarantined, False, message)


def _promote_rows(conn: Connection, pipeline: Pipeline, batch: Batch) -> tuple[int, int]:
    """Heads (compare-and-set), ledger ranges, target, quarantine, staging cleanup, state."""
    partitions = [p.partition for p in batch.plan.partitions]
    lock_partitions(conn, pipeline.name, partitions, f"promotion of batch {batch.batch_id}")
    reads = _records_read(conn, batch.batch_id)
    for part in batch.plan.partitions:
        _advance_head(conn, pipeline, batch, part)
        _record_ranges(conn, pipeline, batch, part, reads)
    promoted = insert_target(conn, pipeline, batch)
    quarantined = insert_quarantine(conn, pipeline, batch)
    clear_staging(conn, pipeline, batch.batch_id)
    set_state(conn, batch, "promoted", rows_promoted=promoted, rows_quarantined=quarantined)
    return promoted, quarantined


def clear_staging(conn: Connection, pipeline: Pipeline, batch_id: int) -> None:
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE batch_id = %s").format(sql.Identifier("kafka2pg", pipeline.staging_table)),
        (batch_id,),
    )


def _records_read(conn: Connection, batch_id: int) -> dict[int, int]:
    rows = conn.execute(
        "SELECT kafka_partition, records_read FROM kafka2pg.batch_partitions WHERE batch_id = %s", (batch_id,)
    ).fetchall()
    return {p: n or 0 for p, n in rows}


def _advance_head(conn: Connection, pipeline: Pipeline, batch: Batch, part: PartitionPlan) -> None:
    if part.expected_head is None:
        moved = conn.execute(
            "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset, last_batch_id)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (pipeline.name, pipeline.topic, part.partition, part.new_head, batch.batch_id),
        ).rowcount
    else:
        moved = conn.execute(
            "UPDATE kafka2pg.ledger_heads SET next_offset = %s, last_batch_id = %s, updated_at = now()"
            " WHERE pipeline = %s AND kafka_partition = %s AND next_offset = %s",
            (part.new_head, batch.batch_id, pipeline.name, part.partition, part.expected_head),
        ).rowcount
    if moved == 1:
        return
    current = conn.execute(
        "SELECT next_offset, last_batch_id FROM kafka2pg.ledger_heads WHERE pipeline = %s AND kafka_partition = %s",
        (pipeline.name, part.partition),
    ).fetchone()
    found = "no head" if current is None else f"head {current[0]} (moved by batch {current[1]})"
    raise LedgerConflictError(
        f"pipeline {pipeline.name!r} batch {batch.batch_id}, partition {part.partition}: planned from "
        f"head {part.expected_head} but the ledger has {found}. Another run promoted these offsets "
        "first; nothing from this batch was written. Trigger a new run to plan from the current head."
    )


def _record_ranges(
    conn: Connection, pipeline: Pipeline, batch: Batch, part: PartitionPlan, reads: dict[int, int]
) -> None:
    rows = []
    if part.gap is not None:
        rows.append((part.gap.start, part.gap.end, part.gap.kind, 0))
    if part.range is not None:
        rows.append((part.range.start, part.range.end, "batch", reads.get(part.partition, 0)))
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO kafka2pg.ledger_ranges (pipeline, topic, kafka_partition, start_offset, end_offset,"
            " kind, batch_id, records, generation) VALUES (%s, %s, %s, %s, %s, %s, %s, %s,"
            " (SELECT count(*) FROM kafka2pg.ledger_resets r WHERE r.pipeline = %s AND r.kafka_partition = %s))",
            [
                (
                    pipeline.name,
                    pipeline.topic,
                    part.partition,
                    s,
                    e,
                    k,
                    batch.batch_id,
                    n,
                    pipeline.name,
                    part.partition,
                )
                for s, e, k, n in rows
            ],
        )


def insert_target(conn: Connection, pipeline: Pipeline, batch: Batch) -> int:
    """Insert the batch's accepted staging rows into the target; rows the target refuses on data
    (a CHECK or a type the admission rules do not know of) are flagged to quarantine instead,
    with the database's reason, and the rest land. A unique violation on the business key or
    the provenance key raises `KeyCollisionError` (the quality gate has to judge it)."""
    accepted = sql.SQL("batch_id = %s AND quarantine_reason IS NULL")
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    collisions = _collision_indexes(conn, pipeline)
    try:
        with conn.transaction():  # a savepoint: a refused row leaves the promotion's transaction usable
            return _insert(conn, pipeline, batch, collisions, staging, accepted, (batch.batch_id,))
    except DATA_ERRORS:
        return _insert_isolating(conn, pipeline, batch, collisions)


def _insert(
    conn: Connection,
    pipeline: Pipeline,
    batch: Batch,
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
        raise KeyCollisionError(
            f"pipeline {pipeline.name!r} batch {batch.batch_id}: promotion hit a unique key already in the "
            f"target ({exc.diag.message_detail}); nothing was promoted. A replay or a manual write loaded it "
            "after this batch was validated. The batch goes back to 'staged': the next run (trigger one) "
            "validates it again, and the duplicate check then flags the row."
        ) from exc


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


def _insert_isolating(conn: Connection, pipeline: Pipeline, batch: Batch, collisions: set[str]) -> int:
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
        (batch.batch_id,),
    )
    conn.execute(sql.SQL("CREATE INDEX ON {} (n)").format(_ISOLATING))
    rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(_ISOLATING)).fetchone()[0]
    in_range = sql.SQL("n >= %s AND n < %s")

    def write(start: int, stop: int) -> None:
        _insert(conn, pipeline, batch, collisions, _ISOLATING, in_range, (start, stop))

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
            [f"PostgreSQL refused the row at promotion: {m}" for m in refused.values()],
            batch.batch_id,
        ),
    )
    log.warning(
        "pipeline=%s batch_id=%s %s refused %s of %s row(s) on data; flagged to quarantine",
        pipeline.name,
        batch.batch_id,
        table,
        len(refused),
        rows,
    )
    return rows - len(refused)


def insert_quarantine(conn: Connection, pipeline: Pipeline, batch: Batch) -> int:
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
    return conn.execute(query, (pipeline.name, batch.batch_id)).rowcount
