"""Read + stage (DESIGN step 2): Spark reads exactly a batch's planned ranges and stages them.

Every Spark task COPYs its rows in one transaction that first deletes its own chunk, so a
task retry or a whole-job retry replaces rows instead of duplicating them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from psycopg import Connection, sql
from py4j.protocol import Py4JError, Py4JNetworkError
from pyspark.errors import PySparkException
from pyspark.sql import Row, SparkSession

from kafka2pg.admission import strict_only_note
from kafka2pg.batch_store import Batch, load_claimed, staging_lost, transition
from kafka2pg.chunk_writer import KAFKA_COLUMNS, STATS_SCHEMA, chunk_writer
from kafka2pg.config import KAFKA_READERS, Pipeline, Settings, keep_log_options, stage_jvm_conf
from kafka2pg.database import describe, hide_password, refused_by_hba, refuses, transaction
from kafka2pg.exceptions import (
    BatchStateError,
    ConfigError,
    DatabaseRefusedError,
    DatabaseUnavailableError,
    Kafka2PgError,
    KafkaAuthenticationError,
    KafkaRequestError,
    KafkaUnavailableError,
    OffsetRegressionError,
    RetentionLossError,
    SparkSessionLost,
    StageInterrupted,
    StatementTimeoutError,
)
from kafka2pg.kafka_config import kafka_config
from kafka2pg.kafka_offsets import TopicAdmin
from kafka2pg.kafka_reader import raw_records_at, read_ranges
from kafka2pg.lifecycle import Action, BatchState, stage_action
from kafka2pg.locations import COMMAND, PACKAGE_DIR, preview_first
from kafka2pg.planner import BatchPlan, OffsetRange, describe_ranges
from kafka2pg.raw_bytes import fill_raw_bytes, staging_place
from kafka2pg.rows import staged_counts
from kafka2pg.scratch import jvm_temporary_files_in

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionRead:
    """What Spark actually read from one partition of a batch."""

    partition: int
    records: int
    quarantined: int
    min_offset: int | None
    max_offset: int | None
    refused: tuple[int, ...] = ()  # offsets quarantined while staging: their headers are fetched


@dataclass(frozen=True)
class StageResult:
    batch_id: int
    state: BatchState
    reads: tuple[PartitionRead, ...]
    message: str
    ranges: tuple[OffsetRange, ...] = ()  # the batch's planned ranges

    @property
    def records_read(self) -> int:
        return sum(r.records for r in self.reads)

    @property
    def quarantined(self) -> int:
        return sum(r.quarantined for r in self.reads)


def kafka_read_options(settings: Settings, plan: BatchPlan) -> dict[str, str]:
    """Spark Kafka source options reading exactly the plan's ranges, committed records only, with
    the connection's client properties (SASL, TLS) mapped to the Java client's (`KafkaConfig`)."""
    ranges = plan.ranges
    return {
        **settings.kafka.spark_options(),
        "assign": json.dumps({plan.topic: [r.partition for r in ranges]}),
        "startingOffsets": json.dumps({plan.topic: {str(r.partition): r.start for r in ranges}}),
        "endingOffsets": json.dumps({plan.topic: {str(r.partition): r.end for r in ranges}}),
        "kafka.isolation.level": "read_committed",
        "failOnDataLoss": "true",
        # Every range is already written when we read it, so a fetch never needs to wait for data.
        # Spark asks for the partition's offset range after each poll, and the broker answers a
        # connection's requests in order: with the default 500 ms, that request waits behind the
        # consumer's prefetch at the end of each partition (a 300k read to the head: 3.1 s -> 1.8 s).
        "kafka.fetch.max.wait.ms": "10",
        # Spark also asks for that offset range after each poll: 500 records per poll (the default)
        # meant two ListOffsets requests per 500 records read. Bigger polls and fetches halve the
        # broker's CPU for a 1M backlog (5.0 -> 2.4 core-seconds) at a few MB per consumer.
        "kafka.max.poll.records": "5000",
        "kafka.max.partition.fetch.bytes": str(4 << 20),
        # Spark pools its consumers by group id and partition. Its default, a new group id per read,
        # made every batch build a consumer per partition (about half the JVM's fixed cost of a
        # batch); a stable one reuses them, positioned where the previous batch ended, as a streaming
        # query does. Only `assign` is used and nothing is committed, so the group stays empty.
        # Spark warns about it on every read; its log4j2 file (log4j2.properties) filters that out.
        "kafka.group.id": kafka_group_id(plan.pipeline),
    }


def kafka_group_id(pipeline_name: str) -> str:
    """The consumer group id of a pipeline's Spark reads (never committed to: see kafka_read_options)."""
    return f"kafka2pg-stage-{pipeline_name}"


