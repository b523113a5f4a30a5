"""What the Kafka cluster says about a topic: partitions, low watermarks, LSO, high watermarks.

Thin confluent-kafka AdminClient calls; client errors are translated into kafka2pg errors here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from kafka2pg.exceptions import (
    ConsumerGroupRefusedError,
    KafkaAuthenticationError,
    KafkaUnavailableError,
    RetentionLossError,
    TopicNotFoundError,
)
from kafka2pg.kafka_config import KafkaLike, kafka_config

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PartitionOffsets:
    """Broker offsets of one partition: [low, high), last stable offset for read_committed."""

    partition: int
    low: int
    last_stable: int
    high: int


def client_config(kafka: KafkaLike, timeout_s: float) -> dict:
    """The connection's client properties (SASL, TLS, ...) and librdkafka settings that fail fast
    and quietly when the cluster is unreachable (a property the connection sets wins)."""
    timeout_ms = int(timeout_s * 1000)
    return {
        "socket.timeout.ms": timeout_ms,
        "socket.connection.setup.timeout.ms": timeout_ms,
        "reconnect.backoff.max.ms": 1000,
        # librdkafka logs every failed connect attempt; the raised error says it once.
        "log_level": 0,
        **kafka_config(kafka).confluent(),
    }


class _Admin(AdminClient):
    """An AdminClient that keeps the connection errors librdkafka reports (authentication, TLS):
    a request to a cluster that refuses the client only times out, the cause comes this way."""

    def __init__(self, kafka: KafkaLike, timeout_s: float) -> None:
        self.connection_errors: list[KafkaError] = []
        super().__init__({**client_config(kafka, timeout_s), "error_cb": self.connection_errors.append})

    def why(self) -> list[KafkaError]:
        self.poll(0.5)  # the error callbacks are served by poll
        return self.connection_errors


def admin_client(kafka: KafkaLike, timeout_s: float) -> AdminClient:
    return _Admin(kafka, timeout_s)


def topic_partitions(admin: AdminClient, topic: str, kafka: KafkaLike, timeout_s: float) -> list[int]:
    """Partition ids of `topic`; `TopicNotFoundError` / `KafkaUnavailableError` otherwise."""
    try:
        metadata = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
    if not metadata.brokers:
        raise KafkaUnavailableError(
            f"Kafka at {kafka} returned no brokers within {timeout_s:.0f}s",
            cluster=str(kafka),
            timeout_s=timeout_s,
            topic=topic,
        )
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
            f"topic {topic!r} does not exist on Kafka at {kafka}: create it, or fix "
            "the pipeline's 'topic' in the pipelines file",
            topic=topic,
            cluster=str(kafka),
        )
    if topic_meta.error is not None:
        raise KafkaUnavailableError(
            f"Kafka at {kafka}: metadata of topic {topic!r} failed: {topic_meta.error}",
            cluster=str(kafka),
            topic=topic,
            cause=str(topic_meta.error),
        )
    return sorted(topic_meta.partitions)


def partition_offsets(kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> list[PartitionOffsets]:
    """Low watermark, last stable offset (read_committed) and high watermark per partition."""
    admin = admin_client(kafka, timeout_s)
    partitions = topic_partitions(admin, topic, kafka, timeout_s)
    low = _list(admin, topic, partitions, OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED, kafka, timeout_s)
    stable = _list(admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED, kafka, timeout_s)
    high = _list(admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED, kafka, timeout_s)
    return [PartitionOffsets(p, low[p], stable[p], high[p]) for p in partitions]


def ensure_topic(kafka: KafkaLike, topic: str, partitions: int, timeout_s: float = 10.0) -> bool:
    """Create `topic` with `partitions` partitions if missing; True when it was created."""
    admin = admin_client(kafka, timeout_s)
    try:
        topic_partitions(admin, topic, kafka, timeout_s)
        return False
    except TopicNotFoundError:
        pass
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    try:
        _answer(futures[topic], f"creating topic {topic!r}", kafka, timeout_s, admin, topic)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
    return True


@dataclass(frozen=True)
class TopicRetention:
    """The topic settings that decide when unread records disappear."""

    compacted: bool
    deletes: bool
    retention_ms: int | None
    retention_bytes: int | None


def topic_retention(kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> TopicRetention:
    """cleanup.policy, retention.ms and retention.bytes of `topic` (-1 means unlimited -> None)."""
    admin = admin_client(kafka, timeout_s)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    try:
        future = admin.describe_configs([resource], request_timeout=timeout_s)[resource]
        entries = _answer(future, f"reading the configs of topic {topic!r}", kafka, timeout_s, admin, topic)
    except KafkaException as exc:
        raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
    policy = entries["cleanup.policy"].value or "delete"

    def limit(name: str) -> int | None:
        value = int(entries[name].value)
        return None if value < 0 else value

    return TopicRetention("compact" in policy, "delete" in policy, limit("retention.ms"), limit("retention.bytes"))


def offsets_for_times(kafka: KafkaLike, topic: str, timestamp_ms: int, timeout_s: float = 10.0) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is >= `timestamp_ms`.

    A partition with no such record maps to its high watermark (the offset the next record
    will get), so `[offsets_for_times(t0), offsets_for_times(t1))` is the window [t0, t1).
    """
    admin = admin_client(kafka, timeout_s)
    partitions = topic_partitions(admin, topic, kafka, timeout_s)
    found = _list(
        admin,
        topic,
        partitions,
        OffsetSpec.for_timestamp(timestamp_ms),
        IsolationLevel.READ_COMMITTED,
        kafka,
        timeout_s,
    )
    missing = [p for p, offset in found.items() if offset < 0]
    if missing:
        high = _list(admin, topic, missing, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED, kafka, timeout_s)
        found.update(high)
    return found


