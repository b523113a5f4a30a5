"""The walking skeleton against the real broker, PostgreSQL and Spark (same functions as the DAG)."""

import dataclasses
import logging
import os
import subprocess
import sys
import time
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from psycopg import sql

from kafka2pg.devtools.producer import produce, produce_sample, sample_events
from kafka2pg.exceptions import (
    DatabaseRefusedError,
    DatabaseUnavailableError,
    KafkaUnavailableError,
    LedgerConflictError,
    OffsetRegressionError,
    QualityGateFailed,
    StageInterrupted,
    TopicNotFoundError,
)
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.kafka_offsets import partition_offsets
from kafka2pg.opening import open_batch, plan_lookahead
from kafka2pg.quality import validate_batch
from kafka2pg.rows import staged_counts
from kafka2pg.runner import run_batches
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch

ROOT = Path(__file__).resolve().parents[2]


def target(env):
    return sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)


def count(db, env):
    return db.execute(sql.SQL("SELECT count(*) FROM {}").format(target(env))).fetchone()[0]


def ledger_ranges(db, env):
    return db.execute(
        "SELECT kafka_partition, start_offset, end_offset, kind, batch_id FROM kafka2pg.ledger_ranges"
        " WHERE pipeline = %s ORDER BY kafka_partition, start_offset",
        (env.pipeline.name,),
    ).fetchall()


def quarantined(db, env):
    return db.execute("SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)).fetchone()[
        0
    ]


def quarantine_reasons(db, env):
    """The reasons of the pipeline's quarantined records, in offset order (one row each)."""
    return db.execute(
        "SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY kafka_offset", (env.pipeline.name,)
    ).fetchall()


def test_all_records_land_once_with_provenance(make_pipeline, run_batch, db, heads):
    env = make_pipeline()
    produce_sample(env.settings.bootstrap_servers, env.topic, 500, seed=1)
    result = run_batch(env)
    assert result.promoted == 500
    rows = db.execute(
        sql.SQL("SELECT event_id, kafka_topic, kafka_partition, kafka_offset, payload->>'seq' FROM {}").format(
            target(env)
        )
    ).fetchall()
    assert len(rows) == 500
    assert {r[1] for r in rows} == {env.topic}
    assert len({(r[2], r[3]) for r in rows}) == 500
    expected = {e["event_id"]: e["payload"]["seq"] for e in sample_events(500, seed=1)}
    assert {r[0]: int(r[4]) for r in rows} == expected
    per_partition = {}
    for _, _, partition, offset, _ in rows:
        per_partition.setdefault(partition, []).append(offset)
    assert heads(env) == {p: max(o) + 1 for p, o in per_partition.items()}
    for offsets in per_partition.values():
        assert sorted(offsets) == list(range(len(offsets)))
    assert run_batch(env) is None, "a second run with nothing new must plan nothing"


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_kafka_connect_envelopes_with_string_amounts_land_by_value_root_and_quoted_numbers(
    make_pipeline, run_batch, db, sample_columns, reader
):
    """Records as Kafka Connect's JsonConverter writes them with schemas (`{"schema": ..., "payload":
    {...}}`), amounts as strings (Debezium's decimal.handling.mode=string): the columns read from
    `value_root: payload`, the amount with `quoted_numbers`, through the stage job's real reader."""
    columns = [{**c, "quoted_numbers": True} if c["name"] == "amount" else c for c in sample_columns]
    env = make_pipeline(partitions=1, value_root="payload", columns=columns, kafka_reader=reader)
    events = list(sample_events(4, seed=11))
    schema = {"type": "struct", "fields": [{"field": "event_id", "type": "string"}], "optional": False}
    envelopes = [{"schema": schema, "payload": {**e, "amount": str(e["amount"])}} for e in events[:3]]
    envelopes.append({"schema": schema, "payload": None})  # Connect's tombstone-like null payload
    envelopes.append({k: v for k, v in events[3].items() if k != "payload"})  # not an envelope
    produce(env.settings.bootstrap_servers, env.topic, envelopes, key_field=None)
    result = run_batch(env)
    assert (result.promoted, result.quarantined) == (3, 2)
    landed = db.execute(sql.SQL("SELECT event_id, amount FROM {} ORDER BY kafka_offset").format(target(env))).fetchall()
    assert landed == [(e["event_id"], Decimal(str(e["amount"]))) for e in events[:3]]
    assert quarantine_reasons(db, env) == [
        ("field 'payload' (the pipeline's value_root): null",),
        ("field 'payload' (the pipeline's value_root): missing",),
    ]


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_debezium_change_events_land_with_their_operation_and_source_position(make_pipeline, run_batch, db, reader):
    """Debezium's change events (JsonConverter without schemas): the row's columns from `after`
    (`value_root`), a delete's from `before` (`value_root_fallback`), the operation and the
    source's commit time and log position from beside it (`path`), through the stage job's real
    reader; a delete without its row and an event whose `source` is not an object are
    quarantined, naming why."""
    columns = [
        {"name": "event_id", "type": "text", "required": True},
        {"name": "customer_id", "type": "bigint", "required": True},
        {"name": "op", "type": "text", "required": True, "path": "op"},
        {"name": "committed_at", "type": "timestamptz", "epoch": "milliseconds", "path": "source.ts_ms"},
        {"name": "lsn", "type": "bigint", "path": ["source", "lsn"]},
    ]
    env = make_pipeline(
        partitions=1,
        value_root="after",
        value_root_fallback="before",
        columns=columns,
        business_key=[],
        kafka_reader=reader,
    )

    def change(op, after, source, before=None):
        return {"before": before, "after": after, "source": source, "op": op, "ts_ms": 1764064800999}

    events = [
        change("r", {"event_id": "a", "customer_id": 1}, {"ts_ms": 1764064800000, "lsn": 100, "db": "shop"}),
        change("c", {"event_id": "b", "customer_id": 2}, {"ts_ms": 1764064801500, "lsn": 101, "db": "shop"}),
        change("d", None, {"ts_ms": 1764064802000, "lsn": 102}, before={"event_id": "a", "customer_id": 1}),
        change("d", None, {"ts_ms": 1764064802000, "lsn": 103}),
        change("c", {"event_id": "c", "customer_id": 3}, "shop"),
        change("c", {"event_id": "d", "customer_id": 4}, None),
    ]
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)
    result = run_batch(env)
    assert (result.promoted, result.quarantined) == (4, 2)
    landed = db.execute(
        sql.SQL("SELECT event_id, customer_id, op, committed_at, lsn FROM {} ORDER BY kafka_offset").format(target(env))
    ).fetchall()
    assert landed == [
        ("a", 1, "r", datetime(2025, 11, 25, 10, tzinfo=UTC), 100),
        ("b", 2, "c", datetime(2025, 11, 25, 10, 0, 1, 500000, tzinfo=UTC), 101),
        ("a", 1, "d", datetime(2025, 11, 25, 10, 0, 2, tzinfo=UTC), 102),
        ("d", 4, "c", None, None),
    ]
    assert quarantine_reasons(db, env) == [
        (
            "field 'after' (the pipeline's value_root): null, and field 'before' (the pipeline's "
            "value_root_fallback): null",
        ),
        ("field 'source': expected a JSON object, got a string ('\"shop\"')",),
    ]


