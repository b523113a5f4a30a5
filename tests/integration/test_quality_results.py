"""Each batch's quality result lives in PostgreSQL with its verdict: the report (Airflow page,
`kafka2pg report --html`) is rendered from it, and the operator's pages read the ledger."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kafka2pg import cli, quality
from kafka2pg.data_docs import write_report
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import QualityGateFailed
from kafka2pg.locations import COMMAND
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.staging import stage_batch
from kafka2pg.web import app, dag_reader, require_airflow_user


@pytest.fixture
def pages(monkeypatch):
    """The plugin's app with a signed-in user who may read every DAG (Airflow's token and DAG
    checks are the e2e and unit tests')."""
    app.dependency_overrides[require_airflow_user] = lambda: "operator"
    app.dependency_overrides[dag_reader] = lambda: lambda dag_id: True
    yield lambda env: _client(env, monkeypatch)
    app.dependency_overrides.clear()


def _client(env, monkeypatch) -> TestClient:
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    return TestClient(app, root_path="/kafka2pg")


def stored(db, batch_id: int) -> tuple[str, dict] | None:
    return db.execute(
        "SELECT verdict, result FROM kafka2pg.quality_results WHERE batch_id = %s", (batch_id,)
    ).fetchone()


def cells(page: str, row_attribute: str) -> str:
    """The text of the table row marked with `row_attribute` (e.g. data-batch="3"), tags stripped."""
    row = re.search(rf"<tr[^>]*{re.escape(row_attribute)}[^>]*>(.*?)</tr>", page, re.S)
    assert row, f"no row {row_attribute} in {page[:2000]}"
    return " | ".join(re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S))


