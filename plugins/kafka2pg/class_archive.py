"""The stage JVM's class-data archive (AppCDS): made once by set-up, used by every stage job.

A training run starts Spark as the stage job does and runs the stage's decode and Arrow path on
synthetic rows; its JVM records the classes it loaded (`-XX:ArchiveClassesAtExit`) when it exits.
Later stage JVMs map them (`-XX:SharedArchiveFile`, added by `config.stage_jvm_options`) instead
of reading, parsing and verifying them from Spark's jars. The archive is written under a
temporary name and renamed only once the JVM has exited: a JVM given a truncated archive
crashes, one given none or a stale one runs without it.

    python -m kafka2pg.class_archive   # what `./kafka2pg setup` runs; idempotent
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kafka2pg.config import STAGE_JVM_OPTIONS_TIERED, class_archive_path

log = logging.getLogger(__name__)

TIMEOUT_S = 300


def ensure(state_dir: Path | None = None) -> Path | None:
    """The archive for this pyspark and java, made now if missing; None if it could not be made
    (stage jobs then start without one, as before: slower, never wrong)."""
    target = class_archive_path(state_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_partials(target.parent)
    failed = target.with_name(f"{target.name}.failed")
    if failed.is_file():  # its training exited with an error for this pyspark and java: not on every command
        log.debug("no Spark class-data archive: its training failed before (delete %s to try again)", failed)
        return None
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kafka2pg.class_archive", "--train", str(partial)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0 or not partial.is_file() or partial.stat().st_size == 0:
            if done.returncode > 0:  # an error of its own, not a signal (the OOM killer): the next try would fail too
                failed.write_text(f"exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
            log.warning(
                "could not make the Spark class-data archive (stage jobs start without it; delete %s to try "
                "again): exit %s\n%s",
                failed,
                done.returncode,
                (done.stdout + done.stderr)[-3000:],
            )
            return None
        partial.replace(target)
    except subprocess.TimeoutExpired:  # a busy machine: tried again by the next command
        log.warning("the Spark class-data training run took over %s s; stage jobs start without it", TIMEOUT_S)
        return None
    finally:
        partial.unlink(missing_ok=True)
    for stale in target.parent.glob("spark-*.jsa"):
        if stale != target:
            stale.unlink(missing_ok=True)
    log.info("Spark class-data archive %s made in %.1f s", target, time.monotonic() - started)
    return target


def _remove_orphaned_partials(folder: Path) -> None:
    """Archives a training JVM wrote after its run was interrupted (it ignores Ctrl-C and writes
    on its way out, once the name was already cleaned up): about 150 MB each, their process gone."""
    for partial in folder.glob("spark-*.jsa.*.partial"):
        pid = partial.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            partial.unlink(missing_ok=True)


def train(archive: Path) -> None:
    """Run the stage's Spark path on synthetic rows in a JVM that writes `archive` when it exits."""
    from pyspark import SparkContext
    from pyspark.sql import functions as F

    from kafka2pg.chunk_writer import KAFKA_COLUMNS
    from kafka2pg.jars import spark_jars
    from kafka2pg.staging import spark_session

    options = f"{STAGE_JVM_OPTIONS_TIERED} -XX:ArchiveClassesAtExit={shlex.quote(str(archive))}"
    spark = spark_session(
        "local[2]",
        app_name="kafka2pg-class-archive",
        jars=spark_jars(),
        conf={"spark.driver.extraJavaOptions": options},
    )
    spark.sparkContext.setLogLevel("ERROR")
    events = spark.range(0, 20_000, numPartitions=2).select(
        (F.col("id") % 2).cast("int").alias("partition"),
        F.col("id").alias("offset"),
        F.current_timestamp().alias("timestamp"),
        F.to_json(
            F.struct(
                F.expr("uuid()").alias("event_id"),
                F.col("id").alias("customer_id"),
                (F.col("id") / 100).alias("amount"),
                F.lit("EUR").alias("currency"),
                F.current_timestamp().alias("ts"),
                F.struct(F.col("id").alias("n")).alias("payload"),
            )
        )
        .cast("binary")
        .alias("value"),
        F.col("id").cast("string").cast("binary").alias("key"),
    )
    events.select(*KAFKA_COLUMNS).coalesce(2).mapInArrow(_count_rows, "rows long").collect()
    # The librdkafka reader's path: Python tasks over a parallelized list, their rows collected.
    spark.sparkContext.parallelize([[1], [2]], 2).mapPartitions(lambda share: iter(share)).collect()
    gateway = SparkContext._gateway
    spark.stop()
    # The JVM exits (and writes the archive) when its stdin closes; wait for it to finish writing.
    process = getattr(gateway, "proc", None)
    if process is not None:
        process.stdin.close()
        process.wait(timeout=TIMEOUT_S)


def _count_rows(batches):
    import pyarrow as pa

    rows = sum(batch.num_rows for batch in batches)
    yield pa.RecordBatch.from_pylist([{"rows": rows}], schema=pa.schema([("rows", pa.int64())]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"] and len(sys.argv) == 3:
        train(Path(sys.argv[2]))
    elif len(sys.argv) == 1:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        print(ensure() or "no archive: stage jobs start without one")
    else:
        sys.exit("usage: python -m kafka2pg.class_archive [--train ARCHIVE]")
