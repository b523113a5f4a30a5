"""What the commands print of a batch: a record's bytes quoted in a reason cannot move the
terminal's cursor or colour it; a batch without quarantined rows says why, by its state; a
STUCK batch's advice is said once."""

from kafka2pg.config import Column, Pipeline
from kafka2pg.lifecycle import BatchState
from kafka2pg.report import _none_quarantined
from kafka2pg.task_log import printable


def test_control_characters_in_a_reason_are_escaped_and_the_rest_kept():
    reason = "field 'note': 'a\nb\x1b[31mred\x00' é 😀\t"
    assert printable(reason) == "field 'note': 'a\\nb\\x1b[31mred\\x00' é 😀\\t"


def test_a_batch_without_quarantined_rows_says_why_by_its_state():
    pipeline = Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),))
    said = {state: _none_quarantined(pipeline, state) for state in BatchState}
    assert said.pop(BatchState.PROMOTED) == ""  # promoted with nothing to quarantine: nothing to add
    assert all(said.values()), [s for s, text in said.items() if not text]
    assert "staging table" not in said[BatchState.UNDONE] + said[BatchState.VERIFIED] + said[BatchState.ABANDONED]
    assert "kafka2pg.stg_orders" in said[BatchState.VALIDATED] and "staging table, kafka2pg.stg_orders" in (
        _none_quarantined(pipeline, None)
    )


def test_a_stuck_batch_gives_the_errors_own_advice_once():
    from datetime import UTC, datetime

    from kafka2pg.stuck import StuckBatch

    def described(error: str) -> str:
        since = datetime(2026, 1, 2, tzinfo=UTC)
        return StuckBatch("orders", 7, "validated", "promote", 2, since, error, "p0[0,10)").describe()

    from kafka2pg.exceptions import TableRefusesRowsError

    advised = described(f"TableRefusesRowsError: {TableRefusesRowsError('public.t', 3, 3, 'a check')}")
    assert advised.endswith("it resumes the batch. See docs/operations.md (STUCK batches).")
    assert advised.count("trigger a run") == 1 and ".." not in advised
    plain = described("KafkaUnavailableError: no broker answered")
    assert plain.endswith(
        "no broker answered. Fix the cause and trigger a run (it resumes the batch), or see docs/operations.md "
        "(STUCK batches)."
    )


def test_status_lists_each_open_batch_once_a_stuck_one_by_its_stuck_line_and_json_holds_both():
    import json
    from dataclasses import replace
    from datetime import UTC, datetime

    from kafka2pg.status import PipelineStatus
    from kafka2pg.stuck import ABANDONS, RESUMES, OpenBatch, with_next_runs

    since = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    failing = OpenBatch("orders", 7, "live", "validated", None, "run-2", since, "promote", 2, since, "E: no", "p0[0,9)")
    resumable = OpenBatch(
        "orders", 8, "live", "staged", 7, "run-2", since, "validate", 1, since, "E: x" * 99, "p0[9,12)"
    )
    planned = OpenBatch("orders", 9, "replay", "planned", None, "manual__1", since, None, 0, None, None, "none")
    by_cli = OpenBatch("orders", 10, "replay", "staged", None, "cli", since, None, 0, None, None, "p0[0,9)")
    running = replace(by_cli, batch_id=11)
    opened = with_next_runs([failing, resumable, planned, by_cli, running], {11: 4242, 9: 77})
    status = PipelineStatus("orders", "orders", "public.orders", (), None, tuple(opened), "gone", "kafka")

    # The oldest open live batch is resumed, a later one (a lookahead) abandoned, a replay's left to
    # its run, and each replay's line says how to discard it once its run will not finish it.
    abandon = (
        "`./kafka2pg abandon --pipeline orders --batch-id {}` then, if its preview is right, the same with "
        "`--confirm` discards it"
    )
    replay_left = f"leaves it: only its replay run's retries carry it on; once that run has ended without it, {abandon}"
    cli_left = (
        "leaves it: the `./kafka2pg replay` process that planned it is gone (no session holds its lock), and only it "
        "would carry it on; " + abandon.format(10)
    )
    cli_running = (
        "leaves it to the `./kafka2pg replay` process running it (its session: backend pid 4242); if that process "
        "hangs, stop it; " + abandon.format(11)
    )
    assert [b.next_run for b in opened] == [RESUMES, ABANDONS, replay_left.format(9), cli_left, cli_running]
    assert [b.batch_id for b in status.stuck] == [7]
    lines = status.open_batch_lines()
    assert [line.split(" (")[0] for line in lines] == [
        "open: batch 8",
        "open: batch 9",
        "open: batch 10",
        "open: batch 11",
    ]
    assert lines[0].startswith("open: batch 8 (live, staged, planned after batch 7) p0[9,12), claimed 2026-01-02")
    assert " by run run-2; last failure at validate: E: xE: x" in lines[0]
    assert lines[0].endswith(f"…; next run: {ABANDONS}")
    assert len(lines[0].split("last failure at validate: ")[1].split("; next run: ")[0]) == 200
    assert lines[1] == (
        "open: batch 9 (replay, planned) none, claimed 2026-01-02 03:04:05 UTC by run manual__1; next run: "
        + replay_left.format(9)
    )
    assert status.not_ready_lines("this command's") == ["NOT READY for a run as role 'kafka' (this command's): gone"]

    data = json.loads(json.dumps(status.to_json()))
    assert [(b["batch_id"], b["stuck"], b["next_run"]) for b in data["open_batches"]] == [
        (7, True, RESUMES),
        (8, False, ABANDONS),
        (9, False, replay_left.format(9)),
        (10, False, cli_left),
        (11, False, cli_running),
    ]
    assert data["open_batches"][0]["claimed_at"] == "2026-01-02T03:04:05+00:00"
    assert [(b["batch_id"], b["step"], b["since"]) for b in data["stuck"]] == [(7, "promote", since.isoformat())]
    assert (data["not_ready"], data["not_ready_role"]) == ("gone", "kafka")
    ready = PipelineStatus("orders", "orders", "public.orders", (), None, (planned,), None, None)
    assert ready.not_ready_lines("x") == [] and ready.to_json()["stuck"] == []


