"""What the Kafka cluster says about a topic: partitions, low watermarks, LSO, high watermarks.

Thin confluent-kafka AdminClient calls; client errors are translated into kafka2pg errors here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from kafka2pg.exceptions import KafkaUnavailableError, TopicNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionOffsets:
    """Broker offsets of one partition: [low, high), last stable offset for read_committed."""

    partition: int
    low: int
    last_stable: int
    high: int


def client_config(bootstrap_servers: str, timeout_s: float) -> dict:
    """librdkafka settings that fail fast and quietly when the cluster is unreachable."""
    timeout_ms = int(timeout_s * 1000)
    return {
        "bootstrap.servers": bootstrap_servers,
        "socket.timeout.ms": timeout_ms,
        "socket.connection.setup.timeout.ms": timeout_ms,
        "reconnect.backoff.max.ms": 1000,
        # librdkafka logs every failed connect attempt; the raised error says it once.
        "log_level": 0,
    }


def admin_client(bootstrap_servers: str, timeout_s: float) -> AdminClient:
    return AdminClient(client_config(bootstrap_servers, timeout_s))


def topic_partitions(admin: AdminClient, topic: str, bootstrap_servers: str, timeout_s: float) -> list[int]:
    """Partition ids of `topic`; `TopicNotFoundError` / `KafkaUnavailableError` otherwise."""
    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        raise _unavailable(bootstrap_servers, timeout_s, exc) from exc
    if not metadata.brokers:
        raise KafkaUnavailableError(f"Kafka at {bootstrap_servers} returned no brokers within {timeout_s:.0f}s")
    topic_meta = metadata.topics.get(topic)
    if (
        topic_meta is None
        or topic_meta.error is not None
        and topic_meta.error.code()
        in (
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError._UNKNOWN_TOPIC,
        )
    ):
        raise TopicNotFoundError(
            f"topic {topic!r} does not exist on Kafka at {bootstrap_servers}: create it, or fix "
            "the pipeline's 'topic' in the pipelines file"
        )
    if topic_meta.error is not None:
        raise KafkaUnavailableError(
            f"Kafka at {bootstrap_servers}: metadata of topic {topic!r} failed: {topic_meta.error}"
        )
    return sorted(topic_meta.partitions)


def partition_offsets(bootstrap_servers: str, topic: str, timeout_s: float = 10.0) -> list[PartitionOffsets]:
    """Low watermark, last stable offset (read_committed) and high watermark per partition."""
    admin = admin_client(bootstrap_servers, timeout_s)
    partitions = topic_partitions(admin, topic, bootstrap_servers, timeout_s)
    low = _list(
        admin, topic, partitions, OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED, bootstrap_servers, timeout_s
    )
    stable = _list(
        admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED, bootstrap_servers, timeout_s
    )
    high = _list(
        admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED, bootstrap_servers, timeout_s
    )
    return [PartitionOffsets(p, low[p], stable[p], high[p]) for p in partitions]


def ensure_topic(bootstrap_servers: str, topic: str, partitions: int, timeout_s: float = 10.0) -> bool:
    """Create `topic` with `partitions` partitions if missing; True when it was created."""
    admin = admin_client(bootstrap_servers, timeout_s)
    try:
        topic_partitions(admin, topic, bootstrap_servers, timeout_s)
        return False
    except TopicNotFoundError:
        pass
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    try:
        futures[topic].result(timeout=timeout_s)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise _unavailable(bootstrap_servers, timeout_s, exc) from exc
    return True


def _list(
    admin: AdminClient,
    topic: str,
    partitions: list[int],
    spec: OffsetSpec,
    isolation: IsolationLevel,
    bootstrap_servers: str,
    timeout_s: float,
) -> dict[int, int]:
    request = {TopicPartition(topic, p): spec for p in partitions}
    futures = admin.list_offsets(request, isolation_level=isolation, request_timeout=timeout_s)
    result = {}
    for tp, future in futures.items():
        try:
            result[tp.partition] = future.result(timeout=timeout_s).offset
        except KafkaException as exc:
            raise _unavailable(bootstrap_servers, timeout_s, exc) from exc
    return result


def _unavailable(bootstrap_servers: str, timeout_s: float, exc: Exception) -> KafkaUnavailableError:
    return KafkaUnavailableError(
        f"Kafka at {bootstrap_servers} did not answer within {timeout_s:.0f}s ({exc}). Check that "
        "the brokers run and KAFKA2PG_BOOTSTRAP_SERVERS is right."
    )
