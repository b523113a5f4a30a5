"""`kafka2pg produce` makes new sample events each time unless a seed repeats a run's."""

import json
import re
import uuid

from confluent_kafka import Consumer

from kafka2pg import cli
from kafka2pg.kafka_offsets import client_config


def _event_ids(servers: str, topic: str, count: int) -> list[str]:
    consumer = Consumer({**client_config(servers, 10), "group.id": f"g-{topic}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    ids: list[str] = []
    try:
        while len(ids) < count:
            message = consumer.poll(30)
            assert message is not None, f"only {len(ids)} of {count} records read back"
            assert message.error() is None, message.error()
            ids.append(json.loads(message.value())["event_id"])
    finally:
        consumer.close()
    return ids


def test_produce_makes_new_events_each_time_and_the_same_ones_for_a_seed(base_settings, monkeypatch, capsys):
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", base_settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", base_settings.database_url)
    topic = f"produced-{uuid.uuid4().hex[:8]}"
    for args in ([], [], ["--seed", "7"], ["--seed", "7"]):
        assert cli.main(["produce", "--topic", topic, "--count", "5", "--partitions", "1", *args]) == 0
    printed = capsys.readouterr().out
    seeds = re.findall(r"produced 5 events to \S+ \(--seed (\d+) produces the same events again\)", printed)
    assert len(seeds) == 4 and seeds[2:] == ["7", "7"], printed
    ids = _event_ids(base_settings.bootstrap_servers, topic, 20)
    first, second, seeded, again = (ids[i : i + 5] for i in range(0, 20, 5))
    assert len(set(first + second)) == 10  # two runs without a seed: ten different events
    assert seeded == again and not set(seeded) & set(first + second)
