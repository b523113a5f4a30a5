"""The kafka2pg plugin on a real Airflow (api-server, scheduler) with login required, after a run the
signed-in operator triggered promoted a batch: the overview shows what
`kafka2pg status --json` shows, a batch's report page its checks, the batches page its state,
ranges and run (linked to the Airflow run), the history page an undo done with the CLI, and
anonymous callers are refused; screenshots of the pages as a signed-in browser shows them."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from urllib.parse import quote

from airflow_server import api, running_airflow, wait_for
from cdp_screenshot import click_in_frame, screenshot_page

from kafka2pg import cli
from kafka2pg.devtools.producer import produce, sample_events

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".cache" / "test-artifacts"
# A table's rows as the browser's DOM holds them: each row's cells' text and its links.
ROWS = """[...document.querySelectorAll('#TABLE tr[data-KEY]')].map(row => ({
    key: row.dataset.KEY,
    cells: [...row.cells].map(cell => cell.innerText.trim()),
    links: [...row.querySelectorAll('a')].map(
        a => ({text: a.innerText, href: a.getAttribute('href'), target: a.target})),
}))"""


def row_cells(page: str, row_attribute: str) -> list[str]:
    row = re.search(rf"<tr[^>]*{re.escape(row_attribute)}[^>]*>(.*?)</tr>", page, re.S)
    assert row, f"no row {row_attribute} in {page[:3000]}"
    return re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)


def test_plugin_pages_behind_airflow_login_agree_with_the_cli(make_pipeline, db, tmp_path, monkeypatch, capsys):
    env = make_pipeline(partitions=2)
    events = list(sample_events(30, seed=81))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[3]])
    services = {
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
    }
    for name, value in services.items():
        monkeypatch.setenv(name, value)

    password = secrets.token_urlsafe(12)
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"operator": password}))
    extra = {
        **services,
        "AIRFLOW_CONN_KAFKA2PG_SPARK": '{"conn_type": "spark", "host": "local[1]"}',
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        # Logins required: with all-admins, Airflow signs every request in, anonymous ones too.
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "operator:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
    }
    name, dag_id = env.pipeline.name, env.pipeline.dag_id
    with running_airflow(tmp_path / "airflow", env.settings.database_url, extra) as server:
        overview_url = f"{server.url}/kafka2pg/"
        for url in (overview_url, f"{server.url}/kafka2pg/pipelines/{name}/batches"):
            assert api("GET", url).status_code == 401, f"{url} answered an anonymous caller"
        schema = api("GET", f"{server.url}/kafka2pg/openapi.json")  # FastAPI serves it outside dependencies
        assert schema.status_code != 200 and '"paths"' not in schema.text, schema.text[:200]
        forged = api("GET", overview_url, cookies={"_token": "not-a-token"})
        assert forged.status_code == 403

        login = api("POST", f"{server.url}/auth/token", json={"username": "operator", "password": password})
        assert login.status_code == 201, login.text
        token = login.json()["access_token"]
        bearer = {"Authorization": f"Bearer {token}"}
        plugins = api("GET", f"{server.api}/plugins", headers=bearer).json()
        (plugin,) = [p for p in plugins["plugins"] if p["name"] == "kafka2pg"]
        assert plugin["fastapi_apps"] == [
            {"app": "fastapi.applications.FastAPI", "url_prefix": "/kafka2pg", "name": "kafka2pg"}
        ]
        assert (
            plugin["external_views"][0]["href"] == "/kafka2pg/" and plugin["external_views"][0]["destination"] == "nav"
        )

        # The batch is promoted by a run the scheduler runs, triggered by the signed-in operator.
        wait_for(lambda: api("GET", f"{server.api}/dags/{dag_id}", headers=bearer).ok, 180, what=f"DAG {dag_id} parsed")
        created = api("POST", f"{server.api}/dags/{dag_id}/dagRuns", headers=bearer, json={"logical_date": None})
        assert created.ok, created.text
        run_id = created.json()["dag_run_id"]

        def finished():
            run = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}", headers=bearer).json()
            return run if run["state"] in ("success", "failed") else None

        assert wait_for(finished, 900, what=f"run {run_id}")["state"] == "success", server.task_logs()
        ((batch_id, promoted, quarantined),) = db.execute(
            "SELECT batch_id, rows_promoted, rows_quarantined FROM kafka2pg.batches"
            " WHERE pipeline = %s AND run_id = %s",
            (name, run_id),
        ).fetchall()
        assert (promoted, quarantined) == (30, 1)
        report_url = f"{server.url}/kafka2pg/pipelines/{name}/batches/{batch_id}/report"
        assert api("GET", report_url).status_code == 401
        links = api("GET", f"{server.api}/dags/{dag_id}/dagRuns/{run_id}/taskInstances/promote/links", headers=bearer)
        assert links.json()["extra_links"] == {"Quality report": report_url}, links.text
        capsys.readouterr()
        assert cli.main(["status", "--pipeline", name, "--json"]) == 0
        (status,) = json.loads(capsys.readouterr().out)

        overview = api("GET", overview_url, cookies={"_token": token})  # as the UI's frame sends it
        assert overview.status_code == 200, overview.text
        for partition in status["partitions"]:
            cells = row_cells(overview.text, f'data-partition="{partition["partition"]}"')
            keys = [
                "partition",
                "next_offset",
                "last_stable_offset",
                "low_watermark",
                "high_watermark",
                "lag",
                "margin",
            ]
            assert cells[:7] == [str(partition[k]) for k in keys] and cells[7] == partition["time_to_loss"]
        assert sum(p["next_offset"] for p in status["partitions"]) == 31 and all(
            p["lag"] == 0 for p in status["partitions"]
        )
        assert '<span class="state">promoted</span>' in overview.text

        report = api("GET", report_url, headers={"Authorization": f"Bearer {token}"})
        assert report.status_code == 200, report.text
        assert "PROMOTABLE" in report.text
        for check in ("business_key_unique_in_batch", "staged_rows_equal_records_read", "provenance_unique"):
            assert check in report.text, check
        quarantine = api(
            "GET", f"{server.url}/kafka2pg/pipelines/{name}/batches/{batch_id}/quarantine", cookies={"_token": token}
        )
        assert "duplicate business key within batch" in quarantine.text

        # As a signed-in browser shows them (the UI's session cookie).
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        cookie = {"name": "_token", "value": token}
        rows = ROWS.replace("TABLE", f"partitions-{name}").replace("KEY", "partition")
        shown = screenshot_page(overview_url, cookie, ARTIFACTS / "plugin-overview.png", read=rows)
        # The browser's DOM shows each partition's head, offsets, lag and margin as `status --json`.
        keys = ["partition", "next_offset", "last_stable_offset", "low_watermark", "high_watermark", "lag", "margin"]
        assert [row["cells"] for row in shown] == [
            [*(str(p[k]) for k in keys), p["time_to_loss"]] for p in status["partitions"]
        ], shown
        text = screenshot_page(report_url, cookie, ARTIFACTS / "plugin-quality-report.png")
        assert "business_key_unique_in_batch" in text
        assert (ARTIFACTS / "plugin-overview.png").stat().st_size > 10_000

        batches_url = f"{server.url}/kafka2pg/pipelines/{name}/batches"
        rows = ROWS.replace("TABLE", "batches").replace("KEY", "batch")
        (row,) = screenshot_page(batches_url, cookie, ARTIFACTS / "plugin-batches.png", read=rows)
        ranges = " ".join(f"p{p['partition']}[0,{p['next_offset']})" for p in status["partitions"] if p["next_offset"])
        assert row["key"] == str(batch_id) and row["cells"][1:8] == ["live", "promoted", ranges, "31", "31", "30", "1"]
        assert row["cells"][8] == "none", "every offset of the batch holds a record"
        run = f"/dags/{dag_id}/runs/{quote(run_id, safe='')}"
        assert {"text": run_id, "href": run, "target": "_top"} in row["links"]
        # In the UI, the page is in a sandboxed frame that may not navigate the window (target=_top
        # does nothing there): clicking the run id moves the UI itself to the run.
        clicked = click_in_frame(
            f"{server.url}/plugin/kafka2pg/kafka2pg/pipelines/{name}/batches",
            cookie,
            "a.run",
            f"location.pathname === {json.dumps(run)} && document.querySelectorAll('iframe').length === 0"
            f" && document.body.innerText.includes({json.dumps(run_id)})",
            ARTIFACTS / "plugin-run-link-followed.png",
        )
        assert clicked["before"]["frame"] == f"/kafka2pg/pipelines/{name}/batches", clicked
        assert clicked["after"]["top"] == run and clicked["after"]["frames"] == 0, clicked
        assert clicked["back"] == clicked["before"]["top"] == f"/plugin/kafka2pg/kafka2pg/pipelines/{name}/batches"

        capsys.readouterr()
        assert cli.main(["undo", "--pipeline", name, "--batch-id", str(batch_id), "--reason", "e2e", "--confirm"]) == 0
        history_url = f"{server.url}/kafka2pg/pipelines/{name}/history"
        rows = ROWS.replace("TABLE", "history").replace("KEY", "entry")
        (entry,) = screenshot_page(history_url, cookie, ARTIFACTS / "plugin-history.png", read=rows)
        assert entry["cells"][1:4] == ["undo", str(batch_id), ranges] and entry["cells"][5] == "e2e"
        assert entry["cells"][7] == "target rows 30 -> 0, quarantine rows 1 -> 0"
        assert api("GET", history_url).status_code == 401
