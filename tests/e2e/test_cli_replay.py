"""`kafka2pg replay` and `kafka2pg undo` as a user types them (subprocess, own Spark session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from psycopg import sql

from kafka2pg.devtools.producer import produce, sample_events

ROOT = Path(__file__).resolve().parents[2]


def cli_environment(env) -> dict[str, str]:
    return {
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_SPARK_MASTER": "local[1]",
        "PYTHONPATH": str(ROOT / "plugins"),
    }


def cli(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kafka2pg", *args],
        env={**os.environ, **cli_environment(env)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_replay_verify_only_and_undo_from_the_command_line(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1, max_records_per_batch=20)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=9))
    first, second = run_batch(env), run_batch(env)
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("UPDATE {} SET currency = 'XXX' WHERE kafka_offset = 4").format(table))

    name = env.pipeline.name
    out = cli(env, "replay", "--pipeline", name, "--offsets", "0:0-20", "--mode", "verify-only", "--reason", "check")
    assert out.returncode == 1, out.stderr[-3000:]  # a difference found: as `verify` exits on a discrepancy
    assert "1 difference(s)" in out.stdout and "changed: 1 (e.g. 0:4)" in out.stdout

    refused = cli(env, "replay", "--pipeline", name, "--offsets", "0:0-41")
    assert refused.returncode == 2 and "beyond the live head 40" in refused.stderr

    older = cli(env, "undo", "--pipeline", name, "--batch-id", str(first.batch_id), "--confirm")
    assert older.returncode == 2 and "Replay its range instead" in older.stderr
    preview = cli(env, "undo", "--pipeline", name, "--batch-id", str(second.batch_id))
    assert preview.returncode == 1 and "delete 20 target and 0 quarantine rows of p0[20,40)" in preview.stdout
    done = cli(
        env, "undo", "--pipeline", name, "--batch-id", str(second.batch_id), "--reason", "bad batch", "--confirm"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0] == 20
    head = db.execute("SELECT next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (name,)).fetchone()[0]
    assert head == 20
    ops = db.execute(
        "SELECT operation, reason FROM kafka2pg.replays WHERE pipeline = %s ORDER BY replay_id", (name,)
    ).fetchall()
    assert ops == [("verify-only", "check"), ("undo", "bad batch")]


def test_a_replay_from_the_command_line_reads_through_sparks_kafka_source(make_pipeline, run_batch, db):
    """A pipeline reading with Spark's Kafka source: the CLI's own Spark session gets the source's
    jars as the DAG's spark-submit does (here: the ones set-up resolved, by their glob)."""
    env = make_pipeline(partitions=1, kafka_reader="spark")
    produce(env.settings.bootstrap_servers, env.topic, sample_events(30, seed=19))
    run_batch(env)

    out = cli(env, "replay", "--pipeline", env.pipeline.name, "--offsets", "0:0-30", "--mode", "verify-only")

    assert out.returncode == 0, out.stderr[-3000:]
    assert "0 difference(s)" in out.stdout, out.stdout


