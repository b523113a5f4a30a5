"""What every benchmark script shares: a throwaway stack, a copy of the sample pipeline, a
Spark session shipping kafka2pg, the Spark JDBC settings of the JDBC contenders, best-of timing."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

from kafka2pg import class_archive  # noqa: E402
from kafka2pg.config import KAFKA_READERS, Pipeline, Settings, class_archive_path, get_pipeline  # noqa: E402
from kafka2pg.devtools import local_stack  # noqa: E402
from kafka2pg.devtools.local_stack import Stack  # noqa: E402
from kafka2pg.jars import resolve_jars, spark_jars  # noqa: E402
from kafka2pg.kafka_offsets import ensure_topic  # noqa: E402
from kafka2pg.migrations import migrate  # noqa: E402
from kafka2pg.opening import open_batch  # noqa: E402

# Spark JDBC writer options of the contenders that write through JDBC (batched, typed by PG).
JDBC_PROPERTIES = {
    "user": "postgres",
    "driver": "org.postgresql.Driver",
    "reWriteBatchedInserts": "true",
    "batchsize": "10000",
    "stringtype": "unspecified",
}


@contextmanager
def bench_stack(prefix: str) -> Iterator[tuple[Settings, Stack, Path]]:
    """A local broker and PostgreSQL for one benchmark run, stopped and deleted afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    # This run's state dir is a scratch folder: it gets set-up's jars and class-data archive, so
    # that ours starts Spark as a set-up machine does (jars resolved into a fresh state dir by the
    # first contender that asks took it seconds more, timed).
    resolve_jars(local_stack.DEFAULT_CACHE)
    (work / "jars").symlink_to(local_stack.DEFAULT_CACHE / "jars", target_is_directory=True)
    archive = class_archive.ensure(local_stack.DEFAULT_CACHE)
    if archive is not None:
        class_archive_path(work).parent.mkdir(parents=True)
        class_archive_path(work).symlink_to(archive)
    stack = local_stack.start_stack(work)
    finished = False
    try:
        yield Settings(stack.kafka.bootstrap_servers, stack.postgres.url, state_dir=work), stack, work
        finished = True
    finally:
        local_stack.discard_stack(stack)
        if finished:  # the rest of the scratch folder: the floor's input file (about 230 MB at 1M), logs
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the run's logs are kept in {work}", file=sys.stderr)


def bench_pipeline(name: str, topic: str | None = None) -> Pipeline:
    """The shipped `orders` pipeline under another name, topic and target table."""
    return dataclasses.replace(get_pipeline("orders"), name=name, topic=topic or name, target_table=name)


def padded_events(count: int, size: int) -> Iterator[dict]:
    """Sample events padded to about `size` bytes of JSON each."""
    from kafka2pg.devtools.producer import sample_events

    for event in sample_events(count):
        event["payload"]["note"] = "x" * max(0, size - len(json.dumps(event)) - 12)
        yield event


def planned_batch(settings: Settings, name: str, events: Iterable[dict], partitions: int, records: int):
    """The sample pipeline as `name` (its tables made), `events` written to a topic of that name
    with `partitions`, and one live batch of up to `records` planned over them: (pipeline, batch)."""
    from kafka2pg.devtools.producer import produce

    pipeline = bench_pipeline(name)
    migrate(settings.database_url, [pipeline])
    ensure_topic(settings.bootstrap_servers, name, partitions)
    produce(settings.bootstrap_servers, name, events)
    return pipeline, open_batch(settings, pipeline, max_records_per_batch=records).batch


def bench_spark(
    master: str,
    app_name: str,
    state_dir: Path,
    conf: dict[str, str] | None = None,
    batches: int = 1,
    kafka_reader: str = KAFKA_READERS[0],
    kafka_source: bool = True,
):
    """A quiet Spark session with the kafka2pg package shipped, and Spark's Kafka source jars unless
    not `kafka_source`; `batches` and `kafka_reader` pick the stage JVM's JIT options as the DAG does
    for such a run."""
    from kafka2pg.staging import package_zip, spark_session

    jars = spark_jars() if kafka_source else None
    spark = spark_session(master, app_name=app_name, jars=jars, conf=conf, batches=batches, kafka_reader=kafka_reader)
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.addPyFile(str(package_zip(state_dir)))
    return spark


def best_of(rounds: int, action: Callable[[], object]) -> float:
    """The fastest of `rounds` runs of `action`, in seconds."""
    times = []
    for _ in range(rounds):
        started = time.monotonic()
        action()
        times.append(time.monotonic() - started)
    return min(times)


def spark_sql_decode(raw, pipeline: Pipeline):
    """The decode a Structured Streaming user writes: `from_json` into the columns' Spark types,
    PERMISSIVE, with a quarantine reason for nulls, malformed records and missing required fields
    (none of kafka2pg's admission rules: what `from_json` accepts, lands)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType, _parse_datatype_string

    corrupt = "_corrupt_record"
    schema = StructType(
        [StructField(c.field, _parse_datatype_string(c.spark_type)) for c in pipeline.columns]
        + [StructField(corrupt, StringType())]
    )
    parsed = raw.select(
        F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("value").isNull().alias("_is_null"),
        F.from_json(
            F.col("value").cast("string"), schema, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": corrupt}
        ).alias("_parsed"),
    )
    record = F.col("_parsed")
    reason = F.when(F.col("_is_null"), F.lit("null value"))
    reason = reason.when(record.isNull(), F.lit("not a JSON object"))
    reason = reason.when(record.getField(corrupt).isNotNull(), F.lit("malformed JSON or a field of the wrong type"))
    for column in pipeline.columns:
        if column.required or column.name in pipeline.business_key:
            reason = reason.when(record.getField(column.field).isNull(), F.lit(f"{column.field} missing"))
    return parsed.select(
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_timestamp",
        *[record.getField(c.field).alias(c.name) for c in pipeline.columns],
        reason.alias("quarantine_reason"),
    )
