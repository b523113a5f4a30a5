"""Replays: re-load a range the ledger already loaded (undo, taking the newest batch back, is
`kafka2pg.undo`; the request itself, `kafka2pg.replay_request`).

A replay is a batch of kind `replay`: it is planned here from explicit offset ranges or a
time window, read and staged by the same Spark job and checked by the same quality gate as a
live batch, then finished in ONE transaction under the partitions' range locks:

- `replace`: delete the range's target and quarantine rows (by provenance), insert the new
  ones, record counts before/after in kafka2pg.replays; the live heads never move;
- `verify-only`: compare the new rows with what the target and quarantine hold, record the
  differences, change nothing.
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from psycopg import Connection, sql
from psycopg.types.json import Jsonb

from kafka2pg.batch_store import (
    Batch,
    insert_batch,
    staging_lost,
    transition,
)
from kafka2pg.checks import KEY_PROMOTED_REASON
from kafka2pg.config import Pipeline, Settings, float_bound
from kafka2pg.database import transaction
from kafka2pg.exceptions import BatchStateError, ReplayRefusedError
from kafka2pg.kafka_offsets import TopicAdmin
from kafka2pg.ledger import (
    last_resets,
    lock_partitions,
    lock_plan,
    ranges_since_reset,
    read_heads,
    recreated_partitions,
    reset_floors,
)
from kafka2pg.lifecycle import Action, BatchState, promote_action, replay_outcome
from kafka2pg.locations import COMMAND
from kafka2pg.opening import OpenedBatch
from kafka2pg.planner import BatchPlan, OffsetRange, PartitionPlan, describe_ranges
from kafka2pg.replay_request import ReplayRequest, kafka_ms
from kafka2pg.rows import (
    STAND_IN_LANDED,
    STAND_IN_REFUSED,
    WITHIN_BATCH_DUPLICATE,
    clear_staging,
    insert_quarantine,
    insert_target,
    literal,
    range_predicate,
    records_read,
    shortfall,
)

log = logging.getLogger(__name__)

SAMPLE = 20
# The suffix of a verify-only kind for rows whose record the replay could not read (compacted away).
RECORD_GONE = "_record_gone"


def resolve_ranges(settings: Settings, pipeline: Pipeline, request: ReplayRequest) -> tuple[OffsetRange, ...]:
    """The request's offset ranges; a time window maps through offsets_for_times (empty ones dropped)."""
    if request.window is None:
        return request.ranges
    kafka = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    start = kafka.offsets_for_times(kafka_ms(request.window[0]))
    end = kafka.offsets_for_times(kafka_ms(request.window[1]))
    return tuple(OffsetRange(p, start[p], end[p]) for p in sorted(start) if end.get(p, start[p]) > start[p])


def open_replay(
    settings: Settings,
    pipeline: Pipeline,
    request: ReplayRequest,
    *,
    run_id: str | None = None,
    on_planned: Callable[[int], None] | None = None,
) -> OpenedBatch:
    """Check the ranges against the ledger and the broker, then record a planned replay batch
    (`on_planned` gets its id before the plan commits: a CLI replay's process lock).

    Refused (`ReplayRefusedError`, nothing recorded) when a range reaches beyond the live head,
    covers offsets the ledger never loaded (a recorded gap, an older topic generation), or
    starts below the low watermark (those records are gone: replacing would lose rows).
    """
    ranges = resolve_ranges(settings, pipeline, request)
    window = ""
    if request.window is not None:
        window = f" (time window [{request.window[0].isoformat()}, {request.window[1].isoformat()}))"
    if not ranges:
        return OpenedBatch(None, False, f"replay: no records to replay{window}; nothing recorded, Spark not launched")
    kafka = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    broker, identity = {o.partition: o for o in kafka.offsets()}, kafka.topic_id()
    with transaction(settings.database_url, waits=f"pipeline={pipeline.name} the replay's plan") as conn:
        # Serialised with planning, undo and reset: the heads read here stay valid until commit.
        lock_plan(conn, pipeline.name)
        heads = read_heads(conn, pipeline.name)
        loaded = ranges_since_reset(conn, pipeline.name, last_resets(conn, pipeline.name))[1]
        recreated = recreated_partitions(conn, pipeline.name, identity)
        for r in ranges:
            if r.partition in recreated:
                raise ReplayRefusedError.range_refused(
                    pipeline.name,
                    r.partition,
                    (r.start, r.end),
                    f"the topic was deleted and recreated since the ledger loaded it (topic ID {recreated[r.partition]}"
                    f" -> {identity}): its offsets now hold other records. Realign the ledger with `{COMMAND} reset`.",
                    topic_id=identity,
                )
            _check_replayable(pipeline, r, heads.get(r.partition), loaded.get(r.partition, []), broker.get(r.partition))
        plan = BatchPlan(
            pipeline.name,
            pipeline.topic,
            tuple(PartitionPlan(r.partition, heads[r.partition], None, r) for r in ranges),
            identity,
        )
        batch = insert_batch(conn, pipeline, plan, run_id, kind="replay")
        batch_id = batch.batch_id
        record_operation(conn, pipeline, batch_id, request.mode, ranges, request, run_id)
        if on_planned is not None:
            on_planned(batch_id)
    described = describe_ranges(ranges)
    message = f"planned replay batch {batch_id} ({request.mode}) of {plan.record_budget} offsets: {described}{window}"
    log.info("pipeline=%s %s", pipeline.name, message)
    return OpenedBatch(batch, False, message)


