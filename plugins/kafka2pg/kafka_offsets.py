"""What the Kafka cluster says about a topic: partitions, low watermarks, LSO, high watermarks.

Thin confluent-kafka AdminClient calls; client errors are translated into kafka2pg errors here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from kafka2pg.exceptions import (
    ConfigError,
    ConsumerGroupRefusedError,
    KafkaAuthenticationError,
    KafkaRequestError,
    KafkaUnavailableError,
    TopicNotFoundError,
)
from kafka2pg.kafka_config import KafkaLike, kafka_config, scrubbed

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
        with configuration_checked(kafka):
            super().__init__({**client_config(kafka, timeout_s), "error_cb": self.connection_errors.append})

    def why(self) -> list[KafkaError]:
        self.poll(0.5)  # the error callbacks are served by poll
        return self.connection_errors


@contextmanager
def configuration_checked(kafka: KafkaLike) -> Iterator[None]:
    """Creating a librdkafka client: a configuration it refuses (an unknown property, a value of
    the wrong kind, a SASL login without its password) is a `ConfigError`, not a traceback."""
    try:
        yield
    except KafkaException as exc:
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if error is None or error.code() != KafkaError._INVALID_ARG:
            raise
        raise ConfigError(
            f"librdkafka refuses the Kafka client configuration for {kafka}: {scrubbed(kafka, error.str())}. Fix the "
            "pipeline's Kafka connection (its extra) or KAFKA2PG_KAFKA_CONFIG (README, Connections)",
            cluster=str(kafka),
        ) from None


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


@dataclass(frozen=True)
class TopicRetention:
    """The topic settings that decide when unread records disappear."""

    compacted: bool
    deletes: bool
    retention_ms: int | None
    retention_bytes: int | None


# What a broker without topic IDs (before Kafka 2.8) or a client that did not read one reports.
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


class TopicAdmin:
    """Questions about one topic through one client: a step that asks several (the offsets, the
    topic's ID, its retention) sets up one connection to the cluster, not one per question (with
    SASL and TLS, each set-up is a handshake). Each question reads the topic's metadata afresh.
    The client is made at the first question: a configuration librdkafka refuses fails there."""

    def __init__(self, kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> None:
        self.kafka, self.topic, self.timeout_s = kafka, topic, timeout_s
        self.admin: AdminClient | None = None

    def _ask(self) -> tuple[AdminClient, str, KafkaLike, float]:
        """Before each question but the first: the connection errors reported while an earlier one
        was answered are not this one's (a failure names what it met, or the client's start did)."""
        if self.admin is None:
            self.admin = admin_client(self.kafka, self.timeout_s)
        elif isinstance(self.admin, _Admin):
            self.admin.poll(0)
            self.admin.connection_errors.clear()
        return self.admin, self.topic, self.kafka, self.timeout_s

    def offsets(self) -> list[PartitionOffsets]:
        """Low watermark, last stable offset (read_committed) and high watermark per partition."""
        admin, topic, kafka, timeout_s = self._ask()
        partitions = topic_partitions(admin, topic, kafka, timeout_s)
        low = _list(admin, topic, partitions, OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED, kafka, timeout_s)
        stable = _list(admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED, kafka, timeout_s)
        high = _list(admin, topic, partitions, OffsetSpec.latest(), IsolationLevel.READ_UNCOMMITTED, kafka, timeout_s)
        return [PartitionOffsets(p, low[p], stable[p], high[p]) for p in partitions]

    def offsets_for_times(self, timestamp_ms: int) -> dict[int, int]:
        """Per partition, the first offset whose record timestamp is >= `timestamp_ms`.

        A partition with no such record maps to its high watermark (the offset the next record
        will get), so `[offsets_for_times(t0), offsets_for_times(t1))` is the window [t0, t1).
        A time before 1970 is searched as 1970's first instant: Kafka's record timestamps are not
        negative, and it refuses a negative search time or reads -1 and -2 as latest and earliest.
        """
        admin, topic, kafka, timeout_s = self._ask()
        spec = OffsetSpec.for_timestamp(max(timestamp_ms, 0))
        partitions = topic_partitions(admin, topic, kafka, timeout_s)
        found = _list(admin, topic, partitions, spec, IsolationLevel.READ_COMMITTED, kafka, timeout_s)
        missing = [p for p, offset in found.items() if offset < 0]
        if missing:
            high = _list(admin, topic, missing, OffsetSpec.latest(), IsolationLevel.READ_COMMITTED, kafka, timeout_s)
            found.update(high)
        return found

    def topic_id(self) -> str | None:
        """The topic's ID (KIP-516), as Kafka's tools print it: a topic deleted and recreated under
        the same name gets a new one. None when the cluster has none to give."""
        admin, topic, kafka, timeout_s = self._ask()
        topic_partitions(admin, topic, kafka, timeout_s)  # a missing topic: TopicNotFoundError, as everywhere
        try:
            future = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout_s)[topic]
            described = _answer(future, f"describing topic {topic!r}", kafka, timeout_s, admin, topic)
        except KafkaException as exc:
            raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
        # librdkafka prints base64, Kafka's tools (`kafka-topics.sh --describe`) its URL-safe form.
        found = str(described.topic_id or "").replace("+", "-").replace("/", "_")
        return None if found in ("", _NO_TOPIC_ID) else found

    def retention(self) -> TopicRetention:
        """cleanup.policy, retention.ms and retention.bytes of the topic (-1 means unlimited -> None)."""
        admin, topic, kafka, timeout_s = self._ask()
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


def partition_offsets(kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> list[PartitionOffsets]:
    """Low watermark, last stable offset (read_committed) and high watermark per partition."""
    return TopicAdmin(kafka, topic, timeout_s).offsets()


def partition_bounds(
    kafka: KafkaLike, topic: str, partition: int, isolation: str, timeout_s: float = 10.0
) -> tuple[int, int]:
    """One partition's low watermark and its end for `isolation`: the last stable offset for
    read_committed, the high watermark for read_uncommitted."""
    admin = admin_client(kafka, timeout_s)
    low = _list(admin, topic, [partition], OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED, kafka, timeout_s)
    level = IsolationLevel.READ_COMMITTED if isolation == "read_committed" else IsolationLevel.READ_UNCOMMITTED
    end = _list(admin, topic, [partition], OffsetSpec.latest(), level, kafka, timeout_s)
    return low[partition], end[partition]


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


def topic_id(kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> str | None:
    """The topic's ID (`TopicAdmin.topic_id`)."""
    return TopicAdmin(kafka, topic, timeout_s).topic_id()


