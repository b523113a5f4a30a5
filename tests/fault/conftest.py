"""Fault-injection harness: randomized trials that kill, stop or restart things mid-run, then
recover the way Airflow would (retry the task, or the next scheduled run) and audit.

KAFKA2PG_FAULT_TRIALS (default 2) trials per scenario; KAFKA2PG_FAULT_SEED replays a run.
Every trial ends with the audit: 0 missing, 0 duplicated, ledger contiguous up to the head,
every committed record in the target or the quarantine exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "child.py"
TRIALS = int(os.environ.get("KAFKA2PG_FAULT_TRIALS", "2"))
SEED = int(os.environ.get("KAFKA2PG_FAULT_SEED", str(random.SystemRandom().randrange(1_000_000))))
REPORT: list[dict] = []


def pytest_generate_tests(metafunc):
    if "trial_no" in metafunc.fixturenames:
        metafunc.parametrize("trial_no", range(TRIALS))


@dataclasses.dataclass
class Trial:
    """One randomized trial: its random source, its pipeline and what it moved."""

    scenario: str
    number: int
    seed: int
    rng: random.Random
    env: object = None
    produced: int = 0
    fault_landed: bool | None = None
    outcome: str = ""
    audit: dict = dataclasses.field(default_factory=dict)


@pytest.fixture
def trial(request, trial_no):
    scenario = request.node.originalname.removeprefix("test_")
    seed = SEED + zlib.crc32(scenario.encode()) + trial_no
    current = Trial(scenario, trial_no, seed, random.Random(seed))
    started = time.monotonic()
    yield current
    REPORT.append(
        {
            "scenario": scenario,
            "trial": trial_no,
            "seed": seed,
            "partitions": getattr(current.env, "partitions", None),
            "records": current.produced,
            "fault_landed": current.fault_landed,
            "outcome": current.outcome,
            **current.audit,
            "seconds": round(time.monotonic() - started, 1),
        }
    )


def pytest_terminal_summary(terminalreporter):
    if not REPORT:
        return
    write = terminalreporter.write_line
    write("")
    write(f"fault injection (KAFKA2PG_FAULT_SEED={SEED}, {TRIALS} trial(s) per scenario):")
    write(f"{'scenario':<36} {'trial':>5} {'parts':>5} {'records':>8} {'landed':>6} {'lost':>5} {'dup':>4} {'s':>6}")
    for row in REPORT:
        write(
            f"{row['scenario']:<36} {row['trial']:>5} {row['partitions'] or '-':>5} {row['records']:>8} "
            f"{str(row['fault_landed']):>6} {row.get('lost', '?'):>5} {row.get('duplicated', '?'):>4} "
            f"{row['seconds']:>6}  {row['outcome']}"
        )
    audited = [r for r in REPORT if "lost" in r]
    write(
        f"trials: {len(REPORT)} ({len(audited)} audited), records moved: {sum(r['records'] for r in audited)}, "
        f"lost: {sum(r['lost'] for r in audited)}, duplicated: {sum(r['duplicated'] for r in audited)}, "
        f"wall time of trials: {sum(r['seconds'] for r in REPORT):.0f}s"
    )
    out = Path(os.environ.get("KAFKA2PG_STATE_DIR", ROOT / ".cache")) / "fault-report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seed": SEED, "trials": REPORT}, indent=2))
    write(f"report: {out}")


# ------------------------------------------------------------------ data and recovery


def produce_backlog(trial: Trial, count: int) -> None:
    """`count` events plus producer-retry duplicates and a bad record: every path of a batch."""
    from kafka2pg.devtools.producer import produce, sample_events

    events = list(sample_events(count, seed=trial.seed))
    retries = trial.rng.sample(events, k=min(len(events), trial.rng.randint(0, 3)))
    values = [*events, *retries, b"{not json"]
    trial.rng.shuffle(values)
    trial.produced += produce(trial.env.settings.bootstrap_servers, trial.env.topic, values)


def drain(env, spark, *, limit: int = 60) -> int:
    """Run whole micro-batches (the DAG's functions) until nothing is left; return how many."""
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    for runs in range(limit):
        opened = open_batch(env.settings, env.pipeline, run_id=f"recovery-{runs}")
        if opened.batch is None:
            return runs
        batch = opened.batch
        stage_batch(spark, env.settings, env.pipeline, batch.batch_id, batch.epoch)
        validate_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)
        promote_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)
    raise AssertionError(f"backlog of {env.pipeline.name} not drained after {limit} runs")


def batch_state(env, batch_id: int) -> str:
    from kafka2pg.database import connect

    with connect(env.settings.database_url) as conn:
        return conn.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]