def test_max_records_per_batch_splits_backlog_into_contiguous_ranges(make_pipeline, run_batch, db, heads):
    env = make_pipeline(max_records_per_batch=120)
    produce_sample(env.settings.bootstrap_servers, env.topic, 500, seed=2)
    runs = 0
    while run_batch(env) is not None:
        runs += 1
        assert runs < 20
    assert runs == 5
    assert count(db, env) == 500
    ranges = ledger_ranges(db, env)
    for partition in range(env.partitions):
        mine = [r for r in ranges if r[0] == partition]
        assert mine[0][1] == 0
        for before, after in zip(mine, mine[1:], strict=False):
            assert before[2] == after[1], f"gap or overlap in partition {partition}: {before} {after}"
        assert mine[-1][2] == heads(env)[partition]
    sizes = db.execute(
        "SELECT sum(end_offset - start_offset) FROM kafka2pg.ledger_ranges WHERE pipeline = %s GROUP BY batch_id",
        (env.pipeline.name,),
    ).fetchall()
    assert all(s[0] <= 120 for s in sizes)


def batch_states(db, env):
    return db.execute(
        "SELECT batch_id, state, run_id FROM kafka2pg.batches WHERE pipeline = %s ORDER BY batch_id",
        (env.pipeline.name,),
    ).fetchall()


def test_one_run_catches_up_a_backlog_in_several_batches_of_one_spark_session(
    make_pipeline, spark, db, heads, monkeypatch
):
    """batches_per_run > 1: the stage job finishes each batch (gate, promotion) and plans the next."""
    import threading

    import kafka2pg.kafka_offsets

    env = make_pipeline(max_records_per_batch=100)
    events = list(sample_events(350, seed=21))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[5], events[300]])  # two producer retries
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    real_client, clients = kafka2pg.kafka_offsets.admin_client, []

    def counted(*args):
        clients.append(threading.current_thread() is threading.main_thread())
        return real_client(*args)

    monkeypatch.setattr(kafka2pg.kafka_offsets, "admin_client", counted)
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=3, run_id="run-1")
    monkeypatch.undo()
    assert len(result.promoted) == 3 and result.staged == result.promoted and result.records == 300
    # Three stages (each asks the topic's ID before and after its read) and two lookahead plans:
    # one Kafka client set up for all of them.
    assert clients.count(True) == 1, clients
    assert result.promoted[0] == first.batch_id
    assert count(db, env) + quarantined(db, env) == 300
    assert (result.rows_promoted, result.rows_quarantined) == (count(db, env), quarantined(db, env))
    assert [(state, run) for _, state, run in batch_states(db, env)] == [("promoted", "run-1")] * 3
    after = db.execute(
        "SELECT after_batch_id FROM kafka2pg.batches WHERE pipeline = %s ORDER BY batch_id", (env.pipeline.name,)
    ).fetchall()
    assert [a for (a,) in after] == [None, *result.promoted[:2]], "batches 2 and 3 were staged as lookaheads"
    assert all(result.phases[p] > 0 for p in ("plan", "stage", "validate", "promote"))

    # The next run stops when nothing is left, short of its limit; the ledger is contiguous.
    second = open_batch(env.settings, env.pipeline, run_id="run-2").batch
    result = run_batches(spark, env.settings, env.pipeline, second.batch_id, second.epoch, batches=10, run_id="run-2")
    assert len(result.promoted) == 1 and result.records == 52
    assert count(db, env) == 350 and quarantined(db, env) == 2
    assert (result.rows_promoted, result.rows_quarantined) == (50, 2), "the two producer retries are in it"
    table = f"{env.pipeline.target_schema}.{env.pipeline.target_table}"
    assert result.message.endswith(f"50 rows to {table}, 2 to quarantine")
    ranges = ledger_ranges(db, env)
    for partition in range(env.partitions):
        mine = [r for r in ranges if r[0] == partition]
        assert [r[1] for r in mine[1:]] == [r[2] for r in mine[:-1]], f"gap or overlap in partition {partition}"
        assert mine[-1][2] == heads(env)[partition]
    assert open_batch(env.settings, env.pipeline).batch is None