def topic_retention(kafka: KafkaLike, topic: str, timeout_s: float = 10.0) -> TopicRetention:
    """The topic's retention settings (`TopicAdmin.retention`)."""
    return TopicAdmin(kafka, topic, timeout_s).retention()


def offsets_for_times(kafka: KafkaLike, topic: str, timestamp_ms: int, timeout_s: float = 10.0) -> dict[int, int]:
    """Per partition, the first offset at or after a time (`TopicAdmin.offsets_for_times`)."""
    return TopicAdmin(kafka, topic, timeout_s).offsets_for_times(timestamp_ms)


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
            raise ConsumerGroupRefusedError.refused(group, topic, scrubbed(kafka, error.str())) from exc
        raise _unavailable(kafka, timeout_s, exc, _why(admin), topic=topic) from exc
    failed = [tp for tp in result.topic_partitions if tp.error]
    if failed:
        detail = scrubbed(kafka, "; ".join(f"{topic}[{tp.partition}]: {tp.error}" for tp in failed))
        if all(tp.error.code() in _GROUP_REFUSALS for tp in failed):
            raise ConsumerGroupRefusedError.refused(group, topic, detail)
        error = next(tp.error for tp in failed if tp.error.code() not in _GROUP_REFUSALS)
        what = f"setting consumer group {group}'s offsets: {detail}"
        raise _unavailable(kafka, timeout_s, what, topic=topic, error=error)


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
    KafkaError.SASL_AUTHENTICATION_FAILED: "refused the client's credentials",
    KafkaError._SSL: "failed the TLS handshake",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "refused the client access to the topic (an ACL)",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "refused the client access to the cluster (an ACL)",
}


def refusal(errors: list[KafkaError]) -> str | None:
    """What a client's reported connection errors say about a refusal (credentials, TLS), if any."""
    for error in errors:
        refused = _REFUSALS.get(error.code())
        if refused is None and "bad certificate" in error.str():
            refused = "refused the client's certificate"
        if refused is None and "certificate verify failed" in error.str():
            # A failed verification of the broker's certificate can surface as a transport error.
            refused = "failed the TLS handshake"
        if refused is not None:
            return refused
    return None


def _unavailable(
    kafka: KafkaLike,
    timeout_s: float,
    cause: Exception | str,
    errors: list[KafkaError] | None = None,
    *,
    topic: str | None = None,
    partition: int | None = None,
    error: KafkaError | None = None,
) -> KafkaUnavailableError | KafkaAuthenticationError | KafkaRequestError:
    """The error for a request that failed: a refusal (credentials, TLS) when librdkafka reported
    one (`errors`, from the client's error callback, or `error`: the request's own, by default the
    one `cause` carries); a request refused as invalid or unsupported (not retried); an error Kafka
    answered with; else a cluster that did not answer (the last two retryable)."""
    if error is None and isinstance(cause, KafkaException) and cause.args and isinstance(cause.args[0], KafkaError):
        error = cause.args[0]
    for reported in [*(errors or []), *([error] if error is not None else [])]:
        refused = refusal([reported])
        if refused is not None:
            return KafkaAuthenticationError.refused(str(kafka), refused, scrubbed(kafka, reported.str()), topic=topic)
    said = scrubbed(kafka, str(cause))  # librdkafka's words may quote a property's value
    if error is None or error.code() in _NO_ANSWER:
        return KafkaUnavailableError.no_answer(str(kafka), timeout_s, said, topic=topic, partition=partition)
    detail = f"{error.name()} ({scrubbed(kafka, error.str())})" if isinstance(cause, KafkaException) else said
    if error.code() in _INVALID_REQUESTS:
        return KafkaRequestError.refused(str(kafka), detail, topic=topic, partition=partition)
    if error.code() < 0:  # librdkafka's own codes are negative, the protocol's positive
        return KafkaUnavailableError.client_failed(str(kafka), detail, topic=topic, partition=partition)
    return KafkaUnavailableError.answered(str(kafka), detail, topic=topic, partition=partition)


# librdkafka's codes for a request that got no answer: no connection, no broker, no time left.
_NO_ANSWER = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE,
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._DESTROY,
    KafkaError._WAIT_COORD,
    KafkaError._WAIT_CACHE,
    KafkaError._NODE_UPDATE,
    KafkaError._FAIL,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
}
# A request refused as malformed or unsupported (by librdkafka before sending it, or by the broker):
# sending it again cannot help.
_INVALID_REQUESTS = {
    KafkaError._INVALID_ARG,
    KafkaError._NOT_IMPLEMENTED,
    KafkaError.INVALID_REQUEST,
    KafkaError.UNSUPPORTED_VERSION,
}
