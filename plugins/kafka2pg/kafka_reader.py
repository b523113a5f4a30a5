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
from kafka2pg.kafka_offsets import _unavailable, client_config
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
) -> Iterator[pa.RecordBatch]:
    """The committed records of `ranges` (read_committed), in offset order per partition, as
    record batches of at most `rows_per_batch` rows.

    A partition is done at its first record at or beyond its range's end, or at its end of
    partition (the last stable offset, which the plan put at or beyond the end): offsets inside a
    range without a record (transaction markers, aborted records, compaction) are skipped, as
    Spark's source skips them. An offset below the low watermark fails (RetentionLossError), as
    does `timeout_s` without any progress (KafkaUnavailableError).
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
                    if error.code() == KafkaError._PARTITION_EOF and message.offset() >= end:
                        _finish(consumer, topic, ends, partition)
                        continue
                    raise _read_error(kafka, topic, partition, ranges, error, message.offset())
                offset = message.offset()
                if offset >= end:
                    _finish(consumer, topic, ends, partition)
                    continue
                partitions.append(partition)
                offsets.append(offset)
                timestamps.append(message.timestamp()[1] * 1000)
                keys.append(message.key())
                values.append(message.value())
            if len(offsets) >= rows_per_batch:
                yield _record_batch(columns)
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


def _read_error(
    kafka: KafkaConfig, topic: str, partition: int, ranges: Sequence[OffsetRange], error: KafkaError, error_offset: int
) -> Exception:
    planned = [r for r in ranges if r.partition == partition]
    evidence = {"cluster": str(kafka), "topic": topic, "partition": partition, "offsets": planned}
    where = f"{topic}[{partition}]"
    if error.code() == KafkaError._PARTITION_EOF:
        # The last stable offset was at or beyond the planned end when the batch was planned and
        # never moves back: the partition was truncated or recreated since.
        return RetentionLossError(
            f"reading {where} on Kafka at {kafka}: the partition now ends at offset {error_offset}, before the "
            f"end of the planned offsets {describe_ranges(planned)}",
            **evidence,
        )
    if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        return RetentionLossError(
            f"reading {where} on Kafka at {kafka}: the planned offsets "
            f"{describe_ranges(planned)} are below the low watermark now ({error.str()})",
            **evidence,
        )
    return KafkaUnavailableError(f"Kafka at {kafka}: reading {where}: {error}", cause=str(error), **evidence)
