"""Offset arithmetic of one micro-batch: which half-open ranges [start, end) to read next.

Pure code on plain values; no Kafka, PostgreSQL or Spark import. Every `+1`/exclusive-end
decision lives here: a range's `end` is the next offset to read after the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kafka2pg.exceptions import OffsetRegressionError, RetentionLossError

GapKind = Literal["retention_gap", "skipped_new_partition"]


@dataclass(frozen=True)
class OffsetRange:
    """Offsets [start, end) of one partition; `end` is exclusive."""

    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid offset range [{self.start}, {self.end}) on p{self.partition}")

    @property
    def size(self) -> int:
        return self.end - self.start


def describe_ranges(ranges) -> str:
    """`p0[100,200) p1[0,50)`: how ranges read in logs and messages."""
    return " ".join(f"p{r.partition}[{r.start},{r.end})" for r in ranges)


@dataclass(frozen=True)
class Gap:
    """Offsets [start, end) the ledger skips on purpose, with the reason."""

    partition: int
    start: int
    end: int
    kind: GapKind

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PartitionState:
    """What the ledger and the broker say about one partition right now.

    `head` is the ledger's next offset to read (None: never read). `last_stable` is the
    read_committed end (LSO); `high` the high watermark; `low` the first retained offset.
    `last_batch_id` is the batch that last moved the head (None: none has): when the budget
    cannot give every partition a record, the partitions whose heads moved longest ago go first.
    `planned_from`: for a partition without a head, where an abandoned batch had planned to start
    reading it: the records from there on were meant to load, and those Kafka has deleted since
    are a retention loss, as below a head.
    """

    partition: int
    head: int | None
    low: int
    last_stable: int
    high: int
    last_batch_id: int | None = None
    planned_from: int | None = None


@dataclass(frozen=True)
class PartitionPlan:
    """One partition's part of a batch: the head it expects, then an optional gap and range."""

    partition: int
    expected_head: int | None
    gap: Gap | None
    range: OffsetRange | None

    @property
    def new_head(self) -> int:
        if self.range is not None:
            return self.range.end
        if self.gap is not None:
            return self.gap.end
        assert self.expected_head is not None
        return self.expected_head


@dataclass(frozen=True)
class BatchPlan:
    """The ranges one batch reads and the gaps it records, per partition."""

    pipeline: str
    topic: str
    partitions: tuple[PartitionPlan, ...] = field(default_factory=tuple)
    topic_id: str | None = None  # the ID of the topic the offsets were planned in (None: not known)

    @property
    def ranges(self) -> tuple[OffsetRange, ...]:
        return tuple(p.range for p in self.partitions if p.range is not None)

    @property
    def gaps(self) -> tuple[Gap, ...]:
        return tuple(p.gap for p in self.partitions if p.gap is not None)

    @property
    def record_budget(self) -> int:
        return sum(r.size for r in self.ranges)

    @property
    def is_empty(self) -> bool:
        return not self.partitions

    def in_another_topic(self, topic_id: str | None) -> bool:
        """Whether these offsets were planned in another topic than the one with `topic_id` (the
        name's topic deleted and recreated since). Only IDs tell: where the plan or Kafka has
        none (a cluster before topic IDs, a plan made before they were recorded), not."""
        return None not in (self.topic_id, topic_id) and self.topic_id != topic_id

    def to_json(self) -> dict:
        return {
            "pipeline": self.pipeline,
            "topic": self.topic,
            "partitions": [
                {
                    "partition": p.partition,
                    "expected_head": p.expected_head,
                    "gap": None if p.gap is None else {"start": p.gap.start, "end": p.gap.end, "kind": p.gap.kind},
                    "range": None if p.range is None else {"start": p.range.start, "end": p.range.end},
                }
                for p in self.partitions
            ],
            "topic_id": self.topic_id,
        }

    @classmethod
    def from_json(cls, data: dict) -> BatchPlan:
        parts = []
        for p in data["partitions"]:
            gap = p.get("gap")
            rng = p.get("range")
            parts.append(
                PartitionPlan(
                    partition=p["partition"],
                    expected_head=p["expected_head"],
                    gap=None if gap is None else Gap(p["partition"], gap["start"], gap["end"], gap["kind"]),
                    range=None if rng is None else OffsetRange(p["partition"], rng["start"], rng["end"]),
                )
            )
        return cls(data["pipeline"], data["topic"], tuple(parts), data.get("topic_id"))


