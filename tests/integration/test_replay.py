"""Replays, backfills and undo on the real stack: re-loads with new logic equal a fresh load,
verify-only changes nothing, range locks keep replays and live batches exactly-once."""

from __future__ import annotations

import logging.handlers
import random
import re
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial

import psycopg
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql

from kafka2pg import tasks
from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.browse import history_page
from kafka2pg.checks import KEY_PROMOTED_CHECK
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import BatchStateError, KeyCollisionError, QualityGateFailed, ReplayRefusedError
from kafka2pg.kafka_offsets import client_config
from kafka2pg.lifecycle import CLI_RUN_ID
from kafka2pg.opening import open_batch
from kafka2pg.planner import OffsetRange
from kafka2pg.quality import validate_batch
from kafka2pg.replay import _comparable_reason, open_replay
from kafka2pg.replay_request import ReplayRequest, request_from_params
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch
from kafka2pg.undo import abandon_replay, undo_batch

DAYS = 3
PER_DAY = 60


def midnight(days_ago: int) -> datetime:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=days_ago)


def day_events(first_day: datetime, days: int = DAYS, per_day: int = PER_DAY, seed: int = 0) -> list[dict]:
    """`per_day` events on each of `days` days; `gross` is what the buggy v1 logic loads as amount."""
    events = []
    for day in range(days):
        for event in sample_events(per_day, seed=seed * 100 + day, start=first_day + timedelta(days=day, hours=1)):
            events.append({**event, "gross": round(event["amount"] * 1.19, 2)})
    return events


def v1(columns: list[dict]) -> list[dict]:
    """The logic with the bug: amount read from the gross field."""
    return [{**c, "field": "gross"} if c["name"] == "amount" else c for c in columns]


def v2(columns: list[dict]) -> list[dict]:
    """The fixed logic: amount from amount, and GBP is not accepted (quarantined)."""
    rule = {"allowed": ["EUR", "USD"], "on_violation": "quarantine"}
    return [{**c, **rule} if c["name"] == "currency" else c for c in columns]


def snapshot(db, env) -> tuple[list, list]:
    """Target rows and quarantine rows by provenance, without batch ids or load times."""
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    rows = db.execute(
        sql.SQL(
            "SELECT kafka_partition, kafka_offset, event_id, customer_id, amount, currency, event_time, payload"
            " FROM {} ORDER BY 1, 2"
        ).format(table)
    ).fetchall()
    quarantined = db.execute(
        "SELECT kafka_partition, kafka_offset, reason, record FROM kafka2pg.quarantine WHERE pipeline = %s"
        " ORDER BY 1, 2",
        (env.pipeline.name,),
    ).fetchall()
    return rows, quarantined


def assert_clean(env) -> None:
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits), format_audit(env.pipeline, audits)


def load_all(run_batch, env) -> int:
    batches = 0
    while run_batch(env) is not None:
        batches += 1
    return batches


@pytest.fixture
def loaded(make_pipeline, run_batch, sample_columns):
    """A topic with 3 days of events loaded by the buggy v1 logic, plus a factory for the v2 config
    of the same pipeline and a fresh v2 pipeline over the same topic."""
    first_day = midnight(DAYS + 1)
    old = make_pipeline(columns=v1(sample_columns), max_records_per_batch=70)
    events = day_events(first_day)
    produce(old.settings.bootstrap_servers, old.topic, events, timestamp_field="ts")
    load_all(run_batch, old)

    def fixed():
        return make_pipeline(
            name=old.pipeline.name,
            topic=old.topic,
            target_table=f"{old.pipeline.target_schema}.{old.pipeline.target_table}",
            columns=v2(sample_columns),
            max_records_per_batch=70,
            create_topic=False,
        )

    def fresh():
        env = make_pipeline(topic=old.topic, columns=v2(sample_columns), create_topic=False)
        load_all(run_batch, env)
        return env

    return old, fixed, fresh, first_day, events


