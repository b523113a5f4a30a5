"""The local stack's secured listeners, with plain confluent-kafka clients against the real broker:
SASL_SSL with SCRAM-SHA-512 and with PLAIN, SSL with a client certificate (mTLS); a wrong password,
an untrusted CA and a missing client certificate fail within seconds; no password reaches a log or
the printed output; a restarted broker keeps its ports, certificates and users. One secured stack,
started by `./kafka2pg stack start --secured` in a state dir of this module's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer

from kafka2pg.devtools import local_stack
from kafka2pg.devtools.secured_listeners import SecuredListener
from kafka2pg.exceptions import KafkaAuthenticationError
from kafka2pg.jars import resolve_jars
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.kafka_offsets import ensure_topic
from kafka2pg.kafka_reader import read_ranges
from kafka2pg.planner import OffsetRange

MODES = ("scram", "plain", "mtls")
EVENTS = 20
FAIL_WITHIN_S = 30


def run_cli(state_dir: Path, *args: str) -> str:
    """Run `./kafka2pg ARGS` as a process of its own on `state_dir`; its whole output, stdout and stderr."""
    env = {**os.environ, "KAFKA2PG_STATE_DIR": str(state_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "kafka2pg", *args], env=env, capture_output=True, text=True, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


@dataclass
class SecuredStack:
    state_dir: Path
    stack: local_stack.Stack
    listener: SecuredListener
    outputs: list[str]  # everything the CLI printed

    def cli(self, *args: str) -> str:
        output = run_cli(self.state_dir, *args)
        self.outputs.append(output)
        return output


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[SecuredStack]:
    state_dir = tmp_path_factory.mktemp("secured-state")
    jars = Path(os.environ.get("KAFKA2PG_STATE_DIR", local_stack.DEFAULT_CACHE))
    resolve_jars(jars)
    (state_dir / "jars").symlink_to(jars / "jars")
    try:
        output = run_cli(state_dir, "stack", "start", "--secured")
        assert "started a new broker" in output and "SASL_SSL at 127.0.0.1:" in output, output
        stack = local_stack.load_stack(state_dir)
        yield SecuredStack(state_dir, stack, stack.kafka.secured_listener(), [output])
    finally:
        local_stack.reset_stack(state_dir)


def new_topic(secured: SecuredStack) -> str:
    topic = f"secured-{uuid.uuid4().hex[:10]}"
    ensure_topic(secured.stack.kafka.bootstrap_servers, topic, 1)  # made on the plain listener
    return topic


def round_trip(config: dict[str, str], topic: str) -> None:
    """Produce EVENTS values with `config`, then read them back, in order, with `config`."""
    producer = Producer(config)
    sent = [f"event-{n}".encode() for n in range(EVENTS)]
    for value in sent:
        producer.produce(topic, value=value)
    assert producer.flush(30) == 0, f"{len(producer)} records not delivered within 30 s"
    consumer = Consumer({**config, "group.id": topic, "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    received, deadline = [], time.monotonic() + 30
    try:
        while len(received) < EVENTS and time.monotonic() < deadline:
            message = consumer.poll(1)
            if message is None:
                continue
            assert message.error() is None, message.error()
            received.append(message.value())
    finally:
        consumer.close()
    assert received == sent


def first_errors(config: dict[str, str], topic: str) -> tuple[list[KafkaError], float]:
    """Try to produce one record with `config`; the client errors reported until one arrives (or
    FAIL_WITHIN_S passed), and the seconds that took. The record must not be delivered."""
    errors: list[KafkaError] = []
    delivered: list[object] = []
    producer = Producer({**config, "error_cb": errors.append, "log_level": 0})
    started = time.monotonic()
    producer.produce(topic, value=b"must not arrive", on_delivery=lambda err, msg: delivered.append(err or msg))
    while not errors and time.monotonic() - started < FAIL_WITHIN_S:
        producer.poll(0.1)
    elapsed = time.monotonic() - started
    producer.purge()
    producer.flush(5)
    assert not [d for d in delivered if not isinstance(d, KafkaError)], "a record got through"
    return errors, elapsed


@pytest.mark.parametrize("mode", MODES)
def test_produce_and_consume_through_each_secured_way_in(secured, mode):
    round_trip(secured.listener.client_config(mode), new_topic(secured))


def other_ca(directory: Path) -> Path:
    """A CA of its own, which signed nothing the broker presents."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        + ["-keyout", "other-ca.key", "-out", "other-ca.pem", "-subj", "/CN=not the stack's CA", "-days", "1"],
        cwd=directory,
        capture_output=True,
        check=True,
    )
    return directory / "other-ca.pem"


