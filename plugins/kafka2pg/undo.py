"""Undo: take the newest promoted live batch back (delete its rows, rewind its heads and ledger
ranges), only when it is the newest batch of every partition it touched; otherwise a replay
of the range is the way (`kafka2pg.replay`). And abandon a replay batch left open by a run
that will not finish it (nothing of it was promoted: only its staging rows go)."""

from __future__ import annotations

import getpass
import logging
from dataclasses import dataclass

from psycopg import Connection

from kafka2pg.batch_store import (
    Batch,
    abandon_lookaheads,
    abandon_unpromoted,
    load_batch,
    load_claimed,
    open_batch_id,
    transition,
)
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction
from kafka2pg.exceptions import ReplayRefusedError
from kafka2pg.kafka_offsets import TopicAdmin
from kafka2pg.ledger import lock_partitions, lock_plan, reset_floors
from kafka2pg.lifecycle import CLI_RUN_ID, BatchState, is_open
from kafka2pg.locations import COMMAND
from kafka2pg.planner import OffsetRange, describe_ranges
from kafka2pg.replay import count_rows, delete_rows, finish_record, record_operation
from kafka2pg.replay_process import process_locks, running_pid
from kafka2pg.rows import range_predicate, staged_counts
from kafka2pg.stuck import ABANDON_COMMAND

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Undo:
    batch_id: int
    ranges: tuple[OffsetRange, ...]
    rows: tuple[int, int]
    applied: bool
    message: str


# Where the next plan starts a partition left without a head, as the undo preview says it.
_NEW_START = {
    "earliest": "at its low watermark, reading its records again (new_partition_start: earliest)",
    "latest": "at its end then, SKIPPING its records (new_partition_start: latest)",
}


def _refuse_records_gone(
    where: str, pipeline: Pipeline, batch: Batch, topic_id: str | None, lows: dict[int, int]
) -> None:
    """An undo deletes rows the next live run is to load again: refused when Kafka (its topic ID
    and low watermarks, asked before the locks and again under them) no longer holds their records (retention deleted
    them since, or the topic was deleted and recreated), which would lose those rows for good,
    not even as a recorded gap where the batch started a partition."""
    if batch.plan.in_another_topic(topic_id):
        raise ReplayRefusedError(
            f"{where} was read from topic {pipeline.topic!r} before it was deleted and recreated: its records are "
            "gone, and undoing it would delete its rows with nothing to load in their place.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            topic=pipeline.topic,
        )
    ranges = [p.range for p in batch.plan.partitions if p.range is not None]
    held = {r.partition: max(r.start, lows.get(r.partition, r.end)) for r in ranges}
    gone = [r for r in ranges if held[r.partition] > r.start]
    if not gone:
        return
    still = ",".join(f"{r.partition}:{held[r.partition]}-{r.end}" for r in ranges if held[r.partition] < r.end)
    raise ReplayRefusedError(
        f"{where}: records {', '.join(f'p{r.partition}[{r.start}, {min(held[r.partition], r.end)})' for r in gone)} "
        "are gone from Kafka (retention deleted them since); undoing the batch would delete their rows and the "
        "next run could not load them again."
        + (
            f" To correct the rows of the batch's records Kafka still holds, replay them: "
            f"`{COMMAND} replay --pipeline {pipeline.name} --offsets {still}`."
            if still
            else ""
        ),
        pipeline=pipeline.name,
        batch_id=batch.batch_id,
        offsets=[(r.partition, r.start, min(held[r.partition], r.end)) for r in gone],
    )


def _held(kafka: TopicAdmin) -> tuple[str | None, dict[int, int]]:
    """The topic's ID and each partition's low watermark: what Kafka holds now."""
    return kafka.topic_id(), {o.partition: o.low for o in kafka.offsets()}