def test_replay_by_offsets_then_by_time_window_equals_a_fresh_load_with_the_new_logic(loaded, replay, db, heads):
    old, fixed, fresh, first_day, events = loaded
    before_heads = heads(old)
    v1_rows, v1_quarantine = snapshot(db, old)
    assert len(v1_rows) == len(events) and v1_quarantine == []
    env = fixed()
    expected_rows, expected_quarantine = snapshot(db, fresh())
    assert len(expected_quarantine) > 0, "the new logic quarantines GBP events"

    # By offsets: partitions 0 and 1 entirely.
    ranges = tuple(OffsetRange(p, 0, before_heads[p]) for p in (0, 1))
    result = replay(env, ReplayRequest("replace", ranges, requested_by="test", reason="amount bug"))
    assert result.before == (sum(before_heads[p] for p in (0, 1)), 0)
    rows, quarantined = snapshot(db, env)
    assert [r for r in rows if r[0] in (0, 1)] == [r for r in expected_rows if r[0] in (0, 1)]
    assert [r for r in rows if r[0] == 2] == [r for r in v1_rows if r[0] == 2]
    assert [q for q in quarantined if q[0] in (0, 1)] == [q for q in expected_quarantine if q[0] in (0, 1)]
    assert heads(env) == before_heads
    assert_clean(env)

    # By time window: day 2 only (all partitions).
    day2 = (first_day + timedelta(days=1), first_day + timedelta(days=2))
    result = replay(env, ReplayRequest("replace", window=day2, requested_by="test"))
    rows, _ = snapshot(db, env)
    by_offset = {(r[0], r[1]): r for r in rows}
    expected_by_offset = {(r[0], r[1]): r for r in expected_rows}
    p2 = [r for r in v1_rows if r[0] == 2]
    assert any(day2[0] <= r[6] < day2[1] for r in p2), "partition 2 has events on day 2"
    for r in p2:
        key = (r[0], r[1])
        # Day 2 of partition 2 now follows the new logic (None: quarantined by it); the rest is v1.
        wanted = expected_by_offset.get(key) if day2[0] <= r[6] < day2[1] else r
        assert by_offset.get(key) == wanted, key
    assert sum(result.before) == sum(1 for r in v1_rows if day2[0] <= r[6] < day2[1])

    # The whole topic by a window covering every day: now identical to the fresh load.
    everything = (first_day, first_day + timedelta(days=DAYS))
    result = replay(env, ReplayRequest("replace", window=everything, requested_by="test"))
    assert result.promoted == len(expected_rows) and result.quarantined == len(expected_quarantine)
    assert snapshot(db, env) == (expected_rows, expected_quarantine)
    assert heads(env) == before_heads
    assert_clean(env)
    recorded = db.execute(
        "SELECT operation, requested_by, target_rows_before, target_rows_after, quarantine_rows_after, window_from"
        " FROM kafka2pg.replays WHERE pipeline = %s ORDER BY replay_id",
        (env.pipeline.name,),
    ).fetchall()
    assert [r[0] for r in recorded] == ["replace"] * 3
    assert recorded[0][:3] == ("replace", "test", sum(before_heads[p] for p in (0, 1)))
    assert recorded[2][3:5] == (len(expected_rows), len(expected_quarantine))
    assert recorded[1][5] == day2[0]


def test_backfill_over_three_dates_twice_gives_an_identical_target(loaded, replay, db, heads):
    old, fixed, fresh, first_day, _ = loaded
    env = fixed()
    expected = snapshot(db, fresh())
    before_heads = heads(env)
    results = []
    for attempt in range(2):
        for day in range(DAYS):
            interval = (first_day + timedelta(days=day), first_day + timedelta(days=day + 1))
            request = request_from_params({}, run_type="backfill", interval=interval, requested_by="backfill")
            assert request.window == interval
            results.append(replay(env, request))
        assert snapshot(db, env) == expected, f"backfill attempt {attempt + 1}"
        assert heads(env) == before_heads
    assert all(r is not None for r in results)
    assert_clean(env)
    # A date with no events replays nothing and launches no Spark.
    empty = request_from_params({}, run_type="backfill", interval=(midnight(30), midnight(29)))
    assert open_replay(env.settings, env.pipeline, empty).batch is None


def test_verify_only_reports_a_planted_difference_and_changes_nothing(loaded, spark, db, heads, monkeypatch):
    """Finished by the replay DAG's task: the differences recorded, and said at WARNING."""
    old, *_ = loaded
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", old.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", old.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(old.settings.pipelines_file))
    table = sql.Identifier(old.pipeline.target_schema, old.pipeline.target_table)
    db.execute(
        sql.SQL("UPDATE {} SET amount = amount + 1 WHERE kafka_partition = 1 AND kafka_offset = 3").format(table)
    )
    db.execute(sql.SQL("DELETE FROM {} WHERE kafka_partition = 2 AND kafka_offset = 5").format(table))
    before = snapshot(db, old)
    before_heads = heads(old)
    ranges = tuple(OffsetRange(p, 0, h) for p, h in sorted(before_heads.items()))
    batch = open_replay(old.settings, old.pipeline, ReplayRequest("verify-only", ranges, requested_by="test")).batch
    stage_batch(spark, old.settings, old.pipeline, batch.batch_id)
    validate_batch(old.settings, old.pipeline, batch.batch_id)
    # A handler on the logger itself: Airflow's logging set-up (on the first task, when the test
    # runs alone) takes pytest's handler off the root logger.
    logged = logging.handlers.BufferingHandler(10_000)  # emptied when full: room for every record
    logging.getLogger("kafka2pg").addHandler(logged)
    try:
        result = tasks.finish_replay(old.pipeline.name, batch.batch_id, batch.epoch)
    finally:
        logging.getLogger("kafka2pg").removeHandler(logged)
    assert result["mode"] == "verify-only" and result["asset_event"] is None
    assert result["differences"] == {"changed": 1, "only_in_replay": 1}
    warned = [r.getMessage() for r in logged.buffer if r.levelno == logging.WARNING]
    assert any("2 difference(s)" in line for line in warned), warned
    assert any(line.startswith("difference changed") and "e.g. 1:3" in line for line in warned), warned
    assert snapshot(db, old) == before and heads(old) == before_heads
    state, stored = db.execute(
        "SELECT b.state, r.differences FROM kafka2pg.batches b JOIN kafka2pg.replays r USING (batch_id)"
        " WHERE b.batch_id = %s",
        (batch.batch_id,),
    ).fetchone()
    assert state == "verified" and stored["changed"]["count"] == 1
    assert stored["changed"]["sample"] == ["1:3"] and stored["only_in_replay"]["sample"] == ["2:5"]
    staging = sql.Identifier("kafka2pg", old.pipeline.staging_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(staging)).fetchone()[0] == 0


