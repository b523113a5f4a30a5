"""Exactly-once under kills, stops, restarts and races: each scenario runs randomized trials
against the real broker, PostgreSQL and Spark, recovers like Airflow would, then audits."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from kafka2pg.database import connect
from kafka2pg.exceptions import BatchStateError, LedgerConflictError, StagingLostError
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch

from .conftest import (
    assert_exactly_once,
    batch_state,
    drain,
    kill_group,
    log_has,
    produce_backlog,
    python_driver,
    result_of,
    run_child,
    spark_submit,
    start_child,
    target_count,
    wait_for,
    wait_group_exit,
)


def setup_trial(trial, make_pipeline, spark, *, records: tuple[int, int], single_batch: bool = False):
    """A fresh pipeline with random partitions and batch size, a backlog, maybe a few batches done."""
    partitions = trial.rng.randint(1, 4)
    count = trial.rng.randint(*records)
    batch_cap = count * 2 if single_batch else trial.rng.randint(max(50, count // 4), count)
    trial.env = make_pipeline(partitions=partitions, max_records_per_batch=batch_cap)
    produce_backlog(trial, count)
    if not single_batch and trial.rng.random() < 0.5:
        opened = open_batch(trial.env.settings, trial.env.pipeline, run_id="before-fault")
        stage_batch(spark, trial.env.settings, trial.env.pipeline, opened.batch.batch_id)
        validate_batch(trial.env.settings, trial.env.pipeline, opened.batch.batch_id)
        promote_batch(trial.env.settings, trial.env.pipeline, opened.batch.batch_id)
    return trial.env


def plan_in_child(env) -> dict:
    return result_of(run_child(env, "plan", "--run-id", "doomed-run"))


STEPS = ("stage", "validate", "promote")


def run_step(env, spark, planned: dict, step: str) -> None:
    """One task of a DAG run, with the claim (epoch) its plan task handed out."""
    batch_id, epoch = planned["batch_id"], planned["epoch"]
    if step == "stage":
        stage_batch(spark, env.settings, env.pipeline, batch_id, epoch)
    elif step == "validate":
        validate_batch(env.settings, env.pipeline, batch_id, epoch)
    else:
        promote_batch(env.settings, env.pipeline, batch_id, epoch)


def finish_run(env, spark, planned: dict, *, from_step: str) -> None:
    """Airflow retries the failed task, then runs the rest of the same DAG run (same claim)."""
    for step in STEPS[STEPS.index(from_step) :]:
        run_step(env, spark, planned, step)


def recover(trial, spark, planned: dict, *, from_step: str) -> None:
    """Half the trials retry the task in the same run first; every trial then drains the backlog."""
    if trial.rng.random() < 0.5:
        try:
            finish_run(trial.env, spark, planned, from_step=from_step)
            trial.outcome += " retry ok;"
        except StagingLostError:
            trial.outcome += " retry: staging lost, re-staged by next run;"
    runs = drain(trial.env, spark)
    trial.outcome += f" {runs} recovery run(s)"


# ------------------------------------------------------------------ SIGKILL at each point


def test_kill_after_plan(trial, make_pipeline, spark):
    env = setup_trial(trial, make_pipeline, spark, records=(200, 3000))
    done = run_child(env, "plan", "--run-id", "doomed-run", "--kill-at", "plan:after")
    assert done.returncode == -signal.SIGKILL, done.stderr
    resumed = open_batch(env.settings, env.pipeline, run_id="next-run")
    trial.fault_landed = resumed.resumed
    assert resumed.resumed and resumed.batch.epoch == 2, "the killed run's batch is resumed with a new claim"
    finish_run(env, spark, {"batch_id": resumed.batch.batch_id, "epoch": resumed.batch.epoch}, from_step="stage")
    trial.outcome = f"resumed batch {resumed.batch.batch_id}; {drain(env, spark)} more run(s)"
    assert_exactly_once(trial)


def job_mid_read(trial, make_pipeline, spark, log, *, max_delay: float):
    """A big single batch planned by a doomed run; its spark-submit job 0..max_delay s into the read."""
    env = setup_trial(trial, make_pipeline, spark, records=(20_000, 40_000), single_batch=True)
    planned = plan_in_child(env)
    job = spark_submit(env, planned["batch_id"], planned["epoch"], log)
    wait_for(log_has(log, "reading", job), timeout=120, what="the Spark read to start")
    time.sleep(trial.rng.uniform(0, max_delay))
    return env, planned, job


def test_kill_during_spark_read(trial, make_pipeline, spark, tmp_path):
    env, planned, job = job_mid_read(trial, make_pipeline, spark, tmp_path / "job.log", max_delay=2.5)
    trial.fault_landed = batch_state(env, planned["batch_id"]) == "planned"
    kill_group(job, signal.SIGKILL)
    assert target_count(env) == 0
    recover(trial, spark, planned, from_step="stage")
    assert_exactly_once(trial)


def test_kill_after_staging(trial, make_pipeline, spark, tmp_path):
    env = setup_trial(trial, make_pipeline, spark, records=(500, 5000), single_batch=True)
    planned = plan_in_child(env)
    job = spark_submit(env, planned["batch_id"], planned["epoch"], tmp_path / "job.log")
    wait_for(
        lambda: batch_state(env, planned["batch_id"]) == "staged" or job.poll() is not None,
        timeout=180,
        what="the batch to be staged",
    )
    trial.fault_landed = job.poll() is None
    kill_group(job, signal.SIGKILL)
    assert batch_state(env, planned["batch_id"]) == "staged"
    recover(trial, spark, planned, from_step="stage")
    assert_exactly_once(trial)


def test_kill_during_validation(trial, make_pipeline, spark):
    env = setup_trial(trial, make_pipeline, spark, records=(200, 3000))
    planned = plan_in_child(env)
    run_step(env, spark, planned, "stage")
    point = trial.rng.choice(["validate:after_checks", "validate:after_store", "validate:before_commit"])
    done = run_child(
        env, "validate", "--batch-id", str(planned["batch_id"]), "--epoch", str(planned["epoch"]), "--kill-at", point
    )
    trial.fault_landed = done.returncode == -signal.SIGKILL
    assert trial.fault_landed, done.stdout + done.stderr
    assert batch_state(env, planned["batch_id"]) == "staged", "the validation transaction must roll back whole"
    trial.outcome = f"killed at {point};"
    recover(trial, spark, planned, from_step="validate")
    assert_exactly_once(trial)


def stage_and_validate(env, spark, planned: dict) -> None:
    run_step(env, spark, planned, "stage")
    run_step(env, spark, planned, "validate")


def promote_args(planned: dict, *extra: str) -> list[str]:
    return ["--batch-id", str(planned["batch_id"]), "--epoch", str(planned["epoch"]), *extra]


def test_kill_inside_promote_before_commit(trial, make_pipeline, spark):
    env = setup_trial(trial, make_pipeline, spark, records=(200, 3000))
    planned = plan_in_child(env)
    stage_and_validate(env, spark, planned)
    before = target_count(env)
    point = trial.rng.choice(["promote:after_head", "promote:after_target", "promote:before_commit"])
    done = run_child(env, "promote", *promote_args(planned, "--kill-at", point))
    trial.fault_landed = done.returncode == -signal.SIGKILL
    assert trial.fault_landed, done.stdout + done.stderr
    assert batch_state(env, planned["batch_id"]) == "validated", "the promote transaction must roll back whole"
    assert target_count(env) == before
    trial.outcome = f"killed at {point};"
    recover(trial, spark, planned, from_step="promote")
    assert_exactly_once(trial)


def test_kill_after_promote_commit(trial, make_pipeline, spark):
    env = setup_trial(trial, make_pipeline, spark, records=(200, 3000))
    planned = plan_in_child(env)
    stage_and_validate(env, spark, planned)
    done = run_child(env, "promote", *promote_args(planned, "--kill-at", "promote:after_commit"))
    trial.fault_landed = done.returncode == -signal.SIGKILL
    assert trial.fault_landed, done.stdout + done.stderr
    assert batch_state(env, planned["batch_id"]) == "promoted"
    again = promote_batch(env.settings, env.pipeline, planned["batch_id"], planned["epoch"])
    assert again.already_promoted, "Airflow's retry of the promote task must be a no-op"
    trial.outcome = "retry was a no-op;"
    recover(trial, spark, planned, from_step="promote")
    assert_exactly_once(trial)


# ------------------------------------------------------------------ restarts and graceful stop


def test_postgres_restarted_during_promote(trial, make_pipeline, spark, stack, tmp_path):
    from kafka2pg.devtools.postgres import restart_postgres

    env = setup_trial(trial, make_pipeline, spark, records=(200, 3000))
    planned = plan_in_child(env)
    stage_and_validate(env, spark, planned)
    before = target_count(env)
    resume = tmp_path / "resume"
    log = tmp_path / "promote.log"
    child = start_child(
        env,
        "promote",
        *promote_args(planned, "--pause-at", "promote:before_commit", "--resume-file", str(resume)),
        log=log,
    )
    wait_for(log_has(log, "FAULT promote:before_commit", child), timeout=60, what="promote to reach its commit")
    # fast: clean shutdown, open transactions cut; immediate: a crash, recovery empties UNLOGGED staging.
    mode = ("immediate", "fast")[trial.number % 2]
    stack.postgres = restart_postgres(stack.postgres, mode=mode)
    resume.touch()
    assert child.wait(timeout=60) != 0
    assert "lost the connection to PostgreSQL" in log.read_text(), log.read_text()
    trial.fault_landed = True
    assert target_count(env) == before, "nothing of the interrupted promotion may be visible"
    trial.outcome = f"restart -m {mode};"
    recover(trial, spark, planned, from_step="promote")
    assert_exactly_once(trial)


def test_kafka_restarted_during_read(trial, make_pipeline, spark, stack, tmp_path):
    from kafka2pg.devtools.broker import restart_kafka

    env, planned, job = job_mid_read(trial, make_pipeline, spark, tmp_path / "job.log", max_delay=1.5)
    trial.fault_landed = job.poll() is None
    stack.kafka = restart_kafka(stack.kafka)
    code = job.wait(timeout=300)
    trial.outcome = f"job exit {code};"
    recover(trial, spark, planned, from_step="stage")
    assert_exactly_once(trial)


def test_sigterm_during_stage_stops_gracefully(trial, make_pipeline, spark, tmp_path):
    """SIGTERM to the Python driver alone (its handler must cancel Spark and exit 143 with a clear
    message) or to the whole process group as Airflow does (the JVM dies with it)."""
    log = tmp_path / "job.log"
    env, planned, job = job_mid_read(trial, make_pipeline, spark, log, max_delay=2.0)
    driver_only = trial.number % 2 == 0
    trial.fault_landed = batch_state(env, planned["batch_id"]) == "planned" and job.poll() is None
    signalled = time.monotonic()
    if driver_only:
        os.kill(wait_for(lambda: python_driver(job.pid), timeout=10, what="the Python driver"), signal.SIGTERM)
        code = job.wait(timeout=60)
    else:
        code = kill_group(job, signal.SIGTERM, timeout=60)
    stopped_in = time.monotonic() - signalled
    state = batch_state(env, planned["batch_id"])
    trial.outcome = f"SIGTERM to {'driver' if driver_only else 'group'}: exit {code} after {stopped_in:.1f}s, {state};"
    if trial.fault_landed:
        output = log.read_text()
        assert code != 0 and state == "planned" and stopped_in < 30, output[-3000:]
        if driver_only:
            assert "kafka2pg stage interrupted" in output and "batch stays planned" in output, output[-3000:]
    wait_group_exit(job.pid, 120)
    assert target_count(env) == 0, "nothing is promoted by a stopped stage"
    recover(trial, spark, planned, from_step="stage")
    assert_exactly_once(trial)


def test_kill_multi_batch_job_at_a_random_moment(trial, make_pipeline, spark, tmp_path):
    """A run catching up a backlog (batches_per_run > 1: the job validates and promotes each
    batch itself while staging the next) SIGKILLed at a random moment from its first lookahead
    on: what it promoted stays; half the trials first retry the same job with the same claim
    (Airflow's task retry), which must carry on; the next runs drain the rest."""
    count = trial.rng.randint(2000, 6000)
    env = trial.env = make_pipeline(
        partitions=trial.rng.randint(1, 4), max_records_per_batch=count // trial.rng.randint(4, 8)
    )
    produce_backlog(trial, count)
    planned = plan_in_child(env)
    log = tmp_path / "job.log"
    args = ("--batches", "50", "--run-id", "doomed-run")
    job = spark_submit(env, planned["batch_id"], planned["epoch"], log, *args)
    # Killed anywhere from planning the first lookahead (before the first promotion) onwards.
    wait_for(log_has(log, "planned after batch", job), timeout=180, what="the job's first lookahead")
    time.sleep(trial.rng.uniform(0, 10))
    trial.fault_landed = job.poll() is None
    kill_group(job, signal.SIGKILL)
    with connect(env.settings.database_url) as conn:
        done = conn.execute(
            "SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s AND state = 'promoted' AND run_id = %s",
            (env.pipeline.name, "doomed-run"),
        ).fetchone()[0]
    trial.outcome = f"killed after {done} promoted batch(es);"
    if trial.rng.random() < 0.5:  # Airflow retries the task: the same job, batch and claim
        retry = spark_submit(env, planned["batch_id"], planned["epoch"], log.with_suffix(".retry"), *args)
        code = retry.wait(timeout=600)
        assert code == 0, log.with_suffix(".retry").read_text()[-3000:]
        trial.outcome += " retried job ok;"
    runs = drain(env, spark)
    trial.outcome += f" {runs} recovery run(s)"
    assert_exactly_once(trial)


# ------------------------------------------------------------------ concurrency


def test_two_runs_racing(trial, make_pipeline, spark):
    """Two installations (a manual trigger beside the schedule, or two Airflows on one database)
    run the same pipeline at once, each retrying after a conflict, until the backlog is gone."""
    env = setup_trial(trial, make_pipeline, spark, records=(1000, 6000))
    conflicts: list[str] = []
    promoted: list[int] = []
    errors: list[Exception] = []

    def installation(name: str, seed: int) -> None:
        rng = random.Random(seed)
        for attempt in range(40):
            try:
                opened = open_batch(env.settings, env.pipeline, run_id=f"{name}-{attempt}")
                if opened.batch is None:
                    return
                batch_id, epoch = opened.batch.batch_id, opened.batch.epoch
                time.sleep(rng.uniform(0, 0.5))
                stage_batch(spark, env.settings, env.pipeline, batch_id, epoch)
                validate_batch(env.settings, env.pipeline, batch_id, epoch)
                result = promote_batch(env.settings, env.pipeline, batch_id, epoch)
                promoted.append(result.promoted)
            except (LedgerConflictError, BatchStateError) as exc:
                # Airflow fails the run; the next one comes later. Model that with backoff.
                conflicts.append(f"{name}: {type(exc).__name__}")
                time.sleep(rng.uniform(0.5, 1.5) * 2 ** min(sum(c.startswith(name) for c in conflicts), 4))
            except Exception as exc:  # noqa: BLE001 - any other error fails the test below
                errors.append(exc)
                return

    racers = [threading.Thread(target=installation, args=(n, trial.seed + i)) for i, n in enumerate("AB")]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=600)
    assert not any(r.is_alive() for r in racers), "a racer hung"
    assert errors == [], f"only fencing conflicts are expected: {errors!r}"
    assert promoted, "at least one installation must get batches through"
    trial.fault_landed = bool(conflicts)
    trial.outcome = f"{len(promoted)} promotions, {len(conflicts)} fenced/conflicting attempts;"
    trial.outcome += f" {drain(env, spark)} recovery run(s)"
    assert_exactly_once(trial)