def stage_batch(
    spark: SparkSession,
    settings: Settings,
    pipeline: Pipeline,
    batch_id: int,
    epoch: int | None = None,
    *,
    stop: threading.Event | None = None,
    kafka: TopicAdmin | None = None,
) -> StageResult:
    """Read the batch's ranges from Kafka and (re)write its staging rows; idempotent.

    `epoch` is the run's claim on the batch (None: the current one); every write checks it,
    so a zombie attempt fenced off by a newer run stops before changing anything. `stop`
    set (SIGTERM) means: give up before marking the batch staged (`StageInterrupted`).
    `kafka`: the client the caller asks its topic with (a run's, for all its plans and
    stages: each new client is a connection set up, a TLS handshake on a secured cluster),
    else one for this stage.
    """
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        done = nothing_to_stage(conn, pipeline, batch)
        if done is not None:
            return done
        batch = replace(batch, state=BatchState.PLANNED)  # planned, or staged before and its staging lost: read
        conn.execute(_staging_sql("DELETE FROM {} WHERE batch_id = %s", pipeline), (batch_id,))
        # Check results of earlier staging rows (lost in a crash after validation) judge rows
        # that are gone; the quality gate reuses stored results of a batch sent back to it. The
        # report file of those rows is forgotten with them (the next validation writes one).
        conn.execute("DELETE FROM kafka2pg.batch_checks WHERE batch_id = %s", (batch_id,))
        conn.execute("DELETE FROM kafka2pg.quality_results WHERE batch_id = %s", (batch_id,))
        conn.execute(
            "UPDATE kafka2pg.batches SET report_path = NULL WHERE batch_id = %s AND report_path IS NOT NULL",
            (batch_id,),
        )
    epoch = batch.epoch
    log.info(
        "pipeline=%s batch_id=%s epoch=%s reading %s offsets: %s",
        pipeline.name,
        batch_id,
        epoch,
        batch.plan.record_budget,
        describe_ranges(batch.plan.ranges),
    )
    if slow := strict_only_note(pipeline):
        log.warning("pipeline=%s %s", pipeline.name, slow)
    kafka = kafka or TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    _check_topic_identity(kafka, pipeline, batch, read=False)
    rows = _read_and_write(spark, settings, pipeline, batch, stop) if batch.plan.ranges else []
    reads = _merge_stats(rows, batch)
    _raise_if_stopped(stop, pipeline, batch_id)
    # The headers of the records refused while staging (their key and value are staged), read
    # again from Kafka by offset before any lock is taken; records without headers are left alone.
    refused = {r.partition: r.refused for r in reads if r.refused}
    headers = {
        k: r
        for k, r in raw_records_at(settings.kafka, pipeline.topic, refused, settings.kafka_timeout_s).items()
        if r.headers
    }
    _check_topic_identity(kafka, pipeline, batch, read=True)  # after every read of the batch's records
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        _check_stageable(batch, pipeline)
        if stage_action(batch.state) is Action.DONE:  # a concurrent attempt holding the same claim finished first
            return StageResult(batch_id, batch.state, reads, f"batch {batch_id} was {batch.state} by another attempt")
        _check_staged(conn, pipeline, batch, reads)
        fill_raw_bytes(conn, staging_place(pipeline), batch_id, headers)
        with conn.cursor() as cur:
            cur.executemany(
                "UPDATE kafka2pg.batch_partitions SET records_read = %s, min_offset_read = %s,"
                " max_offset_read = %s WHERE batch_id = %s AND kafka_partition = %s",
                [(r.records, r.min_offset, r.max_offset, batch_id, r.partition) for r in reads],
            )
        total = sum(r.records for r in reads)
        quarantined = sum(r.quarantined for r in reads)
        # Again at the last moment: a SIGTERM while the refused records' headers were fetched or
        # this transaction ran still leaves the batch planned (this transaction rolls back).
        _raise_if_stopped(stop, pipeline, batch_id)
        transition(conn, batch, BatchState.STAGED, records_read=total, rows_staged=total, rows_quarantined=quarantined)
    message = f"batch {batch_id}: read {total} records, {quarantined} to quarantine"
    return StageResult(batch_id, BatchState.STAGED, reads, message, batch.plan.ranges)


def _check_topic_identity(kafka: TopicAdmin, pipeline: Pipeline, batch: Batch, *, read: bool) -> None:
    """Before the read: the topic is still the one the batch was planned in. Again after it and
    the refused records' header lookup: a topic deleted and recreated meanwhile has another ID (a
    topic's ID is never given again), so the same ID then proves every record read came from the
    planned topic. Not asked
    for a batch with nothing to read, or planned where Kafka gave no topic ID."""
    if batch.plan.topic_id is None or not batch.plan.ranges:
        return
    now = kafka.topic_id()
    if batch.plan.in_another_topic(now):
        raise OffsetRegressionError.recreated_since_planned(
            pipeline.name, pipeline.topic, batch.batch_id, batch.plan.topic_id, now, read=read
        )


