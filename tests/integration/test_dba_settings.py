"""Settings a DBA gives kafka2pg's role or database. A statement_timeout (for the role, the
database or in the connection's options) that cancels one of kafka2pg's statements is reported
as what it is, with where it was set and what to change; the batch stays where it was, and the
step succeeds once the limit allows it. Output styles psycopg cannot read change nothing."""

import dataclasses
from datetime import datetime, timedelta

import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from kafka2pg.database import transaction
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import StatementTimeoutError
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.staging import stage_batch
from kafka2pg.status import pipeline_status
from kafka2pg.steps import promote_batch

# Each statement the trigger below fires for sleeps this long, twice the limit set: cancelled
# however fast or loaded the machine, while the batch's other statements (60 rows) stay far below it.
LIMIT = "1s"
SLEEP_S = 2


def _slow_statements(db, table: sql.Composable) -> None:
    """Every INSERT or COPY into `table` waits SLEEP_S seconds first (a statement-level trigger)."""
    db.execute(
        "CREATE OR REPLACE FUNCTION public.kafka2pg_test_slow() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$ BEGIN PERFORM pg_sleep({SLEEP_S}); RETURN NULL; END $$"
    )
    db.execute(
        sql.SQL(
            "CREATE TRIGGER slow BEFORE INSERT ON {} FOR EACH STATEMENT EXECUTE FUNCTION public.kafka2pg_test_slow()"
        ).format(table)
    )


def _with_options(settings, options: str):
    """`settings` whose connections start with `options` (as PGOPTIONS gives them: pg_settings' source `client`)."""
    return dataclasses.replace(settings, database_url=make_conninfo(settings.database_url, options=options))


