"""A row PostgreSQL still refuses on data at write time (a rule admission does not know) is
isolated and quarantined with the database's words; the rest of the batch lands."""

import json

import pytest
from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.devtools.producer import produce, sample_events


def test_a_check_constraint_on_the_target_quarantines_only_its_rows_and_the_batch_promotes(
    make_pipeline, run_batch, db, heads
):
    env = make_pipeline(partitions=2)
    events = list(sample_events(60, seed=81))
    for event in events[::7]:
        event["customer_id"] = 100_000  # above the target's CHECK, which admission knows nothing of
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_customer CHECK (customer_id < 10000)").format(target))
    produce(env.settings.bootstrap_servers, env.topic, events)

    result = run_batch(env)

    refused = {e["event_id"] for e in events[::7]}
    assert (result.promoted, result.quarantined) == (60 - len(refused), len(refused))
    landed = {r[0] for r in db.execute(sql.SQL("SELECT event_id FROM {}").format(target))}
    assert landed == {e["event_id"] for e in events} - refused
    rows = db.execute(
        "SELECT record->>'event_id', reason, raw_key, raw_value FROM kafka2pg.quarantine WHERE pipeline = %s",
        (env.pipeline.name,),
    ).fetchall()
    assert {event_id for event_id, *_ in rows} == refused
    assert all(
        reason.startswith("PostgreSQL refused the row at promotion: 23514 new row for relation")
        and "(constraint small_customer)" in reason
        for _, reason, *_ in rows
    ), rows
    # Their raw key and value, read again from Kafka after the promotion: the bytes produced.
    sent = {e["event_id"]: (str(e["customer_id"]).encode(), json.dumps(e).encode()) for e in events[::7]}
    assert {event_id: (bytes(k), bytes(v)) for event_id, _, k, v in rows} == sent
    assert sum(heads(env).values()) == 60
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_a_row_the_staging_copy_refuses_is_isolated_and_quarantined(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1)
    events = list(sample_events(30, seed=82))
    events[4]["currency"] = events[17]["currency"] = "XXX"
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT no_xxx CHECK (currency <> 'XXX')").format(staging))
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (28, 2)
    rows = db.execute(
        "SELECT kafka_offset, reason, raw_value FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY 1",
        (env.pipeline.name,),
    ).fetchall()
    assert [offset for offset, *_ in rows] == [4, 17]
    assert all(r.startswith("PostgreSQL refused the row in staging: 23514") and "no_xxx" in r for _, r, _ in rows)
    assert all(b'"currency": "XXX"' in value for *_, value in rows)  # the raw bytes, kept
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_a_target_no_row_fits_fails_the_promotion_loudly_instead_of_quarantining_the_batch(
    make_pipeline, spark, db, heads
):
    import pytest

    from kafka2pg.exceptions import TableRefusesRowsError
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(300, seed=83), key_field=None)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD COLUMN added_later text NOT NULL").format(target))  # no row fills it
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)

    with pytest.raises(TableRefusesRowsError) as refused:
        promote_batch(env.settings, env.pipeline, batch.batch_id)

    assert refused.value.table == f"{env.pipeline.target_schema}.{env.pipeline.target_table}"
    assert refused.value.refused == 100 and refused.value.tried <= 199
    assert "23502" in refused.value.example and "added_later" in refused.value.example
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 0
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]
    assert state == "validated" and heads(env) == {}


