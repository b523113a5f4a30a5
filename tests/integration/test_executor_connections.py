"""The Spark tasks connect to PostgreSQL themselves, from wherever the executors run: one that
cannot reach the database the driver reached fails the stage with what to change, and the batch
stays planned for the retry."""

import pytest

from kafka2pg.audit import audit_pipeline
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import DatabaseUnavailableError
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch


def test_executors_that_cannot_reach_postgresql_fail_the_stage_naming_why_and_the_retry_lands_it(
    make_pipeline, spark, db
):
    env = make_pipeline(partitions=2)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(40, seed=91))
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    # The executors' libpq (and only theirs: Spark hands this environment to its Python workers)
    # connects to another loopback address, where no PostgreSQL listens: an executor on a host
    # for which the connection's host is not the database's.
    environment = spark.sparkContext.environment
    environment["PGHOSTADDR"] = "127.0.0.2"
    try:
        with pytest.raises(DatabaseUnavailableError) as failed:
            stage_batch(spark, env.settings, env.pipeline, batch_id)
    finally:
        del environment["PGHOSTADDR"]

    message = str(failed.value)
    assert message.startswith(
        f"pipeline {env.pipeline.name!r} batch {batch_id}: a Spark task could not connect to PostgreSQL at "
    ), message
    assert '"127.0.0.2"' in message and "Connection refused" in message
    assert "a host such as localhost or 127.0.0.1 names each executor's own machine" in message
    assert "Traceback" not in message and "org.apache" not in message
    assert failed.value.terminal is False  # Airflow retries it
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()[0]
    assert state == "planned"

    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)
    assert promote_batch(env.settings, env.pipeline, batch_id).promoted == 40
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))
