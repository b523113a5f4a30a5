"""Human-readable summaries: what landed, the ledger per partition, a batch's counts and checks.

Used by the promote task's log, `./kafka2pg status` and the demo command.
"""

from __future__ import annotations

from psycopg import Connection, sql

from kafka2pg.batch_store import load_claimed
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import NOT_READY_ERRORS, session
from kafka2pg.lifecycle import BatchState
from kafka2pg.locations import COMMAND
from kafka2pg.status import PipelineStatus, pipeline_status
from kafka2pg.task_log import fit, printable, table


def ledger_report(settings: Settings, pipeline: Pipeline) -> str:
    return status_report(settings, pipeline)[0]


def status_report(settings: Settings, pipeline: Pipeline) -> tuple[str, PipelineStatus]:
    """What `kafka2pg status` prints of the pipeline, and the status it read."""
    with session(settings.database_url) as conn:  # Kafka is asked in between: no transaction
        status = pipeline_status(settings, pipeline, conn)
        target = sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(pipeline.target_schema, pipeline.target_table)
        )
        landed = _count(conn, status, target)
        quarantined = _count(
            conn, status, "SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", pipeline.name
        )
        batches = conn.execute(
            "SELECT state, count(*) FROM kafka2pg.batches WHERE pipeline = %s GROUP BY state ORDER BY state",
            (pipeline.name,),
        ).fetchall()
    rows = [
        [p.partition, p.next_offset, p.low_watermark, p.high_watermark, p.lag, p.margin, p.time_to_loss]
        for p in status.partitions
    ]
    ledger = (
        [f"ledger: Kafka's offsets unknown, not shown ({status.kafka_error})"]
        if status.kafka_error
        else [
            "ledger:",
            table(
                ["partition", "next_offset", "low_watermark", "high_watermark", "lag", "margin", "time_to_loss"], rows
            ),
        ]
    )
    text = "\n".join(
        [
            f"pipeline {pipeline.name}: topic {pipeline.topic} -> {pipeline.target_schema}.{pipeline.target_table}",
            f"rows landed in target: {landed}; records in quarantine: {quarantined}",
            "batches: " + (", ".join(f"{n} {s}" for s, n in batches) or "none"),
            *status.not_ready_lines("this command's"),
            *status.blocked_lines(),
            *status.open_batch_lines(),
            *(batch.describe() for batch in status.stuck),
            *ledger,
        ]
    )
    return text, status


def _count(conn: Connection, status: PipelineStatus, query: str | sql.Composed, *params: object) -> int | str:
    """A count for `status`; on a database found not ready, a table it cannot read (not created
    yet, not granted) is "unknown": the NOT READY line says what to run."""
    try:
        return conn.execute(query, params).fetchone()[0]
    except NOT_READY_ERRORS:
        if status.not_ready is None:
            raise
        return "unknown (NOT READY)"


def batch_report(settings: Settings, pipeline: Pipeline, batch_id: int) -> str:
    with session(settings.database_url) as conn:
        batch = conn.execute(
            "SELECT state, records_planned, records_read, rows_promoted, rows_quarantined, report_path"
            " FROM kafka2pg.batches WHERE batch_id = %s",
            (batch_id,),
        ).fetchone()
        parts = conn.execute(
            "SELECT kafka_partition, start_offset, end_offset, records_read, min_offset_read, max_offset_read,"
            " aborted_records, marker_offsets, compacted_offsets FROM kafka2pg.batch_partitions"
            " WHERE batch_id = %s ORDER BY kafka_partition",
            (batch_id,),
        ).fetchall()
        checks = conn.execute(
            "SELECT check_name, CASE WHEN success THEN 'ok' ELSE 'FAILED' END, unexpected_count, details"
            " FROM kafka2pg.batch_checks WHERE batch_id = %s ORDER BY check_name",
            (batch_id,),
        ).fetchall()
    if batch is None:
        return f"batch {batch_id}: not found"
    state, planned, read, promoted, quarantined, report_path = batch
    lines = [
        f"batch {batch_id} ({state}): planned {planned} offsets, read {read}, "
        f"promoted {promoted}, quarantined {quarantined}",
        table(
            ["partition", "start", "end", "read", "min_offset", "max_offset", "aborted", "markers", "compacted"],
            [list(p) for p in parts],
        ),
        fit(f"quality checks of batch {batch_id} (table kafka2pg.batch_checks; report: {report_path or 'none'}):"),
        table(["check", "result", "unexpected", "details"], [list(c) for c in checks]),
        ledger_report(settings, pipeline),
    ]
    return "\n".join(lines)