def undo_batch(
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    *,
    confirm: bool,
    reason: str = "",
    requested_by: str = "",
) -> Undo:
    """Take one promoted live batch back: delete its range's rows, rewind heads and ledger, atomically.

    Allowed only when, on every partition it touched, it is the newest batch (the head is where
    it left it). Otherwise `ReplayRefusedError` says to replay the range instead. Without
    `confirm` nothing changes and the message says what would happen. An unfinished live batch
    is abandoned (it was planned from the heads being rewound).
    """
    kafka = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    if kafka.retention().compacted:
        raise ReplayRefusedError(
            f"pipeline {pipeline.name!r} batch {batch_id}: topic {pipeline.topic!r} is compacted; an undo deletes rows "
            "whose records may since have been compacted away, and the reload could not bring them back. "
            "Use a replay of the range instead (it replaces only what it re-reads).",
            pipeline=pipeline.name,
            batch_id=batch_id,
            topic=pipeline.topic,
        )
    topic_id, lows = _held(kafka)  # before any lock: the preview and the refusals need no wait
    with transaction(settings.database_url, waits=f"pipeline={pipeline.name} undo of batch {batch_id}") as conn:
        # Plan lock, then the open live batch: no live promotion moves a head while this runs.
        lock_plan(conn, pipeline.name)
        open_id = open_batch_id(conn, pipeline)
        batch = load_claimed(conn, pipeline, batch_id, None)  # locked, of this pipeline, whatever its claim
        where = f"pipeline {pipeline.name!r} batch {batch_id}"
        if batch.kind != "live" or batch.state is not BatchState.PROMOTED:
            raise ReplayRefusedError(
                f"{where} is a {batch.kind} batch in state {batch.state}: only a promoted live batch can be undone"
                + (
                    f" ({ABANDON_COMMAND.format(pipeline=pipeline.name, batch_id=batch_id)} discards an open replay"
                    " batch its run will not finish)"
                    if batch.kind == "replay" and is_open(batch.state)
                    else ""
                ),
                pipeline=pipeline.name,
                batch_id=batch_id,
                state=batch.state,
                kind=batch.kind,
            )
        parts = batch.plan.partitions
        floors = reset_floors(conn, pipeline.name)
        reset = [p.partition for p in parts if batch_id <= floors.get(p.partition, 0)]
        if reset:
            raise ReplayRefusedError(
                f"{where} was loaded from the topic as it was before a ledger reset; it cannot be undone",
                pipeline=pipeline.name,
                batch_id=batch_id,
                partitions=reset,
            )
        heads = dict(
            conn.execute(
                "SELECT kafka_partition, last_batch_id FROM kafka2pg.ledger_heads WHERE pipeline = %s", (pipeline.name,)
            ).fetchall()
        )
        newer = {p.partition: heads.get(p.partition) for p in parts if heads.get(p.partition) != batch_id}
        if newer:
            spans = ",".join(f"{r.partition}:{r.start}-{r.end}" for r in batch.plan.ranges)
            moved_by = sorted({b for b in newer.values() if b is not None})
            raise ReplayRefusedError(
                f"{where} is not the newest batch of partition(s) {sorted(newer)} (last moved by batch(es) "
                f"{moved_by}): undoing it would leave a hole in the ledger. Replay its range instead (offsets "
                f"{spans}), e.g. `{COMMAND} replay --pipeline {pipeline.name} --offsets {spans}`.",
                pipeline=pipeline.name,
                batch_id=batch_id,
                partitions=sorted(newer),
                offsets=batch.plan.ranges,
                moved_by=moved_by,
            )
        _refuse_records_gone(where, pipeline, batch, topic_id, lows)
        ranges = tuple(OffsetRange(p.partition, p.gap.start if p.gap else p.range.start, p.new_head) for p in parts)
        in_range = range_predicate(ranges, floors)
        rows = count_rows(conn, pipeline, in_range)
        described = describe_ranges(ranges)
        new_start = _NEW_START[pipeline.new_partition_start]
        message = (
            f"{where}: delete {rows[0]} target and {rows[1]} quarantine rows of {described}, rewind heads to "
            + ", ".join(
                f"p{p.partition}@{p.expected_head}"
                if p.expected_head is not None
                else f"p{p.partition}: no head (the next plan starts it as a new partition: {new_start})"
                for p in parts
            )
        )
        if open_id is not None:
            message += f"; unfinished batch {open_id} is abandoned"
        if not confirm:
            return Undo(batch_id, ranges, rows, False, message)
        # Serialised with replays finishing on these partitions (they delete and insert rows there).
        lock_partitions(conn, pipeline.name, [p.partition for p in parts], f"undo of batch {batch_id}")
        # Asked again under every lock: retention may have deleted the range's first records while
        # this waited for them (a gate holding the open batch, a replay holding the range).
        _refuse_records_gone(where, pipeline, batch, *_held(kafka))
        rows = count_rows(conn, pipeline, in_range)
        if open_id is not None:
            abandon_lookaheads(conn, pipeline, f"batch {batch_id} was undone")
            abandon_unpromoted(conn, pipeline, load_batch(conn, open_id), f"batch {batch_id} was undone")
        delete_rows(conn, pipeline, in_range)
        conn.execute(
            "DELETE FROM kafka2pg.ledger_ranges WHERE pipeline = %s AND batch_id = %s", (pipeline.name, batch_id)
        )
        for p in parts:
            if p.expected_head is None:
                conn.execute(
                    "DELETE FROM kafka2pg.ledger_heads WHERE pipeline = %s AND kafka_partition = %s",
                    (pipeline.name, p.partition),
                )
                continue
            conn.execute(
                "UPDATE kafka2pg.ledger_heads SET next_offset = %s, updated_at = now(), last_batch_id ="
                " (SELECT max(batch_id) FROM kafka2pg.ledger_ranges WHERE pipeline = %s AND kafka_partition = %s"
                "  AND end_offset = %s AND batch_id > %s) WHERE pipeline = %s AND kafka_partition = %s"
                " AND last_batch_id = %s",
                (
                    p.expected_head,
                    pipeline.name,
                    p.partition,
                    p.expected_head,
                    floors.get(p.partition, 0),
                    pipeline.name,
                    p.partition,
                    batch_id,
                ),
            )
        transition(conn, batch, BatchState.UNDONE, error=f"undone: {reason}" if reason else "undone")
        record_operation(conn, pipeline, batch_id, "undo", ranges, None, None, requested_by=requested_by, reason=reason)
        finish_record(conn, batch_id, rows, (0, 0), None)
    log.warning("undo: %s (reason: %s)", message, reason or "-")
    return Undo(batch_id, ranges, rows, True, message + " (recorded in kafka2pg.replays)")