def _check_replayable(pipeline: Pipeline, r: OffsetRange, head: int | None, loaded: list, broker) -> None:
    def refused(problem: str, **evidence: object) -> ReplayRefusedError:
        return ReplayRefusedError.range_refused(pipeline.name, r.partition, (r.start, r.end), problem, **evidence)

    if head is None:
        raise refused("the ledger has never loaded this partition; nothing to replay", head=None)
    if r.end > head:
        raise refused(
            f"the range reaches beyond the live head {head}. A replay only re-loads what the live "
            f"pipeline already loaded; offsets from {head} on are the live pipeline's next batch.",
            head=head,
        )
    if not any(start <= r.start and r.end <= end for start, end in loaded):
        spans = ", ".join(f"[{s}, {e})" for s, e in loaded) or "none"
        raise refused(
            f"part of the range was never loaded by this topic's ledger (loaded: {spans}); recorded gaps "
            "(retention loss, skipped new partition) and offsets from before a reset cannot be replayed.",
            head=head,
            loaded=list(loaded),
        )
    if broker is not None and r.start < broker.low:
        raise refused(
            f"records [{r.start}, {broker.low}) are gone from Kafka (low watermark {broker.low}); "
            "replacing would delete their rows with nothing to put back. Replay from the low watermark on.",
            head=head,
            low_watermark=broker.low,
        )


def record_operation(
    conn: Connection,
    pipeline: Pipeline,
    batch_id: int,
    operation: str,
    ranges: tuple[OffsetRange, ...],
    request: ReplayRequest | None,
    run_id: str | None,
    *,
    requested_by: str = "",
    reason: str = "",
) -> None:
    window = request.window if request is not None else None
    conn.execute(
        "INSERT INTO kafka2pg.replays (batch_id, pipeline, topic, operation, ranges, window_from, window_to,"
        " requested_by, reason, run_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            batch_id,
            pipeline.name,
            pipeline.topic,
            operation,
            Jsonb([{"partition": r.partition, "start": r.start, "end": r.end} for r in ranges]),
            window[0] if window else None,
            window[1] if window else None,
            (request.requested_by if request else requested_by) or getpass.getuser(),
            (request.reason if request else reason) or "",
            run_id,
        ),
    )


@dataclass(frozen=True)
class ReplayResult:
    """The outcome of finishing a replay (the promote step of the replay DAG)."""

    batch_id: int
    mode: str
    promoted: int
    quarantined: int
    already_promoted: bool
    message: str
    before: tuple[int, int] = (0, 0)
    differences: dict = field(default_factory=dict)