@dataclass(frozen=True)
class RangeCount:
    """What a plain consumer finds in [start, end) of one partition."""

    committed: int
    data_records: int


def count_range(
    kafka: KafkaLike, topic: str, partition: int, start: int, end: int, timeout_s: float = 10.0
) -> RangeCount:
    """Count committed records and all data records (aborted included) in [start, end).

    Two passes (read_committed, read_uncommitted) with a consumer of its own, outside Spark: the
    witness the gap accounting compares the stage's read with. It is independent of Spark's
    Kafka source; for the default librdkafka reader it is another read by the same library.
    """
    counts = [
        sum(1 for _ in read_offsets(kafka, topic, partition, [(start, end)], isolation, timeout_s))
        for isolation in ("read_committed", "read_uncommitted")
    ]
    return RangeCount(*counts)


def record_timestamp(
    kafka: KafkaLike, topic: str, partition: int, offset: int, end: int, timeout_s: float = 10.0
) -> int | None:
    """Timestamp (ms) of the first committed record in [offset, end), or None if there is none."""
    records = read_offsets(kafka, topic, partition, [(offset, end)], "read_committed", timeout_s)
    first = next(records, None)
    records.close()
    return None if first is None else first[1]


def read_offsets(
    kafka: KafkaLike,
    topic: str,
    partition: int,
    ranges: list[tuple[int, int]],
    isolation: str,
    timeout_s: float,
) -> Iterator[tuple[int, int]]:
    """(offset, timestamp ms) of every record in the half-open `ranges`, ascending; streams."""
    for message in _read_messages(kafka, topic, partition, ranges, isolation, timeout_s):
        yield message.offset(), message.timestamp()[1]


def record_headers(
    kafka: KafkaLike, topic: str, partition: int, offsets: list[int], timeout_s: float
) -> dict[int, list[tuple[bytes, bytes | None]]]:
    """The headers (key as UTF-8 bytes, value) of the committed records at `offsets`, by offset;
    records without headers, or gone since, are left out."""
    wanted = set(offsets)
    found: dict[int, list[tuple[bytes, bytes | None]]] = {}
    ranges = [(min(wanted), max(wanted) + 1)] if wanted else []
    for message in _read_messages(kafka, topic, partition, ranges, "read_committed", timeout_s):
        if message.offset() in wanted and message.headers():
            found[message.offset()] = [
                (key.encode("utf-8", "surrogateescape"), value) for key, value in message.headers()
            ]
    return found


def commit_group_offsets(
    kafka: KafkaLike, group: str, topic: str, offsets: dict[int, int], timeout_s: float = 10.0
) -> None:
    """Set consumer group `group`'s offsets on `topic` to `offsets` (partition -> next offset to read)
    with the admin API, within `timeout_s` (a consumer's synchronous commit would wait for a group
    coordinator without end). Kafka accepts it only while the group has no active member."""
    admin = admin_client(kafka, timeout_s)
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p, o) for p, o in sorted(offsets.items())])
    (future,) = admin.alter_consumer_group_offsets([request], request_timeout=timeout_s).values()
    try:
        result = _answer(future, f"setting consumer group {group}'s offsets", kafka, timeout_s, admin, topic)
    except KafkaException as exc:
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if error is not None and error.code() in _GROUP_REFUSALS:
            raise ConsumerGroupRefusedError.refused(group, topic, error.str()) from exc
        raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
    failed = [tp for tp in result.topic_partitions if tp.error]
    if failed:
        detail = "; ".join(f"{topic}[{tp.partition}]: {tp.error}" for tp in failed)
        if all(tp.error.code() in _GROUP_REFUSALS for tp in failed):
            raise ConsumerGroupRefusedError.refused(group, topic, detail)
        raise _unavailable(kafka, timeout_s, f"setting consumer group {group}'s offsets: {detail}", topic=topic)


# The broker's answers to an offset commit that mean "not this group, not this client": retrying
# cannot help. Others (a coordinator loading or moving, a timeout, a disconnect) may pass.
_GROUP_REFUSALS = {
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.NON_EMPTY_GROUP,
    KafkaError.GROUP_SUBSCRIBED_TO_TOPIC,
    KafkaError.FENCED_INSTANCE_ID,
    KafkaError.INVALID_GROUP_ID,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
}