def test_a_budget_below_the_partitions_with_records_reads_each_in_turn_also_in_lookaheads(make_pipeline, spark, db):
    """max_records_per_batch 2, three partitions with records: each is read at least once in any
    ceil(3 / 2) = 2 batches in a row, also when a batch is planned (as a lookahead) before the one
    before it is promoted."""
    env = make_pipeline(max_records_per_batch=2)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(60, seed=23)))
    offsets = partition_offsets(env.settings.bootstrap_servers, env.topic)
    assert all(o.last_stable >= 4 for o in offsets), "every partition has records for all four batches"
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=4, run_id="run-1")
    assert len(result.promoted) == 4 and result.records == 8
    read = [
        set(parts)
        for (parts,) in db.execute(
            "SELECT array_agg(p.kafka_partition) FROM kafka2pg.batches b JOIN kafka2pg.batch_partitions p"
            " USING (batch_id) WHERE b.pipeline = %s GROUP BY b.batch_id ORDER BY b.batch_id",
            (env.pipeline.name,),
        ).fetchall()
    ]
    assert len(read) == 4 and all(len(parts) == 2 for parts in read)
    assert all(a | b == {0, 1, 2} for a, b in zip(read, read[1:], strict=False)), read


def test_one_batch_per_run_only_stages_and_leaves_the_gate_to_the_dag(make_pipeline, spark, db):
    env = make_pipeline(max_records_per_batch=100)
    produce_sample(env.settings.bootstrap_servers, env.topic, 150, seed=22)
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=1, run_id="run-1")
    assert result.staged == [first.batch_id] and result.promoted == [] and result.records == 100
    assert [state for _, state, _ in batch_states(db, env)] == ["staged"]
    assert count(db, env) == 0

    # A job with more batches resuming it (e.g. the same run retried with batches_per_run 5) reads
    # only the next batch, and reports both that and what it promoted.
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1")
    assert result.records == 50 and (result.rows_promoted, result.rows_quarantined) == (150, 0)
    assert count(db, env) == 150
    # The same job retried once more: its batch is already promoted, nothing is read or landed.
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1")
    assert result.promoted == [first.batch_id]
    assert (result.records, result.rows_promoted, result.rows_quarantined) == (0, 0, 0)


def test_a_rejected_batch_stops_the_run_and_voids_the_lookahead_staged_meanwhile(make_pipeline, spark, db, heads):
    env = make_pipeline(partitions=1, max_records_per_batch=100, duplicate_policy="fail")
    events = list(sample_events(300, seed=23))
    # A producer retry of event 0 at offset 150: batch 2 ([100, 200)) is rejected while the run
    # has already planned and staged batch 3 ([200, 300)) after it. Batch 3 repeats event 1 at
    # offset 250: had its gate run, it would be rejected too instead of abandoned.
    produce(
        env.settings.bootstrap_servers,
        env.topic,
        [*events[:150], events[0], *events[150:249], events[1], *events[249:298]],
    )
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    with pytest.raises(QualityGateFailed) as rejected:
        run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=10, run_id="run-1")
    rows = db.execute(
        "SELECT batch_id, state, after_batch_id IS NOT NULL FROM kafka2pg.batches WHERE pipeline = %s"
        " ORDER BY batch_id",
        (env.pipeline.name,),
    ).fetchall()
    assert [r[1:] for r in rows] == [("promoted", False), ("rejected", True), ("abandoned", True)]
    assert rejected.value.batch_id == rows[1][0]
    assert rejected.value.failed == {
        "business_key_not_already_promoted": "1 duplicate business key(s) (duplicate_policy: fail)"
    }
    assert count(db, env) == 100 and heads(env) == {0: 100}
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    staged = db.execute(sql.SQL("SELECT DISTINCT batch_id FROM {}").format(staging)).fetchall()
    # The rejected batch keeps its rows for inspection; the void lookahead's are gone.
    assert staged == [(rows[1][0],)]
    # The next run plans the rejected range again from the ledger head.
    again = open_batch(env.settings, env.pipeline).batch
    assert [(r.start, r.end) for r in again.plan.ranges] == [(100, 200)]


