"""The operator pages' reads of the ledger: a pipeline's batches and a batch's quarantine rows,
one page at a time by key (keyset paging on indexes), whatever the ledger's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from psycopg import Connection


@dataclass(frozen=True)
class BatchRow:
    batch_id: int
    kind: str
    state: str
    ranges: str  # p<partition>[start,end) per partition, end exclusive
    records_planned: int
    records_read: int | None
    rows_promoted: int | None
    rows_quarantined: int | None
    epoch: int
    run_id: str | None
    updated_at: datetime
    has_report: bool


@dataclass(frozen=True)
class QuarantineRow:
    partition: int
    offset: int
    timestamp: datetime | None
    reason: str
    raw_key: bytes | None
    raw_value: bytes | None


def batches_page(conn: Connection, pipeline: str, before: int | None, limit: int) -> list[BatchRow]:
    """The pipeline's batches with ids below `before` (None: the newest), newest first."""
    rows = conn.execute(
        "SELECT b.batch_id, b.kind, b.state,"
        " coalesce((SELECT string_agg(format('p%%s[%%s,%%s)', p.kafka_partition, p.start_offset, p.end_offset), ' '"
        "   ORDER BY p.kafka_partition) FROM kafka2pg.batch_partitions p WHERE p.batch_id = b.batch_id), 'none'),"
        " b.records_planned, b.records_read, b.rows_promoted, b.rows_quarantined, b.epoch, b.run_id, b.updated_at,"
        " EXISTS (SELECT FROM kafka2pg.quality_results r WHERE r.batch_id = b.batch_id)"
        " FROM kafka2pg.batches b WHERE b.pipeline = %s AND (%s::bigint IS NULL OR b.batch_id < %s)"
        " ORDER BY b.batch_id DESC LIMIT %s",
        (pipeline, before, before, limit),
    ).fetchall()
    return [BatchRow(*row) for row in rows]


def batch_state(conn: Connection, pipeline: str, batch_id: int) -> str | None:
    """The batch's state; None when the pipeline has no such batch."""
    row = conn.execute(
        "SELECT state FROM kafka2pg.batches WHERE batch_id = %s AND pipeline = %s", (batch_id, pipeline)
    ).fetchone()
    return None if row is None else row[0]


def quarantine_page(
    conn: Connection, pipeline: str, batch_id: int, after: tuple[int, int] | None, limit: int
) -> list[QuarantineRow]:
    """The batch's quarantined records after (partition, offset) `after` (None: from the first), in order."""
    partition, offset = after if after is not None else (-1, -1)
    rows = conn.execute(
        "SELECT kafka_partition, kafka_offset, kafka_timestamp, reason, raw_key, raw_value"
        " FROM kafka2pg.quarantine WHERE batch_id = %s AND pipeline = %s AND (kafka_partition, kafka_offset) > (%s, %s)"
        " ORDER BY kafka_partition, kafka_offset LIMIT %s",
        (batch_id, pipeline, partition, offset, limit),
    ).fetchall()
    return [QuarantineRow(*row) for row in rows]
