"""How the stage job splits a batch over its Spark tasks, names a Spark task's Kafka failure, and stops its session."""

from __future__ import annotations

import itertools

import pytest

from kafka2pg.config import Settings
from kafka2pg.exceptions import (
    ConfigError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    KafkaAuthenticationError,
    KafkaUnavailableError,
    RetentionLossError,
)
from kafka2pg.planner import BatchPlan, OffsetRange, PartitionPlan
from kafka2pg.staging import _kafka_error, chunk_shares


def ranges(*sizes: int) -> list[OffsetRange]:
    return [OffsetRange(p, 1000, 1000 + size) for p, size in enumerate(sizes)]


@pytest.mark.parametrize(
    ("sizes", "chunks", "records"),
    [
        ((100,) * 6, 2, [300, 300]),
        ((100,) * 6, 4, [200, 200, 100, 100]),
        ((500, 100, 100, 100, 100, 100), 2, [500, 500]),
        ((7, 3), 8, [7, 3]),  # never more shares than ranges, never an empty one
        ((100,) * 6, 6, [100] * 6),
    ],
)
def test_shares_cover_every_range_once_and_balance_the_records(sizes, chunks, records):
    planned = ranges(*sizes)
    shares = chunk_shares(planned, chunks)
    assert sorted(sum(r.size for r in share) for share in shares) == sorted(records)
    assert sorted(itertools.chain(*shares), key=lambda r: r.partition) == planned
    assert all(share == sorted(share, key=lambda r: r.partition) for share in shares)


def test_shares_are_the_same_for_the_same_ranges_in_any_order():
    """A retried task must read exactly the ranges its chunk held the first time."""
    planned = ranges(120, 80, 100, 100, 95, 105)
    assert chunk_shares(planned, 2) == chunk_shares(planned[::-1], 2) == chunk_shares(planned[2:] + planned[:2], 2)


class _Pipeline:
    name, topic = "orders", "orders"


class _Batch:
    batch_id = 7
    plan = BatchPlan("orders", "orders", (PartitionPlan(0, 1000, None, OffsetRange(0, 1000, 1100)),))


SETTINGS = Settings(kafka="broker:9092", database_url="postgresql://postgres@db/kafka2pg")


def task_failure(error: str, message: str) -> str:
    """How a kafka2pg error raised in a Spark task reads in the driver's exception."""
    return (
        "An exception was thrown from the Python worker. Please see the stack trace below.\n"
        'Traceback (most recent call last):\n  File "kafka2pg/kafka_reader.py", line 92, in read_ranges\n'
        f"kafka2pg.exceptions.{error}: {message}\n SQLSTATE: 38000\n\tat org.apache.spark.api.python.X"
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("KafkaAuthenticationError", KafkaAuthenticationError),
        ("KafkaUnavailableError", KafkaUnavailableError),
        ("RetentionLossError", RetentionLossError),
    ],
)
def test_a_kafka_error_in_a_spark_task_is_raised_as_itself_naming_the_batch(error, expected):
    raised = _kafka_error(task_failure(error, "Kafka at broker:9092 said no."), SETTINGS, _Pipeline, _Batch)
    assert type(raised) is expected
    assert str(raised).startswith("pipeline 'orders' batch 7: ")
    assert "SQLSTATE" not in str(raised) and "org.apache" not in str(raised)
    if expected is not RetentionLossError:
        assert "Kafka at broker:9092 said no. Nothing was staged" in str(raised)


def test_a_task_retention_loss_keeps_the_tasks_own_words():
    text = task_failure("RetentionLossError", "reading orders[0]: the partition now holds offsets [0, 60)")
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert "after the batch was planned (reading orders[0]: the partition now holds offsets [0, 60))." in str(raised)


def test_a_module_missing_on_the_executors_is_a_configuration_error_naming_it():
    text = task_failure("X", "y").replace(
        "kafka2pg.exceptions.X: y", "ModuleNotFoundError: No module named 'confluent_kafka'"
    )
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, ConfigError)
    assert "no module 'confluent_kafka'" in str(raised) and "spark.pyspark.python" in str(raised)