def finish_replay(conn: Connection, pipeline: Pipeline, batch: Batch) -> ReplayResult | None:
    """Replace the range's rows (or only compare them) in the caller's transaction.

    Returns None when the staged rows were lost (the batch is back to `planned`).
    """
    mode, before_counts, differences = conn.execute(
        "SELECT operation, ARRAY[target_rows_before, quarantine_rows_before], differences"
        " FROM kafka2pg.replays WHERE batch_id = %s",
        (batch.batch_id,),
    ).fetchone()
    action = promote_action(batch.state, replay=True)
    if action is Action.DONE:
        message = f"replay batch {batch.batch_id} was already finished ({batch.state}): nothing changed"
        return ReplayResult(
            batch.batch_id,
            mode,
            batch.rows_promoted or 0,
            batch.rows_quarantined or 0,
            True,
            message,
            tuple(before_counts),
            differences or {},
        )
    if action is Action.REFUSE:
        raise BatchStateError.wrong_state(
            pipeline.name,
            batch.batch_id,
            batch.state,
            "only a validated replay batch can be finished",
            "The quality gate fails closed.",
        )
    if staging_lost(conn, pipeline, batch):
        return None
    ranges = batch.plan.ranges
    lock_partitions(conn, pipeline.name, [r.partition for r in ranges], f"replay batch {batch.batch_id}")
    # Under the range locks no promotion, undo or reset of these partitions runs: re-check the plan.
    floors = reset_floors(conn, pipeline.name)
    _recheck(conn, pipeline, batch, floors)
    in_range = range_predicate(ranges, floors)
    before = count_rows(conn, pipeline, in_range)
    if replay_outcome(mode == "verify-only") is BatchState.VERIFIED:
        found = differences_of(conn, pipeline, batch.batch_id, in_range)
        clear_staging(conn, pipeline, batch.batch_id)
        transition(conn, batch, BatchState.VERIFIED)
        finish_record(conn, batch.batch_id, before, before, found)
        differences, gone = (sum(v["count"] for v in part.values()) for part in split_differences(found))
        kept = (
            f"; {gone} row(s) whose record Kafka no longer holds (compacted away; a replace keeps them)" if gone else ""
        )
        message = (
            f"replay batch {batch.batch_id} verify-only: {differences} difference(s) between Kafka re-read with the "
            f"current logic and the target/quarantine ({_describe_differences(found)}){kept}; nothing changed"
        )
        log.info("pipeline=%s %s", pipeline.name, message)
        return ReplayResult(batch.batch_id, mode, 0, 0, False, message, before, found)
    delete_rows(conn, pipeline, in_range, replacing=batch.batch_id)
    promoted = insert_target(conn, pipeline, batch.batch_id)
    quarantined = insert_quarantine(conn, pipeline, batch.batch_id)
    read = sum(records_read(conn, batch.batch_id).values())
    # The caller's transaction rolls back whole: the range's rows deleted above come back.
    short = shortfall(pipeline, batch.batch_id, promoted + quarantined, read, "nothing was replaced")
    if short:
        raise BatchStateError(short, pipeline=pipeline.name, batch_id=batch.batch_id)
    clear_staging(conn, pipeline, batch.batch_id)
    transition(conn, batch, BatchState.PROMOTED, rows_promoted=promoted, rows_quarantined=quarantined)
    after = count_rows(conn, pipeline, in_range)
    finish_record(conn, batch.batch_id, before, after, None)
    message = (
        f"replay batch {batch.batch_id} replaced {before[0]} target and {before[1]} quarantine rows with "
        f"{promoted} and {quarantined}; live heads unchanged"
    )
    log.info("pipeline=%s %s", pipeline.name, message)
    return ReplayResult(batch.batch_id, mode, promoted, quarantined, False, message, before)