def test_task_retried_while_first_try_runs(trial, make_pipeline, spark):
    """Airflow retries a task whose first try is still running (a zombie): both tries hold the
    same claim and run each step at the same time."""
    env = setup_trial(trial, make_pipeline, spark, records=(2000, 8000), single_batch=True)
    planned = plan_in_child(env)
    outcomes: list[str] = []

    def attempt(step: str, delay: float) -> None:
        time.sleep(delay)
        try:
            run_step(env, spark, planned, step)
            outcomes.append(f"{step} ok")
        except (LedgerConflictError, BatchStateError) as exc:
            outcomes.append(f"{step} {type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - any other error fails the test below
            outcomes.append(f"{step} unexpected {exc!r}")

    for step in STEPS:
        tries = [threading.Thread(target=attempt, args=(step, d)) for d in (0, trial.rng.uniform(0, 1.0))]
        for t in tries:
            t.start()
        for t in tries:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in tries), f"a try of {step} hung"
        assert f"{step} ok" in outcomes, f"neither try of {step} succeeded: {outcomes}"
    assert not [o for o in outcomes if "unexpected" in o], outcomes
    trial.fault_landed = True
    trial.outcome = ", ".join(sorted(outcomes)) + ";"
    trial.outcome += f" {drain(env, spark)} recovery run(s)"
    assert_exactly_once(trial)
