"""Builds one Airflow DAG per pipeline of the pipelines file: plan -> stage -> validate -> promote.

Runs at DAG-parse time, so it reads only the YAML file: no database, Kafka, Spark or GX here.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from kafka2pg.config import PROJECT_ROOT, Pipeline, load_pipelines

SPARK_CONN_ID = "kafka2pg_spark"
JOB = PROJECT_ROOT / "jobs" / "stage_batch.py"


def spark_jars() -> str:
    """Comma-separated jar paths/globs for the Kafka source (KAFKA2PG_SPARK_JARS overrides)."""
    default = Path(os.environ.get("KAFKA2PG_STATE_DIR", PROJECT_ROOT / ".cache")) / "jars" / "spark" / "*.jar"
    return os.environ.get("KAFKA2PG_SPARK_JARS", str(default))


def build_dag(pipeline: Pipeline):
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.sdk import DAG, Param, task

    name = pipeline.name
    with DAG(
        dag_id=pipeline.dag_id,
        description=f"Kafka topic {pipeline.topic} -> {pipeline.target_schema}.{pipeline.target_table}, exactly once",
        schedule=pipeline.schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        tags=["kafka2pg"],
        default_args={"retries": 2, "retry_delay": timedelta(seconds=20)},
        params={
            "max_records_per_batch": Param(
                None,
                type=["null", "integer"],
                minimum=1,
                description="Cap of records in this run's batch "
                f"(default from config: {pipeline.max_records_per_batch}).",
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
        def plan_batch(params: dict | None = None, run_id: str | None = None) -> dict | None:
            from kafka2pg import tasks

            params = params or {}
            return tasks.plan(
                name,
                max_records_per_batch=params.get("max_records_per_batch"),
                dry_run=bool(params.get("dry_run")),
                run_id=run_id,
            )

        @task.short_circuit(task_id="has_batch")
        def has_batch(planned: dict | None) -> bool:
            return bool(planned)

        stage = SparkSubmitOperator(
            task_id="read_and_stage",
            application=str(JOB),
            conn_id=SPARK_CONN_ID,
            name=f"kafka2pg-{name}",
            jars=spark_jars(),
            # kafka2pg's Spark defaults are applied by the job's session (staging.SPARK_DEFAULTS).
            conf=dict(pipeline.spark_conf),
            application_args=[
                "--pipeline",
                name,
                "--batch-id",
                "{{ ti.xcom_pull(task_ids='plan')['batch_id'] }}",
                "--epoch",
                "{{ ti.xcom_pull(task_ids='plan')['epoch'] }}",
            ],
            verbose=False,
        )

        @task(task_id="validate")
        def validate_batch(planned: dict) -> dict:
            from kafka2pg import tasks

            return tasks.validate(name, planned["batch_id"], planned["epoch"])

        @task(task_id="promote")
        def promote_batch(planned: dict) -> dict:
            from kafka2pg import tasks

            return tasks.promote(name, planned["batch_id"], planned["epoch"])

        planned = plan_batch()
        validated = validate_batch(planned)
        has_batch(planned) >> stage >> validated >> promote_batch(planned)
    return dag


def build_dags() -> dict:
    return {p.dag_id: build_dag(p) for p in load_pipelines().values()}