def test_a_new_run_resumes_the_open_batch_and_voids_a_dead_runs_lookahead(make_pipeline, spark, db):
    env = make_pipeline(partitions=1, max_records_per_batch=50)
    produce_sample(env.settings.bootstrap_servers, env.topic, 120, seed=25)
    first = open_batch(env.settings, env.pipeline, run_id="dead-run").batch
    stage_batch(spark, env.settings, env.pipeline, first.batch_id, first.epoch)
    lookahead = plan_lookahead(env.settings, env.pipeline, first.batch_id, first.epoch, run_id="dead-run")
    assert [(r.start, r.end) for r in lookahead.plan.ranges] == [(50, 100)]
    # A retry of the same job (same claim on the first batch) takes its lookahead over.
    retried = plan_lookahead(env.settings, env.pipeline, first.batch_id, first.epoch, run_id="dead-run")
    assert (retried.batch_id, retried.epoch) == (lookahead.batch_id, lookahead.epoch + 1)
    with pytest.raises(LedgerConflictError):  # the killed attempt's claim is fenced off
        stage_batch(spark, env.settings, env.pipeline, lookahead.batch_id, lookahead.epoch)
    stage_batch(spark, env.settings, env.pipeline, retried.batch_id, retried.epoch)
    # The run died here. The next one resumes the first batch and voids the lookahead.
    opened = open_batch(env.settings, env.pipeline, run_id="next-run")
    assert opened.resumed and opened.batch.batch_id == first.batch_id
    assert [state for _, state, _ in batch_states(db, env)] == ["staged", "abandoned"]
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    assert db.execute(sql.SQL("SELECT DISTINCT batch_id FROM {}").format(staging)).fetchall() == [(first.batch_id,)]
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, opened.batch.epoch, batches=5)
    assert len(result.promoted) == 3 and count(db, env) == 120


def waited_for(env, until) -> bool:
    """Poll `until(conn)` on a connection of its own until it holds (deadline: 120 s): whether it did."""
    import psycopg

    deadline = time.monotonic() + 120
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        while not (reached := until(conn)) and time.monotonic() < deadline:
            time.sleep(0.05)
    return reached


def holding_the_first_promotion(monkeypatch, env, first_id: int, until) -> list:
    """The run's promotion of batch `first_id` waits until `until(conn)` holds (`waited_for`);
    returns the list it appends whether it did."""
    import kafka2pg.runner

    real = kafka2pg.runner.promote_batch
    held = []

    def promote(settings, pipeline, batch_id, epoch=None):
        if batch_id == first_id:
            held.append(waited_for(env, until))
        return real(settings, pipeline, batch_id, epoch)

    monkeypatch.setattr(kafka2pg.runner, "promote_batch", promote)
    return held


def test_the_next_batch_is_validated_while_the_one_before_it_is_promoted(make_pipeline, spark, db, monkeypatch):
    """A run of several batches runs batch N+1's quality gate beside N's promotion (the target's
    unique business-key index stands in for the promoted-key probe); N+1 is promoted after N."""
    env = make_pipeline(partitions=1, max_records_per_batch=100)
    produce_sample(env.settings.bootstrap_servers, env.topic, 200, seed=27)
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch

    def next_validated(conn):
        return conn.execute(
            "SELECT state FROM kafka2pg.batches WHERE pipeline = %s AND batch_id > %s",
            (env.pipeline.name, first.batch_id),
        ).fetchall() == [("validated",)]

    held = holding_the_first_promotion(monkeypatch, env, first.batch_id, next_validated)
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1")
    assert held == [True], "batch 2 was not validated while batch 1 waited to be promoted"
    assert len(result.promoted) == 2 and count(db, env) == 200
    promoted_at = db.execute(
        "SELECT promoted_at FROM kafka2pg.batches WHERE pipeline = %s ORDER BY batch_id", (env.pipeline.name,)
    ).fetchall()
    assert promoted_at[0] < promoted_at[1]


