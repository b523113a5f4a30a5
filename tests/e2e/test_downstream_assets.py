"""The target table's Asset events through a real scheduler: a live run promoting two batches (one
event), a no-op run (none) and a replay (one); two downstream DAGs, one scheduled on the table's
Asset URI and one on the pipeline's AssetAlias, parsed before the Asset had any event, run on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from airflow_server import api, running_airflow, wait_for
from psycopg.conninfo import conninfo_to_dict

from kafka2pg.devtools.producer import produce, sample_events

ROOT = Path(__file__).resolve().parents[2]

DOWNSTREAM = """
from datetime import datetime

from airflow.sdk import DAG, Asset, AssetAlias, task

for dag_id, source in (("{name}_on_table", Asset({uri!r})), ("{name}_on_alias", AssetAlias({alias!r}))):
    with DAG(dag_id, schedule=[source], start_date=datetime(2026, 1, 1), is_paused_upon_creation=False) as dag:

        @task
        def consume(triggering_asset_events=None, source=source):
            # Each event is listed under its Asset and again under the alias it came through.
            return [event.extra for event in triggering_asset_events[source]]

        consume()
    globals()[dag_id] = dag
"""


def trigger(server, dag_id: str, conf: dict) -> dict:
    created = api("POST", f"{server.api}/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
    assert created.ok, created.text
    run_id = created.json()["dag_run_id"]

    def done():
        run = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}").json()
        return run if run["state"] in ("success", "failed") else None

    run = wait_for(done, timeout_s=900, what=f"run {run_id} of {dag_id}")  # Spark on a loaded machine
    assert run["state"] == "success", server.task_logs()
    return run


def asset_events(server, uri: str) -> list[dict]:
    """Every event of the table's Asset, oldest first."""
    assets = api("GET", f"{server.api}/assets", params={"uri_pattern": uri}).json()["assets"]
    (asset,) = [a for a in assets if a["uri"] == uri]
    events = api("GET", f"{server.api}/assets/events", params={"asset_id": asset["id"], "limit": 100}).json()
    return sorted(events["asset_events"], key=lambda e: e["id"])


def returned(server, dag_id: str) -> list:
    """What the downstream DAG's task read from `triggering_asset_events`, per successful run."""
    runs = api("GET", f"{server.api}/dags/{dag_id}/dagRuns", params={"state": "success"}).json()["dag_runs"]
    url = f"{server.api}/dags/{dag_id}/dagRuns/{{}}/taskInstances/consume/xcomEntries/return_value"
    values = [api("GET", url.format(run["dag_run_id"])).json()["value"] for run in runs]
    return [json.loads(v) if isinstance(v, str) else v for v in values]


def consumed(server, dag_id: str) -> list[dict]:
    """The asset events the downstream DAG's successful runs were triggered by."""
    runs = api("GET", f"{server.api}/dags/{dag_id}/dagRuns", params={"state": "success"}).json()["dag_runs"]
    return [
        event
        for run in runs
        for event in api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run['dag_run_id']}/upstreamAssetEvents").json()[
            "asset_events"
        ]
    ]


def test_promotions_emit_the_tables_asset_events_and_trigger_downstream_dags(make_pipeline, db, ledgered, tmp_path):
    env = make_pipeline(partitions=2)
    settings, pipeline = env.settings, env.pipeline
    produce(settings.bootstrap_servers, env.topic, [*sample_events(30, seed=21), b"not json"])
    params = conninfo_to_dict(settings.database_url)
    uri = (
        f"postgres://{params.get('host') or 'localhost'}:{params.get('port') or 5432}/{params['dbname']}/"
        f"{pipeline.target_schema}/{pipeline.target_table}"
    )
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "kafka2pg_pipelines.py", dags)
    (dags / "downstream.py").write_text(DOWNSTREAM.format(name=pipeline.name, uri=uri, alias=pipeline.asset_alias))
    extra = {
        "KAFKA2PG_PIPELINES": str(settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": settings.database_url,
        "AIRFLOW_CONN_KAFKA2PG_SPARK": '{"conn_type": "spark", "host": "local[1]"}',
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",  # the live DAG (no schedule); replay DAG stays paused
    }
    on_table, on_alias = f"{pipeline.name}_on_table", f"{pipeline.name}_on_alias"
    with running_airflow(tmp_path / "airflow", settings.database_url, extra) as server:
        for dag_id in (pipeline.dag_id, pipeline.replay_dag_id, on_table, on_alias):
            wait_for(
                lambda dag_id=dag_id: api("GET", f"{server.api}/dags/{dag_id}").ok,
                timeout_s=180,
                what=f"DAG {dag_id} parsed",
            )
        # 1. One run promoting two batches: the Spark job promotes both, `promote` confirms and announces them.
        live = trigger(server, pipeline.dag_id, {"batches_per_run": 2, "max_records_per_batch": 20})
        batches = [
            r[0]
            for r in db.execute(
                "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND state = 'promoted' ORDER BY 1",
                (pipeline.name,),
            )
        ]
        assert len(batches) == 2
        expected = ledgered(*batches)
        assert (expected["rows"], expected["quarantined"]) == (30, 1)
        for dag_id in (on_table, on_alias):
            wait_for(lambda dag_id=dag_id: consumed(server, dag_id), what=f"{dag_id} run on the event")
            assert [e["extra"] for e in consumed(server, dag_id)] == [expected]
            assert returned(server, dag_id) == [[expected]]

        # 2. A run with nothing to load announces nothing; 3. a replay announces the replaced range.
        trigger(server, pipeline.dag_id, {})
        assert api("PATCH", f"{server.api}/dags/{pipeline.replay_dag_id}", json={"is_paused": False}).ok
        replayed = expected["ranges"][:1]
        replay = trigger(server, pipeline.replay_dag_id, {"offset_ranges": replayed})
        events = asset_events(server, uri)

    (replay_batch,) = [
        r[0] for r in db.execute("SELECT batch_id FROM kafka2pg.replays WHERE pipeline = %s", (pipeline.name,))
    ]
    assert [(e["source_dag_id"], e["source_task_id"], e["source_run_id"]) for e in events] == [
        (pipeline.dag_id, "promote", live["dag_run_id"]),
        (pipeline.replay_dag_id, "finish", replay["dag_run_id"]),
    ]
    assert [e["extra"] for e in events] == [expected, ledgered(replay_batch)]
    assert events[1]["extra"]["kind"] == "replay" and events[1]["extra"]["ranges"] == replayed
    password = params.get("password")
    assert not password or all(password not in str(e) for e in events)