def _recheck(conn: Connection, pipeline: Pipeline, batch: Batch, floors: dict[int, int]) -> None:
    """What held when the replay was planned must still hold when it finishes, or nothing changes:
    the range is below the head and loaded by this topic generation (no reset or undo since), and
    no newer replay or reload of it finished in between (its rows must not be overwritten by these)."""
    heads = read_heads(conn, pipeline.name)
    loaded = ranges_since_reset(conn, pipeline.name, last_resets(conn, pipeline.name))[1]
    for r in batch.plan.ranges:
        head = heads.get(r.partition)
        problem, newer = None, None
        if floors.get(r.partition, 0) >= batch.batch_id:
            problem = "the partition's ledger was reset after this replay was planned"
        elif head is None or r.end > head:
            problem = f"it now reaches beyond the live head {head} (an undo rewound it)"
        elif not any(start <= r.start and r.end <= end for start, end in loaded.get(r.partition, [])):
            problem = "part of it is no longer loaded by the ledger (undone, or recorded as a gap)"
        else:
            newer = conn.execute(
                "SELECT max(b.batch_id) FROM kafka2pg.batches b JOIN kafka2pg.batch_partitions bp USING (batch_id)"
                " WHERE b.pipeline = %s AND b.batch_id > %s AND b.state = %s AND bp.kafka_partition = %s"
                " AND bp.start_offset < %s AND bp.end_offset > %s",
                (pipeline.name, batch.batch_id, str(BatchState.PROMOTED), r.partition, r.end, r.start),
            ).fetchone()[0]
            if newer is not None:
                problem = f"batch {newer}, newer than this replay, has since loaded or replayed part of it"
        if problem:
            raise ReplayRefusedError.range_refused(
                pipeline.name,
                r.partition,
                (r.start, r.end),
                problem,
                batch_id=batch.batch_id,
                head=head,
                newer_batch_id=newer,
            )


def _target(pipeline: Pipeline) -> sql.Identifier:
    return sql.Identifier(pipeline.target_schema, pipeline.target_table)


def count_rows(conn: Connection, pipeline: Pipeline, in_range: sql.Composable) -> tuple[int, int]:
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {target} WHERE kafka_topic = %(topic)s AND {r}),"
            " (SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %(pipeline)s"
            " AND kafka_topic = %(topic)s AND {r})"
        ).format(target=_target(pipeline), r=in_range),
        {"topic": pipeline.topic, "pipeline": pipeline.name},
    ).fetchone()
    return row[0], row[1]


def delete_rows(conn: Connection, pipeline: Pipeline, in_range: sql.Composable, replacing: int | None = None) -> None:
    """Delete the range's target and quarantine rows; with `replacing` (a replay batch id) only those
    whose record the replay re-read: a record compacted away since cannot be put back, so its row stays."""
    params = {"topic": pipeline.topic, "pipeline": pipeline.name, "batch": replacing}
    reread = sql.SQL("")
    if replacing is not None:
        reread = sql.SQL(
            " AND EXISTS (SELECT 1 FROM {} s WHERE s.batch_id = %(batch)s"
            " AND s.kafka_partition = x.kafka_partition AND s.kafka_offset = x.kafka_offset)"
        ).format(sql.Identifier("kafka2pg", pipeline.staging_table))
    conn.execute(
        sql.SQL("DELETE FROM {} x WHERE kafka_topic = %(topic)s AND {}{}").format(_target(pipeline), in_range, reread),
        params,
    )
    conn.execute(
        sql.SQL(
            "DELETE FROM kafka2pg.quarantine x WHERE pipeline = %(pipeline)s AND kafka_topic = %(topic)s AND {}{}"
        ).format(in_range, reread),
        params,
    )


def finish_record(
    conn: Connection, batch_id: int, before: tuple[int, int], after: tuple[int, int], differences: dict | None
) -> None:
    conn.execute(
        "UPDATE kafka2pg.replays SET target_rows_before = %s, quarantine_rows_before = %s, target_rows_after = %s,"
        " quarantine_rows_after = %s, differences = %s, finished_at = now() WHERE batch_id = %s",
        (*before, *after, None if differences is None else Jsonb(differences), batch_id),
    )


