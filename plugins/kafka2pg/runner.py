"""Several batches in one Spark session: how one DAG run catches up a backlog.

With `batches_per_run: 1` (the DAG's default) the stage job only stages the planned batch and
the DAG's `validate` and `promote` tasks finish it. With more, the job finishes each batch
itself, with the same functions and the same transactions those tasks run (stage -> quality
gate -> promote, every step fenced by the run's claim), and stages the next batch meanwhile,
until the backlog is empty or `batches_per_run` batches are promoted. The DAG's `validate` and
`promote` tasks then find the planned batch promoted and change nothing. A failure at any step
stops the loop: the batches before it stay promoted, the failed one stays where it stopped
(the next run resumes it, as after any failed run) and a lookahead after it is abandoned.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from dataclasses import dataclass, field

from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from kafka2pg.batch_store import Batch, abandon_unpromoted, load_claimed
from kafka2pg.checks import ProbeAwaitsPrevious
from kafka2pg.config import UNFILTERED_LOG, Pipeline, Settings, get_pipeline, names_own_log_config
from kafka2pg.database import transaction
from kafka2pg.exceptions import LedgerConflictError, StageInterrupted
from kafka2pg.expectations import warm_up_in_background
from kafka2pg.ledger import lock_plan
from kafka2pg.lifecycle import BatchState, is_open
from kafka2pg.opening import open_batch, plan_lookahead, topic_admin
from kafka2pg.quality import validate_batch
from kafka2pg.scratch import job_scratch
from kafka2pg.staging import kafka_group_id, package_zip, spark_session, stage_batch, stop_session
from kafka2pg.steps import promote_batch
from kafka2pg.stuck import recording_failures
from kafka2pg.task_log import promotion_summary, step_summary, validation_summary

log = logging.getLogger(__name__)

PHASES = ("plan", "stage", "validate", "promote")


@dataclass
class RunResult:
    """What one run did: the batches it finished (or only staged) and seconds per phase.

    `records`: records this run read from Kafka (a batch staged by an earlier attempt adds
    none); `rows_promoted` / `rows_quarantined`: the rows this run's promotions landed (a batch
    an earlier attempt promoted is listed in `promoted` but adds none).
    """

    staged: list[int] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)
    records: int = 0
    rows_promoted: int = 0
    rows_quarantined: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    message: str = ""


def run_batches(
    spark: SparkSession,
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    epoch: int | None = None,
    *,
    batches: int = 1,
    run_id: str | None = None,
    max_records_per_batch: int | None = None,
    stop: threading.Event | None = None,
) -> RunResult:
    """Stage the planned batch; with `batches` > 1 also finish it and go on with the next ones.

    With more than one batch, batch N+1 is planned (a lookahead, from N's planned ends) and
    staged by Spark while a second thread runs N's quality gate and promotion in PostgreSQL:
    the two use different resources. Once N+1 is staged, its quality gate runs beside N's
    promotion, with the check that needs N's rows in the target (a probe of the target for
    promoted business keys, when the target's unique index cannot stand in for it) left until
    N is promoted; N+1 is promoted only after N, and on N's partitions its compare-and-set
    cannot succeed before N's. N+2 is planned once N is promoted. A planning error still lets N
    finish before the run stops; after SIGTERM a gate or promotion under way finishes its
    transaction and none starts.
    """
    if batches < 1:
        raise ValueError(f"batches must be at least 1, got {batches}")
    result = RunResult()
    # One client for the topic questions of all the run's plans and stages, asked from this thread.
    kafka = topic_admin(settings, pipeline)
    if batches == 1:
        current = _stage(result, spark, settings, pipeline, batch_id, epoch, stop, kafka)
        result.message = current.message
        return result
    # The first quality gate's GX import, paid beside Spark's start (run_job starts it before the
    # session) and the first stages; every finishing thread joins it before it validates, so GX
    # is never imported by two threads.
    warming = warm_up_in_background()
    current = _stage(result, spark, settings, pipeline, batch_id, epoch, stop, kafka)
    finishing = None  # the thread finishing `current`, when it was started early
    while current is not None:
        following = planning_error = None
        if len(result.promoted) + 1 < batches and not _stopped(stop):
            try:
                following = _timed(
                    result, "plan", _next_batch, settings, pipeline, current, run_id, max_records_per_batch, kafka
                )
            except Exception as exc:  # noqa: BLE001 - the staged batch is still finished first, then this raises
                planning_error = exc
        if finishing is None:
            finishing = _Finish(result, settings, pipeline, current.batch_id, current.epoch, warming, stop=stop)
            finishing.start()
        stage_error = None
        staged = early = None
        if following is not None and not _stopped(stop):  # SIGTERM during planning: stage nothing more
            try:
                staged = _stage(result, spark, settings, pipeline, following.batch_id, following.epoch, stop, kafka)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once the finishing thread is done
                stage_error = exc
            if staged is not None and not _stopped(stop):
                early = _Finish(
                    result, settings, pipeline, staged.batch_id, staged.epoch, warming, after=finishing, stop=stop
                )
                early.start()
        finishing.join()
        if finishing.error is not None:
            _stop_early(early)
            if following is not None:
                _abandon_lookahead(settings, pipeline, following, current.batch_id)
            raise finishing.error
        if not finishing.finished:  # SIGTERM before its gate or promotion began: the batch stays open
            _stop_early(early)
            raise _interrupted(pipeline, result)
        result.promoted.append(current.batch_id)
        log.info(
            "pipeline=%s run %s: batch %s/%s done (%s); so far %s records read, %s rows promoted; seconds: %s",
            pipeline.name,
            run_id,
            len(result.promoted),
            batches,
            finishing.message,
            result.records,
            result.rows_promoted,
            ", ".join(f"{k} {v:.1f}" for k, v in result.phases.items()),
        )
        for error in (stage_error, planning_error):
            if error is not None:
                raise error
        if _stopped(stop):
            _stop_early(early)
            raise _interrupted(pipeline, result)
        current, finishing = staged, early
    result.message = (
        f"{len(result.promoted)} batch(es) promoted in this run ({result.records} records read): "
        f"{', '.join(map(str, result.promoted))}; {result.rows_promoted} rows to "
        f"{pipeline.target_schema}.{pipeline.target_table}, {result.rows_quarantined} to quarantine"
    )
    log.info("pipeline=%s %s", pipeline.name, result.message)
    return result


def _stop_early(early: _Finish | None) -> None:
    """The run stops before the batch `early` finishes: no promotion; its quality gate, if under
    way, ends its transaction (the batch stays open, for the next run to resume)."""
    if early is not None:
        early.cancel()
        early.join()


@dataclass(frozen=True)
class _Staged:
    batch_id: int
    epoch: int | None
    state: BatchState
    message: str


def _stage(result: RunResult, spark, settings, pipeline, batch_id: int, epoch: int | None, stop, kafka) -> _Staged:
    started = time.monotonic()
    with recording_failures(settings, pipeline.name, batch_id, epoch, "stage"):
        staged = _timed(
            result, "stage", stage_batch, spark, settings, pipeline, batch_id, epoch, stop=stop, kafka=kafka
        )
    log.info(
        "%s",
        step_summary(
            "stage",
            pipeline.name,
            batch_id,
            time.monotonic() - started,
            ranges=staged.ranges,
            state=None if staged.state is BatchState.STAGED else staged.state,  # shown when found further on
            records=staged.records_read,
            rows=staged.records_read - staged.quarantined,
            quarantined=staged.quarantined,
        ),
    )
    result.staged.append(batch_id)
    result.records += staged.records_read
    return _Staged(batch_id, epoch, staged.state, staged.message)


def _next_batch(settings, pipeline, current: _Staged, run_id, max_records_per_batch, kafka) -> Batch | None:
    """The lookahead after an open batch; after one already promoted (a retried job), the next run's plan."""
    if current.state is BatchState.PROMOTED:
        opened = open_batch(
            settings, pipeline, max_records_per_batch=max_records_per_batch, run_id=run_id, job_retry=True, kafka=kafka
        )
        log.info("pipeline=%s %s", pipeline.name, opened.message)
        return opened.batch
    batch = plan_lookahead(
        settings,
        pipeline,
        current.batch_id,
        current.epoch,
        max_records_per_batch=max_records_per_batch,
        run_id=run_id,
        kafka=kafka,
    )
    if batch is not None:
        log.info("pipeline=%s batch %s planned after batch %s", pipeline.name, batch.batch_id, current.batch_id)
    return batch


class _Finish(threading.Thread):
    """Quality gate + promotion of one batch, beside the Spark stage of the next one.

    `after`: the thread finishing the batch before this one, when this one starts before that
    batch is promoted. This one's gate then waits for that gate's verdict (so the previous
    batch's checks are stored), runs beside that promotion (`previous_pending`), and this
    promotion waits for that one. Neither the gate nor the promotion starts once that one
    failed, the run cancelled this one or `stop` (SIGTERM) is set; `finished` tells whether the
    batch was promoted.
    """

    def __init__(
        self,
        result: RunResult,
        settings,
        pipeline,
        batch_id: int,
        epoch: int | None,
        warming: threading.Thread,
        after: _Finish | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        super().__init__(name=f"kafka2pg-finish-{batch_id}", daemon=True)
        self.args_ = (result, settings, pipeline, batch_id, epoch)
        self.warming = warming
        self.after = after
        self.stop = stop
        self.gated = threading.Event()  # this batch's gate has ended (whatever its verdict)
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        self.finished = False  # promoted (by this thread or an earlier attempt)
        self.message = ""

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self) -> None:
        try:
            self._finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = exc
        finally:
            self.gated.set()

    def _finish(self) -> None:
        result, settings, pipeline, batch_id, epoch = self.args_
        after = self.after
        self.warming.join()
        if after is not None:
            after.gated.wait()
        if not self._may_go_on():  # the run stops before this batch: it stays open, unvalidated
            return
        started = time.monotonic()
        with recording_failures(settings, pipeline.name, batch_id, epoch, "validate"):
            try:
                validated = _timed(
                    result,
                    "validate",
                    validate_batch,
                    settings,
                    pipeline,
                    batch_id,
                    epoch,
                    previous_pending=after is not None and after.is_alive(),
                )
            except ProbeAwaitsPrevious:
                if not self._after_promoted():
                    return
                started = time.monotonic()
                validated = _timed(result, "validate", validate_batch, settings, pipeline, batch_id, epoch)
        log.info("%s", validation_summary(pipeline.name, validated, time.monotonic() - started))
        self.gated.set()
        if not self._after_promoted():
            return
        started = time.monotonic()
        with recording_failures(settings, pipeline.name, batch_id, epoch, "promote"):
            promoted = _timed(result, "promote", promote_batch, settings, pipeline, batch_id, epoch)
        log.info("%s", promotion_summary(pipeline.name, promoted, time.monotonic() - started))
        self.message = promoted.message
        if not promoted.already_promoted:  # an earlier attempt landed those rows
            with _RESULT_LOCK:
                result.rows_promoted += promoted.promoted
                result.rows_quarantined += promoted.quarantined
        self.finished = True

    def _after_promoted(self) -> bool:
        """Wait for the batch before this one to be finished: whether this one may go on."""
        if self.after is not None:
            self.after.join()
        return self._may_go_on()

    def _may_go_on(self) -> bool:
        """Not when the batch before failed (this one is abandoned), the run was cancelled or
        SIGTERM stops it (this one stays open for the next run)."""
        failed_before = self.after is not None and self.after.error is not None
        return not (failed_before or self.cancelled.is_set() or _stopped(self.stop))


def _abandon_lookahead(settings: Settings, pipeline: Pipeline, lookahead: Batch, after_batch_id: int) -> None:
    """The batch before this run's lookahead was not promoted: abandon the lookahead, if this run
    still holds it (a run fenced off meanwhile leaves it, and anything newer, to the new owner)."""
    with transaction(settings.database_url) as conn:
        lock_plan(conn, pipeline.name)
        try:
            batch = load_claimed(conn, pipeline, lookahead.batch_id, lookahead.epoch)
        except LedgerConflictError:
            return
        if not is_open(batch.state):
            return
        abandon_unpromoted(conn, pipeline, batch, f"batch {after_batch_id} before it was not promoted")
    log.warning("pipeline=%s lookahead batch %s abandoned", pipeline.name, lookahead.batch_id)


_RESULT_LOCK = threading.Lock()  # two finishing threads add to one RunResult


def _timed(result: RunResult, phase: str, step, *args, **kwargs):
    started = time.monotonic()
    try:
        return step(*args, **kwargs)
    finally:
        with _RESULT_LOCK:
            result.phases[phase] += time.monotonic() - started


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


def _interrupted(pipeline: Pipeline, result: RunResult) -> StageInterrupted:
    return StageInterrupted(
        f"pipeline {pipeline.name!r}: stopped by SIGTERM after promoting batches {result.promoted}; "
        "a batch planned, staged or validated after them stays open and the next run (or a retry) resumes it.",
        pipeline=pipeline.name,
        promoted=list(result.promoted),
    )


def run_job(
    pipeline_name: str,
    batch_id: int,
    epoch: int | None = None,
    *,
    batches: int = 1,
    run_id: str | None = None,
    max_records_per_batch: int | None = None,
) -> RunResult:
    """What the Spark job (`kafka2pg.stage_job`) runs; spark-submit supplies master and jars."""
    settings = Settings.from_env()
    pipeline = get_pipeline(pipeline_name, settings.pipelines_file)
    # A job of several batches validates: GX's import (seconds of CPU) runs while the driver waits
    # on the JVM. Joined before the job leaves on any path: a daemon thread stopped inside an
    # import at exit can leave the interpreter holding a lock (see the cancelling threads below).
    warming = warm_up_in_background() if batches > 1 else None
    try:
        return _run_in_session(settings, pipeline, batch_id, epoch, batches, run_id, max_records_per_batch)
    finally:
        if warming is not None:
            warming.join(timeout=30)


def _run_in_session(
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    epoch: int | None,
    batches: int,
    run_id: str | None,
    max_records_per_batch: int | None,
) -> RunResult:
    with job_scratch(settings.state_dir / "spark") as scratch:
        # A session that cannot start (a master that gives up, a spark_conf Spark refuses) fails
        # the batch's stage like any other failure: recorded, STUCK when it happens run after run.
        with recording_failures(settings, pipeline.name, batch_id, epoch, "stage", run_id=run_id, batches=batches):
            spark = spark_session(
                None,
                app_name=f"kafka2pg-stage-{pipeline.name}-{batch_id}",
                conf=pipeline.spark_conf,
                batches=batches,
                kafka_reader=pipeline.kafka_reader,
                scratch=scratch,
            )
        # Where the JVM started without kafka2pg's log4j2 file (cluster deploy mode, spark_conf
        # naming a log4j2 file of its own) the level still applies from here on.
        spark.sparkContext.setLogLevel(pipeline.spark_log_level)
        # kafka2pg's filters are for Spark's Kafka source (the librdkafka reader does not load it).
        source, own = pipeline.kafka_reader == "spark", names_own_log_config(pipeline.spark_conf)
        log.info(
            "pipeline=%s Kafka reads use consumer group %s: assign only, nothing committed%s",
            pipeline.name,
            kafka_group_id(pipeline.name),
            " (Spark's per-read warning about kafka.group.id is filtered)" if source and not own else "",
        )
        if source and own:
            log.warning("pipeline=%s %s", pipeline.name, UNFILTERED_LOG)
        archive = package_zip(scratch)
        stop = threading.Event()
        cancelling: list[threading.Thread] = []
        previous = signal.signal(signal.SIGTERM, _on_sigterm(spark, stop, pipeline.name, batch_id, cancelling))
        try:
            spark.sparkContext.addPyFile(str(archive))
            return run_batches(
                spark,
                settings,
                pipeline,
                batch_id,
                epoch,
                batches=batches,
                run_id=run_id,
                max_records_per_batch=max_records_per_batch,
                stop=stop,
            )
        finally:
            signal.signal(signal.SIGTERM, previous)
            # A daemon thread still inside py4j (which logs when the JVM is gone) as the interpreter
            # exits is ended holding the logging lock; py4j's finalizers then log and the driver
            # hangs for good (seen in the fault suite: SIGTERM to the process group). Let it finish.
            for thread in cancelling:
                thread.join(timeout=30)
            stop_session(spark)


def _on_sigterm(
    spark: SparkSession, stop: threading.Event, pipeline_name: str, batch_id: int, threads: list[threading.Thread]
):
    """SIGTERM (Airflow killing the task, a node draining): cancel Spark's jobs, then stop.

    The handler only flags and starts a thread: the main thread is inside a py4j call, whose
    connection the handler must not reuse. The cancelled job makes `collect()` fail, and
    stage_batch turns the flag into `StageInterrupted` before the batch could become staged.
    Chunks already committed stay; the next attempt replaces them. Between batches the loop
    stops at the flag; a quality gate or promotion under way finishes its transaction first.
    The cancelling threads are appended to `threads`, for the job to join before it exits.
    """

    def cancel() -> None:
        with contextlib.suppress(Py4JError):  # the JVM may already be going down with us
            spark.sparkContext.cancelAllJobs()

    def handler(signum: int, frame: object) -> None:
        log.warning("pipeline=%s batch_id=%s SIGTERM: cancelling Spark jobs", pipeline_name, batch_id)
        stop.set()
        thread = threading.Thread(target=cancel, name="kafka2pg-cancel", daemon=True)
        threads.append(thread)
        thread.start()

    return handler