def test_without_a_unique_key_index_the_next_gate_probes_the_target_only_after_the_promotion_before(
    make_pipeline, spark, db, monkeypatch
):
    """Without the unique index the gate probes the target for promoted business keys itself:
    batch N+1's probe must see N's rows, so its gate, started beside N's promotion, waits for it."""
    import kafka2pg.runner

    env = make_pipeline(partitions=1, max_records_per_batch=3)
    index = sql.Identifier(env.pipeline.target_schema, env.pipeline.business_key_index)
    db.execute(sql.SQL("DROP INDEX {}").format(index))
    db.execute(  # not unique
        sql.SQL("CREATE INDEX {} ON {} (event_id)").format(sql.Identifier(env.pipeline.business_key_index), target(env))
    )
    events = list(sample_events(6, seed=28))
    produce(  # offset 3, in the second batch, repeats the first event's key
        env.settings.bootstrap_servers,
        env.topic,
        [*events[:3], {**events[3], "event_id": events[0]["event_id"]}, *events[4:]],
        key_field=None,
    )
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    real_validate = kafka2pg.runner.validate_batch
    gates = []

    def validate(settings, pipeline, batch_id, epoch=None, **kwargs):
        try:
            validated = real_validate(settings, pipeline, batch_id, epoch, **kwargs)
        except Exception as exc:
            gates.append((batch_id, kwargs.get("previous_pending", False), type(exc).__name__))
            raise
        gates.append((batch_id, kwargs.get("previous_pending", False), "validated"))
        return validated

    monkeypatch.setattr(kafka2pg.runner, "validate_batch", validate)
    held = holding_the_first_promotion(monkeypatch, env, first.batch_id, lambda conn: len(gates) >= 2)
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1")
    assert held == [True]
    second = first.batch_id + 1
    assert gates == [
        (first.batch_id, False, "validated"),
        (second, True, "ProbeAwaitsPrevious"),  # beside batch 1's promotion: nothing probed, nothing changed
        (second, False, "validated"),  # once batch 1 was promoted
    ]
    assert (result.rows_promoted, result.rows_quarantined) == (5, 1)
    keys = db.execute(sql.SQL("SELECT count(*), count(DISTINCT event_id) FROM {}").format(target(env))).fetchone()
    assert keys == (5, 5)
    reasons = db.execute(
        "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchall()
    assert len(reasons) == 1 and reasons[0][0] == 3
    assert reasons[0][1].startswith(f"business key already promoted by batch {first.batch_id}")


def test_after_sigterm_the_gate_under_way_finishes_and_no_promotion_or_gate_starts(
    make_pipeline, spark, db, monkeypatch
):
    """SIGTERM (the run's stop flag) while batch 1's quality gate runs and batch 2 is staged:
    the gate ends its transaction, then neither batch 1's promotion nor batch 2's gate starts;
    both stay open for the next run, which finishes them."""
    import threading

    import kafka2pg.runner

    env = make_pipeline(partitions=1, max_records_per_batch=100)
    produce_sample(env.settings.bootstrap_servers, env.topic, 200, seed=31)
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    stop = threading.Event()
    real_validate = kafka2pg.runner.validate_batch

    def next_staged(conn):
        return conn.execute(
            "SELECT state FROM kafka2pg.batches WHERE pipeline = %s AND batch_id > %s",
            (env.pipeline.name, first.batch_id),
        ).fetchall() == [("staged",)]

    def validate(settings, pipeline, batch_id, epoch=None, **kwargs):
        if batch_id == first.batch_id:  # SIGTERM arrives once batch 2 is staged
            waited_for(env, next_staged)
            stop.set()
        return real_validate(settings, pipeline, batch_id, epoch, **kwargs)

    monkeypatch.setattr(kafka2pg.runner, "validate_batch", validate)
    with pytest.raises(StageInterrupted, match=r"after promoting batches \[\]"):
        run_batches(
            spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1", stop=stop
        )
    assert [state for _, state, _ in batch_states(db, env)] == ["validated", "staged"]
    assert count(db, env) == 0
    monkeypatch.undo()
    opened = open_batch(env.settings, env.pipeline, run_id="run-2")
    assert opened.resumed and opened.batch.batch_id == first.batch_id
    result = run_batches(spark, env.settings, env.pipeline, first.batch_id, opened.batch.epoch, batches=5)
    assert len(result.promoted) == 2 and count(db, env) == 200


def test_a_lookahead_is_planned_beside_a_step_holding_the_batch_before_and_after_its_promotion(
    make_pipeline, spark, db
):
    """The planner reads the batch it follows without waiting for the step that holds it (its
    gate or its promotion, in a run of several batches), and plans after it once it is promoted."""
    import threading

    import psycopg

    from kafka2pg.batch_store import load_claimed

    env = make_pipeline(partitions=1, max_records_per_batch=50)
    produce_sample(env.settings.bootstrap_servers, env.topic, 150, seed=29)
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    stage_batch(spark, env.settings, env.pipeline, first.batch_id, first.epoch)
    planned = []

    def plan() -> None:
        planned.append(plan_lookahead(env.settings, env.pipeline, first.batch_id, first.epoch, run_id="run-1"))

    with psycopg.connect(env.settings.database_url) as step:  # holds the first batch until it leaves
        load_claimed(step, env.pipeline, first.batch_id, first.epoch)
        planner = threading.Thread(target=plan, daemon=True)
        planner.start()
        planner.join(timeout=120)
        assert not planner.is_alive(), "planning the lookahead waited for the step holding the batch before it"
    second = planned[0]
    assert [(r.start, r.end) for r in second.plan.ranges] == [(50, 100)]
    stage_batch(spark, env.settings, env.pipeline, second.batch_id, second.epoch)
    for batch in (first, second):
        validate_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)
        promote_batch(env.settings, env.pipeline, batch.batch_id, batch.epoch)
    third = plan_lookahead(env.settings, env.pipeline, second.batch_id, second.epoch, run_id="run-1")
    assert [(r.start, r.end) for r in third.plan.ranges] == [(100, 150)]
    stage_batch(spark, env.settings, env.pipeline, third.batch_id, third.epoch)
    validate_batch(env.settings, env.pipeline, third.batch_id, third.epoch)
    promote_batch(env.settings, env.pipeline, third.batch_id, third.epoch)
    assert count(db, env) == 150
    # Another run moves the heads on meanwhile: a batch promoted is no longer fenced by its
    # claim, so the planner checks that the heads are still the ones it set.
    produce_sample(env.settings.bootstrap_servers, env.topic, 50, seed=30)
    other = open_batch(env.settings, env.pipeline, run_id="run-2").batch
    stage_batch(spark, env.settings, env.pipeline, other.batch_id, other.epoch)
    validate_batch(env.settings, env.pipeline, other.batch_id, other.epoch)
    promote_batch(env.settings, env.pipeline, other.batch_id, other.epoch)
    with pytest.raises(LedgerConflictError, match=f"moved since by batch {other.batch_id}"):
        plan_lookahead(env.settings, env.pipeline, third.batch_id, third.epoch, run_id="run-1")
    assert count(db, env) == 200 and [s for _, s, _ in batch_states(db, env)] == ["promoted"] * 4


def test_a_failure_to_plan_the_lookahead_still_promotes_the_staged_batch(make_pipeline, spark, db, monkeypatch):
    import kafka2pg.runner

    def unreachable(*args, **kwargs):
        raise KafkaUnavailableError("broker gone while planning the next batch")

    env = make_pipeline(max_records_per_batch=100)
    produce_sample(env.settings.bootstrap_servers, env.topic, 150, seed=26)
    first = open_batch(env.settings, env.pipeline, run_id="run-1").batch
    monkeypatch.setattr(kafka2pg.runner, "plan_lookahead", unreachable)
    with pytest.raises(KafkaUnavailableError, match="broker gone"):
        run_batches(spark, env.settings, env.pipeline, first.batch_id, first.epoch, batches=5, run_id="run-1")
    assert [state for _, state, _ in batch_states(db, env)] == ["promoted"]
    assert count(db, env) == 100


