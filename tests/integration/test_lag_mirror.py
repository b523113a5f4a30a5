"""`lag_consumer_group`: after each promotion the ledger heads are committed as a Kafka consumer
group's offsets, so Kafka's own tooling (kafka-consumer-groups) shows the pipeline's lag. Best
effort: a group Kafka refuses to commit for leaves the promotion as it is."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import threading
import time

from confluent_kafka import Consumer

from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.jars import resolve_jars
from kafka2pg.steps import mirror_heads


def consumer_groups_describe(bootstrap: str, group: str) -> dict[int, tuple[int, int, int]]:
    """Per partition (current offset, log end offset, lag), as Kafka's kafka-consumer-groups prints them."""
    jars = resolve_jars()["kafka"]
    done = subprocess.run(
        [
            shutil.which("java") or "java",
            "-cp",
            f"{jars}/*",
            "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--group",
            group,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == group:
            rows[int(fields[2])] = (int(fields[3]), int(fields[4]), int(fields[5]))
    return rows


def test_heads_are_mirrored_into_the_consumer_group_kafka_tools_read(make_pipeline, run_batch, heads):
    env = make_pipeline(partitions=2, lag_consumer_group=f"kafka2pg-lag-{time.monotonic_ns()}")
    group = env.pipeline.lag_consumer_group
    produce(env.settings.bootstrap_servers, env.topic, sample_events(20, seed=91))
    assert run_batch(env).promoted == 20
    described = consumer_groups_describe(env.settings.bootstrap_servers, group)
    assert {p: current for p, (current, _, _) in described.items()} == heads(env)
    assert all(lag == 0 for _, _, lag in described.values()), described

    produce(env.settings.bootstrap_servers, env.topic, sample_events(7, seed=92))
    described = consumer_groups_describe(env.settings.bootstrap_servers, group)
    assert sum(lag for _, _, lag in described.values()) == 7, described  # Kafka's tool sees what is not loaded
    assert run_batch(env).promoted == 7
    described = consumer_groups_describe(env.settings.bootstrap_servers, group)
    assert {p: current for p, (current, _, _) in described.items()} == heads(env)
    assert sum(heads(env).values()) == 27 and all(lag == 0 for _, _, lag in described.values())


def test_a_group_kafka_refuses_to_commit_for_leaves_the_promotion_standing(make_pipeline, run_batch, heads, caplog):
    env = make_pipeline(partitions=1, lag_consumer_group=f"kafka2pg-lag-busy-{time.monotonic_ns()}")
    # Another application is an active member of that group: Kafka refuses a commit from outside it.
    member = Consumer(
        {
            "bootstrap.servers": env.settings.bootstrap_servers,
            "group.id": env.pipeline.lag_consumer_group,
            "enable.auto.commit": False,
        }
    )
    member.subscribe([env.topic])
    deadline = time.monotonic() + 120
    while not member.assignment():
        assert time.monotonic() < deadline, "the member never joined its group"
        member.poll(0.5)
    try:
        produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=93))
        with caplog.at_level(logging.WARNING, logger="kafka2pg.steps"):
            assert run_batch(env).promoted == 5
        assert heads(env) == {0: 5}
        assert "heads not mirrored into consumer group" in caplog.text and "the promotion stands" in caplog.text
        # Kafka answered, and said no: a refusal naming why, not "did not answer".
        assert "ConsumerGroupRefusedError: Kafka refused to set consumer group" in caplog.text, caplog.text
        assert "did not answer" not in caplog.text
    finally:
        member.close()


def test_an_unreachable_kafka_costs_the_mirror_its_client_timeout_not_the_promotion(make_pipeline, run_batch, caplog):
    env = make_pipeline(partitions=1, lag_consumer_group=f"kafka2pg-lag-dead-{time.monotonic_ns()}")
    produce(env.settings.bootstrap_servers, env.topic, sample_events(3, seed=94))
    assert run_batch(env).promoted == 3
    dead = dataclasses.replace(env.settings, kafka="127.0.0.1:9", kafka_timeout_s=2)
    mirror = threading.Thread(target=mirror_heads, args=(dead, env.pipeline), daemon=True)
    with caplog.at_level(logging.WARNING, logger="kafka2pg.steps"):
        mirror.start()
        mirror.join(timeout=30)  # a deadline for a hang, 15 times the 2 s client timeout (a consumer commit: 45 s)
    assert not mirror.is_alive(), "the mirror waited for Kafka without end"
    assert "heads not mirrored into consumer group" in caplog.text and "KafkaUnavailableError" in caplog.text