def plan_batch(
    pipeline: str,
    topic: str,
    states: list[PartitionState],
    *,
    max_records_per_batch: int,
    max_records_per_partition: int | None = None,
    on_retention_loss: Literal["fail", "skip"] = "fail",
    new_partition_start: Literal["earliest", "latest"] = "earliest",
    ledger_partitions: tuple[int, ...] = (),
) -> BatchPlan:
    """Plan the next batch; raise on retention loss (unless skipped) or offset regression.

    `ledger_partitions` are the partitions the ledger has heads for; one the topic no longer
    has (recreated with fewer partitions) is an offset regression too.

    The record budget is shared fairly: every partition with new records gets an equal share,
    and what a small partition leaves over goes to the others (deterministic for equal input).
    Records that do not divide evenly (all of them, with a budget below the number of partitions
    with new records) go to the partitions whose heads moved longest ago (`last_batch_id`), so
    with a budget of b and P such partitions each is read at least once in any ceil(P / b)
    consecutive batches.
    """
    vanished = sorted(set(ledger_partitions) - {s.partition for s in states})
    if vanished:
        raise OffsetRegressionError.partitions_gone(pipeline, topic, vanished)
    starts: dict[int, tuple[int | None, int, Gap | None]] = {}
    for state in sorted(states, key=lambda s: s.partition):
        starts[state.partition] = _start_of(pipeline, topic, state, on_retention_loss, new_partition_start)
    available = {s.partition: max(0, s.last_stable - starts[s.partition][1]) for s in states}
    if max_records_per_partition is not None:
        available = {p: min(n, max_records_per_partition) for p, n in available.items()}
    allotted = _share(available, max_records_per_batch, _least_recently_moved(states))
    plans = []
    for partition, (expected_head, start, gap) in sorted(starts.items()):
        count = allotted.get(partition, 0)
        rng = OffsetRange(partition, start, start + count) if count else None
        if rng is None and gap is None:
            continue  # nothing new (or a new, empty partition): nothing to record
        plans.append(PartitionPlan(partition, expected_head, gap, rng))
    return BatchPlan(pipeline, topic, tuple(plans))


def _start_of(
    pipeline: str,
    topic: str,
    state: PartitionState,
    on_retention_loss: str,
    new_partition_start: str,
) -> tuple[int | None, int, Gap | None]:
    """(expected head, first offset to read, gap to record before it) for one partition."""
    if state.head is None:
        if state.planned_from is not None and state.planned_from < state.low:  # deleted before it was read
            if on_retention_loss == "skip":
                return None, state.low, Gap(state.partition, state.planned_from, state.low, "retention_gap")
            raise RetentionLossError.expired(pipeline, topic, state.partition, state.planned_from, state.low)
        if new_partition_start == "latest" and state.last_stable > state.low:
            gap = Gap(state.partition, state.low, state.last_stable, "skipped_new_partition")
            return None, state.last_stable, gap
        return None, state.low, None
    if state.head > state.high:
        raise OffsetRegressionError.beyond_high_watermark(pipeline, topic, state.partition, state.head, state.high)
    if state.head < state.low:
        if on_retention_loss == "skip":
            return state.head, state.low, Gap(state.partition, state.head, state.low, "retention_gap")
        raise RetentionLossError.expired(pipeline, topic, state.partition, state.head, state.low)
    return state.head, state.head, None


def _least_recently_moved(states: list[PartitionState]) -> list[int]:
    """Partitions by how long ago their heads moved: never moved first, then by the batch that
    last moved them, then by partition id."""
    return [
        s.partition
        for s in sorted(states, key=lambda s: (s.last_batch_id is not None, s.last_batch_id or 0, s.partition))
    ]


def _share(available: dict[int, int], budget: int, priority: list[int]) -> dict[int, int]:
    """Water-filling split of `budget` over partitions capped by `available`; records that do not
    divide evenly go first to the partitions earliest in `priority`."""
    rank = {p: i for i, p in enumerate(priority)}
    allotted = {p: 0 for p in available}
    open_parts = [p for p in available if available[p] > 0]
    while budget > 0 and open_parts:
        share, extra = divmod(budget, len(open_parts))
        next_open = []
        # Extras go to the partitions that got least so far, so shares differ by at most one.
        for index, partition in enumerate(sorted(open_parts, key=lambda p: (allotted[p], rank[p]))):
            want = share + (1 if index < extra else 0)
            room = available[partition] - allotted[partition]
            take = min(want, room)
            allotted[partition] += take
            budget -= take
            if allotted[partition] < available[partition]:
                next_open.append(partition)
        open_parts = next_open
    return allotted


