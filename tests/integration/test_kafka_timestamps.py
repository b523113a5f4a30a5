"""A record whose Kafka timestamp PostgreSQL would store but no client can read back (after year
9999, up to the largest 64-bit count of milliseconds: brokers before Kafka 4.0 accept any by
default; before year 1, down to the smallest) goes to quarantine naming the timestamp, with its
bytes; the rest of the batch lands."""

import json
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.chunk_writer import UNREADABLE_TIMESTAMP
from kafka2pg.exceptions import Kafka2PgError
from kafka2pg.kafka_offsets import client_config
from kafka2pg.status import pipeline_status

LONG_MAX = 2**63 - 1
LAST_READABLE_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


def _topic_accepting_any_timestamp(env) -> None:
    admin = AdminClient(client_config(env.settings.bootstrap_servers, 10))
    config = {"message.timestamp.after.max.ms": str(LONG_MAX)}  # Kafka 4's default refuses an hour ahead
    futures = admin.create_topics([NewTopic(env.topic, num_partitions=1, replication_factor=1, config=config)])
    futures[env.topic].result(30)


def _event(n: int) -> bytes:
    return json.dumps({"event_id": f"ts-{n}", "customer_id": n, "ts": "2026-01-01T00:00:00Z"}).encode()


def test_kafka_timestamps_after_year_9999_are_quarantined_naming_them_and_the_rest_lands(
    make_pipeline, run_batch, db, heads
):
    env = make_pipeline(partitions=1, create_topic=False)
    _topic_accepting_any_timestamp(env)
    now_ms = int(time.time() * 1000)
    records = [  # (value, timestamp in ms, headers)
        (_event(0), now_ms, None),
        (_event(1), LONG_MAX, [("h", b"\xfe")]),  # read as milliseconds, too large for microseconds
        (_event(2), LAST_READABLE_MS + 1, None),  # 10000-01-01
        (_event(3), LAST_READABLE_MS, None),  # the last instant that lands
        (_event(4), now_ms * 1000, None),  # microseconds where Kafka expects milliseconds
        (b"not json", LONG_MAX, None),  # refused by admission as well
        (_event(6), now_ms, None),
        (_event(7), -(2**63), None),  # the smallest: too small for microseconds too
        (_event(8), -(10**16), [("h", b"x")]),  # about year -314,000
    ]
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    for value, timestamp, headers in records:
        producer.produce(env.topic, value=value, partition=0, timestamp=timestamp, headers=headers)
    assert producer.flush(30) == 0

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (3, 6)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(sql.SQL("SELECT kafka_offset, kafka_timestamp FROM {} ORDER BY 1").format(target)).fetchall()
    assert [offset for offset, _ in landed] == [0, 3, 6]
    assert landed[1][1] == datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    quarantined = db.execute(
        "SELECT kafka_offset, kafka_timestamp, reason, raw_value, raw_headers FROM kafka2pg.quarantine"
        " WHERE pipeline = %s ORDER BY 1",
        (env.pipeline.name,),
    ).fetchall()
    assert [row[0] for row in quarantined] == [1, 2, 4, 5, 7, 8]
    assert all(stamp is None for _, stamp, *_ in quarantined)
    assert [reason for _, _, reason, *_ in quarantined[:3] + quarantined[4:]] == [UNREADABLE_TIMESTAMP] * 5
    assert quarantined[3][2].endswith(f"; and {UNREADABLE_TIMESTAMP}")
    assert quarantined[3][2] != f"; and {UNREADABLE_TIMESTAMP}" and "value" in quarantined[3][2].split(";")[0]
    assert [bytes(value) for *_, value, _ in quarantined] == [records[i][0] for i in (1, 2, 4, 5, 7, 8)]
    assert [[bytes(part) for part in pair] for pair in quarantined[0][4]] == [[b"h", b"\xfe"]]
    assert [[bytes(part) for part in pair] for pair in quarantined[5][4]] == [[b"h", b"x"]]
    assert heads(env) == {0: 9}
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))


