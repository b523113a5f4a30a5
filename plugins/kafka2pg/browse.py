"""The operator pages' reads of the ledger: a pipeline's batches, a batch's quarantine rows and the
pipeline's history of replays, undos and resets, one page at a time by key (keyset paging on
indexes), whatever the ledger's length.
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
    gaps: dict[str, int]  # offsets without a loaded record, by kind (`GAP_KINDS`); only kinds found
    stage_s: float | None  # planned -> staged; None: the step has not ended (or ended before migration 0011)
    validate_s: float | None  # staged -> the gate's verdict
    promote_s: float | None  # the verdict -> promoted


# Why a batch's offsets hold no loaded record: skipped before its range (the plan's gaps), or
# counted inside it by the quality gate's witnesses (kafka2pg.batch_partitions).
GAP_KINDS = ("retention_gap", "skipped_new_partition", "aborted", "transaction_markers", "compacted")


@dataclass(frozen=True)
class HistoryEntry:
    """One replay, undo or partition reset of a pipeline; `key` pages the history (newest first)."""

    at: datetime
    source: str  # the table: "replays" or "ledger_resets"
    entry_id: int
    operation: str  # replace, verify-only, undo, reset
    batch_id: int | None  # the replay batch, the undone batch; a reset: the last batch before it
    ranges: str
    requested_by: str
    reason: str
    run_id: str | None
    outcome: str

    @property
    def key(self) -> tuple[datetime, str, int]:
        return (self.at, self.source, self.entry_id)


@dataclass(frozen=True)
class QuarantineRow:
    partition: int
    offset: int
    timestamp: datetime | None
    reason: str
    raw_key: bytes | None  # its first PREVIEW_BYTES bytes
    raw_value: bytes | None  # its first PREVIEW_BYTES bytes
    key_bytes: int | None = None  # the whole key's length; None: as long as raw_key
    value_bytes: int | None = None


# What a quarantine page reads of a record's key and value: a record may be as large as the
# broker allows (about 1 MB by default, far more where raised), and a page holds many.
PREVIEW_BYTES = 200


# A page of batches: (pipeline, before, before, limit); each batch's partitions read by its key.
BATCHES_QUERY = (
    "SELECT b.batch_id, b.kind, b.state, coalesce(p.ranges, 'none'),"
    " b.records_planned, b.records_read, b.rows_promoted, b.rows_quarantined, b.epoch, b.run_id, b.updated_at,"
    # a scalar subquery, not EXISTS: the planner may hash EXISTS over all of quality_results
    " coalesce((SELECT true FROM kafka2pg.quality_results r WHERE r.batch_id = b.batch_id), false),"
    " (SELECT jsonb_object_agg(g.kind, g.offsets) FROM (SELECT x.part->'gap'->>'kind' AS kind,"
    "   sum((x.part->'gap'->>'end')::bigint - (x.part->'gap'->>'start')::bigint) AS offsets"
    "   FROM jsonb_array_elements(CASE jsonb_typeof(b.plan->'partitions') WHEN 'array'"
    "     THEN b.plan->'partitions' ELSE '[]' END) x(part)"
    "   WHERE jsonb_typeof(x.part->'gap') = 'object' GROUP BY 1) g),"
    " p.aborted, p.markers, p.compacted,"
    " extract(epoch FROM b.staged_at - b.created_at)::float8,"
    " extract(epoch FROM b.validated_at - b.staged_at)::float8,"
    " extract(epoch FROM b.promoted_at - b.validated_at)::float8"
    " FROM kafka2pg.batches b LEFT JOIN LATERAL (SELECT"
    "   string_agg(format('p%%s[%%s,%%s)', p.kafka_partition, p.start_offset, p.end_offset), ' '"
    "     ORDER BY p.kafka_partition) AS ranges,"
    "   sum(p.aborted_records) AS aborted, sum(p.marker_offsets) AS markers,"
    "   sum(p.compacted_offsets) AS compacted"
    "   FROM kafka2pg.batch_partitions p WHERE p.batch_id = b.batch_id) p ON true"
    " WHERE b.pipeline = %s AND (%s::bigint IS NULL OR b.batch_id < %s)"
    " ORDER BY b.batch_id DESC LIMIT %s"
)
# A page of history, newest first: %(pipeline)s, the entry before which it starts (%(at)s, %(source)s,
# %(id)s; NULLs: the newest) and %(limit)s; each table read by its (pipeline, time) index.
HISTORY_QUERY = (
    "SELECT * FROM ("
    " (SELECT r.requested_at, 'replays', r.replay_id, r.operation, r.batch_id,"
    "   (SELECT string_agg(format('p%%s[%%s,%%s)', e->>'partition', e->>'start', e->>'end'), ' ')"
    "    FROM jsonb_array_elements(r.ranges) e),"
    "   r.requested_by, r.reason, r.run_id,"
    "   CASE WHEN b.state = 'abandoned' THEN coalesce(b.error, 'abandoned') || '; target and quarantine unchanged'"
    "     WHEN r.finished_at IS NULL THEN 'not finished' ELSE format("
    "     'target rows %%s -> %%s, quarantine rows %%s -> %%s', coalesce(r.target_rows_before::text, '-'),"
    "     coalesce(r.target_rows_after::text, '-'), coalesce(r.quarantine_rows_before::text, '-'),"
    "     coalesce(r.quarantine_rows_after::text, '-')) END"
    "  FROM kafka2pg.replays r JOIN kafka2pg.batches b USING (batch_id)"
    "  WHERE r.pipeline = %(pipeline)s AND (%(at)s::timestamptz IS NULL"
    "   OR (r.requested_at, 'replays'::text, r.replay_id) < (%(at)s, %(source)s, %(id)s))"
    "  ORDER BY r.requested_at DESC, r.replay_id DESC LIMIT %(limit)s)"
    " UNION ALL"
    " (SELECT s.reset_at, 'ledger_resets', s.reset_id, 'reset', s.after_batch_id,"
    "   format('p%%s head %%s -> %%s', s.kafka_partition, coalesce(s.from_offset::text, 'unread'),"
    "     coalesce(s.to_offset::text, 'dropped')),"
    "   s.reset_by, s.reason, NULL, 'head moved by hand'"
    "  FROM kafka2pg.ledger_resets s WHERE s.pipeline = %(pipeline)s AND (%(at)s::timestamptz IS NULL"
    "   OR (s.reset_at, 'ledger_resets'::text, s.reset_id) < (%(at)s, %(source)s, %(id)s))"
    "  ORDER BY s.reset_at DESC, s.reset_id DESC LIMIT %(limit)s)"
    ") h ORDER BY 1 DESC, 2 DESC, 3 DESC LIMIT %(limit)s"
)


def batches_page(conn: Connection, pipeline: str, before: int | None, limit: int) -> list[BatchRow]:
    """The pipeline's batches with ids below `before` (None: the newest), newest first."""
    rows = conn.execute(BATCHES_QUERY, (pipeline, before, before, limit)).fetchall()
    return [_batch_row(*row) for row in rows]


