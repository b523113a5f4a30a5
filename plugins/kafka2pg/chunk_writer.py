"""The Spark task's side of staging: admit each Kafka record (kafka2pg.admission) and COPY the
task's chunk into the staging table, isolating any row PostgreSQL still refuses.

Runs inside Spark's Python workers (`mapInArrow`), so it imports only what an executor has.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from kafka2pg.admission import (
    MAX_YEAR,
    MIN_YEAR,
    AdmittedBatch,
    RecordDecoder,
    decoder_for,
    index_mask,
    unreadable_instants,
)
from kafka2pg.config import Pipeline
from kafka2pg.copy_binary import HEADER, TRAILER, copy_rows
from kafka2pg.database import isolate_refused, session_settings, statement_refusals
from kafka2pg.exceptions import BatchStateError, ConfigError
from kafka2pg.lifecycle import BatchState
from kafka2pg.migrations import PROVENANCE, RAW, column_types, retyped_columns, staging_columns
from kafka2pg.planner import NO_TIMESTAMP_MS
from kafka2pg.withheld_imports import withheld

# What the chunk writer gets from the Kafka reader (kafka2pg.kafka_reader, or Spark's Kafka source
# for kafka_reader: spark), in this order. Not the headers: Spark's Kafka source builds them per
# record at a high price (more than reading and moving the value); the stage step fetches them
# from Kafka for the records that go to quarantine only. Not the topic: a batch reads one.
KAFKA_COLUMNS = ("partition", "offset", "timestamp", "key", "value")
STATS_SCHEMA = (
    "kafka_partition int, records long, quarantined long, min_offset long, max_offset long, refused array<long>"
)

# The PostgreSQL types of the columns a chunk writes around the pipeline's own (staging_table.sql).
_HEAD_TYPES = ("bigint", "integer", "text", "integer", "bigint", "timestamptz")  # batch_id, chunk, PROVENANCE
_TAIL_TYPES = ("bytea", "bytea", "bytea[]", "text")  # RAW, quarantine_reason


class StagingCopy(NamedTuple):
    """The COPY of a pipeline's staging rows (binary format) and the PostgreSQL type of each
    of its columns, in `frame`'s order."""

    statement: sql.Composed
    types: tuple[str, ...]


def staging_copy(pipeline: Pipeline) -> StagingCopy:
    table = sql.Identifier("kafka2pg", pipeline.staging_table)
    columns = sql.SQL(", ").join(map(sql.Identifier, ["batch_id", "chunk", *staging_columns(pipeline)]))
    statement = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT binary)").format(table, columns)
    return StagingCopy(statement, (*_HEAD_TYPES, *(c.type for c in pipeline.columns), *_TAIL_TYPES))


def _refuse_retyped_staging(conn: psycopg.Connection, pipeline: Pipeline, batch_id: int) -> None:
    """A binary COPY carries no types: a staging table `migrate` made again with another type of
    the same width (bigint to double precision, integer to date) would take this job's bytes as
    other values, silently. Refused when the table's types are not this job's pipelines file's."""
    retyped = retyped_columns(pipeline, column_types(conn, "kafka2pg", pipeline.staging_table))
    if retyped:
        raise ConfigError(
            f"pipeline {pipeline.name!r} batch {batch_id}: kafka2pg.{pipeline.staging_table} no longer has the "
            f"column types this stage job was started with ({'; '.join(retyped)}): `migrate` ran with a changed "
            "pipelines file while the job ran. Nothing was staged; the batch stays planned, and a run started with "
            "the pipelines file `migrate` used stages it."
        )


