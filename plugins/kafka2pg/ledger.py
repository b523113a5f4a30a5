"""The offset ledger and the batch records: heads, committed ranges, batch states.

Opening a batch (DESIGN step 1) happens here: ledger heads + broker offsets -> planner -> row.
"""

from __future__ import annotations

import getpass
import logging
import time
from dataclasses import dataclass, replace

import psycopg
from psycopg import Connection, sql
from psycopg.types.json import Jsonb

from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction
from kafka2pg.exceptions import BatchStateError, LedgerConflictError, RangeLockedError, StagingLostError
from kafka2pg.kafka_offsets import PartitionOffsets, partition_offsets, record_timestamp, topic_retention
from kafka2pg.planner import BatchPlan, LossHorizon, PartitionState, describe_ranges, loss_horizon, plan_batch

log = logging.getLogger(__name__)

OPEN_STATES = ("planned", "staged", "validated")


@dataclass(frozen=True)
class Batch:
    """One row of kafka2pg.batches with its plan."""

    batch_id: int
    pipeline: str
    topic: str
    state: str
    plan: BatchPlan
    epoch: int = 1
    run_id: str | None = None
    records_read: int | None = None
    rows_staged: int | None = None
    rows_quarantined: int | None = None
    rows_promoted: int | None = None
    kind: str = "live"


@dataclass(frozen=True)
class OpenedBatch:
    """The outcome of the plan step: the batch to work on (None: nothing new), and why."""

    batch: Batch | None
    resumed: bool
    message: str


def read_heads(conn: Connection, pipeline: str) -> dict[int, int]:
    rows = conn.execute(
        "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s",
        (pipeline,),
    ).fetchall()
    return {partition: offset for partition, offset in rows}


def read_head_batches(conn: Connection, pipeline: str) -> dict[int, int | None]:
    """Per partition with a head: the batch that last moved it (None: set by a reset)."""
    rows = conn.execute(
        "SELECT kafka_partition, last_batch_id FROM kafka2pg.ledger_heads WHERE pipeline = %s",
        (pipeline,),
    ).fetchall()
    return dict(rows)


def load_batch(conn: Connection, batch_id: int, *, for_update: bool = False) -> Batch:
    query = (
        "SELECT batch_id, pipeline, topic, state, plan, epoch, run_id, records_read, rows_staged,"
        " rows_quarantined, rows_promoted, kind FROM kafka2pg.batches WHERE batch_id = %s"
    )
    row = conn.execute(query + (" FOR UPDATE" if for_update else ""), (batch_id,)).fetchone()
    if row is None:
        raise BatchStateError(f"batch {batch_id} does not exist in kafka2pg.batches")
    return Batch(row[0], row[1], row[2], row[3], BatchPlan.from_json(row[4]), *row[5:])


def load_claimed(conn: Connection, pipeline: Pipeline, batch_id: int, epoch: int | None) -> Batch:
    """Lock a batch for one step of a run; the run's claim (`epoch`) must still be the newest.

    `epoch=None` (manual CLI use) accepts the current claim. A zombie run holding an older
    epoch gets `LedgerConflictError` before it writes anything.
    """
    batch = load_batch(conn, batch_id, for_update=True)
    if batch.pipeline != pipeline.name:
        raise BatchStateError(f"batch {batch_id} belongs to pipeline {batch.pipeline!r}, not {pipeline.name!r}")
    if epoch is not None and batch.epoch != epoch:
        raise LedgerConflictError(
            f"pipeline {pipeline.name!r} batch {batch_id}: this run holds claim epoch {epoch} but run "
            f"{batch.run_id!r} claimed the batch since (epoch {batch.epoch}). This run stops without "
            "writing anything; the newer run carries the batch on. Nothing to do unless it also failed."
        )
    return batch


