"""The read_and_stage task: spark-submit of the stage job, with the pipeline's services resolved
from its Airflow Connections at run time and handed to the job in its environment.

Imported by the DAG factory when it builds a DAG (the spark provider is an Airflow import anyway).
"""

from __future__ import annotations

from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator


class StageOperator(SparkSubmitOperator):
    """SparkSubmitOperator whose job reads the pipeline's services from its environment.

    The connections are looked up in `execute` (in the task, with Airflow's own lookup), not at
    DAG-parse time, and never go into a templated field: Airflow would keep rendered fields in
    its database and show them in the UI. spark-submit's environment is not logged; the job
    (kafka2pg.runner) builds its Settings from it (`Settings.from_env`).
    """

    def __init__(self, *, pipeline_name: str, pipelines_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_name = pipeline_name
        self.pipelines_file = pipelines_file

    def execute(self, context: Any) -> None:
        from kafka2pg.tasks import airflow_errors, resolve

        with airflow_errors():
            settings, _ = resolve(self.pipeline_name, self.pipelines_file)
        self.env_vars = {**(self.env_vars or {}), **settings.to_env()}
        return super().execute(context)
