"""Promotion of a live batch (DESIGN step 4): data, quarantine and ledger move together in the
caller's ONE transaction (`kafka2pg.steps.promote_batch` runs the step).

Each partition's head advances only by compare-and-set from the head the batch was planned
at; any other outcome raises `LedgerConflictError` and the transaction rolls back whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psycopg import Connection

from kafka2pg.batch_store import Batch, staging_lost, transition
from kafka2pg.config import Pipeline
from kafka2pg.exceptions import BatchStateError, LedgerConflictError
from kafka2pg.ledger import lock_partitions
from kafka2pg.lifecycle import Action, BatchState, promote_action
from kafka2pg.planner import PartitionPlan
from kafka2pg.rows import clear_staging, insert_quarantine, insert_target, records_read, shortfall

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromoteResult:
    batch_id: int
    promoted: int
    quarantined: int
    already_promoted: bool
    message: str


def promote_live(conn: Connection, pipeline: Pipeline, batch: Batch) -> PromoteResult | None:
    """Promote a claimed live batch in the caller's transaction (None: its staging rows were
    lost; the batch is back to planned). A promoted batch is reported, not promoted again."""
    action = promote_action(batch.state)
    if action is Action.DONE:
        message = f"batch {batch.batch_id} was already promoted: nothing changed"
        return PromoteResult(batch.batch_id, batch.rows_promoted or 0, batch.rows_quarantined or 0, True, message)
    if action is Action.REFUSE:
        raise BatchStateError.wrong_state(
            pipeline.name,
            batch.batch_id,
            batch.state,
            "only a validated batch can be promoted",
            "The quality gate fails closed.",
        )
    try:
        with conn.transaction():  # a savepoint: rows missing from staging roll the promotion back
            promoted, quarantined = _promote_rows(conn, pipeline, batch)
    except _StagingShort as short:
        if staging_lost(conn, pipeline, batch):
            return None
        raise BatchStateError(str(short), **short.evidence) from None  # the target skips rows: as the message says
    table = f"{pipeline.target_schema}.{pipeline.target_table}"
    message = f"batch {batch.batch_id} promoted: {promoted} rows to {table}, {quarantined} to quarantine"
    log.info("pipeline=%s %s", pipeline.name, message)
    return PromoteResult(batch.batch_id, promoted, quarantined, False, message)


class _StagingShort(BatchStateError):
    """The rows promoted and quarantined are not the records the batch read: its staging rows
    changed since the gate (crash recovery empties UNLOGGED tables). `staging_lost` counts
    them and sends the batch back."""


def _promote_rows(conn: Connection, pipeline: Pipeline, batch: Batch) -> tuple[int, int]:
    """Heads (compare-and-set), ledger ranges, target, quarantine, staging cleanup, state.
    Every staged row lands in the target or the quarantine, so the two inserts together must
    move as many rows as the batch read; a shortfall raises `_StagingShort` before the batch's
    state changes (no count of the staging rows beforehand)."""
    partitions = [p.partition for p in batch.plan.partitions]
    lock_partitions(conn, pipeline.name, partitions, f"promotion of batch {batch.batch_id}")
    reads = records_read(conn, batch.batch_id)
    for part in batch.plan.partitions:
        _advance_head(conn, pipeline, batch, part)
        _record_ranges(conn, pipeline, batch, part, reads)
    promoted = insert_target(conn, pipeline, batch.batch_id)
    quarantined = insert_quarantine(conn, pipeline, batch.batch_id)
    short = shortfall(pipeline, batch.batch_id, promoted + quarantined, sum(reads.values()), "nothing was promoted")
    if short:
        raise _StagingShort(short, pipeline=pipeline.name, batch_id=batch.batch_id)
    clear_staging(conn, pipeline, batch.batch_id)
    transition(conn, batch, BatchState.PROMOTED, rows_promoted=promoted, rows_quarantined=quarantined)
    return promoted, quarantined


def _advance_head(conn: Connection, pipeline: Pipeline, batch: Batch, part: PartitionPlan) -> None:
    if part.expected_head is None:
        moved = conn.execute(
            "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset, last_batch_id, topic_id)"
            " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (pipeline.name, pipeline.topic, part.partition, part.new_head, batch.batch_id, batch.plan.topic_id),
        ).rowcount
    else:
        # The head is an offset in the topic the batch was planned in (a plan made before kafka2pg
        # recorded topic IDs keeps the head's).
        moved = conn.execute(
            "UPDATE kafka2pg.ledger_heads SET next_offset = %s, last_batch_id = %s, updated_at = now(),"
            " topic_id = coalesce(%s, topic_id) WHERE pipeline = %s AND kafka_partition = %s AND next_offset = %s",
            (part.new_head, batch.batch_id, batch.plan.topic_id, pipeline.name, part.partition, part.expected_head),
        ).rowcount
    if moved == 1:
        return
    current = conn.execute(
        "SELECT next_offset, last_batch_id FROM kafka2pg.ledger_heads WHERE pipeline = %s AND kafka_partition = %s",
        (pipeline.name, part.partition),
    ).fetchone()
    found, moved_by = (None, None) if current is None else current
    raise LedgerConflictError.head_moved(
        pipeline.name, batch.batch_id, part.partition, part.expected_head, found, moved_by
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
