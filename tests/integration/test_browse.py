"""The operator pages' ledger reads (kafka2pg.browse) on the real stack: a pipeline's batches with
their gaps by kind, step durations and run ids, and its history of undos and resets, paged by key."""

from __future__ import annotations

import json
import time

from confluent_kafka import Producer

from kafka2pg.browse import batches_page, history_page
from kafka2pg.database import connect
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.kafka_offsets import client_config, partition_offsets
from kafka2pg.ledger import reset_head
from kafka2pg.undo import undo_batch

RUN_ID = "manual__2026-11-26T06:00:00+00:00"


def produce_transactions(env, events: list[dict]) -> None:
    """10 committed, 5 aborted, 10 committed records on partition 0: 3 transaction markers."""
    values = [json.dumps(e).encode() for e in events]
    producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "transactional.id": f"tx-{env.topic}"})
    producer.init_transactions(10)
    for chunk, commit in ((values[0:10], True), (values[10:15], False), (values[15:25], True)):
        producer.begin_transaction()
        for value in chunk:
            producer.produce(env.topic, value=value, partition=0)
        producer.flush(10)
        (producer.commit_transaction if commit else producer.abort_transaction)(10)


def wait_last_stable(env, offset: int) -> None:
    """The coordinator writes a transaction's markers after commit returns: wait for the last one."""
    deadline = time.monotonic() + 60
    while (p0 := partition_offsets(env.settings.bootstrap_servers, env.topic)[0]).last_stable != offset:
        assert time.monotonic() < deadline, f"p0 last stable offset stayed at {p0.last_stable}"
        time.sleep(0.2)


def test_batches_page_shows_gaps_by_kind_step_durations_and_run_ids_newest_first(make_pipeline, run_batch):
    env = make_pipeline(partitions=1, new_partition_start="latest")
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=101)))
    skipped = run_batch(env, run_id="scheduled__first")  # a new partition starts at its end: offsets 0-9 skipped
    produce_transactions(env, list(sample_events(25, seed=102)))
    wait_last_stable(env, 38)  # 10-19 committed, 20 marker, 21-25 aborted, 26 marker, 27-36 committed, 37 marker
    loaded = run_batch(env, run_id=RUN_ID)
    assert loaded.promoted == 20

    with connect(env.settings.database_url, autocommit=True) as conn:
        newest, first = batches_page(conn, env.pipeline.name, None, 50)
        assert batches_page(conn, env.pipeline.name, newest.batch_id, 50) == [first]
        assert batches_page(conn, env.pipeline.name, None, 1) == [newest]

    assert (newest.batch_id, newest.state, newest.kind, newest.ranges) == (
        loaded.batch_id,
        "promoted",
        "live",
        "p0[10,38)",
    )
    assert (newest.records_read, newest.rows_promoted, newest.rows_quarantined) == (20, 20, 0)
    assert newest.gaps == {"aborted": 5, "transaction_markers": 3}
    assert (newest.run_id, newest.epoch, newest.has_report) == (RUN_ID, 1, True)
    assert all(s is not None and s >= 0 for s in (newest.stage_s, newest.validate_s, newest.promote_s)), newest

    assert (first.batch_id, first.state, first.ranges) == (skipped.batch_id, "promoted", "none")
    assert first.gaps == {"skipped_new_partition": 10}
    assert first.run_id == "scheduled__first"


def test_history_lists_undos_and_resets_newest_first_page_by_page(make_pipeline, run_batch):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=103)))
    batch_id = run_batch(env).batch_id
    undo_batch(env.settings, env.pipeline, batch_id, confirm=True, reason="bad load", requested_by="ops")
    reset_head(env.settings, env.pipeline, 0, 20, reason="skip the bad load", confirm=True)

    with connect(env.settings.database_url, autocommit=True) as conn:
        reset, undo = history_page(conn, env.pipeline.name, None, 50)
        assert history_page(conn, env.pipeline.name, None, 1) == [reset]
        assert history_page(conn, env.pipeline.name, reset.key, 1) == [undo]
        assert history_page(conn, env.pipeline.name, undo.key, 1) == []
        assert history_page(conn, "no_such_pipeline", None, 50) == []
        (state,) = conn.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()

    assert (undo.operation, undo.batch_id, undo.ranges, undo.requested_by, undo.reason) == (
        "undo",
        batch_id,
        "p0[0,20)",
        "ops",
        "bad load",
    )
    assert undo.outcome == "target rows 20 -> 0, quarantine rows 0 -> 0"
    assert (reset.operation, reset.ranges, reset.reason) == ("reset", "p0 head unread -> 20", "skip the bad load")
    assert state == "undone"


def test_the_quarantine_page_reads_the_first_bytes_of_a_large_record_and_its_length(make_pipeline, run_batch):
    from kafka2pg.browse import PREVIEW_BYTES, quarantine_page

    env = make_pipeline(partitions=1)
    large = b"\xff" + b"x" * 900_000  # not JSON, not UTF-8: quarantined whole
    producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "message.max.bytes": 2_000_000})
    producer.produce(env.topic, key=b"k" * 300, value=large, partition=0)
    producer.produce(env.topic, key=None, value=b"short", partition=0)
    assert producer.flush(30) == 0
    loaded = run_batch(env)
    assert loaded.quarantined == 2

    with connect(env.settings.database_url, autocommit=True) as conn:
        first, second = quarantine_page(conn, env.pipeline.name, loaded.batch_id, None, 50)
        assert quarantine_page(conn, env.pipeline.name, loaded.batch_id, (0, 0), 50) == [second]
    assert (first.raw_value, first.value_bytes) == (large[:PREVIEW_BYTES], len(large))
    assert (first.raw_key, first.key_bytes) == (b"k" * PREVIEW_BYTES, 300)
    assert (second.raw_key, second.key_bytes, second.raw_value, second.value_bytes) == (None, None, b"short", 5)
