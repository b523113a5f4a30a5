"""The Spark job of the read_and_stage task: read one planned batch's offset ranges from Kafka and stage them.

spark-submit runs this module's file (the DAG passes `kafka2pg.stage_job.__file__`, inside the installed
package; the checkout's jobs/stage_batch.py calls `main` too):

    spark-submit .../kafka2pg/stage_job.py --pipeline NAME --batch-id N [--epoch E] [--batches K
        --run-id ID --max-records-per-batch M]

With --batches K > 1 the job also validates and promotes each batch and goes on with the next ones
(kafka2pg.runner). Only the standard library is imported before `main` runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--batch-id", required=True, type=int)
    parser.add_argument("--epoch", type=int, help="the run's claim on the batch (from the plan task)")
    parser.add_argument(
        "--batches", type=int, default=1, help="finish up to this many batches in this job (default 1: stage only)"
    )
    parser.add_argument("--run-id", help="the Airflow run, recorded with each batch this job plans")
    parser.add_argument("--max-records-per-batch", type=int, help="cap of the batches this job plans")
    args = parser.parse_args(argv)
    if args.batches < 1:
        parser.error(f"--batches must be at least 1, got {args.batches}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # py4j logs every connection it closes at INFO: noise in the task log.
    logging.getLogger("py4j").setLevel(logging.WARNING)

    # spark-submit put the installed pyspark's zip first on the path: import the package instead.
    from kafka2pg.worker_daemon.kafka2pg_worker_daemon import skip_bundled_pyspark_zip

    skip_bundled_pyspark_zip(sys.path)
    from kafka2pg.exceptions import TERMINAL_EXIT, Kafka2PgError, StageInterrupted
    from kafka2pg.runner import run_job

    try:
        result = run_job(
            args.pipeline,
            args.batch_id,
            args.epoch,
            batches=args.batches,
            run_id=args.run_id,
            max_records_per_batch=args.max_records_per_batch,
        )
    except StageInterrupted as exc:
        print(f"kafka2pg stage interrupted: {exc}", file=sys.stderr)
        return 128 + 15
    except Kafka2PgError as exc:
        print(f"kafka2pg stage failed: {exc}", file=sys.stderr)
        return TERMINAL_EXIT if exc.terminal else 2
    print(result.message)
    return 0


if __name__ == "__main__":
    # Run as a file, Python put this package's own folder first on sys.path, where its modules
    # (config, tasks, ...) would stand in for top-level ones of those names; kafka2pg is imported
    # as the package it is.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