@pytest.mark.parametrize(
    ("mode", "broker_says"),
    [("scram", "invalid credentials with SASL mechanism SCRAM-SHA-512"), ("plain", "Invalid username or password")],
)
def test_a_wrong_password_fails_within_seconds(secured, mode, broker_says):
    config = {**secured.listener.client_config(mode), "sasl.password": "not-the-password"}
    errors, elapsed = first_errors(config, new_topic(secured))
    assert errors and elapsed < FAIL_WITHIN_S, f"no error within {FAIL_WITHIN_S} s"
    assert errors[0].code() == KafkaError._AUTHENTICATION, errors[0]
    assert "SASL authentication error: Authentication failed" in errors[0].str() and broker_says in errors[0].str()


@pytest.mark.parametrize("mode", MODES)
def test_a_client_trusting_another_ca_fails_within_seconds(secured, mode, tmp_path):
    config = {**secured.listener.client_config(mode), "ssl.ca.location": str(other_ca(tmp_path))}
    errors, elapsed = first_errors(config, new_topic(secured))
    assert errors and elapsed < FAIL_WITHIN_S, f"no error within {FAIL_WITHIN_S} s"
    # librdkafka reports a failed verification as an SSL error, or as a transport error when it
    # surfaces while reading the handshake: the reason is in the message either way.
    assert errors[0].code() in (KafkaError._SSL, KafkaError._TRANSPORT), errors[0]
    assert "certificate verify failed" in errors[0].str()


def test_the_mtls_listener_refuses_a_client_without_certificate(secured):
    config = secured.listener.client_config("mtls")
    del config["ssl.certificate.location"], config["ssl.key.location"]
    errors, elapsed = first_errors(config, new_topic(secured))
    assert errors and elapsed < FAIL_WITHIN_S, f"no error within {FAIL_WITHIN_S} s"
    # With TLS 1.3 the client learns of the refusal only after its handshake: a transport error then.
    assert errors[0].code() in (KafkaError._SSL, KafkaError._TRANSPORT), errors[0]
    assert "alert bad certificate" in errors[0].str()


def assert_no_password(secured: SecuredStack) -> None:
    """No password in anything the CLI printed, nor in any log file under the stack's folder (the
    broker's and PostgreSQL's logs, and the record segments of every topic, which are .log files too)."""
    passwords = [secured.listener.scram.password, secured.listener.plain.password]
    assert all(len(p) >= 20 for p in passwords)
    logs = [p for p in local_stack.stack_dir(secured.state_dir).rglob("*.log") if p.is_file()]
    assert Path(secured.stack.kafka.log_file) in logs
    for password in passwords:
        for output in secured.outputs:
            assert password not in output
        for log_file in logs:
            assert password.encode() not in log_file.read_bytes(), f"a password is in {log_file}"


def test_no_password_in_logs_or_output_and_secrets_readable_by_the_owner_only(secured):
    # A failed log-in and a status query first: what they print or log is checked too.
    first_errors({**secured.listener.client_config("scram"), "sasl.password": "wrong"}, new_topic(secured))
    assert "SASL_SSL at 127.0.0.1:" in secured.cli("stack", "status")
    assert_no_password(secured)
    directory = secured.listener.ca_pem.parent
    assert directory.stat().st_mode & 0o777 == 0o700
    for private in ("credentials.json", "ca.key", "client.key", "client-keystore.pem", "broker-keystore.pem"):
        assert (directory / private).stat().st_mode & 0o777 == 0o600, private
    assert (Path(secured.stack.kafka.data_dir) / "server.properties").stat().st_mode & 0o777 == 0o600


