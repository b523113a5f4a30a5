"""How the stage job splits a batch over its Spark tasks, and names a Spark task's Kafka failure."""

from __future__ import annotations

import itertools

import pytest

from kafka2pg.config import Settings
from kafka2pg.exceptions import ConfigError, KafkaAuthenticationError, KafkaUnavailableError, RetentionLossError
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


def test_another_task_failure_is_not_called_a_kafka_error():
    assert _kafka_error(task_failure("BatchStateError", "batch 7 is staged"), SETTINGS, _Pipeline, _Batch) is None
