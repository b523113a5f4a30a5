"""Quality-gate overhead on one staged batch: SQL checks vs the Great Expectations suite.

Stages one batch of N events (with a few producer-retry duplicates) once, then times, in the
same process: the whole validate step, its SQL checks, loading the accepted rows for GX, and
the GX validation itself; prints seconds and ratios against the staging of the same batch.
    ./kafka2pg python bench/validation_overhead.py [--events 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bench_spark, bench_stack, best_of, planned_batch  # noqa: E402
from psycopg import sql  # noqa: E402

from kafka2pg import checks, expectations, quality  # noqa: E402
from kafka2pg.batch_store import load_batch  # noqa: E402
from kafka2pg.config import Settings  # noqa: E402
from kafka2pg.database import connect, transaction  # noqa: E402
from kafka2pg.devtools.producer import sample_events  # noqa: E402
from kafka2pg.lifecycle import BatchState  # noqa: E402
from kafka2pg.rows import staged_counts  # noqa: E402
from kafka2pg.staging import stage_batch  # noqa: E402


def _unvalidate(settings: Settings, staging: str, batch_id: int) -> None:
    with connect(settings.database_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET quarantine_reason = NULL WHERE quarantine_reason LIKE 'duplicate%%'").format(
                sql.Identifier("kafka2pg", staging)
            )
        )
        conn.execute("UPDATE kafka2pg.batches SET state = %s WHERE batch_id = %s", (BatchState.STAGED, batch_id))
        # Stored results of a deferred check mean "sent back by a key collision at promotion", which
        # gets a recheck only: without them the next validation runs the whole gate again.
        conn.execute("DELETE FROM kafka2pg.batch_checks WHERE batch_id = %s", (batch_id,))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with bench_stack("kafka2pg-bench-") as (settings, _, work):
        events = list(sample_events(args.events))
        pipeline, batch = planned_batch(settings, "vbench", events + events[:10], 3, args.events + 10)
        spark = bench_spark("local[2]", "vbench", work)
        started = time.monotonic()
        stage_batch(spark, settings, pipeline, batch.batch_id)
        stage_s = time.monotonic() - started
        spark.stop()

        def whole() -> None:
            _unvalidate(settings, pipeline.staging_table, batch.batch_id)
            quality.validate_batch(settings, pipeline, batch.batch_id)

        def sql_checks() -> None:
            _unvalidate(settings, pipeline.staging_table, batch.batch_id)
            witnesses = checks.gap_witnesses(settings, pipeline, batch.batch_id)
            with transaction(settings.database_url) as conn:
                staged = staged_counts(conn, pipeline, batch.batch_id)
                checks.run_checks(conn, pipeline, load_batch(conn, batch.batch_id), False, staged, witnesses)

        with connect(settings.database_url) as conn:
            frame = expectations.load_accepted(conn, pipeline, batch.batch_id)
            load_s = best_of(args.rounds, lambda: expectations.load_accepted(conn, pipeline, batch.batch_id))
        suite = expectations.suite_for(pipeline, len(frame))
        gx_s = best_of(args.rounds, lambda: expectations.run_suite(frame, suite))
        validate_s = best_of(args.rounds, whole)
        sql_s = best_of(args.rounds, sql_checks)
        rows = [
            ("stage (Spark read + COPY), once", stage_s),
            ("validate step, whole", validate_s),
            ("  SQL checks (duplicates, completeness, gaps)", sql_s),
            ("  load accepted rows into pandas", load_s),
            ("  Great Expectations suite", gx_s),
        ]
        print(f"quality gate on {args.events + 10} staged rows (best of {args.rounds}, local[2], this machine)")
        for label, seconds in rows:
            print(f"{label:<48} {seconds:7.2f}s  x{seconds / stage_s:5.2f} of staging")
    return 0


if __name__ == "__main__":
    sys.exit(main())
