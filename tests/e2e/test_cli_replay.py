"""`kafka2pg replay` and `kafka2pg undo` as a user types them (subprocess, own Spark session)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from psycopg import sql

from kafka2pg.devtools.producer import produce, sample_events

ROOT = Path(__file__).resolve().parents[2]


def cli(env, *args: str) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_SPARK_MASTER": "local[1]",
        "PYTHONPATH": str(ROOT / "plugins"),
    }
    return subprocess.run(
        [sys.executable, "-m", "kafka2pg", *args], env=environ, capture_output=True, text=True, timeout=600, check=False
    )


def test_replay_verify_only_and_undo_from_the_command_line(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1, max_records_per_batch=20)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=9))
    first, second = run_batch(env), run_batch(env)
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("UPDATE {} SET currency = 'XXX' WHERE kafka_offset = 4").format(table))

    name = env.pipeline.name
    out = cli(env, "replay", "--pipeline", name, "--offsets", "0:0-20", "--mode", "verify-only", "--reason", "check")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 difference(s)" in out.stdout and "changed: 1 (e.g. 0:4)" in out.stdout

    refused = cli(env, "replay", "--pipeline", name, "--offsets", "0:0-41")
    assert refused.returncode == 2 and "beyond the live head 40" in refused.stderr

    older = cli(env, "undo", "--pipeline", name, "--batch-id", str(first.batch_id), "--confirm")
    assert older.returncode == 2 and "Replay its range instead" in older.stderr
    preview = cli(env, "undo", "--pipeline", name, "--batch-id", str(second.batch_id))
    assert preview.returncode == 1 and "delete 20 target and 0 quarantine rows of p0[20,40)" in preview.stdout
    done = cli(
        env, "undo", "--pipeline", name, "--batch-id", str(second.batch_id), "--reason", "bad batch", "--confirm"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0] == 20
    head = db.execute("SELECT next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (name,)).fetchone()[0]
    assert head == 20
    ops = db.execute(
        "SELECT operation, reason FROM kafka2pg.replays WHERE pipeline = %s ORDER BY replay_id", (name,)
    ).fetchall()
    assert ops == [("verify-only", "check"), ("undo", "bad batch")]


def test_a_replay_from_the_command_line_reads_through_sparks_kafka_source(make_pipeline, run_batch, db):
    """A pipeline reading with Spark's Kafka source: the CLI's own Spark session gets the source's
    jars as the DAG's spark-submit does (here: the ones set-up resolved, by their glob)."""
    env = make_pipeline(partitions=1, kafka_reader="spark")
    produce(env.settings.bootstrap_servers, env.topic, sample_events(30, seed=19))
    run_batch(env)

    out = cli(env, "replay", "--pipeline", env.pipeline.name, "--offsets", "0:0-30", "--mode", "verify-only")

    assert out.returncode == 0, out.stderr[-3000:]
    assert "0 difference(s)" in out.stdout, out.stdout
