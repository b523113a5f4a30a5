"""The CLI as a user meets it: `produce` makes new sample events each time unless a seed repeats
a run's; no Airflow chatter; `status` shows every pipeline it can when one is broken."""

import json
import os
import re
import subprocess
import sys
import uuid

import yaml
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


def test_a_command_prints_no_airflow_info_lines_unless_verbose(base_settings):
    env = {
        **os.environ,
        "KAFKA2PG_BOOTSTRAP_SERVERS": base_settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": base_settings.database_url,
    }
    topic = f"quiet-{uuid.uuid4().hex[:8]}"
    for verbose in ([], ["-v"]):
        done = subprocess.run(
            [sys.executable, "-m", "kafka2pg", *verbose, "produce", "--topic", topic, "--count", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert ("INFO airflow." in done.stderr) is bool(verbose), done.stderr


def test_status_shows_every_pipeline_it_can_when_one_is_broken_and_exits_2(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=1)
    spec = yaml.safe_load(env.settings.pipelines_file.read_text())
    suffix = uuid.uuid4().hex[:8]
    broken = {
        **spec["pipelines"][0],
        "name": f"{env.pipeline.name}_b",
        "topic": f"absent-{suffix}",
        "target_table": f"public.absent_{suffix}",
    }
    spec["pipelines"].append(broken)
    env.settings.pipelines_file.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()

    assert cli.main(["status", "--json"]) == 2
    shown = capsys.readouterr()
    good, bad = json.loads(shown.out)
    assert good["pipeline"] == env.pipeline.name and "partitions" in good
    assert bad["pipeline"] == broken["name"] and bad["error"].startswith("TopicNotFoundError: topic 'absent-")

    assert cli.main(["status"]) == 2
    shown = capsys.readouterr()
    assert f"pipeline {env.pipeline.name}: topic {env.topic}" in shown.out
    assert f"pipeline {broken['name']}: error: TopicNotFoundError" in shown.err
