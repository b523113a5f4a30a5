"""The pipeline DAG on a real Spark standalone cluster (a master and two workers, separate JVMs)
with Spark's RPC authentication on: executors in the workers read Kafka and write staging, exactly
once, even when a worker dies mid-stage. The pipelines give the cluster's secret in `spark_conf`,
which reaches the stage job's session only, never spark-submit's command line or the task log.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor

import psycopg
import pytest
from psycopg import sql

from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import produce_sample
from kafka2pg.devtools.spark_cluster import SparkCluster, kill_worker, restore_workers, start_cluster, stop_cluster
from kafka2pg.kafka_offsets import partition_offsets

PARTITIONS = 6
EVENTS = 3000
DEADLINE_S = 300  # for states a loaded machine reaches late (a Spark application's start, a run's end)
SECRET = "cluster-rpc-s3cret-4411"
# What a pipeline run on the cluster gives Spark: authentication on, with the cluster's secret.
AUTHENTICATED = {"spark.authenticate": "true", "spark.authenticate.secret": SECRET}


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    started = start_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, secret=SECRET)
    yield started
    stop_cluster(started)


@pytest.fixture
def cluster(spark_cluster) -> SparkCluster:
    """The module's cluster with all its workers ALIVE (a test before may have killed one)."""
    restore_workers(spark_cluster)
    return spark_cluster


def on_cluster(run_env: dict[str, str], cluster: SparkCluster) -> dict[str, str]:
    """A DAG run's environment with the Spark connection pointing at `cluster` instead of local[2]."""
    return {**run_env, "AIRFLOW_CONN_KAFKA2PG_SPARK": json.dumps(cluster.connection())}


def assert_exactly_once(db, env, produced: int) -> None:
    """Every produced record is in the target once, the heads are at the high watermarks, the audit is clean."""
    audits = audit_pipeline(env.settings, env.pipeline)
    report = format_audit(env.pipeline, audits)
    assert all(a.clean for a in audits), report
    assert sum(a.matched for a in audits) == produced, report
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == produced
    watermarks = {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}
    assert {a.partition: a.head for a in audits} == watermarks, report


def executor_work(cluster: SparkCluster, pipeline_name: str) -> tuple[dict, dict[str, str]]:
    """The pipeline's one Spark application, once the master lists it FINISHED, and its executors' logs."""
    deadline = time.monotonic() + 60
    while (apps := cluster.applications(pipeline_name)) == [] or apps[0]["state"] != "FINISHED":
        assert time.monotonic() < deadline, f"the master lists no finished application of {pipeline_name}: {apps}"
        time.sleep(0.5)
    assert len(apps) == 1, apps
    return apps[0], cluster.executor_logs(apps[0]["id"])


def test_dag_run_on_a_standalone_cluster_is_read_and_written_by_the_workers_executors(
    cluster, make_pipeline, airflow_env, db, tmp_path
):
    env = make_pipeline(partitions=PARTITIONS, spark_conf=AUTHENTICATED)
    produced = produce_sample(env.settings.bootstrap_servers, env.topic, EVENTS, seed=23)
    code, output, _ = dags_test(env.pipeline.dag_id, on_cluster(airflow_env(env), cluster), tmp_path / "run.log")
    assert code == 0, output[-3000:]
    assert_exactly_once(db, env, produced)
    # The master required the secret, and the run gave it without showing it.
    with open(cluster.log_file, errors="replace") as master_log:
        assert "authentication enabled" in master_log.read()
    submits = re.findall(r"Spark-Submit cmd: .*", output)
    assert submits and not [line for line in submits if "spark.authenticate.secret" in line], submits
    assert SECRET not in output and SECRET not in (tmp_path / "run.log").read_text(errors="replace")

    # In local mode no application reaches the master and no worker launches an executor.
    app, logs = executor_work(cluster, env.pipeline.name)
    assert app["cores"] >= 1, app
    assert logs, f"no executor logs of {app['id']} under the workers' work dirs"
    text = "\n".join(logs.values())
    # One task per Kafka partition ran in the executors' JVMs...
    assert len(set(re.findall(r"Running task (\d+)\.\d+ in stage", text))) >= PARTITIONS, text[-3000:]
    # ...with the package fetched from the driver, as the job ships it (addPyFile): the workers'
    # environment has none of it. The tasks read Kafka with librdkafka: no Kafka source jars.
    assert re.search(r"Fetching spark://\S+/files/kafka2pg-\d+\.zip", text), text[-3000:]
    assert "spark-sql-kafka" not in text, text[-3000:]
    assert SECRET not in text


def _planned_batch(db, env, running: Future) -> int:
    """The batch the run's plan task opens (waits for it, with a deadline)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        row = db.execute(
            "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND state = 'planned'", (env.pipeline.name,)
        ).fetchone()
        if row is not None:
            return row[0]
        assert not running.done(), running.result()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no batch of {env.pipeline.name} planned within {DEADLINE_S}s")


def _wait_for_writers(holder, count: int, running: Future) -> None:
    """Wait until `count` chunk writers (Spark tasks) wait for the chunk locks `holder` holds."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        waiting = holder.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid <> pg_backend_pid()"
        ).fetchone()[0]
        if waiting >= count:
            return
        assert not running.done(), running.result()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{count} Spark tasks did not reach their chunk writes within {DEADLINE_S}s")


def _wait_until_gone(pids: list[int]) -> None:
    from kafka2pg.devtools.processes import alive

    deadline = time.monotonic() + DEADLINE_S
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"executors {pids} of the killed worker still run after {DEADLINE_S}s"
        time.sleep(0.2)


def test_worker_killed_mid_stage_loses_and_duplicates_nothing(
    cluster, make_pipeline, airflow_env, base_settings, db, tmp_path
):
    env = make_pipeline(partitions=PARTITIONS, spark_conf=AUTHENTICATED)
    produced = produce_sample(env.settings.bootstrap_servers, env.topic, EVENTS, seed=24)
    run_env = on_cluster(airflow_env(env), cluster)
    with ThreadPoolExecutor(1) as pool, psycopg.connect(base_settings.database_url, autocommit=True) as holder:
        running = pool.submit(dags_test, env.pipeline.dag_id, run_env, tmp_path / "run-1.log")
        batch_id = _planned_batch(db, env, running)
        # Hold every chunk's lock (the key kafka2pg.chunk_writer takes before it writes): each
        # worker's executor then sits inside a task of the stage, mid-write, when its worker dies.
        for chunk in range(PARTITIONS):
            holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"kafka2pg.stage:{batch_id}:{chunk}",))
        _wait_for_writers(holder, len(cluster.workers), running)
        executors = kill_worker(cluster, 0)
        assert executors, "the killed worker had launched no executor"
        _wait_until_gone(executors)  # Spark's WorkerWatcher ends them: their tasks are lost
        holder.execute("SELECT pg_advisory_unlock_all()")
        code, output, _ = running.result(timeout=DEADLINE_S)
    assert re.search(r"Lost executor \d+ on 127\.0\.0\.1: worker lost", output), output[-3000:]
    if code == 0:  # Spark rescheduled: a second attempt of the lost task ran in the surviving worker
        _, logs = executor_work(cluster, env.pipeline.name)
        assert re.search(r"Running task \d+\.[1-9]\d* in stage", "\n".join(logs.values())), list(logs)
    else:  # the stage failed instead: the next run resumes the batch
        code, output, _ = dags_test(env.pipeline.dag_id, run_env, tmp_path / "run-2.log")
        assert code == 0, output[-3000:]
    assert_exactly_once(db, env, produced)
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
    assert state == "promoted"
