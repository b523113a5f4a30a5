"""Reading the records of bounded offset ranges with librdkafka (confluent-kafka).

One rule for every read of planned offsets: the stage job's read inside a Spark task
(`read_ranges`, Arrow record batches for the chunk writer, without a trip through the JVM), the
gate's witness count (`count_range`), the audit (`read_offsets`), the raw key, value and headers
of quarantined records (`raw_records_at`) and the time-to-data-loss probe (`first_timestamps`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from kafka2pg.exceptions import KafkaAuthenticationError, KafkaUnavailableError, RetentionLossError
from kafka2pg.kafka_config import KafkaLike, scrubbed
from kafka2pg.kafka_offsets import _unavailable, client_config, configuration_checked, partition_bounds, refusal
from kafka2pg.planner import OffsetRange, describe_ranges

log = logging.getLogger(__name__)

Isolation = Literal["read_committed", "read_uncommitted"]

# The Arrow types of the columns Spark's Kafka source gives (KAFKA_COLUMNS), in its order.
RECORD_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
    ]
)


class RangeReader:
    """A consumer of one topic that reads half-open offset ranges, at most one per partition at
    a time, by assignment (no group membership, nothing committed).

    A partition's range is done at its first record at or beyond the range's end, or at an end of
    partition at or beyond it: offsets inside a range without a record (transaction markers,
    aborted records under read_committed, compaction) are skipped, as Spark's Kafka source skips
    them. An end of partition before the range's end, which a lagging replica or a new leader can
    report for a moment, is checked with the partition's leader: if the leader has the offsets,
    the read goes on; if it has not (the partition was truncated or recreated, or the range was
    asked beyond its end), `short="raise"` raises RetentionLossError and `short="stop"` ends the
    range where the leader's partition ends. An offset below the low watermark is a
    RetentionLossError; a refusal (credentials, TLS, an ACL), KafkaAuthenticationError at once;
    `timeout_s` without any record or end of partition, KafkaUnavailableError.
    """

    def __init__(
        self,
        kafka: KafkaLike,
        topic: str,
        timeout_s: float,
        *,
        isolation: Isolation = "read_committed",
        group_id: str = "kafka2pg-reader",
        fetch: dict | None = None,
    ) -> None:
        self.kafka, self.topic, self.timeout_s, self.isolation = kafka, topic, timeout_s, isolation
        self.errors: list[KafkaError] = []
        with configuration_checked(kafka):
            self.consumer = Consumer(
                {
                    **client_config(kafka, timeout_s),
                    "error_cb": self.errors.append,
                    "group.id": group_id,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "isolation.level": isolation,
                    "enable.partition.eof": True,
                    # An offset below the low watermark must fail, not silently jump to the end.
                    "auto.offset.reset": "error",
                    **(fetch or {}),
                }
            )

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *_) -> None:
        self.consumer.close()

    def messages(
        self,
        ranges: Sequence[OffsetRange],
        short: Literal["raise", "stop"] = "raise",
        chunk: int = 10_000,
        *,
        first_only: bool = False,
    ) -> Iterator[list[Message]]:
        """The records inside `ranges` (one range per partition), in offset order per partition,
        in lists of at most `chunk`; with `first_only`, each partition's first record only."""
        ranges = [r for r in ranges if r.size]
        ends = {r.partition: r.end for r in ranges}
        if len(ends) != len(ranges):
            raise ValueError(f"one range per partition at a time: {describe_ranges(ranges)}")
        consumer = self.consumer
        # assign() replaces whatever a read left early had assigned, and drops what it prefetched.
        consumer.assign([TopicPartition(self.topic, r.partition, r.start) for r in ranges])
        idle_since = time.monotonic()
        while ends:
            batch = consumer.consume(num_messages=chunk, timeout=0.2)
            if not batch:
                self._idle([r for r in ranges if r.partition in ends], idle_since)
                continue
            idle_since = time.monotonic()
            self.errors.clear()  # the cluster answers: an earlier connection error has passed
            kept = []
            for message in batch:
                partition = message.partition()
                end = ends.get(partition)
                if end is None:
                    continue  # already done: records fetched beyond its range
                error = message.error()
                if error is None and message.offset() < end:
                    kept.append(message)
                    if first_only:
                        del ends[partition]
                        consumer.incremental_unassign([TopicPartition(self.topic, partition)])
                    continue
                if error is not None and error.code() != KafkaError._PARTITION_EOF:
                    raise self._error(partition, ranges, error)
                if error is None or message.offset() >= end or self._ends_short(partition, ranges, message, short):
                    del ends[partition]
                    consumer.incremental_unassign([TopicPartition(self.topic, partition)])
                else:  # the leader holds the range: its answer is progress, however long it took
                    idle_since = time.monotonic()
            if kept:
                yield kept

    def _idle(self, unread: list[OffsetRange], idle_since: float) -> None:
        """Nothing arrived: a refusal fails at once, silence only after timeout_s."""
        refused = refusal(self.errors)
        if refused is None and time.monotonic() - idle_since <= self.timeout_s:
            return
        cause = f"while reading {self.topic} {describe_ranges(unread)}"
        partition = unread[0].partition if len(unread) == 1 else None
        raise _unavailable(self.kafka, self.timeout_s, cause, self.errors, topic=self.topic, partition=partition)

    def _ends_short(
        self, partition: int, ranges: Sequence[OffsetRange], eof: Message, short: Literal["raise", "stop"]
    ) -> bool:
        """An end of partition (`eof`) at an offset before the range's end. False when the leader holds
        the offsets (a replica or leader lagging for a moment: a new end of partition follows when
        the reported end moves on); True (stop) or RetentionLossError (raise) when it does not."""
        (planned,), reported = [r for r in ranges if r.partition == partition], eof.offset()
        low, end = partition_bounds(self.kafka, self.topic, partition, self.isolation, self.timeout_s)
        if end >= planned.end and low <= reported:
            return False
        if short == "stop":
            return reported >= end
        raise RetentionLossError(
            f"reading {self.topic}[{partition}] on Kafka at {self.kafka}: the partition now holds offsets [{low}, "
            f"{end}) ({self.isolation}), not all of the planned {describe_ranges([planned])}: it was truncated, "
            "recreated or its records deleted since the batch was planned",
            cluster=str(self.kafka),
            topic=self.topic,
            partition=partition,
            offsets=[planned],
        )

    def _error(self, partition: int, ranges: Sequence[OffsetRange], error: KafkaError) -> Exception:
        planned = [r for r in ranges if r.partition == partition]
        evidence = {"cluster": str(self.kafka), "topic": self.topic, "partition": partition, "offsets": planned}
        where = f"{self.topic}[{partition}]"
        if error.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
            return KafkaAuthenticationError.refused(
                str(self.kafka),
                f"refused to let the client read {where} (an ACL: READ on the topic)",
                scrubbed(self.kafka, error.str()),
                topic=self.topic,
            )
        if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
            return RetentionLossError(
                f"reading {where} on Kafka at {self.kafka}: the offsets {describe_ranges(planned)} are below the "
                f"low watermark now ({error.str()}): records expired while kafka2pg was reading them. Run again: "
                "the plan step reports exactly which offsets were lost.",
                **evidence,
            )
        said = scrubbed(self.kafka, str(error))  # librdkafka's words may quote a property's value
        return KafkaUnavailableError(f"Kafka at {self.kafka}: reading {where}: {said}", cause=said, **evidence)


