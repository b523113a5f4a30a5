"""Broker-side reality against the real broker: transactions, compaction, retention loss, new
partitions, recreated topics, offsets by time. Every hole in the offsets is explained."""

from __future__ import annotations

import json
import logging
import time
from decimal import Decimal
from functools import partial

import psycopg
import pytest
from confluent_kafka import KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)
from psycopg import sql

from kafka2pg import cli, kafka_reader
from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import (
    BatchStateError,
    OffsetRegressionError,
    QualityGateFailed,
    ReplayRefusedError,
    RetentionLossError,
)
from kafka2pg.kafka_offsets import client_config, offsets_for_times, partition_offsets
from kafka2pg.kafka_reader import count_range, first_timestamps, raw_records_at, read_ranges
from kafka2pg.ledger import reset_head
from kafka2pg.opening import open_batch
from kafka2pg.planner import OffsetRange
from kafka2pg.report import ledger_report, status_report
from kafka2pg.rows import staged_counts
from kafka2pg.staging import stage_batch
from kafka2pg.status import pipeline_status

# A compacted topic whose segments roll and are cleaned within seconds.
COMPACTED_AT_ONCE = {
    "cleanup.policy": "compact",
    "segment.ms": "200",
    "min.cleanable.dirty.ratio": "0.0001",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "100",
}


def admin(env) -> AdminClient:
    return AdminClient(client_config(env.settings.bootstrap_servers, 10))


def create_topic(env, partitions: int = 1, **config: str) -> None:
    client = admin(env)  # the client must outlive its futures
    futures = client.create_topics([NewTopic(env.topic, num_partitions=partitions, config=config)])
    futures[env.topic].result(timeout=10)


def rows(db, env, column: str = "event_id") -> list:
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    query = sql.SQL("SELECT {} FROM {} ORDER BY kafka_partition, kafka_offset").format(sql.Identifier(column), table)
    return [r[0] for r in db.execute(query).fetchall()]


def partition_gaps(db, batch_id: int) -> list[tuple]:
    return db.execute(
        "SELECT kafka_partition, start_offset, end_offset, records_read, aborted_records, marker_offsets,"
        " compacted_offsets FROM kafka2pg.batch_partitions WHERE batch_id = %s ORDER BY kafka_partition",
        (batch_id,),
    ).fetchall()


def ledger(db, env) -> list[tuple]:
    return db.execute(
        "SELECT kafka_partition, start_offset, end_offset, kind, records FROM kafka2pg.ledger_ranges"
        " WHERE pipeline = %s ORDER BY kafka_partition, start_offset",
        (env.pipeline.name,),
    ).fetchall()


def assert_audit_clean(env) -> list:
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits), audits
    return audits