def quality_summary(settings: Settings, pipeline: Pipeline, batch_id: int | None = None) -> str:
    """The latest (or the given) validated batch's verdict, a summary of its checks and where its report is.

    The report is the result stored with the batch (kafka2pg.quality_results); the file export is
    named when the validate task wrote one.
    """
    with session(settings.database_url) as conn:
        row = conn.execute(
            "SELECT b.batch_id, b.state, b.report_path, r.verdict, b.records_read, b.rows_quarantined"
            " FROM kafka2pg.batches b LEFT JOIN kafka2pg.quality_results r USING (batch_id)"
            " WHERE b.pipeline = %s AND (%s::bigint IS NULL OR b.batch_id = %s)"
            " AND (b.report_path IS NOT NULL OR EXISTS (SELECT FROM kafka2pg.quality_results r"
            " WHERE r.batch_id = b.batch_id)) ORDER BY b.batch_id DESC LIMIT 1",
            (pipeline.name, batch_id, batch_id),
        ).fetchone()
        if row is None and batch_id is not None:  # BatchStateError: no such batch, or another pipeline's
            batch = load_claimed(conn, pipeline, batch_id, None, lock=False)
            return f"pipeline {pipeline.name}: no quality report yet for batch {batch_id} ({batch.state})"
        if row is None:
            return f"pipeline {pipeline.name}: no quality report yet"
        checks = conn.execute(
            "SELECT check_name, success, unexpected_count FROM kafka2pg.batch_checks WHERE batch_id = %s"
            " ORDER BY check_name",
            (row[0],),
        ).fetchall()
    batch, state, _, verdict, read, quarantined = row
    failed = [f"{name} ({n} unexpected)" for name, ok, n in checks if not ok]
    caught = [f"{name}: {n}" for name, ok, n in checks if ok and n]
    refused = (quarantined or 0) - sum(n for name, ok, n in checks if ok and n and not name.startswith("gx:"))
    if refused > 0:  # not flagged by a check: refused by admission or by PostgreSQL (staging, promotion)
        caught.insert(0, f"refused by admission or PostgreSQL: {refused}")
    where = (
        f"quality report {row[2]}"
        if row[2]
        else f"quality report in the database ({COMMAND} report --html --pipeline {pipeline.name} --batch-id {row[0]})"
    )
    return "\n".join(
        [
            f"pipeline {pipeline.name} batch {batch} ({state}): {where}",
            f"  verdict: {verdict or 'not recorded'}; {len(checks)} checks, {len(failed)} failed"
            + (f": {'; '.join(failed)}" if failed else ""),
            f"  caught and quarantined (of {read or 0} records read): " + ("; ".join(caught) or "nothing"),
        ]
    )


def quarantine_listing(settings: Settings, pipeline: Pipeline, batch_id: int | None, limit: int) -> str:
    """The pipeline's quarantined records (of one batch, or the newest `limit`): batch, partition,
    offset, the raw value's size and the reason, control characters escaped, under how many
    there are in all. Rows of batches not promoted yet are still in the staging table, flagged,
    and not listed."""
    state = None
    with session(settings.database_url) as conn:
        if batch_id is not None:  # BatchStateError: no such batch, or another pipeline's
            state = load_claimed(conn, pipeline, batch_id, None, lock=False).state
        where = sql.SQL("pipeline = %(p)s AND (%(b)s::bigint IS NULL OR batch_id = %(b)s)")
        total = conn.execute(
            sql.SQL("SELECT count(*) FROM kafka2pg.quarantine WHERE {}").format(where),
            {"p": pipeline.name, "b": batch_id},
        ).fetchone()[0]
        rows = conn.execute(
            sql.SQL(
                "SELECT batch_id, kafka_partition, kafka_offset, octet_length(raw_value), reason"
                " FROM kafka2pg.quarantine WHERE {} ORDER BY batch_id DESC, kafka_partition, kafka_offset LIMIT %(n)s"
            ).format(where),
            {"p": pipeline.name, "b": batch_id, "n": limit},
        ).fetchall()
    scope = f"batch {batch_id}" if batch_id is not None else "all batches"
    if not rows:
        return f"pipeline {pipeline.name} ({scope}): no quarantined records{_none_quarantined(pipeline, state)}"
    order = "by partition and offset" if batch_id is not None else "the newest batches first"
    shown = "" if total <= len(rows) else f", {len(rows)} shown (--limit): {order}"
    head = f"pipeline {pipeline.name} ({scope}): {total} quarantined record(s){shown}"
    body = table(
        ["batch", "partition", "offset", "raw bytes", "reason"],
        [(b, p, o, size, printable(reason)) for b, p, o, size, reason in rows],
        text_last=True,
    )
    return f"{head}\n{body}"


def _none_quarantined(pipeline: Pipeline, state: BatchState | None) -> str:
    """Why a batch in `state` (None: all batches) has no rows in kafka2pg.quarantine, where that says more."""
    staging = f"kafka2pg.{pipeline.staging_table}"
    if state is None:
        return f" (a batch not promoted yet holds the records it flagged in its staging table, {staging})"
    return {
        BatchState.PLANNED: " yet: the batch is planned, nothing of it is read",
        BatchState.STAGED: f" yet: the batch is staged, not promoted; what it flags waits in {staging}",
        BatchState.VALIDATED: f" yet: the batch is validated, not promoted; what it flagged waits in {staging}",
        BatchState.REJECTED: (
            f": the batch was rejected, never promoted (its rows stay in {staging} until the next batch is planned)"
        ),
        BatchState.ABANDONED: (
            ": the batch was abandoned, never promoted (a live batch's offsets were planned afresh; a replay's "
            "range keeps the rows it had)"
        ),
        BatchState.VERIFIED: ": the batch is a verify-only replay, which writes no rows",
        BatchState.UNDONE: ": the batch was undone, its rows (the quarantine's too) removed",
    }.get(state, "")
