"""The offset ledger: per partition its head (the next offset to load), the committed ranges,
the range locks that serialise changes of a partition's rows, and ledger resets.

Opening a batch from the heads is `kafka2pg.opening`; the batch rows are `kafka2pg.batch_store`.
"""

from __future__ import annotations

import getpass
import logging
from dataclasses import dataclass

import psycopg
from psycopg import Connection, sql

from kafka2pg.batch_store import abandon_lookaheads, abandon_unpromoted, load_batch, open_batch_id
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction
from kafka2pg.exceptions import BatchStateError, OffsetRegressionError, RangeLockedError
from kafka2pg.kafka_offsets import PartitionOffsets, TopicAdmin
from kafka2pg.locations import COMMAND, preview_first

log = logging.getLogger(__name__)


def read_heads(conn: Connection, pipeline: str) -> dict[int, int]:
    rows = conn.execute(
        "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s",
        (pipeline,),
    ).fetchall()
    return {partition: offset for partition, offset in rows}


def recreated_partitions(conn: Connection, pipeline: str, topic_id: str | None) -> dict[int, str]:
    """Partitions whose ledger head is an offset in another topic than the one with `topic_id`
    (the same name, deleted and recreated since): partition -> the ID its head was written for.
    Empty when the topic's ID is not known, and for heads written before IDs were recorded."""
    if topic_id is None:
        return {}
    rows = conn.execute(
        "SELECT kafka_partition, topic_id FROM kafka2pg.ledger_heads WHERE pipeline = %s"
        " AND topic_id IS NOT NULL AND topic_id <> %s ORDER BY kafka_partition",
        (pipeline, topic_id),
    ).fetchall()
    return dict(rows)


def check_topic_identity(conn: Connection, pipeline: Pipeline, topic_id: str | None) -> None:
    """`OffsetRegressionError` when a ledger head belongs to the topic as it was before it was
    deleted and recreated (the offsets of the new one start again from 0)."""
    recreated = recreated_partitions(conn, pipeline.name, topic_id)
    if recreated:
        ledgered = ", ".join(sorted(set(recreated.values())))
        raise OffsetRegressionError.recreated(pipeline.name, pipeline.topic, sorted(recreated), ledgered, topic_id)


def read_head_batches(conn: Connection, pipeline: str) -> dict[int, int | None]:
    """Per partition with a head: the batch that last moved it (None: set by a reset)."""
    rows = conn.execute(
        "SELECT kafka_partition, last_batch_id FROM kafka2pg.ledger_heads WHERE pipeline = %s",
        (pipeline,),
    ).fetchall()
    return dict(rows)


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
        backend = conn.execute(
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
            f"backend pid {backend[0]} ({backend[1] or 'no application name'}: {backend[2]})"
            if backend
            else "another transaction",
        )
        # The error names the holding backend, never its query (the log has it).
        holder = f"backend pid {backend[0]}, application {backend[1]!r}" if backend else None
        previous = conn.execute("SELECT current_setting('lock_timeout')").fetchone()[0]
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{RANGE_LOCK_WAIT_S}s",))
        try:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s), %s)", key)
        except psycopg.errors.LockNotAvailable as exc:
            raise RangeLockedError.held(pipeline, partition, purpose, RANGE_LOCK_WAIT_S, holder) from exc
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (previous,))


def _old_rows(conn: Connection, pipeline: Pipeline, partition: int, below: int | None = None) -> int:
    """The partition's rows in the target and the quarantine (with `below`: of offsets below it)."""
    target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
    query = sql.SQL(
        "SELECT (SELECT count(*) FROM {} WHERE kafka_topic = %(topic)s AND kafka_partition = %(p)s{below})"
        " + (SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %(pipeline)s AND kafka_partition = %(p)s{below})"
    ).format(target, below=sql.SQL("" if below is None else " AND kafka_offset < %(below)s"))
    params = {"topic": pipeline.topic, "p": partition, "pipeline": pipeline.name, "below": below}
    return conn.execute(query, params).fetchone()[0]


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


@dataclass(frozen=True)
class HeadStatus:
    """One partition of the status report."""

    partition: int
    next_offset: int | None
    low: int
    high: int
    lag: int


