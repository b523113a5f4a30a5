"""The Asset event of a run, from the real ledger: the batches the run promoted (a Spark job with
batches_per_run > 1 promotes several under the run's id), a replay's replaced range, and none for a
verify-only replay."""

from __future__ import annotations

import json

from psycopg.conninfo import conninfo_to_dict

from kafka2pg.asset_events import run_event_of
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.planner import OffsetRange
from kafka2pg.replay_request import ReplayRequest


def test_a_run_announces_the_batches_it_promoted_and_a_replay_its_range(make_pipeline, run_batch, replay, db, ledgered):
    env = make_pipeline(partitions=2)
    settings, pipeline = env.settings, env.pipeline
    produce(settings.bootstrap_servers, env.topic, [*sample_events(30, seed=11), b"not json"])
    first = run_batch(env, max_records_per_batch=20, run_id="run-a")
    second = run_batch(env, max_records_per_batch=20, run_id="run-a")
    produce(settings.bootstrap_servers, env.topic, list(sample_events(5, seed=12)))
    third = run_batch(env, max_records_per_batch=20, run_id="run-b")

    params = conninfo_to_dict(settings.database_url)
    uri = f"postgres://{params.get('host') or 'localhost'}:{params.get('port') or 5432}/{params['dbname']}/"
    uri += f"{pipeline.target_schema}/{pipeline.target_table}"

    # The two batches of run-a are contiguous per partition: one range each.
    event = run_event_of(settings, pipeline, first.batch_id, "run-a")
    assert event.uri == uri
    assert event.extra == ledgered(first.batch_id, second.batch_id)
    assert (event.extra["rows"], event.extra["quarantined"]) == (30, 1)
    assert run_event_of(settings, pipeline, third.batch_id, "run-b").extra == ledgered(third.batch_id)
    # Without the run's id (the CLI, a test) only the batch itself.
    assert run_event_of(settings, pipeline, first.batch_id, None).extra == ledgered(first.batch_id)
    assert not params.get("password") or params["password"] not in json.dumps(event.__dict__)

    p0 = ledgered(first.batch_id)["ranges"][0]
    ranges = (OffsetRange(p0["partition"], p0["start"], p0["end"]),)
    replaced = replay(env, ReplayRequest("replace", ranges, requested_by="test"))
    event = run_event_of(settings, pipeline, replaced.batch_id, None)
    assert event.uri == uri
    assert event.extra == ledgered(replaced.batch_id)
    assert event.extra["kind"] == "replay" and event.extra["ranges"] == [p0]
    assert event.extra["rows"] == replaced.promoted

    verified = replay(env, ReplayRequest("verify-only", ranges, requested_by="test"))
    assert run_event_of(settings, pipeline, verified.batch_id, None) is None, "a verify-only replay changes no table"


def test_the_runs_promote_task_fills_the_raw_bytes_its_further_batches_were_left_without(
    make_pipeline, run_batch, db, monkeypatch
):
    """A Spark job of batches_per_run > 1 promoted a further batch and was killed before it read
    that batch's quarantined record again from Kafka (its raw bytes): no step of that batch runs
    again, so the run's promote task fills them."""
    from kafka2pg import tasks

    env = make_pipeline(partitions=1)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    produce(env.settings.bootstrap_servers, env.topic, [*sample_events(20, seed=13), b"not json"])
    first = run_batch(env, max_records_per_batch=20, run_id="run-a")
    further = run_batch(env, max_records_per_batch=20, run_id="run-a")
    raw = "SELECT raw_value FROM kafka2pg.quarantine WHERE batch_id = %s"
    assert db.execute(raw, (further.batch_id,)).fetchall() == [(b"not json",)]
    db.execute(
        "UPDATE kafka2pg.quarantine SET raw_key = NULL, raw_value = NULL, raw_headers = NULL WHERE batch_id = %s",
        (further.batch_id,),
    )  # as the killed job left it

    epoch = db.execute("SELECT epoch FROM kafka2pg.batches WHERE batch_id = %s", (first.batch_id,)).fetchone()[0]
    done = tasks.promote(env.pipeline.name, first.batch_id, epoch, run_id="run-a")

    assert done["asset_event"]["extra"]["batch_ids"] == [first.batch_id, further.batch_id]
    assert db.execute(raw, (further.batch_id,)).fetchall() == [(b"not json",)]