def chunk_writer(database_url: str, pipeline: Pipeline, batch_id: int, epoch: int, topic: str):
    """A mapInArrow function: admit and COPY one Spark partition of `topic` into staging, yield its read stats.

    Each chunk is one transaction that checks the run's claim (batch still `planned`, same
    epoch; FOR SHARE so a newer claim or the `staged` transition waits for it) and replaces
    the chunk's earlier rows under a per-chunk lock, so twin attempts cannot double it.
    """

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        chunk = TaskContext.get().partitionId()
        arrow_without_pandas()
        decoder = decoder_for(pipeline)
        table = sql.Identifier("kafka2pg", pipeline.staging_table)
        copy = staging_copy(pipeline)
        stats: dict[int, list] = {}
        with (
            collector_paused(),
            session_settings(
                psycopg.connect(database_url, client_encoding="UTF8", connect_timeout=10),
                f"kafka2pg chunk writer (batch {batch_id})",
            ) as conn,
            statement_refusals(
                database_url, conn, f"chunk {chunk} of batch {batch_id} was not staged; the batch stays planned"
            ),
        ):
            claim = conn.execute(
                "SELECT state, epoch FROM kafka2pg.batches WHERE batch_id = %s FOR SHARE", (batch_id,)
            ).fetchone()
            if claim is None or tuple(claim) != (BatchState.PLANNED, epoch):
                raise BatchStateError(
                    f"batch {batch_id} is {claim and claim[0]} at epoch {claim and claim[1]}; this attempt "
                    f"(epoch {epoch}) must not write its staging rows",
                    pipeline=pipeline.name,
                    batch_id=batch_id,
                    state=claim and claim[0],
                    epoch=epoch,
                    current_epoch=claim and claim[1],
                )
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"kafka2pg.stage:{batch_id}:{chunk}",)
            )
            conn.execute(sql.SQL("DELETE FROM {} WHERE batch_id = %s AND chunk = %s").format(table), (batch_id, chunk))
            _refuse_retyped_staging(conn, pipeline, batch_id)  # the DELETE's lock keeps the table as checked
            for record_batch in batches:
                if not record_batch.num_rows:
                    continue
                admitted = decoder.admit(record_batch.column("value").to_pylist())
                if pipeline.kafka_reader == "spark":
                    record_batch = undo_julian_rebase(record_batch)
                record_batch, admitted = refuse_unreadable_timestamps(no_timestamp_as_null(record_batch), admitted)
                framed = frame(record_batch, admitted, decoder, batch_id, chunk, topic)
                refused = copy_isolating(conn, copy, framed, into=f"kafka2pg.{pipeline.staging_table}")
                if refused:
                    reasons = {i: f"PostgreSQL refused the row in staging: {message}" for i, message in refused.items()}
                    admitted = admitted.refusing(reasons)
                    framed = frame(record_batch, admitted, decoder, batch_id, chunk, topic)
                    # Now NULLs, raw bytes as bytea and a reason: nothing left to refuse.
                    _copy(conn, copy, framed.take(pa.array(sorted(refused), pa.int64())))
                _accumulate(stats, framed)
        yield pa.RecordBatch.from_pylist(
            [
                {
                    "kafka_partition": p,
                    "records": a[0],
                    "quarantined": a[1],
                    "min_offset": a[2],
                    "max_offset": a[3],
                    "refused": a[4],
                }
                for p, a in stats.items()
            ],
            schema=pa.schema(
                [
                    ("kafka_partition", pa.int32()),
                    ("records", pa.int64()),
                    ("quarantined", pa.int64()),
                    ("min_offset", pa.int64()),
                    ("max_offset", pa.int64()),
                    ("refused", pa.list_(pa.int64())),
                ]
            ),
        )

    return write


UNREADABLE_TIMESTAMP = (
    f"kafka_timestamp: the record's Kafka timestamp is outside years {MIN_YEAR}-{MAX_YEAR}: PostgreSQL would "
    "store it, but client libraries cannot read it back (a producer that sets microseconds or nanoseconds "
    "where Kafka expects milliseconds writes such timestamps)"
)


# Kafka's "no timestamp" (a record of the v0 message format, or one a client wrote without a
# time), in the microseconds both readers hand it over in: the instant 1969-12-31T23:59:59.999Z.
NO_TIMESTAMP_US = NO_TIMESTAMP_MS * 1_000