def test_replays_beyond_the_head_or_outside_the_loaded_ledger_are_refused(make_pipeline, run_batch, db, heads):
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=3))
    run_batch(env)
    head = heads(env)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(10, seed=4))
    with pytest.raises(ReplayRefusedError) as refused:
        open_replay(env.settings, env.pipeline, ReplayRequest("replace", (OffsetRange(0, 0, head[0] + 1),)))
    assert (refused.value.partition, refused.value.offsets, refused.value.head) == (0, (0, head[0] + 1), head[0])
    with pytest.raises(ReplayRefusedError) as refused:  # the ledger has no head for it: never loaded
        open_replay(env.settings, env.pipeline, ReplayRequest("replace", (OffsetRange(7, 0, 1),)))
    assert (refused.value.partition, refused.value.offsets, refused.value.head) == (7, (0, 1), None)
    count = db.execute("SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,)).fetchone()
    assert count[0] == 1, "a refused replay records nothing"


def test_undo_of_the_newest_batch_rewinds_atomically_and_older_batches_need_a_replay(
    loaded, run_batch, spark, db, heads
):
    old, *_ = loaded
    before = snapshot(db, old)
    before_heads = heads(old)
    batches = [
        r[0]
        for r in db.execute(
            "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND state = 'promoted' ORDER BY batch_id",
            (old.pipeline.name,),
        )
    ]
    assert len(batches) >= 3
    # A replay of the newest batch's range, validated before the undo, must not finish after it.
    newest = {
        r["partition"]: r["range"]
        for r in db.execute("SELECT plan FROM kafka2pg.batches WHERE batch_id = %s", (batches[-1],)).fetchone()[0][
            "partitions"
        ]
        if r["range"]
    }
    partition, span = sorted(newest.items())[0]
    stale = open_replay(
        old.settings, old.pipeline, ReplayRequest("replace", (OffsetRange(partition, span["start"], span["end"]),))
    ).batch
    stage_batch(spark, old.settings, old.pipeline, stale.batch_id)
    validate_batch(old.settings, old.pipeline, stale.batch_id)
    with pytest.raises(ReplayRefusedError) as refused:  # newer batches moved its partitions' heads
        undo_batch(old.settings, old.pipeline, batches[0], confirm=True)
    assert refused.value.batch_id == batches[0]
    assert refused.value.moved_by and set(refused.value.moved_by) <= set(batches[1:])
    assert "Replay its range instead" in str(refused.value)  # the operator's way out
    preview = undo_batch(old.settings, old.pipeline, batches[-1], confirm=False)
    assert not preview.applied and snapshot(db, old) == before
    undone = undo_batch(old.settings, old.pipeline, batches[-1], confirm=True, reason="test", requested_by="me")
    assert undone.applied
    removed = sum(undone.rows)
    assert removed > 0 and len(snapshot(db, old)[0]) == len(before[0]) - removed
    rewound = heads(old)
    assert all(rewound[r.partition] == r.start for r in undone.ranges)
    assert_clean(old)
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batches[-1],)).fetchone()[0]
    assert state == "undone"
    with pytest.raises(ReplayRefusedError) as refused:  # the undo rewound the head below its range
        promote_batch(old.settings, old.pipeline, stale.batch_id)
    assert (refused.value.batch_id, refused.value.partition) == (stale.batch_id, partition)
    assert refused.value.head == rewound[partition] < span["end"]
    # The next live run loads the range again: the target is as before.
    load_all(run_batch, old)
    assert snapshot(db, old) == before and heads(old) == before_heads
    assert_clean(old)
    # The stale replay (planned before the reload) still must not overwrite the reloaded rows.
    with pytest.raises(ReplayRefusedError) as refused:
        promote_batch(old.settings, old.pipeline, stale.batch_id)
    assert (refused.value.batch_id, refused.value.partition) == (stale.batch_id, partition)
    assert refused.value.newer_batch_id > stale.batch_id
    assert snapshot(db, old) == before


def test_range_lock_makes_a_live_promotion_wait_for_a_replay_of_the_same_partition(make_pipeline, spark, db, heads):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(30, seed=5))
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)
    done = threading.Event()
    with psycopg.connect(env.settings.database_url) as holder:
        # What a replay's finishing transaction holds on partition 0.
        holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s), 0)", (f"kafka2pg.range:{env.pipeline.name}",))
        worker = threading.Thread(
            target=lambda: (promote_batch(env.settings, env.pipeline, batch.batch_id), done.set()), daemon=True
        )
        worker.start()
        time.sleep(3)
        assert not done.is_set(), "the live promotion did not wait for the range lock"
        waiting = db.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 0"
        ).fetchone()[0]
        assert waiting >= 1
        holder.rollback()
    worker.join(60)
    assert done.is_set()
    assert heads(env) == {0: 30}


