"""Builds two Airflow DAGs per pipeline: the live one (plan -> stage -> validate -> promote) and the
replay one (plan_replay -> stage -> validate -> finish), which also serves backfills. The live DAG
refuses backfills (`allowed_run_types`): each of its runs loads the next batch whatever its date.

Runs at DAG-parse time, so it reads only the YAML file: no database, Kafka, Spark or GX here.
"""

from __future__ import annotations

import functools
import logging
import re
from datetime import datetime, timedelta
from pathlib import Path

from kafka2pg import stage_job
from kafka2pg.config import Pipeline, pipelines_file_from_env, read_pipelines
from kafka2pg.exceptions import ConfigError

log = logging.getLogger(__name__)

SPARK_CONN_ID = "kafka2pg_spark"
# What a `plan` task returns when there is no batch. Not None: Airflow stores no XCom for None, and
# `has_batch` pulling the missing XCom logs "[error] XCom not found" on every no-op run.
NO_BATCH: dict = {}
# What spark-submit runs: the job module's file inside the package, wherever it is installed.
JOB = Path(stage_job.__file__).resolve()
# The live DAG's runs: every kind Airflow has but "backfill". Airflow caps a backfill's runs by the
# backfill's own max_active_runs (10 by default), not the DAG's max_active_runs=1: each would
# claim the open batch and fence the others' Spark jobs, and every run loads the next batch
# whatever its date anyway. The scheduler, the API, the UI and `airflow backfill create` refuse a
# backfill of a DAG whose allowed_run_types leave it out. Past dates go to the replay DAG.
LIVE_RUN_TYPES = ("scheduled", "manual", "asset_triggered", "operator_triggered", "asset_materialization")
# The replay DAG's Spark jobs at once, whatever starts its runs: its own max_active_runs, and
# max_active_tis_per_dag on its read_and_stage task for a backfill's runs, which Airflow counts
# apart from the DAG's (a backfill may have 10 active runs by default).
REPLAY_SPARK_JOBS = 4


def build_dag(pipeline: Pipeline, pipelines_file: Path):
    from airflow.sdk import DAG, Param, task

    name = pipeline.name
    with DAG(
        dag_id=pipeline.dag_id,
        auto_register=False,  # handed over by build_dags alone: a half-built pair is never collected
        description=f"Kafka topic {pipeline.topic} -> {pipeline.target_schema}.{pipeline.target_table}, exactly once",
        schedule=pipeline.schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        allowed_run_types=LIVE_RUN_TYPES,
        tags=["kafka2pg"],
        default_args=_default_args(pipeline),
        params={
            "max_records_per_batch": Param(
                None,
                type=["null", "integer"],
                minimum=1,
                description="Cap of records in this run's batch "
                f"(default from config: {pipeline.max_records_per_batch}).",
            ),
            "batches_per_run": Param(
                None,
                type=["null", "integer"],
                minimum=1,
                description="Batches this run may load in one Spark job to catch up a backlog; the job "
                f"validates and promotes each one (default from config: {pipeline.batches_per_run}).",
            ),
            "dry_run": Param(
                False,
                type="boolean",
                description="Plan and log the ranges only: nothing is recorded, Spark is not launched.",
            ),
        },
        doc_md=__doc__,
    ) as dag:

        @task(task_id="plan")
        def plan_batch(params: dict | None = None, run_id: str | None = None, dag_run=None, dag=None) -> dict:
            from kafka2pg import tasks

            tasks.check_run_conf(dag.dag_id, getattr(dag_run, "conf", None), dag.params.keys(), params)
            params = params or {}
            planned = tasks.plan(
                name,
                max_records_per_batch=params.get("max_records_per_batch"),
                batches_per_run=params.get("batches_per_run"),
                dry_run=bool(params.get("dry_run")),
                run_id=run_id,
                pipelines_file=pipelines_file,
            )
            return planned or NO_BATCH

        stage = _stage_operator(pipeline, pipelines_file, several_batches=True)

        alias = _asset_alias(pipeline)

        @task(task_id="promote", outlets=[alias], **_report_hooks(name))
        def promote_batch(planned: dict, run_id: str | None = None, outlet_events=None) -> dict:
            from kafka2pg import tasks

            promoted = tasks.promote(
                name, planned["batch_id"], planned["epoch"], run_id=run_id, pipelines_file=pipelines_file
            )
            _emit(outlet_events, alias, promoted["asset_event"])
            return promoted

        planned = plan_batch()
        validated = _linked_to_report(_validate_task(name, pipelines_file)(planned), name)
        promoted = _linked_to_report(promote_batch(planned), name)
        _has_batch_task()(planned) >> stage >> validated >> promoted
    return dag