def test_with_sparks_kafka_source_too_and_one_it_cannot_convert_fails_the_stage_saying_what_to_do(
    make_pipeline, run_batch, db, heads
):
    env = make_pipeline(partitions=1, create_topic=False, kafka_reader="spark")
    _topic_accepting_any_timestamp(env)
    now_ms = int(time.time() * 1000)
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    for n, timestamp in enumerate((now_ms, LAST_READABLE_MS + 1, now_ms * 1000, LAST_READABLE_MS)):
        producer.produce(env.topic, value=_event(n), partition=0, timestamp=timestamp)
    assert producer.flush(30) == 0

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (2, 2)
    reasons = db.execute(
        "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY 1", (env.pipeline.name,)
    ).fetchall()
    assert reasons == [(1, UNREADABLE_TIMESTAMP), (2, UNREADABLE_TIMESTAMP)]

    producer.produce(env.topic, value=_event(4), partition=0, timestamp=LONG_MAX)
    assert producer.flush(30) == 0
    with pytest.raises(Kafka2PgError) as failed:
        run_batch(env)
    message = str(failed.value)
    assert "Spark's Kafka source cannot read a record of it" in message and "offset 4" in message, message
    assert "kafka_reader: librdkafka" in message and "kafka2pg reset" in message, message
    assert heads(env) == {0: 4}  # nothing of that batch promoted


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_kafka_timestamps_before_the_gregorian_calendar_land_exactly_with_either_reader(
    reader, make_pipeline, run_batch, db
):
    # Spark's Kafka source reads them through java.sql.Timestamp's Julian calendar (1582-10-04
    # arrives as 1582-09-24); kafka2pg turns them back.
    env = make_pipeline(partitions=1, create_topic=False, kafka_reader=reader)
    _topic_accepting_any_timestamp(env)
    instants = [
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(1000, 3, 1, 12, 0, 0, 1000, tzinfo=UTC),
        datetime(1500, 6, 1, tzinfo=UTC),
        datetime(1582, 10, 4, 23, 59, 59, 999000, tzinfo=UTC),
        datetime(1582, 10, 15, tzinfo=UTC),
        datetime(1900, 1, 1, tzinfo=UTC),
    ]
    stamps = [(instant - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1) for instant in instants]
    stamps.append(stamps[0] - 1)  # 0000-12-31T23:59:59.999Z: before year 1
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    for n, stamp in enumerate(stamps):
        producer.produce(env.topic, value=_event(n), partition=0, timestamp=stamp)
    assert producer.flush(30) == 0

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (6, 1)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(sql.SQL("SELECT kafka_timestamp FROM {} ORDER BY kafka_offset").format(target)).fetchall()
    assert [stamp for (stamp,) in landed] == instants
    reasons = db.execute(
        "SELECT kafka_offset, reason FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    )
    assert reasons.fetchall() == [(6, UNREADABLE_TIMESTAMP)]


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_a_record_kafka_holds_without_a_timestamp_lands_with_a_null_one_not_a_date_in_1969(
    reader, make_pipeline, run_batch, replay, db
):
    from kafka2pg.planner import OffsetRange
    from kafka2pg.replay_request import ReplayRequest

    env = make_pipeline(partitions=1, kafka_reader=reader)
    now_ms = int(time.time() * 1000)
    producer = Producer(client_config(env.settings.bootstrap_servers, 10))
    for n, stamp in enumerate((-1, now_ms, -1)):  # -1: Kafka's NO_TIMESTAMP
        producer.produce(env.topic, value=_event(n), partition=0, timestamp=stamp)
    assert producer.flush(30) == 0
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        (partition,) = pipeline_status(env.settings, env.pipeline, conn).partitions
    assert partition.time_to_loss == "unknown (no Kafka timestamp)"  # not "overdue": 1969 is no record's time

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (3, 0)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(sql.SQL("SELECT kafka_timestamp FROM {} ORDER BY kafka_offset").format(target)).fetchall()
    assert landed[0][0] is None and landed[2][0] is None
    assert abs(landed[1][0].timestamp() * 1000 - now_ms) < 1
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))

    # Rows loaded while such a record's time was stored as 1969-12-31T23:59:59.999Z: a replay
    # compares them as the same records.
    db.execute(
        sql.SQL("UPDATE {} SET kafka_timestamp = 'epoch'::timestamptz - interval '1 ms'").format(target)
        + sql.SQL(" WHERE kafka_timestamp IS NULL")
    )
    replay(env, ReplayRequest("verify-only", (OffsetRange(0, 0, 3),), requested_by="test"))
    (differences,) = db.execute(
        "SELECT differences FROM kafka2pg.replays WHERE pipeline = %s AND finished_at IS NOT NULL", (env.pipeline.name,)
    ).fetchone()
    assert differences == {}, differences
