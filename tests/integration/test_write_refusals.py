"""A row PostgreSQL still refuses on data at write time (a rule admission does not know) is
isolated and quarantined with the database's words; the rest of the batch lands."""

from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.producer import produce, sample_events


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
        "SELECT record->>'event_id', reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchall()
    assert {event_id for event_id, _ in rows} == refused
    assert all(
        reason.startswith("PostgreSQL refused the row at promotion: 23514 new row for relation")
        and "(constraint small_customer)" in reason
        for _, reason in rows
    ), rows
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