def _default_args(pipeline: Pipeline) -> dict:
    """Every task's: two retries 20 s apart; with `task_timeout_minutes`, Airflow's
    execution_timeout (a task past it fails and is retried; the stage task's `on_kill` stops its
    Spark job, whose batch the next attempt resumes)."""
    args: dict = {"retries": 2, "retry_delay": timedelta(seconds=20)}
    if pipeline.task_timeout_minutes is not None:
        args["execution_timeout"] = timedelta(minutes=pipeline.task_timeout_minutes)
    return args


def _report_hooks(pipeline_name: str) -> dict:
    """A validate or promote (finish) task's hooks that end its log with the report page of the
    run's batch (`kafka2pg.report_link`): after its own lines when it succeeds (before Airflow's
    post-execute group), after the error when it fails."""
    from kafka2pg.report_link import log_report_page

    hook = functools.partial(log_report_page, pipeline_name)
    return {"post_execute": hook, "on_failure_callback": hook, "on_retry_callback": hook}


def _linked_to_report(task_output, pipeline_name: str):
    """The task (an `@task`'s output) with a "Quality report" link to the report page of the run's
    batch (`kafka2pg.report_link`), on the task's page in the UI and in the REST API."""
    from kafka2pg.report_link import QualityReportLink

    task_output.operator.operator_extra_links = (QualityReportLink(pipeline_name),)
    return task_output


def _asset_alias(pipeline: Pipeline):
    """The alias the promote (finish) task emits the target table's Asset through: the table's URI
    names the PostgreSQL server, known only from the connection at run time, never at parse time."""
    from airflow.sdk import AssetAlias

    return AssetAlias(pipeline.asset_alias)


def _emit(outlet_events, alias, event: dict | None) -> None:
    """The target table's Asset event (kafka2pg.asset_events), if the run promoted anything; Airflow
    records it, and triggers the DAGs scheduled on the table's Asset or on the alias, when the task
    succeeds."""
    from airflow.sdk import Asset

    if event is not None:
        outlet_events[alias].add(Asset(uri=event["uri"]), extra=event["extra"])


def _run_type(dag_run) -> str | None:
    """'manual', 'backfill', 'scheduled', ... (the enum's value, whatever form the context gives it)."""
    run_type = getattr(dag_run, "run_type", None)
    if run_type is None:
        return None
    return str(getattr(run_type, "value", run_type)).lower().removeprefix("dagruntype.")


def _has_batch_task():
    """Short-circuit: no batch planned (nothing new, or nothing to replay) skips Spark and the rest."""
    from airflow.sdk import task

    @task.short_circuit(task_id="has_batch")
    def has_batch(planned: dict) -> bool:
        return bool(planned)

    return has_batch


def _validate_task(name: str, pipelines_file: Path):
    """The quality gate on the batch the `plan` task handed over (live and replay DAGs alike)."""
    from airflow.sdk import task

    @task(task_id="validate", **_report_hooks(name))
    def validate_batch(planned: dict) -> dict:
        from kafka2pg import tasks

        return tasks.validate(name, planned["batch_id"], planned["epoch"], pipelines_file=pipelines_file)

    return validate_batch