def lock_plan(conn: Connection, pipeline: str) -> None:
    """One planner per pipeline at a time (planning, replay planning, undo, reset), until commit."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext('kafka2pg.plan'), hashtext(%s))", (pipeline,))


def reset_floors(conn: Connection, pipeline: str) -> dict[int, int]:
    """Per reset partition: the last batch id of the topic before its latest reset (rows up to it are older)."""
    return {partition: after for partition, (after, _) in last_resets(conn, pipeline).items()}


def last_resets(conn: Connection, pipeline: str) -> dict[int, tuple[int, int | None]]:
    """Per reset partition: the last batch id of the topic before its latest reset, and the reset offset.

    Rows and ledger ranges of batches up to that id belong to the topic as it was before.
    """
    rows = conn.execute(
        "SELECT DISTINCT ON (kafka_partition) kafka_partition, after_batch_id, to_offset FROM kafka2pg.ledger_resets"
        " WHERE pipeline = %s ORDER BY kafka_partition, reset_id DESC",
        (pipeline,),
    ).fetchall()
    return {partition: (after, to_offset) for partition, after, to_offset in rows}


def ranges_since_reset(
    conn: Connection, pipeline: str, resets: dict[int, tuple[int, int | None]]
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[int, int]]]]:
    """Per partition since its last reset: every ledgered range, and the loaded (batch) ranges merged."""
    rows = conn.execute(
        "SELECT kafka_partition, start_offset, end_offset, kind, batch_id FROM kafka2pg.ledger_ranges"
        " WHERE pipeline = %s ORDER BY kafka_partition, start_offset",
        (pipeline,),
    ).fetchall()
    stored: dict[int, list[tuple[int, int]]] = {}
    loaded: dict[int, list[tuple[int, int]]] = {}
    for partition, start, end, kind, batch_id in rows:
        if batch_id <= resets.get(partition, (0, None))[0]:
            continue  # consumed from the topic as it was before a reset: cannot be re-read
        stored.setdefault(partition, []).append((start, end))
        if kind != "batch":
            continue
        mine = loaded.setdefault(partition, [])
        if mine and mine[-1][1] == start:
            mine[-1] = (mine[-1][0], end)
        else:
            mine.append((start, end))
    return stored, loaded


RANGE_LOCK_WAIT_S = 300


def lock_partitions(conn: Connection, pipeline: str, partitions: set[int] | list[int], purpose: str) -> None:
    """Range locks: one transaction-scoped lock per (pipeline, partition), taken in partition order.

    Every transaction that changes a partition's promoted rows or head (live promotion, a replay's
    replace, an undo) holds them, so two such changes of one partition never overlap: the second
    waits (logged, with the holder) up to RANGE_LOCK_WAIT_S, then fails with `RangeLockedError`.
    """
    for partition in sorted(set(partitions)):
        key = (f"kafka2pg.range:{pipeline}", partition)
        if conn.execute("SELECT pg_try_advisory_xact_lock(hashtext(%s), %s)", key).fetchone()[0]:
            continue
        holder = conn.execute(
            "SELECT a.pid, a.application_name, left(a.query, 120) FROM pg_locks l JOIN pg_stat_activity a"
            " USING (pid) WHERE l.locktype = 'advisory' AND l.granted AND l.classid = hashtext(%s)::oid"
            " AND l.objid = %s::oid AND l.objsubid = 2 AND l.database = (SELECT oid FROM pg_database"
            " WHERE datname = current_database()) LIMIT 1",
            key,
        ).fetchone()
        log.warning(
            "pipeline=%s %s waits for the range lock of partition %s held by %s",
            pipeline,
            purpose,
            partition,
            f"backend pid {holder[0]} ({holder[1] or 'no application name'}: {holder[2]})"
            if holder
            else "another transaction",
        )
        previous = conn.execute("SELECT current_setting('lock_timeout')").fetchone()[0]
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{RANGE_LOCK_WAIT_S}s",))
        try:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s), %s)", key)
        except psycopg.errors.LockNotAvailable as exc:
            raise RangeLockedError(
                f"pipeline {pipeline!r}: {purpose} waited {RANGE_LOCK_WAIT_S}s for partition {partition}, which "
                "another promotion, replay or undo still holds; nothing was changed. Retry when it has finished "
                "(see kafka2pg.batches and kafka2pg.replays)."
            ) from exc
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (previous,))


# How far along a batch is: moving forward (or to an end) is progress, which clears its recorded
# step failures (kafka2pg.stuck); moving back (staging lost, a key collision) is not.
_PROGRESS = {"planned": 0, "staged": 1, "validated": 2}
_CLEAR_FAILURES = ", failed_step = NULL, failed_epoch = NULL, failures = 0, failing_since = NULL, last_failure = NULL"


def set_state(conn: Connection, batch: Batch, to_state: str, **counts: int | str | None) -> None:
    """Move the batch to `to_state`; a move forward clears its recorded step failures."""
    assignments = "".join(f", {name} = %({name})s" for name in counts)
    if to_state not in _PROGRESS or _PROGRESS[to_state] > _PROGRESS.get(batch.state, -1):  # an end, or forward
        assignments += _CLEAR_FAILURES
    conn.execute(
        f"UPDATE kafka2pg.batches SET state = %(state)s, updated_at = now(){assignments}"  # noqa: S608 - names are code constants
        " WHERE batch_id = %(batch_id)s",
        {"state": to_state, "batch_id": batch.batch_id, **counts},
    )
    log.info("pipeline=%s batch_id=%s state %s -> %s", batch.pipeline, batch.batch_id, batch.state, to_state)


def staged_counts(conn: Connection, pipeline: Pipeline, batch_id: int) -> dict[int, int]:
    """Rows per Kafka partition in the pipeline's staging table for one batch."""
    query = sql.SQL("SELECT kafka_partition, count(*) FROM {} WHERE batch_id = %s GROUP BY 1").format(
        sql.Identifier("kafka2pg", pipeline.staging_table)
    )
    return dict(conn.execute(query, (batch_id,)).fetchall())