def no_timestamp_as_null(record_batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record Kafka holds without a timestamp gets a NULL kafka_timestamp, not a date in 1969."""
    stamps = record_batch.column("timestamp")
    missing = pc.equal(stamps.cast(pa.int64()), pa.scalar(NO_TIMESTAMP_US, pa.int64()))
    if not pc.any(missing).as_py():
        return record_batch
    nulled = pc.if_else(missing, pa.scalar(None, stamps.type), stamps)
    position = record_batch.schema.get_field_index("timestamp")
    return record_batch.set_column(position, record_batch.schema.field(position), nulled)


# 1582-10-15T00:00:00Z in microseconds: the first day of the Gregorian calendar.
_GREGORIAN_CUTOVER_US = -12_219_292_800 * 1_000_000
_DAY_US = 86_400 * 1_000_000


def undo_julian_rebase(record_batch: pa.RecordBatch) -> pa.RecordBatch:
    """The Kafka timestamps as Kafka holds them, from Spark's Kafka source. It converts each one
    through `java.sql.Timestamp`, whose calendar is Julian before 1582-10-15: an instant before
    then arrives with its Julian date read as a Gregorian one (1582-10-04 as 1582-09-24, 0001-01-01
    as 0001-01-03). The reverse, exact for a JVM whose default time zone is UTC (the date's days
    are moved, never its time of day)."""
    stamps = record_batch.column("timestamp")
    micros = stamps.cast(pa.int64())
    early = pc.indices_nonzero(pc.less(micros, pa.scalar(_GREGORIAN_CUTOVER_US, pa.int64()))).to_pylist()
    if not early:
        return record_batch
    values = micros.to_pylist()
    for i in early:
        days, time_of_day = divmod(values[i], _DAY_US)
        values[i] = (days + _julian_minus_gregorian_days(days)) * _DAY_US + time_of_day
    fixed = pa.array(values, pa.int64()).cast(stamps.type)
    position = record_batch.schema.get_field_index("timestamp")
    return record_batch.set_column(position, record_batch.schema.field(position), fixed)


def _julian_minus_gregorian_days(days: int) -> int:
    """For the Gregorian date `days` after 1970-01-01: how many days later the same year, month
    and day fall in the Julian calendar (Julian day numbers of both)."""
    year, month = _civil_from_days(days)
    y = year + 4800 - (month <= 2)
    return y // 100 - y // 400 - 38


def _civil_from_days(days: int) -> tuple[int, int]:
    """The proleptic Gregorian year and month of a day count from 1970-01-01, any year."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month


def refuse_unreadable_timestamps(
    record_batch: pa.RecordBatch, admitted: AdmittedBatch
) -> tuple[pa.RecordBatch, AdmittedBatch]:
    """Records whose Kafka timestamp (a provenance column) lies outside years 1-9999 go to
    quarantine, their timestamp NULL; a record admission refused already keeps its reason, the
    timestamp's added. Brokers before Kafka 4.0 accept any timestamp by default."""
    stamps = record_batch.column("timestamp")
    late = unreadable_instants(stamps)
    if not late:
        return record_batch, admitted
    nulled = pc.if_else(index_mask(late, len(stamps)), pa.scalar(None, stamps.type), stamps)
    reasons = {
        i: UNREADABLE_TIMESTAMP if admitted.reasons[i] is None else f"{admitted.reasons[i]}; and {UNREADABLE_TIMESTAMP}"
        for i in late
    }
    position = record_batch.schema.get_field_index("timestamp")
    return record_batch.set_column(position, record_batch.schema.field(position), nulled), admitted.refusing(reasons)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (a Spark task's write), then back
    as it was. Reading, admitting and framing records allocate a few objects per record, none of
    them in a cycle, and each collection they trigger walks every object the worker process
    holds (PySpark's among them): about a third of admission's CPU (bench/README.md). Objects
    are still freed as their last reference goes; only cycles wait for the collector's return."""
    if not gc.isenabled():
        yield
        return
    _freeze_long_lived()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_frozen = False


def _freeze_long_lived() -> None:
    """Once per process, at its first write: move every object it holds (the modules of PySpark,
    pyarrow, psycopg, librdkafka's binding and kafka2pg, not yet a record) out of the collector's
    reach. PySpark's daemon runs a full collection after every task of a reused worker, which
    walked them all each time; objects frozen are still freed as their last reference goes."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()


def arrow_without_pandas() -> None:
    """Let pyarrow settle, for this process, that it has no pandas to look for.

    pyarrow imports pandas on its first conversion of Python values (`pa.array`), to recognise
    pandas objects, and a Spark task here never hands it one: that import cost each task process
    about 0.17 s of CPU and 54 MB (docs/design.md). For that one conversion `import pandas`
    fails, so pyarrow records "no pandas"; `import pandas` works again right after, only
    pyarrow's pandas conversions (`to_pandas`) do not, and no task code uses them. For Spark
    task processes only (the chunk writer's, at each task's start: after the first, pyarrow does
    not look again and this is a one-value conversion), where no other thread imports meanwhile;
    a process that imported pandas already is left as it is.
    """
    if "pandas" in sys.modules:
        return
    with withheld("pandas"):
        pa.array([0], pa.int8())


def frame(
    record_batch: pa.RecordBatch,
    admitted: AdmittedBatch,
    decoder: RecordDecoder,
    batch_id: int,
    chunk: int,
    topic: str,
) -> pa.Table:
    """The staging rows of Kafka records of `topic` and their admission outcomes (`RecordDecoder.admit`), as an
    Arrow table in COPY order.

    An admitted record carries its typed values; a refused one NULLs and its raw key and value,
    with the reason (its headers are added by the stage step, `stage_batch`).
    """
    rows = record_batch.num_rows
    refused = [i for i, reason in enumerate(admitted.reasons) if reason is not None]
    columns: list[pa.Array] = [
        pa.repeat(pa.scalar(batch_id, pa.int64()), rows),
        pa.repeat(pa.scalar(chunk, pa.int32()), rows),
        pa.repeat(pa.scalar(topic, pa.string()), rows),
        record_batch.column("partition"),
        record_batch.column("offset"),
        record_batch.column("timestamp"),
        *admitted.columns,
    ]
    keys, values, headers = ([None] * rows for _ in RAW)
    if refused:
        indices = pa.array(refused, pa.int64())  # typed: from a Python list, `take` imports pandas
        raw_keys = record_batch.column("key").take(indices).to_pylist()
        raw_values = record_batch.column("value").take(indices).to_pylist()
        for i, key, value in zip(refused, raw_keys, raw_values, strict=True):
            keys[i], values[i] = key, value
    columns += [pa.array(keys, pa.binary()), pa.array(values, pa.binary()), pa.array(headers, pa.string())]
    columns.append(pa.array(admitted.reasons, pa.string()))
    names = ["batch_id", "chunk", *PROVENANCE, *(r.name for r in decoder.rules), *RAW, "quarantine_reason"]
    return pa.Table.from_arrays(columns, names=names)


def copy_isolating(conn: psycopg.Connection, copy: StagingCopy, table: pa.Table, *, into: str) -> dict[int, str]:
    """COPY `table` (into the table named `into`); the rows PostgreSQL refuses on data are left
    out (see `isolate_refused`)."""

    def write(start: int, stop: int) -> None:
        _copy(conn, copy, table.slice(start, stop - start))

    return isolate_refused(conn, write, table.num_rows, table=into)


# PostgreSQL cannot read the binary rows at all: the encoder's defect, never a record's.
_UNREADABLE = (psycopg.errors.InvalidBinaryRepresentation, psycopg.errors.BadCopyFileFormat)


def _copy(conn: psycopg.Connection, copy: StagingCopy, table: pa.Table) -> None:
    rows = copy_rows(table, copy.types)  # binary: no text for PostgreSQL to parse, no time zone to mind
    try:
        with conn.transaction(), conn.cursor() as cur, cur.copy(copy.statement) as stream:
            stream.write(HEADER)
            stream.write(memoryview(rows))
            stream.write(TRAILER)
    except _UNREADABLE as exc:
        # Not a data error to isolate: quarantining the rows would hide a defect behind records.
        raise RuntimeError(
            f"PostgreSQL could not read the binary COPY rows kafka2pg encoded ({exc.sqlstate}: {exc}); "
            "this is a defect in kafka2pg, not in the records: the write stops instead of quarantining them"
        ) from exc


def _accumulate(stats: dict[int, list], framed: pa.Table) -> None:
    """Per Kafka partition: records, quarantined (non-null reason), min and max offset, and the
    offsets quarantined here, summed over the chunk's batches. With compute functions, one
    partition at a time (a task's batch holds a few): Arrow's group-by imports pyarrow's dataset
    module, and with it pandas."""
    partitions, offsets = framed.column("kafka_partition"), framed.column("kafka_offset")
    quarantined = pc.is_valid(framed.column("quarantine_reason"))
    for partition in pc.unique(partitions).to_pylist():
        mine = pc.equal(partitions, pa.scalar(partition, pa.int32()))
        own_offsets = pc.filter(offsets, mine)
        bounds = pc.min_max(own_offsets).as_py()
        acc = stats.setdefault(partition, [0, 0, bounds["min"], bounds["max"], []])
        acc[0] += len(own_offsets)
        acc[1] += pc.sum(pc.and_(mine, quarantined)).as_py()
        acc[2] = min(acc[2], bounds["min"])
        acc[3] = max(acc[3], bounds["max"])
    refused = framed.filter(quarantined)
    for partition, offset in zip(
        refused.column("kafka_partition").to_pylist(), refused.column("kafka_offset").to_pylist(), strict=True
    ):
        stats[partition][4].append(offset)