def read_ranges(
    kafka: KafkaLike,
    topic: str,
    ranges: Sequence[OffsetRange],
    group_id: str,
    timeout_s: float,
    rows_per_batch: int = 5_000,
    bytes_per_batch: int = 64 << 20,
) -> Iterator[pa.RecordBatch]:
    """The committed records of a batch's planned `ranges` (read_committed, RangeReader's rule
    with `short="raise"`), in offset order per partition, as record batches of RECORD_SCHEMA of
    at most `rows_per_batch` rows, closed as soon as their keys and values reach
    `bytes_per_batch` bytes. A task holds one batch's records and decoded values while it writes
    them: 20,000 rows held about 30 MB more per task than 5,000, for the same CPU."""
    columns: tuple[list, ...] = ([], [], [], [], [])
    partitions, offsets, timestamps, keys, values = columns
    size = 0
    with RangeReader(kafka, topic, timeout_s, group_id=group_id, fetch=READER_FETCH) as reader:
        for messages in reader.messages(ranges):
            for message in messages:
                partitions.append(message.partition())
                offsets.append(message.offset())
                timestamps.append(min(max(message.timestamp()[1], _TIMESTAMP_FLOOR_MS), _TIMESTAMP_CEILING_MS) * 1000)
                key, value = message.key(), message.value()
                keys.append(key)
                values.append(value)
                size += (len(key) if key else 0) + (len(value) if value else 0)
                if size >= bytes_per_batch or len(offsets) >= rows_per_batch:
                    yield _record_batch(columns)
                    size = 0
    if offsets:
        yield _record_batch(columns)


# The stage reader's fetching: answers within 10 ms once records are there (the broker's default
# wait is 500 ms), up to 1 MB a partition per fetch, and a prefetch queue of 1 MB or 5,000
# records per partition (librdkafka's defaults, 64 MB and 100,000, held about 110 MB more per
# task reading 3 partitions, and 4 MB held about 25 MB more, for the same speed; librdkafka
# also caps a fetch response at the queue's size, and a broker still returns one record batch
# larger than that). A full queue postpones the next fetch by fetch.queue.backoff.ms: 1 s by
# default, 10 ms here.
READER_FETCH = {
    "fetch.wait.max.ms": 10,
    "fetch.message.max.bytes": 1 << 20,
    "queued.max.messages.kbytes": 1 << 10,
    "queued.min.messages": 5_000,
    "fetch.queue.backoff.ms": 10,
}


