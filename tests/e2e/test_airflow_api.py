"""The replay DAG driven through a real Airflow API server's REST API: a replay triggered with
Params (no logical date), a 3-date backfill created twice, and a screenshot of the trigger form."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from airflow_server import api, running_airflow, wait_for
from cdp_screenshot import screenshot_trigger_form
from psycopg import sql

from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.devtools.producer import produce, sample_events

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".cache" / "test-artifacts"
DAYS = 3


def snapshot(db, env) -> list:
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    return db.execute(
        sql.SQL("SELECT kafka_partition, kafka_offset, event_id, amount, event_time FROM {} ORDER BY 1, 2").format(
            table
        )
    ).fetchall()


def replays(db, env) -> list[tuple]:
    return db.execute(
        "SELECT operation, window_from, target_rows_before, target_rows_after, requested_by FROM kafka2pg.replays"
        " WHERE pipeline = %s ORDER BY replay_id",
        (env.pipeline.name,),
    ).fetchall()


def finished_run(server, dag_id: str, run_id: str) -> dict:
    def done():
        run = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}").json()
        return run if run["state"] in ("success", "failed") else None

    return wait_for(done, what=f"run {run_id}")


def finished_backfill(server, dag_id: str, first: str, last: str) -> list[dict]:
    def done():
        runs = api(
            "GET",
            f"{server.api}/dags/{dag_id}/dagRuns",
            params={"run_type": "backfill", "logical_date_gte": first, "logical_date_lte": last, "limit": 100},
        ).json()["dag_runs"]
        return runs if len(runs) == DAYS and all(r["state"] in ("success", "failed") for r in runs) else None

    return wait_for(done, timeout_s=600, what=f"backfill {first}..{last}")


def test_replay_trigger_and_backfill_through_the_rest_api(make_pipeline, run_batch, db, tmp_path):
    env = make_pipeline(max_records_per_batch=200)
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    first_day = today - timedelta(days=DAYS + 1)
    events = [
        event
        for day in range(DAYS)
        for event in sample_events(40, seed=50 + day, start=first_day + timedelta(days=day, hours=2))
    ]
    produce(env.settings.bootstrap_servers, env.topic, events, timestamp_field="ts")
    while run_batch(env) is not None:
        pass
    loaded = snapshot(db, env)
    assert len(loaded) == len(events)
    dag_id = env.pipeline.replay_dag_id
    extra = {
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "AIRFLOW_CONN_KAFKA2PG_SPARK": '{"conn_type": "spark", "host": "local[1]"}',
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
    }
    with running_airflow(tmp_path / "airflow", env.settings.database_url, extra) as server:
        details = wait_for(
            lambda: (r := api("GET", f"{server.api}/dags/{dag_id}/details")).ok and r.json(),
            timeout_s=180,
            what=f"DAG {dag_id} parsed",
        )
        assert details["is_paused"] is True, "the replay DAG is created paused"
        assert {"mode", "offset_ranges", "from_time", "to_time", "reason"} <= set(details["params"])
        # Backfill runs stay queued on a paused DAG; its own scheduled runs replay nothing.
        assert api("PATCH", f"{server.api}/dags/{dag_id}", json={"is_paused": False}).ok

        # Invalid Params are refused by the API before any run exists.
        runs_url = f"{server.api}/dags/{dag_id}/dagRuns"
        bad = api("POST", runs_url, json={"logical_date": None, "conf": {"mode": "delete"}})
        assert bad.status_code == 400 and "mode" in bad.text

        # 1. A replay triggered with Params and no logical date.
        conf = {"mode": "replace", "offset_ranges": [{"partition": 0, "start": 0, "end": 10}], "reason": "api test"}
        created = api("POST", f"{server.api}/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
        assert created.ok, created.text
        run = finished_run(server, dag_id, created.json()["dag_run_id"])
        assert run["state"] == "success", server.task_logs()
        assert run["logical_date"] is None
        assert replays(db, env)[0][0] == "replace" and replays(db, env)[0][2:4] == (10, 10)

        # 2. A backfill over 3 dates, then the same backfill again (reprocessing completed runs).
        first, last = first_day.isoformat(), (first_day + timedelta(days=DAYS - 1)).isoformat()
        body = {
            "dag_id": dag_id,
            "from_date": first,
            "to_date": last,
            "reprocess_behavior": "none",
            "max_active_runs": 3,
            "run_backwards": False,
            "dag_run_conf": {"reason": "backfill test"},
        }
        snapshots = []
        for _ in range(2):
            response = api("POST", f"{server.api}/backfills", json=body)
            assert response.ok, response.text
            runs = finished_backfill(server, dag_id, first, last)
            assert all(r["state"] == "success" for r in runs), server.task_logs()
            snapshots.append(snapshot(db, env))
            # Completes the finished backfill now (the scheduler would take up to 30 s) so the next can start.
            api("PUT", f"{server.api}/backfills/{response.json()['id']}/cancel")
            body["reprocess_behavior"] = "completed"

        # 3. The trigger form, as a user sees it.
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "replay-trigger-form.png"
        text = screenshot_trigger_form(server.url, dag_id, shot)
        for label in ("mode", "offset_ranges", "from_time", "to_time", "reason", "Run Parameters"):
            assert label in text, text
        assert shot.stat().st_size > 20_000

    assert snapshots[0] == snapshots[1] == loaded, "a backfill run twice leaves the target identical"
    windows = sorted(r[1] for r in replays(db, env) if r[1] is not None)
    assert windows == sorted([first_day + timedelta(days=d) for d in range(DAYS)] * 2)
    assert all(r[2] == r[3] == len(events) // DAYS for r in replays(db, env) if r[1] is not None)
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits), format_audit(env.pipeline, audits)
