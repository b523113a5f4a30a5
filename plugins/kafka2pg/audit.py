"""The audit: re-read Kafka for every ledgered range and compare with target + quarantine.

Streams both sides in offset order per partition (Kafka consumer, server-side DB cursor) and
merges them, so memory stays flat however large the backlog.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from psycopg import Connection, sql

from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import snapshot
from kafka2pg.kafka_offsets import TopicAdmin
from kafka2pg.kafka_reader import read_offsets
from kafka2pg.ledger import last_resets, ranges_since_reset, read_heads, recreated_partitions
from kafka2pg.locations import COMMAND
from kafka2pg.planner import ledger_breaks
from kafka2pg.stuck import OpenBatch, StuckBatch

SAMPLE = 20


@dataclass
class PartitionAudit:
    """One partition's comparison; `missing`/`duplicated`/`unexplained` are discrepancies."""

    partition: int
    head: int | None
    kafka_records: int = 0
    matched: int = 0
    missing: int = 0
    duplicated: int = 0
    unexplained: int = 0
    expired: int = 0
    compacted: int = 0
    missing_offsets: list[int] = field(default_factory=list)
    duplicated_offsets: list[int] = field(default_factory=list)
    unexplained_offsets: list[int] = field(default_factory=list)
    ledger_breaks: list[str] = field(default_factory=list)
    # The partition's latest `kafka2pg reset`: (the last batch before it, the offset it set or None
    # for a dropped head). What was loaded before it is not compared.
    reset: tuple[int, int | None] | None = None

    @property
    def clean(self) -> bool:
        return self.missing == 0 and self.duplicated == 0 and self.unexplained == 0 and not self.ledger_breaks


def _db_offsets(conn: Connection, pipeline: Pipeline, partition: int, after_batch: int) -> Iterator[int]:
    """Offsets of the partition in target and quarantine (since its last reset), ascending,
    duplicates kept, as `conn`'s snapshot holds them."""
    query = sql.SQL(
        "SELECT kafka_offset FROM {target} WHERE kafka_topic = %(topic)s AND kafka_partition = %(p)s"
        " AND batch_id > %(after)s"
        " UNION ALL SELECT kafka_offset FROM kafka2pg.quarantine"
        " WHERE pipeline = %(pipeline)s AND kafka_topic = %(topic)s AND kafka_partition = %(p)s"
        " AND batch_id > %(after)s ORDER BY 1"
    ).format(target=sql.Identifier(pipeline.target_schema, pipeline.target_table))
    with conn.cursor(name=f"audit_{partition}") as cur:
        cur.itersize = 10_000
        params = {"topic": pipeline.topic, "p": partition, "pipeline": pipeline.name, "after": after_batch}
        cur.execute(query, params)
        for (offset,) in cur:
            yield offset


def _kafka_offsets(settings: Settings, topic: str, partition: int, ranges: list[tuple[int, int]]) -> Iterator[int]:
    """Offsets of committed records inside `ranges`, ascending (read_committed)."""
    records = read_offsets(settings.kafka, topic, partition, ranges, settings.kafka_timeout_s)
    return (offset for offset, _ in records)


def audit_pipeline(settings: Settings, pipeline: Pipeline) -> list[PartitionAudit]:
    """Compare every ledgered offset range with what the database holds, per partition.

    The ledger and the rows are read in one snapshot (a read-only REPEATABLE READ transaction),
    so a batch promoted, undone or reset while the audit runs is wholly in it or not at all; the
    watermarks are read from Kafka after the snapshot is taken, so every range it ledgers is below them."""
    with snapshot(settings.database_url) as conn:
        # It reads Kafka between fetches, idle in its transaction for as long as a partition takes.
        conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
        resets = last_resets(conn, pipeline.name)  # the first query takes the transaction's snapshot
        stored, ledger = ranges_since_reset(conn, pipeline.name, resets)
        heads = read_heads(conn, pipeline.name)
        cluster = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
        watermarks = {o.partition: o for o in cluster.offsets()}
        compacted, identity = cluster.retention().compacted, cluster.topic_id()
        recreated = recreated_partitions(conn, pipeline.name, identity)
        audits = []
        for partition in sorted(set(watermarks) | set(stored) | set(heads)):
            # Kafka holds [low, last stable) now; ledgered offsets outside it are not there to read.
            held = watermarks.get(partition)
            low, stable = (held.low, held.last_stable) if held else (0, 0)
            ranges = [(max(s, low), min(e, stable)) for s, e in ledger.get(partition, []) if e > low and s < stable]
            result = PartitionAudit(partition, heads.get(partition), reset=resets.get(partition))
            after, reset_to = resets.get(partition, (0, None))
            result.ledger_breaks = ledger_breaks(stored.get(partition, []), heads.get(partition), reset_to)
            if held is None:
                result.ledger_breaks.append(
                    f"topic {pipeline.topic} has no partition {partition} now: its rows cannot be re-read (a "
                    f"recreated topic: see `{COMMAND} reset`)"
                )
            if partition in recreated:  # the offsets of the topic it loaded are not this topic's
                result.ledger_breaks.append(
                    f"the ledger's head is an offset in the topic with ID {recreated[partition]}, but topic "
                    f"{pipeline.topic} now has ID {identity} (deleted and recreated): its records are not the ones "
                    f"loaded, so they were not compared (see `{COMMAND} reset`)"
                )
                audits.append(result)
                continue
            kafka = _kafka_offsets(settings, pipeline.topic, partition, ranges) if ranges else iter(())
            database = _db_offsets(conn, pipeline, partition, after)
            _merge(kafka, database, low, result, compacted_ranges=ranges if compacted else [])
            audits.append(result)
        return audits