@dataclass(frozen=True)
class GapAccount:
    """Why a read range [start, end) of one partition holds fewer records than offsets.

    `read` is what Spark staged; `committed` and `data_records` are what an independent
    consumer finds in the range with read_committed and read_uncommitted. Offsets with no
    data record at all are transaction markers, or (on a compacted topic) compacted away —
    Kafka does not let a client tell those two apart. `problem` is set when the numbers do
    not add up; such a batch is held, not promoted.
    """

    partition: int
    size: int
    read: int
    committed: int
    aborted: int
    markers: int
    compacted: int
    problem: str | None = None

    @property
    def gap(self) -> int:
        return self.size - self.read


def account_gap(
    rng: OffsetRange, read: int, committed: int | None, data_records: int | None, *, compacted_topic: bool
) -> GapAccount:
    """Explain `rng.size - read` (a dense range needs no witness: pass None, None)."""
    if read == rng.size:
        return GapAccount(rng.partition, rng.size, read, read, 0, 0, 0)
    if committed is None or data_records is None:
        raise ValueError(f"p{rng.partition}: a range with a gap needs the witness counts")
    empty = rng.size - data_records
    account = GapAccount(
        rng.partition,
        rng.size,
        read,
        committed,
        aborted=data_records - committed,
        markers=0 if compacted_topic else empty,
        compacted=empty if compacted_topic else 0,
    )
    where = f"partition {rng.partition} [{rng.start}, {rng.end})"
    if read != committed:
        problem = f"{where}: Spark read {read} records but a read_committed consumer finds {committed}"
    elif not committed <= data_records <= rng.size:
        problem = f"{where}: {committed} committed and {data_records} data records cannot fit {rng.size} offsets"
    else:
        return account
    return GapAccount(**{**account.__dict__, "problem": problem})


@dataclass(frozen=True)
class LossHorizon:
    """How close retention is to deleting records the pipeline has not read yet (one partition).

    `records_margin` = head - low watermark: how many older records the broker deletes first.
    `seconds_left` estimates when the oldest unread record (timestamp `head_timestamp_ms`)
    passes `retention.ms`; None when nothing is unread or retention by time is off.
    """

    partition: int
    unread: int
    records_margin: int
    seconds_left: float | None
    unstamped: bool = False  # the oldest unread record has no Kafka timestamp: the time is unknown

    def at_risk(self, warning_hours: float) -> bool:
        return self.seconds_left is not None and self.seconds_left < warning_hours * 3600


def time_left(seconds: float) -> str:
    """Time to data loss in words: hours, or overdue (the oldest unread record's timestamp is past
    retention.ms already: Kafka deletes it with its segment, at the next roll or check)."""
    return f"~{seconds / 3600:.1f} h" if seconds > 0 else "overdue (past retention.ms: Kafka may delete it any time)"


def loss_horizon(
    state: PartitionState, head_timestamp_ms: int | None, now_ms: int, retention_ms: int | None
) -> LossHorizon:
    head = state.low if state.head is None else state.head
    unread = max(0, state.last_stable - head)
    seconds_left = None
    unstamped = bool(unread) and retention_ms is not None and head_timestamp_ms == NO_TIMESTAMP_MS
    if unread and retention_ms is not None and head_timestamp_ms is not None and not unstamped:
        seconds_left = (head_timestamp_ms + retention_ms - now_ms) / 1000
    return LossHorizon(state.partition, unread, head - state.low, seconds_left, unstamped)


# Kafka's timestamp of a record without one (RecordBatch.NO_TIMESTAMP).
NO_TIMESTAMP_MS = -1


def ledger_breaks(ranges: list[tuple[int, int]], head: int | None, start: int | None = None) -> list[str]:
    """Where a partition's ledger is not one contiguous, non-overlapping run ending at the head.

    `ranges` are every ledgered range (batches and recorded gaps), sorted by start; `start`,
    after a reset, is the offset the partition was reset to (where its ranges must begin).
    """
    if not ranges and head == start:
        return []  # reset, nothing consumed since
    breaks = []
    if start is not None and ranges and ranges[0][0] != start:
        breaks.append(f"ledger restarts at {ranges[0][0]} but the partition was reset to {start}")
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            breaks.append(f"ranges overlap at [{start}, {end})")
        elif start > end:
            breaks.append(f"unrecorded hole [{end}, {start})")
    last = ranges[-1][1] if ranges else None
    if last != head:
        breaks.append(f"ledger ends at {last} but the head is {head}")
    return breaks