def test_replays_racing_live_batches_never_duplicate_or_lose(make_pipeline, run_batch, replay, db, heads):
    env = make_pipeline(partitions=3, max_records_per_batch=40)
    produced = produce(env.settings.bootstrap_servers, env.topic, sample_events(120, seed=6))
    load_all(run_batch, env)
    rng = random.Random(7)
    errors: list[BaseException] = []
    stop = threading.Event()

    def live() -> None:
        nonlocal produced
        try:
            for round_ in range(6):
                produced += produce(env.settings.bootstrap_servers, env.topic, sample_events(30, seed=100 + round_))
                load_all(run_batch, env)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            stop.set()

    replays = []

    def replayer() -> None:
        try:
            while not stop.is_set():
                with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
                    current = heads(env, conn)
                p = rng.choice(sorted(current))
                start = rng.randrange(0, current[p])
                end = current[p]  # up to the head: overlaps the batch just promoted
                replays.append(replay(env, ReplayRequest("replace", (OffsetRange(p, start, end),))))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=live), threading.Thread(target=replayer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert len(replays) >= 2
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(sql.SQL("SELECT count(*), count(DISTINCT event_id) FROM {}").format(table)).fetchone()
    quarantined = db.execute(
        "SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]
    assert landed[0] == landed[1] and landed[0] + quarantined == produced
    assert_clean(env)


def a_quarantined_key_then_the_same_key_valid(make_pipeline, run_batch, sample_columns, seed: int):
    """A pipeline whose strict rule (currency EUR only) quarantined the record at offset 0, loaded;
    offset 1, not loaded yet, holds its business key again, valid. The pipeline without the rule
    (`reconfigured(env, columns=sample_columns)`) would promote the key at offset 0."""
    strict = [
        {**c, "allowed": ["EUR"], "on_violation": "quarantine"} if c["name"] == "currency" else c
        for c in sample_columns
    ]
    env = make_pipeline(partitions=1, columns=strict)
    first, again = [dict(e) for e in sample_events(2, seed=seed)]
    again["event_id"] = first["event_id"]
    first["currency"], again["currency"] = "GBP", "EUR"
    produce(env.settings.bootstrap_servers, env.topic, [first])
    run_batch(env)  # GBP: quarantined by the strict rule; the key is not in the target
    produce(env.settings.bootstrap_servers, env.topic, [again])
    return env


def test_a_key_a_replay_promoted_after_a_live_batch_was_validated_is_flagged_at_promotion_counting_both(
    make_pipeline, reconfigured, run_batch, replay, spark, db, sample_columns, write_by_hand
):
    """The live batch's gate ran the promoted-key check (it flagged one key a manual write had
    promoted); a replay then lands another of its keys, which only the unique index sees at
    promotion: the promotion runs the check again, flags that row too and promotes the rest; the
    stored check counts both rows (it counted only the second: its first were out of its reach)."""
    env = a_quarantined_key_then_the_same_key_valid(make_pipeline, run_batch, sample_columns, seed=8)
    (by_hand,) = [{**e, "currency": "EUR"} for e in sample_events(1, seed=10)]  # valid under the strict rule
    write_by_hand(env, by_hand["event_id"], env.topic, 7, 0)
    produce(env.settings.bootstrap_servers, env.topic, [by_hand])  # offset 2: its key already in the target
    live = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, live.batch_id)
    # The promoted-key check runs here (it would otherwise be left to promotion, which then runs
    # it itself: see test_quality_gate); a replay that lands a key after it only the index sees.
    validate_batch(env.settings, env.pipeline, live.batch_id, probe_promoted_keys=True)
    stored = "SELECT unexpected_count, details FROM kafka2pg.batch_checks WHERE batch_id = %s AND check_name = %s"
    assert db.execute(stored, (live.batch_id, KEY_PROMOTED_CHECK)).fetchone()[0] == 1
    relaxed = reconfigured(env, columns=sample_columns)
    replay(relaxed, ReplayRequest("replace", (OffsetRange(0, 0, 1),)))  # now offset 0 holds offset 1's key

    result = promote_batch(relaxed.settings, relaxed.pipeline, live.batch_id)

    assert result.batch_id == live.batch_id and (result.promoted, result.quarantined) == (0, 2)
    count, details = db.execute(stored, (live.batch_id, KEY_PROMOTED_CHECK)).fetchone()
    assert count == 2 and "(1 when the batch was validated, 1 after a key collision at promotion)" in details
    assert_clean(relaxed)


def test_a_collision_no_check_explains_fails_the_promotion_and_the_next_gate_judges_it(
    make_pipeline, spark, db, write_by_hand
):
    """Without a business key the gate has no promoted-key check to run again: a row written by
    hand at one of the batch's offsets after validation makes the promotion fail naming the
    target's primary key; the batch goes back to staged, and its next validation rejects it."""
    env = make_pipeline(partitions=1, business_key=None)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(2, seed=11)))
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)
    write_by_hand(env, "written-by-hand", env.topic, 0, 1)
    with pytest.raises(KeyCollisionError) as collision:
        promote_batch(env.settings, env.pipeline, batch.batch_id)
    assert (collision.value.pipeline, collision.value.batch_id) == (env.pipeline.name, batch.batch_id)
    assert collision.value.constraint  # the target's primary key, named by PostgreSQL
    # Not chained: a traceback would print psycopg's words, which quote the row, unescaped.
    assert collision.value.__cause__ is None and collision.value.__suppress_context__
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]
    assert state == "staged"
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert rejected.value.failed["provenance_not_already_promoted"].startswith("1 staged offsets already in the target")


