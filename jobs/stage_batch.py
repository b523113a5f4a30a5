"""spark-submit entry point: read one planned batch's offset ranges from Kafka and stage them.

Usage: spark-submit jobs/stage_batch.py --pipeline NAME --batch-id N [--epoch E] (the DAG does this).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Local runs import the package from the checkout; clusters get it through --py-files.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--batch-id", required=True, type=int)
    parser.add_argument("--epoch", type=int, help="the run's claim on the batch (from the plan task)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from kafka2pg.exceptions import Kafka2PgError, StageInterrupted
    from kafka2pg.staging import run_job

    try:
        result = run_job(args.pipeline, args.batch_id, args.epoch)
    except StageInterrupted as exc:
        print(f"kafka2pg stage interrupted: {exc}", file=sys.stderr)
        return 128 + 15
    except Kafka2PgError as exc:
        print(f"kafka2pg stage failed: {exc}", file=sys.stderr)
        return 2
    print(result.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
