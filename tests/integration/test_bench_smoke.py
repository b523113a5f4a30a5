"""The comparative benchmark runs end to end on a tiny backlog, so it cannot rot (no timing asserted)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_benchmark_smoke_runs_every_contender_and_prints_the_ratios():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "compare.py"), "--events", "2000", "--partitions", "2", "--no-scaling"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in (
        "ours ",
        "peer ",
        "worker ",
        "floor ",
        "throughput ours/peer:",
        "ours per phase:",
        "fixed costs:",
        "CPU core-seconds while each ran",
        "through `airflow dags test`",
        "ours through the DAG, one `airflow dags test` run with batches_per_run unlimited: 2000 rows",
        "throughput ours-via-DAG/peer:",
    ):
        assert line in done.stdout, done.stdout
    rows = [
        ln.split() for ln in done.stdout.splitlines() if ln.split()[:1] in (["ours"], ["peer"], ["worker"], ["floor"])
    ]
    assert {r[0]: int(r[1]) for r in rows if r[1].isdigit()} == {
        "ours": 2000,
        "peer": 2000,
        "worker": 2000,
        "floor": 2000,
    }