def offsets_become(env, *, last_stable: int, high: int, timeout_s: float = 60) -> bool:
    """Partition 0's last stable offset and high watermark reach these values within the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        (p0,) = partition_offsets(env.settings.bootstrap_servers, env.topic)
        if (p0.last_stable, p0.high) == (last_stable, high):
            return True
        if time.monotonic() > deadline:
            raise AssertionError(f"p0 stayed at last stable {p0.last_stable}, high {p0.high}")
        time.sleep(0.2)


def test_transactions_aborted_never_promoted_markers_explained_open_one_waits(make_pipeline, run_batch, db):
    env = make_pipeline(create_topic=False)
    create_topic(env)
    events = [json.dumps(e).encode() for e in sample_events(90, seed=31)]
    producer = Producer(
        {**client_config(env.settings.bootstrap_servers, 10), "transactional.id": f"tx-{env.topic}", "linger.ms": 5}
    )
    producer.init_transactions(10)
    for chunk, commit in ((events[0:30], True), (events[30:50], False), (events[50:75], True), (events[75:90], None)):
        producer.begin_transaction()
        for value in chunk:
            producer.produce(env.topic, value=value, partition=0)
        producer.flush(10)
        if commit:
            producer.commit_transaction(10)
        elif commit is False:
            producer.abort_transaction(10)
    # Offsets: 0-29 committed, 30 marker, 31-50 aborted, 51 marker, 52-76 committed, 77 marker,
    # 78-92 an open transaction: the last stable offset stays at 78 until it ends.
    # The coordinator writes a transaction's markers after commit/abort returns: wait for them.
    assert offsets_become(env, last_stable=78, high=93)

    first = run_batch(env)
    assert first.promoted == 55 and first.quarantined == 0
    ids = [e["event_id"] for e in sample_events(90, seed=31)]
    assert rows(db, env) == ids[0:30] + ids[50:75]
    assert partition_gaps(db, first.batch_id) == [(0, 0, 78, 55, 20, 3, 0)]
    check = db.execute(
        "SELECT success, details FROM kafka2pg.batch_checks"
        " WHERE batch_id = %s AND check_name = 'offset_gaps_explained'",
        (first.batch_id,),
    ).fetchone()
    assert check == (True, "p0: 23 offsets without a record (20 aborted, 3 transaction markers, 0 compacted)")
    assert run_batch(env) is None, "the open transaction must make the batch wait, not hang"

    producer.commit_transaction(10)
    assert offsets_become(env, last_stable=94, high=94)
    second = run_batch(env)
    assert second.promoted == 15
    assert partition_gaps(db, second.batch_id) == [(0, 78, 94, 15, 0, 1, 0)]
    assert len(rows(db, env)) == 70
    assert_audit_clean(env)


def test_compacted_topic_gaps_are_compaction_and_the_audit_does_not_call_them_loss(make_pipeline, run_batch, db):
    env = make_pipeline(create_topic=False)
    create_topic(env, **COMPACTED_AT_ONCE)
    events = list(sample_events(120, seed=32))
    for index, event in enumerate(events):
        event["customer_id"] = index % 10  # key: ten customers, each written 12 times
    produce(env.settings.bootstrap_servers, env.topic, events[:60])
    first = run_batch(env)
    assert first.promoted == 60
    produce(env.settings.bootstrap_servers, env.topic, events[60:])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # a new record rolls the segment; the cleaner then compacts it
        produce(env.settings.bootstrap_servers, env.topic, [{**events[-1], "event_id": f"filler-{time.time()}"}])
        audits = audit_pipeline(env.settings, env.pipeline)
        (p0,) = partition_offsets(env.settings.bootstrap_servers, env.topic)
        unread = count_range(env.settings.bootstrap_servers, env.topic, 0, 60, p0.high)
        # Wait until compaction reached both the promoted range and the range still to read.
        if sum(a.compacted for a in audits) > 0 and unread.data_records < p0.high - 60:
            break
        time.sleep(1)
    assert sum(a.compacted for a in audits) > 0, "the broker did not compact within 90s"
    assert all(a.clean for a in audits), "records compacted after promotion are not a loss"
    time.sleep(3)  # let the cleaner finish the segment the last filler rolled

    second = run_batch(env)
    ((_, start, end, read, aborted, markers, compacted),) = partition_gaps(db, second.batch_id)
    assert compacted > 0 and aborted == 0 and markers == 0 and read + compacted == end - start
    assert_audit_clean(env)


def test_retention_loss_fails_naming_the_offsets_then_skip_records_the_gap(
    make_pipeline, reconfigured, run_batch, db, monkeypatch, capsys
):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=33)))
    run_batch(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=34)))
    client = admin(env)
    deleted = client.delete_records([TopicPartition(env.topic, 0, 150)])
    assert next(iter(deleted.values())).result(timeout=10).low_watermark == 150
    before = ledger(db, env)
    with pytest.raises(RetentionLossError) as lost:
        open_batch(env.settings, env.pipeline)
    assert (lost.value.pipeline, lost.value.partition, lost.value.offsets) == (env.pipeline.name, 0, (100, 150))
    assert ledger(db, env) == before
    assert blocked(env) == f"RetentionLossError: {lost.value}"
    # verify says it as status does, and exits 1 for it; the same audit under `skip` is clean
    assert verified(env, monkeypatch, capsys) == (
        1,
        f"BLOCKED: no batch can be planned until an operator acts: RetentionLossError: {lost.value}",
    )

    skipping = reconfigured(env, on_retention_loss="skip")
    assert blocked(skipping) is None  # the next run records the gap and goes on
    assert verified(skipping, monkeypatch, capsys) == (0, None)
    result = run_batch(skipping)
    assert result.promoted == 50
    assert ledger(db, env) == [
        (0, 0, 100, "batch", 100),
        (0, 100, 150, "retention_gap", 0),
        (0, 150, 200, "batch", 50),
    ]
    assert_audit_clean(skipping)


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_offsets_deleted_between_plan_and_read_fail_clearly_and_the_next_run_reports_the_loss(
    reader, make_pipeline, run_batch, spark, db
):
    env = make_pipeline(partitions=1, kafka_reader=reader)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=36)))
    run_batch(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=37)))
    planned = open_batch(env.settings, env.pipeline).batch
    client = admin(env)  # kept referenced until the deletion's future is resolved
    deleted = client.delete_records([TopicPartition(env.topic, 0, 140)])
    assert next(iter(deleted.values())).result(timeout=10).low_watermark == 140
    before = ledger(db, env)
    with pytest.raises(RetentionLossError) as lost:
        stage_batch(spark, env.settings, env.pipeline, planned.batch_id, planned.epoch)
    assert (lost.value.batch_id, lost.value.offsets) == (planned.batch_id, (OffsetRange(0, 100, 200),))
    # The next run does not resume the batch (it could only fail again): planning afresh names the
    # lost offsets (that run fails whole, so nothing changes).
    with pytest.raises(RetentionLossError) as lost:
        open_batch(env.settings, env.pipeline)
    assert (lost.value.partition, lost.value.offsets) == (0, (100, 140))
    assert ledger(db, env) == before


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_records_of_every_compression_codec_land_whole_through_either_reader(reader, make_pipeline, run_batch, db):
    """Producers compress as they are configured (gzip, snappy, lz4, zstd, none), one partition
    each here, and a topic may recompress on the broker (`compression.type`): both readers
    decode every codec, and every record lands once with its values."""
    codecs = ["gzip", "snappy", "lz4", "zstd", "none"]
    env = make_pipeline(partitions=len(codecs), create_topic=False, kafka_reader=reader)
    create_topic(env, partitions=len(codecs))
    events = list(sample_events(40 * len(codecs), seed=38))
    for partition, codec in enumerate(codecs):
        producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "compression.type": codec})
        for event in events[partition :: len(codecs)]:
            producer.produce(env.topic, value=json.dumps(event).encode(), partition=partition)
        assert producer.flush(30) == 0
    client = admin(env)  # kept referenced until the change's future is resolved
    zstd = ConfigEntry("compression.type", "zstd", incremental_operation=AlterConfigOpType.SET)
    changed = client.incremental_alter_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, env.topic, incremental_configs=[zstd])]
    )
    next(iter(changed.values())).result(timeout=10)
    recompressed = list(sample_events(len(codecs), seed=39))  # written as lz4, stored as zstd
    produce(env.settings.bootstrap_servers, env.topic, recompressed, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (len(events) + len(codecs), 0)
    assert sorted(rows(db, env)) == sorted(e["event_id"] for e in [*events, *recompressed])
    payloads = dict(zip(rows(db, env), rows(db, env, "amount"), strict=True))
    assert payloads == {e["event_id"]: Decimal(str(e["amount"])) for e in [*events, *recompressed]}
    assert_audit_clean(env)


def test_time_to_data_loss_is_logged_and_shown_with_a_warning_under_the_threshold(make_pipeline, db, caplog):
    env = make_pipeline(create_topic=False, data_loss_warning_hours=2)
    create_topic(env, partitions=2, **{"retention.ms": str(3600 * 1000)})
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(40, seed=35)))
    with caplog.at_level(logging.INFO, logger="kafka2pg.ledger"):
        dry = open_batch(env.settings, env.pipeline, dry_run=True)
    # The dry run names the ranges it would read (the topic's two partitions hold the 40 records).
    assert dry.message.startswith("dry run: would read 40 offsets: p0[0,") and " p1[0," in dry.message, dry.message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(
        "time to data loss ~1.0 h: UNDER the 2 h warning threshold" in w for w in warnings
    )
    report = ledger_report(env.settings, env.pipeline)
    assert "time_to_loss" in report and report.count("(AT RISK)") == 2


def test_first_record_timestamps_of_all_partitions_come_from_one_read_past_aborted_records(make_pipeline):
    """The time-to-data-loss probe reads each partition's first committed record from its head on:
    past an aborted transaction (p0), straight (p1), none at all where the range holds only
    aborted records and markers (p2, left out), and not before the head (p1 from offset 2)."""
    env = make_pipeline(create_topic=False)
    create_topic(env, partitions=3)
    producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "transactional.id": f"tx-{env.topic}"})
    producer.init_transactions(10)
    base = int(time.time() * 1000) - 60_000
    for partition, commit, stamps in ((0, False, [1, 2]), (0, True, [3, 4]), (1, True, [5, 6, 7]), (2, False, [8])):
        producer.begin_transaction()
        for stamp in stamps:
            producer.produce(env.topic, value=b"{}", partition=partition, timestamp=base + stamp)
        producer.flush(10)
        (producer.commit_transaction if commit else producer.abort_transaction)(10)
    # p0: 0-1 aborted, 2 marker, 3-4 committed, 5 marker; p1: 0-2 committed, 3 marker; p2: 0 aborted, 1 marker.
    deadline = time.monotonic() + 60
    while [o.last_stable for o in partition_offsets(env.settings.bootstrap_servers, env.topic)] != [6, 4, 2]:
        assert time.monotonic() < deadline, "the transaction markers were not written"
        time.sleep(0.2)
    ranges = [OffsetRange(0, 0, 6), OffsetRange(1, 2, 4), OffsetRange(2, 0, 2)]
    assert first_timestamps(env.settings.kafka, env.topic, ranges) == {0: base + 3, 1: base + 7}
    with kafka_reader.RangeReader(env.settings.kafka, env.topic, 10) as reader:  # one record each, no more
        read = [(m.partition(), m.offset()) for c in reader.messages(ranges, short="stop", first_only=True) for m in c]
    assert sorted(read) == [(0, 3), (1, 2)]


def test_new_partitions_start_at_low_watermark_or_are_skipped_as_a_recorded_gap(make_pipeline, run_batch, db):
    earliest = make_pipeline(partitions=2)
    latest = make_pipeline(topic=earliest.topic, create_topic=False, new_partition_start="latest")
    produce(earliest.settings.bootstrap_servers, earliest.topic, list(sample_events(40, seed=36)))
    run_batch(earliest)
    assert run_batch(latest).promoted == 0, "a new 'latest' pipeline starts from now"
    client = admin(earliest)
    futures = client.create_partitions([NewPartitions(earliest.topic, 4)])
    futures[earliest.topic].result(timeout=10)
    produce(earliest.settings.bootstrap_servers, earliest.topic, list(sample_events(80, seed=37)))
    new_offsets = {o.partition: o.high for o in partition_offsets(earliest.settings.bootstrap_servers, earliest.topic)}
    assert new_offsets[2] > 0 and new_offsets[3] > 0

    run_batch(earliest)
    assert len(rows(db, earliest)) == 120
    assert {r[0] for r in ledger(db, earliest) if r[3] == "batch"} == {0, 1, 2, 3}
    assert [r for r in ledger(db, earliest) if r[0] >= 2 and r[1] == 0] == [
        (2, 0, new_offsets[2], "batch", new_offsets[2]),
        (3, 0, new_offsets[3], "batch", new_offsets[3]),
    ]
    run_batch(latest)
    skipped = [r for r in ledger(db, latest) if r[3] == "skipped_new_partition"]
    assert [(r[0], r[1], r[2]) for r in skipped if r[0] >= 2] == [(2, 0, new_offsets[2]), (3, 0, new_offsets[3])]
    assert len(rows(db, latest)) == 80 - new_offsets[2] - new_offsets[3]
    assert_audit_clean(earliest)
    assert_audit_clean(latest)


def test_a_staged_batch_whose_records_expired_since_is_resumed_so_status_says_nothing_is_blocked(
    make_pipeline, spark, run_batch, db
):
    """Records deleted after their batch read them: the next run resumes and promotes it, so
    `status` judges the plan after that batch, not one from the head before it."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=49)))
    assert run_batch(env).promoted == 10
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=50)))
    staged = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, staged.batch_id)
    client = admin(env)  # kept referenced until the deletion's future is resolved
    deleted = client.delete_records([TopicPartition(env.topic, 0, 15)])
    assert next(iter(deleted.values())).result(timeout=10).low_watermark == 15
    assert blocked(env) is None
    assert run_batch(env).promoted == 10  # the staged batch, resumed
    assert ledger(db, env) == [(0, 0, 10, "batch", 10), (0, 10, 20, "batch", 10)]
    assert blocked(env) is None


