"""The Kafka read of the stage job inside a Spark task: a batch's planned ranges, read with
librdkafka (confluent-kafka) as Arrow record batches of KAFKA_COLUMNS.

Runs inside Spark's Python workers, beside the chunk writer that admits and COPYs the records:
the records go from the broker to the writer in one process, without a trip through the JVM.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kafka2pg.exceptions import KafkaAuthenticationError, KafkaUnavailableError, RetentionLossError
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.kafka_offsets import _unavailable, client_config, partition_offsets
from kafka2pg.planner import OffsetRange, describe_ranges

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


def read_ranges(
    kafka: KafkaConfig,
    topic: str,
    ranges: Sequence[OffsetRange],
    group_id: str,
    timeout_s: float,
    rows_per_batch: int = 20_000,
    bytes_per_batch: int = 64 << 20,
) -> Iterator[pa.RecordBatch]:
    """The committed records of `ranges` (read_committed), in offset order per partition, as
    record batches of at most `rows_per_batch` rows, closed as soon as their keys and values
    reach `bytes_per_batch` bytes.

    A partition is done at its first record at or beyond its range's end, or at its end of
    partition (the last stable offset, which the plan put at or beyond the end): offsets inside a
    range without a record (transaction markers, aborted records, compaction) are skipped, as
    Spark's source skips them. An end of partition before the range's end, which a lagging
    replica or a new leader can report for a moment, is checked with the partition's leader: if it
    confirms (the partition was truncated or recreated since the plan) or an offset is below the
    low watermark, RetentionLossError; `timeout_s` without any progress, KafkaUnavailableError; a
    refusal (credentials, TLS), KafkaAuthenticationError at once.
    """
    ranges = [r for r in ranges if r.size]
    if not ranges:
        return
    errors: list[KafkaError] = []
    consumer = Consumer(
        {
            **client_config(kafka, timeout_s),
            "error_cb": errors.append,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": 10,
            "fetch.message.max.bytes": 4 << 20,
        }
    )
    ends = {r.partition: r.end for r in ranges}
    columns: tuple[list, ...] = ([], [], [], [], [])
    partitions, offsets, timestamps, keys, values = columns
    size = 0
    try:
        consumer.assign([TopicPartition(topic, r.partition, r.start) for r in ranges])
        idle_since = time.monotonic()
        while ends:
            messages = consumer.consume(num_messages=10_000, timeout=0.2)
            if not messages:
                where = describe_ranges([r for r in ranges if r.partition in ends])
                error = _unavailable(kafka, timeout_s, f"while reading {topic} {where}", errors, topic=topic)
                # A refusal (credentials, TLS) is final at once; silence, only after timeout_s.
                if isinstance(error, KafkaAuthenticationError) or time.monotonic() - idle_since > timeout_s:
                    raise error
                continue
            idle_since = time.monotonic()
            for message in messages:
                partition = message.partition()
                end = ends.get(partition)
                if end is None:
                    continue  # already done: records fetched beyond its range
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise _read_error(kafka, topic, partition, ranges, error)
                    if message.offset() >= end:
                        _finish(consumer, topic, ends, partition)
                    else:  # a new end of partition follows when the reported end moves on
                        _check_still_there(kafka, topic, partition, ranges, message.offset(), timeout_s)
                    continue
                offset = message.offset()
                if offset >= end:
                    _finish(consumer, topic, ends, partition)
                    continue
                partitions.append(partition)
                offsets.append(offset)
                timestamps.append(message.timestamp()[1] * 1000)
                key, value = message.key(), message.value()
                keys.append(key)
                values.append(value)
                size += (len(key) if key else 0) + (len(value) if value else 0)
                if size >= bytes_per_batch or len(offsets) >= rows_per_batch:
                    yield _record_batch(columns)
                    size = 0
        if offsets:
            yield _record_batch(columns)
    finally:
        consumer.close()


def _finish(consumer: Consumer, topic: str, ends: dict[int, int], partition: int) -> None:
    del ends[partition]
    consumer.incremental_unassign([TopicPartition(topic, partition)])


def _record_batch(columns: tuple[list, ...]) -> pa.RecordBatch:
    batch = pa.RecordBatch.from_arrays(
        [pa.array(column, field.type) for column, field in zip(columns, RECORD_SCHEMA, strict=True)],
        schema=RECORD_SCHEMA,
    )
    for column in columns:
        column.clear()
    return batch


def _check_still_there(
    kafka: KafkaConfig, topic: str, partition: int, ranges: Sequence[OffsetRange], reported: int, timeout_s: float
) -> None:
    """An end of partition at `reported`, before the range's end: the leader's last stable offset
    (as the plan read it) tells a replica or leader lagging for a moment from a partition that
    was truncated or recreated since the plan (RetentionLossError)."""
    (planned,) = [r for r in ranges if r.partition == partition]
    offsets = next(o for o in partition_offsets(kafka, topic, timeout_s) if o.partition == partition)
    if offsets.last_stable < planned.end or offsets.low > reported:
        raise RetentionLossError(
            f"reading {topic}[{partition}] on Kafka at {kafka}: the partition now holds offsets [{offsets.low}, "
            f"{offsets.last_stable}) (read_committed), not all of the planned {describe_ranges([planned])}: it was "
            "truncated, recreated or its records deleted since the batch was planned",
            cluster=str(kafka),
            topic=topic,
            partition=partition,
            offsets=[planned],
        )


def _read_error(
    kafka: KafkaConfig, topic: str, partition: int, ranges: Sequence[OffsetRange], error: KafkaError
) -> Exception:
    planned = [r for r in ranges if r.partition == partition]
    evidence = {"cluster": str(kafka), "topic": topic, "partition": partition, "offsets": planned}
    where = f"{topic}[{partition}]"
    if error.code() in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED):
        return KafkaAuthenticationError.refused(
            str(kafka), f"refused to let the client read {where} (an ACL: READ on the topic)", error.str(), topic=topic
        )
    if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        return RetentionLossError(
            f"reading {where} on Kafka at {kafka}: the planned offsets "
            f"{describe_ranges(planned)} are below the low watermark now ({error.str()})",
            **evidence,
        )
    return KafkaUnavailableError(f"Kafka at {kafka}: reading {where}: {error}", cause=str(error), **evidence)