def test_a_key_a_live_batch_promoted_after_a_replay_was_validated_is_flagged_when_the_replay_finishes(
    make_pipeline, reconfigured, run_batch, spark, db, sample_columns
):
    """No other run resumes a replay: its finish runs the promoted-key check again itself after
    a collision, flags the key, and finishes (it was left `staged`, every retry refused)."""
    env = a_quarantined_key_then_the_same_key_valid(make_pipeline, run_batch, sample_columns, seed=9)
    relaxed = reconfigured(env, columns=sample_columns)
    request = ReplayRequest("replace", (OffsetRange(0, 0, 1),), requested_by="test")
    replaying = open_replay(relaxed.settings, relaxed.pipeline, request).batch
    stage_batch(spark, relaxed.settings, relaxed.pipeline, replaying.batch_id)
    validate_batch(relaxed.settings, relaxed.pipeline, replaying.batch_id)  # the key is new: accepted
    live = run_batch(env)  # offset 1 lands the key
    assert (live.promoted, live.quarantined) == (1, 0)

    result = promote_batch(relaxed.settings, relaxed.pipeline, replaying.batch_id)

    assert result.batch_id == replaying.batch_id and (result.promoted, result.quarantined) == (0, 1)
    reason = db.execute(
        "SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s AND kafka_offset = 0", (env.pipeline.name,)
    ).fetchone()[0]
    assert reason.startswith(f"business key already promoted by batch {live.batch_id} at partition 0 offset 1")
    assert_clean(relaxed)