def staging_lost(conn: Connection, pipeline: Pipeline, batch: Batch, staged: dict[int, int] | None = None) -> bool:
    """True when a staged batch's rows are no longer all there (crash recovery empties UNLOGGED
    tables); the batch is then put back to `planned` so the next run re-reads it from Kafka.
    `staged`: the batch's `staged_counts`, when the caller has them from this transaction."""
    read = dict(
        conn.execute(
            "SELECT kafka_partition, coalesce(records_read, 0) FROM kafka2pg.batch_partitions"
            " WHERE batch_id = %s AND coalesce(records_read, 0) > 0",
            (batch.batch_id,),
        ).fetchall()
    )
    if (staged_counts(conn, pipeline, batch.batch_id) if staged is None else staged) == read:
        return False
    log.error("pipeline=%s batch_id=%s staging rows lost; batch reset to planned", pipeline.name, batch.batch_id)
    set_state(conn, batch, "planned", error="staging rows lost (PostgreSQL crash recovery?); re-staged by next run")
    return True


def raise_staging_lost(pipeline: Pipeline, batch_id: int) -> None:
    raise StagingLostError(
        f"pipeline {pipeline.name!r} batch {batch_id}: its staged rows are gone (PostgreSQL crash recovery "
        "empties UNLOGGED staging tables). Nothing was promoted; the batch is back to 'planned' and the "
        "next run re-reads the same offsets from Kafka."
    )


