"""The operator's read-only pages in the Airflow UI (a FastAPI app the plugin mounts at /kafka2pg):
overview (what `kafka2pg status` shows), a pipeline's batches and history (replays, undos, resets), a
batch's quality report and quarantine.

Airflow mounts a plugin's app without authentication: every page here requires the caller's
Airflow JWT (the UI's `_token` cookie or an `Authorization: Bearer` header), checked by Airflow's
auth manager, and shows only the pipelines whose DAG the auth manager lets the caller read. Each
request reads the pipelines file and the pipelines' Airflow Connections then.
"""

from __future__ import annotations

import base64
import hashlib
import html
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING, Annotated
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from kafka2pg.exceptions import ConfigError, Kafka2PgError
from kafka2pg.locations import COMMAND
from kafka2pg.task_log import html_cell as _cell
from kafka2pg.task_log import html_text

if TYPE_CHECKING:
    from kafka2pg.config import Pipeline, Settings
    from kafka2pg.status import PipelineStatus

log = logging.getLogger(__name__)

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
# Pipelines whose status the overview asks Kafka and PostgreSQL for at the same time: one
# unreachable broker's timeout then delays the page once, not once per pipeline after it.
OVERVIEW_WORKERS = 4


async def require_airflow_user(request: Request) -> object:
    """The Airflow user of the request; 401/403 for an anonymous or invalid token, as Airflow's API answers."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    token = credentials if scheme.lower() == "bearer" and credentials else request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    user = await resolve_user_from_token(token)
    if not get_auth_manager().is_authorized_view(access_view=AccessView.WEBSITE, user=user):
        raise HTTPException(status_code=403, detail="Forbidden")
    return user


def dag_reader(user: Annotated[object, Depends(require_airflow_user)]) -> Callable[[str], bool]:
    """Whether the request's user may read a DAG (by id), as Airflow's auth manager decides."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    manager = get_auth_manager()
    return lambda dag_id: manager.is_authorized_dag(method="GET", details=DagDetails(id=dag_id), user=user)


MayRead = Annotated[Callable[[str], bool], Depends(dag_reader)]

app = FastAPI(
    title="kafka2pg", dependencies=[Depends(require_airflow_user)], docs_url=None, redoc_url=None, openapi_url=None
)


# Ids and offsets as PostgreSQL's bigint holds them: a value beyond is the request's mistake (422,
# as FastAPI answers any malformed parameter), not a failed service.
OptionalBigint = Annotated[int | None, Query(ge=-(2**63), le=2**63 - 1)]

# Airflow's UI shows the pages in a sandboxed frame that may not navigate the window: a link with
# target="_top" does nothing there. A run link clicked in a frame of the same origin (the UI's)
# therefore moves the UI itself to the run, as the UI's own router moves (a history entry and a
# popstate event, no reload); opened directly, or framed by another origin, the link is a link.
RUN_LINK_SCRIPT = """document.addEventListener("click", function (event) {
  var link = event.target.closest ? event.target.closest("a.run") : null;
  if (!link || window.top === window || event.button !== 0 ||
      event.ctrlKey || event.metaKey || event.shiftKey || event.altKey) return;
  try {
    var ui = window.top, state = ui.history.state, idx = state && typeof state.idx === "number" ? state.idx : 0;
    ui.history.pushState({usr: null, key: Math.random().toString(36).slice(2, 10), idx: idx + 1}, "", link.href);
    ui.dispatchEvent(new PopStateEvent("popstate", {state: ui.history.state}));
    event.preventDefault();
  } catch (e) {}
});"""
_RUN_LINK_HASH = base64.b64encode(hashlib.sha256(RUN_LINK_SCRIPT.encode()).digest()).decode()

# The pages show records' bytes and operators' words: escaped, and with no script but the run
# links' own (allowed by its hash), no frame and no outside resource allowed should anything
# slip through; only their inline style. Airflow's UI may frame them (its origin's own).
SECURITY_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src 'sha256-{_RUN_LINK_HASH}'; "
    "style-src 'unsafe-inline'; frame-ancestors 'self'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


