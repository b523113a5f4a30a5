"""What the `airflow dags test` tests share: one Airflow home (metadata DB migrated once) and the
environment of a run against a test's own pipeline."""

import os
from pathlib import Path

import pytest

from kafka2pg.devtools.airflow_cli import ensure_airflow_db

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("airflow")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_CONN_KAFKA2PG_SPARK": '{"conn_type": "spark", "host": "local[2]"}',
    }
    ensure_airflow_db(env)
    return env


@pytest.fixture
def airflow_env(airflow_home):
    """`airflow_env(pipeline_env)`: the environment of a DAG run of that test pipeline."""

    def environment(env) -> dict[str, str]:
        return {
            **airflow_home,
            "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
            "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
            "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        }

    return environment