def differences_of(conn: Connection, pipeline: Pipeline, batch_id: int, in_range: sql.Composable) -> dict:
    """Staged replay rows vs the target and quarantine rows of the range, by provenance.

    Kinds: only_in_target, only_in_replay, changed (same offset, other values); for the
    quarantine: quarantined_only_before, quarantined_only_by_replay, quarantine_reason_changed.
    A row of the target or the quarantine at an offset where the replay read no record at all
    (compacted away since it was loaded) is `only_in_target_record_gone` or
    `quarantined_only_before_record_gone`: what Kafka no longer holds, not a difference of the
    logic (a `replace` keeps such a row). Each: count and up to SAMPLE "partition:offset" samples.
    """
    # A row loaded before a record without a Kafka timestamp was stored as NULL holds the instant
    # Kafka's -1 ms reads as: the same record, not a change.
    no_timestamp = sql.SQL("nullif(kafka_timestamp, timestamptz '1969-12-31 23:59:59.999+00')")
    values = sql.SQL(", ").join([sql.Identifier(c.name) for c in pipeline.columns] + [no_timestamp])
    staging = sql.Identifier("kafka2pg", pipeline.staging_table)
    params = {"batch": batch_id, "topic": pipeline.topic, "pipeline": pipeline.name}
    new_rows = sql.SQL(
        "SELECT kafka_partition, kafka_offset, ROW({values}) AS v FROM {staging}"
        " WHERE batch_id = %(batch)s AND quarantine_reason IS NULL"
    ).format(values=values, staging=staging)
    old_rows = sql.SQL(
        "SELECT kafka_partition, kafka_offset, ROW({values}) AS v FROM {target} WHERE kafka_topic = %(topic)s AND {r}"
    ).format(values=values, target=_target(pipeline), r=in_range)
    new_q = sql.SQL(
        "SELECT kafka_partition, kafka_offset, {v} AS v FROM {staging}"
        " WHERE batch_id = %(batch)s AND quarantine_reason IS NOT NULL"
    ).format(v=_comparable_reason(sql.Identifier("quarantine_reason"), pipeline), staging=staging)
    old_q = sql.SQL(
        "SELECT kafka_partition, kafka_offset, {v} AS v FROM kafka2pg.quarantine"
        " WHERE pipeline = %(pipeline)s AND kafka_topic = %(topic)s AND {r}"
    ).format(v=_comparable_reason(sql.Identifier("reason"), pipeline), r=in_range)
    kinds = {
        "target": ("only_in_target", "only_in_replay", "changed"),
        "quarantine": ("quarantined_only_before", "quarantined_only_by_replay", "quarantine_reason_changed"),
    }
    # Every offset the replay read a record at (for the target's rows or the quarantine's).
    reread = sql.SQL("SELECT kafka_partition AS p, kafka_offset AS o FROM {} WHERE batch_id = %(batch)s").format(
        staging
    )
    found: dict[str, dict] = {}
    for side, old, new in (("target", old_rows, new_rows), ("quarantine", old_q, new_q)):
        only_old, only_new, changed = kinds[side]
        joined = sql.SQL(
            "SELECT CASE WHEN n.p IS NULL AND r.p IS NULL THEN {gone} WHEN n.p IS NULL THEN {only_old}"
            " WHEN o.p IS NULL THEN {only_new} ELSE {changed} END,"
            " coalesce(o.p, n.p), coalesce(o.o, n.o)"
            " FROM (SELECT kafka_partition AS p, kafka_offset AS o, v FROM ({old}) x) o"
            " FULL JOIN (SELECT kafka_partition AS p, kafka_offset AS o, v FROM ({new}) y) n ON o.p = n.p AND o.o = n.o"
            " LEFT JOIN ({reread}) r ON r.p = o.p AND r.o = o.o"
            " WHERE o.p IS NULL OR n.p IS NULL OR o.v IS DISTINCT FROM n.v ORDER BY 2, 3"
        ).format(
            gone=sql.Literal(only_old + RECORD_GONE),
            only_old=sql.Literal(only_old),
            only_new=sql.Literal(only_new),
            changed=sql.Literal(changed),
            old=old,
            new=new,
            reread=reread,
        )
        for kind, partition, offset in conn.execute(joined, params):
            entry = found.setdefault(kind, {"count": 0, "sample": []})
            entry["count"] += 1
            if len(entry["sample"]) < SAMPLE:
                entry["sample"].append(f"{partition}:{offset}")
    return found