def _read_and_write(
    spark: SparkSession,
    settings: Settings,
    pipeline: Pipeline,
    batch: Batch,
    stop: threading.Event | None,
) -> list:
    writer = chunk_writer(settings.database_url, pipeline, batch.batch_id, batch.epoch, batch.plan.topic)
    ignored = kafka_config(settings.kafka).ignored_by(pipeline.kafka_reader)
    if ignored:
        log.warning(
            "pipeline=%s batch=%s kafka_reader=%s reads without the connection's Kafka properties %s (%s)",
            pipeline.name,
            batch.batch_id,
            pipeline.kafka_reader,
            ", ".join(ignored),
            "Java-only: set kafka_reader: spark to use them"
            if pipeline.kafka_reader == "librdkafka"
            else "no Java equivalent known: give it prefixed `kafka.` under its Java name",
        )
    try:
        if pipeline.kafka_reader == "spark":
            return _read_with_spark_source(spark, settings, batch, writer)
        return _read_in_tasks(spark, settings, pipeline, batch, writer)
    except (PySparkException, Py4JError, ConnectionError) as exc:  # ConnectionError: py4j's, the JVM gone
        _raise_if_stopped(stop, pipeline, batch.batch_id)
        # A chunk writer refuses to write once the claim is lost: report that, not a Java trace.
        with transaction(settings.database_url) as conn:
            current = load_claimed(conn, pipeline, batch.batch_id, batch.epoch)
        if current.state is not BatchState.PLANNED:
            why = (
                f"a newer run, a ledger reset, an undo or `{COMMAND} abandon` abandoned it"
                if current.state is BatchState.ABANDONED
                else "a concurrent attempt finished first"
            )
            raise BatchStateError(
                f"batch {batch.batch_id} became {current.state} while this attempt was staging it ({why}); this "
                "attempt wrote nothing that counts",
                pipeline=pipeline.name,
                batch_id=batch.batch_id,
                state=current.state,
                epoch=batch.epoch,
            ) from None
        if isinstance(exc, (Py4JNetworkError, ConnectionError)):  # the JVM is gone: no Spark error to read
            raise SparkSessionLost.staging(pipeline.name, batch.batch_id) from exc
        retyped = _python_message(str(exc), ConfigError.__name__)
        if retyped is not None:  # a chunk writer's refusal of a staging table made again under it
            raise ConfigError(retyped) from None
        timed_out = _python_message(str(exc), StatementTimeoutError.__name__)
        if timed_out is not None:  # a chunk writer's statement: its message says what to change
            raise StatementTimeoutError(
                f"pipeline {pipeline.name!r} batch {batch.batch_id}, staging: {timed_out}",
                pipeline=pipeline.name,
                batch_id=batch.batch_id,
            ) from None
        raise _kafka_error(str(exc), settings, pipeline, batch) or exc from None


def _read_with_spark_source(spark: SparkSession, settings: Settings, batch: Batch, writer) -> list:
    """Spark's Kafka source (the Java client) reads the ranges; the chunk writer gets them as Arrow."""
    try:
        raw = spark.read.format("kafka").options(**kafka_read_options(settings, batch.plan)).load()
    except PySparkException as exc:
        if "Failed to find data source: kafka" not in str(exc):
            raise
        raise ConfigError(
            "Spark has no Kafka source on its classpath (org.apache.spark:spark-sql-kafka-0-10_2.13 and its "
            "dependencies), and the pipeline's kafka_reader is spark. The DAG passes the comma-separated jars in "
            f"KAFKA2PG_SPARK_JARS, else those resolved under $KAFKA2PG_STATE_DIR/jars/spark (`{COMMAND} stack "
            "install` resolves them), else spark.jars.packages; on a cluster, install them or set "
            "spark.jars.packages in the pipeline's spark_conf. Nothing was staged."
        ) from None
    frame = raw.select(*KAFKA_COLUMNS)
    context = spark.sparkContext
    if context.master.startswith("local"):
        # One chunk (Spark task, COPY, PostgreSQL connection) per task slot, not per Kafka
        # partition: each task has a fixed cost (a Python worker's run, a connection, a claim
        # check) that six small tasks on two slots paid three times over. coalesce() merges Kafka
        # partitions without a shuffle; a chunk's id (its task's partition) stays the same on a
        # task retry. Only in local mode: on a cluster, defaultParallelism can be 2 before the
        # executors register.
        frame = frame.coalesce(max(1, context.defaultParallelism))
    return frame.mapInArrow(writer, STATS_SCHEMA).collect()


