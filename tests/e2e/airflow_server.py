"""A throwaway real Airflow (api-server + scheduler + dag-processor + triggerer, LocalExecutor
unless told otherwise) for e2e tests, and the docker-compose Airflow settings mapped onto it.

The metadata DB is a fresh database in the test stack's PostgreSQL (SQLite refuses concurrent
backfill creation at random). No auth (SimpleAuthManager, all admins), 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg
import requests
import yaml
from psycopg.conninfo import conninfo_to_dict

from kafka2pg.devtools.processes import free_port

SIMPLE_AUTH = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
INHERITED_NOT = frozenset(
    {"AIRFLOW_CONFIG", "KAFKA2PG_DATABASE_URL", "KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG"}
)
# Components whose heartbeat /monitor/health reports ("metadatabase" is the API server's own check).
HEALTH_PARTS = ("metadatabase", "scheduler", "dag_processor", "triggerer")


@dataclass
class AirflowServer:
    port: int
    env: dict[str, str]
    logs: Path
    work: Path
    commands: dict[str, list[str]]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Processes left behind by a killed component (task runners in their own process groups).
    orphans: list[psutil.Process] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/api/v2"

    def start(self, name: str) -> subprocess.Popen:
        """Start (or start again) one component, in its own session, its output appended to its log."""
        with open(self.logs / f"{name}.log", "a") as out:
            self.procs[name] = subprocess.Popen(
                self.commands[name],
                env=self.env,
                cwd=self.work,
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return self.procs[name]

    def kill(self, name: str) -> None:
        """SIGKILL one component's process group (as `kill -9 -PGID` or the OOM killer would); its
        descendants in other process groups (task runners) live on, remembered for `kill_orphans`."""
        proc = self.procs[name]
        self.orphans += psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def kill_orphans(self) -> None:
        """SIGKILL what `kill` left behind, by PID (psutil checks each is still the same process)."""
        for orphan in self.orphans:
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()
        psutil.wait_procs(self.orphans, timeout=30)

    def health(self) -> dict:
        return requests.get(f"{self.api}/monitor/health", timeout=5).json()

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
    # Services come from `extra` only (connections or the CLI fallback), never from the caller's shell.
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}
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
    work: Path,
    database_url: str,
    extra_env: dict[str, str],
    timeout_s: float = 240,
    extra_commands: dict[str, list[str]] | None = None,
) -> Iterator[AirflowServer]:
    """Migrate a fresh metadata DB, start the four components (and `extra_commands`: an executor's
    workers), wait until healthy; stop them by PID."""
    home, logs = work / "home", work / "logs"
    home.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    port = free_port()
    commands = {
        "api-server": ["airflow", "api-server", "--host", "127.0.0.1", "--port", str(port)],
        "scheduler": ["airflow", "scheduler"],
        "dag-processor": ["airflow", "dag-processor"],
        "triggerer": ["airflow", "triggerer"],
        **(extra_commands or {}),
    }
    server = AirflowServer(port, _env(home, port, _metadata_db(database_url), extra_env), logs, work, commands)
    with open(logs / "db-migrate.log", "w") as out:
        subprocess.run(["airflow", "db", "migrate"], env=server.env, check=True, stdout=out, stderr=subprocess.STDOUT)
    try:
        for name in commands:
            server.start(name)
        wait_healthy(server, timeout_s)
        yield server
    finally:
        _stop(server)


def wait_healthy(server: AirflowServer, timeout_s: float = 240) -> dict:
    """Every component running and reported healthy by /monitor/health (with heartbeats); the report."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in server.procs.items():
            if proc.poll() is not None:
                tail = (server.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(requests.RequestException, ValueError, KeyError, TypeError):
            health = server.health()
            if all(health[part]["status"] == "healthy" for part in HEALTH_PARTS):
                return health
        time.sleep(1)
    raise TimeoutError(f"airflow not healthy within {timeout_s}s; logs in {server.logs}")


def _stop(server: AirflowServer, grace_s: float = 20) -> None:
    for proc in server.procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            server.orphans += psutil.Process(proc.pid).children(recursive=True)
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
    server.kill_orphans()


COMPOSE_POSTGRES_HOST = "postgres"
COMPOSE_KAFKA = "kafka:9092"
COMPOSE_SPARK_PREFIX = "spark://spark-master:"


def compose_airflow_env(compose_file: Path, database_url: str, bootstrap_servers: str, spark_master: str) -> dict:
    """The executor and kafka2pg connections of docker-compose's `x-airflow-common` environment, their
    compose hosts mapped onto a test's own services: the `postgres` host (port, login, password,
    database) onto `database_url`, `kafka:9092` onto `bootstrap_servers`, the Spark master onto
    `spark_master`. Everything else in a connection (its type, its extra) stays as compose has it;
    a connection pointing elsewhere than the compose hosts raises, so the two cannot drift apart."""
    compose = yaml.safe_load(compose_file.read_text())
    environment = compose["x-airflow-common"]["environment"]
    mapped = {"AIRFLOW__CORE__EXECUTOR": environment["AIRFLOW__CORE__EXECUTOR"]}
    for name, value in environment.items():
        if name.startswith("AIRFLOW_CONN_KAFKA2PG_"):
            mapped[name] = json.dumps(
                _mapped_connection(name, json.loads(value), database_url, bootstrap_servers, spark_master)
            )
    return mapped


def _mapped_connection(name: str, conn: dict, database_url: str, bootstrap_servers: str, spark_master: str) -> dict:
    conn = dict(conn)
    kind = conn.get("conn_type")
    if kind == "postgres" and conn.get("host") == COMPOSE_POSTGRES_HOST:
        target = conninfo_to_dict(database_url)
        conn.update(
            host=target["host"],
            port=int(target.get("port", 5432)),
            login=target["user"],
            password=target.get("password", ""),
            schema=target["dbname"],
        )
        return conn
    if kind == "kafka" and conn.get("extra", {}).get("bootstrap.servers") == COMPOSE_KAFKA:
        conn["extra"] = {**conn["extra"], "bootstrap.servers": bootstrap_servers}
        return conn
    if kind == "spark" and str(conn.get("host", "")).startswith(COMPOSE_SPARK_PREFIX):
        conn.pop("port", None)
        conn["host"] = spark_master
        return conn
    raise ValueError(f"{name} in docker-compose.yaml: no mapping onto the test stack for {conn!r}")


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


def trigger(server: AirflowServer, dag_id: str, conf: dict) -> str:
    created = api("POST", f"{server.api}/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
    assert created.ok, created.text
    return created.json()["dag_run_id"]


def finished_run(server: AirflowServer, dag_id: str, run_id: str, timeout_s: float = 600) -> dict:
    def done():
        run = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}").json()
        return run if run["state"] in ("success", "failed") else None

    return wait_for(done, timeout_s=timeout_s, what=f"run {run_id}")


def task_instance(server: AirflowServer, dag_id: str, run_id: str, task_id: str) -> dict:
    return api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}").json()


def wait_dag_unpaused(server: AirflowServer, dag_id: str) -> None:
    """Wait until the dag-processor has parsed `dag_id`, then unpause it."""
    wait_for(lambda: api("GET", f"{server.api}/dags/{dag_id}/details").ok, timeout_s=180, what=f"DAG {dag_id} parsed")
    assert api("PATCH", f"{server.api}/dags/{dag_id}", json={"is_paused": False}).ok