@app.middleware("http")
async def _service_errors(request: Request, call_next):
    """A page whose PostgreSQL (or Kafka) fails answers 503 with the cause, not a bare 500; a ledger
    older than this version (a migration not applied) says so; a configuration error answers 500
    naming it. psycopg is imported only then:
    loading the plugin loads no database client."""
    try:
        return await call_next(request)
    except Exception as exc:
        import psycopg

        if not isinstance(exc, psycopg.Error | Kafka2PgError):
            raise
        log.warning("kafka2pg page %s: %s: %s", request.url.path, type(exc).__name__, exc)
        cause = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn):
            cause += f" (the ledger lacks a migration of this version: run `{COMMAND} migrate`)"
        # A configuration error (the pipelines file, a connection) is the deployment's to fix, not
        # a service that may come back: 500, named as such (its first line, to signed-in users only).
        configuration = isinstance(exc, ConfigError)
        title = "kafka2pg: a configuration error" if configuration else "kafka2pg: a service failed"
        page = _page(request, title, f'<p class="error">{html_text(cause)}</p>')
        page.status_code = 500 if configuration else 503
        return page


@app.middleware("http")
async def _security_headers(request: Request, call_next):
    """Every answer of the app's, its error pages included (added last: the outermost)."""
    response = await call_next(request)
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #1d2733; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.4em; }
table { border-collapse: collapse; margin-top: .5em; }
th, td { border: 1px solid #c9d1d9; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #eef2f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.risk td, .alarm { background: #fdecea; color: #b71c1c; font-weight: bold; }
.open { background: #fff8e1; }
.error { color: #b71c1c; } .meta { color: #57606a; font-size: .9em; } nav a { margin-right: 1em; }
"""


def _page(request: Request, title: str, body: str) -> HTMLResponse:
    home = _base(request)
    return HTMLResponse(
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html_text(title)}</title>'
        f'<style>{CSS}</style></head><body><nav><a href="{home}/">kafka2pg overview</a></nav>'
        f"<h1>{html_text(title)}</h1>{body}<script>{RUN_LINK_SCRIPT}</script></body></html>"
    )


def _base(request: Request) -> str:
    """Where the app is mounted (/kafka2pg), for links between its pages."""
    return html.escape(request.scope.get("root_path", "").rstrip("/"))


def _link(href: str, text: object) -> str:
    return f'<a href="{html.escape(href)}">{html_text(text)}</a>'


def _table(headers: list[str], rows: list[str], table_id: str) -> str:
    head = "".join(f"<th>{html_text(h)}</th>" for h in headers)
    return f'<table id="{table_id}"><tr>{head}</tr>{"".join(rows)}</table>'


def readable_pipelines(may_read: Callable[[str], bool]) -> tuple[list[Pipeline], dict[str, Exception]]:
    """The pipelines of the pipelines file whose DAG the user may read, in the file's order, and
    the errors of those in error (by name) whose DAG the user may read."""
    from kafka2pg.config import pipelines_file_from_env, read_pipelines

    pipelines, broken = read_pipelines(pipelines_file_from_env())
    errors = {name: e for name, e in broken.items() if "[" not in name and may_read(f"kafka2pg_{name}")}
    return [p for p in pipelines.values() if may_read(p.dag_id)], errors


def _pipeline(name: str, may_read: Callable[[str], bool]) -> tuple[Settings, Pipeline]:
    """The pipeline and its services; 404 for no such pipeline, 403 when its DAG is not the user's
    to read; a pipeline in error, its `ConfigError` (whatever the file's other pipelines hold)."""
    from kafka2pg.config import pipelines_file_from_env, read_pipelines
    from kafka2pg.connections import settings_for

    pipelines, broken = read_pipelines(pipelines_file_from_env())
    if name in broken and may_read(f"kafka2pg_{name}"):
        raise broken[name]
    if name not in pipelines:
        raise HTTPException(status_code=404, detail=f"no pipeline {name!r} in the pipelines file")
    if not may_read(pipelines[name].dag_id):
        raise HTTPException(status_code=403, detail=f"not allowed to read DAG {pipelines[name].dag_id!r}")
    return settings_for(pipelines[name]), pipelines[name]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"


@app.get("/", response_class=HTMLResponse)
def overview(request: Request, may_read: MayRead) -> HTMLResponse:
    """Per pipeline and partition: head, last stable offset, lag, margin, time to data loss; last batch; STUCK."""
    base = _base(request)
    pipelines, errors = readable_pipelines(may_read)
    with ThreadPoolExecutor(max_workers=OVERVIEW_WORKERS, thread_name_prefix="kafka2pg-overview") as pool:
        sections = list(pool.map(lambda p: _overview_section(base, p), pipelines))
    sections += [
        f'<h2 id="pipeline-{html_text(name)}">pipeline {html_text(name)}</h2>'
        f'<p class="error">{html_text(f"{type(error).__name__}: {error}")}</p>'
        for name, error in errors.items()
    ]
    return _page(
        request,
        "kafka2pg pipelines",
        "".join(sections) or "<p>no pipeline in the pipelines file whose DAG you may read</p>",
    )


def _overview_section(base: str, pipeline: Pipeline) -> str:
    """One pipeline's part of the overview; its services' failure shown there, not hiding the others."""
    import psycopg

    from kafka2pg.connections import settings_for
    from kafka2pg.database import connect
    from kafka2pg.exceptions import Kafka2PgError
    from kafka2pg.status import pipeline_status

    heading = f'<h2 id="pipeline-{html_text(pipeline.name)}">pipeline {html_text(pipeline.name)}</h2>'
    try:
        settings = settings_for(pipeline)
        with connect(settings.database_url, autocommit=True) as conn:
            status = pipeline_status(settings, pipeline, conn)
    except (Kafka2PgError, psycopg.Error) as exc:  # e.g. Kafka down, a migration not applied yet
        log.warning("pipeline=%s overview: %s", pipeline.name, exc)
        return f'{heading}<p class="error">{html_text(f"{type(exc).__name__}: {exc}")}</p>'
    return heading + _status_section(base, status)


def _status_section(base: str, status: PipelineStatus) -> str:
    name = status.pipeline
    rows = [
        f'<tr class="{"risk" if p.at_risk else ""}" data-partition="{p.partition}">{_cell(p.partition, "num")}'
        f"{_cell(p.next_offset, 'num')}{_cell(p.last_stable_offset, 'num')}{_cell(p.low_watermark, 'num')}"
        f"{_cell(p.high_watermark, 'num')}{_cell(p.lag, 'num')}{_cell(p.margin, 'num')}{_cell(p.time_to_loss)}</tr>"
        for p in status.partitions
    ]
    last = status.last_batch
    batches = f"{base}/pipelines/{name}/batches"
    if last is None:
        last_line = "no batch yet"
    else:
        report = _link(f"{batches}/{last.batch_id}/report", "quality report")
        last_line = (
            f"last batch {_link(f'{batches}?before={last.batch_id + 1}', last.batch_id)}: "
            f'<span class="state">{html_text(last.state)}</span>, {_age(last.age_seconds)} ago ({report})'
        )
    alarms = [*status.not_ready_lines("this page's"), *status.blocked_lines(), *(b.describe() for b in status.stuck)]
    if status.kafka_error:
        alarms.insert(0, f"Kafka's offsets unknown, partitions not shown: {status.kafka_error}")
    notes = "".join(f'<p class="alarm">{html_text(line)}</p>' for line in alarms) + "".join(
        f'<p class="open">{html_text(line.strip())}</p>' for line in status.open_batch_lines()
    )
    history = f"{base}/pipelines/{name}/history"
    return (
        f'<p class="meta">topic {html_text(status.topic)} &rarr; {html_text(status.target)} &middot; '
        f"{_link(batches, 'batches')} &middot; {_link(history, 'history')}</p><p>{last_line}</p>{notes}"
        + _table(
            [
                "partition",
                "head",
                "last stable offset",
                "low watermark",
                "high watermark",
                "lag",
                "margin",
                "time to data loss",
            ],
            rows,
            f"partitions-{html_text(name)}",
        )
    )


@app.get("/pipelines/{name}/batches", response_class=HTMLResponse)
def batches(
    request: Request, name: str, may_read: MayRead, before: OptionalBigint = None, limit: int = PAGE_SIZE
) -> HTMLResponse:
    """The pipeline's batches, newest first, `limit` per page; `before`: the page below that batch id."""
    from kafka2pg.browse import batches_page
    from kafka2pg.database import connect

    settings, pipeline = _pipeline(name, may_read)
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    with connect(settings.database_url, autocommit=True) as conn:
        page = batches_page(conn, pipeline.name, before, limit)
    here = f"{_base(request)}/pipelines/{name}/batches"
    ui = _airflow_ui(request)
    rows = [
        f'<tr data-batch="{b.batch_id}">{_cell(b.batch_id, "num")}{_cell(b.kind)}'
        f'<td class="state">{html_text(b.state)}</td>{_cell(b.ranges)}'
        f"{_cell(b.records_planned, 'num')}{_cell(b.records_read, 'num')}{_cell(b.rows_promoted, 'num')}"
        f"{_cell(b.rows_quarantined, 'num')}{_cell(_gaps(b.gaps))}{_cell(_seconds(b.stage_s), 'num')}"
        f"{_cell(_seconds(b.validate_s), 'num')}{_cell(_seconds(b.promote_s), 'num')}{_cell(b.epoch, 'num')}"
        f"<td>{_run_link(ui, _dag_of(pipeline, b.kind), b.run_id)}</td>{_cell(f'{b.updated_at:%Y-%m-%d %H:%M:%S %Z}')}"
        f"<td>{_link(f'{here}/{b.batch_id}/report', 'report') if b.has_report else '-'} "
        f"{_link(f'{here}/{b.batch_id}/quarantine', 'quarantine') if b.rows_quarantined else ''}</td></tr>"
        for b in page
    ]
    more = ""
    if len(page) == limit:
        query = urlencode({"before": page[-1].batch_id, "limit": limit})
        more = f"<p>{_link(f'{here}?{query}', 'older batches')}</p>"
    table = _table(
        [
            "batch",
            "kind",
            "state",
            "offset ranges [start, end)",
            "records planned",
            "records read",
            "promoted",
            "quarantined",
            "gaps by kind",
            "stage s",
            "validate s",
            "promote s",
            "claim epoch",
            "run id",
            "updated",
            "",
        ],
        rows,
        "batches",
    )
    meta = (
        f'<p class="meta">{_link(f"{_base(request)}/pipelines/{name}/history", "history of replays, undos and resets")}'
        " &middot; gaps: offsets holding no loaded record, by why &middot; a step's seconds run from the end of the"
        " step before it (planned, staged, the gate's verdict): a batch that waited or was resumed counts the wait</p>"
    )
    return _page(request, f"pipeline {pipeline.name}: batches", meta + table + more)


def _airflow_ui(request: Request) -> str:
    """The Airflow UI's root: the server path this app is mounted under, without its own prefix."""
    return request.scope.get("root_path", "").rstrip("/").rpartition("/")[0]


def _dag_of(pipeline: Pipeline, kind: str) -> str:
    """The DAG whose runs plan a batch of this kind: a replay batch's is the replay DAG."""
    return pipeline.replay_dag_id if kind == "replay" else pipeline.dag_id


def _run_link(ui: str, dag_id: str, run_id: str | None) -> str:
    """A run id linked to its run of the DAG in the Airflow UI (the whole window, not the plugin's
    frame: target="_top" opened directly, RUN_LINK_SCRIPT in the UI's sandboxed frame)."""
    from kafka2pg.lifecycle import CLI_RUN_ID

    if run_id is None or run_id == CLI_RUN_ID:
        return html_text(run_id or "-")
    href = f"{ui}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"
    return f'<a class="run" target="_top" href="{html.escape(href)}">{html_text(run_id)}</a>'


def _gaps(gaps: dict[str, int]) -> str:
    return ", ".join(f"{kind} {offsets}" for kind, offsets in gaps.items()) or "none"


def _seconds(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.1f}"


@app.get("/pipelines/{name}/history", response_class=HTMLResponse)
def history(
    request: Request,
    name: str,
    may_read: MayRead,
    before_at: datetime | None = None,
    before_source: str | None = None,
    before_id: OptionalBigint = None,
    limit: int = PAGE_SIZE,
) -> HTMLResponse:
    """The pipeline's replays, undos and partition resets, newest first, `limit` per page; `before_*`:
    the page after that entry (kafka2pg.replays and kafka2pg.ledger_resets)."""
    from kafka2pg.browse import history_page
    from kafka2pg.database import connect

    settings, pipeline = _pipeline(name, may_read)
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    before = None
    if before_at is not None and before_source is not None and before_id is not None:
        before = (before_at, before_source, before_id)
    with connect(settings.database_url, autocommit=True) as conn:
        page = history_page(conn, pipeline.name, before, limit)
    base, ui = _base(request), _airflow_ui(request)
    batches_url = f"{base}/pipelines/{name}/batches"
    rows = [
        f'<tr data-entry="{html_text(e.source)}:{e.entry_id}">{_cell(f"{e.at:%Y-%m-%d %H:%M:%S %Z}")}'
        f'<td class="operation">{html_text(e.operation)}</td>'
        f"<td>{'-' if e.batch_id is None else _link(f'{batches_url}?before={e.batch_id + 1}', e.batch_id)}</td>"
        f"{_cell(e.ranges)}{_cell(e.requested_by)}{_cell(e.reason or None)}"
        f"<td>{_run_link(ui, pipeline.replay_dag_id, e.run_id)}</td>{_cell(e.outcome)}</tr>"
        for e in page
    ]
    more = ""
    if len(page) == limit:
        last = page[-1]
        query = urlencode(
            {"before_at": last.at.isoformat(), "before_source": last.source, "before_id": last.entry_id, "limit": limit}
        )
        more = f"<p>{_link(f'{base}/pipelines/{name}/history?{query}', 'older entries')}</p>"
    table = _table(
        ["when", "operation", "batch", "ranges [start, end)", "by", "reason", "run id", "outcome"], rows, "history"
    )
    meta = f'<p class="meta">{_link(batches_url, "batches")}</p>'
    if not page and before is None:
        meta += "<p>no replay, undo or reset yet</p>"
    return _page(request, f"pipeline {pipeline.name}: replays, undos and resets", meta + table + more)


@app.get("/pipelines/{name}/batches/{batch_id}/report", response_class=HTMLResponse)
def report(name: str, batch_id: int, may_read: MayRead) -> HTMLResponse:
    """The batch's quality report, rendered from the result stored with it (kafka2pg.quality_results)."""
    from kafka2pg.data_docs import render_html
    from kafka2pg.database import connect
    from kafka2pg.quality_results import load_result

    settings, pipeline = _pipeline(name, may_read)
    with connect(settings.database_url, autocommit=True) as conn:
        result = load_result(conn, pipeline.name, batch_id)
    if result is None:
        raise HTTPException(status_code=404, detail=f"pipeline {name!r} batch {batch_id}: no stored quality result")
    return HTMLResponse(render_html(result))


@app.get("/pipelines/{name}/batches/{batch_id}/quarantine", response_class=HTMLResponse)
def quarantine(
    request: Request,
    name: str,
    batch_id: int,
    may_read: MayRead,
    after_partition: OptionalBigint = None,
    after_offset: OptionalBigint = None,
    limit: int = PAGE_SIZE,
) -> HTMLResponse:
    """The batch's quarantined records with their reasons, by partition and offset, `limit` per page."""
    from kafka2pg.browse import batch_state, quarantine_page
    from kafka2pg.database import connect

    settings, pipeline = _pipeline(name, may_read)
    limit = max(1, min(limit, MAX_PAGE_SIZE))
    after = None if after_partition is None or after_offset is None else (after_partition, after_offset)
    with connect(settings.database_url, autocommit=True) as conn:
        if batch_state(conn, pipeline.name, batch_id) is None:
            raise HTTPException(status_code=404, detail=f"pipeline {name!r} has no batch {batch_id}")
        page = quarantine_page(conn, pipeline.name, batch_id, after, limit)
    rows = [
        f'<tr data-offset="{q.partition}:{q.offset}">{_cell(q.partition, "num")}{_cell(q.offset, "num")}'
        f"{_cell(q.timestamp)}{_cell(q.reason)}{_cell(_preview(q.raw_key, q.key_bytes))}"
        f"{_cell(_preview(q.raw_value, q.value_bytes))}</tr>"
        for q in page
    ]
    more = ""
    if len(page) == limit:
        query = urlencode({"after_partition": page[-1].partition, "after_offset": page[-1].offset, "limit": limit})
        more = (
            f"<p>{_link(f'{_base(request)}/pipelines/{name}/batches/{batch_id}/quarantine?{query}', 'next page')}</p>"
        )
    table = _table(["partition", "offset", "kafka timestamp", "reason", "raw key", "raw value"], rows, "quarantine")
    return _page(request, f"pipeline {pipeline.name}: quarantine of batch {batch_id}", table + more)


def _preview(raw: bytes | None, whole: int | None = None) -> str | None:
    """The first bytes of a raw key or value (of `whole` bytes in all), undecodable bytes shown as
    \\x escapes; a cut one ends with its length."""
    from kafka2pg.browse import PREVIEW_BYTES

    if raw is None:
        return None
    whole = len(raw) if whole is None else whole
    text = bytes(raw[:PREVIEW_BYTES]).decode("utf-8", errors="backslashreplace")
    return text + (f"… ({whole:,} bytes)" if whole > PREVIEW_BYTES else "")