def _read_in_tasks(spark: SparkSession, settings: Settings, pipeline: Pipeline, batch: Batch, writer) -> list:
    """Each Spark task reads its share of the ranges with librdkafka (kafka2pg.kafka_reader) and hands
    the records to the chunk writer in the same Python process: nothing crosses the JVM.

    A task (a chunk) reads whole ranges; their split over the tasks depends only on the ranges and
    the number of tasks, so a retried task reads and replaces exactly its own chunk. In local mode
    one task per slot (as `_read_with_spark_source` coalesces), on a cluster one per range.
    """
    context = spark.sparkContext
    ranges = batch.plan.ranges
    local = context.master.startswith("local")
    shares = chunk_shares(ranges, max(1, context.defaultParallelism) if local else len(ranges))
    kafka, topic, group = settings.kafka, batch.plan.topic, kafka_group_id(pipeline.name)
    timeout_s = max(settings.kafka_timeout_s, READ_STALL_S)

    def task(share: Iterator[list[OffsetRange]]) -> Iterator[Row]:
        (mine,) = share  # one share per task
        for stats in writer(read_ranges(kafka, topic, mine, group, timeout_s)):
            yield from (Row(**row) for row in stats.to_pylist())

    return context.parallelize(shares, len(shares)).mapPartitions(task).collect()


def chunk_shares(ranges: Sequence[OffsetRange], chunks: int) -> list[list[OffsetRange]]:
    """`ranges` split into `chunks` non-empty shares of about equal records (each in partition
    order): the largest range first, each to the share with the fewest records so far."""
    shares: list[list[OffsetRange]] = [[] for _ in range(min(chunks, len(ranges)))]
    for r in sorted(ranges, key=lambda r: (-r.size, r.partition)):
        min(shares, key=lambda share: sum(x.size for x in share)).append(r)
    return [sorted(share, key=lambda r: r.partition) for share in shares]


# How long a Spark task's Kafka read may go without any record or end of partition before it
# fails as "Kafka did not answer" (at least; KAFKA2PG_KAFKA_TIMEOUT_S if longer): a busy broker or
# a task slot starved for CPU can pause a read for seconds without anything being wrong.
READ_STALL_S = 60.0


