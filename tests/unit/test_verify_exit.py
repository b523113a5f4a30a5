"""`kafka2pg verify`'s exit code and last words when pipelines end differently: 1 for a
discrepancy even when another pipeline could not be audited (named again at the end), 2 when one
could not be audited and the rest are clean; the audit's line for a reset before any batch."""

import dataclasses
from contextlib import nullcontext
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
import yaml

from kafka2pg import audit, cli, connections, database, migrations, opening, stuck
from kafka2pg.audit import PartitionAudit, format_audit
from kafka2pg.config import Column, Pipeline
from kafka2pg.exceptions import KafkaUnavailableError, SchemaNotReadyError, TopicNotFoundError
from kafka2pg.stuck import OpenBatch


@pytest.fixture
def three_pipelines(tmp_path, monkeypatch):
    spec = {
        "pipelines": [
            {"name": name, "topic": name, "target_table": f"public.{name}", "columns": [{"name": "n", "type": "text"}]}
            for name in ("clean", "broken", "unreadable")
        ]
    }
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(path))
    monkeypatch.setattr(
        connections, "settings_for", lambda pipeline: SimpleNamespace(database_url="postgresql://nowhere/x")
    )
    monkeypatch.setattr(database, "session", lambda url: nullcontext(None))
    monkeypatch.setattr(stuck, "open_batches", lambda conn, name: [])
    monkeypatch.setattr(opening, "blocked_words", lambda settings, pipeline, conn: None)
    return spec


def audits_of(outcomes: dict[str, str]):
    def audit_pipeline(settings, pipeline):
        if outcomes[pipeline.name] == "error":
            raise TopicNotFoundError(f"topic {pipeline.topic!r} does not exist")
        return [
            PartitionAudit(
                0,
                10,
                kafka_records=10,
                matched=10 - (outcomes[pipeline.name] == "missing"),
                missing=1 if outcomes[pipeline.name] == "missing" else 0,
            )
        ]

    return audit_pipeline


@pytest.mark.parametrize(
    ("outcomes", "code", "last_words"),
    [
        ({"clean": "ok", "broken": "missing", "unreadable": "error"}, 1, "also not audited: unreadable"),
        ({"clean": "ok", "broken": "missing", "unreadable": "ok"}, 1, None),
        ({"clean": "ok", "broken": "ok", "unreadable": "error"}, 2, None),
        ({"clean": "ok", "broken": "ok", "unreadable": "ok"}, 0, None),
        ({"clean": "ok", "broken": "stuck", "unreadable": "error"}, 1, "also not audited: unreadable"),
        ({"clean": "ok", "broken": "not ready", "unreadable": "ok"}, 1, None),
        ({"clean": "ok", "broken": "blocked", "unreadable": "ok"}, 1, None),
        ({"clean": "ok", "broken": "blocked", "unreadable": "error"}, 1, "also not audited: unreadable"),
        ({"clean": "ok", "broken": "kafka down", "unreadable": "ok"}, 0, None),  # that check unknown, said
    ],
)
def test_verify_exits_1_for_a_discrepancy_2_for_a_pipeline_not_audited_and_names_both(
    three_pipelines, monkeypatch, capsys, outcomes, code, last_words
):
    monkeypatch.setattr(audit, "audit_pipeline", audits_of(outcomes))
    monkeypatch.setattr(
        migrations,
        "readiness_error",
        lambda settings, pipeline, conn: SchemaNotReadyError("grant it")
        if outcomes[pipeline.name] == "not ready"
        else None,
    )

    def blocked_words(settings, pipeline, conn):
        if outcomes[pipeline.name] == "kafka down":
            raise KafkaUnavailableError("Kafka at nowhere:9092 did not answer")
        return "OffsetRegressionError: recreated" if outcomes[pipeline.name] == "blocked" else None

    monkeypatch.setattr(opening, "blocked_words", blocked_words)
    since = datetime(2026, 1, 2, tzinfo=UTC)
    failing = OpenBatch("", 7, "live", "validated", None, "r", since, "promote", 2, since, "E: no", "p0[0,9)")
    monkeypatch.setattr(
        stuck,
        "open_batches",
        lambda conn, name: [dataclasses.replace(failing, pipeline=name)] if outcomes[name] == "stuck" else [],
    )
    assert cli.main(["verify"]) == code
    shown = capsys.readouterr()
    assert shown.out.count("result: ") == sum(o != "error" for o in outcomes.values())
    assert ("result: DISCREPANCIES FOUND" in shown.out) is ("missing" in outcomes.values())
    assert ("result: STUCK" in shown.out) is ("stuck" in outcomes.values())
    assert ("NOT READY: grant it\nresult: NOT READY" in shown.out) is ("not ready" in outcomes.values())
    blocked = "BLOCKED: no batch can be planned until an operator acts: OffsetRegressionError: recreated"
    assert (blocked in shown.out) is ("blocked" in outcomes.values())
    unknown = "pipeline broken: whether the ledger still fits the topic is unknown: KafkaUnavailableError: Kafka at"
    assert (unknown in shown.err) is (outcomes["broken"] == "kafka down")
    errors = shown.err.strip().splitlines()
    assert ("pipeline unreadable: not audited: TopicNotFoundError" in shown.err) is (outcomes["unreadable"] == "error")
    if last_words:
        assert errors[-1].endswith(last_words), errors
    else:
        assert "also not audited" not in shown.err


