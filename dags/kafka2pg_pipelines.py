"""One Airflow DAG per pipeline declared in dags/pipelines.yaml (built by kafka2pg.dag_factory)."""

from kafka2pg.dag_factory import build_dags

globals().update(build_dags())