def _kafka_error(text: str, settings: Settings, pipeline: Pipeline, batch: Batch) -> Exception | None:
    """The kafka2pg error for a Spark job that failed on Kafka (from either reader), or None."""
    where = f"pipeline {pipeline.name!r} batch {batch.batch_id}"
    text = settings.kafka.scrub(text)  # a client's words may quote a property's value
    refused = next((n for n in _JAVA_REFUSALS if n in text), None)
    if refused is not None:
        cause = _java_message(text, refused)
        return KafkaAuthenticationError(
            f"{where}: Spark's Kafka client was refused by Kafka at {settings.kafka} ({refused}: {cause}). Check "
            "the pipeline's Kafka connection (its sasl.* and ssl.* properties, as mapped for Java: README, "
            "Connections). Nothing was staged; the batch stays planned.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            topic=pipeline.topic,
            cluster=str(settings.kafka),
            refusal=refused,
            cause=cause,
        )
    lost = _python_message(text, RetentionLossError.__name__)
    if "Some data may have been lost" in text or lost is not None:
        return RetentionLossError(
            f"{where}: Kafka no longer holds some of its planned offsets ({describe_ranges(batch.plan.ranges)}): "
            "they were deleted (retention, delete-records or a recreated topic) after the batch was planned"
            f"{f' ({lost})' if lost else ''}. Nothing was promoted. The next run abandons this batch and plans from "
            "the ledger's heads, which reports the lost offsets (or records them as a gap under on_retention_loss: "
            "skip).",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            topic=pipeline.topic,
            offsets=batch.plan.ranges,
        )
    if _SPARK_RECORD_REFUSAL in text:  # Spark's Kafka source cannot turn a record into a row
        return Kafka2PgError(
            f"{where}: Spark's Kafka source cannot read a record of it: {_java_message(text, _SPARK_RECORD_REFUSAL)} "
            "The default reader, kafka_reader: librdkafka, reads such a record and quarantines it (its Kafka "
            "timestamp named) while the rest lands: set it for this pipeline if its Kafka connection needs no "
            "Java-only property, or move the partition's ledger head past it with "
            f"{preview_first(f'reset --pipeline {pipeline.name} --partition <p> --to-offset <offset + 1>')} (recorded "
            "in kafka2pg.ledger_resets; "
            "the records skipped are not loaded). Nothing was staged; the batch stays planned.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            topic=pipeline.topic,
        )
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", text)
    if missing is not None:
        return ConfigError(
            f"{where}: the Spark executors' Python has no module {missing.group(1)!r}. The stage job's tasks import "
            "pyspark, pyarrow, psycopg, msgspec, PyYAML and confluent-kafka (for kafka_reader: librdkafka, the "
            "default): install them where spark.pyspark.python points on every worker (README, Run on your cluster). "
            "Nothing was staged; the batch stays planned."
        )
    # A Spark task's own kafka2pg error (the librdkafka reader), by its name in the Python traceback.
    for error in (KafkaAuthenticationError, KafkaRequestError, KafkaUnavailableError):
        message = _python_message(text, error.__name__)
        if message is not None:
            return error(
                f"{where}: {message} Nothing was staged; the batch stays planned.",
                pipeline=pipeline.name,
                batch_id=batch.batch_id,
                topic=pipeline.topic,
                cluster=str(settings.kafka),
            )
    locked = re.search(r"psycopg\.errors\.LockNotAvailable: ([^\n]*)", text)
    if locked is not None:  # a lock_timeout a DBA set for the role or the database
        return StatementTimeoutError(
            f"{where}: a Spark task's statement waited for a lock longer than PostgreSQL's lock_timeout "
            f"({hide_password(locked.group(1).strip(), settings.database_url)}): another session held a lock on "
            "the staging table or the batch (a long transaction, a VACUUM FULL, a DBA's lock). Nothing was "
            "staged; the batch stays planned and the retry stages it again. If it recurs, unset lock_timeout "
            "for kafka2pg's role (ALTER ROLE … RESET lock_timeout) or find the session holding the lock.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
        )
    connecting = _TASK_CONNECT.search(text)
    if connecting is not None:  # a chunk writer's own connection, after the driver's had worked
        return _task_connect_error(" ".join(connecting.group(1).split()), settings, pipeline, batch)
    lost_db = _LOST_DATABASE.search(text)
    if lost_db is not None:  # a chunk writer's connection ended under it (terminated, a restart)
        return DatabaseUnavailableError(
            f"{where}: a Spark task lost its PostgreSQL connection "
            f"({lost_db.group(1)}: {hide_password(lost_db.group(2).strip(), settings.database_url)}). "
            "Nothing was staged; the batch stays planned and the retry (or the next run) stages it again.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            database=describe(settings.database_url),
        )
    return None


# A psycopg error that ends a task's connection, in the Python traceback of a failed Spark task.
_LOST_DATABASE = re.compile(
    r"psycopg\.(?:errors\.)?(AdminShutdown|CrashShutdown|IdleInTransactionSessionTimeout|CannotConnectNow"
    r"|OperationalError): ([^\n]*)"
)


# psycopg's error for a connection it could not open (refused, a name that does not resolve, no
# answer within connect_timeout: packets a firewall drops), with libpq's continuation lines (a tab
# first; the Java trace's lines after it start with a tab and "at ").
_TASK_CONNECT = re.compile(
    r"psycopg\.(?:errors\.ConnectionTimeout: |OperationalError: (?=connection failed|failed to resolve host))"
    r"([^\n]*(?:\n\t(?!at )[^\n]*)*)"
)


def _task_connect_error(
    said: str, settings: Settings, pipeline: Pipeline, batch: Batch
) -> DatabaseRefusedError | DatabaseUnavailableError:
    """A Spark task that could not connect to PostgreSQL, where the stage job's driver had just
    connected with the same settings: on a cluster, the executors' hosts are not the driver's."""
    where = f"pipeline {pipeline.name!r} batch {batch.batch_id}"
    database = describe(settings.database_url)
    said = hide_password(said, settings.database_url)
    if refuses(said):
        why = (
            "most likely its pg_hba.conf does not admit the hosts of the Spark executors, which write the staging "
            "rows themselves. Admit them (for kafka2pg's role and database)"
            if refused_by_hba(said)
            else "the Spark executors, which write the staging rows themselves, most likely lack something the "
            "driver's host has: a password file (~/.pgpass, PGPASSFILE) or a client certificate the connection "
            "relies on. Give it to them, or put the credential in the postgres connection"
        )
        return DatabaseRefusedError(
            f"{where}: PostgreSQL at {database} refused a Spark task's connection ({said}) after accepting the "
            f"stage job's own with the same settings: {why}, or fix the postgres connection if it changed. Nothing "
            "was staged; the batch stays planned.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            database=database,
        )
    return DatabaseUnavailableError(
        f"{where}: a Spark task could not connect to PostgreSQL at {database} ({said}). The Spark executors "
        "write the staging rows themselves, so each must reach the database at the postgres connection's host: "
        "on a cluster, a host such as localhost or 127.0.0.1 names each executor's own machine. Nothing was "
        "staged; the batch stays planned and the retry (or the next run) stages it again.",
        pipeline=pipeline.name,
        batch_id=batch.batch_id,
        database=database,
    )