@pytest.mark.parametrize(
    ("reader", "ignored"), [("librdkafka", "kafka.client.dns.lookup"), ("spark", "enable.ssl.certificate.verification")]
)
def test_a_kafka_property_the_stage_reader_does_not_use_is_named_in_a_warning(
    reader, ignored, make_pipeline, spark, db, caplog
):
    """A Java-only property (`kafka.`-prefixed) does not reach librdkafka, a librdkafka one without
    a known Java name does not reach Spark's source: the stage says which, by name only."""
    env = make_pipeline(kafka_reader=reader)
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": env.settings.bootstrap_servers,
            "kafka.client.dns.lookup": "use_all_dns_ips",
            "enable.ssl.certificate.verification": "true",
        }
    )
    settings = dataclasses.replace(env.settings, kafka=kafka)
    produce_sample(env.settings.bootstrap_servers, env.topic, 10, seed=25)
    batch = open_batch(settings, env.pipeline).batch
    with caplog.at_level(logging.WARNING, logger="kafka2pg.staging"):
        stage_batch(spark, settings, env.pipeline, batch.batch_id)
    (warning,) = [r.getMessage() for r in caplog.records if "reads without" in r.getMessage()]
    assert f"kafka_reader={reader} reads without the connection's Kafka properties {ignored} (" in warning
    assert "use_all_dns_ips" not in warning
    assert sum(staged_counts(db, env.pipeline, batch.batch_id).values()) == 10


@pytest.mark.parametrize("reader", ["spark", "librdkafka"])
def test_stage_job_without_the_kafka_source_jars_says_what_to_do_unless_it_needs_none(reader, make_pipeline, db):
    """Spark's Kafka source needs its jars; the librdkafka reader (the default) needs none."""
    env = make_pipeline(kafka_reader=reader)
    produce_sample(env.settings.bootstrap_servers, env.topic, 10, seed=24)
    batch = open_batch(env.settings, env.pipeline).batch
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("spark-submit")),
            "--master",
            "local[1]",
            str(ROOT / "jobs" / "stage_batch.py"),
            "--pipeline",
            env.pipeline.name,
            "--batch-id",
            str(batch.batch_id),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
            "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
            "KAFKA2PG_DATABASE_URL": env.settings.database_url,
            "KAFKA2PG_STATE_DIR": str(env.settings.state_dir),
        },
    )
    output = done.stdout + done.stderr  # spark-submit hands the Python driver's stderr to its stdout
    if reader == "librdkafka":
        assert done.returncode == 0, output[-3000:]
        assert [state for _, state, _ in batch_states(db, env)] == ["staged"]
        return
    assert done.returncode == 3, output[-3000:]  # a configuration error: the task is not retried
    assert "kafka2pg stage failed: Spark has no Kafka source on its classpath" in output, output[-3000:]
    assert "KAFKA2PG_SPARK_JARS" in output
    assert [state for _, state, _ in batch_states(db, env)] == ["planned"]


def test_stale_promote_fails_with_ledger_conflict_and_changes_nothing(make_pipeline, spark, db, heads):
    env = make_pipeline()
    produce_sample(env.settings.bootstrap_servers, env.topic, 90, seed=3)
    first = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, first.batch_id)
    validate_batch(env.settings, env.pipeline, first.batch_id)
    # A zombie run moved partition 0's head after this batch was planned.
    db.execute(
        "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset) VALUES (%s, %s, 0, 7)",
        (env.pipeline.name, env.topic),
    )
    before_heads = heads(env)
    with pytest.raises(LedgerConflictError) as conflict:
        promote_batch(env.settings, env.pipeline, first.batch_id)
    assert conflict.value.evidence == {
        "pipeline": env.pipeline.name,
        "batch_id": first.batch_id,
        "partition": 0,
        "found": 7,
    }  # planned from no head (offsets None), found head 7 moved by no batch
    assert count(db, env) == 0
    assert heads(env) == before_heads
    assert ledger_ranges(db, env) == []
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (first.batch_id,)).fetchone()[0]
    assert state == "validated"


def test_promote_rerun_of_a_promoted_batch_is_a_noop(make_pipeline, run_batch, db, heads):
    env = make_pipeline()
    produce_sample(env.settings.bootstrap_servers, env.topic, 60, seed=4)
    result = run_batch(env)
    snapshot = (count(db, env), heads(env), ledger_ranges(db, env))
    again = promote_batch(env.settings, env.pipeline, result.batch_id)
    assert again.already_promoted
    assert (count(db, env), heads(env), ledger_ranges(db, env)) == snapshot


def test_bad_records_are_quarantined_with_reason_and_never_vanish(make_pipeline, run_batch, db, heads):
    env = make_pipeline(partitions=1)
    good = list(sample_events(3, seed=5))
    produce(
        env.settings.bootstrap_servers,
        env.topic,
        [good[0], b"{not json", good[1], b'{"event_id": "x", "customer_id": "abc"}', None, {"customer_id": 1}, good[2]],
        key_field=None,
    )
    result = run_batch(env)
    assert result.promoted == 3 and result.quarantined == 4
    rows = db.execute(
        "SELECT kafka_offset, reason, raw_value FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY kafka_offset",
        (env.pipeline.name,),
    ).fetchall()
    assert [(o, r) for o, r, _ in rows] == [
        (1, "value is not valid JSON (Expecting property name enclosed in double quotes at character 1: 'not json')"),
        (3, "field 'customer_id': expected a JSON integer for bigint, got a string ('\"abc\"')"),
        (4, "value is null (a tombstone)"),
        (5, "field 'event_id': required but missing"),
    ]
    assert rows[0][2] == b"{not json"
    assert heads(env) == {0: 7}