def test_a_staged_batch_whose_gap_kafka_can_no_longer_witness_is_held_saying_how_to_go_on(
    make_pipeline, run_batch, spark, db, monkeypatch
):
    """A staged batch of a transactional topic (a marker: an offset without a record) whose
    records retention deleted before its gate ran: the gate cannot witness the gap and does not
    promote it, saying so (not "run again", which only met the same refusal); the reset it names
    goes on from what Kafka still holds."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=51)))
    assert run_batch(env).promoted == 10
    producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "transactional.id": f"tx-{env.topic}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    for event in sample_events(10, seed=52):
        producer.produce(env.topic, value=json.dumps(event).encode(), partition=0)
    producer.commit_transaction(10)
    assert offsets_become(env, last_stable=21, high=21)  # 10-19 the records, 20 the commit marker
    staged = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, staged.batch_id)
    client = admin(env)  # kept referenced until the deletion's future is resolved
    deleted = client.delete_records([TopicPartition(env.topic, 0, 15)])
    assert next(iter(deleted.values())).result(timeout=10).low_watermark == 15

    for _ in range(2):  # the next run resumes the batch and meets the same refusal
        with pytest.raises(RetentionLossError) as held:
            run_batch(env)
        message = str(held.value)
        assert f"batch {staged.batch_id}: Kafka no longer holds offsets [10, 15)" in message, message
        assert "range [10, 21) there has 1 offset(s) without a staged record" in message, message
    assert ledger(db, env) == [(0, 0, 10, "batch", 10)]

    reset = f"reset --pipeline {env.pipeline.name} --partition 0 --to-offset 15 --reason ..."
    assert f"`./kafka2pg {reset}` then, if its preview is right, the same with `--confirm`" in message, message
    reset += " --confirm"
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    assert cli.main(reset.replace("...", "expired").split()) == 0
    assert run_batch(env).promoted == 5


def test_records_deleted_before_a_first_batch_read_them_are_a_retention_loss_not_a_silent_start(
    make_pipeline, reconfigured, run_batch, db
):
    """The pipeline's first batch planned [0, 100); Kafka deleted [0, 50) before it was read. The
    next plan abandons it and knows where it had started: the loss fails the plan (or, under
    `skip`, is recorded as a gap), where it used to start quietly at the new low watermark."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=48)))
    first = open_batch(env.settings, env.pipeline).batch
    assert first.plan.ranges == (OffsetRange(0, 0, 100),)
    client = admin(env)  # kept referenced until the deletion's future is resolved
    deleted = client.delete_records([TopicPartition(env.topic, 0, 50)])
    assert next(iter(deleted.values())).result(timeout=10).low_watermark == 50
    with pytest.raises(RetentionLossError) as lost:
        open_batch(env.settings, env.pipeline)
    assert (lost.value.partition, lost.value.offsets) == (0, (0, 50))
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (first.batch_id,)).fetchone()[0]
    assert state == "planned"  # the plan failed whole: nothing abandoned yet
    assert blocked(env) == f"RetentionLossError: {lost.value}"  # the partition has no head to check

    skipping = reconfigured(env, on_retention_loss="skip")
    assert blocked(skipping) is None
    assert run_batch(skipping).promoted == 50
    assert ledger(db, env) == [(0, 0, 50, "retention_gap", 0), (0, 50, 100, "batch", 50)]
    assert_audit_clean(skipping)