def test_a_task_whose_postgresql_connection_was_ended_fails_as_the_database_unavailable_and_retryable():
    text = task_failure("X", "y").replace(
        "kafka2pg.exceptions.X: y",
        "psycopg.errors.AdminShutdown: terminating connection due to administrator command",
    )
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, DatabaseUnavailableError)
    assert str(raised) == (
        "pipeline 'orders' batch 7: a Spark task lost its PostgreSQL connection (AdminShutdown: terminating "
        "connection due to administrator command). Nothing was staged; the batch stays planned and the retry (or "
        "the next run) stages it again."
    )


def test_another_task_failure_is_not_called_a_kafka_error():
    assert _kafka_error(task_failure("BatchStateError", "batch 7 is staged"), SETTINGS, _Pipeline, _Batch) is None


# A Spark task's Arrow work on a few records (the reader's batch, admission, the staging frame,
# its binary COPY rows and per-partition stats), in a fresh interpreter; prints whether pandas got imported.
TASK_ARROW = """
import sys
from pathlib import Path
from kafka2pg.chunk_writer import _accumulate, arrow_without_pandas, frame, staging_copy
from kafka2pg.copy_binary import copy_rows
from kafka2pg.config import get_pipeline
from kafka2pg.admission import decoder_for
from kafka2pg.kafka_reader import _record_batch

if sys.argv[2] == "without":
    arrow_without_pandas()
pipeline = get_pipeline("orders", Path(sys.argv[1]))
good = b'{"event_id": "e1", "customer_id": 7, "amount": 1.50, "ts": "2026-01-01T00:00:00Z", "payload": {}}'
values = [good, good, b"not json", good]
batch = _record_batch(([0, 3, 0, 3], [5, 40, 6, 41], [1_700_000_000_000_000] * 4, [b"k", None, b"k", b"k"], values))
decoder = decoder_for(pipeline)
admitted = decoder.admit(batch.column("value").to_pylist())
framed = frame(batch, admitted, decoder, 1, 0, "orders")
copy_rows(framed, staging_copy(pipeline).types)
stats = {}
_accumulate(stats, framed)
assert stats == {0: [2, 1, 5, 6, [6]], 3: [2, 0, 40, 41, []]}, stats
imported = "pandas" in sys.modules
import pandas  # still importable afterwards
print(imported)
"""


@pytest.mark.parametrize(("mode", "imports_pandas"), [("with", True), ("without", False)])
def test_a_spark_tasks_arrow_work_leaves_pandas_unimported(mode, imports_pandas, fresh_python):
    """pyarrow imports pandas on its first conversion of Python values unless told there is none
    (`arrow_without_pandas`, as the chunk writer does first in each task): the task's whole Arrow
    path then runs without it, and pandas stays importable."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert fresh_python(TASK_ARROW, str(root / "dags" / "pipelines.yaml"), mode) == str(imports_pandas)


def test_the_collector_is_paused_for_a_write_and_restored_as_it_was(monkeypatch):
    import gc

    from kafka2pg import chunk_writer
    from kafka2pg.chunk_writer import collector_paused

    monkeypatch.setattr(chunk_writer, "_frozen", True)  # not pytest's own objects

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a task that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector someone else turned off stays off"
    finally:
        gc.enable()


FREEZE = """
import gc
from kafka2pg.chunk_writer import collector_paused
before = gc.get_freeze_count()
with collector_paused():
    first = gc.get_freeze_count()
kept = [[i] for i in range(1000)]  # objects made after the first write stay collectable
with collector_paused():
    pass