def open_batch(
    settings: Settings,
    pipeline: Pipeline,
    *,
    max_records_per_batch: int | None = None,
    run_id: str | None = None,
    dry_run: bool = False,
) -> OpenedBatch:
    """Resume the pipeline's unfinished batch, or plan and record the next one.

    Rule: an unfinished live batch (planned/staged/validated) is resumed with its exact
    ranges while every head it expects is still in place; otherwise it is marked `abandoned`
    (it never promoted anything, so nothing is undone) and a fresh batch is planned.
    """
    offsets = partition_offsets(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    with transaction(settings.database_url) as conn:
        # One planner per pipeline at a time; promotion is still fenced by compare-and-set.
        lock_plan(conn, pipeline.name)
        # Lock the open batch BEFORE reading heads: a promote of it still in flight commits first,
        # so the heads read below are never older than the batch states seen.
        open_id = open_batch_id(conn, pipeline)
        if not dry_run:  # this run takes the pipeline over: an earlier run's lookahead is void
            abandon_lookaheads(conn, pipeline, f"run {run_id} took the pipeline over before it was promoted")
        heads = read_heads(conn, pipeline.name)
        _warn_loss_horizons(settings, pipeline, offsets, heads)
        lows = {o.partition: o.low for o in offsets}
        resumed = _resume_or_abandon(conn, pipeline, open_id, heads, lows, run_id, dry_run=dry_run)
        if resumed is not None:
            verb = "dry run: would resume" if dry_run else "resuming"
            return OpenedBatch(
                resumed, True, f"{verb} unfinished batch {resumed.batch_id} ({resumed.state}, epoch {resumed.epoch})"
            )
        plan = _plan_from(pipeline, offsets, heads, read_head_batches(conn, pipeline.name), max_records_per_batch)
        if plan.is_empty:
            return OpenedBatch(None, False, _nothing_new(pipeline, offsets, heads))
        if dry_run:
            draft = Batch(0, pipeline.name, pipeline.topic, "dry-run", plan)
            return OpenedBatch(draft, False, f"dry run: would read {plan.record_budget} offsets; nothing recorded")
        batch = insert_batch(conn, pipeline, plan, run_id)
    return OpenedBatch(batch, False, f"planned batch {batch.batch_id}: {plan.record_budget} offsets")


def loss_horizons(
    settings: Settings, pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int]
) -> list[LossHorizon]:
    """Per partition: unread records, margin to the low watermark, estimated time to data loss."""
    retention = topic_retention(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    now_ms = int(time.time() * 1000)
    horizons = []
    for state in _states(offsets, heads):
        # Below the low watermark nothing can be read: the plan reports that loss itself.
        first_unread = max(state.low, state.low if state.head is None else state.head)
        timestamp = None
        if retention.deletes and retention.retention_ms is not None and first_unread < state.last_stable:
            timestamp = record_timestamp(
                settings.kafka,
                pipeline.topic,
                state.partition,
                first_unread,
                state.last_stable,
                settings.kafka_timeout_s,
            )
        horizons.append(loss_horizon(state, timestamp, now_ms, retention.retention_ms if retention.deletes else None))
    return horizons


def _warn_loss_horizons(
    settings: Settings, pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int]
) -> None:
    for h in loss_horizons(settings, pipeline, offsets, heads):
        if not h.unread:
            continue
        left = "no time-based retention" if h.seconds_left is None else f"~{h.seconds_left / 3600:.1f} h"
        message = (
            f"pipeline={pipeline.name} partition={h.partition} unread={h.unread} margin to low watermark="
            f"{h.records_margin} records, time to data loss {left}"
        )
        if h.at_risk(pipeline.data_loss_warning_hours):
            log.warning(
                "%s: UNDER the %.0f h warning threshold; run the pipeline more often or raise retention.ms",
                message,
                pipeline.data_loss_warning_hours,
            )
        else:
            log.info(message)


def _states(
    offsets: list[PartitionOffsets], heads: dict[int, int], moved: dict[int, int | None] | None = None
) -> list[PartitionState]:
    moved = moved or {}
    return [
        PartitionState(o.partition, heads.get(o.partition), o.low, o.last_stable, o.high, moved.get(o.partition))
        for o in offsets
    ]


def _nothing_new(pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int]) -> str:
    parts = ", ".join(f"p{o.partition}@{heads.get(o.partition, o.low)}/{o.last_stable}" for o in offsets)
    return f"nothing new on topic {pipeline.topic!r} ({parts}): no batch planned, Spark not launched"


def _old_rows(conn: Connection, pipeline: Pipeline, partition: int) -> int:
    target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
    query = sql.SQL(
        "SELECT (SELECT count(*) FROM {} WHERE kafka_topic = %(topic)s AND kafka_partition = %(p)s)"
        " + (SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %(pipeline)s AND kafka_partition = %(p)s)"
    ).format(target)
    return conn.execute(query, {"topic": pipeline.topic, "p": partition, "pipeline": pipeline.name}).fetchone()[0]


def _archive_rows(conn: Connection, pipeline: Pipeline, partition: int, reset_id: int) -> None:
    """Move every target and quarantine row of the partition into kafka2pg.archived_rows."""
    params = {"reset": reset_id, "pipeline": pipeline.name, "topic": pipeline.topic, "p": partition}
    sources = (
        ("target", sql.Identifier(pipeline.target_schema, pipeline.target_table), sql.SQL("kafka_topic = %(topic)s")),
        ("quarantine", sql.Identifier("kafka2pg", "quarantine"), sql.SQL("pipeline = %(pipeline)s")),
    )
    for source, table, owner in sources:
        conn.execute(
            sql.SQL(
                "WITH moved AS (DELETE FROM {table} t WHERE {owner} AND kafka_partition = %(p)s RETURNING t.*)"
                " INSERT INTO kafka2pg.archived_rows (reset_id, pipeline, source, kafka_partition, kafka_offset,"
                " batch_id, row_data) SELECT %(reset)s, %(pipeline)s, {source}, m.kafka_partition, m.kafka_offset,"
                " m.batch_id, to_jsonb(m) FROM moved m"
            ).format(table=table, owner=owner, source=sql.Literal(source)),
            params,
        )