def test_producer_retry_duplicate_is_flagged_not_promoted(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1)
    events = list(sample_events(4, seed=6))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[1]], key_field=None)
    result = run_batch(env)
    assert result.promoted == 4 and result.quarantined == 1
    reason = db.execute(
        "SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s AND kafka_offset = 4", (env.pipeline.name,)
    ).fetchone()[0]
    assert reason.startswith("duplicate business key within batch") and "kept partition 0 offset 1" in reason


def test_later_copies_of_a_key_already_promoted_name_the_promoted_row_not_a_quarantined_copy(
    make_pipeline, run_batch, db
):
    """Two copies of a key promoted by an earlier batch: the in-batch check keeps the first and
    flags the second, then the key check flags the first as already promoted. Both rows' reasons
    name the promoted row (the second's named the first as kept, which was quarantined too)."""
    env = make_pipeline(partitions=1)
    (first, second, third) = list(sample_events(3, seed=16))
    produce(env.settings.bootstrap_servers, env.topic, [first], key_field=None)
    landed = run_batch(env)
    assert landed.promoted == 1
    copies = [{**second, "event_id": first["event_id"]}, {**third, "event_id": first["event_id"]}]
    produce(env.settings.bootstrap_servers, env.topic, copies, key_field=None)
    result = run_batch(env)
    assert (result.promoted, result.quarantined) == (0, 2)
    reasons = db.execute(
        "SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY kafka_offset", (env.pipeline.name,)
    ).fetchall()
    promoted = (
        f"business key already promoted by batch {landed.batch_id} at partition 0 offset 0"
        f" (event_id = '{first['event_id']}')"
    )
    assert reasons == [(promoted,), (promoted,)]


def test_missing_topic_fails_with_a_clear_error(make_pipeline):
    env = make_pipeline(create_topic=False)
    with pytest.raises(TopicNotFoundError) as missing:
        open_batch(env.settings, env.pipeline)
    assert (missing.value.topic, missing.value.cluster) == (env.topic, env.settings.bootstrap_servers)


def test_unreachable_kafka_fails_within_seconds_naming_the_servers(make_pipeline, capfd):
    env = make_pipeline()
    dead = dataclasses.replace(env.settings, kafka="127.0.0.1:9", kafka_timeout_s=3)
    started = time.monotonic()
    with pytest.raises(KafkaUnavailableError) as unavailable:
        open_batch(dead, env.pipeline)
    assert (unavailable.value.cluster, unavailable.value.timeout_s, unavailable.value.topic) == (
        "127.0.0.1:9",
        3,
        env.topic,
    )
    assert time.monotonic() - started < 15
    assert capfd.readouterr().err.count("127.0.0.1:9") < 5, "librdkafka must not flood the log"


def test_unreachable_postgres_names_the_server_without_password(make_pipeline):
    env = make_pipeline()
    dead = dataclasses.replace(env.settings, database_url="postgresql://u:secret@127.0.0.1:9/nowhere")
    with pytest.raises(DatabaseUnavailableError) as info:
        open_batch(dead, env.pipeline)
    assert info.value.database == "127.0.0.1:9/nowhere"
    assert "secret" not in str(info.value) and "secret" not in repr(info.value.evidence)


def test_postgres_refusing_the_role_or_database_is_a_terminal_error_without_password(make_pipeline):
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    env = make_pipeline()
    real = conninfo_to_dict(env.settings.database_url)
    for change, refusal in (({"user": "nobody"}, 'role "nobody" does not exist'), ({"dbname": "nowhere"}, "nowhere")):
        url = make_conninfo(**{**real, "password": "s3cret", **change})
        with pytest.raises(DatabaseRefusedError) as info:
            open_batch(dataclasses.replace(env.settings, database_url=url), env.pipeline)
        assert info.value.terminal and refusal in str(info.value), str(info.value)
        assert "Retrying cannot help" in str(info.value)
        assert "s3cret" not in str(info.value) and "s3cret" not in repr(info.value.evidence)


def test_zombie_run_with_an_older_claim_is_fenced_at_every_step(make_pipeline, spark, db, heads):
    env = make_pipeline(partitions=2)
    produce_sample(env.settings.bootstrap_servers, env.topic, 80, seed=7)
    zombie = open_batch(env.settings, env.pipeline, run_id="scheduled__1").batch
    # The zombie's task looked dead; the next run resumed the same batch and took it over.
    current = open_batch(env.settings, env.pipeline, run_id="manual__2")
    assert current.resumed and current.batch.batch_id == zombie.batch_id
    assert (zombie.epoch, current.batch.epoch) == (1, 2)
    for step in (
        lambda: stage_batch(spark, env.settings, env.pipeline, zombie.batch_id, zombie.epoch),
        lambda: validate_batch(env.settings, env.pipeline, zombie.batch_id, zombie.epoch),
        lambda: promote_batch(env.settings, env.pipeline, zombie.batch_id, zombie.epoch),
    ):
        with pytest.raises(LedgerConflictError) as fenced:
            step()
        assert (fenced.value.batch_id, fenced.value.epoch, fenced.value.current_epoch) == (zombie.batch_id, 1, 2)
        assert fenced.value.run_id == "manual__2"
    assert count(db, env) == 0 and heads(env) == {}
    stage_batch(spark, env.settings, env.pipeline, zombie.batch_id, 2)
    validate_batch(env.settings, env.pipeline, zombie.batch_id, 2)
    assert promote_batch(env.settings, env.pipeline, zombie.batch_id, 2).promoted == 80
    with pytest.raises(LedgerConflictError):
        promote_batch(env.settings, env.pipeline, zombie.batch_id, zombie.epoch)
    assert count(db, env) == 80