def target_count(env) -> int:
    from kafka2pg.database import connect

    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    with connect(env.settings.database_url) as conn:
        return conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]


def assert_exactly_once(trial: Trial) -> None:
    """The audit is clean, the backlog is drained and every produced record is accounted once."""
    from kafka2pg.audit import audit_pipeline, format_audit
    from kafka2pg.database import connect
    from kafka2pg.kafka_offsets import partition_offsets

    env = trial.env
    audits = audit_pipeline(env.settings, env.pipeline)
    lost = sum(a.missing for a in audits)
    duplicated = sum(a.duplicated + a.unexplained for a in audits)
    trial.audit = {"lost": lost, "duplicated": duplicated, "matched": sum(a.matched for a in audits)}
    report = format_audit(env.pipeline, audits)
    assert all(a.clean for a in audits), report
    offsets = partition_offsets(env.settings.bootstrap_servers, env.topic)
    assert {a.partition: a.head for a in audits} == {o.partition: o.last_stable for o in offsets}, report
    with connect(env.settings.database_url) as conn:
        quarantined = conn.execute(
            "SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchone()[0]
        open_batches = conn.execute(
            "SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s AND state IN ('planned', 'staged', 'validated')",
            (env.pipeline.name,),
        ).fetchone()[0]
    assert target_count(env) + quarantined == trial.produced == trial.audit["matched"], report
    assert open_batches == 0


# ------------------------------------------------------------------ processes


def child_env(env) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT / "plugins"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_STATE_DIR": str(env.settings.state_dir),
    }


def run_child(env, step: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One DAG step in its own process (tests/fault/child.py); returns when it ends or dies."""
    return subprocess.run(
        [sys.executable, str(CHILD), step, "--pipeline", env.pipeline.name, *args],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
        check=False,
    )


def start_child(env, step: str, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, str(CHILD), step, "--pipeline", env.pipeline.name, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(env),
            start_new_session=True,
        )


def result_of(done: subprocess.CompletedProcess) -> dict:
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(line.removeprefix("RESULT "))


def spark_submit(env, batch_id: int, epoch: int, log: Path, *extra: str) -> subprocess.Popen:
    """The real job file through spark-submit, in its own process group, as the DAG launches it."""
    from kafka2pg.jars import spark_jars

    # The driver's temporary files (lz4-java's native library) beside the log, as the stage
    # operator keeps them in the task's scratch folder: a JVM killed outright cannot delete them.
    temporary = log.parent / "jvm-tmp"
    temporary.mkdir(exist_ok=True)
    command = [
        str(Path(sys.executable).with_name("spark-submit")),
        "--master",
        "local[1]",
        "--conf",
        f"spark.driver.extraJavaOptions=-Djava.io.tmpdir={temporary}",
        "--jars",
        ",".join(str(j) for j in spark_jars()),
        str(ROOT / "jobs" / "stage_batch.py"),
        "--pipeline",
        env.pipeline.name,
        "--batch-id",
        str(batch_id),
        "--epoch",
        str(epoch),
        *extra,
    ]
    with open(log, "w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=child_env(env), start_new_session=True
        )


def wait_for(predicate, *, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def log_has(log: Path, text: str, process: subprocess.Popen | None = None):
    def check():
        if text in log.read_text(errors="replace"):
            return True
        if process is not None and process.poll() is not None:
            return "exited"
        return False

    return check


def kill_group(process: subprocess.Popen, sig: signal.Signals, *, timeout: float = 90) -> int:
    """Signal the whole process group (what Airflow does to a task); wait until every process of
    it (the JVM and the Python driver it started) is gone; return the leader's exit code."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    code = process.wait(timeout=timeout)
    wait_group_exit(process.pid, timeout)
    return code


def wait_group_exit(pgid: int, timeout: float) -> None:
    try:
        wait_for(lambda: not group_alive(pgid), timeout=timeout, what=f"process group {pgid} to exit")
    except AssertionError:
        ps = subprocess.run(
            ["ps", "-o", "pid,stat,wchan:24,etime,cmd", "-g", str(pgid)], capture_output=True, text=True
        )
        raise AssertionError(f"processes of group {pgid} still running:\n{ps.stdout[-3000:]}") from None


def python_driver(pgid: int) -> int | None:
    """PID of the job's Python driver: spark-submit's JVM starts it as a child in the same group."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            in_group = os.getpgid(int(proc.name)) == pgid
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (
            in_group
            and b"java" not in Path(command[0].decode()).name.encode()
            and any(part.endswith(b"stage_batch.py") for part in command)
        ):
            return int(proc.name)
    return None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