@dataclass(frozen=True)
class Abandon:
    batch_id: int
    staged_rows: int
    applied: bool
    message: str


def abandon_replay(
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    *,
    confirm: bool,
    reason: str = "",
    requested_by: str = "",
) -> Abandon:
    """Abandon an open replay batch whose run will not finish it: a CLI replay whose process is
    gone, an Airflow replay run that failed for good. The batch ends `abandoned` and its staging
    rows are deleted; its kafka2pg.replays record ends too. Nothing of it was promoted, so the
    target, the quarantine, the ledger and the heads stay as they are. A run still working on it
    is fenced off: its next step (a staging chunk, the gate, the finish) finds it abandoned and
    stops without writing. Without `confirm` nothing changes and the message says what would.
    An open live batch is refused: the next live run resumes or abandons it itself."""
    # A step in progress holds the batch's row until its transaction ends: the wait is logged.
    with transaction(settings.database_url, waits=f"pipeline={pipeline.name} abandon of batch {batch_id}") as conn:
        where = f"pipeline {pipeline.name!r} batch {batch_id}"
        # Before the batch's lock, which the running process may hold in a step: refused at once.
        seen = load_claimed(conn, pipeline, batch_id, None, lock=False)
        if seen.kind == "replay" and is_open(seen.state) and seen.run_id == CLI_RUN_ID:
            _refuse_a_running_replay(conn, pipeline, batch_id, where)
        batch = load_claimed(conn, pipeline, batch_id, None)  # locked, of this pipeline, whatever its claim
        if batch.kind != "replay" or not is_open(batch.state):
            why = (
                "the next live run resumes or abandons an open live batch itself"
                if is_open(batch.state)
                else "it is already finished"
            )
            raise ReplayRefusedError(
                f"{where} is a {batch.kind} batch in state {batch.state}: only an open replay batch can be abandoned "
                f"({why})",
                pipeline=pipeline.name,
                batch_id=batch_id,
                state=batch.state,
                kind=batch.kind,
            )
        staged = sum(staged_counts(conn, pipeline, batch_id).values())
        by = f", claimed by run {batch.run_id}" if batch.run_id else ""
        message = (
            f"{where} (replay, {batch.state}{by}) of {describe_ranges(batch.plan.ranges)}: mark it abandoned and"
            f" delete its {staged} staging rows; the target, the quarantine and the heads are unchanged"
        )
        if not confirm:
            return Abandon(batch_id, staged, False, message)
        who = requested_by or getpass.getuser()
        abandon_unpromoted(conn, pipeline, batch, f"abandoned by {who}: {reason}" if reason else f"abandoned by {who}")
        conn.execute(
            "UPDATE kafka2pg.replays SET finished_at = now() WHERE batch_id = %s AND finished_at IS NULL", (batch_id,)
        )
    log.warning("abandon: %s (reason: %s)", message, reason or "-")
    return Abandon(batch_id, staged, True, message)


def _refuse_a_running_replay(conn: Connection, pipeline: Pipeline, batch_id: int, where: str) -> None:
    """`ReplayRefusedError` when the `kafka2pg replay` process of the batch still runs."""
    running = running_pid(process_locks(conn), batch_id)
    if running is not None:
        raise ReplayRefusedError(
            f"{where} is still being replayed by a running `{COMMAND} replay` process (its session: backend pid "
            f"{running}); nothing was changed. Stop that process (Ctrl-C or a kill) and abandon it then; if the "
            f"process is out of reach, SELECT pg_terminate_backend({running}) ends its session (the process, "
            "should it go on, is fenced once the batch is abandoned).",
            pipeline=pipeline.name,
            batch_id=batch_id,
            backend_pid=running,
        )