def test_the_report_is_stored_with_the_batch_and_rendered_from_the_database(
    make_pipeline, run_batch, db, pages, tmp_path, capsys
):
    env = make_pipeline(partitions=1)
    good = list(sample_events(4, seed=71))
    produce(env.settings.bootstrap_servers, env.topic, [*good, b"{not json", good[1]], key_field=None)
    result = run_batch(env)
    assert (result.promoted, result.quarantined) == (4, 2)
    verdict, payload = stored(db, result.batch_id)
    assert verdict == "promotable" and payload["batch_id"] == result.batch_id
    assert list(payload["counts"].items()) == [  # in the gate's order, as the report shows them
        ("records read", 6),
        ("accepted (to promote)", 4),
        ("to quarantine", 2),
        ("business-key duplicates found", 1),
    ]
    checks = {c["check"]: c for c in payload["checks"]}
    assert checks["business_key_unique_in_batch"]["flagged"] == 1
    assert payload["expectations"] and all(e["success"] for e in payload["expectations"])

    # The files are an export of the stored result; without them the report is still there.
    report_path = Path(
        db.execute("SELECT report_path FROM kafka2pg.batches WHERE batch_id = %s", (result.batch_id,)).fetchone()[0]
    )
    assert json.loads(report_path.with_suffix(".json").read_text()) == payload
    report_path.unlink()
    report_path.with_suffix(".json").unlink()

    client = pages(env)
    out = tmp_path / "exported.html"
    name = env.pipeline.name
    assert (
        cli.main(["report", "--pipeline", name, "--batch-id", str(result.batch_id), "--html", "--out", str(out)]) == 0
    )
    exported = out.read_text()
    assert "PROMOTABLE" in exported and "business_key_unique_in_batch" in exported
    assert '<td>to quarantine</td><td class="num">2</td>' in exported
    page = client.get(f"/pipelines/{name}/batches/{result.batch_id}/report")
    assert page.status_code == 200 and page.text == exported, "the page and the export render the same stored result"
    assert client.get(f"/pipelines/{name}/batches/{result.batch_id + 1000}/report").status_code == 404
    capsys.readouterr()
    assert cli.main(["report", "--pipeline", name, "--batch-id", str(result.batch_id + 1000), "--html"]) == 2
    assert cli.main(["report", "--pipeline", name, "--batch-id", str(result.batch_id + 1000)]) == 2
    assert f"batch {result.batch_id + 1000} does not exist in kafka2pg.batches" in capsys.readouterr().err
    # A batch whose export was never recorded (files not written) still has its summary and report.
    db.execute("UPDATE kafka2pg.batches SET report_path = NULL WHERE batch_id = %s", (result.batch_id,))
    capsys.readouterr()
    assert cli.main(["report", "--pipeline", name]) == 0
    summary = capsys.readouterr().out
    assert f"batch {result.batch_id} (promoted): quality report in the database ({COMMAND} report --html" in summary
    assert "caught and quarantined (of 6 records read): refused by admission or PostgreSQL: 1;" in summary
    assert "business_key_unique_in_batch: 1" in summary

    batches = client.get(f"/pipelines/{name}/batches").text
    row = cells(batches, f'data-batch="{result.batch_id}"')
    assert row.startswith(f"{result.batch_id} | live | promoted | p0[0,6) | 6 | 6 | 4 | 2 | none | ")
    quarantine = client.get(f"/pipelines/{name}/batches/{result.batch_id}/quarantine").text
    assert "value is not valid JSON" in cells(quarantine, 'data-offset="0:4"')
    assert "duplicate business key within batch" in cells(quarantine, 'data-offset="0:5"')
    # The same records from the command line, and the report exported without naming the batch.
    capsys.readouterr()
    assert cli.main(["quarantine", "--pipeline", name]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == f"pipeline {name} (all batches): 2 quarantined record(s)"
    assert listed[1].split() == ["batch", "partition", "offset", "raw", "bytes", "reason"]
    assert listed[2].split()[:4] == [str(result.batch_id), "0", "4", str(len(b"{not json"))]
    assert "value is not valid JSON" in listed[2] and "duplicate business key within batch" in listed[3]
    assert cli.main(["quarantine", "--pipeline", name, "--batch-id", str(result.batch_id), "--limit", "1"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    shown = "2 quarantined record(s), 1 shown (--limit): by partition and offset"  # one batch's
    assert head == f"pipeline {name} (batch {result.batch_id}): {shown}"
    assert cli.main(["quarantine", "--pipeline", name, "--limit", "1"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert (
        head == f"pipeline {name} (all batches): 2 quarantined record(s), 1 shown (--limit): the newest batches first"
    )
    assert cli.main(["quarantine", "--pipeline", name, "--batch-id", str(result.batch_id + 1000)]) == 2
    latest = tmp_path / "latest.html"
    assert cli.main(["report", "--pipeline", name, "--html", "--out", str(latest)]) == 0
    assert latest.read_text() == exported


def test_a_rejected_batch_keeps_its_result_with_the_verdict(make_pipeline, spark, db, pages):
    env = make_pipeline(partitions=1, duplicate_policy="fail")
    events = list(sample_events(3, seed=72))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[0]], key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    with pytest.raises(QualityGateFailed):
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]
    verdict, payload = stored(db, batch.batch_id)
    assert (state, verdict, payload["verdict"]) == ("rejected", "rejected", "rejected")
    failed = [c["check"] for c in payload["checks"] if not c["success"]]
    assert failed == ["business_key_unique_in_batch"]
    page = pages(env).get(f"/pipelines/{env.pipeline.name}/batches/{batch.batch_id}/report").text
    assert "REJECTED" in page and "business_key_unique_in_batch" in page


def test_the_overview_shows_what_status_json_shows_and_batches_page_by_key(make_pipeline, run_batch, pages, capsys):
    env = make_pipeline(partitions=2, max_records_per_batch=10)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(25, seed=73))
    promoted = []
    while (result := run_batch(env)) is not None:
        promoted.append(result.batch_id)
    assert len(promoted) == 3
    capsys.readouterr()
    client = pages(env)
    assert cli.main(["status", "--pipeline", env.pipeline.name, "--json"]) == 0
    (status,) = json.loads(capsys.readouterr().out)
    overview = client.get("/")
    assert overview.status_code == 200
    for partition in status["partitions"]:
        row = cells(overview.text, f'data-partition="{partition["partition"]}"').split(" | ")
        expected = ["next_offset", "last_stable_offset", "low_watermark", "high_watermark", "lag", "margin"]
        assert row[1:7] == [str(partition[k]) for k in expected] and row[7] == partition["time_to_loss"]
        assert partition["lag"] == 0 and partition["time_to_loss"] == "caught up"
    assert sum(p["next_offset"] for p in status["partitions"]) == 25
    assert status["last_batch"]["batch_id"] == promoted[-1] and status["last_batch"]["state"] == "promoted"
    assert f'>{promoted[-1]}</a>: <span class="state">promoted</span>' in overview.text

    first = client.get(f"/pipelines/{env.pipeline.name}/batches", params={"limit": 2}).text
    assert re.findall(r'data-batch="(\d+)"', first) == [str(b) for b in promoted[:0:-1]]
    older = re.search(r'href="([^"]+)">older batches', first).group(1).replace("&amp;", "&")
    assert older.startswith("/kafka2pg/pipelines/")
    second = client.get(older.removeprefix("/kafka2pg")).text
    assert re.findall(r'data-batch="(\d+)"', second) == [str(promoted[0])]


def test_a_batch_staged_again_after_its_staging_was_lost_has_no_report_until_validated_again(
    make_pipeline, spark, db, monkeypatch, capsys
):
    """Its checks and stored result are gone with its staging rows: `report` and `report --html`
    both say no report yet, instead of one pointing at the stale file of the rows read before."""
    from psycopg import sql

    from kafka2pg.report import quality_summary

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(5, seed=73)))
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert f"batch {batch.batch_id} (validated): quality report " in quality_summary(env.settings, env.pipeline)
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(sql.SQL("DELETE FROM {} WHERE batch_id = %s").format(staging), (batch.batch_id,))  # lost

    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    assert quality_summary(env.settings, env.pipeline) == f"pipeline {env.pipeline.name}: no quality report yet"
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()
    assert cli.main(["report", "--html", "--pipeline", env.pipeline.name]) == 1
    assert "no quality report yet" in capsys.readouterr().err

    validate_batch(env.settings, env.pipeline, batch.batch_id)
    said = quality_summary(env.settings, env.pipeline)
    assert (
        f"batch {batch.batch_id} (validated): quality report " in said
        and "verdict: promotable; " in said
        and " checks, 0 failed" in said
    ), said
    assert cli.main(["report", "--html", "--pipeline", env.pipeline.name]) == 0


