"""The pipeline DAG on Airflow with the CeleryExecutor, as most deployments run it: a Redis broker
and a Celery worker as a process of its own, where the tasks (and the stage task's spark-submit)
run. A run lands its records exactly once; then the worker's host is lost in the middle of a
run of several batches (the worker and its Spark job SIGKILLed): the scheduler finds the task
without a heartbeat, a new worker runs its next attempt, and the run ends exactly once."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

from airflow_server import (
    compose_airflow_env,
    finished_run,
    running_airflow,
    task_instance,
    trigger,
    wait_dag_unpaused,
    wait_for,
)
from test_airflow_services import FIRST, MORE, assert_exactly_once, promoted_batches, run_between_two_batches

from kafka2pg.devtools.processes import free_port
from kafka2pg.devtools.producer import produce_sample

ROOT = Path(__file__).resolve().parents[2]
WORKER = ["airflow", "celery", "worker", "--concurrency", "2", "--without-mingle", "--without-gossip"]


@contextlib.contextmanager
def running_redis(work: Path):
    """A throwaway Redis (no persistence) on a free local port; stopped by its PID."""
    assert shutil.which("redis-server"), "redis-server is not installed: run the suite through ./kafka2pg test"
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "redis.log", "w") as out:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            log = (work / "redis.log").read_text(errors="replace")
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{log[-2000:]}")
            return "Ready to accept connections" in log

        wait_for(ready, 60, 0.2, "redis")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def worker_ready(server, since: int = 0) -> bool:
    """The worker's log says it is ready, after `since` characters of it (a restarted worker appends)."""
    return " ready." in (server.logs / "celery-worker.log").read_text(errors="replace")[since:]


def test_pipeline_dag_on_the_celery_executor_survives_a_lost_worker(make_pipeline, db, tmp_path):
    env = make_pipeline(partitions=3)
    produce_sample(env.settings.bootstrap_servers, env.topic, FIRST, seed=41)
    dag_id = env.pipeline.dag_id
    with running_redis(tmp_path / "redis") as broker:
        extra = {
            **compose_airflow_env(
                ROOT / "docker-compose.yaml", env.settings.database_url, env.settings.bootstrap_servers, "local[1]"
            ),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CELERY__BROKER_URL": broker,
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
            # A task without a heartbeat for a minute is failed (and retried); the default waits 5 minutes.
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
            "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        }
        with running_airflow(
            tmp_path / "airflow", env.settings.database_url, extra, extra_commands={"celery-worker": WORKER}
        ) as server:
            wait_for(lambda: worker_ready(server), timeout_s=240, what="the Celery worker ready")
            wait_dag_unpaused(server, dag_id)

            # 1. A triggered run: every task goes through Redis to the worker, which runs it.
            run_id = trigger(server, dag_id, {})
            run = finished_run(server, dag_id, run_id)
            assert run["state"] == "success", server.task_logs()
            assert_exactly_once(db, env, FIRST)
            worker_log = (server.logs / "celery-worker.log").read_text(errors="replace")
            for task_id in ("plan", "read_and_stage", "validate", "promote"):
                assert task_instance(server, dag_id, run_id, task_id)["state"] == "success"
                assert f"run_id={run_id}/task_id={task_id}/attempt=1.log" in worker_log, worker_log[-3000:]

            # 2. The worker's host lost while the run's Spark job is between two batches.
            run_id, batches = run_between_two_batches(server, db, env, seed=42)
            server.kill("celery-worker")
            server.kill_orphans()  # the task's own process group: the whole host is gone
            lost_at = promoted_batches(db, env, run_id)
            assert lost_at < batches, "the Spark job finished the run before its worker was lost"
            log_size = len((server.logs / "celery-worker.log").read_text(errors="replace"))
            server.start("celery-worker")
            wait_for(lambda: worker_ready(server, log_size), timeout_s=240, what="the new Celery worker ready")

            run = finished_run(server, dag_id, run_id, timeout_s=900)
            assert run["state"] == "success", server.task_logs()
            stage = task_instance(server, dag_id, run_id, "read_and_stage")
            assert stage["state"] == "success" and stage["try_number"] >= 2, stage
            assert promoted_batches(db, env, run_id) == batches
            print(f"worker lost at {lost_at} of {batches} batches promoted; read_and_stage try {stage['try_number']}")
    assert_exactly_once(db, env, FIRST + MORE)