def _batch_row(*row) -> BatchRow:
    *columns, planned_gaps, aborted, markers, compacted, stage_s, validate_s, promote_s = row
    found = {**(planned_gaps or {}), "aborted": aborted, "transaction_markers": markers, "compacted": compacted}
    gaps = {kind: int(found[kind]) for kind in GAP_KINDS if found.get(kind)}
    return BatchRow(*columns, gaps, stage_s, validate_s, promote_s)


def history_page(
    conn: Connection, pipeline: str, before: tuple[datetime, str, int] | None, limit: int
) -> list[HistoryEntry]:
    """The pipeline's replays, undos and partition resets older than the entry `before` (its
    `key`; None: the newest), newest first. Each table is read by its (pipeline, time) index."""
    at, source, entry_id = before if before is not None else (None, None, None)
    rows = conn.execute(
        HISTORY_QUERY,
        {"pipeline": pipeline, "at": at, "source": source, "id": entry_id, "limit": limit},
    ).fetchall()
    return [HistoryEntry(*row) for row in rows]


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
        "SELECT kafka_partition, kafka_offset, kafka_timestamp, reason, substring(raw_key FOR %(n)s),"
        " substring(raw_value FOR %(n)s), octet_length(raw_key), octet_length(raw_value) FROM kafka2pg.quarantine"
        " WHERE batch_id = %(batch)s AND pipeline = %(pipeline)s AND (kafka_partition, kafka_offset) > (%(p)s, %(o)s)"
        " ORDER BY kafka_partition, kafka_offset LIMIT %(limit)s",
        {"n": PREVIEW_BYTES, "batch": batch_id, "pipeline": pipeline, "p": partition, "o": offset, "limit": limit},
    ).fetchall()
    return [QuarantineRow(*row) for row in rows]
