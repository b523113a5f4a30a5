"""The quality gate on the real stack: Great Expectations + duplicate checks before promotion,
per-batch reports that render offline (checked in headless Chromium)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.checks import DEFERRED_KEY_PROBE
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import BatchStateError, QualityGateFailed, StagingLostError, WitnessMismatchError
from kafka2pg.kafka_offsets import client_config, partition_offsets
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.report import quality_summary
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / ".cache" / "test-artifacts"


def with_rules(columns: list[dict], on_violation: str) -> list[dict]:
    """amount within [0, 1000], currency one of EUR/USD/GBP; what a violation does."""
    rules = {
        "amount": {"min": 0, "max": 1000, "on_violation": on_violation},
        "currency": {"allowed": ["EUR", "USD", "GBP"], "on_violation": on_violation},
    }
    return [{**c, **rules.get(c["name"], {})} for c in columns]


def first_batch(events: list) -> list:
    """Six good events, a producer retry of the second, a null business key, an amount out of
    range, a currency not allowed."""
    bad_key = {**events[6], "event_id": None}
    out_of_range = {**events[7], "amount": 9999}
    bad_currency = {**events[8], "currency": "XXX"}
    return [*events[:6], events[1], bad_key, out_of_range, bad_currency]


def target_ids(db, env) -> list[str]:
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    return [r[0] for r in db.execute(sql.SQL("SELECT event_id FROM {} ORDER BY event_id").format(table))]


def quarantine(db, env) -> list[tuple[int, str]]:
    return db.execute(
        "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY batch_id, kafka_offset",
        (env.pipeline.name,),
    ).fetchall()


def render(report: Path, name: str) -> str:
    """Open the report in headless Chromium without network; keep a screenshot; return the DOM."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: run the suite through ./kafka2pg test, which installs it"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--window-size=1400,1400",
    ]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    subprocess.run([chromium, *flags, f"--screenshot={shot}", report.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, "Chromium did not render a screenshot"
    dom = subprocess.run([chromium, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    return dom.stdout


def test_quarantine_policy_keeps_each_event_once_and_the_report_shows_what_was_caught(
    make_pipeline, run_batch, db, sample_columns
):
    env = make_pipeline(partitions=1, columns=with_rules(sample_columns, "quarantine"))
    events = list(sample_events(9, seed=51))
    produce(env.settings.bootstrap_servers, env.topic, first_batch(events), key_field=None)
    first = run_batch(env)
    assert (first.promoted, first.quarantined) == (6, 4)
    produce(env.settings.bootstrap_servers, env.topic, [events[2]], key_field=None)  # already promoted
    second = run_batch(env)
    assert (second.promoted, second.quarantined) == (0, 1)

    assert target_ids(db, env) == sorted(e["event_id"] for e in events[:6])
    reasons = quarantine(db, env)
    assert [o for o, _ in reasons] == [6, 7, 8, 9, 10]
    assert reasons[0][1] == (
        f"duplicate business key within batch {first.batch_id}: kept partition 0 offset 1"
        f" (event_id = '{events[1]['event_id']}')"
    )
    assert reasons[1][1] == "field 'event_id': required but null"
    assert reasons[2][1] == "amount = '9999.00' violates the declared range [0, 1000]"
    assert reasons[3][1] == "currency = 'XXX' violates the declared allowed values ['EUR', 'USD', 'GBP']"
    assert reasons[4][1] == (
        f"business key already promoted by batch {first.batch_id} at partition 0 offset 2"
        f" (event_id = '{events[2]['event_id']}')"
    )
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))

    summary = quality_summary(env.settings, env.pipeline, first.batch_id)
    report = Path(summary.split("quality report ")[1].splitlines()[0])
    html = report.read_text()
    assert "<script" not in html and "<link" not in html and "http" not in html, "the report must be self-contained"
    dom = render(report, "quality-report-quarantine")
    assert (
        'id="expectations"' in dom and "ExpectColumnValuesToBeUnique" in dom and "ExpectColumnValuesToBeBetween" in dom
    )
    assert '<td>business-key duplicates found</td><td class="num">1</td>' in dom
    assert "PROMOTABLE" in dom and "verdict: promotable" in summary
    assert "records read): refused by admission or PostgreSQL: 1; business_key_unique_in_batch: 1" in summary


def test_fail_policy_promotes_nothing_and_fails_with_the_report_path(make_pipeline, spark, db, sample_columns):
    env = make_pipeline(partitions=1, columns=with_rules(sample_columns, "fail"), duplicate_policy="fail")
    events = list(sample_events(9, seed=52))
    produce(env.settings.bootstrap_servers, env.topic, first_batch(events), key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    with pytest.raises(QualityGateFailed) as info:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    report = Path(info.value.report)
    assert (info.value.batch_id, info.value.state, report.suffix) == (batch.batch_id, "rejected", ".html")
    # What the operator reads: the verdict and where the report is.
    assert "rejected, nothing promoted, ledger unchanged" in str(info.value) and f"Report: {report}." in str(info.value)
    assert target_ids(db, env) == [] and quarantine(db, env) == []
    assert db.execute(
        "SELECT count(*) FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone() == (0,)
    failed = dict(
        db.execute(
            "SELECT check_name, unexpected_count FROM kafka2pg.batch_checks WHERE batch_id = %s AND NOT success",
            (batch.batch_id,),
        ).fetchall()
    )
    assert failed == {
        "business_key_unique_in_batch": 1,
        "gx:ExpectColumnValuesToBeUnique:event_id": 2,
        "gx:ExpectColumnValuesToBeBetween:amount": 1,
        "rule_amount": 1,  # the exact SQL check beside GX's float comparison
        "gx:ExpectColumnValuesToBeInSet:currency": 1,
    }
    assert set(info.value.failed) == set(failed)
    with pytest.raises(BatchStateError) as refused:
        promote_batch(env.settings, env.pipeline, batch.batch_id)
    assert (refused.value.batch_id, refused.value.state) == (batch.batch_id, "rejected")
    dom = render(report, "quality-report-fail")
    assert "REJECTED" in dom and "FAILED" in dom and "p0@8" in dom
    assert '<td>business-key duplicates found</td><td class="num">1</td>' in dom


def test_an_error_inside_great_expectations_blocks_promotion(make_pipeline, spark, db, monkeypatch):
    import kafka2pg.expectations

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(5, seed=53)), key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)

    def broken(frame, suite):
        raise RuntimeError("metric computation exploded")

    monkeypatch.setattr(kafka2pg.expectations, "run_suite", broken)
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert rejected.value.batch_id == batch.batch_id
    assert rejected.value.failed["gx:validation_error"] == (
        "Great Expectations raised RuntimeError: metric computation exploded"
    )
    assert target_ids(db, env) == []


def test_offsets_already_in_the_target_or_quarantine_are_rejected(make_pipeline, spark, db):
    """Rows of the same offsets already landed (an unarchived recreated topic, a manual load): the
    batch is held with their exact count, quarantine and target both counted; the same offsets
    of another topic are other records."""
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=61)))
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)

    def stage() -> tuple[int, list]:
        batch = open_batch(env.settings, env.pipeline).batch
        stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
        staged = db.execute(
            sql.SQL("SELECT kafka_partition, kafka_offset FROM {} WHERE batch_id = %s ORDER BY 1, 2").format(
                sql.Identifier("kafka2pg", env.pipeline.staging_table)
            ),
            (batch.batch_id,),
        ).fetchall()
        return batch.batch_id, staged

    batch_id, staged = stage()
    (p0, o0), (p1, o1) = staged[0], staged[-1]
    assert p0 != p1
    db.execute(
        "INSERT INTO kafka2pg.quarantine (pipeline, batch_id, kafka_topic, kafka_partition, kafka_offset, reason)"
        " VALUES (%s, %s, %s, %s, %s, 'old quarantine row')",
        (env.pipeline.name, batch_id, env.topic, p1, o1),
    )
    already = "{} staged offsets already in the target or the quarantine"
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch_id)
    assert rejected.value.batch_id == batch_id
    assert rejected.value.failed["provenance_not_already_promoted"].startswith(already.format(1))

    batch_id, _ = stage()  # the rejected batch's offsets, planned again
    db.execute(
        sql.SQL(
            "INSERT INTO {} (event_id, customer_id, kafka_topic, kafka_partition, kafka_offset, batch_id)"
            " VALUES ('old-row', 1, %s, %s, %s, %s)"
        ).format(target),
        (env.topic, p0, o0, batch_id),
    )
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch_id)
    assert rejected.value.batch_id == batch_id
    assert rejected.value.failed["provenance_not_already_promoted"].startswith(already.format(2))
    assert target_ids(db, env) == ["old-row"]

    db.execute(sql.SQL("UPDATE {} SET kafka_topic = 'another-topic'").format(target))
    db.execute("UPDATE kafka2pg.quarantine SET kafka_topic = 'another-topic' WHERE pipeline = %s", (env.pipeline.name,))
    batch_id, _ = stage()
    assert validate_batch(env.settings, env.pipeline, batch_id).state == "validated"


