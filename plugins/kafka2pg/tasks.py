"""The callables behind each Airflow task: plan, validate, promote (staging is a Spark job).

They are imported lazily inside the tasks; kafka2pg errors are translated here into Airflow's
terms: a broken invariant fails without retry, an unreachable service stays retryable.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import unquote

from kafka2pg.config import (
    Pipeline,
    Settings,
    get_pipeline,
    pipelines_file_from_env,
    spark_conf_secrets,
)
from kafka2pg.exceptions import Kafka2PgError, RunConfNotAppliedError, UnknownRunConfError
from kafka2pg.replay_request import whole_number
from kafka2pg.task_log import fit, promotion_summary, step_summary, validation_summary

log = logging.getLogger("kafka2pg")


@contextmanager
def airflow_errors() -> Iterator[None]:
    """Terminal kafka2pg errors -> AirflowFailException (no retry); others propagate."""
    try:
        yield
    except Kafka2PgError as exc:
        if not exc.terminal:
            raise
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def resolve(pipeline_name: str, pipelines_file: Path | str | None = None) -> tuple[Settings, Pipeline]:
    """The pipeline, from `pipelines_file` (the one its DAG was built from; by default
    `pipelines_file_from_env()`), and its services (its Airflow Connections). The settings name
    that file, so the Spark job (`Settings.to_env`) reads the same one."""
    from kafka2pg.connections import settings_for

    path = Path(pipelines_file) if pipelines_file else pipelines_file_from_env()
    pipeline = get_pipeline(pipeline_name, path)
    settings = dataclasses.replace(settings_for(pipeline), pipelines_file=path)
    mask_secrets(settings, spark_conf_secrets(pipeline.spark_conf))
    return settings, pipeline


def mask_secrets(settings: Settings, others: Iterable[str] = ()) -> None:
    """Airflow's log masker learns the services' secrets (and `others`: the pipeline's spark_conf
    ones), so that a task log line quoting one (Spark's, a client library's, spark-submit's
    output) shows *** instead. Airflow registers a connection's password and its extras under
    names it deems sensitive itself; not a password (or the client key's `sslpassword`, libpq's
    SCRAM keys) in KAFKA2PG_DATABASE_URL, a `sasl.jaas.config`, an inline PEM key or the lines of the key file
    `ssl.key.location` names."""
    import psycopg
    from airflow.sdk.log import mask_secret
    from psycopg.conninfo import conninfo_to_dict

    from kafka2pg.database import typed_password

    for secret in (*settings.kafka.secrets(), *others):
        mask_secret(secret)
    typed = typed_password(settings.database_url)  # as written in a URL, and decoded
    passwords = [typed, unquote(typed)]
    with suppress(psycopg.Error):  # a malformed URL fails the task where it is used, saying so
        params = conninfo_to_dict(settings.database_url)
        # The client key's password too, and libpq 18's SCRAM keys (each stands in for the password).
        passwords += [params.get(k) for k in ("password", "sslpassword", "scram_client_key", "scram_server_key")]
    for password in passwords:
        if password:
            mask_secret(str(password))


def check_run_conf(dag_id: str, conf: Mapping | None, known: Iterable[str], params: Mapping | None) -> None:
    """A plan task's first act, fails without retry instead of running with a Param's default:

    - a run whose conf names a key the DAG has no Param for (`known`): `UnknownRunConfError`;
    - a run whose conf sets a Param to a value the task's `params` (what Airflow resolved for it)
      do not hold: Airflow applies a run's conf to the Params only while `[core]
      dag_run_conf_overrides_params` is True, and otherwise leaves them at the DAG's defaults
      (`RunConfNotAppliedError`): a replay with `{"mode": "verify-only"}` would replace rows,
      a `{"dry_run": true}` run would load.
    """
    known = tuple(known)
    conf = conf or {}
    unknown = set(conf) - set(known)
    if unknown:
        with airflow_errors():
            raise UnknownRunConfError.keys(dag_id, unknown, known)
    params = params or {}
    missing = object()
    differing = {key: (value, params.get(key)) for key, value in conf.items() if params.get(key, missing) != value}
    if differing:
        with airflow_errors():
            raise RunConfNotAppliedError.ignored(dag_id, differing)


def plan(
    pipeline_name: str,
    *,
    max_records_per_batch: int | None = None,
    batches_per_run: int | None = None,
    dry_run: bool = False,
    run_id: str | None = None,
    pipelines_file: Path | None = None,
) -> dict | None:
    """Plan (or resume) the next batch; None when there is nothing to do (no Spark launched).

    The result tells the stage job how many batches it may finish in this run and their cap.
    Runs no DDL: a database not migrated (or not granted) for the pipeline fails it once.
    """
    from kafka2pg.migrations import require_ready
    from kafka2pg.opening import open_batch

    started = time.monotonic()
    max_records_per_batch, batches_per_run = whole_number(max_records_per_batch), whole_number(batches_per_run)
    with airflow_errors():
        settings, pipeline = resolve(pipeline_name, pipelines_file)
        require_ready(settings, pipeline)
        opened = open_batch(
            settings, pipeline, max_records_per_batch=max_records_per_batch, run_id=run_id, dry_run=dry_run
        )
    log.info("pipeline=%s %s", pipeline_name, opened.message)
    if opened.batch is None or dry_run:
        return None
    batch = opened.batch
    log.info(
        "%s",
        step_summary(
            "plan",
            pipeline_name,
            batch.batch_id,
            time.monotonic() - started,
            ranges=batch.plan.ranges,
            records=batch.plan.record_budget,
            resumed=opened.resumed or None,
        ),
    )
    return {
        "batch_id": batch.batch_id,
        "epoch": batch.epoch,
        "resumed": opened.resumed,
        "records": batch.plan.record_budget,
        "batches": batches_per_run or pipeline.batches_per_run,
        "max_records_per_batch": max_records_per_batch or pipeline.max_records_per_batch,
    }


def validate(
    pipeline_name: str, batch_id: int, epoch: int | None = None, *, pipelines_file: Path | None = None
) -> dict:
    from kafka2pg.quality import validate_batch
    from kafka2pg.stuck import recording_failures

    started = time.monotonic()
    with airflow_errors():
        settings, pipeline = resolve(pipeline_name, pipelines_file)
        with recording_failures(settings, pipeline_name, batch_id, epoch, "validate"):
            result = validate_batch(settings, pipeline, batch_id, epoch)
    for check in result.checks:
        verdict = "ok" if check.success else "FAILED"
        log.info("%s", fit(f"batch_id={batch_id} check {check.name:<36} {verdict}  {check.details}"))
    log.info("%s", validation_summary(pipeline_name, result, time.monotonic() - started))
    return {"batch_id": batch_id, "state": result.state, "report": str(result.report) if result.report else None}


def promote(
    pipeline_name: str,
    batch_id: int,
    epoch: int | None = None,
    *,
    run_id: str | None = None,
    pipelines_file: Path | None = None,
) -> dict:
    """Promote the run's batch (or confirm it, when the Spark job promoted it). `asset_event`: the
    target table's event for the batches this run promoted (`run_id`: the DAG run's, which the
    job's further batches carry)."""
    from kafka2pg.asset_events import run_event_of
    from kafka2pg.report import batch_report
    from kafka2pg.steps import promote_batch
    from kafka2pg.stuck import recording_failures

    started = time.monotonic()
    with airflow_errors():
        settings, pipeline = resolve(pipeline_name, pipelines_file)
        with recording_failures(settings, pipeline_name, batch_id, epoch, "promote"):
            result = promote_batch(settings, pipeline, batch_id, epoch)
        seconds = time.monotonic() - started
        log.info("pipeline=%s %s", pipeline_name, result.message)
        event = run_event_of(settings, pipeline, batch_id, run_id)
        _keep_further_raw_bytes(settings, pipeline, event)
        try:  # the batch is promoted: a summary that needs Kafka must not fail the task
            log.info("\n%s", batch_report(settings, pipeline, batch_id))
        except Kafka2PgError as exc:
            log.warning("pipeline=%s batch %s promoted; its summary is not available: %s", pipeline_name, batch_id, exc)
    log.info("%s", promotion_summary(pipeline_name, result, seconds))
    return {
        "batch_id": batch_id,
        "promoted": result.promoted,
        "quarantined": result.quarantined,
        "asset_event": _logged(pipeline_name, event),
    }


def _keep_further_raw_bytes(settings: Settings, pipeline: Pipeline, event) -> None:
    """The raw bytes of the quarantined rows of the further batches the run's Spark job promoted
    itself: a job killed between such a promotion's commit and its reading them again from Kafka
    leaves no step of that batch to do it (a retried job resumes open batches only). Best effort;
    when nothing lacks them, one query per further batch of a run that quarantined any row."""
    from kafka2pg.raw_bytes import QUARANTINE, keep_raw_bytes

    if event is not None and event.extra["quarantined"]:
        for further in event.extra["batch_ids"][1:]:
            keep_raw_bytes(settings, pipeline, further, QUARANTINE)


def _logged(pipeline_name: str, event) -> dict | None:
    """The Asset event as the task hands it to Airflow (a plain dict), logged."""
    if event is None:
        return None
    log.info(
        "pipeline=%s asset event %s batches=%s rows=%s quarantined=%s",
        pipeline_name,
        event.uri,
        event.extra["batch_ids"],
        event.extra["rows"],
        event.extra["quarantined"],
    )
    return {"uri": event.uri, "extra": event.extra}


def plan_replay(
    pipeline_name: str,
    params: dict,
    *,
    run_id: str | None = None,
    run_type: str | None = None,
    interval: tuple = (None, None),
    requested_by: str = "",
    pipelines_file: Path | None = None,
) -> dict | None:
    """The replay DAG's first task: Params (or the backfill's data interval) -> a planned replay batch."""
    from kafka2pg.migrations import require_ready
    from kafka2pg.replay import open_replay
    from kafka2pg.replay_request import request_from_params

    started = time.monotonic()
    with airflow_errors():
        settings, pipeline = resolve(pipeline_name, pipelines_file)
        request = request_from_params(params, run_type=run_type, interval=interval, requested_by=requested_by)
        if request is None:
            log.info(
                "pipeline=%s scheduled run of the replay DAG: replays run from triggers and backfills only; "
                "nothing to do, Spark not launched",
                pipeline_name,
            )
            return None
        require_ready(settings, pipeline)
        opened = open_replay(settings, pipeline, request, run_id=run_id)
    log.info("pipeline=%s %s", pipeline_name, opened.message)
    if opened.batch is None:
        return None
    plan = opened.batch.plan
    summary = step_summary(
        "plan", pipeline_name, opened.batch.batch_id, time.monotonic() - started, ranges=plan.ranges, mode=request.mode
    )
    log.info("%s", summary)
    return {"batch_id": opened.batch.batch_id, "epoch": opened.batch.epoch, "mode": request.mode}


def finish_replay(
    pipeline_name: str, batch_id: int, epoch: int | None = None, *, pipelines_file: Path | None = None
) -> dict:
    """The replay DAG's last task: replace the range's rows, or report the differences (verify-only).
    `asset_event`: the replaced range's event (None for verify-only: the target did not change)."""
    from kafka2pg.asset_events import run_event_of
    from kafka2pg.replay import split_differences
    from kafka2pg.steps import promote_batch

    started = time.monotonic()
    with airflow_errors():
        settings, pipeline = resolve(pipeline_name, pipelines_file)
        result = promote_batch(settings, pipeline, batch_id, epoch)
        event = run_event_of(settings, pipeline, batch_id, None)
    seconds = time.monotonic() - started
    differences, gone = split_differences(result.differences)
    # A verify-only replay that found differences ends green (it changed nothing and the findings
    # are recorded) but says so at WARNING, which Airflow's log view marks.
    level = logging.WARNING if differences else logging.INFO
    log.log(level, "pipeline=%s %s", pipeline_name, result.message)
    for label, findings in (("difference", differences), ("record gone", gone)):
        for kind, found in sorted(findings.items()):
            log.log(level, "%s", fit(f"{label} {kind:<35} {found['count']:>6}  e.g. {', '.join(found['sample'])}"))
    log.info("%s", promotion_summary(pipeline_name, result, seconds))
    return {
        "batch_id": batch_id,
        "mode": result.mode,
        "promoted": result.promoted,
        "quarantined": result.quarantined,
        "rows_before": list(result.before),
        "differences": {kind: found["count"] for kind, found in differences.items()},
        "records_gone": {kind: found["count"] for kind, found in gone.items()},
        "asset_event": _logged(pipeline_name, event),
    }