def recreate_topic(env, partitions: int = 1) -> None:
    client = admin(env)  # kept referenced until the deletion's future is resolved
    client.delete_topics([env.topic])[env.topic].result(timeout=10)
    deadline = time.monotonic() + 30
    while True:  # topic deletion completes asynchronously
        try:
            create_topic(env, partitions)
            return
        except KafkaException:  # TOPIC_ALREADY_EXISTS while the deletion is in flight
            assert time.monotonic() < deadline
            time.sleep(0.5)


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_a_topic_recreated_shorter_between_plan_and_read_stages_nothing(reader, make_pipeline, spark, db):
    """The planned offsets [0, 100) now hold 60 other records: the batch must not stage them as its own."""
    env = make_pipeline(partitions=1, kafka_reader=reader)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=40)))
    planned = open_batch(env.settings, env.pipeline).batch
    assert planned.plan.ranges == (OffsetRange(0, 0, 100),)
    recreate_topic(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(60, seed=41)))
    with pytest.raises(OffsetRegressionError) as recreated:
        stage_batch(spark, env.settings, env.pipeline, planned.batch_id, planned.epoch)
    assert "was deleted and recreated, and the planned offsets are not the records" in str(recreated.value)
    assert staged_counts(db, env.pipeline, planned.batch_id) == {}
    left_planned_then_abandoned(env, db, planned, recreated.value, 60)


def left_planned_then_abandoned(env, db, planned, recreated: OffsetRegressionError, new_records: int) -> None:
    """The stage refused batch `planned` as read from the topic recreated with `new_records`: it
    stays planned, and the next run abandons it and plans the new topic from its start (the
    ledger has no head yet)."""
    assert recreated.batch_id == planned.batch_id
    assert recreated.planned_topic_id == planned.plan.topic_id != recreated.topic_id
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (planned.batch_id,)).fetchone()[0]
    assert state == "planned"
    fresh = open_batch(env.settings, env.pipeline).batch
    assert fresh.batch_id != planned.batch_id and fresh.plan.ranges == (OffsetRange(0, 0, new_records),)
    state, error = db.execute(
        "SELECT state, error FROM kafka2pg.batches WHERE batch_id = %s", (planned.batch_id,)
    ).fetchone()
    assert state == "abandoned" and "was deleted and recreated since it was planned" in error


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_a_topic_recreated_while_the_batch_is_read_stages_nothing_read_from_it(
    reader, make_pipeline, spark, db, monkeypatch
):
    """Deleted and recreated after the stage's check before the read, and refilled: the read finds
    records at the planned offsets, the new topic's. The topic's ID, asked again once the read is
    over, says so: the batch stays planned and the next run abandons it."""
    import kafka2pg.staging

    env = make_pipeline(partitions=1, kafka_reader=reader)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=48)))
    planned = open_batch(env.settings, env.pipeline).batch
    assert planned.plan.ranges == (OffsetRange(0, 0, 100),)
    real_read = kafka2pg.staging._read_and_write

    def recreated_before_the_read(*args):
        recreate_topic(env)
        produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=49)))
        return real_read(*args)

    monkeypatch.setattr(kafka2pg.staging, "_read_and_write", recreated_before_the_read)
    with pytest.raises(OffsetRegressionError) as recreated:
        stage_batch(spark, env.settings, env.pipeline, planned.batch_id, planned.epoch)
    monkeypatch.undo()
    assert "deleted and recreated while the batch was being read" in str(recreated.value)
    assert sum(staged_counts(db, env.pipeline, planned.batch_id).values()) == 100, "the new topic's records were read"
    left_planned_then_abandoned(env, db, planned, recreated.value, 100)
    assert staged_counts(db, env.pipeline, planned.batch_id) == {}, "the abandoned batch's rows are gone"