def _stage_operator(
    pipeline: Pipeline,
    pipelines_file: Path,
    *,
    several_batches: bool = False,
    max_active_tis_per_dag: int | None = None,
):
    """The Spark job reading the batch the `plan` task handed over (live and replay DAGs alike).

    `several_batches` (live DAG): the job may go on with further batches (Param batches_per_run).
    `max_active_tis_per_dag` (replay DAG): the task's instances running at once over all the DAG's
    runs, backfill runs included.
    """
    from kafka2pg.stage_operator import StageOperator

    planned = "ti.xcom_pull(task_ids='plan')"
    more = []
    if several_batches:
        more = [
            "--batches",
            f"{{{{ {planned}['batches'] }}}}",
            "--max-records-per-batch",
            f"{{{{ {planned}['max_records_per_batch'] }}}}",
            "--run-id",
            "{{ run_id }}",
        ]

    # spark-submit's JVM options and Spark's Kafka source (jars, or spark.jars.packages) are
    # decided by the task on the worker, from what set-up made there (StageOperator.execute).
    return StageOperator(
        pipeline_name=pipeline.name,
        pipelines_file=str(pipelines_file),
        task_id="read_and_stage",
        application=str(JOB),
        conn_id=SPARK_CONN_ID,
        name=f"kafka2pg-{pipeline.name}",
        application_args=[
            "--pipeline",
            pipeline.name,
            "--batch-id",
            f"{{{{ {planned}['batch_id'] }}}}",
            "--epoch",
            f"{{{{ {planned}['epoch'] }}}}",
            *more,
        ],
        verbose=False,
        max_active_tis_per_dag=max_active_tis_per_dag,
    )


REPLAY_DOC = f"""Replay a range this pipeline already loaded: re-read it from Kafka with the current
pipeline config, run the same quality gate, then in ONE transaction replace the range's target
and quarantine rows (`replace`), or only report the differences (`verify-only`). The live
ledger head never moves. Give **offset_ranges** or **from_time/to_time**; a backfill over dates
replays each run's data interval. At most {REPLAY_SPARK_JOBS} runs stage (run a Spark job) at
once, a backfill's included whatever its own max_active_runs; the others wait in `read_and_stage`.
Recorded in `kafka2pg.replays`.
"""


def build_replay_dag(pipeline: Pipeline, pipelines_file: Path):
    """plan_replay -> read_and_stage -> validate -> finish (replace or verify-only)."""
    from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task

    name = pipeline.name
    with DAG(
        dag_id=pipeline.replay_dag_id,
        auto_register=False,  # handed over by build_dags alone: a half-built pair is never collected
        description=f"Replay / backfill of {pipeline.topic} -> {pipeline.target_schema}.{pipeline.target_table}",
        # Data intervals for backfills; the DAG starts paused so nothing replays on a timer.
        schedule=CronDataIntervalTimetable(pipeline.replay_interval, timezone="UTC"),
        start_date=datetime(2026, 1, 1),
        catchup=False,
        is_paused_upon_creation=True,
        max_active_runs=REPLAY_SPARK_JOBS,
        tags=["kafka2pg", "replay"],
        default_args=_default_args(pipeline),
        params={
            "mode": Param(
                "replace",
                type="string",
                enum=["replace", "verify-only"],
                description="replace: swap the range's rows for the re-read ones in one transaction. "
                "verify-only: report the differences, change nothing.",
            ),
            "offset_ranges": Param(
                None,
                type=["null", "array"],
                items={
                    "type": "object",
                    "properties": {
                        "partition": {"type": "integer", "minimum": 0},
                        "start": {"type": "integer", "minimum": 0},
                        "end": {"type": "integer", "minimum": 1},
                    },
                    "required": ["partition", "start", "end"],
                    "additionalProperties": False,
                },
                description='Offsets to replay per partition, end exclusive, e.g. [{"partition": 0, '
                '"start": 0, "end": 500}]. Must lie within what the live pipeline already loaded.',
            ),
            "from_time": Param(
                None,
                type=["null", "string"],
                format="date-time",
                description="Time window start (inclusive, record timestamps), instead of offset_ranges.",
            ),
            "to_time": Param(
                None,
                type=["null", "string"],
                format="date-time",
                description="Time window end (exclusive). Mapped to offsets with offsets_for_times.",
            ),
            "reason": Param(
                None,
                type=["null", "string"],
                description="Why (optional): recorded with the replay in kafka2pg.replays.",
            ),
        },
        doc_md=REPLAY_DOC,
    ) as dag:

        @task(task_id="plan")
        def plan_replay(params: dict | None = None, run_id: str | None = None, dag_run=None, **context) -> dict:
            from kafka2pg import tasks

            dag = context["dag"]
            tasks.check_run_conf(dag.dag_id, getattr(dag_run, "conf", None), dag.params.keys(), params)
            user = getattr(dag_run, "triggering_user_name", None) or ""
            planned = tasks.plan_replay(
                name,
                dict(params or {}),
                run_id=run_id,
                run_type=_run_type(dag_run),
                interval=(context.get("data_interval_start"), context.get("data_interval_end")),
                requested_by=user or f"airflow run {run_id}",
                pipelines_file=pipelines_file,
            )
            return planned or NO_BATCH

        alias = _asset_alias(pipeline)

        @task(task_id="finish", outlets=[alias], **_report_hooks(name))
        def finish(planned: dict, outlet_events=None) -> dict:
            from kafka2pg import tasks

            finished = tasks.finish_replay(name, planned["batch_id"], planned["epoch"], pipelines_file=pipelines_file)
            _emit(outlet_events, alias, finished["asset_event"])
            return finished

        planned = plan_replay()
        validated = _linked_to_report(_validate_task(name, pipelines_file)(planned), name)
        stage = _stage_operator(pipeline, pipelines_file, max_active_tis_per_dag=REPLAY_SPARK_JOBS)
        _has_batch_task()(planned) >> stage >> validated >> _linked_to_report(finish(planned), name)
    return dag


