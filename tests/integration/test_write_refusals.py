"""A row PostgreSQL still refuses on data at write time (a rule admission does not know) is
isolated and quarantined with the database's words; the rest of the batch lands."""

import json

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


def test_a_key_collision_behind_a_refused_row_still_goes_to_the_quality_gate(make_pipeline, spark, db):
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
    db.execute(
        sql.SQL(
            "INSERT INTO {} (event_id, customer_id, kafka_topic, kafka_partition, kafka_offset, batch_id)"
            " VALUES (%s, 1, 'manual', 0, 0, 0)"
        ).format(target),
        (events[12]["event_id"],),
    )

    result = promote_batch(env.settings, env.pipeline, batch.batch_id)

    assert (result.promoted, result.quarantined) == (18, 2)
    reasons = dict(
        db.execute(
            "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert reasons[3].startswith("PostgreSQL refused the row at promotion: 23514")
    assert reasons[12].startswith("business key already promoted by batch 0")