def test_abandoning_a_replay_its_run_left_open_drops_only_its_staging_rows_and_fences_the_run(
    make_pipeline, run_batch, spark, db, heads
):
    """A CLI replay whose process was killed after staging leaves its batch open for good: it is
    abandoned by hand (previewed first), its staging rows go, its history entry says so, the
    target and heads stay as they were, and the run, were it still going, cannot finish it."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(20, seed=93))
    live = run_batch(env)
    before, before_heads = snapshot(db, env), heads(env)
    staging = sql.SQL("SELECT count(*) FROM {} WHERE batch_id = %s").format(
        sql.Identifier("kafka2pg", env.pipeline.staging_table)
    )
    request = ReplayRequest("replace", (OffsetRange(0, 0, 20),), requested_by="test")
    replaying = open_replay(env.settings, env.pipeline, request, run_id=CLI_RUN_ID).batch
    stage_batch(spark, env.settings, env.pipeline, replaying.batch_id)
    abandon = f"kafka2pg abandon --pipeline {env.pipeline.name} --batch-id {replaying.batch_id}` then, if its preview"
    with pytest.raises(ReplayRefusedError, match=abandon):
        undo_batch(env.settings, env.pipeline, replaying.batch_id, confirm=True)
    with pytest.raises(ReplayRefusedError, match="only an open replay batch can be abandoned"):
        abandon_replay(env.settings, env.pipeline, live.batch_id, confirm=True)

    preview = abandon_replay(env.settings, env.pipeline, replaying.batch_id, confirm=False)
    assert not preview.applied and preview.staged_rows == 20
    assert "delete its 20 staging rows" in preview.message and "claimed by run cli" in preview.message
    assert db.execute(staging, (replaying.batch_id,)).fetchone()[0] == 20
    done = abandon_replay(
        env.settings, env.pipeline, replaying.batch_id, confirm=True, reason="process killed", requested_by="ops"
    )

    assert done.applied
    state, error = db.execute(
        "SELECT state, error FROM kafka2pg.batches WHERE batch_id = %s", (replaying.batch_id,)
    ).fetchone()
    assert (state, error) == ("abandoned", "abandoned by ops: process killed")
    assert db.execute(staging, (replaying.batch_id,)).fetchone()[0] == 0
    assert snapshot(db, env) == before and heads(env) == before_heads
    with pytest.raises(BatchStateError):  # the run, still going, cannot go on
        stage_batch(spark, env.settings, env.pipeline, replaying.batch_id)
    with pytest.raises(BatchStateError, match="It is over"):
        validate_batch(env.settings, env.pipeline, replaying.batch_id)
    with pytest.raises(BatchStateError):
        promote_batch(env.settings, env.pipeline, replaying.batch_id)
    entry = next(e for e in history_page(db, env.pipeline.name, None, 10) if e.batch_id == replaying.batch_id)
    assert entry.outcome == "abandoned by ops: process killed; target and quarantine unchanged"
    assert (entry.requested_by, entry.run_id) == ("test", CLI_RUN_ID)
    finished = db.execute("SELECT finished_at FROM kafka2pg.replays WHERE batch_id = %s", (replaying.batch_id,))
    assert finished.fetchone()[0] is not None
    with pytest.raises(ReplayRefusedError, match="it is already finished"):
        abandon_replay(env.settings, env.pipeline, replaying.batch_id, confirm=True)
    assert snapshot(db, env) == before
    assert_clean(env)


def test_abandon_and_undo_name_who_holds_the_batch_while_they_wait(make_pipeline, run_batch, monkeypatch, caplog):
    """A step frozen inside its transaction holds the batch's row: abandon (and undo, behind the
    plan lock) wait for it, and say every LOCK_WAIT_LOG_S seconds which backend holds it, until
    PostgreSQL ends the frozen session; then they go on."""
    import logging

    from kafka2pg import database

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=94))
    live = run_batch(env)
    request = ReplayRequest("replace", (OffsetRange(0, 0, 5),), requested_by="test")
    replaying = open_replay(env.settings, env.pipeline, request, run_id=CLI_RUN_ID).batch
    monkeypatch.setattr(database, "IDLE_IN_TRANSACTION_TIMEOUT_S", 4)
    monkeypatch.setattr(database, "LOCK_WAIT_LOG_S", 0.5)

    def frozen_holding(query: str, params: tuple) -> psycopg.Connection:
        frozen = database.connect(env.settings.database_url)
        frozen.execute(query, params)
        return frozen

    for command, holding in (
        (
            lambda: abandon_replay(env.settings, env.pipeline, replaying.batch_id, confirm=True),
            ("SELECT 1 FROM kafka2pg.batches WHERE batch_id = %s FOR UPDATE", (replaying.batch_id,)),
        ),
        (
            lambda: undo_batch(env.settings, env.pipeline, live.batch_id, confirm=True),
            ("SELECT pg_advisory_xact_lock(hashtext('kafka2pg.plan'), hashtext(%s))", (env.pipeline.name,)),
        ),
    ):
        frozen = frozen_holding(*holding)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kafka2pg.database"):
            assert command().applied
        waits = [r.getMessage() for r in caplog.records if "waits for a lock held by" in r.getMessage()]
        assert waits and f"backend pid {frozen.info.backend_pid} (" in waits[-1], caplog.text
        assert waits[-1].startswith(f"pipeline={env.pipeline.name} "), waits[-1]
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # PostgreSQL ended its session
            frozen.execute("SELECT 1")


def test_abandon_refuses_the_batch_of_a_running_replay_process_at_once_whatever_locks_the_batch(
    make_pipeline, run_batch, end_at_deadline
):
    """A `kafka2pg replay` process's lock, taken before its plan commits, makes abandon refuse its
    batch without waiting for the batch's row (which the process's step in progress may hold);
    gone with the process's session, the batch is abandoned."""
    import contextlib

    from kafka2pg.replay_process import ReplayProcess, process_locks, running_pid

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=95))
    run_batch(env)
    request = ReplayRequest("replace", (OffsetRange(0, 0, 5),), requested_by="test")
    with ReplayProcess(env.settings.database_url) as process:
        seen = []
        replaying = open_replay(
            env.settings,
            env.pipeline,
            request,
            run_id=CLI_RUN_ID,
            on_planned=lambda batch_id: (process.hold(batch_id), seen.append(batch_id)),
        ).batch
        assert seen == [replaying.batch_id]
        step = psycopg.connect(env.settings.database_url)  # a step in progress holds the batch's row
        with contextlib.closing(step):
            step.execute("SELECT 1 FROM kafka2pg.batches WHERE batch_id = %s FOR UPDATE", (replaying.batch_id,))
            # The refusal must not wait for the row: its holder is ended at a deadline, and the test fails.
            with end_at_deadline(env.settings.database_url, step.info.backend_pid, 60) as rescued:
                with pytest.raises(ReplayRefusedError, match="still being replayed by a running `./kafka2pg replay`"):
                    abandon_replay(env.settings, env.pipeline, replaying.batch_id, confirm=False)
            assert not rescued, "abandon waited for the batch's row before refusing"
        with psycopg.connect(env.settings.database_url) as db:
            assert running_pid(process_locks(db), replaying.batch_id) == process._conn.info.backend_pid
    assert abandon_replay(env.settings, env.pipeline, replaying.batch_id, confirm=True).applied


def test_an_undo_is_refused_when_kafka_no_longer_holds_the_records_it_would_have_reloaded(
    make_pipeline, run_batch, db, heads
):
    """Retention deleted part of the newest batch's records on one partition since it loaded them:
    undoing it would delete their rows and the next run could not load them again. Refused,
    preview included, nothing changed, naming the records gone and the replay of every record of
    the batch Kafka still holds (the other partition's whole range too)."""
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=93))
    run_batch(env)
    first = heads(env)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=94))
    newest = run_batch(env)
    ends = heads(env)
    assert all(ends[p] - first[p] >= 2 for p in (0, 1)), (first, ends)
    low = first[0] + 1
    client = AdminClient(client_config(env.settings.bootstrap_servers, 10))
    deleted = client.delete_records([TopicPartition(env.topic, 0, low)])
    assert next(iter(deleted.values())).result(timeout=30).low_watermark == low
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)

    for confirm in (False, True):
        with pytest.raises(ReplayRefusedError) as refused:
            undo_batch(env.settings, env.pipeline, newest.batch_id, confirm=confirm)
        message = str(refused.value)
        assert f"records p0[{first[0]}, {low}) are gone from Kafka" in message, message
        still = f"0:{low}-{ends[0]},1:{first[1]}-{ends[1]}"
        assert f"replay --pipeline {env.pipeline.name} --offsets {still}`" in message, message

    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 80
    assert heads(env) == ends


