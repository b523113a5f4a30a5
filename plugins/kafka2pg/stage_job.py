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

    skip_bundled_pyspark_zip(sys.path)
    from kafka2pg.exceptions import Kafka2PgError, StageInterrupted
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
        return 2
    print(result.message)
    return 0


def skip_bundled_pyspark_zip(path: list[str]) -> list[str]:
    """Take the installed pyspark package's own `python/lib/pyspark.zip` off `path` when that package
    is importable from the rest of it; returns what was taken off.

    spark-submit puts the zip first on the driver's PYTHONPATH. Python keeps no compiled modules
    for a zip: importing PySpark from it compiles its source again in every job (about 0.4 s of
    one core, before Spark starts). The zip holds the same files as the package it lies in, whose
    modules Python has compiled once. A zip of another Spark installation (SPARK_HOME elsewhere)
    stays, and so does this one if the package would not be the one imported without it.
    """
    import importlib.machinery

    skipped = []
    for entry in [e for e in path if e.endswith("pyspark.zip")]:
        package = Path(entry).parent.parent.parent  # <pyspark>/python/lib/pyspark.zip
        if package.name != "pyspark" or not (package / "__init__.py").is_file():
            continue
        rest = [e for e in path if e != entry]
        spec = importlib.machinery.PathFinder.find_spec("pyspark", rest)
        if spec is not None and spec.origin and Path(spec.origin).resolve() == (package / "__init__.py").resolve():
            path[:] = rest
            skipped.append(entry)
    return skipped


if __name__ == "__main__":
    # Run as a file, Python put this package's own folder first on sys.path, where its modules
    # (config, tasks, ...) would stand in for top-level ones of those names; kafka2pg is imported
    # as the package it is.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