def test_a_topic_recreated_and_refilled_beyond_the_head_is_refused_until_a_reset(make_pipeline, run_batch, replay, db):
    """The new topic holds more records than the ledger's head: by offsets alone, planning would
    go on from the old head and never load the new topic's first records. The topic's ID says it
    is another topic: planning, replays and the audit refuse until a recorded reset."""
    from kafka2pg.replay_request import ReplayRequest

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(50, seed=46)))
    run_batch(env)
    old_id = db.execute(
        "SELECT topic_id FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]
    assert old_id
    recreate_topic(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(80, seed=47)))
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert regressed.value.partitions == [0] and regressed.value.ledgered_topic_id == old_id
    assert "deleted and recreated" in str(regressed.value) and "kafka2pg reset" in str(regressed.value)
    with pytest.raises(ReplayRefusedError, match="deleted and recreated"):
        replay(env, ReplayRequest("replace", (OffsetRange(0, 0, 50),), requested_by="test"))
    (audit,) = audit_pipeline(env.settings, env.pipeline)
    assert not audit.clean and audit.kafka_records == 0
    assert any("deleted and recreated" in problem for problem in audit.ledger_breaks)

    preview = reset_head(env.settings, env.pipeline, 0, 0, reason="topic recreated", confirm=False)
    assert "the head is an offset in the topic before it was recreated" in preview.message
    reset_head(env.settings, env.pipeline, 0, 0, reason="topic recreated", confirm=True, archive_old_rows=True)
    assert run_batch(env).promoted == 80
    assert rows(db, env) == [e["event_id"] for e in sample_events(80, seed=47)]
    assert_audit_clean(env)


def test_an_end_of_partition_below_the_range_end_goes_on_reading_when_the_leader_holds_the_offsets(
    make_pipeline, monkeypatch
):
    """A replica or a new leader can report an end of partition below offsets the plan saw: the
    read asks the leader and goes on instead of ending the range short. Played here by writing
    the range's last 40 records while the read asks (the one broker is its own leader)."""
    env = make_pipeline(partitions=1)
    servers = env.settings.bootstrap_servers
    produce(servers, env.topic, list(sample_events(60, seed=42)))
    real_bounds = kafka_reader.partition_bounds
    asked = []

    def records_arrive_while_asked(*args):
        if not asked:
            producer = Producer({**client_config(servers, 10), "linger.ms": 5000})  # in one request
            for n in range(40):
                producer.produce(env.topic, value=b"late %d" % n, partition=0, headers=[("n", b"%d" % n)])
            assert producer.flush(30) == 0
        asked.append(args)
        return real_bounds(*args)

    monkeypatch.setattr(kafka_reader, "partition_bounds", records_arrive_while_asked)
    batches = list(read_ranges(servers, env.topic, [OffsetRange(0, 0, 100)], "kafka2pg-test", 30))
    assert [o for b in batches for o in b.column("offset").to_pylist()] == list(range(100))
    assert asked  # the end of partition at 60

    asked.clear()
    monkeypatch.setattr(kafka_reader, "partition_bounds", real_bounds)
    produce(servers, env.topic, list(sample_events(40, seed=43)))  # offsets 100-139, without headers
    monkeypatch.setattr(kafka_reader, "partition_bounds", records_arrive_while_asked)
    # 140-179 arrive while the witness asks about its end at 140.
    found = count_range(servers, env.topic, 0, 100, 180)
    assert (found.committed, found.data_records) == (80, 80)
    asked.clear()  # 180-219 arrive while the headers reader asks about its end at 180
    found = raw_records_at(servers, env.topic, {0: [139, 219]}, 30)
    assert {at: r.headers for at, r in found.items()} == {(0, 139): [], (0, 219): [(b"n", b"39")]}
    assert found[(0, 219)].value == b"late 39"


def test_records_larger_than_the_readers_prefetch_queue_are_read_whole(make_pipeline):
    """The stage reader's prefetch queue per partition (and with it librdkafka's cap on a fetch
    response) is smaller than a record a topic may allow: the broker still returns the record's
    batch, and the reader hands every record on whole, in offset order."""
    queue = kafka_reader.READER_FETCH["queued.max.messages.kbytes"] * 1024
    big = queue * 2 + 12_345
    env = make_pipeline(partitions=2, create_topic=False)
    create_topic(env, partitions=2, **{"max.message.bytes": str(big * 2)})
    servers = env.settings.bootstrap_servers
    producer = Producer({**client_config(servers, 10), "message.max.bytes": big * 2, "compression.type": "none"})
    sizes = {0: [100, big, 200, big + 1], 1: [big + 2, 300]}
    for partition, lengths in sizes.items():
        for n, length in enumerate(lengths):
            producer.produce(env.topic, value=bytes([65 + n]) * length, partition=partition)
            assert producer.flush(60) == 0  # one at a time: offsets in this order
    ranges = [OffsetRange(p, 0, len(lengths)) for p, lengths in sizes.items()]
    read = {}
    for batch in read_ranges(servers, env.topic, ranges, "kafka2pg-test", 60):
        for partition, offset, value in zip(
            *(batch.column(c).to_pylist() for c in ("partition", "offset", "value")), strict=True
        ):
            read.setdefault(partition, []).append((offset, len(value), value[:1]))
    assert read == {
        p: [(n, length, bytes([65 + n])) for n, length in enumerate(lengths)] for p, lengths in sizes.items()
    }