def test_an_undo_asks_kafka_again_once_it_holds_its_locks(make_pipeline, run_batch, db, heads, behind_range_lock):
    """Kafka held the newest batch's records when the undo began, and retention deleted the first
    of them while it waited for a range lock (a replay finishing on the partition): refused once
    it holds the lock, nothing changed, not a rewind to offsets no run can load again."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(20, seed=95))
    run_batch(env)
    start = heads(env)[0]
    produce(env.settings.bootstrap_servers, env.topic, sample_events(20, seed=96))
    newest = run_batch(env)
    ends = heads(env)
    undo = partial(undo_batch, env.settings, env.pipeline, newest.batch_id, confirm=True)
    with behind_range_lock(env, undo) as outcome:
        client = AdminClient(client_config(env.settings.bootstrap_servers, 10))
        deleted = client.delete_records([TopicPartition(env.topic, 0, start + 1)])
        assert next(iter(deleted.values())).result(timeout=30).low_watermark == start + 1
    assert isinstance(outcome[0], ReplayRefusedError), outcome
    assert f"records p0[{start}, {start + 1}) are gone from Kafka" in str(outcome[0])
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 40
    assert heads(env) == ends


def test_undoing_a_partitions_first_batch_says_the_partition_is_left_without_a_head(make_pipeline, run_batch, heads):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=91))
    first = run_batch(env)

    preview = undo_batch(env.settings, env.pipeline, first.batch_id, confirm=False)

    assert not preview.applied
    assert preview.message.endswith(
        "rewind heads to p0: no head (the next plan starts it as a new partition: at its low watermark, reading its"
        " records again (new_partition_start: earliest))"
    ), preview.message
    latest = replace(env.pipeline, new_partition_start="latest")
    assert "as a new partition: at its end then, SKIPPING its records (new_partition_start: latest)" in (
        undo_batch(env.settings, latest, first.batch_id, confirm=False).message
    )
    assert undo_batch(env.settings, env.pipeline, first.batch_id, confirm=True).applied
    assert heads(env) == {}


def test_verify_only_reads_a_rules_reason_stored_in_its_older_words_as_the_same_verdict(
    make_pipeline, run_batch, replay, db, heads, sample_columns
):
    """A `min` without `max` is "the declared minimum 100", the value is quoted and shortened
    to 40 characters, a long list of allowed values cut; quarantine rows stored when they read
    "amount = 5.5 violates the declared range [100.0, None]" (the value unquoted and whole, the
    list whole) are the same verdict to a verify-only replay, not a change."""
    allowed = ["EUR", "USD", "GBP", "Y…", *(f"Z{i:02}" for i in range(30))]
    rules = {"amount": {"min": 100}, "currency": {"allowed": allowed}, "customer_id": {"min": 0, "max": 10**17}}
    columns = [
        {**c, **rules[c["name"]], "on_violation": "quarantine"} if c["name"] in rules else c for c in sample_columns
    ]
    env = make_pipeline(columns=columns)
    events = list(sample_events(200, seed=5))
    events[3] = {**events[3], "amount": 250.0, "currency": "X" * 60}
    events[4] = {**events[4], "amount": 250.0, "customer_id": -5}
    produce(env.settings.bootstrap_servers, env.topic, events)
    load_all(run_batch, env)
    reasons = [r for _, _, r, _ in snapshot(db, env)[1]]
    listed = f"allowed values {allowed!r}"
    assert len(listed) > len("allowed values ") + 120
    long = (
        "currency = '"
        + "X" * 40
        + "…' violates the declared "
        + listed[: len("allowed values ") + 120]
        + "… (34 values)"
    )
    assert reasons.count(long) == 1, reasons
    customer = "customer_id = '-5' violates the declared range [0, 100000000000000000]"  # the bounds as written
    assert reasons.count(customer) == 1, reasons
    ranged = [r for r in reasons if r not in (long, customer)]
    assert ranged and all(re.fullmatch(r"amount = '[0-9.]+' violates the declared minimum 100", r) for r in ranged)
    db.execute(
        "UPDATE kafka2pg.quarantine SET reason = regexp_replace(reason,"
        " '^(\\w+) = ''(.*)'' violates the declared minimum 100$',"
        " '\\1 = \\2 violates the declared range [100.0, None]')"
        " WHERE pipeline = %s",
        (env.pipeline.name,),
    )
    db.execute(
        "UPDATE kafka2pg.quarantine SET reason = %s WHERE pipeline = %s AND reason = %s",
        ("currency = " + "X" * 60 + " violates the declared " + listed, env.pipeline.name, long),
    )
    db.execute(
        "UPDATE kafka2pg.quarantine SET reason = %s WHERE pipeline = %s AND reason = %s",
        # as it was stored when bounds were read as floats (str(1e17) is "1e+17")
        ("customer_id = -5 violates the declared range [0.0, 1e+17]", env.pipeline.name, customer),
    )
    stored = [r for _, _, r, _ in snapshot(db, env)[1]]
    assert sum(r.startswith("currency = " + "X" * 60 + " violates") for r in stored) == 1, stored
    assert all(
        re.fullmatch(r"amount = [0-9.]+ violates the declared range \[100.0, None\]", r)
        for r in stored
        if "amount" in r
    )
    ranges = tuple(OffsetRange(p, 0, h) for p, h in sorted(heads(env).items()))
    assert replay(env, ReplayRequest("verify-only", ranges, requested_by="test")).differences == {}
    changed = db.execute(
        "UPDATE kafka2pg.quarantine SET reason = replace(reason, '[100.0, None]', '[90.0, None]')"
        " WHERE pipeline = %s AND ctid = (SELECT min(ctid) FROM kafka2pg.quarantine WHERE pipeline = %s"
        " AND reason LIKE 'amount%%')",
        (env.pipeline.name, env.pipeline.name),
    ).rowcount
    assert changed == 1
    found = replay(env, ReplayRequest("verify-only", ranges, requested_by="test")).differences
    assert {k: v["count"] for k, v in found.items()} == {"quarantine_reason_changed": 1}


def test_verify_only_reads_a_key_duplicate_by_the_copy_that_landed_wherever_its_range_starts(
    make_pipeline, run_batch, replay, db
):
    """A business key's later copy is quarantined as a duplicate "within batch N: kept partition P
    offset O" when its batch holds the kept copy, and as "already promoted by batch N at partition P
    offset O" when an earlier batch promoted it: the same verdict, the same landed copy. A
    verify-only replay whose range starts between the copies (or holds both where the loads had
    them in two batches) finds no difference; another landed copy is one."""
    env = make_pipeline(partitions=1, max_records_per_batch=20)
    events = list(sample_events(40, seed=12))
    for copy in (12, 15, 30):
        events[copy] = {**events[copy], "event_id": events[10]["event_id"]}
    produce(env.settings.bootstrap_servers, env.topic, events)
    assert load_all(run_batch, env) == 2
    stored = {o: r for p, o, r, _ in snapshot(db, env)[1]}
    assert sorted(stored) == [12, 15, 30], stored
    assert (
        stored[12].startswith("duplicate business key within batch ") and ": kept partition 0 offset 10 (" in stored[12]
    )
    assert (
        stored[30].startswith("business key already promoted by batch ") and " at partition 0 offset 10 (" in stored[30]
    )
    for start in (0, 11, 16):
        request = ReplayRequest("verify-only", (OffsetRange(0, start, 40),), requested_by="test")
        assert replay(env, request).differences == {}, start
    db.execute(  # another landed copy, in either form, is a difference
        "UPDATE kafka2pg.quarantine SET reason = replace(reason, 'partition 0 offset 10 (', 'partition 0 offset 9 (')"
        " WHERE pipeline = %s AND kafka_offset IN (15, 30)",
        (env.pipeline.name,),
    )
    found = replay(env, ReplayRequest("verify-only", (OffsetRange(0, 11, 40),), requested_by="test")).differences
    assert {k: v["count"] for k, v in found.items()} == {"quarantine_reason_changed": 2}
    assert found["quarantine_reason_changed"]["sample"] == ["0:15", "0:30"]
    # A kept copy refused at promotion: the copy that landed instead is the one compared.
    refused = (
        "duplicate business key within batch 7: kept partition 0 offset 10 (event_id = 'a; b');"
        " that copy was refused at promotion, partition 1 offset 4 landed instead"
    )
    compared = [
        db.execute(sql.SQL("SELECT {}").format(_comparable_reason(sql.Literal(r), env.pipeline))).fetchone()[0]
        for r in (refused, "business key already promoted by batch 9 at partition 1 offset 4 (event_id = 'a; b')")
    ]
    assert compared == ["duplicate business key of partition 1 offset 4 (event_id = 'a; b')"] * 2, compared


def test_a_replay_process_that_loses_its_lock_session_says_so(make_pipeline, monkeypatch, caplog):
    """The session holding a replay process's lock ended from outside (a DBA, a pooler, a network
    cut): the process logs that status now shows it gone and an abandon would fence it."""
    import logging

    from kafka2pg import replay_process
    from kafka2pg.replay_process import ReplayProcess, process_locks, running_pid

    env = make_pipeline(partitions=1)
    monkeypatch.setattr(replay_process, "PING_S", 0.2)
    with psycopg.connect(env.settings.database_url, autocommit=True) as admin:
        with caplog.at_level(logging.WARNING, logger="kafka2pg.replay_process"):
            with ReplayProcess(env.settings.database_url) as process:
                process.hold(2**32 + 7)  # a batch id beyond int4 keys by its low 32 bits
                pid = running_pid(process_locks(admin), 2**32 + 7)
                assert pid is not None and running_pid(process_locks(admin), 7) == pid
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                deadline = time.monotonic() + 120
                while "cannot keep the lock that tells status and abandon this process runs" not in caplog.text:
                    assert time.monotonic() < deadline, caplog.text
                    time.sleep(0.1)
        assert running_pid(process_locks(admin), 2**32 + 7) is None