def test_a_failure_quoting_a_records_bytes_cannot_move_the_terminal(capsys, monkeypatch):
    """A key collision's text quotes the key as the record had it (PostgreSQL's `Key (id)=(…)`):
    the STUCK line, the open-batch line and the CLI's error line show it escaped."""
    from datetime import UTC, datetime

    from kafka2pg import cli
    from kafka2pg.exceptions import ConfigError
    from kafka2pg.stuck import OpenBatch, StuckBatch

    error = "KeyCollisionError: Key (event_id)=(a-1\x1b]0;owned\x07\x1b[2J\u202e\rnothing STUCK) already exists"
    since = datetime(2026, 1, 2, tzinfo=UTC)
    stuck = StuckBatch("orders", 7, "validated", "promote", 2, since, error, "p0[0,10)").describe()
    opened = OpenBatch("orders", 7, "live", "validated", None, None, since, "promote", 1, since, error, "p0[0,9)")
    for line in (stuck, opened.describe()):
        assert "(a-1\\x1b]0;owned\\x07\\x1b[2J\\u202e\\rnothing STUCK)" in line and line.isprintable(), line

    def fail(args):
        raise ConfigError(f"first line\nsecond {error}")

    monkeypatch.setattr(cli, "cmd_status", fail)
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ConfigError: first line\nsecond KeyCollisionError: Key (event_id)=(a-1\\x1b]0;")
    assert "\x1b" not in err and "\r" not in err and "\u202e" not in err


def test_a_report_with_non_ascii_bytes_is_written_as_utf8_under_a_c_locale(tmp_path):
    """The page declares UTF-8; under LANG=C Python's default encoding is ASCII and a quarantined
    record's 'é' in a check's details would fail the export (and `report` to stdout)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    plugins = Path(__file__).resolve().parents[2] / "plugins"

    script = """
import sys
from pathlib import Path
from kafka2pg.config import Column, Pipeline
from kafka2pg.data_docs import render_html, report_payload, write_report
p = Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),))
payload = report_payload(p, 3, verdict="promotable", expectations=[], counts={"rows": 1}, gx_version="1",
    checks=[{"check": "dup", "success": True, "unexpected": 0, "flagged": 1, "details": "caf\\u00e9 \\U0001f600"}])
html = write_report(Path(sys.argv[1]), p, payload)
print(html)
"""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(plugins)}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = Path(done.stdout.strip()).read_bytes().decode("utf-8")
    assert "<td>café 😀</td>" in page, page[-800:]


def test_a_stuck_batch_whose_error_names_the_command_that_ends_it_is_not_told_to_trigger_a_run():
    """A batch Kafka lost offsets of since it was staged waits for a reset: "trigger a run
    (it resumes the batch)" would fail the same way again."""
    from datetime import UTC, datetime

    from kafka2pg.exceptions import RetentionLossError
    from kafka2pg.stuck import StuckBatch

    lost = RetentionLossError.unwitnessed("orders", 7, "live", "orders", (0, 10, 50), 40, 5)
    since = datetime(2026, 1, 2, tzinfo=UTC)
    said = StuckBatch(
        "orders", 7, "staged", "validate", 2, since, f"RetentionLossError: {lost}", "p0[10,50)"
    ).describe()
    assert "./kafka2pg reset --pipeline orders --partition 0 --to-offset 40" in said
    assert "trigger a run" not in said and said.endswith("See docs/operations.md (STUCK batches).")