def test_the_audit_of_a_topic_recreated_shorter_reports_the_rows_kafka_no_longer_holds(make_pipeline, run_batch, db):
    """Ledgered ranges that now lie partly or wholly beyond the partition's end: the audit reads
    what Kafka holds and names the rest as rows without a record in Kafka, without failing. (A
    topic whose ID changed is named as recreated instead, compared with nothing: below.)"""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(100, seed=44)))
    run_batch(env, max_records_per_batch=50)
    run_batch(env, max_records_per_batch=50)  # ledgered: [0, 50) and [50, 100)
    recreate_topic(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(30, seed=45)))
    (audit,) = audit_pipeline(env.settings, env.pipeline)
    assert (audit.kafka_records, audit.matched, audit.unexplained) == (0, 0, 0)
    assert [p for p in audit.ledger_breaks if "deleted and recreated" in p] and not audit.clean
    # A head written before kafka2pg recorded topic IDs: only the offsets can say what changed.
    db.execute("UPDATE kafka2pg.ledger_heads SET topic_id = NULL WHERE pipeline = %s", (env.pipeline.name,))
    (audit,) = audit_pipeline(env.settings, env.pipeline)
    assert (audit.kafka_records, audit.matched, audit.unexplained) == (30, 30, 70)
    assert audit.unexplained_offsets[0] == 30
    assert not audit.clean


def verified(env, monkeypatch, capsys) -> tuple[int, str | None]:
    """`kafka2pg verify --pipeline`'s exit code and BLOCKED line (None: none)."""
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()
    code = cli.main(["verify", "--pipeline", env.pipeline.name])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BLOCKED")]
    return code, lines[0] if lines else None


def blocked(env) -> str | None:
    """What `status` and the Airflow overview page say stops every run (their `blocked`)."""
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        return pipeline_status(env.settings, env.pipeline, conn).blocked


def test_recreated_topic_is_an_offset_regression_until_an_explicit_recorded_reset(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(50, seed=38)))
    run_batch(env)
    assert blocked(env) is None
    recreate_topic(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=39)))
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert regressed.value.partitions == [0] and "deleted and recreated" in str(regressed.value)
    # status says so, with the words the run stops at: it used to show a normal ledger
    assert blocked(env) == f"OffsetRegressionError: {regressed.value}"
    text, _ = status_report(env.settings, env.pipeline)
    assert f"BLOCKED: no batch can be planned until an operator acts: OffsetRegressionError: {regressed.value}" in text
    assert "caught up" not in text and "head past the topic's end" in text, text  # head 50, high watermark 10
    # A head written before kafka2pg recorded topic IDs: the offsets say it.
    db.execute("UPDATE kafka2pg.ledger_heads SET topic_id = NULL WHERE pipeline = %s", (env.pipeline.name,))
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert (regressed.value.partition, regressed.value.head, regressed.value.high_watermark) == (0, 50, 10)
    assert blocked(env) == f"OffsetRegressionError: {regressed.value}"

    preview = reset_head(env.settings, env.pipeline, 0, 0, reason="topic recreated", confirm=False)
    assert (
        not preview.applied and "head 50 -> 0" in preview.message and "50 promoted/quarantined rows" in preview.message
    )
    assert "will never be loaded" not in preview.message  # nothing Kafka holds is skipped
    # Without --archive-old-rows the new records' offsets 0-9 are the old rows' provenance: said before it fails.
    assert "50 of them hold offsets from 0 on, which the new topic's records reuse" in preview.message
    assert "give --archive-old-rows" in preview.message
    archiving = reset_head(env.settings, env.pipeline, 0, 0, reason="x", confirm=False, archive_old_rows=True)
    assert "hold offsets from" not in archiving.message
    with pytest.raises(OffsetRegressionError):
        open_batch(env.settings, env.pipeline)

    reset_head(env.settings, env.pipeline, 0, 0, reason="topic recreated", confirm=True, archive_old_rows=True)
    assert blocked(env) is None
    recorded = db.execute(
        "SELECT from_offset, to_offset, reason FROM kafka2pg.ledger_resets WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchall()
    assert recorded == [(50, 0, "topic recreated")]
    assert_audit_clean(env)  # reset, nothing consumed since: the old topic's ranges are history
    assert run_batch(env).promoted == 10
    assert rows(db, env) == [e["event_id"] for e in sample_events(10, seed=39)]
    archived = db.execute(
        "SELECT count(*) FROM kafka2pg.archived_rows WHERE pipeline = %s AND source = 'target'", (env.pipeline.name,)
    ).fetchone()[0]
    assert archived == 50
    assert_audit_clean(env)


def test_a_reset_forward_says_which_offsets_kafka_holds_that_will_never_be_loaded(make_pipeline, run_batch):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=40)))
    loaded = run_batch(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=41)))
    preview = reset_head(env.settings, env.pipeline, 0, 25, reason="skip a bad producer", confirm=False)
    assert "head 20 -> 25" in preview.message, preview.message
    assert "offsets [20, 25) that Kafka still holds (5 at most) will never be loaded" in preview.message
    # The same topic: its rows did not come "from the topic before the reset"; what the reset costs them.
    assert preview.message.endswith(
        "; the 20 promoted/quarantined rows of partition 0 loaded before the reset stay, but `./kafka2pg verify` "
        "audits the partition from the reset on and `./kafka2pg replay` re-reads only offsets loaded after it"
    ), preview.message
    with pytest.raises(BatchStateError, match="partition 0's head is 20 already, in topic .* nothing to reset"):
        reset_head(env.settings, env.pipeline, 0, 20, reason="no-op", confirm=True)
    with pytest.raises(BatchStateError, match="partition 7 has no ledger head to drop"):
        reset_head(env.settings, env.pipeline, 7, None, reason="typo", confirm=True)
    # Backwards on the same topic: its rows are there, every batch would be rejected as promoted.
    with pytest.raises(BatchStateError, match=r"moving it back to 5 would read \[5, 20\) again") as back:
        reset_head(env.settings, env.pipeline, 0, 5, reason="load again", confirm=True)
    assert "kafka2pg replay" in str(back.value)
    assert (
        "--archive-old-rows would archive EVERY row of partition 0 (the 5 of offsets below 5 too, which are not"
        " loaded again) and load [5, 20) as new"
    ) in str(back.value)
    # Archiving takes the whole partition's rows: those below the new head are not loaded again.
    preview = reset_head(env.settings, env.pipeline, 0, 5, reason="load again", confirm=False, archive_old_rows=True)
    assert preview.message.endswith(
        "; all 20 promoted/quarantined rows of partition 0 are archived to kafka2pg.archived_rows, 5 of them of "
        "offsets below the new head 5: those leave the target and the quarantine for good (the next runs load only "
        "from the new head on)"
    ), preview.message
    moved = reset_head(env.settings, env.pipeline, 0, 5, reason="load again", confirm=True, archive_old_rows=True)
    assert moved.applied and run_batch(env).promoted == 25
    audits = assert_audit_clean(env)
    shown = format_audit(env.pipeline, audits)  # the audit says where it starts: at the reset
    assert f"partition 0 audited since its reset (to offset 5, after batch {loaded.batch_id}): " in shown, shown
    # With a batch open, a reset to the same head abandons it: allowed.
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(3, seed=42)))
    planned = open_batch(env.settings, env.pipeline).batch
    same = reset_head(env.settings, env.pipeline, 0, 30, reason="abandon it", confirm=False)
    assert f"head 30 -> 30; unfinished batch {planned.batch_id} is abandoned" in same.message, same.message