def _python_message(text: str, name: str) -> str | None:
    """The message of kafka2pg error `name` raised in a Spark task (its line in the traceback)."""
    marker = f"kafka2pg.exceptions.{name}: "
    if marker not in text:
        return None
    return text[text.index(marker) + len(marker) :].split("\n", 1)[0].strip()


# The Java client's exceptions for a cluster that refuses it (credentials, TLS).
_JAVA_REFUSALS = ("SaslAuthenticationException", "SslAuthenticationException")
# Spark's Kafka source's error for a record it cannot convert (a timestamp beyond its microseconds).
_SPARK_RECORD_REFUSAL = "KafkaIllegalStateException"


def _java_message(text: str, exception: str) -> str:
    """The message of a Java exception named in a Spark error: the rest of its line."""
    line = text[text.index(exception) :].split("\n", 1)[0]
    return line.split(":", 1)[1].strip()[:300] if ":" in line else line[:300]


def _raise_if_stopped(stop: threading.Event | None, pipeline: Pipeline, batch_id: int) -> None:
    if stop is not None and stop.is_set():
        raise StageInterrupted(
            f"pipeline {pipeline.name!r} batch {batch_id}: stopped by SIGTERM before staging finished; nothing "
            "was promoted and the batch stays planned. The next run (or a retry) re-reads it.",
            pipeline=pipeline.name,
            batch_id=batch_id,
            state=BatchState.PLANNED,
        )


def _check_staged(conn, pipeline: Pipeline, batch: Batch, reads: tuple[PartitionRead, ...]) -> None:
    staged = staged_counts(conn, pipeline, batch.batch_id)
    expected = {r.partition: r.records for r in reads if r.records}
    if staged != expected:
        raise BatchStateError(
            f"pipeline {pipeline.name!r} batch {batch.batch_id}: staging holds {staged} rows per partition but this "
            f"attempt wrote {expected}; a concurrent attempt replaced them. The batch stays planned: run the stage "
            "step again.",
            pipeline=pipeline.name,
            batch_id=batch.batch_id,
            state=batch.state,
            staged=staged,
            expected=expected,
        )


def nothing_to_stage(conn: Connection, pipeline: Pipeline, batch: Batch) -> StageResult | None:
    """What staging `batch` would say without reading Kafka (it is staged, validated, promoted...),
    or None when it must be read: planned, or staged before and its staging rows lost in a crash.
    `BatchStateError` for a batch that cannot be staged (rejected, abandoned)."""
    _check_stageable(batch, pipeline)
    if batch.state is BatchState.PLANNED:
        return None
    if batch.state in (BatchState.STAGED, BatchState.VALIDATED) and staging_lost(conn, pipeline, batch):
        return None
    return StageResult(
        batch.batch_id, batch.state, (), f"batch {batch.batch_id} is already {batch.state}: nothing to stage"
    )


def _check_stageable(batch: Batch, pipeline: Pipeline) -> None:
    if stage_action(batch.state) is Action.REFUSE:
        raise BatchStateError.wrong_state(
            pipeline.name,
            batch.batch_id,
            batch.state,
            "it cannot be staged",
            "Trigger a new run: it plans a fresh batch.",
        )


def _staging_sql(template: str, pipeline: Pipeline) -> sql.Composed:
    return sql.SQL(template).format(sql.Identifier("kafka2pg", pipeline.staging_table))


def _merge_stats(rows: list, batch: Batch) -> tuple[PartitionRead, ...]:
    planned = {r.partition: r for r in batch.plan.ranges}
    merged: dict[int, list] = {p: [0, 0, None, None, []] for p in planned}
    for row in rows:
        acc = merged.setdefault(row.kafka_partition, [0, 0, None, None, []])
        acc[0] += row.records
        acc[1] += row.quarantined
        acc[2] = row.min_offset if acc[2] is None else min(acc[2], row.min_offset)
        acc[3] = row.max_offset if acc[3] is None else max(acc[3], row.max_offset)
        acc[4] += row.refused
    reads = []
    for partition, (records, quarantined, low, high, refused) in sorted(merged.items()):
        rng = planned.get(partition)
        outside = rng is None or (records and (low < rng.start or high >= rng.end or records > rng.size))
        if outside:
            planned = "(none)" if rng is None else f"[{rng.start}, {rng.end})"
            raise BatchStateError(
                f"pipeline {batch.pipeline!r} batch {batch.batch_id}: Spark returned offsets [{low}, {high}] "
                f"({records} records) of partition {partition}, outside the planned range {planned}; nothing was "
                "staged as final",
                pipeline=batch.pipeline,
                batch_id=batch.batch_id,
                partition=partition,
                offsets=None if low is None else (low, high + 1),
                records=records,
            )
        reads.append(PartitionRead(partition, records, quarantined, low, high, tuple(sorted(refused))))
    return tuple(reads)


