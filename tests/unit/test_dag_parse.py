"""DAG files parse fast and light: a live and a replay DAG per pipeline, no heavy import at parse time."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, runpy
ns = runpy.run_path(sys.argv[1])
dags = {k: v for k, v in ns.items() if k.startswith("kafka2pg_")}
heavy = sorted(m for m in ("pyspark", "psycopg", "great_expectations", "confluent_kafka") if m in sys.modules)
dag = dags["kafka2pg_orders"]
replay = dags["kafka2pg_orders_replay"]
print(json.dumps({
    "dags": sorted(dags),
    "heavy": heavy,
    "tasks": sorted(dag.task_ids),
    "max_active_runs": dag.max_active_runs,
    "params": sorted(dag.params.keys()),
    "replay_tasks": sorted(replay.task_ids),
    "replay_params": {
        k: {**replay.params.get_param(k).schema, "description": replay.params.get_param(k).description}
        for k in replay.params.keys()
    },
    "replay_paused": replay.is_paused_upon_creation,
    "replay_timetable": type(replay.timetable).__name__,
}))
"""


def test_dag_file_builds_one_dag_per_pipeline_without_heavy_imports():
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "dags" / "kafka2pg_pipelines.py")],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dags"] == ["kafka2pg_orders", "kafka2pg_orders_replay"]
    assert result["heavy"] == [], f"parsing the DAG imported {result['heavy']}"
    assert result["tasks"] == ["has_batch", "plan", "promote", "read_and_stage", "validate"]
    assert result["max_active_runs"] == 1
    assert result["params"] == ["batches_per_run", "dry_run", "max_records_per_batch"]
    assert result["replay_tasks"] == ["finish", "has_batch", "plan", "read_and_stage", "validate"]
    params = result["replay_params"]
    assert sorted(params) == ["from_time", "mode", "offset_ranges", "reason", "to_time"]
    assert params["mode"]["enum"] == ["replace", "verify-only"]
    assert params["from_time"]["format"] == "date-time"
    assert all(schema.get("description") for schema in params.values())
    assert result["replay_paused"] is True
    assert result["replay_timetable"] == "CronDataIntervalTimetable"
