"""The open batches (planned, staged or validated; what `status` lists), failed steps recorded
with their batch, and the STUCK verdict: a batch whose step failed in consecutive runs, which
`status`, `verify` and the task log report instead of staying silent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime

import psycopg
from psycopg import Connection

from kafka2pg.config import Settings
from kafka2pg.database import session, transaction
from kafka2pg.exceptions import (
    PROCESS_STOPS,
    RESUMES_ON_TRIGGER,
    Kafka2PgError,
    LedgerConflictError,
    StageInterrupted,
)
from kafka2pg.lifecycle import CLI_RUN_ID, OPEN
from kafka2pg.locations import COMMAND, preview_first
from kafka2pg.replay_process import process_locks, running_pid
from kafka2pg.task_log import printable

log = logging.getLogger(__name__)
OPEN_STATES = sorted(str(s) for s in OPEN)

# Consecutive runs (claims) failing the same step of one batch before it is called stuck: one
# failure can be a passing outage; the next run failing the same way is a wedge.
STUCK_AFTER_RUNS = 2
_ERROR_CHARS = 2000
# Not failures of the batch: a run fenced off by a newer one, a SIGTERM.
_NOT_FAILURES = (LedgerConflictError, StageInterrupted)


@dataclass(frozen=True)
class StuckBatch:
    """An open batch whose `step` failed in `runs` consecutive runs since `since`."""

    pipeline: str
    batch_id: int
    state: str
    step: str
    runs: int
    since: datetime
    error: str
    ranges: str

    def describe(self) -> str:
        guide = "docs/operations.md (STUCK batches)"
        if RESUMES_ON_TRIGGER in self.error or _names_a_way_on(self.error):  # the error says what to do
            advice = f"See {guide}."
        else:
            advice = f"Fix the cause and trigger a run (it resumes the batch), or see {guide}."
        return (
            f"STUCK: pipeline {self.pipeline!r} batch {self.batch_id} ({self.state}, offsets {self.ranges}) failed "
            f"at {self.step} in {self.runs} consecutive runs since {self.since:%Y-%m-%d %H:%M:%S %Z}: "
            f"{printable(self.error).rstrip('. ')}. {advice}"
        )


def _names_a_way_on(error: str) -> bool:
    """Whether the error names the command that ends the batch's wait (a reset past offsets Kafka
    lost, an abandon): another run alone would fail the same way."""
    return any(f"kafka2pg {command} --pipeline" in error for command in ("reset", "abandon"))  # ./ or not


def is_stuck(failures: int) -> bool:
    return failures >= STUCK_AFTER_RUNS


@contextmanager
def recording_failures(
    settings: Settings,
    pipeline: str,
    batch_id: int,
    epoch: int | None,
    step: str,
    *,
    run_id: str | None = None,
    batches: int = 1,
) -> Iterator[None]:
    """Run one step of a batch; if it raises, record the failure with the batch (and log STUCK
    when the same step failed in the previous run too), then re-raise. A stage job of several
    `batches` records it on the batch `job_batch` finds."""
    try:
        yield
    except (*_NOT_FAILURES, *PROCESS_STOPS):
        raise
    except BaseException as exc:  # Airflow's AirflowTaskTimeout (execution_timeout) is no Exception
        held = job_batch(settings, pipeline, batch_id, epoch, run_id, batches)
        if held is not None:
            record_failure(settings, pipeline, *held, step, exc)
        raise


def job_batch(
    settings: Settings, pipeline: str, batch_id: int | None, epoch: int | None, run_id: str | None, batches: int
) -> tuple[int, int | None] | None:
    """(batch id, epoch) a stage job's failure belongs to: the planned batch, or for a job of
    several `batches` (`batches_per_run`) the oldest `run_id` still holds open (an earlier attempt
    may have promoted the planned one and moved on; without `run_id`, the planned batch, which
    `record_failure` leaves alone once it is no longer open at `epoch`). None when there is none,
    or the database cannot tell (logged: the job's own error is what its caller sees)."""
    if batches <= 1 or not run_id:
        return None if batch_id is None else (batch_id, epoch)
    try:
        return oldest_open_batch(settings, pipeline, run_id)
    except (Kafka2PgError, psycopg.Error) as unknown:
        log.warning("pipeline=%s could not tell which batch the stage failure belongs to: %s", pipeline, unknown)
        return None


# The longest the record of a failure waits for the batch's row.
RECORD_LOCK_WAIT_S = 10


def record_failure(
    settings: Settings, pipeline: str, batch_id: int, epoch: int | None, step: str, exc: BaseException
) -> None:
    error = f"{type(exc).__name__}: {_first_lines(str(exc)) or 'no message'}"[:_ERROR_CHARS]
    try:
        with transaction(settings.database_url) as conn:
            # Not a wait of its own on a batch another process holds (a step that timed out waiting
            # for that process would wait again here, past its timeout): unrecorded, logged.
            conn.execute(
                "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)",
                (f"{RECORD_LOCK_WAIT_S}s", f"{RECORD_LOCK_WAIT_S + 5}s"),
            )
            row = conn.execute(
                "UPDATE kafka2pg.batches SET"
                " failures = CASE WHEN failed_step = %(step)s AND failed_epoch = epoch THEN failures"
                "   WHEN failed_step = %(step)s THEN failures + 1 ELSE 1 END,"
                " failing_since = CASE WHEN failed_step = %(step)s THEN failing_since ELSE now() END,"
                " failed_step = %(step)s, failed_epoch = epoch, last_failure = %(error)s"
                " WHERE batch_id = %(batch)s AND (%(epoch)s::bigint IS NULL OR epoch = %(epoch)s)"
                " AND state = ANY(%(open)s) RETURNING failures",
                {"step": step, "error": error, "batch": batch_id, "epoch": epoch, "open": OPEN_STATES},
            ).fetchone()
            stuck = stuck_batches(conn, pipeline, batch_id) if row is not None and is_stuck(row[0]) else []
    except (Kafka2PgError, psycopg.Error) as unrecorded:  # the step's own error is what the caller sees
        log.warning("pipeline=%s batch_id=%s could not record the %s failure: %s", pipeline, batch_id, step, unrecorded)
        return
    for batch in stuck:
        log.error("%s", batch.describe())


@dataclass(frozen=True)
class OpenBatch:
    """A batch planned, staged or validated and not yet promoted: what `status` lists as open."""

    pipeline: str
    batch_id: int
    kind: str
    state: str
    after_batch_id: int | None
    run_id: str | None
    claimed_at: datetime
    failed_step: str | None
    failures: int
    failing_since: datetime | None
    last_failure: str | None
    ranges: str
    next_run: str = ""  # what the next run does with it (`open_batches`)

    @property
    def stuck(self) -> StuckBatch | None:
        """The STUCK verdict when the same step failed in consecutive runs."""
        if self.failed_step is None or not is_stuck(self.failures):
            return None
        return StuckBatch(
            self.pipeline,
            self.batch_id,
            self.state,
            self.failed_step,
            self.failures,
            self.failing_since,  # set with every failure recorded
            self.last_failure or "no message",
            self.ranges,
        )

    def describe(self) -> str:
        after = f", planned after batch {self.after_batch_id}" if self.after_batch_id else ""
        what = f"{self.kind}, {self.state}{after}"
        by = f" by run {self.run_id}" if self.run_id else ""
        line = f"open: batch {self.batch_id} ({what}) {self.ranges}, claimed {self.claimed_at:%Y-%m-%d %H:%M:%S %Z}{by}"
        if self.failed_step:
            # Stored shortened to its first lines; it may quote a record's bytes (a key, a value).
            failure = self.last_failure or "no message"
            line += f"; last failure at {self.failed_step}: " + printable(
                failure if len(failure) <= _FAILURE_SHOWN else failure[: _FAILURE_SHOWN - 1] + "…"
            )
        return line + (f"; next run: {self.next_run}" if self.next_run else "")


# Of a failure's stored text, what one open-batch line shows.
_FAILURE_SHOWN = 200


def open_batches(conn: Connection, pipeline: str, batch_id: int | None = None) -> list[OpenBatch]:
    """The pipeline's open batches (or the one given, if open), oldest first, with their ranges."""
    # Read before and after the batches: a process that ends in between finished its batch, and
    # one that starts in between holds its lock by then.
    locks = process_locks(conn) if batch_id is None else {}
    rows = conn.execute(
        "SELECT b.batch_id, b.kind, b.state, b.after_batch_id, b.run_id, b.claimed_at, b.failed_step, b.failures,"
        " b.failing_since, b.last_failure, coalesce(string_agg(format('p%%s[%%s,%%s)', p.kafka_partition,"
        " p.start_offset, p.end_offset), ' ' ORDER BY p.kafka_partition), 'none')"
        " FROM kafka2pg.batches b LEFT JOIN kafka2pg.batch_partitions p USING (batch_id)"
        " WHERE b.pipeline = %s AND (%s::bigint IS NULL OR b.batch_id = %s) AND b.state = ANY(%s)"
        " GROUP BY b.batch_id ORDER BY b.batch_id",
        (pipeline, batch_id, batch_id, OPEN_STATES),
    ).fetchall()
    batches = [OpenBatch(pipeline, *row) for row in rows]
    if batch_id is not None:
        return batches
    by_cli = [b.batch_id for b in batches if b.kind != "live" and b.run_id == CLI_RUN_ID]
    if by_cli:
        locks |= process_locks(conn)
    return with_next_runs(batches, {i: pid for i in by_cli if (pid := running_pid(locks, i)) is not None})


def with_next_runs(batches: list[OpenBatch], running: dict[int, int] | None = None) -> list[OpenBatch]:
    """A pipeline's open batches (all of them, in id order), each with what the next run does with it.

    `running`: the CLI replay batches whose `kafka2pg replay` process runs, with its session's pid."""
    shown, live, running = [], 0, running or {}
    for batch in batches:
        if batch.kind != "live":
            pid = running.get(batch.batch_id) if batch.run_id == CLI_RUN_ID else None
            left = REPLAY_LEFT if batch.run_id != CLI_RUN_ID else REPLAY_LEFT_CLI if pid is None else REPLAY_RUNNING_CLI
            action = left.format(pipeline=batch.pipeline, batch_id=batch.batch_id, pid=pid)
        else:
            live += 1
            action = RESUMES if live == 1 else ABANDONS
        shown.append(replace(batch, next_run=action))
    return shown


# What the next run does with an open batch (as `opening.open_batch` plans): the oldest open live
# batch is resumed, every later one (an earlier run's lookahead) abandoned; a replay's is its own.
RESUMES = (
    "resumes it, unless its plan no longer holds (the heads moved: an undo, a reset; its offsets expired; "
    "the topic recreated)"
)
ABANDONS = (
    "abandons it (a lookahead) and plans its offsets afresh, unless the run that planned it is still going "
    "and finishes it first"
)
# The command that discards an open replay batch its run or process will not finish.
ABANDON_COMMAND = preview_first("abandon --pipeline {pipeline} --batch-id {batch_id}")
REPLAY_LEFT = (
    "leaves it: only its replay run's retries carry it on; once that run has ended without it, "
    f"{ABANDON_COMMAND} discards it"
)
REPLAY_LEFT_CLI = (
    f"leaves it: the `{COMMAND} replay` process that planned it is gone (no session holds its lock), and only it "
    f"would carry it on; {ABANDON_COMMAND} discards it"
)
REPLAY_RUNNING_CLI = (
    f"leaves it to the `{COMMAND} replay` process running it (its session: backend pid {{pid}}); if that process "
    f"hangs, stop it; {ABANDON_COMMAND} discards it"
)


def oldest_open_batch(settings: Settings, pipeline: str, run_id: str) -> tuple[int, int] | None:
    """(batch id, epoch) of the oldest batch `run_id` claimed that is still open: where a stage
    job of several batches stopped (the batches before it were promoted, a lookahead after it
    is planned from it); None when the run holds none."""
    with session(settings.database_url) as conn:
        return conn.execute(
            "SELECT batch_id, epoch FROM kafka2pg.batches WHERE pipeline = %s AND run_id = %s AND state = ANY(%s)"
            " ORDER BY batch_id LIMIT 1",
            (pipeline, run_id, OPEN_STATES),
        ).fetchone()


def stuck_batches(conn: Connection, pipeline: str, batch_id: int | None = None) -> list[StuckBatch]:
    """The pipeline's open batches that failed the same step in consecutive runs."""
    return [batch.stuck for batch in open_batches(conn, pipeline, batch_id) if batch.stuck is not None]


def _first_lines(text: str, lines: int = 3) -> str:
    """A Java or Python trace shortened to its first lines: the message, not the frames."""
    return " | ".join(line.strip() for line in text.strip().splitlines()[:lines] if line.strip())