def _comparable_reason(reason: sql.Composable, pipeline: Pipeline) -> sql.Composable:
    """SQL: a quarantine reason as a replay compares it. Batch ids vary between runs; a declared
    rule's reason compares by its column and rule, not the value it quotes (stored unquoted and
    whole before values were quoted and shortened); a one-bound range stored as "range [0.0,
    None]" reads "minimum 0" now (and "[None, 9.5]" "maximum 9.5"), and a whole-number bound
    stored as "100.0" reads "100" (and one of 1e16 or more, stored as "1e+16" when bounds were
    read as floats, as written); a value shortened to 40 characters is compared without its
    mark ("…"), which reasons of keys once lacked; a column's list of allowed values stored
    whole, before long lists were cut, reads as the list is cut now (a list the current config
    does not declare stays as it was stored: a changed rule is a difference). A business key's
    duplicate compares by the copy that landed: "within batch N: kept partition P offset O" (the
    kept copy in its batch; or, when that copy was refused at promotion, the copy that "landed
    instead") and "already promoted by batch N at partition P offset O" (an earlier batch's copy)
    are the same verdict when P and O are, which one depends only on where a batch or a replay's
    range started."""
    for column in pipeline.columns:
        whole = f"declared allowed values {list(column.allowed or ())!r}"
        if column.allowed is not None and f"declared {column.allowed_words}" != whole:
            cut = literal(f"declared {column.allowed_words}")
            reason = sql.SQL("replace({}, {}, {})").format(reason, literal(whole), cut)
    within = f"^{WITHIN_BATCH_DUPLICATE}N: kept partition "
    promoted = f"^{KEY_PROMOTED_REASON}N at partition "
    reason = sql.SQL(
        "regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace("
        "regexp_replace(regexp_replace({},"
        " 'batch \\d+', 'batch N', 'g'), '…''', '''', 'g'),"
        " 'declared range \\[([^],]+), None\\]$', 'declared minimum \\1'),"
        " 'declared range \\[None, ([^],]+)\\]$', 'declared maximum \\1'),"
        " '^(\\S+) = .* violates the declared ', '\\1 violates the declared '),"
        " '(declared (?:range \\[|minimum |maximum )-?\\d+)\\.0(?=\\]|, |$)', '\\1'),"
        " '(declared range \\[[^],]+, -?\\d+)\\.0\\]$', '\\1]')"
    ).format(reason)
    for column in pipeline.columns:  # bounds once read as floats: 1e16 read "1e+16", 2**53 + 1 read 2**53
        floats = dataclasses.replace(column, minimum=float_bound(column.minimum), maximum=float_bound(column.maximum))
        if column.ranged and floats.range_words != column.range_words:
            was, now = literal(f"declared {floats.range_words}"), literal(f"declared {column.range_words}")
            reason = sql.SQL("replace({}, {}, {})").format(reason, was, now)
    return sql.SQL(
        "regexp_replace(regexp_replace(regexp_replace({},"
        " {within_refused}, {of_landed}), {within}, {of}), {promoted}, {of})"
    ).format(
        reason,
        within_refused=literal(
            f"{within}\\d+ offset \\d+ (\\(.*\\)){STAND_IN_REFUSED}(\\d+) offset (\\d+){STAND_IN_LANDED}$"
        ),
        of_landed=literal(f"{KEY_DUPLICATE_OF}\\2 offset \\3 \\1"),
        within=literal(within),
        promoted=literal(promoted),
        of=literal(KEY_DUPLICATE_OF),
    )


# A business key duplicate's reason as a replay compares it, before the landed copy's partition,
# offset and key.
KEY_DUPLICATE_OF = "duplicate business key of partition "


def split_differences(found: dict) -> tuple[dict, dict]:
    """A verify-only replay's findings: the differences, and the rows whose record is gone from Kafka."""
    gone = {kind: v for kind, v in found.items() if kind.endswith(RECORD_GONE)}
    return {kind: v for kind, v in found.items() if kind not in gone}, gone


def _describe_differences(found: dict) -> str:
    shown = split_differences(found)[0]
    if not shown:
        return "none"
    return "; ".join(f"{kind} {v['count']} (e.g. {', '.join(v['sample'][:5])})" for kind, v in sorted(shown.items()))
