"""The pipeline DAG run by Airflow deployed as services (api-server, scheduler, dag-processor,
triggerer as separate processes) with docker-compose's executor and connections: triggered over
REST, exactly once, its tasks linking to the batch's quality report; then the scheduler SIGKILLed
mid-run and replaced, still exactly once."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from airflow_server import (
    api,
    compose_airflow_env,
    finished_run,
    running_airflow,
    task_instance,
    trigger,
    wait_dag_unpaused,
    wait_for,
    wait_healthy,
)
from psycopg import sql

from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.devtools.producer import produce_sample
from kafka2pg.kafka_offsets import partition_offsets

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
FIRST, MORE = 300, 600
BATCH = 100


def airflow_env(env) -> dict[str, str]:
    """docker-compose's Airflow settings on this test's stack; the pipelines file and DAG folder."""
    return {
        **compose_airflow_env(COMPOSE, env.settings.database_url, env.settings.bootstrap_servers, "local[1]"),
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        # A restarted scheduler looks for the dead one's tasks every 10 s (default 5 min); it counts a
        # scheduler as dead after 30 s without heartbeat (the default threshold).
        "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
    }


def run_links_and_log_end(server, dag_id: str, run_id: str, task_id: str) -> tuple[dict, list[str]]:
    """The task's extra links (REST, as the UI asks for them) and its log's last lines up to
    Airflow's post-execute group (what the UI shows above that folded group)."""
    ti = f"{server.api}/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
    links = api("GET", f"{ti}/links")
    assert links.ok, links.text
    try_number = api("GET", ti).json()["try_number"]
    log = api("GET", f"{ti}/logs/{try_number}", params={"full_content": "true"}, headers={"Accept": "application/json"})
    assert log.ok, log.text
    events = [entry["event"] if isinstance(entry, dict) else entry for entry in log.json()["content"]]
    return links.json()["extra_links"], events[: events.index("::group::Post Execute")]


def first_batch_report(server, db, env, run_id: str) -> str:
    """The report page of the batch the run's plan task planned (in a run of several batches, the
    Spark job plans the others later), under the api-server's base_url."""
    (batch_id,) = db.execute(
        "SELECT min(batch_id) FROM kafka2pg.batches WHERE pipeline = %s AND run_id = %s", (env.pipeline.name, run_id)
    ).fetchone()
    return f"{server.url}/kafka2pg/pipelines/{env.pipeline.name}/batches/{batch_id}/report"


def promoted_batches(db, env, run_id: str) -> int:
    row = db.execute(
        "SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s AND run_id = %s AND state = 'promoted'",
        (env.pipeline.name, run_id),
    ).fetchone()
    return row[0]