def _read_messages(
    kafka: KafkaLike,
    topic: str,
    partition: int,
    ranges: list[tuple[int, int]],
    isolation: str,
    timeout_s: float,
) -> Iterator[Message]:
    errors: list[KafkaError] = []
    consumer = Consumer(
        {
            **client_config(kafka, timeout_s),
            "error_cb": errors.append,
            "group.id": "kafka2pg-reader",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            "enable.partition.eof": True,
            "fetch.message.max.bytes": 1_048_576,
            # An offset below the low watermark must fail, not silently jump to the end.
            "auto.offset.reset": "error",
        }
    )
    try:
        for start, end in ranges:
            consumer.assign([TopicPartition(topic, partition, start)])
            yield from _consume_until(consumer, kafka, topic, partition, (start, end), timeout_s, errors)
    finally:
        consumer.close()


def _consume_until(
    consumer: Consumer,
    kafka: KafkaLike,
    topic: str,
    partition: int,
    offsets: tuple[int, int],
    timeout_s: float,
    errors: list[KafkaError],
) -> Iterator[Message]:
    # consume() waits its whole timeout unless num_messages arrive: poll in short slices and
    # give up only after timeout_s without any message or end-of-partition event.
    where, end = f"{topic}[{partition}]", offsets[1]
    evidence = {"cluster": str(kafka), "topic": topic, "partition": partition, "offsets": offsets}
    idle_since = time.monotonic()
    while True:
        messages = consumer.consume(num_messages=5000, timeout=0.2)
        if not messages:
            if time.monotonic() - idle_since > timeout_s:
                raise _unavailable(kafka, timeout_s, f"while reading {where}", errors, topic=topic, partition=partition)
            continue
        idle_since = time.monotonic()
        for message in messages:
            error = message.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:
                return
            if error is not None and error.code() == KafkaError._AUTO_OFFSET_RESET:
                raise RetentionLossError(
                    f"reading {where} on Kafka at {kafka}: the requested offsets are below the low "
                    f"watermark now ({error.str()}); records expired while kafka2pg was reading them. Run again: "
                    "the plan step reports exactly which offsets were lost.",
                    **evidence,
                )
            if error is not None:
                raise KafkaUnavailableError(f"Kafka at {kafka}: reading {where}: {error}", cause=str(error), **evidence)
            if message.offset() >= end:
                return
            yield message


def _list(
    admin: AdminClient,
    topic: str,
    partitions: list[int],
    spec: OffsetSpec,
    isolation: IsolationLevel,
    kafka: KafkaLike,
    timeout_s: float,
) -> dict[int, int]:
    request = {TopicPartition(topic, p): spec for p in partitions}
    futures = admin.list_offsets(request, isolation_level=isolation, request_timeout=timeout_s)
    result = {}
    for tp, future in futures.items():
        try:
            what = f"listing the offsets of {topic}[{tp.partition}]"
            result[tp.partition] = _answer(future, what, kafka, timeout_s, admin, topic, tp.partition).offset
        except KafkaException as exc:
            raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic, partition=tp.partition) from exc
    return result


def _answer(
    future: Future[T],
    what: str,
    kafka: KafkaLike,
    timeout_s: float,
    admin: AdminClient,
    topic: str,
    partition: int | None = None,
) -> T:
    """The result of an AdminClient future. Waiting out `timeout_s` raises a bare TimeoutError,
    without a message, when the cluster is unreachable: translated here; KafkaException passes on."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError as exc:
        raise _unavailable(kafka, timeout_s, f"while {what}", _why(admin), topic=topic, partition=partition) from exc


def _why(client: object) -> list[KafkaError]:
    return client.why() if isinstance(client, _Admin) else []


# librdkafka error codes that mean the cluster refuses this client: retrying cannot help.
_REFUSALS = {
    KafkaError._AUTHENTICATION: "refused the client's credentials",
    KafkaError._SSL: "failed the TLS handshake",
}


def _unavailable(
    kafka: KafkaLike,
    timeout_s: float,
    cause: Exception | str,
    errors: list[KafkaError] | None = None,
    *,
    topic: str | None = None,
    partition: int | None = None,
) -> KafkaUnavailableError | KafkaAuthenticationError:
    """The error for a cluster that did not answer: a refusal (credentials, TLS) when librdkafka
    reported one (`errors`, from the client's error callback), else unavailable (retryable)."""
    for error in errors or []:
        refused = _REFUSALS.get(error.code())
        if refused is None and "bad certificate" in error.str():
            refused = "refused the client's certificate"
        if refused is None and "certificate verify failed" in error.str():
            # A failed verification of the broker's certificate can surface as a transport error.
            refused = "failed the TLS handshake"
        if refused is not None:
            return KafkaAuthenticationError.refused(str(kafka), refused, error.str(), topic=topic)
    return KafkaUnavailableError.no_answer(str(kafka), timeout_s, str(cause), topic=topic, partition=partition)
