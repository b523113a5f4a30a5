"""A batch that fails the same step run after run is reported STUCK, never left silent."""

import logging
import logging.handlers
import os
import subprocess
import sys

import psycopg
import pytest
from psycopg import sql

from kafka2pg import tasks
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.report import ledger_report
from kafka2pg.staging import stage_batch
from kafka2pg.status import pipeline_status
from kafka2pg.stuck import RESUMES


def verify(env) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
    }
    command = [sys.executable, "-m", "kafka2pg", "verify", "--pipeline", env.pipeline.name]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)


def test_a_batch_failing_promotion_in_two_runs_is_stuck_in_status_verify_and_the_log(
    make_pipeline, spark, db, monkeypatch
):
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(20, seed=71))
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    # Not a data error: the database refuses every insert into the target (a broken trigger).
    db.execute(
        "CREATE OR REPLACE FUNCTION public.refuse_all() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'target is read-only for maintenance'; END $$"
    )
    db.execute(sql.SQL("CREATE TRIGGER refuse BEFORE INSERT ON {} EXECUTE FUNCTION public.refuse_all()").format(target))

    batch = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id, batch.epoch)
    validate_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)
    with pytest.raises(Exception, match="read-only for maintenance"):
        tasks.promote(env.pipeline.name, batch.batch_id, batch.epoch)
    status = ledger_report(env.settings, env.pipeline)
    assert "STUCK" not in status  # one failure: maybe a passing outage
    # The open batch is named, with its ranges, its run and its failure, and what the next run does.
    (opened,) = [line for line in status.splitlines() if line.startswith("open: ")]
    assert opened.startswith(f"open: batch {batch.batch_id} (live, validated) p0[0,") and " by run run-1; " in opened
    assert "; last failure at promote: " in opened and "target is read-only for maintenance" in opened, opened
    assert opened.endswith(f"; next run: {RESUMES}")
    assert verify(env).returncode == 0

    resumed = open_batch(env.settings, env.pipeline, run_id="run-2").batch
    assert (resumed.batch_id, resumed.epoch) == (batch.batch_id, batch.epoch + 1)
    # A handler on the logger itself: Airflow's logging set-up (on the first task, when the test
    # runs alone) takes pytest's handler off the root logger.
    logged = logging.handlers.BufferingHandler(100)
    logging.getLogger("kafka2pg.stuck").addHandler(logged)
    try:
        with pytest.raises(Exception, match="read-only for maintenance"):
            tasks.promote(env.pipeline.name, resumed.batch_id, resumed.epoch)
        with pytest.raises(Exception, match="read-only for maintenance"):  # a retry in the same run counts once
            tasks.promote(env.pipeline.name, resumed.batch_id, resumed.epoch)
    finally:
        logging.getLogger("kafka2pg.stuck").removeHandler(logged)

    status = ledger_report(env.settings, env.pipeline)
    expected = f"STUCK: pipeline '{env.pipeline.name}' batch {batch.batch_id} (validated, offsets p0[0,"
    assert expected in status, status
    assert "failed at promote in 2 consecutive runs since" in status
    assert "target is read-only for maintenance" in status
    assert status.count("trigger a run") == 1 and ".." not in status, status  # the error's advice, not twice
    assert f"open: batch {batch.batch_id} " not in status  # its STUCK line says it all, once
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        shown = pipeline_status(env.settings, env.pipeline, conn).to_json()
    assert [(b["batch_id"], b["failed_step"], b["failures"]) for b in shown["open_batches"]] == [
        (batch.batch_id, "promote", 2)
    ]
    assert [b["batch_id"] for b in shown["stuck"]] == [batch.batch_id] and shown["not_ready"] is None
    assert any(r.levelname == "ERROR" and "STUCK" in r.getMessage() for r in logged.buffer)
    failed = verify(env)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "result: STUCK" in failed.stdout and f"batch {batch.batch_id} (validated" in failed.stdout

    dry = open_batch(env.settings, env.pipeline, dry_run=True).message  # a plan says so too
    assert dry.startswith(f"dry run: would resume unfinished batch {batch.batch_id} (validated, ")
    assert dry.endswith("; it is STUCK: it failed at promote in 2 consecutive runs (`./kafka2pg status`)"), dry

    db.execute(sql.SQL("DROP TRIGGER refuse ON {}").format(target))
    third = open_batch(env.settings, env.pipeline, run_id="run-3")
    assert "STUCK" in third.message  # resumed STUCK: this run may fail it again
    third = third.batch
    assert tasks.promote(env.pipeline.name, third.batch_id, third.epoch)["promoted"] == 20
    assert "STUCK" not in ledger_report(env.settings, env.pipeline)
    passed = verify(env)
    assert passed.returncode == 0 and "result: clean" in passed.stdout