@pytest.mark.parametrize("change", ["records deleted", "topic recreated"])
def test_a_reset_asks_kafka_again_once_it_holds_its_locks(
    make_pipeline, run_batch, db, heads, behind_range_lock, change
):
    """The new head was an offset Kafka held when the reset began; retention deleted it (or the
    topic was recreated) while the reset waited for the partition's range lock (a replay finishing
    there): refused under the lock, nothing changed, not a head below the low watermark (or in a
    topic gone) that stops every next run."""
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=43)))
    run_batch(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=44)))
    reset = partial(reset_head, env.settings, env.pipeline, 0, 25, reason="skip", confirm=True)
    with behind_range_lock(env, reset) as outcome:
        if change == "records deleted":
            client = AdminClient(client_config(env.settings.bootstrap_servers, 10))
            deleted = client.delete_records([TopicPartition(env.topic, 0, 27)])
            assert next(iter(deleted.values())).result(timeout=30).low_watermark == 27
            refused = (
                "cannot reset partition 0 to 25: the partition holds offsets [27, 30) (retention deleted records while "
                "it waited for its locks); nothing was changed"
            )
        else:  # the new topic holds offset 25 too: only its ID tells
            recreate_topic(env)
            produce(env.settings.bootstrap_servers, env.topic, list(sample_events(30, seed=45)))
            refused = "was deleted and recreated while the reset of partition 0 waited for its locks"
    assert isinstance(outcome[0], BatchStateError), outcome
    assert refused in str(outcome[0])
    assert heads(env) == {0: 20}
    assert not db.execute(
        "SELECT count(*) FROM kafka2pg.ledger_resets WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]


def test_a_time_window_maps_to_per_partition_offsets(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=2)
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    base = 1_790_000_000_000
    for partition in (0, 1):
        for second in range(10):
            producer.produce(env.topic, value=b"{}", partition=partition, timestamp=base + second * 1000)
    producer.flush(10)
    assert offsets_for_times(env.settings.bootstrap_servers, env.topic, base + 3000) == {0: 3, 1: 3}
    assert offsets_for_times(env.settings.bootstrap_servers, env.topic, base + 7500) == {0: 8, 1: 8}
    assert offsets_for_times(env.settings.bootstrap_servers, env.topic, base + 60_000) == {0: 10, 1: 10}
    # Before 1970 (Kafka's record timestamps are not negative, and it reads -1 and -2 as latest
    # and earliest): the window starts at each partition's first record.
    year_1969 = -365 * 86_400_000
    assert offsets_for_times(env.settings.bootstrap_servers, env.topic, year_1969) == {0: 0, 1: 0}
    assert offsets_for_times(env.settings.bootstrap_servers, env.topic, -1) == {0: 0, 1: 0}
    # The same window from the command line (one client for both ends).
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    capsys.readouterr()
    window = ["--from", "2026-09-21T14:13:23+00:00", "--to", "2026-09-21T14:13:27.500+00:00"]  # base + 3 s, + 7.5 s
    assert cli.main(["offsets", "--pipeline", env.pipeline.name, *window]) == 0
    shown = capsys.readouterr().out
    assert "partition 0: offsets [3, 8)" in shown and "partition 1: offsets [3, 8)" in shown, shown
    assert "records with timestamps in [2026-09-21T14:13:23Z, 2026-09-21T14:13:27.500000Z) (UTC)" in shown


def test_gap_that_does_not_add_up_holds_the_batch(make_pipeline, spark, db):
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(30, seed=40)))
    batch = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, batch.batch_id)
    # Simulate Spark losing records: the staged count says 25 where Kafka holds 30 committed.
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    db.execute(sql.SQL("DELETE FROM {} WHERE batch_id = %s AND kafka_offset >= 25").format(staging), (batch.batch_id,))
    db.execute("UPDATE kafka2pg.batch_partitions SET records_read = 25 WHERE batch_id = %s", (batch.batch_id,))
    db.execute("UPDATE kafka2pg.batches SET records_read = 25, rows_staged = 25 WHERE batch_id = %s", (batch.batch_id,))
    with pytest.raises(QualityGateFailed) as rejected:
        validate_batch(env.settings, env.pipeline, batch.batch_id)
    assert rejected.value.batch_id == batch.batch_id
    assert rejected.value.failed["offset_gaps_explained"] == (
        "partition 0 [0, 30): Spark read 25 records but a read_committed consumer finds 30"
    )
    assert rows(db, env) == []