def test_status_and_abandon_tell_a_running_replay_process_from_a_killed_one(make_pipeline, run_batch, db, tmp_path):
    """A `kafka2pg replay` process holds a lock while it lives: status names its session and
    abandon refuses its batch; killed from outside (its process group), its batch shows as left by
    a process that is gone, and abandon discards it."""
    from kafka2pg.replay_process import process_locks, running_pid

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(30, seed=29))
    run_batch(env)
    name = env.pipeline.name
    environ = {**os.environ, **cli_environment(env)}
    with open(tmp_path / "replay.out", "w") as out:
        replay = subprocess.Popen(
            [sys.executable, "-m", "kafka2pg", "replay", "--pipeline", name, "--offsets", "0:0-30"],
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        batch_id = pid = None
        while pid is None:
            assert replay.poll() is None, (tmp_path / "replay.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the replay process never held its batch's lock"
            found = db.execute(
                "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND kind = 'replay'", (name,)
            ).fetchone()
            if found:
                batch_id = found[0]
                pid = running_pid(process_locks(db), batch_id)
            time.sleep(0.1)
        os.killpg(replay.pid, signal.SIGSTOP)  # held where it is, alive
        state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
        assert state in ("planned", "staged", "validated"), state

        status = cli(env, "status", "--pipeline", name)
        assert (
            f"leaves it to the `./kafka2pg replay` process running it (its session: backend pid {pid})" in status.stdout
        )
        refused = cli(env, "abandon", "--pipeline", name, "--batch-id", str(batch_id), "--confirm")
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"still being replayed by a running `./kafka2pg replay` process (its session: backend pid {pid})" in (
            refused.stderr
        )

        os.killpg(replay.pid, signal.SIGKILL)
        replay.wait(timeout=60)
        while running_pid(process_locks(db), batch_id):  # PostgreSQL ends the killed process's sessions
            assert time.monotonic() < deadline, "the killed process's lock stayed held"
            time.sleep(0.2)
        status = cli(env, "status", "--pipeline", name)
        assert "the `./kafka2pg replay` process that planned it is gone (no session holds its lock)" in status.stdout
        # verify shows it too (not a finding: a replay moves no head and its staged rows are counted nowhere)
        audited = cli(env, "verify", "--pipeline", name)
        assert audited.returncode == 0 and "result: clean" in audited.stdout, audited.stdout + audited.stderr[-3000:]
        assert f"open: batch {batch_id} (replay, " in audited.stdout
        assert f"kafka2pg abandon --pipeline {name} --batch-id {batch_id}` then, if its preview" in audited.stdout
        done = cli(env, "abandon", "--pipeline", name, "--batch-id", str(batch_id), "--reason", "killed", "--confirm")
        assert done.returncode == 0, done.stderr[-3000:]
        state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
        assert state == "abandoned"
    finally:
        if replay.poll() is None:
            os.killpg(replay.pid, signal.SIGKILL)
            replay.wait(timeout=60)


def test_a_replay_postgresql_refuses_says_so_in_one_line_and_names_its_batch_left_open(make_pipeline, run_batch, db):
    """A statement PostgreSQL refuses in words kafka2pg has none for (a DBA's trigger on the
    target): PostgreSQL's error as one line, exit 2, no trace, and the batch this process leaves
    open named with the command that discards it."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(10, seed=31))
    run_batch(env)
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(
        "CREATE OR REPLACE FUNCTION public.kafka2pg_test_refuse() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'refused by the DBA''s trigger'; END $$"
    )
    db.execute(
        sql.SQL(
            "CREATE TRIGGER refuse BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION public.kafka2pg_test_refuse()"
        ).format(table)
    )

    out = cli(env, "replay", "--pipeline", env.pipeline.name, "--offsets", "0:0-10")

    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "error: RaiseException (SQLSTATE P0001): refused by the DBA's trigger" in out.stderr, out.stderr[-3000:]
    batch_id, state = db.execute(
        "SELECT batch_id, state FROM kafka2pg.batches WHERE pipeline = %s AND kind = 'replay'", (env.pipeline.name,)
    ).fetchone()
    assert state == "validated"
    assert (
        f"replay batch {batch_id} is left open (validated), and this process will not carry it on: "
        f"`./kafka2pg abandon --pipeline {env.pipeline.name} --batch-id {batch_id}` then, if its preview is right, "
        "the same with `--confirm` discards it"
    ) in out.stderr


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def is_spark_jvm(pid: int) -> bool:
    """Whether `pid` is a JVM running spark-submit (not the script that execs it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return Path(argv[0].decode()).name == "java" and b"org.apache.spark.deploy.SparkSubmit" in argv


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ctrl_c_while_spark_starts_leaves_no_jvm_behind(make_pipeline, run_batch, db, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while the replay's Spark JVM starts: the
    JVM ignores SIGINT (PySpark starts it so), and once the CLI has given up waiting for it, it
    no longer hears from the CLI: it must not outlive the CLI, which exits 130."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(10, seed=31))
    run_batch(env)
    with open(tmp_path / "replay.out", "w") as out:
        replay = subprocess.Popen(
            [sys.executable, "-m", "kafka2pg", "replay", "--pipeline", env.pipeline.name, "--offsets", "0:0-10"],
            env={**os.environ, **cli_environment(env)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    jvms: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not jvms:
            assert replay.poll() is None, (tmp_path / "replay.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the replay never started its Spark JVM"
            jvms = [p for p in children(replay.pid) if is_spark_jvm(p)]
            time.sleep(0.05)
        os.killpg(replay.pid, signal.SIGINT)
        assert replay.wait(timeout=120) == 130, (tmp_path / "replay.out").read_text()[-3000:]
        assert "interrupted" in (tmp_path / "replay.out").read_text()
        deadline = time.monotonic() + 60
        while any(alive(p) for p in jvms):
            assert time.monotonic() < deadline, f"the Spark JVM {jvms} outlived the interrupted CLI"
            time.sleep(0.2)
    finally:
        for pid in [replay.pid, *jvms]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        replay.wait(timeout=60)
