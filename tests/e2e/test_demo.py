"""The README's first command as a newcomer runs it: `./kafka2pg demo` in a checkout whose path has a
space and is a few folders deep (`~/My Projects/<a long name>/kafka2pg`: longer than a Unix-domain
socket's path may be), its venv and state folder there too. It must start the stack, make
the class-data archive, run the DAG twice and land every event. Only the venv (a link to this one,
under a path with a space) and the resolved jars are shared, so that nothing is installed again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kafka2pg.locations import state_dir

ROOT = Path(__file__).resolve().parents[2]
EVENTS = 300
# What ./kafka2pg sets itself, or reads before its own defaults: the demo must find its own.
_OUTER = ("KAFKA2PG_", "AIRFLOW", "SPARK_HOME", "PYSPARK_", "PYTHONPATH")
_KEPT = ("KAFKA2PG_PG_BINDIR", "KAFKA2PG_PYTHON")  # where this machine's PostgreSQL and Python are


@pytest.fixture
def where():
    """A folder whose path has a space, readable by all: as root, the local stack's PostgreSQL
    (run as `postgres`) keeps its data there only if it can reach it (not in pytest's tmp dir)."""
    top = Path(tempfile.mkdtemp(prefix="kafka2pg-test-"))
    folder = top / "My Projects" / "data-platform-evaluation-of-exactly-once-loaders"  # deep, as people have them
    folder.mkdir(parents=True)
    for path in (top, folder.parent, folder):
        path.chmod(0o755)
    yield folder
    shutil.rmtree(top, ignore_errors=True)


def test_the_demo_runs_from_a_checkout_whose_path_has_a_space(where, tmp_path):
    checkout = where / "kafka2pg"
    checkout.mkdir(parents=True)
    for name in ("kafka2pg", "requirements.txt"):
        shutil.copy2(ROOT / name, checkout / name)
    for name in ("plugins", "dags", "sql"):
        shutil.copytree(ROOT / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = where / "the venv"
    venv.symlink_to(sys.prefix)  # this suite's venv, set up already
    (checkout / ".cache").mkdir()
    (checkout / ".cache" / "jars").symlink_to(state_dir() / "jars")
    env = {k: v for k, v in os.environ.items() if k in _KEPT or not k.startswith(_OUTER)}
    env["KAFKA2PG_VENV"] = str(venv)

    log = tmp_path / "demo.log"
    try:
        with open(log, "w") as out:
            done = subprocess.run(
                ["./kafka2pg", "demo", "--events", str(EVENTS)],
                cwd=checkout,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=900,
            )
    finally:
        left_behind = (checkout / ".cache" / "stack").exists()
        if left_behind:  # stopped here, whatever failed (a demo killed by the timeout cannot)
            subprocess.run(["./kafka2pg", "stack", "reset", "--confirm"], cwd=checkout, env=env, check=False)
    output = log.read_text(errors="replace")
    assert done.returncode == 0, f"./kafka2pg demo failed (log {log}):\n{output[-5000:]}"
    assert f"OK: produced {EVENTS}, landed {EVENTS}" in output, output[-3000:]
    # What landed, as rows: the first by provenance, every column named.
    header = f"the first 3 of the {EVENTS} rows in public.orders (by partition and offset):\n"
    assert header in output, output[-3000:]
    sample = output.split(header)[1]
    assert sample.startswith("  event_id: ") and "kafka_partition: 0, kafka_offset: 0" in sample, output[-3000:]
    assert "could not make the Spark class-data archive" not in output, output[-5000:]
    # What a newcomer reads: no warning of Airflow's about its own set-up, one line for the migrations.
    assert "empty cryptography key" not in output, output[-5000:]
    assert "applied migration " not in output and " migrations and created the pipeline's tables" in output
    assert (checkout / ".cache" / "airflow" / "fernet.key").stat().st_mode & 0o077 == 0
    assert list((checkout / ".cache" / "jvm").glob("spark-*.jsa")), "no class-data archive was made"
    assert not left_behind, "the demo left its stack behind"
    # The broker's and PostgreSQL's logs outlive the stack, beside the Airflow runs' (README).
    kept = checkout / ".cache" / "demo"
    assert "QuorumController" in (kept / "kafka.log").read_text(errors="replace")  # a KRaft broker's first WARN
    assert "database system is ready to accept connections" in (kept / "postgres.log").read_text(errors="replace")