def test_a_replay_over_a_compacted_record_keeps_its_row_and_flags_the_newer_duplicate(
    make_pipeline, run_batch, replay, db
):
    """A row whose record was compacted away stays through a replay of its range (it cannot be
    re-read), so the gate counts it as promoted: a later record of its key, quarantined as a
    duplicate when it was first loaded, is flagged again instead of colliding at the finish. A
    verify-only replay reports the row as gone from Kafka, not as a difference."""
    from kafka2pg.replay_request import ReplayRequest

    env = make_pipeline(create_topic=False)
    create_topic(env, **COMPACTED_AT_ONCE)
    events = list(sample_events(10, seed=35))
    again = {**events[3], "amount": 1.0}  # the same business key, later
    produce(env.settings.bootstrap_servers, env.topic, events, key_field="event_id")
    run_batch(env)
    produce(env.settings.bootstrap_servers, env.topic, [again], key_field="event_id")
    second = run_batch(env)
    assert (second.promoted, second.quarantined) == (0, 1)  # offset 10: key already promoted at offset 3
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # a new record rolls the segment; the cleaner then compacts it
        produce(env.settings.bootstrap_servers, env.topic, [{**events[0], "event_id": f"filler-{time.time()}"}])
        if 3 not in dict(kafka_reader.read_offsets(env.settings.bootstrap_servers, env.topic, 0, [(0, 11)], 10)):
            break
        time.sleep(1)
    else:
        pytest.fail("the broker did not compact offset 3 within 90s")

    verified = replay(env, ReplayRequest("verify-only", (OffsetRange(0, 0, 11),), requested_by="test"))
    assert verified.differences == {"only_in_target_record_gone": {"count": 1, "sample": ["0:3"]}}
    assert " 0 difference(s) " in verified.message, verified.message
    assert "1 row(s) whose record Kafka no longer holds (compacted away; a replace keeps them)" in verified.message
    result = replay(env, ReplayRequest("replace", (OffsetRange(0, 0, 11),), requested_by="test"))
    assert (result.promoted, result.quarantined) == (9, 1)
    reason = db.execute(
        "SELECT reason FROM kafka2pg.quarantine WHERE pipeline = %s AND kafka_offset = 10", (env.pipeline.name,)
    ).fetchone()[0]
    assert "already promoted by batch" in reason and "offset 3" in reason
    assert rows(db, env).count(events[3]["event_id"]) == 1
    assert_audit_clean(env)


def test_a_topic_recreated_with_fewer_partitions_says_to_drop_the_heads_of_those_gone(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=3, create_topic=False)
    create_topic(env, partitions=3)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(60, seed=48)))
    run_batch(env)
    heads = dict(
        db.execute(
            "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    assert sorted(heads) == [0, 1, 2], heads
    recreate_topic(env, partitions=2)
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert "or `--drop` instead of `--to-offset <offset>` for a partition the new topic does not have" in str(
        regressed.value
    )
    # The reset the message names, tried on the partition that is gone, points at --drop.
    with pytest.raises(BatchStateError) as refused:
        reset_head(env.settings, env.pipeline, 2, 0, reason="x", confirm=True)
    assert "the partition does not exist (the topic has 2: 0, 1); `--drop` removes the head" in str(refused.value)
    # Heads without a topic ID (written before kafka2pg recorded them): the partitions say it.
    db.execute("UPDATE kafka2pg.ledger_heads SET topic_id = NULL WHERE pipeline = %s", (env.pipeline.name,))
    with pytest.raises(OffsetRegressionError) as regressed:
        open_batch(env.settings, env.pipeline)
    assert f" reset --pipeline {env.pipeline.name} --partition <p> --drop` then, if its preview" in str(regressed.value)
    assert blocked(env) == f"OffsetRegressionError: {regressed.value}"

    reset_head(env.settings, env.pipeline, 2, None, reason="partition gone", confirm=True)
    for partition in (0, 1):
        reset_head(env.settings, env.pipeline, partition, 0, reason="recreated", confirm=True, archive_old_rows=True)
    assert blocked(env) is None
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(20, seed=49)))
    assert run_batch(env).promoted == 20
    assert_audit_clean(env)


def test_raw_bytes_are_never_read_from_a_topic_recreated_since_the_batch(make_pipeline, spark, db, monkeypatch, caplog):
    """The promotion died after its commit, before it read the refused row's raw bytes; the topic
    was then deleted and recreated, and holds other records at the same offsets: the retry leaves
    the row without raw bytes (its typed values and provenance stay), never another record's."""
    import kafka2pg.steps
    from kafka2pg.quality import validate_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=1)
    events = list(sample_events(10, seed=85))
    events[3]["customer_id"] = 100_000
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_customer CHECK (customer_id < 10000)").format(target))
    produce(env.settings.bootstrap_servers, env.topic, events)
    batch_id = open_batch(env.settings, env.pipeline).batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)

    def dies(*args, **kwargs):
        raise RuntimeError("the promotion's process died here")

    with monkeypatch.context() as patched:
        patched.setattr(kafka2pg.steps, "keep_raw_bytes", dies)
        with pytest.raises(RuntimeError):
            promote_batch(env.settings, env.pipeline, batch_id)
    recreate_topic(env)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=86)))

    with caplog.at_level(logging.WARNING, logger="kafka2pg.raw_bytes"):
        again = promote_batch(env.settings, env.pipeline, batch_id)

    assert again.already_promoted
    raw = "SELECT kafka_offset, raw_value FROM kafka2pg.quarantine WHERE batch_id = %s"
    assert db.execute(raw, (batch_id,)).fetchall() == [(3, None)]
    assert "the topic was deleted and recreated since the batch was read" in caplog.text