def test_dry_run_neither_claims_nor_records(make_pipeline, db):
    env = make_pipeline(partitions=1)
    produce_sample(env.settings.bootstrap_servers, env.topic, 10, seed=8)
    live = open_batch(env.settings, env.pipeline, run_id="live").batch
    dry = open_batch(env.settings, env.pipeline, run_id="dry", dry_run=True)
    assert dry.message.startswith(f"dry run: would resume unfinished batch {live.batch_id}")
    row = db.execute("SELECT epoch, run_id FROM kafka2pg.batches WHERE batch_id = %s", (live.batch_id,)).fetchone()
    assert row == (1, "live")


def test_values_round_trip_exactly_through_staging(make_pipeline, run_batch, db, sample_columns):
    """Every supported type, quotes, commas, newlines, an empty string (not NULL) and NULLs land as sent."""
    columns = [
        *sample_columns,
        {"name": "note", "type": "text"},
        {"name": "flag", "type": "boolean"},
        {"name": "day", "type": "date"},
        {"name": "ratio", "type": "double precision"},
        {"name": "qty", "type": "integer"},
    ]
    env = make_pipeline(partitions=1, columns=columns)
    tricky = 'say "hi",\nbye\\n \t;'
    # Record timestamps near now: one older than the broker's 7-day retention is deleted at the
    # broker's next retention check (every 5 minutes), which once failed this test.
    a_time = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=123000)
    b_time = a_time.replace(microsecond=0) + timedelta(seconds=1)
    events = [
        {
            "event_id": "a",
            "customer_id": 9_000_000_000,
            "amount": 12.5,
            "currency": "",
            "ts": a_time.isoformat(timespec="milliseconds"),
            "payload": {"k": tricky},
            "note": tricky,
            "flag": True,
            "day": "2026-03-04",
            "ratio": 0.1,
            "qty": -7,
        },
        {
            "event_id": "b",
            "customer_id": 2,
            "ts": b_time.isoformat(timespec="seconds"),
            "note": "",
            "flag": False,
            "ratio": 1e300,
        },
    ]
    produce(env.settings.bootstrap_servers, env.topic, events, timestamp_field="ts")
    assert run_batch(env).promoted == 2
    rows = db.execute(
        sql.SQL(
            "SELECT event_id, customer_id, amount, currency, event_time, payload, note, flag, day, ratio, qty,"
            " kafka_timestamp FROM {} ORDER BY event_id"
        ).format(target(env))
    ).fetchall()
    assert rows == [
        (
            "a",
            9_000_000_000,
            Decimal("12.50"),
            "",
            a_time,
            {"k": tricky},
            tricky,
            True,
            date(2026, 3, 4),
            0.1,
            -7,
            a_time,
        ),
        ("b", 2, None, None, b_time, None, "", False, None, 1e300, None, b_time),
    ]


def test_time_to_data_loss_never_fails_a_plan_nor_hides_the_plans_own_error(make_pipeline, db, monkeypatch, caplog):
    """The time-to-data-loss lines are advice worked out after the plan committed: when Kafka
    cannot answer them, the plan still returns its recorded batch (and says why there are
    none); when the plan itself fails, its error is the one raised, and nothing is worked out."""
    import kafka2pg.opening

    env = make_pipeline(partitions=1)
    produce_sample(env.settings.bootstrap_servers, env.topic, 5, seed=81)
    asked = []

    def kafka_gone(*args):
        asked.append(args)
        raise KafkaUnavailableError.no_answer(env.settings.bootstrap_servers, 1, "while reading a record's timestamp")

    monkeypatch.setattr(kafka2pg.opening, "loss_horizons", kafka_gone)
    with caplog.at_level(logging.WARNING, logger="kafka2pg.opening"):
        opened = open_batch(env.settings, env.pipeline)
    assert opened.batch is not None and opened.batch.plan.record_budget == 5 and len(asked) == 1
    assert [state for _, state, _ in batch_states(db, env)] == ["planned"]
    assert "time to data loss not known: KafkaUnavailableError" in caplog.text

    def crashes(*args):
        asked.append(args)
        raise RuntimeError("the horizon lookup crashed")

    monkeypatch.setattr(kafka2pg.opening, "loss_horizons", crashes)
    db.execute(  # a head beyond the topic's end: the plan refuses it
        "INSERT INTO kafka2pg.ledger_heads (pipeline, topic, kafka_partition, next_offset) VALUES (%s, %s, 0, 50)",
        (env.pipeline.name, env.topic),
    )
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert (regressed.value.partition, regressed.value.head) == (0, 50) and len(asked) == 1
    assert [state for _, state, _ in batch_states(db, env)] == ["planned"]
