"""Staging write: COPY from each Spark task (ours) vs Spark JDBC with reWriteBatchedInserts.

Same Kafka batch, same decode, same table shape, one process tree; prints seconds and ratios
against the read-only floor (Kafka read + decode + count). Usage:
    ./kafka2pg python bench/staging_write.py [--events 100000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import JDBC_PROPERTIES, bench_spark, bench_stack, best_of, planned_batch, spark_sql_decode  # noqa: E402
from psycopg import sql  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from kafka2pg.config import Pipeline, Settings  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.devtools.producer import sample_events  # noqa: E402
from kafka2pg.staging import kafka_read_options, stage_batch  # noqa: E402


def _reset(settings: Settings, pipeline: Pipeline, batch_id: int) -> None:
    with connect(settings.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier("kafka2pg", pipeline.staging_table)))
        conn.execute("UPDATE kafka2pg.batches SET state = 'planned' WHERE batch_id = %s", (batch_id,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with bench_stack("kafka2pg-bench-") as (settings, stack, work):
        pipeline, batch = planned_batch(settings, "bench", sample_events(args.events), 3, args.events)
        spark = bench_spark("local[2]", "bench", work)
        with connect(settings.database_url, autocommit=True) as conn:
            conn.execute("CREATE UNLOGGED TABLE kafka2pg.stg_bench_jdbc (LIKE kafka2pg.stg_bench)")
            conn.execute("ALTER TABLE kafka2pg.stg_bench_jdbc DROP COLUMN chunk")
        jdbc_url = f"jdbc:postgresql://127.0.0.1:{stack.postgres.port}/kafka2pg"

        def decoded():
            raw = spark.read.format("kafka").options(**kafka_read_options(settings, batch.plan)).load()
            return spark_sql_decode(raw, pipeline).withColumn("batch_id", F.lit(batch.batch_id))

        def floor():
            decoded().count()

        def ours():
            _reset(settings, pipeline, batch.batch_id)
            stage_batch(spark, settings, pipeline, batch.batch_id)

        def jdbc():
            with connect(settings.database_url, autocommit=True) as conn:
                conn.execute("TRUNCATE kafka2pg.stg_bench_jdbc")
            decoded().write.jdbc(jdbc_url, "kafka2pg.stg_bench_jdbc", mode="append", properties=JDBC_PROPERTIES)

        results = {
            name: best_of(args.rounds, func)
            for name, func in (("read+decode floor", floor), ("COPY per task (ours)", ours), ("JDBC batched", jdbc))
        }
        spark.stop()
    base = results["read+decode floor"]
    print(f"staging write of {args.events} events, 3 partitions, Spark local[2] (best of {args.rounds}):")
    for name, took in results.items():
        print(f"  {name:24s} {took:6.2f}s  {args.events / took:9.0f} rec/s  x{took / base:4.2f} of floor")
    print(f"  COPY/JDBC time ratio: {results['COPY per task (ours)'] / results['JDBC batched']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