def open_batch_id(conn: Connection, pipeline: Pipeline) -> int | None:
    """The pipeline's unfinished live batch (the root: lowest id; a lookahead comes after it), locked."""
    ids = _open_live_ids(conn, pipeline)
    return ids[0] if ids else None


def _open_live_ids(conn: Connection, pipeline: Pipeline) -> list[int]:
    rows = conn.execute(
        "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND kind = 'live' AND state = ANY(%s)"
        " ORDER BY batch_id FOR UPDATE",
        (pipeline.name, list(OPEN_STATES)),
    ).fetchall()
    return [r[0] for r in rows]


def abandon_lookaheads(conn: Connection, pipeline: Pipeline, reason: str) -> list[int]:
    """Abandon every open live batch after the root: the lookahead of a run now fenced off."""
    ids = _open_live_ids(conn, pipeline)[1:]
    for batch_id in ids:
        abandon_unpromoted(conn, pipeline, load_batch(conn, batch_id), reason)
    return ids


def abandon_unpromoted(conn: Connection, pipeline: Pipeline, batch: Batch, reason: str) -> None:
    """Mark an open batch `abandoned` and drop its staging rows: nothing of it was promoted, and
    its offsets are planned afresh by the next run."""
    set_state(conn, batch, "abandoned", error=reason)
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE batch_id = %s").format(sql.Identifier("kafka2pg", pipeline.staging_table)),
        (batch.batch_id,),
    )