def test_a_record_staged_twice_is_rejected_by_provenance_uniqueness(make_pipeline, spark, db):
    """Two staged rows of one offset (say a chunk copied twice) must never reach the target."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(5, seed=59)), key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(
        sql.SQL("INSERT INTO {0} SELECT * FROM {0} WHERE batch_id = %s AND kafka_offset IN (1, 3)").format(staging),
        (batch.batch_id,),
    )
    db.execute(
        "UPDATE kafka2pg.batch_partitions SET records_read = records_read + 2 WHERE batch_id = %s", (batch.batch_id,)
    )
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert rejected.value.batch_id == batch.batch_id
    assert rejected.value.failed["provenance_unique"] == "2 provenance duplicates in staging"
    assert target_ids(db, env) == []


def test_validation_counts_staged_rows_once_for_the_loss_guard_and_the_completeness_check(make_pipeline, spark, db):
    """One count of the staged rows per partition serves both: fewer rows than were read means
    staging was lost (the batch goes back to planned); a partition without a read count fails
    completeness and nothing is promoted."""
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=61)))
    batch = open_batch(env.settings, env.pipeline).batch
    assert {r.partition for r in batch.plan.ranges} == {0, 1}
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(
        sql.SQL(
            "DELETE FROM {0} WHERE ctid = (SELECT ctid FROM {0} WHERE batch_id = %s AND kafka_partition = 1 LIMIT 1)"
        ).format(staging),
        (batch.batch_id,),
    )
    with pytest.raises(StagingLostError) as lost_error:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert (lost_error.value.batch_id, lost_error.value.state) == (batch.batch_id, "planned")
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]
    assert state == "planned"

    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    db.execute(
        "UPDATE kafka2pg.batch_partitions SET records_read = NULL WHERE batch_id = %s AND kafka_partition = 1",
        (batch.batch_id,),
    )
    db.execute(sql.SQL("DELETE FROM {} WHERE batch_id = %s AND kafka_partition = 1").format(staging), (batch.batch_id,))
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert rejected.value.batch_id == batch.batch_id
    assert rejected.value.failed["staged_rows_equal_records_read"] == "p1: read None, staged 0"
    assert target_ids(db, env) == []


def target_scans(db, env) -> tuple[int, int]:
    """(whole-table scans of the target, scans of its business-key index) as PostgreSQL last
    published them: a backend publishes its counts when it ends, so callers wait for them."""
    table = f"{env.pipeline.target_schema}.{env.pipeline.target_table}"
    return db.execute(
        "SELECT coalesce(t.seq_scan, 0), coalesce(sum(i.idx_scan), 0) FROM pg_stat_user_tables t"
        " JOIN pg_index x ON x.indrelid = t.relid AND x.indisunique AND NOT x.indisprimary"
        " JOIN pg_stat_user_indexes i ON i.indexrelid = x.indexrelid"
        " WHERE t.relid = %s::regclass GROUP BY t.seq_scan",
        (table,),
    ).fetchone()


def test_the_business_key_check_probes_the_target_index_instead_of_reading_the_whole_target(
    make_pipeline, spark, run_batch, db
):
    """A batch of 5,000 against a target of 40,000 rows of the same topic and partitions (at
    offsets past the batch's), staging analyzed as autovacuum does with real batches. The
    checks that no staged offset and no staged business key landed before probe the target's
    indexes and never read the whole target (the planner's hash joins did, which made the
    gate's time per batch grow with the target: 1.1 s of 1.9 s per batch at 5M rows). A key
    promoted long ago is still caught (there by the unique index at promotion, the probe
    having been deferred, then by the probe)."""
    env = make_pipeline(partitions=3)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (event_id, customer_id, kafka_topic, kafka_partition, kafka_offset, batch_id)"
            " SELECT 'old-' || g, g, %s, g %% 3, 1000000 + g, 0 FROM generate_series(1, 40000) g"
        ).format(target),
        (env.topic,),
    )
    db.execute(sql.SQL("ANALYZE {}").format(target))
    events = list(sample_events(5001, seed=71))
    produce(env.settings.bootstrap_servers, env.topic, events[:5000], key_field=None)
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    db.execute(sql.SQL("ANALYZE {}").format(sql.Identifier("kafka2pg", env.pipeline.staging_table)))
    scans, probes = target_scans(db, env)

    validate_batch(env.settings, env.pipeline, batch_id, probe_promoted_keys=True)
    deadline = time.monotonic() + 30
    while target_scans(db, env)[1] == probes and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # a backend publishes its table and index counts one after the other
    after = target_scans(db, env)
    assert after[1] > probes, "the business-key check did not use the target's unique index"
    assert after[0] == scans, f"validation read the whole target {after[0] - scans} time(s)"
    assert promote_batch(env.settings, env.pipeline, batch_id).promoted == 5000

    produce(env.settings.bootstrap_servers, env.topic, [{**events[5000], "event_id": "old-777"}], key_field=None)
    second = run_batch(env)
    assert (second.promoted, second.quarantined) == (0, 1)
    assert quarantine(db, env)[0][1].startswith(
        "business key already promoted by batch 0 at partition 0 offset 1000777"
    )


def test_without_a_business_key_index_the_gate_still_catches_a_promoted_key(make_pipeline, run_batch, db):
    """A target whose business-key index is gone (a business_key changed after the target was
    created keeps the old key's index): the check falls back to the planner's join, and a key
    promoted before is still caught."""
    env = make_pipeline(partitions=1)
    db.execute(
        sql.SQL("DROP INDEX {}").format(sql.Identifier(env.pipeline.target_schema, env.pipeline.business_key_index))
    )
    events = list(sample_events(4, seed=72))
    produce(env.settings.bootstrap_servers, env.topic, events[:3], key_field=None)
    assert run_batch(env).promoted == 3
    produce(
        env.settings.bootstrap_servers, env.topic, [{**events[3], "event_id": events[1]["event_id"]}], key_field=None
    )
    second = run_batch(env)
    assert (second.promoted, second.quarantined) == (0, 1)
    assert quarantine(db, env)[0][1].startswith("business key already promoted by batch")


def key_check(db, batch_id: int) -> tuple[bool, int, str]:
    return db.execute(
        "SELECT success, unexpected_count, details FROM kafka2pg.batch_checks"
        " WHERE batch_id = %s AND check_name = 'business_key_not_already_promoted'",
        (batch_id,),
    ).fetchone()


def promote_dying_in_the_deferred_check(monkeypatch, env, batch_id: int) -> None:
    """A promotion whose key collision sends the batch back, then dies in the deferred check."""
    import kafka2pg.checks

    def dies(*args):
        raise RuntimeError("worker lost during the deferred check")

    with monkeypatch.context() as patch:
        patch.setattr(kafka2pg.checks, "_business_key_not_promoted", dies)
        with pytest.raises(RuntimeError, match="worker lost"):
            promote_batch(env.settings, env.pipeline, batch_id)


def test_a_deferred_promoted_key_check_is_run_when_the_unique_index_refuses_a_key(
    make_pipeline, spark, run_batch, db, monkeypatch, heads
):
    """While the previous batch found no promoted keys, the gate leaves that check to the
    target's unique index. When the index refuses a key at promotion, nothing of that insert
    lands: the check runs (an attempt that dies in it is resumed by the next promote call), the
    row is flagged to quarantine with the batch that promoted the key, the batch's other
    findings stand, and the rest is promoted. The batch after it is checked up front; once one
    is clean again the check is deferred again."""
    env = make_pipeline(partitions=1)
    events = list(sample_events(6, seed=73))
    produce(env.settings.bootstrap_servers, env.topic, events[:3], key_field=None)
    first = run_batch(env)
    assert first.promoted == 3 and key_check(db, first.batch_id) == (True, 0, DEFERRED_KEY_PROBE)

    repeat = {**events[3], "event_id": events[1]["event_id"]}  # offset 3: promoted by the first batch
    produce(env.settings.bootstrap_servers, env.topic, [repeat, events[4], events[4]], key_field=None)
    second = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, second)
    assert validate_batch(env.settings, env.pipeline, second).state == "validated"
    assert key_check(db, second) == (True, 0, DEFERRED_KEY_PROBE)

    promote_dying_in_the_deferred_check(monkeypatch, env, second)
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (second,)).fetchone()[0]
    assert state == "staged" and target_ids(db, env) == sorted(e["event_id"] for e in events[:3])

    promoted = promote_batch(env.settings, env.pipeline, second)  # a retry of the promote task
    assert (promoted.promoted, promoted.quarantined, promoted.already_promoted) == (1, 2, False)
    assert key_check(db, second) == (True, 1, "1 duplicate(s) flagged to quarantine")
    assert target_ids(db, env) == sorted(e["event_id"] for e in [*events[:3], events[4]])
    reasons = quarantine(db, env)
    assert [o for o, _ in reasons] == [3, 5]
    assert reasons[0][1].startswith(f"business key already promoted by batch {first.batch_id} at partition 0 offset 1")
    assert (
        reasons[1][1].startswith("duplicate business key within batch") and "kept partition 0 offset 4" in reasons[1][1]
    )
    assert heads(env) == {0: 6}
    summary = quality_summary(env.settings, env.pipeline, second)
    assert "records read): business_key_not_already_promoted: 1; business_key_unique_in_batch: 1" in summary

    produce(env.settings.bootstrap_servers, env.topic, [events[5]], key_field=None)
    third = run_batch(env)
    assert third.promoted == 1 and key_check(db, third.batch_id) == (True, 0, "no duplicates")
    produce(env.settings.bootstrap_servers, env.topic, [dict(e) for e in sample_events(1, seed=74)], key_field=None)
    fourth = run_batch(env)
    assert fourth.promoted == 1 and key_check(db, fourth.batch_id) == (True, 0, DEFERRED_KEY_PROBE)
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_under_the_fail_policy_a_key_refused_at_promotion_rejects_the_batch(make_pipeline, spark, run_batch, db, heads):
    env = make_pipeline(partitions=1, duplicate_policy="fail")
    events = list(sample_events(4, seed=75))
    produce(env.settings.bootstrap_servers, env.topic, events[:2], key_field=None)
    assert run_batch(env).promoted == 2
    produce(env.settings.bootstrap_servers, env.topic, [events[2], {**events[3], "event_id": events[0]["event_id"]}])
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)
    with pytest.raises(QualityGateFailed) as rejected:
        promote_batch(env.settings, env.pipeline, batch_id)
    assert rejected.value.batch_id == batch_id
    assert rejected.value.failed["business_key_not_already_promoted"].startswith("1 duplicate business key")
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
    assert state == "rejected"
    assert target_ids(db, env) == sorted(e["event_id"] for e in events[:2]) and quarantine(db, env) == []
    assert heads(env) == {0: 2}

    # Its staged rows stay for inspection until the next batch is planned, which reads them again.
    from kafka2pg.rows import staged_counts

    assert staged_counts(db, env.pipeline, batch_id) == {0: 2}
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    abandoned = db.execute(
        "INSERT INTO kafka2pg.batches (pipeline, topic, state, plan) VALUES (%s, %s, 'abandoned', '{}')"
        " RETURNING batch_id",
        (env.pipeline.name, env.topic),
    ).fetchone()[0]
    db.execute(  # a row its fenced-off task committed after it was abandoned
        sql.SQL(
            "INSERT INTO {} (batch_id, chunk, kafka_topic, kafka_partition, kafka_offset) VALUES (%s, 0, %s, 0, 2)"
        ).format(staging),
        (abandoned, env.topic),
    )
    next_batch = open_batch(env.settings, env.pipeline).batch
    assert next_batch.batch_id > batch_id
    assert staged_counts(db, env.pipeline, batch_id) == {}
    leftovers = db.execute(sql.SQL("SELECT count(*) FROM {}").format(staging)).fetchone()[0]
    assert leftovers == 0


def test_without_a_unique_business_key_index_the_check_is_never_deferred(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1)
    index = sql.Identifier(env.pipeline.target_schema, env.pipeline.business_key_index)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("DROP INDEX {}").format(index))
    db.execute(  # not unique
        sql.SQL("CREATE INDEX {} ON {} (event_id)").format(sql.Identifier(env.pipeline.business_key_index), target)
    )
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(2, seed=76)), key_field=None)
    first = run_batch(env)
    assert first.promoted == 2 and key_check(db, first.batch_id) == (True, 0, "no duplicates")


def test_a_batch_sent_back_by_a_collision_keeps_its_findings_when_the_next_run_validates_it(
    make_pipeline, spark, run_batch, db, monkeypatch
):
    """The promotion dies between the collision and the deferred check: the next run's validate
    step runs that check only (its in-batch duplicate stays counted), then promotes; a batch
    whose staging is lost and staged again is judged afresh (its stored results are cleared)."""
    env = make_pipeline(partitions=1)
    events = list(sample_events(5, seed=77))
    produce(env.settings.bootstrap_servers, env.topic, events[:2], key_field=None)
    assert run_batch(env).promoted == 2
    produce(
        env.settings.bootstrap_servers,
        env.topic,
        [{**events[2], "event_id": events[0]["event_id"]}, events[3], events[3]],
    )
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)

    promote_dying_in_the_deferred_check(monkeypatch, env, batch_id)
    assert validate_batch(env.settings, env.pipeline, batch_id).state == "validated"
    checks = dict(
        db.execute(
            "SELECT check_name, unexpected_count FROM kafka2pg.batch_checks"
            " WHERE batch_id = %s AND unexpected_count > 0",
            (batch_id,),
        ).fetchall()
    )
    assert checks == {"business_key_unique_in_batch": 1, "business_key_not_already_promoted": 1}
    promoted = promote_batch(env.settings, env.pipeline, batch_id)
    assert (promoted.promoted, promoted.quarantined) == (1, 2)

    produce(env.settings.bootstrap_servers, env.topic, [events[4]], key_field=None)
    lost = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, lost)
    validate_batch(env.settings, env.pipeline, lost)
    db.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier("kafka2pg", env.pipeline.staging_table)))
    with pytest.raises(StagingLostError) as lost_error:
        promote_batch(env.settings, env.pipeline, lost)
    assert (lost_error.value.pipeline, lost_error.value.batch_id) == (env.pipeline.name, lost)
    stage_batch(spark, env.settings, env.pipeline, lost)
    stored = db.execute("SELECT count(*) FROM kafka2pg.batch_checks WHERE batch_id = %s", (lost,)).fetchone()[0]
    assert stored == 0, "staging a batch again must clear the results that judged its lost rows"
    validate_batch(env.settings, env.pipeline, lost)
    assert promote_batch(env.settings, env.pipeline, lost).promoted == 1
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def validated_copy_of_a_promoted_key(env, spark, run_batch, seed: int, key_suffix: str = "") -> tuple[int, list[dict]]:
    """Two events promoted, then a validated batch of a copy of the first one's key (its id
    ending in `key_suffix`) and a new event (the key probe deferred to the target's index): its
    id and the four events."""
    events = list(sample_events(4, seed=seed))
    events[0]["event_id"] += key_suffix
    produce(env.settings.bootstrap_servers, env.topic, events[:2], key_field=None)
    assert run_batch(env).promoted == 2
    produce(env.settings.bootstrap_servers, env.topic, [{**events[2], "event_id": events[0]["event_id"]}, events[3]])
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)
    return batch_id, events


def assert_promoted_once(db, env, events, promoted) -> None:
    """The batch of `validated_copy_of_a_promoted_key` promoted by this attempt: the new event
    landed, the copy quarantined, once."""
    assert (promoted.promoted, promoted.quarantined, promoted.already_promoted) == (1, 1, False)
    assert target_ids(db, env) == sorted(e["event_id"] for e in [*events[:2], events[3]])
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_a_promote_attempt_that_finds_the_batch_sent_back_and_checked_again_by_its_twin_promotes_it(
    make_pipeline, spark, run_batch, db, monkeypatch
):
    """Two attempts of the promote task at once (Airflow retried one whose worker it lost): one
    collides on a business key and sends the batch back to `staged`; the other reads it `staged`,
    and by the time it asks why, the first has run the deferred check and the batch is
    `validated` again. The second promotes it (it failed as `is staged`, with no retry, while
    the batch was promotable); the rows land once."""
    import kafka2pg.steps

    env = make_pipeline(partitions=1)
    batch_id, events = validated_copy_of_a_promoted_key(env, spark, run_batch, seed=81)
    promote_dying_in_the_deferred_check(monkeypatch, env, batch_id)  # the first attempt: sent back

    tries = []
    promote_once = kafka2pg.steps._promote_once

    def twin_checks_meanwhile(*args):
        tries.append(args)
        try:
            return promote_once(*args)
        finally:
            if len(tries) == 1:  # the first attempt runs the deferred check between the read and the why
                validate_batch(env.settings, env.pipeline, batch_id, probe_promoted_keys=True)

    monkeypatch.setattr(kafka2pg.steps, "_promote_once", twin_checks_meanwhile)
    promoted = promote_batch(env.settings, env.pipeline, batch_id)
    assert len(tries) == 2
    assert_promoted_once(db, env, events, promoted)


def test_two_promote_attempts_that_both_collide_on_a_key_promote_the_batch_once(
    make_pipeline, spark, run_batch, db, monkeypatch
):
    """Two attempts of the promote task at once both read the batch `validated` and collide on
    a business key; the twin sends it back to `staged` first. This attempt finds it sent back
    with its check to run: it runs the check and promotes (it failed with a KeyCollisionError,
    not retried, while the twin went on)."""
    import kafka2pg.steps

    env = make_pipeline(partitions=1)
    batch_id, events = validated_copy_of_a_promoted_key(env, spark, run_batch, seed=82)
    assert key_check(db, batch_id) == (True, 0, DEFERRED_KEY_PROBE)

    send_back = kafka2pg.steps._send_back
    calls = []

    def twin_sends_back_first(*args):
        calls.append(args)
        if len(calls) == 1:
            assert send_back(*args) == kafka2pg.steps._CHECK  # the twin, which collided too
        return send_back(*args)

    monkeypatch.setattr(kafka2pg.steps, "_send_back", twin_sends_back_first)
    promoted = promote_batch(env.settings, env.pipeline, batch_id)
    assert len(calls) == 1
    assert_promoted_once(db, env, events, promoted)


def test_a_key_collision_at_promotion_quotes_the_key_escaped_in_the_task_log(
    make_pipeline, spark, run_batch, db, caplog
):
    """PostgreSQL's words about the collision quote the key, a record's bytes: a terminal's escape
    sequences in it reach the log as escapes, not as bytes that retitle or recolour a terminal."""
    env = make_pipeline(partitions=1)
    hostile = "\x1b[31mred\x1b[0m\x1b]0;retitled\x07"
    batch_id, events = validated_copy_of_a_promoted_key(env, spark, run_batch, seed=84, key_suffix=hostile)
    with caplog.at_level(logging.WARNING, logger="kafka2pg"):
        promoted = promote_batch(env.settings, env.pipeline, batch_id)
    said = [r.getMessage() for r in caplog.records if "a business key is already in the target" in r.getMessage()]
    assert said and "\\x1b[31mred\\x1b[0m\\x1b]0;retitled\\x07" in said[0], said
    assert not any(c in said[0] for c in "\x1b\x07"), said
    assert_promoted_once(db, env, events, promoted)


def test_a_deferred_batch_whose_offsets_landed_meanwhile_is_rejected_at_promotion(
    make_pipeline, spark, run_batch, db, heads, write_by_hand
):
    """The collision that sends a batch back may be on the target's primary key (a row of the
    same offset written after validation, say by hand): the offsets check runs again with the
    deferred one, and the batch is rejected with the count, instead of colliding again."""
    env = make_pipeline(partitions=1)
    events = list(sample_events(4, seed=78))
    produce(env.settings.bootstrap_servers, env.topic, events[:2], key_field=None)
    assert run_batch(env).promoted == 2
    produce(env.settings.bootstrap_servers, env.topic, events[2:], key_field=None)
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)
    assert key_check(db, batch_id) == (True, 0, DEFERRED_KEY_PROBE)
    write_by_hand(env, "written-by-hand", env.topic, 0, 3)
    with pytest.raises(QualityGateFailed) as rejected:
        promote_batch(env.settings, env.pipeline, batch_id)
    assert rejected.value.batch_id == batch_id
    assert rejected.value.failed["provenance_not_already_promoted"].startswith("1 staged offsets already in the target")
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
    assert state == "rejected" and heads(env) == {0: 2}
    assert target_ids(db, env) == sorted([e["event_id"] for e in events[:2]] + ["written-by-hand"])


def produce_in_a_transaction(env, events: list[dict]) -> None:
    """Write `events` to partition 0 in one committed transaction: its commit marker takes an
    offset without a record, a gap the gate asks Kafka to witness."""
    producer = Producer(
        {**client_config(env.settings.bootstrap_servers, 10), "transactional.id": f"tx-{env.topic}-{len(events)}"}
    )
    producer.init_transactions(10)
    producer.begin_transaction()
    for event in events:
        producer.produce(env.topic, value=json.dumps(event).encode(), partition=0)
    producer.commit_transaction(10)
    deadline = time.monotonic() + 30  # the coordinator writes the marker after the commit returns
    while time.monotonic() < deadline:
        (p0,) = partition_offsets(env.settings.bootstrap_servers, env.topic)
        if p0.last_stable == p0.high:
            return
        time.sleep(0.1)
    raise AssertionError(f"the transaction's marker did not land within 30s: {p0}")


def gap_check(db, batch_id: int) -> tuple[bool, str]:
    return db.execute(
        "SELECT success, details FROM kafka2pg.batch_checks"
        " WHERE batch_id = %s AND check_name = 'offset_gaps_explained'",
        (batch_id,),
    ).fetchone()


def test_a_batch_sent_back_by_a_collision_is_rechecked_without_asking_kafka(
    make_pipeline, spark, run_batch, db, monkeypatch
):
    """A batch whose range holds a transaction marker (its first validation had Kafka witness the
    gap), sent back by a key collision: the recheck looks only into the target, so it validates
    and promotes with Kafka unreachable (or its offsets expired since), and its gap findings stand."""
    env = make_pipeline(partitions=1)
    events = list(sample_events(4, seed=79))
    produce(env.settings.bootstrap_servers, env.topic, events[:2], key_field=None)
    assert run_batch(env).promoted == 2
    produce_in_a_transaction(env, [{**events[2], "event_id": events[0]["event_id"]}, events[3]])  # marker at 4
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    assert validate_batch(env.settings, env.pipeline, batch_id).state == "validated"
    assert key_check(db, batch_id) == (True, 0, DEFERRED_KEY_PROBE)
    explained = (True, "p0: 1 offsets without a record (0 aborted, 1 transaction markers, 0 compacted)")
    assert gap_check(db, batch_id) == explained

    promote_dying_in_the_deferred_check(monkeypatch, env, batch_id)
    kafka_gone = dataclasses.replace(env.settings, kafka="127.0.0.1:9", kafka_timeout_s=2)
    assert validate_batch(kafka_gone, env.pipeline, batch_id).state == "validated"
    assert key_check(db, batch_id)[:2] == (True, 1) and gap_check(db, batch_id) == explained
    promoted = promote_batch(env.settings, env.pipeline, batch_id)
    assert (promoted.promoted, promoted.quarantined) == (1, 1)
    assert target_ids(db, env) == sorted(e["event_id"] for e in [*events[:2], events[3]])


def test_witnesses_asked_about_another_staging_of_the_batch_make_the_gate_retry(make_pipeline, spark, db, monkeypatch):
    """The gate asks Kafka about a batch's gaps before it locks the batch; a stage job may finish
    in between. Witnesses asked before the batch was staged, or while it was back to planned
    with the read counts of a staging since lost, are refused with a retryable error naming
    both stagings; nothing is decided, and the next attempt asks Kafka again and validates."""
    import kafka2pg.quality

    env = make_pipeline(partitions=1)
    produce_in_a_transaction(env, list(sample_events(3, seed=80)))  # offsets 0-2, marker at 3
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    asked = kafka2pg.quality.gap_witnesses

    def staged_before_the_lock(settings, pipeline, batch_id):
        witnesses = asked(settings, pipeline, batch_id)
        stage_batch(spark, env.settings, env.pipeline, batch_id)  # a stage job finishing meanwhile
        return witnesses

    def validated_while_staged_meanwhile() -> WitnessMismatchError:
        with monkeypatch.context() as patch:
            patch.setattr(kafka2pg.quality, "gap_witnesses", staged_before_the_lock)
            with pytest.raises(WitnessMismatchError) as refused:
                validate_batch(env.settings, env.pipeline, batch_id)
        assert not refused.value.terminal
        state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
        assert state == "staged" and gap_check(db, batch_id) is None
        return refused.value

    refused = validated_while_staged_meanwhile()  # asked while planned, never staged
    assert (refused.batch_id, refused.state, refused.reads) == (batch_id, "staged", {0: 3})
    assert refused.witnessed.startswith("asked while it was planned") and refused.witnessed.endswith("{0: 0}")

    db.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier("kafka2pg", env.pipeline.staging_table)))
    with pytest.raises(StagingLostError):
        validate_batch(env.settings, env.pipeline, batch_id)
    refused = validated_while_staged_meanwhile()  # planned again, staged again with the same counts
    assert refused.reads == {0: 3} and refused.witnessed.startswith("asked while it was planned")
    assert refused.witnessed.endswith("{0: 3}")

    assert validate_batch(env.settings, env.pipeline, batch_id).state == "validated"  # the retry
    assert gap_check(db, batch_id) == (
        True,
        "p0: 1 offsets without a record (0 aborted, 1 transaction markers, 0 compacted)",
    )
    assert promote_batch(env.settings, env.pipeline, batch_id).promoted == 3


def test_a_report_that_cannot_be_written_leaves_the_verdict_standing(
    make_pipeline, spark, db, sample_columns, tmp_path, caplog
):
    """The report is written after the verdict committed: a disk that refuses it (here a file
    where its directory goes) is logged, the batch records no report, and the gate's outcome,
    rejected or validated, is what the caller gets."""
    rejecting = make_pipeline(partitions=1, columns=with_rules(sample_columns, "fail"), duplicate_policy="fail")
    passing = make_pipeline(partitions=1)
    blocked = tmp_path / "state"
    (blocked / "reports").mkdir(parents=True)
    events = list(sample_events(9, seed=54))
    produce(rejecting.settings.bootstrap_servers, rejecting.topic, first_batch(events), key_field=None)
    produce(passing.settings.bootstrap_servers, passing.topic, events[:3], key_field=None)

    def staged(env) -> int:
        batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
        stage_batch(spark, env.settings, env.pipeline, batch_id)
        (blocked / "reports" / env.pipeline.name).write_text("not a directory")
        return batch_id

    def report_path(batch_id: int) -> tuple[str, str | None]:
        return db.execute("SELECT state, report_path FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()

    rejected_id = staged(rejecting)
    with caplog.at_level(logging.WARNING, logger="kafka2pg.quality"):
        with pytest.raises(QualityGateFailed) as rejected:
            validate_batch(dataclasses.replace(rejecting.settings, state_dir=blocked), rejecting.pipeline, rejected_id)
    assert (rejected.value.batch_id, rejected.value.report) == (rejected_id, None)
    assert "Report: not written (see the task log)." in str(rejected.value)
    assert report_path(rejected_id) == ("rejected", None)
    warning = [r.getMessage() for r in caplog.records if "quality report not written" in r.getMessage()]
    assert len(warning) == 1 and str(blocked / "reports" / rejecting.pipeline.name) in warning[0]
    assert "File exists" in warning[0] or "Not a directory" in warning[0]

    passed_id = staged(passing)
    result = validate_batch(dataclasses.replace(passing.settings, state_dir=blocked), passing.pipeline, passed_id)
    assert (result.state, result.report) == ("validated", None) and "report: not written" in result.message
    assert report_path(passed_id) == ("validated", None)
    assert promote_batch(passing.settings, passing.pipeline, passed_id).promoted == 3


def test_a_duplicate_of_a_compound_business_key_is_flagged_naming_each_column_and_value(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1, business_key=["customer_id", "currency"])
    events = list(sample_events(3, seed=52))
    events[2] = {**events[2], "customer_id": events[0]["customer_id"], "currency": events[0]["currency"]}
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (2, 1)
    assert quarantine(db, env) == [
        (
            2,
            f"duplicate business key within batch {result.batch_id}: kept partition 0 offset 0"
            f" (customer_id = '{events[0]['customer_id']}', currency = '{events[0]['currency']}')",
        )
    ]


def test_rows_the_gate_flags_keep_their_raw_key_value_and_headers_read_again_from_kafka(
    make_pipeline, run_batch, db, sample_columns
):
    env = make_pipeline(partitions=1, columns=with_rules(sample_columns, "quarantine"))
    events = list(sample_events(3, seed=53))
    events[2] = {**events[2], "currency": "XXX"}  # violates the declared allowed values
    values = [json.dumps(e).encode() for e in events]
    values[0] = values[0].replace(b'"customer_id": ', b'"payload": {"n": 1e30}, "customer_id": ', 1)
    sent = [  # (key, value, headers): a producer retry writes the first event again, key and headers too
        (b"k\xfe0", values[0], [("trace", b"\xfe\x00"), ("empty", b"")]),
        (b"k1", values[1], None),
        (b"k\xfe0", values[0], [("trace", b"\xfe\x00"), ("empty", b"")]),
        (None, values[2], [("h", b"v")]),
    ]
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    for key, value, headers in sent:
        producer.produce(env.topic, key=key, value=value, headers=headers, partition=0)
    assert producer.flush(30) == 0

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (2, 2)
    rows = db.execute(
        "SELECT kafka_offset, reason, raw_key, raw_value, raw_headers FROM kafka2pg.quarantine"
        " WHERE pipeline = %s ORDER BY kafka_offset",
        (env.pipeline.name,),
    ).fetchall()
    assert [(offset, reason.split(" ")[0]) for offset, reason, *_ in rows] == [(2, "duplicate"), (3, "currency")]
    for (offset, _, key, value, headers), (sent_key, sent_value, sent_headers) in zip(
        rows, (sent[2], sent[3]), strict=True
    ):
        assert (key and bytes(key), bytes(value)) == (sent_key, sent_value), offset
        assert [[bytes(k), bytes(v)] for k, v in headers] == [[k.encode(), v] for k, v in sent_headers], offset
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_with_kafka_gone_after_the_gate_its_flagged_rows_keep_their_typed_values_and_the_batch_promotes(
    make_pipeline, run_batch, db, monkeypatch, caplog
):
    from kafka2pg import raw_bytes
    from kafka2pg.exceptions import KafkaUnavailableError

    def unreachable(*args, **kwargs):
        raise KafkaUnavailableError("Kafka at test did not answer")

    monkeypatch.setattr(raw_bytes, "raw_records_at", unreachable)
    env = make_pipeline(partitions=1)
    events = list(sample_events(2, seed=54))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[0]], key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (2, 1)
    ((reason, raw_value, record),) = db.execute(
        "SELECT reason, raw_value, record FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchall()
    assert reason.startswith("duplicate business key") and raw_value is None
    assert record["event_id"] == events[0]["event_id"]
    assert "the raw bytes of rows quarantined without them were not kept (KafkaUnavailableError" in caplog.text


def test_the_gates_frame_holds_a_ranged_numeric_as_the_float_of_its_decimal(make_pipeline, db, sample_columns):
    """Great Expectations compares floats: a ranged numeric(p,s) column reaches its frame as the
    float of each exact value, cast by PostgreSQL where float8 holds every value of the type, read
    as a Decimal and converted where it may not (a cast there would fail the gate on a value)."""
    from decimal import Decimal

    import pandas as pd

    from kafka2pg.expectations import load_accepted

    ranged = {"min": 0, "max": 1, "on_violation": "quarantine"}
    extra = [
        {"name": "fine", "type": "numeric(40,20)", **ranged},  # more digits than a double keeps
        {"name": "tiny", "type": "numeric(400,360)", **ranged},  # beyond float8: read as Decimals
        {"name": "unset", "type": "numeric(12,2)", **ranged},  # NULL in every row
    ]
    env = make_pipeline(partitions=1, columns=[*with_rules(sample_columns, "quarantine"), *extra])
    values = {
        "amount": ["0.10", "0.29", "999.99", "1234567890.12", None, "-0.07"],
        "fine": ["0.12345678901234567890", "1.00000000000000011102", "0.3", None, "-98765432109876543210", "0"],
        "tiny": ["1e-350", "0.3", None, "1", "7e-301", "0"],
        "unset": [None] * 6,
    }
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    with db.cursor() as cur:
        cur.executemany(
            sql.SQL(
                "INSERT INTO {} (batch_id, chunk, kafka_topic, kafka_partition, kafka_offset, event_id, customer_id,"
                " amount, fine, tiny, unset) VALUES (1, 0, %s, 0, %s, %s, 1, %s::numeric, %s::numeric, %s::numeric,"
                " %s::numeric)"
            ).format(staging),
            [(env.topic, i, f"e{i}", *row) for i, row in enumerate(zip(*values.values(), strict=True))],
        )
    db.execute("SET extra_float_digits = 0")  # as a role or database may set it: 15 digits as text
    frame = load_accepted(db, env.pipeline, 1)

    for column, texts in values.items():
        expected = pd.to_numeric(pd.Series([None if t is None else Decimal(t) for t in texts], dtype=object))
        assert frame[column].dtype == "float64", column
        got = frame[column].to_list()
        assert [x if x == x else None for x in got] == [x if x == x else None for x in expected.to_list()], column
    assert frame["amount"].to_list()[:2] == [0.1, 0.29]


def _nested_loops_over_the_batch(plan: dict, staging: str) -> list[str]:
    """The nested loops of a plan (auto_explain's JSON) whose inner side is not an index probe of
    another table: a scan of the staging table, or a subquery or function over the batch's rows,
    run again for every row of the outer side."""
    found = []
    children = plan.get("Plans", [])
    if plan["Node Type"] == "Nested Loop":
        inner = next(c for c in children if c.get("Parent Relationship") == "Inner")
        probe = inner["Node Type"] in ("Index Scan", "Index Only Scan") and inner.get("Relation Name") != staging
        if not probe:
            found.append(f"{inner['Node Type']} {inner.get('Relation Name', '')}".strip())
    for child in children:
        found += _nested_loops_over_the_batch(child, staging)
    return found


def test_flagging_a_batch_of_duplicates_never_joins_its_staged_rows_in_a_nested_loop(make_pipeline, spark, db):
    """A batch staged since the staging table's statistics were gathered reads as one row to the
    planner. Joined with its own duplicates, with the rows refused, with the copies of a key
    found promoted, or with the raw bytes read again for them in a nested loop, every staged row
    was visited once per such row: 30,000 duplicates of promoted keys took minutes to flag. Seen
    here in the plans PostgreSQL ran (auto_explain) and in its own count of the staging rows
    read, not timed."""
    from kafka2pg.batch_store import load_batch
    from kafka2pg.checks import gap_witnesses, run_checks
    from kafka2pg.kafka_reader import RawRecord
    from kafka2pg.raw_bytes import fill_raw_bytes, staging_place

    env = make_pipeline(partitions=2)
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(staging))
    events = list(sample_events(1500, seed=61))
    produce(env.settings.bootstrap_servers, env.topic, events)
    first = open_batch(env.settings, env.pipeline, run_id="first").batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, first)
    # Statistics as a busy table has them between two automatic analyses: of the batches before, none of the next.
    db.execute(sql.SQL("ANALYZE {}").format(staging))
    validate_batch(env.settings, env.pipeline, first)
    assert promote_batch(env.settings, env.pipeline, first).promoted == 1500
    # The same events again, twice: each staged row duplicates a promoted key, or a copy in the batch.
    produce(env.settings.bootstrap_servers, env.topic, [*events, *events])
    opened = open_batch(env.settings, env.pipeline, run_id="again")
    assert opened.batch is not None, opened
    batch_id = opened.batch.batch_id
    staged = stage_batch(spark, env.settings, env.pipeline, batch_id)
    rows = sum(r.records for r in staged.reads)
    assert rows == 3000

    plans: list[dict] = []
    db.add_notice_handler(
        lambda notice: plans.append(json.loads(notice.message_primary.split("\n", 1)[1]))
        if notice.message_primary.startswith("duration:") and "\n" in notice.message_primary
        else None
    )
    db.execute("LOAD 'auto_explain'")
    for setting in ("log_min_duration = 0", "log_format = json", "log_level = notice"):
        db.execute(f"SET auto_explain.{setting}")

    def staging_rows_read() -> int:
        return db.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relid = %s::regclass",
            (staging.as_string(db),),
        ).fetchone()[0]

    with db.transaction(force_rollback=True):
        witnesses = gap_witnesses(env.settings, env.pipeline, batch_id)
        counts = {r.partition: r.records for r in staged.reads}
        checks = run_checks(db, env.pipeline, load_batch(db, batch_id), True, counts, witnesses)
        flagged = {c.name: c.flagged for c in checks if c.flagged}
        assert flagged == {"business_key_unique_in_batch": 1500, "business_key_not_already_promoted": 1500}, checks
        read = staging_rows_read()
        assert read < 20 * rows, f"the checks read {read} staged rows for a batch of {rows}"
        offsets = db.execute(
            sql.SQL("SELECT kafka_partition, kafka_offset FROM {} WHERE batch_id = %s").format(staging), (batch_id,)
        ).fetchall()
        found = {offset: RawRecord(b"k", b"v", []) for offset in offsets}
        assert fill_raw_bytes(db, staging_place(env.pipeline), batch_id, found) == rows
    db.execute("SET auto_explain.log_min_duration = -1")
    updates = [p for p in plans if p["Query Text"].startswith(f"UPDATE {staging.as_string(db)}")]
    assert len(updates) == 4, [p["Query Text"][:80] for p in plans]
    for plan in updates:
        loops = _nested_loops_over_the_batch(plan["Plan"], env.pipeline.staging_table)
        assert not loops, (plan["Query Text"][:120], loops)


def test_a_required_jsonb_value_too_long_for_pythons_int_lands_instead_of_rejecting_its_batch(
    make_pipeline, run_batch, db, sample_columns
):
    """PostgreSQL's jsonb keeps a number of 5,000 digits; Python refuses to parse an integer of more
    than 4,300. The gate reads a required jsonb column only to see it is not NULL: a record holding
    such a number must land, not reject its batch run after run."""
    columns = [{**c, "required": True} if c["name"] == "payload" else c for c in sample_columns]
    env = make_pipeline(partitions=1, columns=columns)
    events = list(sample_events(3, seed=55))
    values = [json.dumps(e).encode() for e in events]
    long_number = b"9" * 5000
    values[1] = values[1].replace(b'"seq": 1}', b'"seq": ' + long_number + b"}")
    assert long_number in values[1]
    produce(env.settings.bootstrap_servers, env.topic, values, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (3, 0)
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(
        sql.SQL("SELECT payload->>'seq' FROM {} WHERE event_id = %s").format(table), (events[1]["event_id"],)
    ).fetchone()
    assert landed == (long_number.decode(),)


@pytest.mark.parametrize("on_violation", ["quarantine", "fail"])
def test_allowed_values_holding_a_percent_sign_are_checked_like_any_other(
    make_pipeline, run_batch, db, sample_columns, on_violation
):
    """psycopg reads a `%` in a statement run with parameters as a placeholder, even inside a
    literal: a text column allowed "50%" failed every gate run before its values were spelled
    without one."""
    rule = {"allowed": ["EUR", "50%", "100%%"], "on_violation": on_violation}
    env = make_pipeline(partitions=1, columns=[{**c, **rule} if c["name"] == "currency" else c for c in sample_columns])
    events = list(sample_events(6, seed=52))
    for event, currency in zip(events, ["EUR", "50%", "100%%", "EUR", "50%", "%s"], strict=True):
        event["currency"] = currency
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)
    if on_violation == "fail":
        with pytest.raises(QualityGateFailed, match="currency"):
            run_batch(env)
        return
    result = run_batch(env)
    assert (result.promoted, result.quarantined) == (5, 1)
    assert quarantine(db, env) == [(5, "currency = '%s' violates the declared allowed values ['EUR', '50%', '100%%']")]
    assert target_ids(db, env) == sorted(e["event_id"] for e in events[:5])


def test_a_value_outside_its_range_by_less_than_a_float_sees_fails_the_gate_and_a_ranged_key_stays_exact(
    make_pipeline, spark, db
):
    """Great Expectations compares floats: 1.00000000000000000001 is 1.0 there, and 2**53 + 1 is
    2**53. The gate's exact SQL check fails such a batch; a ranged numeric business key is not
    rounded for the uniqueness expectations (two keys a float cannot tell apart are two keys)."""
    columns = [
        {"name": "id", "type": "numeric(30,0)", "required": True, "min": 0, "max": 10**29},
        {"name": "ratio", "type": "numeric(30,20)", "min": 0, "max": 1},
        {"name": "big", "type": "bigint", "max": 2**53},
    ]
    env = make_pipeline(partitions=1, columns=columns, business_key=["id"])
    good = [
        b'{"id": 12345678901234567890, "ratio": 1, "big": 9007199254740992}',
        b'{"id": 12345678901234567891, "ratio": 0.5, "big": 1}',  # the same float as the key before
    ]
    produce(env.settings.bootstrap_servers, env.topic, good, key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    assert validate_batch(env.settings, env.pipeline, batch.batch_id).checks  # nothing violated, no false duplicate
    promote_batch(env.settings, env.pipeline, batch.batch_id)

    produce(
        env.settings.bootstrap_servers,
        env.topic,
        [b'{"id": 1, "ratio": 1.00000000000000000001, "big": 9007199254740993}', b'{"id": 2, "ratio": 0}'],
        key_field=None,
    )
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    failed = rejected.value.failed
    assert set(failed) == {"rule_ratio", "rule_big"}, failed  # GX's own expectations passed: floats
    assert failed["rule_ratio"] == "1 row(s) violating the declared range [0, 1] (e.g. p0@2)"
    assert failed["rule_big"] == "1 row(s) violating the declared maximum 9007199254740992 (e.g. p0@2)"
