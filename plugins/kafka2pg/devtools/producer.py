"""Sample events for demos, tests and benchmarks, written by an idempotent producer.

Each event has an event id (the business key), a customer, an amount, a timestamp and a payload.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta

from confluent_kafka import KafkaException, Producer

from kafka2pg.exceptions import KafkaUnavailableError
from kafka2pg.kafka_config import KafkaLike, scrubbed
from kafka2pg.kafka_offsets import client_config

_PRODUCTS = ("book", "lamp", "chair", "kettle", "bike", "tent", "guitar", "scarf")


def sample_events(count: int, *, seed: int = 0, start: datetime | None = None) -> Iterator[dict]:
    """`count` deterministic, realistic order events (same seed -> same events)."""
    rng = random.Random(seed)
    start = start or datetime(2026, 1, 1, tzinfo=UTC)
    for index in range(count):
        yield {
            "event_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "customer_id": rng.randint(1, 5000),
            "amount": round(rng.uniform(1, 500), 2),
            "currency": rng.choice(("EUR", "USD", "GBP")),
            "ts": (start + timedelta(milliseconds=index * 37)).isoformat(),
            "payload": {"product": rng.choice(_PRODUCTS), "quantity": rng.randint(1, 5), "seq": index},
        }


def produce(
    kafka: KafkaLike,
    topic: str,
    values: Iterable[dict | bytes | str | None],
    *,
    key_field: str | None = "customer_id",
    timestamp_field: str | None = None,
    timeout_s: float = 30.0,
) -> int:
    """Write each value (a dict is JSON-encoded) with an idempotent producer; return the count.

    `timestamp_field`: a dict value's ISO-8601 field used as the Kafka record timestamp
    (otherwise the broker-facing CreateTime is now).
    """
    producer = Producer(
        {
            **client_config(kafka, timeout_s),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
        }
    )
    errors: list[str] = []

    def on_delivery(err, _msg) -> None:
        if err is not None:
            errors.append(str(err))

    count = 0
    for value in values:
        key = str(value[key_field]).encode() if isinstance(value, dict) and key_field else None
        payload = json.dumps(value).encode() if isinstance(value, dict) else value
        if isinstance(payload, str):
            payload = payload.encode()
        while True:
            try:
                extra = {}
                if timestamp_field and isinstance(value, dict):
                    extra["timestamp"] = int(datetime.fromisoformat(value[timestamp_field]).timestamp() * 1000)
                producer.produce(topic, value=payload, key=key, on_delivery=on_delivery, **extra)
                break
            except BufferError:
                producer.poll(0.1)
        count += 1
        if count % 10_000 == 0:
            producer.poll(0)
    remaining = producer.flush(timeout_s)
    if remaining or errors:
        raise KafkaUnavailableError(
            f"producing to {topic!r} on Kafka at {kafka}: {remaining} undelivered, "
            f"errors: {scrubbed(kafka, str(sorted(set(errors))[:3]))}",
            cluster=str(kafka),
            topic=topic,
        )
    return count


def produce_sample(kafka: KafkaLike, topic: str, count: int, *, seed: int = 0) -> int:
    try:
        return produce(kafka, topic, sample_events(count, seed=seed))
    except KafkaException as exc:
        raise KafkaUnavailableError(
            f"producing to {topic!r} on Kafka at {kafka}: {scrubbed(kafka, str(exc))}", cluster=str(kafka), topic=topic
        ) from exc