def plan_lookahead(
    settings: Settings,
    pipeline: Pipeline,
    after_id: int,
    after_epoch: int | None,
    *,
    max_records_per_batch: int | None = None,
    run_id: str | None = None,
) -> Batch | None:
    """Plan the batch that follows batch `after_id` (still open, claimed by this run at
    `after_epoch`) from its planned ends; if one is already planned after it (by a killed
    attempt holding the same claim), claim that one instead.

    For every partition `after_id` reads, its compare-and-set expects that batch's new head,
    so there it promotes only once that one has; other partitions are planned from the ledger's
    heads, as any batch. If `after_id` is rejected or fenced, the run (or the next one's plan
    step) abandons the lookahead. None: nothing new.
    """
    offsets = partition_offsets(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    with transaction(settings.database_url) as conn:
        lock_plan(conn, pipeline.name)
        current = load_claimed(conn, pipeline, after_id, after_epoch)
        if current.kind != "live" or current.state not in ("staged", "validated"):
            raise BatchStateError(
                f"batch {after_id} of pipeline {pipeline.name!r} is a {current.kind} batch in state "
                f"{current.state}: no batch can be planned after it"
            )
        later = [i for i in _open_live_ids(conn, pipeline) if i > after_id]
        mine = conn.execute(
            "SELECT batch_id FROM kafka2pg.batches WHERE after_batch_id = %s AND state = ANY(%s)",
            (after_id, list(OPEN_STATES)),
        ).fetchone()
        if mine is not None and later == [mine[0]]:
            # A retry of this run's job (same claim on `after_id`) finds the lookahead its killed
            # attempt planned: take it over (a newer claim fences the dead attempt) and go on.
            return _claim(conn, load_batch(conn, mine[0]), run_id)
        if later:
            raise BatchStateError(f"pipeline {pipeline.name!r}: batch {later[0]} is already planned after {after_id}")
        heads = read_heads(conn, pipeline.name)
        heads.update({p.partition: p.new_head for p in current.plan.partitions})
        moved = read_head_batches(conn, pipeline.name)
        moved.update({p.partition: after_id for p in current.plan.partitions})
        plan = _plan_from(pipeline, offsets, heads, moved, max_records_per_batch)
        if plan.is_empty:
            return None
        return insert_batch(conn, pipeline, plan, run_id, after_batch_id=after_id)


def _plan_from(
    pipeline: Pipeline,
    offsets: list[PartitionOffsets],
    heads: dict[int, int],
    moved: dict[int, int | None],
    max_records_per_batch: int | None,
) -> BatchPlan:
    """The next batch's plan from these heads (last moved by the `moved` batches), with the
    pipeline's limits and policies."""
    return plan_batch(
        pipeline.name,
        pipeline.topic,
        _states(offsets, heads, moved),
        max_records_per_batch=max_records_per_batch or pipeline.max_records_per_batch,
        max_records_per_partition=pipeline.max_records_per_partition,
        on_retention_loss=pipeline.on_retention_loss,
        new_partition_start=pipeline.new_partition_start,
        ledger_partitions=tuple(heads),
    )


def _claim(conn: Connection, batch: Batch, run_id: str | None) -> Batch:
    """Take an unfinished batch over: bump its epoch so the previous run's later steps are fenced."""
    epoch = conn.execute(
        "UPDATE kafka2pg.batches SET epoch = epoch + 1, run_id = %s, claimed_at = now(), updated_at = now()"
        " WHERE batch_id = %s RETURNING epoch",
        (run_id, batch.batch_id),
    ).fetchone()[0]
    log.warning(
        "pipeline=%s batch_id=%s resumed in state %s: claim epoch %s -> %s (previous run %s is fenced off)",
        batch.pipeline,
        batch.batch_id,
        batch.state,
        batch.epoch,
        epoch,
        batch.run_id,
    )
    return replace(batch, epoch=epoch, run_id=run_id)


def _resume_or_abandon(
    conn: Connection,
    pipeline: Pipeline,
    open_id: int | None,
    heads: dict[int, int],
    lows: dict[int, int],
    run_id: str | None,
    *,
    dry_run: bool,
) -> Batch | None:
    if open_id is None:
        return None
    batch = load_batch(conn, open_id)
    stale = [p.partition for p in batch.plan.partitions if heads.get(p.partition) != p.expected_head]
    # Not read yet, and Kafka no longer holds its start (retention or delete-records since planning):
    # re-reading it can only fail; planning afresh reports the loss (or records it, under `skip`).
    expired = [
        r.partition for r in batch.plan.ranges if batch.state == "planned" and r.start < lows.get(r.partition, 0)
    ]
    if not stale and not expired:
        return batch if dry_run else _claim(conn, batch, run_id)
    if stale:
        why, error = (
            f"ledger heads of partitions {stale} moved since it was planned",
            f"heads of partitions {stale} moved before promotion",
        )
    else:
        why = error = f"Kafka deleted planned offsets of partitions {expired} before they were read"
    if dry_run:
        log.info("pipeline=%s dry run: would abandon batch %s (%s)", pipeline.name, batch.batch_id, why)
        return None
    log.warning("pipeline=%s batch_id=%s abandoned: %s", pipeline.name, batch.batch_id, why)
    set_state(conn, batch, "abandoned", error=error)
    return None


def insert_batch(
    conn: Connection,
    pipeline: Pipeline,
    plan: BatchPlan,
    run_id: str | None,
    kind: str = "live",
    *,
    after_batch_id: int | None = None,
) -> Batch:
    """Record a planned batch (live or replay) with its ranges; `after_batch_id`: a lookahead."""
    batch_id = conn.execute(
        "INSERT INTO kafka2pg.batches (pipeline, topic, kind, state, plan, run_id, records_planned, after_batch_id)"
        " VALUES (%s, %s, %s, 'planned', %s, %s, %s, %s) RETURNING batch_id",
        (pipeline.name, pipeline.topic, kind, Jsonb(plan.to_json()), run_id, plan.record_budget, after_batch_id),
    ).fetchone()[0]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO kafka2pg.batch_partitions (batch_id, kafka_partition, start_offset, end_offset)"
            " VALUES (%s, %s, %s, %s)",
            [(batch_id, r.partition, r.start, r.end) for r in plan.ranges],
        )
    log.info("pipeline=%s batch_id=%s planned %s %s", pipeline.name, batch_id, kind, _describe(plan))
    return Batch(batch_id, pipeline.name, pipeline.topic, "planned", plan, run_id=run_id, kind=kind)


def _describe(plan: BatchPlan) -> str:
    parts = [describe_ranges(plan.ranges)] if plan.ranges else []
    parts += [f"p{g.partition} {g.kind}[{g.start},{g.end})" for g in plan.gaps]
    return " ".join(parts)


