"""One step of a DAG run in its own process, as an Airflow worker runs it, that can die on cue.

    python child.py plan|validate|promote --pipeline NAME [--batch-id N --epoch E]
                    [--kill-at POINT | --pause-at POINT --resume-file PATH]

The step is the same `kafka2pg.tasks` callable the DAG calls. `--kill-at` SIGKILLs this
process at a named point (some inside an open transaction); `--pause-at` stops there until
`--resume-file` exists, so the test can restart PostgreSQL under an open transaction.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))

from kafka2pg import promote, quality, tasks  # noqa: E402

# point name -> (module, attribute): the fault fires right AFTER that function returns.
POINTS = {
    "validate:after_checks": (quality, "run_checks"),
    "validate:after_store": (quality, "store_checks"),
    "validate:before_commit": (quality, "transition"),
    "promote:after_head": (promote, "_advance_head"),
    "promote:after_target": (promote, "insert_target"),
    "promote:before_commit": (promote, "transition"),
}


def fault(point: str, args: argparse.Namespace) -> None:
    print(f"FAULT {point}", flush=True)
    if args.kill_at == point:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not Path(args.resume_file).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def arm(args: argparse.Namespace) -> None:
    point = args.kill_at or args.pause_at
    if point in POINTS:
        module, name = POINTS[point]
        original = getattr(module, name)

        def wrapped(*a, **kw):
            result = original(*a, **kw)
            fault(point, args)
            return result

        setattr(module, name, wrapped)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=["plan", "validate", "promote"])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--batch-id", type=int)
    parser.add_argument("--epoch", type=int)
    parser.add_argument("--run-id", default="child")
    parser.add_argument("--kill-at")
    parser.add_argument("--pause-at")
    parser.add_argument("--resume-file")
    args = parser.parse_args()
    arm(args)
    if args.step == "plan":
        result = tasks.plan(args.pipeline, run_id=args.run_id)
    elif args.step == "validate":
        result = tasks.validate(args.pipeline, args.batch_id, args.epoch)
    else:
        result = tasks.promote(args.pipeline, args.batch_id, args.epoch)
    if args.kill_at in ("plan:after", "validate:after", "promote:after_commit"):
        fault(args.kill_at, args)  # done and committed, but the task never reports success
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