def _staged(make_pipeline, spark, records: int, seed: int):
    """A one-partition pipeline of its own with `records` sample events, its first batch staged."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(records, seed=seed), key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    return env, batch


def _state(db, batch_id: int) -> str:
    return db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]


def test_a_promotion_cancelled_by_the_roles_statement_timeout_says_so_and_promotes_once_it_is_raised(
    make_pipeline, spark, db, heads
):
    env, batch = _staged(make_pipeline, spark, 60, seed=91)
    validate_batch(env.settings, env.pipeline, batch.batch_id)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    _slow_statements(db, target)
    role, database = db.execute("SELECT current_user, current_database()").fetchone()
    alter = sql.SQL("ALTER ROLE {} IN DATABASE {} ").format(sql.Identifier(role), sql.Identifier(database))
    db.execute(alter + sql.SQL("SET statement_timeout = {}").format(sql.Literal(LIMIT)))
    try:
        with pytest.raises(StatementTimeoutError) as cancelled:
            promote_batch(env.settings, env.pipeline, batch.batch_id)
    finally:
        db.execute(alter + sql.SQL("RESET statement_timeout"))

    error = cancelled.value
    assert (error.statement_timeout, error.source, error.role, error.terminal) == (LIMIT, "database user", role, False)
    assert (error.pipeline, error.batch_id) == (env.pipeline.name, batch.batch_id)
    message = str(error)
    assert message.startswith(f"pipeline {env.pipeline.name!r} batch {batch.batch_id}, promotion: PostgreSQL cancelled")
    assert "statement timeout" in message and "statement_timeout is 1s" in message
    assert "set for the role in this database" in message
    assert f"ALTER ROLE {role} IN DATABASE {database} SET statement_timeout" in message
    assert "max_records_per_batch" in message
    assert _state(db, batch.batch_id) == "validated"
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 0
    assert heads(env) == {}

    db.execute(sql.SQL("DROP TRIGGER slow ON {}").format(target))
    result = promote_batch(env.settings, env.pipeline, batch.batch_id)
    assert (result.promoted, result.quarantined) == (60, 0)
    assert heads(env) == {0: 60}


def test_a_staging_copy_cancelled_by_the_connections_own_statement_timeout_leaves_the_batch_planned(
    make_pipeline, spark, db
):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(60, seed=92), key_field=None)
    batch = open_batch(env.settings, env.pipeline).batch
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    _slow_statements(db, staging)
    limited = _with_options(env.settings, f"-c statement_timeout={LIMIT}")

    with pytest.raises(StatementTimeoutError) as cancelled:
        stage_batch(spark, limited, env.pipeline, batch.batch_id)

    error = cancelled.value
    assert (error.pipeline, error.batch_id) == (env.pipeline.name, batch.batch_id)
    message = str(error)
    assert message.startswith(f"pipeline {env.pipeline.name!r} batch {batch.batch_id}, staging: PostgreSQL cancelled")
    assert "chunk 0 of batch" in message and "was not staged; the batch stays planned" in message
    assert "statement_timeout is 1s, set by the client's connection options" in message
    assert "take it out of the connection's options" in message
    assert _state(db, batch.batch_id) == "planned"

    db.execute(sql.SQL("DROP TRIGGER slow ON {}").format(staging))
    staged = stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    assert staged.records_read == 60
    assert _state(db, batch.batch_id) == "staged"


def test_a_roles_session_defaults_change_nothing_kafka2pg_reads_or_writes(make_pipeline, run_batch, db, sample_columns):
    # event_time required: the quality gate reads it back as a timestamp too.
    columns = [{**c, "required": True} if c["name"] == "event_time" else c for c in sample_columns]
    env = make_pipeline(partitions=2, columns=columns)
    events = list(sample_events(40, seed=93))
    for event in events[::5]:
        event["event_id"] += " ünï 😀"  # UTF8 only: no LATIN1 client can read it back
    events[7]["ts"] = "0001-01-01T00:00:00+00:00"  # Go's zero time: a year BC in New York, which psycopg cannot read
    produce(env.settings.bootstrap_servers, env.topic, events, key_field=None)
    role, database = db.execute("SELECT current_user, current_database()").fetchone()
    alter = sql.SQL("ALTER ROLE {} IN DATABASE {} ").format(sql.Identifier(role), sql.Identifier(database))
    # Timestamps as 29/11/2026 01:25:06 +13, which psycopg cannot parse; intervals as P1DT2H.
    # And SERIALIZABLE, which failed concurrent chunk writers with serialization failures.
    settings = {
        "client_encoding": "LATIN1",
        "DateStyle": "SQL, DMY",
        "IntervalStyle": "iso_8601",
        "default_transaction_isolation": "serializable",
        "TimeZone": "America/New_York",
    }
    for name, value in settings.items():
        db.execute(alter + sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
    try:
        result = run_batch(env)
        with transaction(env.settings.database_url) as conn:
            shown = [conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(n))).fetchone()[0] for n in settings]
            interval = conn.execute("SELECT interval '1 day 2 hours'").fetchone()[0]
            isolation = conn.execute("SELECT current_setting('transaction_isolation')").fetchone()[0]
            status = pipeline_status(env.settings, env.pipeline, conn)
    finally:
        for name in settings:
            db.execute(alter + sql.SQL("RESET {}").format(sql.Identifier(name)))

    assert (result.promoted, result.quarantined) == (40, 0)
    assert shown == ["UTF8", "ISO, DMY", "postgres", "read committed", "UTC"]  # the order of dates as text: kept
    assert isolation == "read committed"
    assert interval == timedelta(days=1, hours=2)
    assert status.last_batch.state == "promoted" and isinstance(status.last_batch.updated_at, datetime)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = dict(db.execute(sql.SQL("SELECT event_id, event_time FROM {}").format(target)).fetchall())
    assert landed == {e["event_id"]: datetime.fromisoformat(e["ts"]) for e in events}


def test_a_read_only_session_fails_the_plan_saying_why_and_the_plan_succeeds_on_a_writable_one(make_pipeline, db):
    from kafka2pg.exceptions import DatabaseUnavailableError

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(10, seed=94), key_field=None)
    read_only = _with_options(env.settings, "-c default_transaction_read_only=on")

    with pytest.raises(DatabaseUnavailableError) as refused:
        open_batch(read_only, env.pipeline)

    message = str(refused.value)
    assert "accepts no writes" in message and "read-only transaction" in message
    assert "default_transaction_read_only is on, set by the client's connection options" in message
    assert "at the primary" in message and refused.value.terminal is False
    assert (
        db.execute("SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,)).fetchone()[0] == 0
    )
    assert sum(r.size for r in open_batch(env.settings, env.pipeline).batch.plan.ranges) == 10


def test_the_gates_rows_read_cancelled_by_a_statement_timeout_fails_the_step_not_the_batch(
    make_pipeline, spark, db, monkeypatch
):
    from kafka2pg import expectations

    env, batch = _staged(make_pipeline, spark, 30, seed=95)
    limited = _with_options(env.settings, f"-c statement_timeout={LIMIT}")
    load_accepted = expectations.load_accepted

    def slow_load(conn, pipeline, batch_id):  # the rows for Great Expectations, read on a busy server
        conn.execute("SELECT pg_sleep(%s)", (SLEEP_S,))
        return load_accepted(conn, pipeline, batch_id)

    monkeypatch.setattr(expectations, "load_accepted", slow_load)
    with pytest.raises(StatementTimeoutError) as cancelled:
        validate_batch(limited, env.pipeline, batch.batch_id)
    monkeypatch.undo()
    assert str(cancelled.value).startswith(f"pipeline {env.pipeline.name!r} batch {batch.batch_id}, validation: ")

    row = db.execute("SELECT state, error FROM kafka2pg.batches WHERE batch_id = %s", (batch.batch_id,)).fetchone()
    assert row == ("staged", None)  # not rejected: nothing about the records was found
    assert validate_batch(env.settings, env.pipeline, batch.batch_id).state == "validated"


def test_a_value_psycopg_cannot_read_in_the_gates_rows_still_rejects_the_batch(make_pipeline, spark, db, monkeypatch):
    import psycopg

    from kafka2pg import expectations
    from kafka2pg.exceptions import QualityGateFailed

    env, batch = _staged(make_pipeline, spark, 10, seed=96)

    def unreadable(conn, pipeline, batch_id):  # what psycopg raises for a value it cannot turn into Python
        raise psycopg.DataError("timestamp too small (before year 1): '0001-12-31 19:03:58-04:56:02 BC'")

    monkeypatch.setattr(expectations, "load_accepted", unreadable)
    with pytest.raises(QualityGateFailed, match="DataError: timestamp too small"):
        validate_batch(env.settings, env.pipeline, batch.batch_id)

    assert _state(db, batch.batch_id) == "rejected"  # fail closed: about the batch's values, not the database
