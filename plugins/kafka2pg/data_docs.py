"""The per-batch quality report: the result the gate stores (`report_payload`, kept in
kafka2pg.quality_results) and one self-contained HTML page rendered from it (`render_html`).

GX's stock Data Docs load Bootstrap, jQuery and fonts from CDNs and render an empty,
unstyled table without network; this page inlines its CSS, has no script, and opens
from disk (file://) on an air-gapped machine. `write_report` exports both as files.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from kafka2pg.config import Pipeline
from kafka2pg.files import write_whole
from kafka2pg.task_log import html_cell as _cell
from kafka2pg.task_log import html_text

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1d2733; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.verdict { display: inline-block; padding: .3em .8em; border-radius: 4px; font-weight: bold; color: #fff; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
table { border-collapse: collapse; margin-top: .6em; min-width: 60%; }
th, td { border: 1px solid #c9d1d9; padding: .35em .7em; text-align: left; vertical-align: top; }
th { background: #eef2f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.failed td { background: #fdecea; } tr.flagged td { background: #fff8e1; }
.meta { color: #57606a; font-size: .9em; }
"""


def report_dir(state_dir: Path, pipeline: Pipeline) -> Path:
    return state_dir / "reports" / pipeline.name


def report_payload(
    pipeline: Pipeline,
    batch_id: int,
    *,
    verdict: str,
    expectations: list[dict],
    checks: list[dict],
    counts: dict[str, int],
    gx_version: str,
) -> dict:
    """Everything the report shows, as JSON-ready data: what kafka2pg.quality_results stores."""
    return {
        "pipeline": pipeline.name,
        "topic": pipeline.topic,
        "target": f"{pipeline.target_schema}.{pipeline.target_table}",
        "batch_id": batch_id,
        "verdict": verdict,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "great_expectations": gx_version,
        "counts": counts,
        "expectations": expectations,
        "checks": checks,
    }


def write_report(state_dir: Path, pipeline: Pipeline, payload: dict) -> Path:
    """Export a stored result as batch-<id>.html and batch-<id>.json; return the HTML path."""
    directory = report_dir(state_dir, pipeline)
    directory.mkdir(parents=True, exist_ok=True)
    batch_id = payload["batch_id"]
    write_whole(directory / f"batch-{batch_id}.json", json.dumps(payload, indent=2, default=str))
    path = directory / f"batch-{batch_id}.html"
    write_whole(path, render_html(payload))
    return path


def render_html(p: dict) -> str:
    """The report page of one stored result (`report_payload`)."""
    passed = p["verdict"] == "promotable"
    counts = "".join(f"<tr>{_cell(k)}{_cell(v, 'num')}</tr>" for k, v in p["counts"].items())
    expectation_rows = "".join(
        f'<tr class="{"" if e["success"] else "failed"}">{_cell(e["expectation"])}{_cell(e["column"])}'
        f"{_cell(e['meaning'])}{_cell('passed' if e['success'] else 'FAILED')}{_cell(e['unexpected'], 'num')}"
        f"{_cell(', '.join(e['sample_offsets']) or e.get('error') or '')}</tr>"
        for e in p["expectations"]
    )
    check_rows = "".join(
        f'<tr class="{"failed" if not c["success"] else "flagged" if c["flagged"] else ""}">{_cell(c["check"])}'
        f"{_cell('passed' if c['success'] else 'FAILED')}{_cell(c['unexpected'], 'num')}"
        f"{_cell(c['flagged'], 'num')}{_cell(c['details'])}</tr>"
        for c in p["checks"]
    )
    title = f"kafka2pg quality report: pipeline {p['pipeline']}, batch {p['batch_id']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html_text(title)}</title><style>{CSS}</style></head>
<body>
<h1>{html_text(title)}</h1>
<p class="meta">topic {html_text(p["topic"])} &rarr; {html_text(p["target"])} &middot; generated
{html_text(p["generated_at"])} &middot; Great Expectations {html_text(p["great_expectations"])}</p>
<p><span id="verdict" class="verdict {"pass" if passed else "fail"}">{html_text(p["verdict"].upper())}</span></p>
<h2>Counts</h2>
<table id="counts"><tr><th>what</th><th>rows</th></tr>{counts}</table>
<h2>Great Expectations results (accepted rows of the batch)</h2>
<table id="expectations"><tr><th>expectation</th><th>column</th><th>why</th><th>result</th>
<th>unexpected</th><th>sample offsets / error</th></tr>{expectation_rows}</table>
<h2>Duplicate and completeness checks (before GX; flagged rows go to quarantine)</h2>
<table id="checks"><tr><th>check</th><th>result</th><th>unexpected</th><th>flagged to quarantine</th>
<th>details</th></tr>{check_rows}</table>
</body></html>
"""