def package_zip(state_dir: Path) -> Path:
    """Zip of the kafka2pg package for Spark executors (`addPyFile`), rebuilt each run."""
    package = PACKAGE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    target = state_dir / f"kafka2pg-{os.getpid()}.zip"
    with zipfile.ZipFile(target, "w") as archive:
        for path in sorted(package.rglob("*.py")):
            archive.write(path, Path("kafka2pg") / path.relative_to(package))
    return target


def spark_session(
    master: str | None,
    *,
    app_name: str,
    jars: list[Path] | None = None,
    conf: dict[str, str] | None = None,
    batches: int = 1,
    kafka_reader: str = KAFKA_READERS[0],
    scratch: Path | None = None,
) -> SparkSession:
    """A Spark session with kafka2pg's defaults; `master=None` keeps what spark-submit set.

    `batches` (how many batches the session may stage) and `kafka_reader` pick the JVM's JIT
    options, which take effect only where this call starts the JVM (tests, CLI, bench), not
    under spark-submit. `scratch` (the job's folder, `kafka2pg.scratch`) takes Spark's local
    directories with a local master, and the JVM's temporary files where this call starts it.
    """
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    settings = {**SPARK_DEFAULTS, **stage_jvm_conf(batches, kafka_reader=kafka_reader), **keep_log_options(conf or {})}
    starts_jvm = master is not None and _no_jvm_yet()
    launched = _launched_master(master)
    settings = redaction_conf({**_worker_daemon_conf(launched, settings), **settings}, launched.redaction_regex)
    if scratch is not None:
        settings = _in_scratch(settings, scratch, launched, starts_jvm=starts_jvm)
    for key, value in settings.items():
        builder = builder.config(key, value)
    if jars:
        builder = builder.config("spark.jars", ",".join(str(j) for j in jars))
    if not starts_jvm:
        return builder.getOrCreate()
    before = set(_spark_jvms())
    try:
        return builder.getOrCreate()
    except KeyboardInterrupt:
        # Ctrl-C while the JVM starts: PySpark starts it ignoring SIGINT, and one that has not yet
        # connected back would never hear from this process again (it outlived the CLI by minutes).
        left = sorted(set(_spark_jvms()) - before)
        try:
            while left:
                _stop_process(left[0])
                left.pop(0)
        except KeyboardInterrupt:  # a second Ctrl-C: the ones not yet stopped are killed at once
            for pid in left[1:]:
                _kill(pid)
        raise


def _spark_jvms() -> Iterator[int]:
    """The Spark JVMs this process started: its children running spark-submit (the script, before
    it execs the JVM, or the JVM running spark-submit's main class)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
            if parent == me and (b"org.apache.spark.deploy.SparkSubmit" in command or b"/bin/spark-submit" in command):
                yield int(entry.name)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue


def _stop_process(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM to child `pid` (the JVM's shutdown hooks delete its temporary files), SIGKILL if it
    has not ended within `grace_s` or a second Ctrl-C comes meanwhile (then re-raised); reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    try:
        if _ended(pid, grace_s):
            return
    except KeyboardInterrupt:  # no more waiting: the child does not outlive this process either
        _kill(pid)
        raise
    _kill(pid)


def _ended(pid: int, within_s: float) -> bool:
    """Whether child `pid` ended (reaped) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


# kafka2pg.worker_daemon: PySpark's worker daemon importing PySpark from the installed package.
WORKER_DAEMON_DIR = PACKAGE_DIR / "worker_daemon"
_WORKER_DAEMON_KEYS = ("spark.python.daemon.module", "spark.executorEnv.PYTHONPATH")


def _no_jvm_yet() -> bool:
    from pyspark import SparkContext

    return SparkContext._gateway is None and not os.environ.get("PYSPARK_GATEWAY_PORT")