def test_a_step_stopped_by_airflows_execution_timeout_is_a_recorded_failure_and_leaves_no_statement_waiting(
    make_pipeline, spark, db, monkeypatch
):
    """`task_timeout_minutes` stops a promote task waiting for a partition another process holds
    (Airflow raises AirflowTaskTimeout, no Exception, inside the wait): its statement is cancelled
    at once (its backend went on waiting in the lock queue, holding the batch's row, until the
    holder let go) and the timeout is recorded as the step's failure, as any other (it was not:
    a step timing out run after run never became STUCK)."""
    import signal
    import threading
    import time

    from airflow.sdk.exceptions import AirflowTaskTimeout
    from airflow.sdk.execution_time.timeout import timeout

    from kafka2pg.ledger import lock_partitions

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=72))
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    batch = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id, batch.epoch)
    validate_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)

    def waiting() -> int:
        return db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone()[0]

    def alarm_once_waiting(seen: list) -> None:
        """Airflow's timeout (SIGALRM) to the main thread once the promotion waits for the partition."""
        deadline = time.monotonic() + 120
        with psycopg.connect(env.settings.database_url, autocommit=True) as watcher:
            while time.monotonic() < deadline:
                if watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                    " AND datname = current_database()"
                ).fetchone()[0]:
                    seen.append(True)
                    break
                time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

    with psycopg.connect(env.settings.database_url) as holder:  # an undo, say, frozen with the partition
        lock_partitions(holder, env.pipeline.name, [0], "a frozen holder")
        seen: list = []
        watcher = threading.Thread(target=alarm_once_waiting, args=(seen,), daemon=True)
        with pytest.raises(AirflowTaskTimeout), timeout(600):  # its handler raises at the watcher's SIGALRM
            watcher.start()
            tasks.promote(env.pipeline.name, batch.batch_id, batch.epoch)
        watcher.join(10)
        assert seen, "the promotion never waited for the partition"
        deadline = time.monotonic() + 30
        while waiting():
            assert time.monotonic() < deadline, "the timed-out promotion still waits in PostgreSQL"
            time.sleep(0.1)
        holder.rollback()

    failed = db.execute(
        "SELECT state, failed_step, failures, last_failure FROM kafka2pg.batches WHERE batch_id = %s",
        (batch.batch_id,),
    ).fetchone()
    assert failed[:3] == ("validated", "promote", 1) and failed[3].startswith("AirflowTaskTimeout"), failed
    assert tasks.promote(env.pipeline.name, batch.batch_id, batch.epoch)["promoted"] == 5


