"""One Airflow DAG per pipeline declared in the pipelines.yaml beside this file, or in KAFKA2PG_PIPELINES
(built by kafka2pg.dag_factory).

With kafka2pg pip-installed, this file and a pipelines.yaml are all a DAGs folder needs.
"""

from pathlib import Path

from kafka2pg.dag_factory import build_dags

globals().update(build_dags(Path(__file__).resolve().parent))