def _launched_master(master: str | None) -> _Launched:
    """`master`, or under spark-submit (`master` None) the master and spark.* settings its JVM
    was given (--conf, spark-defaults.conf). Unknown (None) when there is no JVM yet to ask:
    starting it here would start it without the session's conf."""
    if master is not None:
        return _Launched(master, frozenset())
    from pyspark import SparkConf, SparkContext

    if _no_jvm_yet():
        return _Launched(None, frozenset())
    SparkContext._ensure_initialized()  # spark-submit's JVM: connects, starts nothing
    launched = SparkConf()  # the spark.* system properties spark-submit set
    return _Launched(
        launched.get("spark.master", ""),
        frozenset(key for key, _ in launched.getAll()),
        launched.get(REDACTION_KEY, None),
    )


@dataclass(frozen=True)
class _Launched:
    master: str | None
    keys: frozenset[str]  # the spark.* keys spark-submit set
    redaction_regex: str | None = None  # its spark.redaction.regex

    @property
    def local(self) -> bool:
        # Not local-cluster[...]: its executors are processes of their own, like a cluster's (and
        # get spark.executorEnv.PYTHONPATH as their whole PYTHONPATH).
        return self.master is not None and (self.master == "local" or self.master.startswith("local["))


def _in_scratch(conf: dict[str, str], scratch: Path, launched: _Launched, *, starts_jvm: bool) -> dict[str, str]:
    """`conf` with Spark's local directories in the job's scratch folder (a local master only: a
    cluster's executors have directories of their own) and, where this process starts the JVM,
    its temporary files there too (lz4's native library, Spark's temporary folders), unless the
    pipeline's spark_conf or spark-submit set them. SPARK_LOCAL_DIRS, where set, still wins."""
    conf = dict(conf)
    if launched.local and "spark.local.dir" not in conf and "spark.local.dir" not in launched.keys:
        conf["spark.local.dir"] = str(scratch)
    return jvm_temporary_files_in(conf, scratch) if starts_jvm else conf


def worker_daemon_conf(master: str | None, conf: dict[str, str]) -> dict[str, str]:
    """Spark conf that starts the Python workers through kafka2pg's daemon module, for a local
    master (`master`, or under spark-submit the one its JVM was given) only: executors elsewhere
    need not have this folder, or this Python. Nothing where `conf` (or, under spark-submit, its
    --conf or spark-defaults.conf) sets the daemon module or the workers' PYTHONPATH."""
    return _worker_daemon_conf(_launched_master(master), conf)


def _worker_daemon_conf(launched: _Launched, conf: dict[str, str]) -> dict[str, str]:
    if not launched.local or any(key in conf or key in launched.keys for key in _WORKER_DAEMON_KEYS):
        return {}
    return {
        "spark.python.daemon.module": "kafka2pg_worker_daemon",
        "spark.executorEnv.PYTHONPATH": str(WORKER_DAEMON_DIR),
    }


def stop_session(spark: SparkSession) -> None:
    """`spark.stop()` without waiting on PySpark's accumulator server: its request handler
    checks for a shutdown once a second, so stopping it idles for up to a second. The server
    is stopped in a daemon thread after Spark (or ends with the process)."""
    context = spark.sparkContext
    server = getattr(context, "_accumulatorServer", None)
    if server is not None:
        context._accumulatorServer = None  # spark.stop() skips it
    try:
        spark.stop()
    except (Py4JError, ConnectionError) as exc:  # its JVM is gone (killed, crashed): nothing left to stop
        log.warning("Spark's JVM did not answer the session's stop (%s): it is gone already", exc)
    finally:
        if server is not None:
            threading.Thread(target=server.shutdown, name="kafka2pg-accumulator-stop", daemon=True).start()


SPARK_DEFAULTS = {
    "spark.sql.session.timeZone": "UTC",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "20000",
}

# What Spark hides where it shows settings (its Kafka source's client parameters in a DEBUG log,
# its UI's environment): Spark's default, and kafka2pg's terms for the client key it passes
# inline (kafka_config.spark_options) added to whatever regex is in force (`redaction_conf`).
REDACTION_KEY = "spark.redaction.regex"
SPARK_REDACTION_DEFAULT = "(?i)secret|password|token|access[.]?key"
REDACTION_TERMS = "(?i:ssl[.]keystore[.]key|private key)"


def redaction_conf(conf: dict[str, str], launched_regex: str | None) -> dict[str, str]:
    """`conf` with kafka2pg's terms added to spark.redaction.regex: to the pipeline's spark_conf
    value, else spark-submit's (--conf, spark-defaults.conf), else Spark's default; a site's
    stricter regex is kept, never replaced."""
    regex = conf.get(REDACTION_KEY) or launched_regex or SPARK_REDACTION_DEFAULT
    if REDACTION_TERMS in regex:
        return conf
    return {**conf, REDACTION_KEY: f"{regex}|{REDACTION_TERMS}"}