def head_status(heads: dict[int, int], offsets: list[PartitionOffsets]) -> list[HeadStatus]:
    """Each partition's ledger head (from `read_heads`) beside Kafka's offsets."""
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
    kafka = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    offsets, identity = {o.partition: o for o in kafka.offsets()}, kafka.topic_id()
    _refuse_unheld(pipeline, partition, to_offset, offsets)
    with transaction(settings.database_url, waits=f"pipeline={pipeline.name} reset of partition {partition}") as conn:
        lock_plan(conn, pipeline.name)
        open_id = open_batch_id(conn, pipeline)  # before the heads: see open_batch
        current = read_heads(conn, pipeline.name).get(partition)
        if to_offset is None and current is None:
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: partition {partition} has no ledger head to drop (the pipeline never "
                f"read it, and {pipeline.topic!r} has no such partition); nothing was changed",
                pipeline=pipeline.name,
                topic=pipeline.topic,
                partition=partition,
            )
        target = "dropped (partition gone)" if to_offset is None else str(to_offset)
        message = f"pipeline {pipeline.name} partition {partition}: head {current} -> {target}"
        if open_id is not None:
            message += f"; unfinished batch {open_id} is abandoned"
        broker = offsets.get(partition)
        # A head in the topic as it was before it was recreated says nothing about the new one's offsets.
        recreated = partition in recreated_partitions(conn, pipeline.name, identity)
        head_id = conn.execute(
            "SELECT topic_id FROM kafka2pg.ledger_heads WHERE pipeline = %s AND kafka_partition = %s",
            (pipeline.name, partition),
        ).fetchone()
        same_topic = identity is not None and head_id == (identity,)
        if same_topic and to_offset == current and open_id is None and not archive_old_rows:
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: partition {partition}'s head is {current} already, in topic "
                f"{pipeline.topic!r} as it is now (ID {identity}), and no batch is open: nothing to reset. Nothing was "
                "changed",
                pipeline=pipeline.name,
                topic=pipeline.topic,
                partition=partition,
                offsets=to_offset,
                head=current,
            )
        back = to_offset is not None and current is not None and to_offset < current
        if back and same_topic and not archive_old_rows:
            below = _old_rows(conn, pipeline, partition, to_offset)
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: partition {partition}'s head {current} is an offset in topic "
                f"{pipeline.topic!r} as it is now (ID {identity}), not a recreated one: moving it back to {to_offset} "
                f"would read [{to_offset}, {current}) again, whose rows are in the target or the quarantine, and the "
                "quality gate would reject every such batch as already promoted. To load a range again with the "
                f"current config, use `{COMMAND} replay`. --archive-old-rows would archive EVERY row of partition "
                f"{partition}"
                + (f" (the {below} of offsets below {to_offset} too, which are not loaded again)" if below else "")
                + f" and load [{to_offset}, {current}) as new. Nothing was changed",
                pipeline=pipeline.name,
                topic=pipeline.topic,
                partition=partition,
                offsets=to_offset,
                head=current,
            )
        if recreated:
            message += (
                f"; the head is an offset in the topic before it was recreated (the topic's ID is now {identity})"
            )
        start = broker and (broker.low if recreated else max(current or 0, broker.low))
        if to_offset is not None and broker is not None and start < to_offset:
            skipped_from = start
            message += (
                f"; offsets [{skipped_from}, {to_offset}) that Kafka still holds ({to_offset - skipped_from} at most) "
                "will never be loaded: they are skipped, not lost to Kafka, and no audit reports them"
            )
        old_rows = _old_rows(conn, pipeline, partition)
        if old_rows and same_topic and not archive_old_rows:  # the same topic: only the audit's start moves
            message += (
                f"; the {old_rows} promoted/quarantined rows of partition {partition} loaded before the reset stay, "
                f"but `{COMMAND} verify` audits the partition from the reset on and `{COMMAND} replay` re-reads only "
                "offsets loaded after it"
            )
        elif old_rows and same_topic:  # archived: every row of the partition, not only those read again
            message += (
                f"; all {old_rows} promoted/quarantined rows of partition {partition} are archived to "
                "kafka2pg.archived_rows"
            )
            kept_out = _old_rows(conn, pipeline, partition, to_offset) if to_offset is not None else 0
            if kept_out:
                message += (
                    f", {kept_out} of them of offsets below the new head {to_offset}: those leave the target and the "
                    "quarantine for good (the next runs load only from the new head on)"
                )
        elif old_rows:
            message += (
                f"; {old_rows} promoted/quarantined rows of partition {partition} came from the topic before the "
                + ("reset: archived to kafka2pg.archived_rows" if archive_old_rows else "reset and keep their offsets")
            )
            reused = (
                0
                if archive_old_rows or to_offset is None
                else old_rows - _old_rows(conn, pipeline, partition, to_offset)
            )
            if reused:
                message += (
                    f". {reused} of them hold offsets from {to_offset} on, which the new topic's records reuse: the "
                    "quality gate would reject every batch reading those offsets as already promoted "
                    "(provenance_not_already_promoted) until they are archived: give --archive-old-rows (a reset "
                    "to the same offset with it archives them)"
                )
        if not confirm:
            return Reset(partition, current, to_offset, open_id, False, message)
        lock_partitions(conn, pipeline.name, [partition], f"ledger reset of partition {partition}")
        # Asked again under every lock: while this waited (a gate holding the open batch, a replay
        # the range), retention may have deleted the new head's records or the topic been recreated.
        now, now_id = {o.partition: o for o in kafka.offsets()}, kafka.topic_id()
        if now_id != identity:
            again = f"--to-offset {to_offset}" if to_offset is not None else "--drop"
            again += " --archive-old-rows" if archive_old_rows else ""
            raise BatchStateError(
                f"pipeline {pipeline.name!r}: topic {pipeline.topic!r} was deleted and recreated while the reset of "
                f"partition {partition} waited for its locks (its ID was {identity}, now {now_id}). Nothing was "
                "changed; "
                + preview_first(f"reset --pipeline {pipeline.name} --partition {partition} {again} --reason ...")
                + " resets it in the topic as it is now",
                pipeline=pipeline.name,
                topic=pipeline.topic,
                partition=partition,
            )
        _refuse_unheld(
            pipeline, partition, to_offset, now, " (retention deleted records while it waited for its locks)"
        )
        if open_id is not None:
            abandon_lookaheads(conn, pipeline, f"ledger reset: {reason}")
            abandon_unpromoted(conn, pipeline, load_batch(conn, open_id), f"ledger reset: {reason}")
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
                "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset, topic_id)"
                " VALUES (%s, %s, %s, %s, %s)",
                (pipeline.name, pipeline.topic, partition, to_offset, identity),
            )
    log.warning("ledger reset: %s (reason: %s)", message, reason)
    return Reset(partition, current, to_offset, open_id, True, message)


