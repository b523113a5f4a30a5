"""A throwaway real Airflow (api-server + scheduler + dag-processor, LocalExecutor) for e2e tests.

The metadata DB is a fresh database in the test stack's PostgreSQL (SQLite refuses concurrent
backfill creation at random). No auth (SimpleAuthManager, all admins), 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import requests

from kafka2pg.devtools.processes import free_port

SIMPLE_AUTH = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"


@dataclass
class AirflowServer:
    port: int
    env: dict[str, str]
    logs: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/api/v2"

    def task_logs(self) -> str:
        """Every task log of this server (for a failure message), newest last."""
        files = sorted((Path(self.env["AIRFLOW_HOME"]) / "logs").rglob("*.log"), key=lambda p: p.stat().st_mtime)
        return "\n".join(f"--- {f}\n{f.read_text(errors='replace')[-4000:]}" for f in files[-6:])


def _metadata_db(database_url: str) -> str:
    """A new database next to the test stack's, as a SQLAlchemy URL with the psycopg 3 driver."""
    name = f"airflow_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    base = database_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{name}"


def _env(home: Path, port: int, db_url: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIRFLOW_CONFIG"}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": db_url,  # asyncpg is not installed; psycopg 3 is async too
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(64),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            **extra,
        }
    )
    return env


@contextlib.contextmanager
def running_airflow(
    work: Path, database_url: str, extra_env: dict[str, str], timeout_s: float = 240
) -> Iterator[AirflowServer]:
    """Migrate a fresh metadata DB, start the three components, wait until healthy; stop them by PID."""
    home, logs = work / "home", work / "logs"
    home.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    port = free_port()
    server = AirflowServer(port, _env(home, port, _metadata_db(database_url), extra_env), logs)
    with open(logs / "db-migrate.log", "w") as out:
        subprocess.run(["airflow", "db", "migrate"], env=server.env, check=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        for name, command in {
            "api-server": ["airflow", "api-server", "--host", "127.0.0.1", "--port", str(port)],
            "scheduler": ["airflow", "scheduler"],
            "dag-processor": ["airflow", "dag-processor"],
        }.items():
            with open(logs / f"{name}.log", "w") as out:
                server.procs[name] = subprocess.Popen(
                    command, env=server.env, cwd=work, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
                )
        _wait_healthy(server, timeout_s)
        yield server
    finally:
        _stop(server)


def _wait_healthy(server: AirflowServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in server.procs.items():
            if proc.poll() is not None:
                tail = (server.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(requests.RequestException, ValueError, KeyError, TypeError):
            health = requests.get(f"{server.api}/monitor/health", timeout=2).json()
            if all(health[part]["status"] == "healthy" for part in ("metadatabase", "scheduler", "dag_processor")):
                return
        time.sleep(1)
    raise TimeoutError(f"airflow not healthy within {timeout_s}s; logs in {server.logs}")


def _stop(server: AirflowServer, grace_s: float = 20) -> None:
    for proc in server.procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in server.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in server.procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # task supervisors and uvicorn workers of the same group
        proc.wait()


def wait_for(check, timeout_s: float = 300, interval_s: float = 2, what: str = "condition"):
    """Poll `check` until it returns something truthy; a slow or dropped API answer is a "not yet"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.ConnectionError, requests.Timeout):
            value = check()
            if value:
                return value
        time.sleep(interval_s)
    raise TimeoutError(f"waited {timeout_s}s for {what}")


def api(method: str, url: str, *, deadline_s: float = 180, **kwargs) -> requests.Response:
    """One REST call on a loaded machine: an answer may take long, and a call that times out or
    loses its connection is sent again until `deadline_s` (only for calls that are safe to repeat:
    reads, pause/unpause, cancel). A POST is sent once and waited for up to `deadline_s`."""
    if method.upper() == "POST":
        return requests.request(method, url, timeout=(10, deadline_s), **kwargs)
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return requests.request(method, url, timeout=(10, 60), **kwargs)
        except (requests.ConnectionError, requests.Timeout):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
