"""The quality gate (DESIGN step 3): the SQL checks (`kafka2pg.checks`, which flag duplicates
to quarantine) and Great Expectations on a staged batch, the verdict, and the batch's report.

One transaction under the batch's row lock: checks (kafka2pg.batch_checks), the report's data
(kafka2pg.quality_results) and the state move commit together. It fails closed: a batch is
promoted only from `validated`, which only this module sets. Kafka is asked before the lock;
the report's files, an export of the stored result, are written after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psycopg
from psycopg import Connection

from kafka2pg.batch_store import (
    Batch,
    key_probe_deferred,
    load_claimed,
    raise_staging_lost,
    staging_lost,
    transition,
)
from kafka2pg.checks import (
    Check,
    ProbeAwaitsPrevious,
    gap_witnesses,
    quarantined_rows,
    recheck_after_collision,
    run_checks,
    store_checks,
)
from kafka2pg.config import Pipeline, Settings
from kafka2pg.data_docs import report_payload, write_report
from kafka2pg.database import transaction
from kafka2pg.exceptions import BatchStateError, Kafka2PgError, QualityGateFailed, timeouts_named
from kafka2pg.lifecycle import Action, BatchState, gate_verdict, validate_action
from kafka2pg.quality_results import load_result, store_result
from kafka2pg.raw_bytes import keep_raw_bytes, staging_place
from kafka2pg.rows import staged_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationResult:
    batch_id: int
    state: BatchState
    checks: tuple[Check, ...]
    message: str
    report: Path | None = None

    @property
    def success(self) -> bool:
        return all(c.success for c in self.checks)


def validate_batch(
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    epoch: int | None = None,
    *,
    probe_promoted_keys: bool = False,
    previous_pending: bool = False,
) -> ValidationResult:
    """Run every check on the staged batch; mark it `validated` or `rejected` (and raise).

    The check that no business key was promoted before is deferred to the target's unique
    index at promotion when `_may_defer_key_probe` allows it; `probe_promoted_keys` runs it
    here whatever the history. A batch sent back by a collision at promotion gets only that
    check (whoever validates it: the promotion itself, a retry, the next run).
    `previous_pending`: the batch before this one may not be promoted yet (a multi-batch run
    validates a batch while promoting the one before); where the gate would have to probe the
    target for promoted keys it raises `ProbeAwaitsPrevious` instead, having changed nothing.
    """
    with timeouts_named(pipeline.name, batch_id, "validation"):
        return _validate(settings, pipeline, batch_id, epoch, probe_promoted_keys, previous_pending)


def _validate(
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    epoch: int | None,
    probe_promoted_keys: bool,
    previous_pending: bool,
) -> ValidationResult:
    checks: list[Check] = []
    # Kafka is asked before any lock is taken; None for a batch only rechecked after a key collision.
    witnesses = gap_witnesses(settings, pipeline, batch_id)
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        action = validate_action(batch.state)
        if action is Action.DONE:
            message = f"batch {batch_id} is already {batch.state}"
            return ValidationResult(batch_id, batch.state, (), message)
        if action is Action.REFUSE:
            raise BatchStateError.wrong_state(
                pipeline.name,
                batch_id,
                batch.state,
                "only a staged batch can be validated",
                "Run the stage step first (or trigger a new run)."
                if batch.state is BatchState.PLANNED
                else "It is over: trigger a new run (for a replay's range, a new replay).",
            )
        staged = staged_counts(conn, pipeline, batch_id)  # one count: the loss guard and completeness
        lost = staging_lost(conn, pipeline, batch, staged)
        if not lost:
            if key_probe_deferred(conn, batch_id):  # sent back by a key collision at promotion
                if previous_pending:
                    raise ProbeAwaitsPrevious(batch_id)  # rolls back; nothing was changed yet
                sql_checks = recheck_after_collision(conn, pipeline, batch)
            else:
                sql_checks = run_checks(conn, pipeline, batch, probe_promoted_keys, staged, witnesses, previous_pending)
            quarantined = quarantined_rows(conn, pipeline, batch_id)
            gx_checks, gx_rows = _great_expectations(conn, pipeline, batch, quarantined)
            checks = sql_checks + gx_checks
            store_checks(conn, batch_id, checks)
            failed = {c.name: c.details for c in checks if not c.success}
            summary = QualityGateFailed.summary(failed)
            payload = report_payload(
                pipeline, batch_id, **_report(batch, sql_checks, gx_rows, quarantined, bool(summary))
            )
            validated_at = store_result(conn, batch_id, payload)
            verdict = gate_verdict(sum(not c.success for c in checks))
            error = {"error": summary[:2000]} if verdict is BatchState.REJECTED else {}
            # report_path: the export of an earlier verdict is not this one's (set again after the export).
            transition(conn, batch, verdict, rows_quarantined=quarantined, report_path=None, **error)
    if lost:
        raise_staging_lost(pipeline, batch_id)
    if any(c.flagged for c in checks):
        keep_raw_bytes(settings, pipeline, batch_id, staging_place(pipeline))
    report = _write_report(settings, pipeline, payload, validated_at)  # files: after the batch's lock is released
    if summary:
        raise QualityGateFailed.rejected(pipeline.name, batch_id, failed, report, pipeline.staging_table)
    flagged = sum(c.flagged for c in checks)
    message = (
        f"batch {batch_id}: {len(checks)} checks passed, {flagged} row(s) flagged to quarantine; "
        f"report: {report or 'not written'}"
    )
    log.info("pipeline=%s %s", pipeline.name, message)
    return ValidationResult(batch_id, BatchState.VALIDATED, tuple(checks), message, report)


def _great_expectations(
    conn: Connection, pipeline: Pipeline, batch: Batch, quarantined: int
) -> tuple[list[Check], list[dict]]:
    """The GX suite on the accepted rows, as checks and as report rows.

    Fails closed: an exception or a missing result becomes a failed check; a database error
    reading the rows fails the step instead (the batch stays staged), not the batch.
    """
    from kafka2pg.expectations import load_accepted, run_suite, suite_for

    suite = suite_for(pipeline, (batch.records_read or 0) - quarantined)
    try:
        outcome = run_suite(load_accepted(conn, pipeline, batch.batch_id), suite)
    except Exception as exc:  # noqa: BLE001 - fail closed: whatever GX raises blocks promotion, with the reason
        if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.DataError):
            # The database's trouble reading the rows (a statement_timeout, a lost connection): the
            # step's, retried. A value psycopg cannot read (DataError) is the batch's: fail closed.
            raise
        log.exception("pipeline=%s batch_id=%s Great Expectations failed", pipeline.name, batch.batch_id)
        error = f"Great Expectations raised {type(exc).__name__}: {exc}"
        row = {"expectation": "validation_error", "column": "", "meaning": error, "success": False, "unexpected": 0}
        return [Check("gx:validation_error", False, 0, error)], [{**row, "sample_offsets": []}]
    log.info(
        "pipeline=%s batch_id=%s Great Expectations %s: %s expectations on %s rows in %.2fs",
        pipeline.name,
        batch.batch_id,
        outcome.gx_version,
        len(outcome.results),
        outcome.rows,
        outcome.seconds,
    )
    checks, rows = [], []
    for r in outcome.results:
        samples = ", ".join(r.sample_offsets) or "none"
        checks.append(
            Check(
                r.expectation.name,
                r.success,
                r.unexpected,
                r.error or f"{r.expectation.meaning}; sample offsets: {samples}",
            )
        )
        rows.append(
            {
                "expectation": r.expectation.type,
                "column": r.expectation.name.split(":", 2)[2],
                "meaning": r.expectation.meaning,
                "success": r.success,
                "unexpected": r.unexpected,
                "sample_offsets": r.sample_offsets,
                "error": r.error,
            }
        )
    if len(outcome.results) != len(suite):
        checks.append(Check("gx:missing_results", False, len(suite) - len(outcome.results), "GX returned no result"))
    return checks, rows


def _report(batch: Batch, sql_checks: list[Check], gx_rows: list[dict], quarantined: int, rejected: bool) -> dict:
    """What the batch's quality report shows, taken in the gate's transaction."""
    read = batch.records_read or 0
    return {
        "verdict": "rejected" if rejected else "promotable",
        "expectations": gx_rows,
        "checks": [
            {
                "check": c.name,
                "success": c.success,
                "unexpected": c.unexpected,
                "flagged": c.flagged,
                "details": c.details,
            }
            for c in sql_checks
        ],
        "counts": {
            "records read": read,
            "accepted (to promote)": read - quarantined,
            "to quarantine": quarantined,
            "business-key duplicates found": sum(c.unexpected for c in sql_checks if "business_key" in c.name),
        },
        "gx_version": _gx_version(),
    }


def _write_report(settings: Settings, pipeline: Pipeline, payload: dict, validated_at: datetime) -> Path | None:
    """Export the stored result as files, then record where (a crash in between leaves report_path unset).

    The files are the batch's current result's: when the batch was validated again while this
    wrote them (a re-staged batch's next gate, whose export may have come first), the newer
    stored result is exported over them before report_path is set. Best effort: the verdict and
    its stored result are committed already, so files that cannot be written (disk full, no
    permission) are logged, leave the batch without a report_path, and None is returned; the
    report stays in the database (`kafka2pg report --html`, the plugin's page).
    """
    from kafka2pg.data_docs import report_dir

    batch_id = payload["batch_id"]
    path = None
    try:
        for _ in range(_EXPORTS):
            try:
                path = write_report(settings.state_dir, pipeline, payload)
            except OSError as exc:
                log.warning(
                    "pipeline=%s batch_id=%s quality report not written to %s (%s); the gate's verdict stands, "
                    "the report is in the database",
                    pipeline.name,
                    batch_id,
                    report_dir(settings.state_dir, pipeline),
                    exc,
                )
                path = None
            with transaction(settings.database_url) as conn:
                # The batch's row first, as every writer of its result locks it: no later verdict
                # replaces the result before report_path names its files.
                conn.execute("SELECT FROM kafka2pg.batches WHERE batch_id = %s FOR NO KEY UPDATE", (batch_id,))
                current = conn.execute(
                    "SELECT validated_at FROM kafka2pg.quality_results WHERE batch_id = %s", (batch_id,)
                ).fetchone()
                if current is None:
                    log.warning(
                        "pipeline=%s batch_id=%s was staged again while its quality report was exported to %s: "
                        "those files show a verdict the batch no longer has (the next gate exports its own)",
                        pipeline.name,
                        batch_id,
                        path,
                    )
                    return None
                if current[0] == validated_at:
                    conn.execute(
                        "UPDATE kafka2pg.batches SET report_path = %s WHERE batch_id = %s",
                        (path and str(path), batch_id),
                    )
                    return path
                if path is None:  # nothing written over the later verdict's files
                    return None
                later = load_result(conn, pipeline.name, batch_id)  # under the batch's lock: that verdict's
            log.warning(
                "pipeline=%s batch_id=%s was validated again while its quality report was exported: exporting "
                "that later verdict (%s) to %s instead",
                pipeline.name,
                batch_id,
                later.get("verdict"),
                path,
            )
            validated_at, payload = current[0], later
        log.warning(
            "pipeline=%s batch_id=%s quality report exported to %s while the batch was validated again %s times; "
            "report_path not set (the report is in the database)",
            pipeline.name,
            batch_id,
            path,
            _EXPORTS,
        )
    except (psycopg.Error, Kafka2PgError) as exc:
        log.warning(
            "pipeline=%s batch_id=%s quality report exported to %s but not recorded on the batch (%s); the "
            "gate's verdict stands, the report is in the database",
            pipeline.name,
            batch_id,
            path,
            exc,
        )
        return path
    return None


# How many times an export follows a batch validated again while it wrote the files.
_EXPORTS = 3


def _gx_version() -> str:
    from importlib.metadata import version

    return version("great-expectations")