def _refuse_unheld(
    pipeline: Pipeline, partition: int, to_offset: int | None, offsets: dict[int, PartitionOffsets], since: str = ""
) -> None:
    """A head must be an offset the partition holds (low watermark to end); `--drop` only for a
    partition the topic no longer has."""
    broker = offsets.get(partition)
    if to_offset is not None and (broker is None or not broker.low <= to_offset <= broker.high):
        where = (
            f"does not exist (the topic has {len(offsets)}: {_listed(sorted(offsets))}); `--drop` removes the head "
            "of a partition the topic no longer has"
            if broker is None
            else f"holds offsets [{broker.low}, {broker.high}){since}"
        )
        raise BatchStateError(
            f"pipeline {pipeline.name!r}: cannot reset partition {partition} to {to_offset}: the partition {where}"
            + ("; nothing was changed" if since else ""),
            pipeline=pipeline.name,
            topic=pipeline.topic,
            partition=partition,
            offsets=to_offset,
            low_watermark=broker and broker.low,
            high_watermark=broker and broker.high,
        )
    if to_offset is None and broker is not None:
        raise BatchStateError(
            f"partition {partition} of {pipeline.topic!r} exists: give --to-offset",
            pipeline=pipeline.name,
            topic=pipeline.topic,
            partition=partition,
        )


def _listed(partitions: list[int]) -> str:
    """Partition numbers as a reader counts them: "0-3", or "0, 2, 5" when not consecutive."""
    if partitions and partitions == list(range(partitions[0], partitions[-1] + 1)) and len(partitions) > 2:
        return f"{partitions[0]}-{partitions[-1]}"
    return ", ".join(map(str, partitions)) or "none"