def test_the_exported_report_is_the_batchs_latest_verdict_when_it_was_validated_again_meanwhile(
    make_pipeline, spark, db, monkeypatch
):
    """A gate whose file export came after a later verdict of the same batch (staged again and
    validated by a newer attempt, whose export finished first) exports that later verdict over
    its own files, and report_path names them: the files never show a verdict the batch no longer has."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(5, seed=72)))
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    exports: list[dict] = []

    def later_verdict_first(state_dir, pipeline, payload):
        if not exports:  # the later attempt's verdict is committed while this one's files are written
            later = {**payload, "generated_at": "later", "counts": {**payload["counts"], "to quarantine": 99}}
            db.execute(
                "UPDATE kafka2pg.quality_results SET result = %s, validated_at = now() WHERE batch_id = %s",
                (json.dumps(later), batch_id),
            )
        exports.append(payload)
        return write_report(state_dir, pipeline, payload)

    monkeypatch.setattr(quality, "write_report", later_verdict_first)
    result = validate_batch(env.settings, env.pipeline, batch_id)

    assert [e["generated_at"] == "later" for e in exports] == [False, True]
    (path,) = db.execute("SELECT report_path FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()
    assert path == str(result.report)
    exported = json.loads(Path(path).with_suffix(".json").read_text())
    assert exported == stored(db, batch_id)[1] and exported["counts"]["to quarantine"] == 99
