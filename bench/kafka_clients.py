"""What a step pays for asking Kafka about its topic: the plan step, `status`, the overview page and
`verify` each ask for the partitions' offsets, the topic's ID and its retention. Timed through one
client for the three (as they ask) against a new client for each question (the connection set-up
each time: TCP, with SASL_SSL the TLS handshake and the SCRAM exchange), on the plaintext listener
and the SASL_SSL one of a local broker; median of `--rounds`, the two alternated.

    ./kafka2pg python bench/kafka_clients.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kafka2pg.devtools import local_stack
from kafka2pg.exceptions import KafkaUnavailableError, TopicNotFoundError
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.kafka_offsets import TopicAdmin, ensure_topic

TOPIC = "bench_kafka_clients"


def one_client(kafka) -> None:
    topic = TopicAdmin(kafka, TOPIC)
    topic.offsets(), topic.topic_id(), topic.retention()


def a_client_per_question(kafka) -> None:
    TopicAdmin(kafka, TOPIC).offsets(), TopicAdmin(kafka, TOPIC).topic_id(), TopicAdmin(kafka, TOPIC).retention()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-kafka-clients-"))
    stack = local_stack.start_stack(work, secured=True)
    try:
        ensure_topic(stack.kafka.bootstrap_servers, TOPIC, 6)
        deadline = time.monotonic() + 60
        while True:  # the new topic's partitions have their leaders
            try:
                one_client(stack.kafka.bootstrap_servers)
                break
            except (KafkaUnavailableError, TopicNotFoundError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        ways = {
            "PLAINTEXT": stack.kafka.bootstrap_servers,
            "SASL_SSL (SCRAM-SHA-512)": KafkaConfig.of(stack.kafka.secured_listener().client_config("scram")),
        }
        for name, kafka in ways.items():
            times: dict[str, list[float]] = {"one": [], "each": []}
            one_client(kafka), a_client_per_question(kafka)  # warm-up
            for _ in range(args.rounds):
                for label, ask in (("one", one_client), ("each", a_client_per_question)):
                    started = time.perf_counter()
                    ask(kafka)
                    times[label].append(time.perf_counter() - started)
            one, each = statistics.median(times["one"]), statistics.median(times["each"])
            print(
                f"{name}: one client {one * 1000:.0f} ms, a client per question {each * 1000:.0f} ms "
                f"(x{each / one:.2f})"
            )
    finally:
        local_stack.discard_stack(stack)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
