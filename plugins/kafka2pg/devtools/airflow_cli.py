"""The Airflow CLI run as a child process with its output in a log file: `airflow db migrate` once
per AIRFLOW_HOME and `airflow dags test`, for the demo, the end-to-end tests and the benchmarks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from kafka2pg.exceptions import Kafka2PgError, StackError


def airflow_command() -> list[str]:
    airflow = shutil.which("airflow")
    if airflow is None:
        raise Kafka2PgError("the `airflow` command is not on PATH: run through ./kafka2pg, which sets up the venv")
    return [airflow]


def run_logged(command: list[str], log_file: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """Run a command with its output in `log_file`; return exit code, output and seconds."""
    started = time.monotonic()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    return code, log_file.read_text(errors="replace"), time.monotonic() - started


def ensure_airflow_db(env: dict[str, str]) -> None:
    """`airflow db migrate` once per AIRFLOW_HOME (marker file), so later runs start fast."""
    import airflow

    home = Path(env["AIRFLOW_HOME"])
    marker = home / f".kafka2pg-db-migrated-{airflow.__version__}"
    if marker.exists():
        return
    home.mkdir(parents=True, exist_ok=True)
    code, output, _ = run_logged([*airflow_command(), "db", "migrate"], home / "db-migrate.log", env)
    if code != 0:
        raise StackError(f"`airflow db migrate` failed (log {home / 'db-migrate.log'}):\n{output[-3000:]}")
    marker.touch()


def dags_test(dag_id: str, env: dict[str, str], log_file: Path, conf: dict | None = None) -> tuple[int, str, float]:
    """`airflow dags test` of one DAG; `conf` is the run's conf (Param values, as the trigger form sends)."""
    extra = ["--conf", json.dumps(conf)] if conf else []
    return run_logged([*airflow_command(), "dags", "test", dag_id, *extra], log_file, env)
