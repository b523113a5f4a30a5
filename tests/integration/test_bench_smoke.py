"""The comparative benchmark runs end to end on a tiny backlog, so it cannot rot (no timing asserted)."""

import re
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
        "connect ",
        "throughput ours/peer:",
        "throughput ours/connect:",
        "ours per phase:",
        "fixed costs:",
        "CPU core-seconds while each ran",
        "through `airflow dags test`",
        "ours through the DAG, one `airflow dags test` run with batches_per_run unlimited: 2000 rows",
        "throughput ours-via-DAG/peer:",
    ):
        assert line in done.stdout, done.stdout
    rows = [
        ln.split()
        for ln in done.stdout.splitlines()
        if ln.split()[:1] in (["ours"], ["peer"], ["worker"], ["floor"], ["connect"])
    ]
    assert {r[0]: int(r[1]) for r in rows if r[1].isdigit()} == {
        "ours": 2000,
        "peer": 2000,
        "worker": 2000,
        "floor": 2000,
        "connect": 2000,
    }


def test_compare_benchmark_rounds_load_the_backlog_each_time_and_give_the_median_ratio():
    """--rounds 2: each contender loads the whole backlog twice (new tables; the run fails if a
    round lands fewer rows) and the ratio is the median over rounds."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "compare.py"),
            *("--events", "500", "--partitions", "2", "--contenders", "ours,floor", "--rounds", "2"),
            *("--no-scaling", "--no-airflow"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ours: " in done.stdout and "(round 2)" in done.stdout, done.stdout
    assert "throughput ours/floor: " in done.stdout and "(median of 2 rounds: " in done.stdout, done.stdout
    table = [ln.split() for ln in done.stdout.splitlines() if ln.split()[:1] in (["ours"], ["floor"])]
    assert {r[0]: int(r[1]) for r in table if r[1].isdigit()} == {"ours": 500, "floor": 500}, done.stdout


def test_write_once_benchmark_smoke_measures_every_path_on_rows_that_landed():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "write_once.py"), "--events", "3000", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PostgreSQL backend CPU, 3000 staged rows, best of 1, per 1M rows:" in done.stdout, done.stdout
    for label in ("staging write", "gate SQL", "promotion now", "write-once promotion", "write-once: COPY"):
        assert f"  {label}" in done.stdout, done.stdout
    assert "The client side's CPU (this process), 3000 framed rows, best of 1, per 1M rows:" in done.stdout
    for label in ("now: staging COPY encoding", "write-once: IPC files written", "write-once: the gate's counts"):
        assert f"  {label}" in done.stdout, done.stdout
    assert re.search(r"both sides: now [\d.]+, write-once [\d.]+ core-s per 1M", done.stdout), done.stdout
