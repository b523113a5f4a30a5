"""Every kafka_offsets call against a cluster nobody answers for: a `KafkaUnavailableError` naming
the bootstrap servers and what to check, within the timeout; never a bare TimeoutError."""

from __future__ import annotations

import socket
import time

import pytest

from kafka2pg import kafka_offsets, kafka_reader
from kafka2pg.exceptions import KafkaUnavailableError, TopicNotFoundError

TIMEOUT_S = 1.0


@pytest.fixture
def nobody_listens() -> str:
    """bootstrap.servers of a free 127.0.0.1 port: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def metadata_then_broker_gone(monkeypatch) -> None:
    """The broker answered the metadata request, then died: the next request waits out its timeout."""
    monkeypatch.setattr(kafka_offsets, "topic_partitions", lambda *_: [0, 1])


def topic_missing_then_broker_gone(monkeypatch) -> None:
    def missing(*_):
        raise TopicNotFoundError("topic 'orders' does not exist")

    monkeypatch.setattr(kafka_offsets, "topic_partitions", missing)


CALLS = {
    "topic_retention": (None, lambda servers: kafka_offsets.topic_retention(servers, "orders", TIMEOUT_S)),
    "partition_offsets": (None, lambda servers: kafka_offsets.partition_offsets(servers, "orders", TIMEOUT_S)),
    "partition_offsets, broker gone after metadata": (
        metadata_then_broker_gone,
        lambda servers: kafka_offsets.partition_offsets(servers, "orders", TIMEOUT_S),
    ),
    "offsets_for_times, broker gone after metadata": (
        metadata_then_broker_gone,
        lambda servers: kafka_offsets.offsets_for_times(servers, "orders", 0, TIMEOUT_S),
    ),
    "ensure_topic": (None, lambda servers: kafka_offsets.ensure_topic(servers, "orders", 3, TIMEOUT_S)),
    "ensure_topic, broker gone before create": (
        topic_missing_then_broker_gone,
        lambda servers: kafka_offsets.ensure_topic(servers, "orders", 3, TIMEOUT_S),
    ),
    "count_range": (None, lambda servers: kafka_reader.count_range(servers, "orders", 0, 0, 10, TIMEOUT_S)),
}


@pytest.mark.parametrize("name", CALLS)
def test_an_unreachable_cluster_raises_kafka_unavailable_naming_the_servers(name, nobody_listens, monkeypatch):
    prepare, call = CALLS[name]
    if prepare:
        prepare(monkeypatch)
    started = time.monotonic()
    with pytest.raises(KafkaUnavailableError) as raised:
        call(nobody_listens)
    assert (raised.value.cluster, raised.value.timeout_s, raised.value.topic) == (nobody_listens, TIMEOUT_S, "orders")
    assert "Check that the brokers run and that the pipeline's Kafka connection" in str(raised.value)
    assert time.monotonic() - started < 10
