"""Opening a batch (DESIGN step 1): ledger heads + broker offsets -> planner -> a recorded batch;
or the pipeline's unfinished batch resumed under a new claim. Also the lookahead batch of a
multi-batch run, and the time-to-data-loss horizons."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from psycopg import Connection

from kafka2pg.batch_store import (
    Batch,
    abandon_lookaheads,
    abandon_unpromoted,
    claim,
    insert_batch,
    load_batch,
    load_claimed,
    open_batch_id,
    open_live_ids,
)
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction, waits_logged
from kafka2pg.exceptions import BatchStateError, LedgerConflictError, OffsetRegressionError, RetentionLossError
from kafka2pg.kafka_offsets import PartitionOffsets, TopicAdmin
from kafka2pg.kafka_reader import first_timestamps
from kafka2pg.ledger import check_topic_identity, lock_plan, read_head_batches, read_heads
from kafka2pg.lifecycle import OPEN, BatchState, resume_or_abandon
from kafka2pg.locations import COMMAND
from kafka2pg.planner import (
    BatchPlan,
    LossHorizon,
    OffsetRange,
    PartitionState,
    describe_ranges,
    loss_horizon,
    plan_batch,
    time_left,
)
from kafka2pg.rows import clear_finished_staging
from kafka2pg.stuck import stuck_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedBatch:
    """The outcome of the plan step: the batch to work on (None: nothing new), and why."""

    batch: Batch | None
    resumed: bool
    message: str


def open_batch(
    settings: Settings,
    pipeline: Pipeline,
    *,
    max_records_per_batch: int | None = None,
    run_id: str | None = None,
    dry_run: bool = False,
    job_retry: bool = False,
    kafka: TopicAdmin | None = None,
) -> OpenedBatch:
    """Resume the pipeline's unfinished batch, or plan and record the next one.

    `job_retry`: called by a retried stage job of several batches of the same run
    (`batch_store.claim`). `kafka`: the client the caller asks its topic with, else a new one.

    Rule: an unfinished live batch (planned/staged/validated) is resumed with its exact
    ranges while every head it expects is still in place; otherwise it is marked `abandoned`
    (it never promoted anything, so nothing is undone) and a fresh batch is planned.
    """
    kafka = kafka or topic_admin(settings, pipeline)
    offsets, identity = kafka.offsets(), kafka.topic_id()
    with transaction(settings.database_url) as conn:
        with waits_logged(settings.database_url, conn, f"pipeline={pipeline.name} the plan"):
            # One planner per pipeline at a time; promotion is still fenced by compare-and-set.
            lock_plan(conn, pipeline.name)
            # Lock the open batch BEFORE reading heads: a promote of it still in flight commits
            # first, so the heads read below are never older than the batch states seen.
            open_id = open_batch_id(conn, pipeline)
        if not dry_run:  # this run takes the pipeline over: an earlier run's lookahead is void
            abandon_lookaheads(conn, pipeline, f"run {run_id} took the pipeline over before it was promoted")
        heads = read_heads(conn, pipeline.name)
        opened = _open(
            conn, pipeline, offsets, identity, heads, open_id, max_records_per_batch, run_id, dry_run, job_retry
        )
    _warn_loss_horizons(settings, pipeline, offsets, heads, kafka)  # asks Kafka: after the plan lock is released
    return opened


def _open(
    conn: Connection,
    pipeline: Pipeline,
    offsets: list[PartitionOffsets],
    identity: str | None,
    heads: dict[int, int],
    open_id: int | None,
    max_records_per_batch: int | None,
    run_id: str | None,
    dry_run: bool,
    job_retry: bool = False,
) -> OpenedBatch:
    resumed, abandoned = _resume_or_abandon(
        conn, pipeline, open_id, heads, offsets, identity, run_id, dry_run=dry_run, job_retry=job_retry
    )
    if resumed is not None:
        verb = "dry run: would resume" if dry_run else "resuming"
        message = f"{verb} unfinished batch {resumed.batch_id} ({resumed.state}, epoch {resumed.epoch})"
        for stuck in stuck_batches(conn, pipeline.name, resumed.batch_id):  # said before it fails again
            message += f"; it is STUCK: it failed at {stuck.step} in {stuck.runs} consecutive runs (`{COMMAND} status`)"
        return OpenedBatch(resumed, True, message)
    check_topic_identity(conn, pipeline, identity)
    moved = read_head_batches(conn, pipeline.name)
    plan = _plan_from(
        pipeline, offsets, identity, heads, moved, max_records_per_batch, _planned_from(abandoned, identity, heads)
    )
    if plan.is_empty:
        return OpenedBatch(None, False, _nothing_new(pipeline, offsets, heads))
    if dry_run:
        draft = Batch(0, pipeline.name, pipeline.topic, BatchState.PLANNED, plan)  # not recorded
        message = f"dry run: would read {plan.record_budget} offsets: {describe_ranges(plan.ranges)}; nothing recorded"
        return OpenedBatch(draft, False, message)
    batch = insert_batch(conn, pipeline, plan, run_id)
    cleared = clear_finished_staging(conn, pipeline)
    if cleared:
        log.info("pipeline=%s %s staging rows of rejected or abandoned batches deleted", pipeline.name, cleared)
    return OpenedBatch(batch, False, f"planned batch {batch.batch_id}: {plan.record_budget} offsets")


def topic_admin(settings: Settings, pipeline: Pipeline) -> TopicAdmin:
    """The pipeline's topic, asked through one Kafka client for all of a step's questions."""
    return TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)


def loss_horizons(
    settings: Settings,
    pipeline: Pipeline,
    offsets: list[PartitionOffsets],
    heads: dict[int, int],
    kafka: TopicAdmin | None = None,
) -> list[LossHorizon]:
    """Per partition: unread records, margin to the low watermark, estimated time to data loss
    (`kafka`: the client the step asks its topic with, else a new one)."""
    retention = (kafka or topic_admin(settings, pipeline)).retention()
    now_ms = int(time.time() * 1000)
    states = _states(offsets, heads)
    retention_ms = retention.retention_ms if retention.deletes else None
    unread = []
    if retention_ms is not None:
        for state in states:
            # Below the low watermark nothing can be read: the plan reports that loss itself.
            first_unread = max(state.low, state.low if state.head is None else state.head)
            if first_unread < state.last_stable:
                unread.append(OffsetRange(state.partition, first_unread, state.last_stable))
    timestamps = first_timestamps(settings.kafka, pipeline.topic, unread, settings.kafka_timeout_s) if unread else {}
    return [loss_horizon(s, timestamps.get(s.partition), now_ms, retention_ms) for s in states]


def _warn_loss_horizons(
    settings: Settings, pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int], kafka: TopicAdmin
) -> None:
    """Log each partition's time to data loss. Advice on a plan already committed: a failure to
    work it out (Kafka gone since, a record unreadable) is logged and never fails the plan."""
    try:
        horizons = loss_horizons(settings, pipeline, offsets, heads, kafka)
    except Exception as exc:  # noqa: BLE001 - advice only: the plan it would fail is committed
        log.warning(
            "pipeline=%s time to data loss not known: %s: %s; the plan stands", pipeline.name, type(exc).__name__, exc
        )
        return
    for h in horizons:
        if not h.unread:
            continue
        if h.unstamped:
            left = "unknown (the oldest unread record has no Kafka timestamp)"
        else:
            left = "no time-based retention" if h.seconds_left is None else time_left(h.seconds_left)
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
    offsets: list[PartitionOffsets],
    heads: dict[int, int],
    moved: dict[int, int | None] | None = None,
    planned_from: dict[int, int] | None = None,
) -> list[PartitionState]:
    moved, planned_from = moved or {}, planned_from or {}
    return [
        PartitionState(
            o.partition,
            heads.get(o.partition),
            o.low,
            o.last_stable,
            o.high,
            moved.get(o.partition),
            planned_from.get(o.partition),
        )
        for o in offsets
    ]


def _nothing_new(pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int]) -> str:
    parts = ", ".join(f"p{o.partition}@{heads.get(o.partition, o.low)}/{o.last_stable}" for o in offsets)
    return f"nothing new on topic {pipeline.topic!r} ({parts}): no batch planned, Spark not launched"


# A lookahead follows a staged batch; its quality gate and promotion may have run meanwhile
# (a multi-batch run finishes a batch beside planning the next one).
_LOOKAHEAD_AFTER = (BatchState.STAGED, BatchState.VALIDATED, BatchState.PROMOTED)


def plan_lookahead(
    settings: Settings,
    pipeline: Pipeline,
    after_id: int,
    after_epoch: int | None,
    *,
    max_records_per_batch: int | None = None,
    run_id: str | None = None,
    kafka: TopicAdmin | None = None,
) -> Batch | None:
    """Plan the batch that follows batch `after_id` (claimed by this run at `after_epoch`: still
    open, or promoted by this run since) from its planned ends; if one is already planned after
    it (by a killed attempt holding the same claim), claim that one instead.

    For every partition `after_id` reads, its compare-and-set expects that batch's new head,
    so there it promotes only once that one has; other partitions are planned from the ledger's
    heads, as any batch. If `after_id` is rejected or fenced, the run (or the next one's plan
    step) abandons the lookahead. None: nothing new. `kafka`: the client the caller asks its
    topic with (the run's, for all its plans and stages), else a new one.
    """
    kafka = kafka or topic_admin(settings, pipeline)
    offsets, identity = kafka.offsets(), kafka.topic_id()
    with transaction(settings.database_url) as conn:
        lock_plan(conn, pipeline.name)
        check_topic_identity(conn, pipeline, identity)
        # Read, not locked: this run may be validating or promoting it meanwhile; the claim and
        # the plan (all a lookahead depends on) change only under the plan lock held here.
        current = load_claimed(conn, pipeline, after_id, after_epoch, lock=False)
        if current.kind != "live" or current.state not in _LOOKAHEAD_AFTER:
            raise BatchStateError(
                f"batch {after_id} of pipeline {pipeline.name!r} is a {current.kind} batch in state "
                f"{current.state}: no batch can be planned after it",
                pipeline=pipeline.name,
                batch_id=after_id,
                state=current.state,
                kind=current.kind,
            )
        later = open_live_ids(conn, pipeline, after=after_id)
        mine = conn.execute(
            "SELECT batch_id FROM kafka2pg.batches WHERE after_batch_id = %s AND state = ANY(%s)",
            (after_id, [str(s) for s in OPEN]),
        ).fetchone()
        if mine is not None and later == [mine[0]]:
            # A retry of this run's job (same claim on `after_id`) finds the lookahead its killed
            # attempt planned: take it over (a newer claim fences the dead attempt) and go on.
            return claim(conn, load_batch(conn, mine[0]), run_id, job_retry=True)
        if later:
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: batch {later[0]} is already planned after {after_id}",
                pipeline=pipeline.name,
                batch_id=after_id,
                lookahead_id=later[0],
            )
        heads = read_heads(conn, pipeline.name)
        moved = read_head_batches(conn, pipeline.name)
        if current.state is BatchState.PROMOTED:  # a claim no longer fences it: the heads must still be its own
            for part in current.plan.partitions:
                if moved.get(part.partition) != after_id:
                    raise LedgerConflictError.moved_on(
                        pipeline.name, after_id, part.partition, moved.get(part.partition)
                    )
        heads.update({p.partition: p.new_head for p in current.plan.partitions})
        moved.update({p.partition: after_id for p in current.plan.partitions})
        if current.plan.in_another_topic(identity):
            raise OffsetRegressionError.recreated(
                pipeline.name,
                pipeline.topic,
                [p.partition for p in current.plan.partitions],
                current.plan.topic_id,
                identity,
            )
        plan = _plan_from(pipeline, offsets, identity, heads, moved, max_records_per_batch)
        if plan.is_empty:
            return None
        return insert_batch(conn, pipeline, plan, run_id, after_batch_id=after_id)


def ledger_refusal(
    settings: Settings,
    pipeline: Pipeline,
    conn: Connection,
    offsets: list[PartitionOffsets],
    kafka: TopicAdmin | None = None,
) -> OffsetRegressionError | RetentionLossError | None:
    """Why the next run cannot plan from the ledger's heads, by the plan step's own checks: the
    topic deleted and recreated, partitions gone, a head beyond the high watermark, offsets expired
    unread under `on_retention_loss: fail` (where the open batch the plan would abandon meant to
    start a partition without a head included). An open batch the run resumes counts as promoted:
    the plan after it is judged. None when the heads fit the topic. Asks Kafka for the topic's ID;
    reads the ledger over `conn` without a lock (status, not a plan): the open batch first, then
    the heads, as a plan reads them. `kafka`: the client the caller asks the topic with, else a new one."""
    identity = (kafka or topic_admin(settings, pipeline)).topic_id()
    open_ids = open_live_ids(conn, pipeline, locked=False)
    batch = load_batch(conn, open_ids[0]) if open_ids else None
    heads, moved = read_heads(conn, pipeline.name), read_head_batches(conn, pipeline.name)
    abandoned = None
    if batch is not None and batch.state in OPEN:  # not finished between the two reads
        if _abandon_reasons(pipeline, batch, heads, offsets, identity) is None:  # resumed, then planned after
            heads.update({p.partition: p.new_head for p in batch.plan.partitions})
            moved.update({p.partition: batch.batch_id for p in batch.plan.partitions})
        else:
            abandoned = batch
    try:
        check_topic_identity(conn, pipeline, identity)
        _plan_from(pipeline, offsets, identity, heads, moved, None, _planned_from(abandoned, identity, heads))
    except (OffsetRegressionError, RetentionLossError) as exc:
        return exc
    return None


def blocked_words(
    settings: Settings,
    pipeline: Pipeline,
    conn: Connection,
    offsets: list[PartitionOffsets] | None = None,
    kafka: TopicAdmin | None = None,
) -> str | None:
    """`ledger_refusal` as `status` and `verify` say it (the error's name and words); None when the
    heads fit the topic. Asks Kafka for the offsets unless given: Kafka's errors are the caller's."""
    kafka = kafka or topic_admin(settings, pipeline)
    refusal = ledger_refusal(settings, pipeline, conn, kafka.offsets() if offsets is None else offsets, kafka)
    return None if refusal is None else f"{type(refusal).__name__}: {refusal}"


def _plan_from(
    pipeline: Pipeline,
    offsets: list[PartitionOffsets],
    identity: str | None,
    heads: dict[int, int],
    moved: dict[int, int | None],
    max_records_per_batch: int | None,
    planned_from: dict[int, int] | None = None,
) -> BatchPlan:
    """The next batch's plan from these heads (last moved by the `moved` batches), with the
    pipeline's limits and policies, in the topic whose ID is `identity`; `planned_from`: see
    `PartitionState`."""
    plan = plan_batch(
        pipeline.name,
        pipeline.topic,
        _states(offsets, heads, moved, planned_from),
        max_records_per_batch=max_records_per_batch or pipeline.max_records_per_batch,
        max_records_per_partition=pipeline.max_records_per_partition,
        on_retention_loss=pipeline.on_retention_loss,
        new_partition_start=pipeline.new_partition_start,
        ledger_partitions=tuple(heads),
    )
    return replace(plan, topic_id=identity)


def _resume_or_abandon(
    conn: Connection,
    pipeline: Pipeline,
    open_id: int | None,
    heads: dict[int, int],
    offsets: list[PartitionOffsets],
    identity: str | None,
    run_id: str | None,
    *,
    dry_run: bool,
    job_retry: bool = False,
) -> tuple[Batch | None, Batch | None]:
    """(the open batch, resumed under a new claim; or the batch abandoned (or that a dry run
    would abandon)); (None, None) when there is no open batch."""
    if open_id is None:
        return None, None
    batch = load_batch(conn, open_id)
    reasons = _abandon_reasons(pipeline, batch, heads, offsets, identity)
    if reasons is None:
        return (batch if dry_run else claim(conn, batch, run_id, job_retry=job_retry)), None
    why, error = reasons
    if dry_run:
        log.info("pipeline=%s dry run: would abandon batch %s (%s)", pipeline.name, batch.batch_id, why)
        return None, batch
    log.warning("pipeline=%s batch_id=%s abandoned: %s", pipeline.name, batch.batch_id, why)
    abandon_unpromoted(conn, pipeline, batch, error)
    return None, batch


def _abandon_reasons(
    pipeline: Pipeline, batch: Batch, heads: dict[int, int], offsets: list[PartitionOffsets], identity: str | None
) -> tuple[str, str] | None:
    """Why the next plan abandons the open `batch` (what to log, what to record), or None when it
    resumes it."""
    stale = [p.partition for p in batch.plan.partitions if heads.get(p.partition) != p.expected_head]
    # Not read yet, and Kafka no longer holds all of it (retention or delete-records since planning,
    # or a partition that shrank or is gone): re-reading it can only fail; planning afresh reports
    # the loss (or records it, under `skip`), or the offset regression.
    held = {o.partition: o for o in offsets}
    expired = [
        r.partition
        for r in batch.plan.ranges
        if r.partition not in held or r.start < held[r.partition].low or r.end > held[r.partition].high
    ]
    # Planned in the topic as it was before it was deleted and recreated: abandoned whatever its
    # state. Its ranges are offsets of records that are gone, and rows it staged from them cannot
    # be checked against Kafka (the gate's witnesses, the quarantine's raw bytes would read the new
    # topic's records); the plan then names the heads' topic, if they have one.
    recreated = batch.plan.in_another_topic(identity)
    if not recreated and resume_or_abandon(batch.state, stale, expired):
        return None
    if recreated:
        gone = f"topic {pipeline.topic!r} was deleted and recreated since it was planned "
        return (gone + f"(ID {batch.plan.topic_id} -> {identity})",) * 2
    if stale:
        return (
            f"ledger heads of partitions {stale} moved since it was planned",
            f"heads of partitions {stale} moved before promotion",
        )
    expired_unread = (
        f"Kafka no longer holds planned offsets of partitions {expired} (deleted, or the partition shrank or is "
        "gone) and they were not read"
    )
    return expired_unread, expired_unread


def _planned_from(abandoned: Batch | None, identity: str | None, heads: dict[int, int]) -> dict[int, int]:
    """Where the `abandoned` batch (of this topic) meant to read partitions without a head from."""
    if abandoned is None or abandoned.plan.in_another_topic(identity):
        return {}
    return {r.partition: r.start for r in abandoned.plan.ranges if r.partition not in heads}
