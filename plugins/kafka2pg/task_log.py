"""What a task log shows besides its step's own lines: one summary line per batch and step, and
lines kept within what a log viewer shows without clipping. Pure text, no client library."""

from __future__ import annotations

import html
import textwrap
from collections.abc import Sequence

from kafka2pg.planner import OffsetRange, describe_ranges

# The widest line kafka2pg writes into a task log (Airflow's log viewer clips wider ones).
LOG_WIDTH = 160
# Where a batch's ranges are cut short in a summary (the rest of the line needs its room too).
RANGES_WIDTH = 80


def step_summary(
    step: str,
    pipeline: str,
    batch_id: int,
    seconds: float,
    *,
    ranges: Sequence[OffsetRange] = (),
    report: object = None,
    **counts: object,
) -> str:
    """The line a step ends with, one per batch, e.g.

    `summary step=stage pipeline=orders batch=7 ranges=p0[0,146) p1[0,125) records=271 quarantined=0 seconds=9.4`

    `counts` follow in the order given (None: left out); the report path comes last.
    """
    fields = [f"step={step}", f"pipeline={pipeline}", f"batch={batch_id}"]
    if ranges:
        fields.append(f"ranges={shorten_ranges(ranges)}")
    fields += [f"{name}={value}" for name, value in counts.items() if value is not None]
    fields.append(f"seconds={seconds:.1f}")
    if report:
        fields.append(f"report={report}")
    return "summary " + " ".join(fields)


def shorten_ranges(ranges: Sequence[OffsetRange], width: int = RANGES_WIDTH) -> str:
    """`describe_ranges`, cut after the ranges that fit in `width`: `p0[0,5) p1[0,7) ... (+30 partitions)`."""
    text = describe_ranges(ranges)
    if len(text) <= width:
        return text
    shown: list[OffsetRange] = []
    for r in ranges:
        if len(describe_ranges([*shown, r])) > width - len(" ... (+0000 partitions)"):
            break
        shown.append(r)
    return f"{describe_ranges(shown)} ... (+{len(ranges) - len(shown)} partitions)"


def fit(text: str, width: int = LOG_WIDTH, indent: str = "    ") -> str:
    """`text` with every line wider than `width` wrapped at spaces (a longer word is cut);
    continuation lines are indented."""
    lines: list[str] = []
    for line in text.splitlines() or [""]:
        if len(line) <= width:
            lines.append(line)
            continue
        lines += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False)
    return "\n".join(lines)


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], width: int = LOG_WIDTH, *, text_last: bool = False
) -> str:
    """Columns right-aligned; when a row would be wider than `width`, the last column (details,
    free text) is left-aligned and wrapped under itself instead. `text_last`: the last column is
    free text, left-aligned whatever the width."""
    cells = [[str("-" if v is None else v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if sum(widths) + 2 * (len(widths) - 1) <= width:
        aligned = [*(str.rjust for _ in widths[:-1]), str.ljust if text_last else str.rjust]
        lines = [list(headers), *cells]
        return "\n".join(
            "  ".join(align(v, w) for align, v, w in zip(aligned, row, widths, strict=True)).rstrip() for row in lines
        )
    lead = widths[:-1]
    margin = sum(lead) + 2 * len(lead)
    last = max(20, width - margin)
    lines = []
    for row in [list(headers), *cells]:
        head = "  ".join(v.rjust(w) for v, w in zip(row[:-1], lead, strict=True))
        wrapped = textwrap.wrap(row[-1], last, break_on_hyphens=False) or [""]
        lines.append(f"{head}  {wrapped[0]}")
        lines += [" " * margin + more for more in wrapped[1:]]
    return "\n".join(lines)


def validation_summary(pipeline: str, result, seconds: float) -> str:
    """The quality gate's summary line (`result`: a `quality.ValidationResult`)."""
    return step_summary(
        "validate",
        pipeline,
        result.batch_id,
        seconds,
        state=None if result.state == "validated" else result.state,  # shown when the gate found it done
        checks=len(result.checks) or None,
        failed=sum(not c.success for c in result.checks) if result.checks else None,
        flagged=sum(c.flagged for c in result.checks) if result.checks else None,
        report=result.report,
    )


def promotion_summary(pipeline: str, result, seconds: float) -> str:
    """The promotion's (or a replay's finish) summary line (`result`: a `PromoteResult` or `ReplayResult`)."""
    return step_summary(
        "promote",
        pipeline,
        result.batch_id,
        seconds,
        mode=getattr(result, "mode", None),
        rows=result.promoted,
        quarantined=result.quarantined,
        already_promoted=result.already_promoted or None,
    )


def html_text(value: object) -> str:
    """`value` as HTML text: escaped, its control characters as escapes (`\\x1b`, `\\x00`), as
    the CLI shows them: a record's bytes or an operator's words cannot carry a NUL (an HTML parse
    error) or a terminal's escape sequences into a page's source."""
    return html.escape(printable(str(value), keep_newlines=True))


def html_cell(value: object, css: str = "") -> str:
    """A table cell holding `value` as `html_text`, `-` for None; `css` its class."""
    attribute = f' class="{css}"' if css else ""
    return f"<td{attribute}>{html_text('-' if value is None else value)}</td>"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with each control or other unprintable character escaped (`\\n`, `\\x1b`): what
    quotes a record's bytes (a reason, PostgreSQL's words about a row, a key) cannot move the
    cursor of the terminal or log viewer it is shown in. `keep_newlines`: a message's own line
    breaks stay."""
    if keep_newlines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