def test_a_restarted_broker_keeps_its_ports_certificates_and_users(secured):
    before = secured.stack.kafka
    ca_before = secured.listener.ca_pem.read_bytes()
    topic = new_topic(secured)
    round_trip(secured.listener.client_config("scram"), topic)

    os.kill(before.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while before.running():
        assert time.monotonic() < deadline, "the broker still runs 10 s after SIGKILL"
        time.sleep(0.05)
    output = secured.cli("stack", "start")

    assert f"kafka: was down (pid {before.pid}); restarted at {before.bootstrap_servers}" in output, output
    after = local_stack.load_stack(secured.state_dir).kafka
    assert (after.sasl_ssl_port, after.ssl_port) == (before.sasl_ssl_port, before.ssl_port)
    assert after.secured_listener() == secured.listener
    assert secured.listener.ca_pem.read_bytes() == ca_before
    secured.stack.kafka = after
    for mode in MODES:
        round_trip(secured.listener.client_config(mode), new_topic(secured))
    assert_no_password(secured)


@pytest.mark.parametrize("mode", MODES)
def test_the_stage_reader_reads_a_range_through_each_secured_way_in(secured, mode):
    """What a Spark task of the stage job runs (kafka2pg.kafka_reader), with the connection's properties as given."""
    config = secured.listener.client_config(mode)
    topic = new_topic(secured)
    producer = Producer(config)
    for n in range(EVENTS):
        producer.produce(topic, key=str(n).encode(), value=f"event-{n}".encode())
    assert producer.flush(30) == 0
    batches = list(read_ranges(KafkaConfig.of(config), topic, [OffsetRange(0, 5, EVENTS)], "stage-reader", 10))
    read = [(row["offset"], row["value"]) for batch in batches for row in batch.to_pylist()]
    assert read == [(n, f"event-{n}".encode()) for n in range(5, EVENTS)]


@pytest.mark.parametrize("mode", ["scram", "mtls"])
def test_a_refused_stage_reader_fails_within_seconds_naming_the_refusal(secured, mode, tmp_path):
    """A wrong password, a CA that did not sign the broker's certificate: the cluster refuses the
    client, which a Spark task must report as that at once, not as a broker that did not answer."""
    if mode == "scram":
        config = {**secured.listener.client_config(mode), "sasl.password": "not-the-password"}
    else:
        config = {**secured.listener.client_config(mode), "ssl.ca.location": str(other_ca(tmp_path))}
    started = time.monotonic()
    with pytest.raises(KafkaAuthenticationError) as refused:
        list(read_ranges(KafkaConfig.of(config), new_topic(secured), [OffsetRange(0, 0, 1)], "stage-reader", 120))
    assert time.monotonic() - started < FAIL_WITHIN_S
    assert "Retrying will not help" in str(refused.value)
    assert "not-the-password" not in str(refused.value)


def test_the_stage_reader_closes_a_batch_at_its_byte_bound(secured):
    """Large records: a batch holds as many as fit the bound (Arrow's binary column holds 2 GiB at most)."""
    config = secured.listener.client_config("scram")
    topic = new_topic(secured)
    producer = Producer(config)
    for n in range(EVENTS):
        producer.produce(topic, value=bytes([n]) * 1000)
    assert producer.flush(30) == 0
    kafka = KafkaConfig.of(config)
    batches = list(read_ranges(kafka, topic, [OffsetRange(0, 0, EVENTS)], "stage-reader", 10, bytes_per_batch=3000))
    assert [b.num_rows for b in batches] == [3] * (EVENTS // 3) + [EVENTS % 3]
    assert [v for b in batches for v in b.column("value").to_pylist()] == [bytes([n]) * 1000 for n in range(EVENTS)]
