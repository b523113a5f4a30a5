"""Staging write: COPY from each Spark task (ours) vs Spark JDBC with reWriteBatchedInserts.

Same Kafka batch, same decode, same table shape, one process tree; prints seconds and ratios
against the read-only floor (Kafka read + decode + count). Usage:
    ./kafka2pg python bench/staging_write.py [--events 100000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

from psycopg import sql  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from kafka2pg import local_stack  # noqa: E402
from kafka2pg.config import Pipeline, Settings, get_pipeline  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.kafka_offsets import ensure_topic  # noqa: E402
from kafka2pg.ledger import open_batch  # noqa: E402
from kafka2pg.migrations import migrate  # noqa: E402
from kafka2pg.producer import produce_sample  # noqa: E402
from kafka2pg.staging import decode, kafka_read_options, package_zip, spark_session, stage_batch  # noqa: E402


def _reset(settings: Settings, pipeline: Pipeline, batch_id: int) -> None:
    with connect(settings.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier("kafka2pg", pipeline.staging_table)))
        conn.execute("UPDATE kafka2pg.batches SET state = 'planned' WHERE batch_id = %s", (batch_id,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kafka2pg-bench-"))
    stack = local_stack.start_stack(work)
    try:
        settings = Settings(stack.kafka.bootstrap_servers, stack.postgres.url, state_dir=work)
        pipeline = dataclasses.replace(get_pipeline("orders"), name="bench", topic="bench", target_table="bench")
        migrate(settings.database_url, [pipeline])
        ensure_topic(settings.bootstrap_servers, "bench", 3)
        produce_sample(settings.bootstrap_servers, "bench", args.events)
        batch = open_batch(settings, pipeline, max_records_per_batch=args.events).batch
        spark = spark_session("local[2]", app_name="bench", jars=local_stack.spark_jars())
        spark.sparkContext.setLogLevel("ERROR")
        spark.sparkContext.addPyFile(str(package_zip(work)))
        with connect(settings.database_url, autocommit=True) as conn:
            conn.execute("CREATE UNLOGGED TABLE kafka2pg.stg_bench_jdbc (LIKE kafka2pg.stg_bench)")
            conn.execute("ALTER TABLE kafka2pg.stg_bench_jdbc DROP COLUMN chunk")
        jdbc_url = f"jdbc:postgresql://127.0.0.1:{stack.postgres.port}/kafka2pg"

        def decoded():
            raw = spark.read.format("kafka").options(**kafka_read_options(settings, batch.plan)).load()
            return decode(raw, pipeline).withColumn("batch_id", F.lit(batch.batch_id))

        def floor():
            decoded().count()

        def ours():
            _reset(settings, pipeline, batch.batch_id)
            stage_batch(spark, settings, pipeline, batch.batch_id)

        def jdbc():
            with connect(settings.database_url, autocommit=True) as conn:
                conn.execute("TRUNCATE kafka2pg.stg_bench_jdbc")
            decoded().write.jdbc(
                jdbc_url,
                "kafka2pg.stg_bench_jdbc",
                mode="append",
                properties={
                    "user": "postgres",
                    "driver": "org.postgresql.Driver",
                    "reWriteBatchedInserts": "true",
                    "batchsize": "10000",
                    "stringtype": "unspecified",
                },
            )

        results = {}
        for name, func in (("read+decode floor", floor), ("COPY per task (ours)", ours), ("JDBC batched", jdbc)):
            best = None
            for _ in range(args.rounds):
                started = time.monotonic()
                func()
                took = time.monotonic() - started
                best = took if best is None else min(best, took)
            results[name] = best
        spark.stop()
    finally:
        local_stack.stop_stack(stack)
    base = results["read+decode floor"]
    print(f"staging write of {args.events} events, 3 partitions, Spark local[2] (best of {args.rounds}):")
    for name, took in results.items():
        print(f"  {name:24s} {took:6.2f}s  {args.events / took:9.0f} rec/s  x{took / base:4.2f} of floor")
    print(f"  COPY/JDBC time ratio: {results['COPY per task (ours)'] / results['JDBC batched']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