@dataclass(frozen=True)
class HeadStatus:
    """One partition of the status report."""

    partition: int
    next_offset: int | None
    low: int
    high: int
    lag: int


def head_status(conn: Connection, pipeline: Pipeline, offsets: list[PartitionOffsets]) -> list[HeadStatus]:
    heads = read_heads(conn, pipeline.name)
    return [
        HeadStatus(o.partition, heads.get(o.partition), o.low, o.high, o.last_stable - heads.get(o.partition, o.low))
        for o in offsets
    ]


@dataclass(frozen=True)
class Reset:
    """What a ledger reset of one partition does (or did, once `applied`)."""

    partition: int
    from_offset: int | None
    to_offset: int | None
    abandoned_batch: int | None
    applied: bool
    message: str


def reset_head(
    settings: Settings,
    pipeline: Pipeline,
    partition: int,
    to_offset: int | None,
    *,
    reason: str,
    confirm: bool,
    archive_old_rows: bool = False,
) -> Reset:
    """Realign one partition's head after the topic was recreated or restored; recorded forever.

    `to_offset=None` drops the head of a partition the topic no longer has. Without
    `confirm` nothing changes and the returned message says what would happen. Rows promoted
    from the old topic keep their provenance; a recreated topic reuses offsets, so
    `archive_old_rows` moves them (target and quarantine) into kafka2pg.archived_rows.
    """
    offsets = {o.partition: o for o in partition_offsets(settings.kafka, pipeline.topic)}
    if to_offset is not None:
        broker = offsets.get(partition)
        if broker is None or not broker.low <= to_offset <= broker.high:
            where = "does not exist" if broker is None else f"holds offsets [{broker.low}, {broker.high})"
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: cannot reset partition {partition} to {to_offset}: the partition {where}"
            )
    elif partition in offsets:
        raise BatchStateError(f"partition {partition} of {pipeline.topic!r} exists: give --to-offset")
    with transaction(settings.database_url) as conn:
        lock_plan(conn, pipeline.name)
        open_id = open_batch_id(conn, pipeline)  # before the heads: see open_batch
        current = read_heads(conn, pipeline.name).get(partition)
        target = "dropped (partition gone)" if to_offset is None else str(to_offset)
        message = f"pipeline {pipeline.name} partition {partition}: head {current} -> {target}"
        if open_id is not None:
            message += f"; unfinished batch {open_id} is abandoned"
        old_rows = _old_rows(conn, pipeline, partition)
        if old_rows:
            message += (
                f"; {old_rows} promoted/quarantined rows of partition {partition} came from the topic before the "
                + ("reset: archived to kafka2pg.archived_rows" if archive_old_rows else "reset and keep their offsets")
            )
        if not confirm:
            return Reset(partition, current, to_offset, open_id, False, message)
        lock_partitions(conn, pipeline.name, [partition], f"ledger reset of partition {partition}")
        if open_id is not None:
            abandon_lookaheads(conn, pipeline, f"ledger reset: {reason}")
            set_state(conn, load_batch(conn, open_id), "abandoned", error=f"ledger reset: {reason}")
        last = conn.execute(
            "SELECT coalesce(max(batch_id), 0) FROM kafka2pg.batches WHERE pipeline = %s", (pipeline.name,)
        ).fetchone()[0]
        reset_id = conn.execute(
            "INSERT INTO kafka2pg.ledger_resets (pipeline, topic, kafka_partition, from_offset, to_offset,"
            " after_batch_id, reason, reset_by) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING reset_id",
            (pipeline.name, pipeline.topic, partition, current, to_offset, last, reason, getpass.getuser()),
        ).fetchone()[0]
        if archive_old_rows:
            _archive_rows(conn, pipeline, partition, reset_id)
        conn.execute(
            "DELETE FROM kafka2pg.ledger_heads WHERE pipeline = %s AND kafka_partition = %s", (pipeline.name, partition)
        )
        if to_offset is not None:
            conn.execute(
                "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset)"
                " VALUES (%s, %s, %s, %s)",
                (pipeline.name, pipeline.topic, partition, to_offset),
            )
    log.warning("ledger reset: %s (reason: %s)", message, reason)
    return Reset(partition, current, to_offset, open_id, True, message)