# 10000-01-01T00:00:00Z in ms. A Kafka timestamp is a 64-bit count of ms (brokers before Kafka
# 4.0 accept any by default, and a negative one still), too large for Arrow's microseconds past
# about year ±294,000: later ones are read as this instant, earlier ones as the floor's
# (0000-12-31T23:59:59.999Z), which, like any outside years 1-9999, the chunk writer refuses
# (kafka2pg.chunk_writer.refuse_unreadable_timestamps).
_TIMESTAMP_CEILING_MS = 253_402_300_800_000
_TIMESTAMP_FLOOR_MS = -62_135_596_800_001


def _record_batch(columns: tuple[list, ...]) -> pa.RecordBatch:
    batch = pa.RecordBatch.from_arrays(
        [pa.array(column, field.type) for column, field in zip(columns, RECORD_SCHEMA, strict=True)],
        schema=RECORD_SCHEMA,
    )
    for column in columns:
        column.clear()
    return batch


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
    counts = []
    for isolation in ("read_committed", "read_uncommitted"):
        with RangeReader(kafka, topic, timeout_s, isolation=isolation) as reader:
            messages = reader.messages([OffsetRange(partition, start, end)], short="stop")
            counts.append(sum(len(chunk) for chunk in messages))
    return RangeCount(*counts)


def read_offsets(
    kafka: KafkaLike, topic: str, partition: int, ranges: list[tuple[int, int]], timeout_s: float
) -> Iterator[tuple[int, int]]:
    """(offset, timestamp ms) of every committed record in the half-open `ranges` of one
    partition, ascending; streams. A range beyond the partition's end stops at its end."""
    with RangeReader(kafka, topic, timeout_s) as reader:
        for start, end in ranges:
            for chunk in reader.messages([OffsetRange(partition, start, end)], short="stop"):
                yield from ((message.offset(), message.timestamp()[1]) for message in chunk)


def first_timestamps(
    kafka: KafkaLike, topic: str, ranges: Sequence[OffsetRange], timeout_s: float = 10.0
) -> dict[int, int]:
    """Timestamp (ms) of the first committed record in each range (one per partition), by
    partition; a range without one is left out. One consumer for all the partitions (a consumer
    each cost about 50 ms per partition), each partition unassigned once its first record came."""
    found: dict[int, int] = {}
    with RangeReader(kafka, topic, timeout_s) as reader:
        for chunk in reader.messages(ranges, short="stop", first_only=True):
            for message in chunk:
                found.setdefault(message.partition(), message.timestamp()[1])
    return found


Headers = list[tuple[bytes, bytes | None]]


@dataclass(frozen=True)
class RawRecord:
    key: bytes | None
    value: bytes | None
    headers: Headers  # (key as UTF-8 bytes, value), in order


def raw_records(
    kafka: KafkaLike, topic: str, partition: int, offsets: list[int], timeout_s: float
) -> dict[int, RawRecord]:
    """The committed records at `offsets` of one partition as Kafka holds them, by offset;
    records gone since are left out."""
    wanted = set(offsets)
    found: dict[int, RawRecord] = {}
    if not wanted:
        return found
    with RangeReader(kafka, topic, timeout_s) as reader:
        for chunk in reader.messages([OffsetRange(partition, min(wanted), max(wanted) + 1)], short="stop"):
            for message in chunk:
                if message.offset() in wanted:
                    found[message.offset()] = RawRecord(message.key(), message.value(), _headers(message))
    return found


def _headers(message: Message) -> Headers:
    """A record's headers, keys as bytes; none when a header's key is not UTF-8.

    confluent-kafka decodes each header key as UTF-8 without checking the result: for a key that
    is not UTF-8 it returns a list holding a (NULL, value) pair with the decoding error pending,
    and any use of that pair crashes the process. A call from C through the vectorcall protocol
    checks a result returned with an error pending and raises SystemError; the interpreter's
    specialised call of a method, once the call site is warm, does not check it. So the method is
    called from C (`map`), once per message (the broken list stays cached in the message)."""
    try:
        (pairs,) = map(Message.headers, (message,))
    except (SystemError, UnicodeDecodeError):  # the latter from a client that checks: still kept
        log.warning(
            "record at partition %s offset %s has a header key that is not UTF-8: its headers are not kept in "
            "quarantine (its key and value are)",
            message.partition(),
            message.offset(),
        )
        return []
    return [(key.encode("utf-8", "surrogateescape"), value) for key, value in pairs or ()]


def raw_records_at(
    kafka: KafkaLike, topic: str, offsets: Mapping[int, Iterable[int]], timeout_s: float
) -> dict[tuple[int, int], RawRecord]:
    """`raw_records` of several partitions ({partition: offsets}), by (partition, offset)."""
    return {
        (partition, offset): record
        for partition, wanted in offsets.items()
        for offset, record in raw_records(kafka, topic, partition, list(wanted), timeout_s).items()
    }
