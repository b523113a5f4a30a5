"""A topic whose values a Schema Registry JSON Schema serializer wrote (a 5-byte header before the
JSON), read by either reader: the JSON lands, a value without the header is quarantined saying so,
and every quarantined record keeps its bytes as Kafka holds them, header included."""

import json

import pytest
from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.devtools.producer import produce, sample_events


def registry_framed(value: bytes, schema_id: int) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + value


@pytest.mark.parametrize("reader", ["librdkafka", "spark"])
def test_a_schema_registry_json_topic_lands_its_json_and_quarantines_values_without_the_header(
    reader, make_pipeline, run_batch, db
):
    env = make_pipeline(partitions=2, kafka_reader=reader, value_format="schema_registry_json")
    events = list(sample_events(23, seed=94))
    plain = json.dumps(events[20]).encode()  # a producer without the serializer
    broken = registry_framed(json.dumps({**events[21], "customer_id": "many"}).encode(), 7)
    header_only = registry_framed(b"", 7)
    values = [registry_framed(json.dumps(e).encode(), 7) for e in events[:20]] + [plain, broken, header_only]
    produce(env.settings.bootstrap_servers, env.topic, values, key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (20, 3)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = db.execute(sql.SQL("SELECT event_id, customer_id FROM {}").format(target)).fetchall()
    assert sorted(landed) == sorted((e["event_id"], e["customer_id"]) for e in events[:20])
    quarantined = dict(
        db.execute("SELECT raw_value, reason FROM kafka2pg.quarantine WHERE batch_id = %s", (result.batch_id,))
    )
    assert set(quarantined) == {plain, broken, header_only}
    assert quarantined[plain].startswith("value has no Schema Registry header (")
    assert quarantined[broken].startswith("field 'customer_id': expected a JSON integer for bigint")
    assert quarantined[header_only] == "value is a Schema Registry header (schema id 7) without JSON after it"
    assert all(a.clean for a in audit_pipeline(env.settings, env.pipeline))