def test_a_key_collision_behind_a_refused_row_still_goes_to_the_quality_gate(make_pipeline, spark, db, write_by_hand):
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    events = list(sample_events(20, seed=84))
    events[3]["customer_id"] = 100_000  # refused by the CHECK below
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_customer CHECK (customer_id < 10000)").format(target))
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)
    # After validation, a manual write lands the key of offset 12 (behind the refused row).
    write_by_hand(env, events[12]["event_id"], "manual", 0, 0)

    result = promote_batch(env.settings, env.pipeline, batch.batch_id)

    assert (result.promoted, result.quarantined) == (18, 2)
    reasons = dict(
        db.execute(
            "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert reasons[3].startswith("PostgreSQL refused the row at promotion: 23514")
    assert reasons[12].startswith("business key already promoted by batch 0")


def test_columns_named_like_the_words_of_kafka2pgs_own_sql_are_isolated_checked_and_quarantined_alike(
    make_pipeline, run_batch, db
):
    # n, reason, p, o, k, v, h, d, r, s: names kafka2pg's statements give their own columns and aliases.
    names = ["n", "reason", "p", "o", "k", "v", "h", "d", "r", "s"]
    columns = [{"name": "event_id", "type": "text", "required": True}] + [
        {"name": name, "type": "bigint"} for name in names
    ]
    env = make_pipeline(partitions=1, columns=columns)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_n CHECK (n < 100)").format(target))
    events = [{"event_id": f"e-{i}", **{name: i for name in names}} for i in range(6)]
    events[2]["n"] = 500  # refused by the target's CHECK at promotion
    events.append(dict(events[4]))  # a duplicate, flagged by the gate
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (5, 2)
    landed = db.execute(sql.SQL("SELECT event_id, n, reason, s FROM {} ORDER BY 1").format(target)).fetchall()
    assert landed == [(f"e-{i}", i, i, i) for i in (0, 1, 3, 4, 5)]
    reasons = dict(
        db.execute(
            "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert reasons[2].startswith("PostgreSQL refused the row at promotion: 23514"), reasons
    assert reasons[6].startswith("duplicate business key within batch"), reasons


def test_when_the_copy_of_a_key_the_gate_kept_is_refused_at_promotion_its_next_copy_lands_instead(
    make_pipeline, run_batch, db, sample_columns
):
    rule = {"min": 0, "max": 1000, "on_violation": "fail"}  # checked by GX on the rows the gate accepts
    env = make_pipeline(
        partitions=1, columns=[{**c, **(rule if c["name"] == "amount" else {})} for c in sample_columns]
    )
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT no_xxx CHECK (currency <> 'XXX')").format(target))
    events = [dict(e, amount=10) for e in sample_events(5, seed=84)]
    first, second, third = (dict(events[0], currency=c) for c in ("XXX", "XXX", "EUR"))
    other = dict(events[1], currency="XXX")  # refused, its key has no other copy
    # offsets 0-2: key A refused, its retry (the same values), then a good copy; 3-4: key B good twice;
    # 5: key C refused; 6-8: key D refused, then good twice; 9-11: key E refused, then without
    # an amount the rule forbids (the gate would not have accepted it), then good
    sent = [first, second, third, events[2], dict(events[2]), other]
    sent += [dict(events[3], currency="XXX"), events[3], events[3]]
    sent += [dict(events[4], currency="XXX"), dict(events[4], amount=9999), events[4]]
    produce(env.settings.bootstrap_servers, env.topic, sent, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (4, 8)
    landed = db.execute(sql.SQL("SELECT event_id, kafka_offset FROM {} ORDER BY 2").format(target)).fetchall()
    assert landed == [(events[i]["event_id"], o) for i, o in ((0, 2), (2, 3), (3, 7), (4, 11))]
    reasons = dict(
        db.execute(
            "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert sorted(reasons) == [0, 1, 4, 5, 6, 8, 9, 10]
    refused = (0, 5, 6, 9)  # offset 1, the same values as 0, is not tried: it would be refused the same way
    assert all(reasons[o].startswith("PostgreSQL refused the row at promotion: 23514") for o in refused), reasons
    assert "kept partition 0 offset 0" in reasons[1] and reasons[1].endswith("partition 0 offset 2 landed instead")
    assert reasons[4].startswith("duplicate business key within batch") and "kept partition 0 offset 3" in reasons[4]
    assert "landed instead" not in reasons[4]
    assert "kept partition 0 offset 6" in reasons[8], reasons[8]
    assert reasons[8].endswith("; that copy was refused at promotion, partition 0 offset 7 landed instead"), reasons[8]
    assert reasons[10].endswith("partition 0 offset 11 landed instead"), reasons[10]
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_a_pipeline_without_a_business_key_quarantines_the_rows_the_target_refuses_and_promotes_the_rest(
    make_pipeline, run_batch, db
):
    env = make_pipeline(partitions=1, business_key=[])
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT no_xxx CHECK (currency <> 'XXX')").format(target))
    events = list(sample_events(6, seed=85))
    events[3]["currency"] = "XXX"
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[0]], key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (6, 1)
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_a_target_trigger_that_skips_rows_stops_the_promotion_instead_of_losing_them(make_pipeline, spark, db, heads):
    import pytest

    from kafka2pg.exceptions import BatchStateError
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(50, seed=85), key_field=None)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    # A filter a user might add (RETURN NULL keeps the row out, and PostgreSQL raises nothing).
    db.execute(
        "CREATE OR REPLACE FUNCTION public.kafka2pg_test_skip_odd() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN IF NEW.kafka_offset % 2 = 1 THEN RETURN NULL; END IF; RETURN NEW; END $$"
    )
    db.execute(
        sql.SQL(
            "CREATE TRIGGER skip_odd BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION public.kafka2pg_test_skip_odd()"
        ).format(target)
    )
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    validate_batch(env.settings, env.pipeline, batch.batch_id)

    with pytest.raises(BatchStateError) as stopped:
        promote_batch(env.settings, env.pipeline, batch.batch_id)

    assert type(stopped.value) is BatchStateError  # a public error, as the CLI and the task log name it
    assert "25 staged rows moved to the target and the quarantine but the batch read 50 records; nothing was " in str(
        stopped.value
    )
    assert "does not keep every row inserted into it (a trigger or rule that skips rows)" in str(stopped.value)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 0
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()[0]
    assert state == "validated" and heads(env) == {}

    db.execute(sql.SQL("DROP TRIGGER skip_odd ON {}").format(target))
    assert promote_batch(env.settings, env.pipeline, batch.batch_id).promoted == 50
    assert heads(env) == {0: 50}

    # A replay's finish deletes the range's rows before inserting the re-read ones: the same
    # trigger rolls it back whole, the rows it was to replace kept.
    from kafka2pg.planner import OffsetRange
    from kafka2pg.replay import open_replay
    from kafka2pg.replay_request import ReplayRequest

    db.execute(
        sql.SQL(
            "CREATE TRIGGER skip_odd BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION public.kafka2pg_test_skip_odd()"
        ).format(target)
    )
    request = ReplayRequest("replace", (OffsetRange(0, 10, 30),), requested_by="test")
    replay = open_replay(env.settings, env.pipeline, request).batch
    stage_batch(spark, env.settings, env.pipeline, replay.batch_id)
    validate_batch(env.settings, env.pipeline, replay.batch_id)
    with pytest.raises(BatchStateError) as stopped:
        promote_batch(env.settings, env.pipeline, replay.batch_id)
    assert type(stopped.value) is BatchStateError
    assert "10 staged rows moved to the target and the quarantine but the batch read 20 records; nothing was " in str(
        stopped.value
    )
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 50
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (replay.batch_id,)).fetchone()[0]
    assert state == "validated"


class Died(BaseException):
    """An attempt stopped from outside (a kill) at the call patched to raise it."""


def dies(*args):
    raise Died


def _staged_batch(env, spark, events, **produced) -> int:
    """The batch of `events`, produced, opened and staged."""
    from kafka2pg.opening import open_batch
    from kafka2pg.staging import stage_batch

    produce(env.settings.bootstrap_servers, env.topic, events, **produced)
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    return batch_id


def test_a_retry_of_a_promotion_that_died_before_the_raw_bytes_fills_them(make_pipeline, spark, db, monkeypatch):
    """The attempt that promoted the batch died after its commit, before it read the refused
    rows' raw bytes from Kafka: the retry finds the batch promoted and fills them."""
    import kafka2pg.steps
    from kafka2pg.quality import validate_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    events = list(sample_events(10, seed=83))
    events[3]["customer_id"] = 100_000
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_customer CHECK (customer_id < 10000)").format(target))
    batch_id = _staged_batch(env, spark, events)
    validate_batch(env.settings, env.pipeline, batch_id)

    with monkeypatch.context() as patched:
        patched.setattr(kafka2pg.steps, "keep_raw_bytes", dies)
        with pytest.raises(Died):
            promote_batch(env.settings, env.pipeline, batch_id)
    raw = "SELECT raw_value FROM kafka2pg.quarantine WHERE batch_id = %s"
    assert db.execute(raw, (batch_id,)).fetchall() == [(None,)]

    again = promote_batch(env.settings, env.pipeline, batch_id)

    assert again.already_promoted and (again.promoted, again.quarantined) == (9, 1)
    assert db.execute(raw, (batch_id,)).fetchall() == [(json.dumps(events[3]).encode(),)]


def test_a_validation_that_died_before_the_raw_bytes_leaves_them_to_the_promotion(
    make_pipeline, spark, db, monkeypatch
):
    """The attempt that validated the batch died after its verdict committed, before it read the
    raw bytes of the rows its gate flagged: the promotion (a retry finds the batch validated
    and goes on to it) fills them in the quarantine."""
    import kafka2pg.quality
    from kafka2pg.quality import validate_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    events = list(sample_events(3, seed=84))
    copy = {**events[2], "event_id": events[0]["event_id"]}  # flagged: a later copy of a key in the batch
    batch_id = _staged_batch(env, spark, [*events[:2], copy], key_field=None)

    with monkeypatch.context() as patched:
        patched.setattr(kafka2pg.quality, "keep_raw_bytes", dies)
        with pytest.raises(Died):
            validate_batch(env.settings, env.pipeline, batch_id)
    staged = sql.SQL("SELECT raw_value FROM {} WHERE batch_id = %s AND quarantine_reason IS NOT NULL").format(
        sql.Identifier("kafka2pg", env.pipeline.staging_table)
    )
    assert db.execute(staged, (batch_id,)).fetchall() == [(None,)]
    assert validate_batch(env.settings, env.pipeline, batch_id).state == "validated"

    assert (promote_batch(env.settings, env.pipeline, batch_id).quarantined) == 1
    raw = db.execute("SELECT raw_value FROM kafka2pg.quarantine WHERE batch_id = %s", (batch_id,)).fetchall()
    assert raw == [(json.dumps(copy).encode(),)]


def test_a_validation_trigger_raising_a_class_23_sqlstate_quarantines_its_rows_a_plain_raise_fails_loudly(
    make_pipeline, run_batch, db, heads
):
    """How a target's validation trigger says "this row is bad": `USING ERRCODE = 'check_violation'`
    (any class 22/23 SQLSTATE) is the row's refusal, quarantined with the trigger's words. A plain
    `RAISE EXCEPTION` (P0001) might be a maintenance lock or a statement-level check, so it fails
    the promotion whole instead (test_stuck: retried, then STUCK)."""
    import psycopg

    env = make_pipeline(partitions=1)
    events = list(sample_events(40, seed=86))
    for event in events[::9]:
        event["customer_id"] = 100_000
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    validate = sql.Identifier(env.pipeline.target_schema, f"{env.pipeline.target_table}_validate")
    errcode = sql.Identifier(env.pipeline.target_schema, f"{env.pipeline.target_table}_errcode")
    db.execute(sql.SQL("CREATE TABLE {} (code text)").format(errcode))
    db.execute(sql.SQL("INSERT INTO {} VALUES ('P0001')").format(errcode))
    db.execute(
        sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF NEW.customer_id >= 10000 THEN RAISE EXCEPTION 'customer % unknown', NEW.customer_id "
            "USING ERRCODE = (SELECT code FROM {}); END IF; RETURN NEW; END $$"
        ).format(validate, errcode)
    )
    db.execute(
        sql.SQL("CREATE TRIGGER validate BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
            target, validate
        )
    )
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)
    with pytest.raises(psycopg.errors.RaiseException, match="customer 100000 unknown"):
        run_batch(env)
    assert heads(env) == {} and db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 0

    db.execute(sql.SQL("UPDATE {} SET code = 'check_violation'").format(errcode))
    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (40 - len(events[::9]), len(events[::9]))
    reasons = [
        r[0] for r in db.execute("SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,))
    ]
    assert reasons and all(
        r.startswith("PostgreSQL refused the row at promotion: 23514 customer 100000 unknown") for r in reasons
    ), reasons
    assert heads(env) == {0: 40}
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))