def _note(sample: list[int], offset: int) -> None:
    if len(sample) < SAMPLE:
        sample.append(offset)


def _merge(
    kafka: Iterator[int],
    database: Iterator[int],
    low: int,
    result: PartitionAudit,
    *,
    compacted_ranges: list[tuple[int, int]],
) -> None:
    """Walk both ascending streams once; classify every offset.

    `compacted_ranges`: on a compacted topic, the ledgered ranges in which a promoted record
    may since have been compacted away (counted as `compacted`, not `unexplained`).
    """
    db = itertools.groupby(database)
    db_item = next(db, None)
    for k in kafka:
        result.kafka_records += 1
        while db_item is not None and db_item[0] < k:
            _not_in_kafka(db_item, low, result, compacted_ranges)
            db_item = next(db, None)
        if db_item is not None and db_item[0] == k:
            copies = sum(1 for _ in db_item[1])
            result.matched += 1
            if copies > 1:
                result.duplicated += copies - 1
                _note(result.duplicated_offsets, k)
            db_item = next(db, None)
        else:
            result.missing += 1
            _note(result.missing_offsets, k)
    while db_item is not None:
        _not_in_kafka(db_item, low, result, compacted_ranges)
        db_item = next(db, None)


def _not_in_kafka(
    item: tuple[int, Iterator[int]], low: int, result: PartitionAudit, compacted_ranges: list[tuple[int, int]]
) -> None:
    offset, group = item
    copies = sum(1 for _ in group)
    if offset < low:
        result.expired += 1  # promoted, then removed by retention: cannot be re-read
        if copies > 1:  # but landed more than once all the same
            result.duplicated += copies - 1
            _note(result.duplicated_offsets, offset)
        return
    if copies == 1 and any(start <= offset < end for start, end in compacted_ranges):
        result.compacted += 1  # promoted, then superseded by a newer record of its key
        return
    result.unexplained += copies
    _note(result.unexplained_offsets, offset)


def format_audit(
    pipeline: Pipeline,
    audits: list[PartitionAudit],
    stuck: Sequence[StuckBatch] = (),
    not_ready: str | None = None,
    open_replays: Sequence[OpenBatch] = (),
) -> str:
    """The audit's table and result; `stuck` and `not_ready` (what stops the next run's plan: a
    migration or a grant missing) are results too: the pipeline does not advance. `open_replays`
    (replay batches not finished, each saying who carries it on or how to discard it) are shown,
    not a result: a replay moves no head, and its staged rows are in no table the audit counts."""
    lines = [f"audit of pipeline {pipeline.name} (topic {pipeline.topic})"]
    header = f"{'partition':>9} {'head':>10} {'kafka':>10} {'matched':>10} {'missing':>8} {'duplicated':>10} "
    lines.append(header + f"{'unexplained':>11} {'expired':>8} {'compacted':>9}")
    for a in audits:
        lines.append(
            f"{a.partition:>9} {a.head if a.head is not None else '-':>10} {a.kafka_records:>10} {a.matched:>10} "
            f"{a.missing:>8} {a.duplicated:>10} {a.unexplained:>11} {a.expired:>8} {a.compacted:>9}"
        )
        for label, sample in (
            ("missing", a.missing_offsets),
            ("duplicated", a.duplicated_offsets),
            ("unexplained", a.unexplained_offsets),
        ):
            if sample:
                lines.append(f"          partition {a.partition} {label} offsets: {', '.join(map(str, sample))}")
        for problem in a.ledger_breaks:
            lines.append(f"          partition {a.partition} ledger: {problem}")
        if a.reset is not None:
            after, to_offset = a.reset
            where = f"to offset {to_offset}" if to_offset is not None else "dropping its head"
            when = f"after batch {after}" if after else "before any batch"
            unread = ": what batches up to that one loaded is not compared" if after else ""
            lines.append(f"          partition {a.partition} audited since its reset ({where}, {when}){unread}")
    lines += [batch.describe() for batch in stuck]
    lines += [batch.describe() for batch in open_replays]
    if not_ready is not None:
        lines.append(f"NOT READY: {not_ready}")
    if not all(a.clean for a in audits):
        lines.append("result: DISCREPANCIES FOUND")
    elif stuck:
        lines.append("result: STUCK (what the ledger holds is clean, but the pipeline does not advance)")
    elif not_ready is not None:
        lines.append("result: NOT READY (what the ledger holds is clean, but no run plans until then)")
    else:
        lines.append("result: clean")
    return "\n".join(lines)