def test_a_frozen_process_holding_the_open_batch_is_named_while_the_plan_waits_and_ended_by_postgresql(
    make_pipeline, monkeypatch, caplog, end_at_deadline
):
    import logging

    from kafka2pg import database

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(5, seed=91)))
    planned = open_batch(env.settings, env.pipeline, run_id="first")
    monkeypatch.setattr(database, "IDLE_IN_TRANSACTION_TIMEOUT_S", 4)
    monkeypatch.setattr(database, "LOCK_WAIT_LOG_S", 0.5)
    # A stage job frozen (SIGSTOP) inside its transaction: the batch's row locked, the session idle.
    frozen = database.connect(env.settings.database_url)
    frozen.execute("SELECT 1 FROM kafka2pg.batches WHERE batch_id = %s FOR UPDATE", (planned.batch.batch_id,))

    # Without the timeout the plan would wait for good: the holder is ended at a deadline, and the test fails.
    with end_at_deadline(env.settings.database_url, frozen.info.backend_pid) as rescued:
        with caplog.at_level(logging.WARNING, logger="kafka2pg.database"):
            resumed = open_batch(env.settings, env.pipeline, run_id="second")
    assert not rescued, "the frozen holder was not ended by PostgreSQL"

    assert resumed.resumed and resumed.batch.batch_id == planned.batch.batch_id
    waits = [r.getMessage() for r in caplog.records if "waits for a lock held by" in r.getMessage()]
    assert waits and f"backend pid {frozen.info.backend_pid} (" in waits[0], caplog.text
    assert "(kafka2pg, idle in transaction for " in waits[0] and "pg_terminate_backend" in waits[0], waits[0]
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # PostgreSQL ended its session
        frozen.execute("SELECT 1")


def test_the_oldest_batch_a_run_holds_open_is_where_its_stage_job_of_several_batches_stopped(
    make_pipeline, spark, monkeypatch
):
    """A stage job of several batches that times out records the timeout on that batch
    (StageOperator._interrupted): the run's promoted batches and other runs' are not it."""
    from kafka2pg.stuck import oldest_open_batch

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(6, seed=74))
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    first = open_batch(env.settings, env.pipeline, max_records_per_batch=3, run_id="run-a").batch
    assert oldest_open_batch(env.settings, env.pipeline.name, "run-a") == (first.batch_id, first.epoch)
    assert oldest_open_batch(env.settings, env.pipeline.name, "run-b") is None
    stage_batch(spark, env.settings, env.pipeline, first.batch_id, first.epoch)
    validate_batch(env.settings, env.pipeline, first.batch_id, first.epoch)
    tasks.promote(env.pipeline.name, first.batch_id, first.epoch)
    assert oldest_open_batch(env.settings, env.pipeline.name, "run-a") is None
    second = open_batch(env.settings, env.pipeline, max_records_per_batch=3, run_id="run-a").batch
    assert second.batch_id > first.batch_id
    assert oldest_open_batch(env.settings, env.pipeline.name, "run-a") == (second.batch_id, second.epoch)


def test_a_batch_failing_twice_in_one_run_is_not_stuck_and_in_a_second_run_it_is(make_pipeline, db):
    """A stage job of several batches retried by Airflow claims its open batch again (a new epoch)
    within the same run: STUCK counts runs, so that retry's failure is the same run's."""
    from kafka2pg.batch_store import claim, load_batch
    from kafka2pg.database import transaction
    from kafka2pg.stuck import record_failure

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(4, seed=75))
    batch = open_batch(env.settings, env.pipeline, run_id="run-a").batch

    def fail_in(run_id: str | None, job_retry: bool = True) -> int:
        with transaction(env.settings.database_url) as conn:
            claimed = claim(conn, load_batch(conn, batch.batch_id), run_id, job_retry=job_retry)
        record_failure(env.settings, env.pipeline.name, batch.batch_id, claimed.epoch, "stage", OSError("disk full"))
        return db.execute("SELECT failures FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]

    record_failure(env.settings, env.pipeline.name, batch.batch_id, batch.epoch, "stage", OSError("disk full"))
    assert fail_in("run-a") == 1  # Airflow's retry within run-a
    assert fail_in("run-a") == 1
    assert fail_in("run-b") == 2  # the next run: STUCK
    assert fail_in("run-b", job_retry=False) == 3  # run-b cleared in Airflow's UI: its plan claims it again
    assert fail_in(None) == 4  # a claim without a run, or by the CLI, is a run of its own
    assert fail_in("cli") == 5
    assert fail_in("cli") == 6
