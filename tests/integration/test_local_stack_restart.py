"""`./kafka2pg stack start` after one part of the local stack died: only that part restarts, on its
port and with its data, and nothing is deleted; `stack stop` keeps the data, `stack reset` deletes
it only with --confirm. Real processes, each test with a stack of its own in a tmp state dir."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import suppress
from pathlib import Path

import psycopg
import pytest

from kafka2pg import cli
from kafka2pg.devtools import local_stack
from kafka2pg.devtools.processes import alive
from kafka2pg.devtools.producer import produce_sample
from kafka2pg.exceptions import KafkaUnavailableError
from kafka2pg.jars import resolve_jars
from kafka2pg.kafka_offsets import ensure_topic, partition_offsets
from kafka2pg.kafka_reader import count_range

TOPIC = "restart-check"
EVENTS = 500
ROWS = 1000


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    """A state dir of this test's own (the jars shared with the set-up's), torn down at the end."""
    jars = Path(os.environ.get("KAFKA2PG_STATE_DIR", local_stack.DEFAULT_CACHE))
    resolve_jars(jars)
    (tmp_path / "jars").symlink_to(jars / "jars")
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))
    yield tmp_path
    local_stack.reset_stack(tmp_path)


def stack_command(capsys, *args: str) -> tuple[int, str]:
    """Run `./kafka2pg stack ARGS` (the CLI's own code path); exit code and output."""
    code = cli.main(["stack", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def started_and_filled(state_dir: Path, capsys) -> local_stack.Stack:
    """`stack start`, then a topic with EVENTS records and a table with ROWS rows; the stack recorded."""
    code, output = stack_command(capsys, "start")
    assert code == 0 and "started a new broker" in output, output
    stack = local_stack.load_stack(state_dir)
    ensure_topic(stack.kafka.bootstrap_servers, TOPIC, 3)
    produce_sample(stack.kafka.bootstrap_servers, TOPIC, EVENTS, seed=5)
    with psycopg.connect(stack.postgres.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept AS SELECT n FROM generate_series(1, %s) AS n", (ROWS,))
    return stack


def assert_data_intact(stack: local_stack.Stack) -> None:
    """The table's rows and the topic's records are all there, once the restarted services answer
    (a broker just started may take a while to lead its partitions on a loaded machine)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            with psycopg.connect(stack.postgres.url, connect_timeout=10) as conn:
                rows = conn.execute("SELECT count(*) FROM kept").fetchone()[0]
            offsets = partition_offsets(stack.kafka.bootstrap_servers, TOPIC)
            read = sum(
                count_range(stack.kafka.bootstrap_servers, TOPIC, o.partition, 0, o.high).committed for o in offsets
            )
            break
        except (psycopg.OperationalError, KafkaUnavailableError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert rows == ROWS
    assert [(o.low, o.high > 0) for o in offsets] == [(0, True)] * 3
    assert read == EVENTS


def kill(pid: int, is_dead) -> None:
    """SIGKILL, then wait until the process no longer runs (a dead part, as a later `stack start` finds it)."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not is_dead():
        assert time.monotonic() < deadline, f"pid {pid} still runs 60 s after SIGKILL"
        time.sleep(0.05)


def long_query(url: str) -> threading.Thread:
    """A query busy in the CPU, which does not notice its postmaster's death: its process stays,
    holding the cluster's shared memory."""

    def run() -> None:
        # Its connection is cut when `stack start` stops that process.
        with suppress(psycopg.OperationalError), psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT count(*) FROM generate_series(1, 10000000000) AS busy")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + 60
        while not conn.execute("SELECT 1 FROM pg_stat_activity WHERE query LIKE '%AS busy'").fetchone():
            assert time.monotonic() < deadline, "the long query did not start"
            time.sleep(0.05)
    return thread


def test_start_after_postmaster_killed_restarts_only_postgres_with_its_data(state_dir, capsys):
    before = started_and_filled(state_dir, capsys)
    query = long_query(before.postgres.url)

    kill(before.postgres.pid, lambda: not before.postgres.running())
    code, output = stack_command(capsys, "start")

    assert code == 0, output
    assert f"kafka: running at {before.kafka.bootstrap_servers}, pid {before.kafka.pid}: left alone" in output
    assert f"postgres: was down (pid {before.postgres.pid}); restarted at 127.0.0.1:{before.postgres.port}" in output
    assert "first stopped 1 server process(es) it had left running" in output
    query.join(timeout=30)
    after = local_stack.load_stack(state_dir)
    assert after.kafka == before.kafka and after.kafka.running()
    assert (after.postgres.port, after.postgres.data_dir) == (before.postgres.port, before.postgres.data_dir)
    assert after.postgres.pid != before.postgres.pid and after.postgres.running()
    assert_data_intact(after)


def test_start_after_broker_killed_restarts_only_kafka_with_its_data(state_dir, capsys):
    before = started_and_filled(state_dir, capsys)

    kill(before.kafka.pid, lambda: not before.kafka.running())
    code, output = stack_command(capsys, "start")

    assert code == 0, output
    assert f"postgres: running at 127.0.0.1:{before.postgres.port}, pid {before.postgres.pid}: left alone" in output
    assert f"kafka: was down (pid {before.kafka.pid}); restarted at {before.kafka.bootstrap_servers}" in output
    after = local_stack.load_stack(state_dir)
    assert after.postgres == before.postgres and after.postgres.running()
    assert (after.kafka.port, after.kafka.controller_port) == (before.kafka.port, before.kafka.controller_port)
    assert after.kafka.data_dir == before.kafka.data_dir
    assert after.kafka.pid != before.kafka.pid and after.kafka.running()
    assert_data_intact(after)


def test_stop_keeps_the_data_a_taken_port_is_refused_and_only_reset_confirm_deletes(state_dir, capsys):
    before = started_and_filled(state_dir, capsys)

    code, output = stack_command(capsys, "stop")
    assert code == 0 and "its data stays in" in output, output
    assert not before.kafka.running() and not before.postgres.running()
    data = local_stack.stack_data(before)
    assert all(path.is_dir() for path in data)

    code, output = stack_command(capsys, "reset")
    assert code == 1 and "would stop the local stack and delete" in output, output
    assert all(str(path) in output for path in data)
    assert all(path.is_dir() for path in data) and local_stack.load_stack(state_dir) == before

    with socket.socket() as squatter:
        # Like any server: the stopped postgres's connections in TIME_WAIT must not stop the bind.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", before.postgres.port))
        squatter.listen()
        code, output = stack_command(capsys, "start")
    assert code == 2, output
    assert f"recorded port 127.0.0.1:{before.postgres.port}, but another process holds it" in output
    assert Path(before.postgres.data_dir, "PG_VERSION").exists()

    code, output = stack_command(capsys, "start")
    assert code == 0 and "kafka: running at" in output and "postgres: was down" in output, output
    after = local_stack.load_stack(state_dir)
    assert (after.kafka.port, after.postgres.port) == (before.kafka.port, before.postgres.port)
    assert_data_intact(after)

    code, output = stack_command(capsys, "reset", "--confirm")
    assert code == 0 and "local stack stopped and deleted" in output, output
    assert not after.kafka.running() and not after.postgres.running()
    assert not any(path.exists() for path in data)
    assert local_stack.load_stack(state_dir) is None


@pytest.mark.parametrize("failure", [KeyboardInterrupt, FileNotFoundError])
def test_a_stack_start_interrupted_after_its_broker_started_leaves_no_broker_running(state_dir, monkeypatch, failure):
    """Ctrl-C (or a failure that is no StackError, a tool missing) while PostgreSQL starts: the
    broker, which runs in a session of its own and is not recorded yet, is stopped."""
    started = []
    real = local_stack.start_kafka

    def kafka(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    def postgres(work_dir):
        raise failure()

    monkeypatch.setattr(local_stack, "start_kafka", kafka)
    monkeypatch.setattr(local_stack, "start_postgres", postgres)
    with pytest.raises(failure):
        local_stack.start_or_resume(state_dir)
    assert len(started) == 1
    assert not alive(started[0].pid), "the broker outlived the interrupted start"