print(before, first, gc.get_freeze_count())
"""


def test_a_workers_modules_are_frozen_out_of_the_collector_at_its_first_write_only(fresh_python):
    """PySpark's daemon collects after each task of a reused worker: what the process held at its
    first write (its modules) is not walked each time, and nothing later (a task's records) is frozen."""
    before, first, after = map(int, fresh_python(FREEZE).split())
    assert before == 0
    assert first > 20_000, "pyarrow's, psycopg's and kafka2pg's objects are frozen"
    assert after <= first, "only the first write freezes (frozen objects are still freed as they go)"


def test_stopping_the_session_does_not_wait_for_the_accumulator_server():
    """PySpark stops its accumulator server inside `spark.stop()`, and the server's handler
    notices only at its next one-second poll: `stop_session` stops Spark first and leaves the
    server's shutdown to a thread."""
    import threading
    from types import SimpleNamespace

    from kafka2pg.staging import stop_session

    released = threading.Event()
    shut = threading.Event()
    events = []

    class Server:
        def shutdown(self):
            events.append("server shutdown")
            released.wait(timeout=60)  # a handler between two polls
            shut.set()

    context = SimpleNamespace(_accumulatorServer=Server())

    class Spark:
        sparkContext = context

        def stop(self):  # what SparkContext.stop does: the JVM, then the accumulator server
            events.append("spark stopped")
            if context._accumulatorServer is not None:
                context._accumulatorServer.shutdown()

    stopping = threading.Thread(target=stop_session, args=(Spark(),), daemon=True)
    stopping.start()
    stopping.join(timeout=60)
    try:
        assert not stopping.is_alive(), "stop_session waited for the accumulator server"
    finally:
        released.set()
    assert shut.wait(timeout=60), "the accumulator server was never shut down"
    assert events == ["spark stopped", "server shutdown"]


def test_a_task_stopped_by_a_lock_timeout_fails_retryably_saying_what_held_it():
    from kafka2pg.exceptions import StatementTimeoutError

    text = task_failure("X", "y").replace(
        "kafka2pg.exceptions.X: y", "psycopg.errors.LockNotAvailable: canceling statement due to lock timeout"
    )
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, StatementTimeoutError) and not raised.terminal
    assert str(raised).startswith(
        "pipeline 'orders' batch 7: a Spark task's statement waited for a lock longer than PostgreSQL's "
        "lock_timeout (canceling statement due to lock timeout)"
    )
    assert "ALTER ROLE … RESET lock_timeout" in str(raised) and "SQLSTATE" not in str(raised)


def test_a_task_refused_by_postgresql_after_the_driver_connected_is_terminal_and_names_pg_hba():
    said = (
        'connection failed: connection to server at "10.0.0.9", port 5432 failed: FATAL:  no pg_hba.conf entry '
        'for host "10.0.0.5", user "etl", database "warehouse", no encryption'
    )
    raised = _kafka_error(
        task_failure("X", "y").replace("kafka2pg.exceptions.X: y", f"psycopg.OperationalError: {said}"),
        SETTINGS,
        _Pipeline,
        _Batch,
    )
    assert isinstance(raised, DatabaseRefusedError) and raised.terminal
    assert str(raised) == (
        "pipeline 'orders' batch 7: PostgreSQL at db:5432/kafka2pg refused a Spark task's connection ("
        + said.replace("FATAL:  ", "FATAL: ")
        + ") after accepting the stage job's own with the same settings: most likely its pg_hba.conf does not admit "
        "the hosts of the Spark executors, which write the staging rows themselves. Admit them (for kafka2pg's role "
        "and database), or fix the postgres connection if it changed. Nothing was staged; the batch stays planned."
    )


def test_a_task_that_could_not_connect_keeps_libpqs_hint_and_not_the_java_trace():
    text = task_failure("X", "y").replace(
        "kafka2pg.exceptions.X: y",
        'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?",
    )
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, DatabaseUnavailableError) and not raised.terminal
    assert "failed: Connection refused Is the server running on that host and accepting TCP/IP connections?)" in str(
        raised
    )
    assert "org.apache" not in str(raised) and "SQLSTATE" not in str(raised)
    assert "each executor's own machine" in str(raised)


def test_a_task_whose_connection_timed_out_gets_the_executors_advice():
    text = task_failure("X", "y").replace(
        "kafka2pg.exceptions.X: y", "psycopg.errors.ConnectionTimeout: connection timeout expired"
    )
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, DatabaseUnavailableError) and not raised.terminal
    assert "could not connect to PostgreSQL at db:5432/kafka2pg (connection timeout expired)." in str(raised)


def test_a_task_refused_for_a_password_the_driver_had_is_told_about_password_files_not_pg_hba():
    said = 'connection failed: connection to server at "10.0.0.9", port 5432 failed: fe_sendauth: no password supplied'
    text = task_failure("X", "y").replace("kafka2pg.exceptions.X: y", f"psycopg.OperationalError: {said}")
    raised = _kafka_error(text, SETTINGS, _Pipeline, _Batch)
    assert isinstance(raised, DatabaseRefusedError)
    assert "a password file (~/.pgpass, PGPASSFILE)" in str(raised) and "pg_hba" not in str(raised)