def test_a_reset_before_any_batch_is_said_so_and_one_after_a_batch_names_it():
    pipeline = Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),))
    early = format_audit(pipeline, [PartitionAudit(0, 5, reset=(0, 5))], [])
    assert "partition 0 audited since its reset (to offset 5, before any batch)" in early and "batch 0" not in early
    later = format_audit(pipeline, [PartitionAudit(0, 5, reset=(7, None))], [])
    assert "(dropping its head, after batch 7): what batches up to that one loaded is not compared" in later


def test_an_entry_in_error_in_the_pipelines_file_hides_none_of_the_others(
    three_pipelines, tmp_path, monkeypatch, capsys
):
    spec = three_pipelines
    spec["pipelines"].append({**spec["pipelines"][0], "name": "mistyped", "columns": [{"name": "n", "type": "textt"}]})
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(audit, "audit_pipeline", audits_of({"clean": "ok", "broken": "missing", "unreadable": "ok"}))
    monkeypatch.setattr(migrations, "readiness_error", lambda settings, pipeline, conn: None)
    assert cli.main(["verify"]) == 1
    shown = capsys.readouterr()
    assert shown.out.count("result: ") == 3 and "result: DISCREPANCIES FOUND" in shown.out
    assert "pipeline mistyped: not audited: ConfigError: " in shown.err and "textt" in shown.err
    assert shown.err.strip().splitlines()[-1].endswith("also not audited: mistyped")
    assert cli.main(["verify", "--pipeline", "mistyped"]) == 2  # named: its error alone


@pytest.mark.parametrize(("audited", "code"), [("ok", 2), ("missing", 1)])
def test_an_error_in_the_blocked_check_keeps_the_audit_and_its_exit_code(
    three_pipelines, monkeypatch, capsys, audited, code
):
    """Other than Kafka not answering (unknown, said): the audit is printed all the same; exit 1
    for what it found, else 2 (not checked) naming the error."""
    from kafka2pg.exceptions import ConfigError

    def blocked_words(settings, pipeline, conn):
        raise ConfigError("the topic's ID cannot be read")

    monkeypatch.setattr(audit, "audit_pipeline", audits_of({"clean": "ok", "broken": audited, "unreadable": "ok"}))
    monkeypatch.setattr(migrations, "readiness_error", lambda settings, pipeline, conn: None)
    monkeypatch.setattr(opening, "blocked_words", blocked_words)
    assert cli.main(["verify", "--pipeline", "broken"]) == code
    shown = capsys.readouterr()
    assert "result: " in shown.out  # the audit, printed
    assert "whether the ledger still fits the topic could not be checked: ConfigError: the topic's ID" in shown.err
    assert ("not audited: Kafka2PgError: the audit above found nothing, but" in shown.err) is (code == 2), shown.err