def assert_exactly_once(db, env, produced: int) -> None:
    """Every produced record once in the target, the heads at the end of the topic, the audit clean."""
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    rows, distinct = db.execute(
        sql.SQL("SELECT count(*), count(DISTINCT (kafka_partition, kafka_offset)) FROM {}").format(table)
    ).fetchone()
    assert (rows, distinct) == (produced, produced)
    heads = dict(
        db.execute(
            "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert heads == {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits), format_audit(env.pipeline, audits)
    assert sum(a.matched for a in audits) == produced


def run_between_two_batches(server, db, env, seed: int) -> tuple[str, int]:
    """Produce MORE records, trigger a run of several BATCH-record batches and wait until its
    Spark job is between two of them (the stage task running, some batches promoted, not all);
    the run's id and its batch count."""
    produce_sample(env.settings.bootstrap_servers, env.topic, MORE, seed=seed)
    batches = MORE // BATCH
    dag_id = env.pipeline.dag_id
    run_id = trigger(server, dag_id, {"max_records_per_batch": BATCH, "batches_per_run": batches + 2})

    def in_the_middle():
        staging = task_instance(server, dag_id, run_id, "read_and_stage").get("state") == "running"
        return staging and 1 <= promoted_batches(db, env, run_id) < batches

    wait_for(in_the_middle, timeout_s=400, interval_s=0.5, what="the run's Spark job between two batches")
    return run_id, batches


def test_pipeline_dag_on_airflow_services_survives_a_scheduler_kill(make_pipeline, db, tmp_path):
    env = make_pipeline(partitions=3)
    produce_sample(env.settings.bootstrap_servers, env.topic, FIRST, seed=31)
    extra = airflow_env(env)
    compose_conns = {k: json.loads(v) for k, v in extra.items() if k.startswith("AIRFLOW_CONN_")}
    assert {c["conn_type"] for c in compose_conns.values()} == {"postgres", "kafka", "spark"}
    dag_id = env.pipeline.dag_id
    with running_airflow(tmp_path / "airflow", env.settings.database_url, extra) as server:
        # The tasks can only find their services through the connections.
        assert not {"KAFKA2PG_DATABASE_URL", "KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG"} & set(server.env)
        wait_dag_unpaused(server, dag_id)

        # 1. One triggered run loads the backlog.
        run_id = trigger(server, dag_id, {})
        run = finished_run(server, dag_id, run_id)
        assert run["state"] == "success", server.task_logs()
        assert_exactly_once(db, env, FIRST)
        # Its validate and promote tasks link to the batch's quality report under the configured
        # base_url, and their logs end with it; the page (the plugin's) shows the batch's checks.
        report_url = first_batch_report(server, db, env, run_id)
        for task_id in ("validate", "promote"):
            links, log_end = run_links_and_log_end(server, dag_id, run_id, task_id)
            assert links == {"Quality report": report_url}, links
            assert log_end[-1] == f"report: {report_url}", log_end[-3:]
        report = api("GET", report_url)
        assert report.status_code == 200, report.text
        assert "PROMOTABLE" in report.text
        for check in ("business_key_unique_in_batch", "staged_rows_equal_records_read", "provenance_unique"):
            assert check in report.text, check

        # 2. A run of several batches; the scheduler SIGKILLed while its Spark job is between batches.
        run_id, batches = run_between_two_batches(server, db, env, seed=32)
        killed = server.procs["scheduler"].pid
        killed_at = datetime.now(UTC)
        promoted_at_kill = promoted_batches(db, env, run_id)
        server.kill("scheduler")
        # Airflow runs each task in a process group of its own: the stage task outlives its scheduler
        # and its supervisor, and its Spark job goes on promoting batches.
        assert any(p.is_running() for p in server.orphans)
        wait_for(
            lambda: promoted_batches(db, env, run_id) > promoted_at_kill,
            timeout_s=300,
            interval_s=0.5,
            what="the orphaned Spark job promoting one more batch",
        )
        # Then it dies too, as on a crash of the scheduler's host: the batch it was at stays where it
        # stopped, for the task's next attempt to resume.
        server.kill_orphans()
        promoted_before_restart = promoted_batches(db, env, run_id)
        assert promoted_before_restart < batches, "the orphaned job finished the run before it was killed"
        restarted = server.start("scheduler")
        assert restarted.pid != killed
        # Healthy again by the new scheduler's own heartbeat (the dead one's counts for 30 s).
        wait_for(
            lambda: (h := wait_healthy(server))
            and datetime.fromisoformat(h["scheduler"]["latest_scheduler_heartbeat"]) > killed_at,
            timeout_s=240,
            what="the new scheduler's heartbeat",
        )

        run = finished_run(server, dag_id, run_id)
        assert run["state"] == "success", server.task_logs()
        assert restarted.poll() is None
        # The new scheduler reset the dead one's running task; its next attempt finished the run.
        stage = task_instance(server, dag_id, run_id, "read_and_stage")
        assert stage["state"] == "success" and stage["try_number"] >= 2, stage
        assert promoted_batches(db, env, run_id) == batches
        states = db.execute(
            "SELECT state, count(*) FROM kafka2pg.batches WHERE pipeline = %s GROUP BY state", (env.pipeline.name,)
        ).fetchall()
        reset = [line for line in (server.logs / "scheduler.log").read_text().splitlines() if "Reset the" in line]
        print(
            f"scheduler {killed} killed at {promoted_at_kill} batch(es) of {batches} promoted; orphaned job "
            f"killed at {promoted_before_restart}; new scheduler {restarted.pid}: {reset}; read_and_stage "
            f"try {stage['try_number']}; batches {states}"
        )
        # A run of several batches links to its first, the one its validate and promote tasks were
        # handed (the Spark job finished them all; the batches page lists the others).
        report_url = first_batch_report(server, db, env, run_id)
        assert run_links_and_log_end(server, dag_id, run_id, "promote")[0] == {"Quality report": report_url}

        # 3. A run with nothing to load: its validate and promote tasks are skipped, without a link.
        run_id = trigger(server, dag_id, {})
        assert finished_run(server, dag_id, run_id)["state"] == "success", server.task_logs()
        for task_id in ("validate", "promote"):
            assert task_instance(server, dag_id, run_id, task_id)["state"] == "skipped"
            links = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/links").json()
            assert links["extra_links"] == {"Quality report": None}, links
    assert_exactly_once(db, env, FIRST + MORE)