def build_dags(dag_folder: Path | None = None) -> dict:
    """The live and replay DAG of every pipeline in the pipelines file: KAFKA2PG_PIPELINES, else the
    `pipelines.yaml` in `dag_folder` (the DAG file passes its own folder), else the default
    (`config.default_pipelines_file`). Every task reads the pipeline from that same file."""
    pipelines_file = pipelines_file_from_env(dag_folder / "pipelines.yaml" if dag_folder else None)
    pipelines, broken = read_pipelines(pipelines_file)
    dags = {}
    for pipeline in pipelines.values():
        try:
            live, replay = build_dag(pipeline, pipelines_file), build_replay_dag(pipeline, pipelines_file)
        except Exception as exc:  # noqa: BLE001 - a DAG Airflow refuses to build: this pipeline's error alone
            broken[pipeline.name] = ConfigError(
                f"{pipelines_file}: pipeline {pipeline.name!r}: Airflow refused its DAG ({type(exc).__name__}: {exc})"
            )
            continue
        dags[pipeline.dag_id], dags[pipeline.replay_dag_id] = live, replay
    # A pipeline in error keeps its DAGs, which say why and run nothing; the others are unaffected.
    stand_ins: dict[str, list[str]] = {}
    for name, error in broken.items():
        log.error("kafka2pg pipeline %s is not loaded: %s", name, error)
        named = not name.startswith("pipelines[")
        for dag_id in (f"kafka2pg_{name}", f"kafka2pg_{name}_replay") if named else (INVALID_PIPELINES_DAG,):
            if dag_id not in dags:  # never in place of a valid pipeline's
                stand_ins.setdefault(dag_id, []).append(str(error))
    for dag_id, errors in stand_ins.items():
        dags[dag_id] = build_broken_dag(dag_id, errors)
    return dags


# The DAG that reports the pipelines whose entry has no usable name.
INVALID_PIPELINES_DAG = "kafka2pg-invalid-pipelines"  # a hyphen: no pipeline's DAG id has one


def _fenced(text: str) -> str:
    """`text` as a Markdown code block its own backticks cannot close (a key quoted in an error)."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def build_broken_dag(dag_id: str, errors: list[str]):
    """A DAG standing in for a pipeline whose configuration is in error: its description and doc
    say why, it is not scheduled, and a run fails at once with the errors (no retry)."""
    from airflow.sdk import DAG, task

    with (
        DAG(
            dag_id=dag_id,
            auto_register=False,  # handed over by build_dags alone: a half-built pair is never collected
            description="CONFIGURATION ERROR: " + errors[0].splitlines()[0][:200],
            doc_md="**The pipelines file has an error here: this DAG runs nothing until it is fixed.**\n\n"
            + "\n\n".join(_fenced(e) for e in errors),
            schedule=None,
            start_date=datetime(2026, 1, 1),
            catchup=False,
            tags=["kafka2pg", "configuration-error"],
        ) as dag
    ):

        @task(task_id="configuration_error", retries=0)
        def configuration_error() -> None:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException("\n".join(errors))

        configuration_error()
    return dag
