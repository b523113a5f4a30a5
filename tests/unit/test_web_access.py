"""The operator pages as a user sees them: only pipelines whose DAG Airflow's auth manager lets the
user read (the others absent from the overview, 403 on their pages), one pipeline's database
error shown in its section, and the pipelines' statuses asked for at the same time.

The auth manager and the pipelines' services are fakes here; the e2e test runs the pages on a
real api-server behind a real login."""

from __future__ import annotations

import base64
import hashlib
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
import yaml
from fastapi.testclient import TestClient

import kafka2pg.connections
import kafka2pg.database
import kafka2pg.status
from kafka2pg.status import PipelineStatus
from kafka2pg.web import app, require_airflow_user

ROOT = Path(__file__).resolve().parents[2]
READABLE = ("alpha", "beta")


class FakeAuthManager:
    """Lets its user read the DAGs of the READABLE pipelines, records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, object, str]] = []

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        self.asked.append((method, user, details.id))
        return method == "GET" and access_entity is None and details.id in {f"kafka2pg_{n}" for n in READABLE}


@pytest.fixture
def client(tmp_path, monkeypatch):
    (orders,) = yaml.safe_load((ROOT / "dags/pipelines.yaml").read_text())["pipelines"]
    pipelines = [{**orders, "name": n, "topic": n, "target_table": f"public.{n}"} for n in ("alpha", "beta", "gamma")]
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": pipelines}))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(tmp_path / "pipelines.yaml"))

    manager = FakeAuthManager()
    monkeypatch.setattr("airflow.api_fastapi.app.get_auth_manager", lambda: manager)
    monkeypatch.setitem(app.dependency_overrides, require_airflow_user, lambda: "alice")
    # Every readable pipeline's status must be under way before any returns: a serial overview
    # breaks the barrier (after its deadline) instead of rendering.
    started = threading.Barrier(len(READABLE), timeout=30)

    def status(settings, pipeline, conn) -> PipelineStatus:
        started.wait()
        if pipeline.name == "beta":
            raise psycopg.errors.UndefinedColumn('column "staged_at" does not exist')
        return PipelineStatus(pipeline.name, pipeline.topic, "public.alpha", (), None, (), None, None)

    @contextmanager
    def connect(url, **_):
        yield url

    monkeypatch.setattr(kafka2pg.connections, "settings_for", lambda p: SimpleNamespace(database_url=p.name))
    monkeypatch.setattr(kafka2pg.database, "connect", connect)
    monkeypatch.setattr(kafka2pg.status, "pipeline_status", status)
    return TestClient(app), manager


def test_the_overview_shows_only_readable_pipelines_each_with_its_own_database_error(client):
    http, manager = client
    page = http.get("/")
    assert page.status_code == 200, page.text
    assert 'id="pipeline-alpha"' in page.text and "no batch yet" in page.text
    assert 'id="pipeline-beta"' in page.text
    assert 'class="error">UndefinedColumn: column &quot;staged_at&quot; does not exist' in page.text
    assert "gamma" not in page.text
    assert sorted(manager.asked) == [("GET", "alice", f"kafka2pg_{n}") for n in ("alpha", "beta", "gamma")]


@pytest.mark.parametrize(
    "path",
    [
        "/pipelines/{}/batches",
        "/pipelines/{}/history",
        "/pipelines/{}/batches/1/report",
        "/pipelines/{}/batches/1/quarantine",
    ],
)
def test_a_pipeline_page_of_a_dag_the_user_may_not_read_is_forbidden(client, path):
    http, manager = client
    forbidden = http.get(path.format("gamma"))
    assert forbidden.status_code == 403 and "kafka2pg_gamma" in forbidden.text
    assert manager.asked == [("GET", "alice", "kafka2pg_gamma")]
    assert http.get(path.format("nope")).status_code == 404


def test_a_page_whose_database_lacks_a_migration_answers_503_naming_it(client, monkeypatch):
    http, _ = client

    def batches_page(*args):
        raise psycopg.errors.UndefinedColumn("column b.staged_at does not exist")

    monkeypatch.setattr("kafka2pg.browse.batches_page", batches_page)
    page = http.get("/pipelines/alpha/batches")
    assert page.status_code == 503, page.text
    assert "UndefinedColumn: column b.staged_at does not exist" in page.text and "kafka2pg migrate" in page.text
    assert "kafka2pg overview" in page.text  # the pages' own frame, with the way back


def test_a_page_whose_configuration_is_wrong_answers_500_naming_it(client, monkeypatch):
    """A broken pipelines file or connection is not a service that may come back: not a 503."""
    from kafka2pg.exceptions import ConfigError

    http, _ = client

    def batches_page(*args):
        raise ConfigError("connection 'kafka2pg_postgres': no host")

    monkeypatch.setattr("kafka2pg.browse.batches_page", batches_page)
    page = http.get("/pipelines/alpha/batches")
    assert page.status_code == 500, page.text
    assert "a configuration error" in page.text
    assert "ConfigError: connection &#x27;kafka2pg_postgres&#x27;: no host" in page.text


def test_a_pipeline_in_error_is_named_with_its_error_and_the_others_still_show(client, tmp_path, monkeypatch):
    http, _ = client
    path = tmp_path / "pipelines.yaml"
    pipelines = yaml.safe_load(path.read_text())["pipelines"]
    pipelines[0]["columns"] = [{**c} for c in pipelines[0]["columns"]]
    pipelines[0]["columns"][0]["type"] = "nosuchtype"  # alpha's own
    path.write_text(yaml.safe_dump({"pipelines": pipelines}))
    monkeypatch.setattr(  # beta alone now: no barrier to meet
        kafka2pg.status,
        "pipeline_status",
        lambda s, p, c: PipelineStatus(p.name, p.topic, "public.beta", (), None, (), None, None),
    )
    page = http.get("/")
    assert page.status_code == 200, page.text
    alpha = page.text[page.text.index('id="pipeline-alpha"') :]
    assert alpha.startswith('id="pipeline-alpha">pipeline alpha</h2><p class="error">ConfigError: ')
    assert "nosuchtype" in alpha and "beta" not in alpha  # after the others
    beta = page.text[page.text.index('id="pipeline-beta"') : page.text.index('id="pipeline-alpha"')]
    assert "no batch yet" in beta and "error" not in beta
    assert "gamma" not in page.text
    broken = http.get("/pipelines/alpha/batches")
    assert broken.status_code == 500 and "nosuchtype" in broken.text


def test_the_overview_section_shows_not_ready_and_stuck_as_alarms_and_other_open_batches_escaped():
    from datetime import UTC, datetime

    from kafka2pg.stuck import OpenBatch
    from kafka2pg.web import _status_section

    since = datetime(2026, 1, 2, tzinfo=UTC)
    wedged = OpenBatch("alpha", 7, "live", "validated", None, "run-2", since, "promote", 2, since, "E: <no>", "p0[0,9)")
    waiting = OpenBatch("alpha", 8, "live", "staged", 7, "run-2", since, None, 0, None, None, "p0[9,12)")
    status = PipelineStatus(
        "alpha", "alpha", "public.alpha", (), None, (wedged, waiting), "missing <grant>", "kafka2pg_runtime"
    )
    page = _status_section("/kafka2pg", status)
    alarms = re.findall(r'<p class="alarm">(.*?)</p>', page)
    assert (
        alarms[0]
        == "NOT READY for a run as role &#x27;kafka2pg_runtime&#x27; (this page&#x27;s): missing &lt;grant&gt;"
    )
    assert alarms[1].startswith("STUCK: pipeline &#x27;alpha&#x27; batch 7 (validated") and "E: &lt;no&gt;" in alarms[1]
    opened = re.findall(r'<p class="open">(.*?)</p>', page)
    assert opened[0].startswith("open: batch 8 (live, staged, planned after batch 7) p0[9,12)") and len(opened) == 1
    assert "open: batch 7" not in page


def test_a_quarantined_records_bytes_show_escaped_on_a_page_with_no_script_allowed(client, monkeypatch):
    """A record's bytes and its reason may hold markup, NUL (an HTML parse error) and a terminal's
    escape sequences (which a page's source read with curl would run): escaped, as the CLI shows
    them; and every answer forbids scripts and frames from elsewhere, error pages included: the
    one script allowed is the pages' own, by its hash."""
    from kafka2pg.browse import QuarantineRow

    http, _ = client
    hostile = b'<script>alert(1)</script>"><img src=x onerror=alert(1)>\x00\x1b[31m\x1b]0;title\x07\xff\xe2\x80\xa8'
    row = QuarantineRow(0, 7, None, "value is not valid JSON: \x1b[2J<b>\u2028", b"\x1b[31mkey", hostile)
    monkeypatch.setattr("kafka2pg.browse.batch_state", lambda conn, pipeline, batch_id: "promoted")
    monkeypatch.setattr("kafka2pg.browse.quarantine_page", lambda *args: [row])
    page = http.get("/pipelines/alpha/batches/1/quarantine")
    assert page.status_code == 200, page.text
    shown = re.search(r'<tr data-offset="0:7">(.*?)</tr>', page.text, re.S).group(1)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in shown
    assert "\\x00\\x1b[31m\\x1b]0;title\\x07\\xff\\u2028" in shown, shown
    assert "value is not valid JSON: \\x1b[2J&lt;b&gt;\\u2028" in shown and "\\x1b[31mkey" in shown, shown
    assert not any(c in page.text for c in "\x00\x1b\x07\u2028"), page.text
    for answer in (page, http.get("/pipelines/gamma/batches"), http.get("/pipelines/nope/batches")):
        policy = answer.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "frame-ancestors 'self'" in policy, answer.headers
        scripts = re.findall(r"<script>(.*?)</script>", page.text, re.S)
        assert len(scripts) == 1, page.text
        digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
        assert re.findall(r"script-src ([^;]*);", policy) == [f"'sha256-{digest}'"], policy
        assert answer.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(
    "query",
    [
        "/pipelines/alpha/batches?before=9223372036854775808",
        "/pipelines/alpha/history?before_at=2026-01-01T00:00:00Z&before_source=replays&before_id=-9223372036854775809",
        "/pipelines/alpha/batches/1/quarantine?after_partition=0&after_offset=99999999999999999999",
    ],
)
def test_an_id_or_offset_beyond_postgresqls_bigint_is_the_requests_mistake_not_a_failed_service(client, query):
    """It used to reach PostgreSQL, whose refusal answered 503 "a service failed"."""
    http, _ = client
    answer = http.get(query)
    assert answer.status_code == 422, answer.text


def test_the_quality_report_shows_an_errors_quoted_bytes_escaped():
    """A GX error or a check's details may quote a record's value: its markup and control
    characters show as text, as on the other pages and in the CLI."""
    from kafka2pg.config import Column, Pipeline
    from kafka2pg.data_docs import render_html, report_payload

    quoted = "could not convert '\x1b]0;retitled\x07<script>x</script>\x00' to float"
    payload = report_payload(
        Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),)),
        7,
        verdict="rejected",
        expectations=[
            {
                "expectation": "expect_column_values_to_be_between",
                "column": "n",
                "meaning": "in range",
                "success": False,
                "unexpected": 1,
                "sample_offsets": [],
                "error": quoted,
            }
        ],
        checks=[{"check": "c", "success": True, "unexpected": 0, "flagged": 0, "details": "key \u2028\x1b[2J"}],
        counts={"records read": 1},
        gx_version="1.0",
    )
    page = render_html(payload)
    assert "could not convert &#x27;\\x1b]0;retitled\\x07&lt;script&gt;x&lt;/script&gt;\\x00&#x27; to float" in page
    assert "key \\u2028\\x1b[2J" in page
    assert not any(c in page for c in "\x00\x1b\x07\u2028"), page
