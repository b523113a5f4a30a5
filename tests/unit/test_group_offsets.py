"""Setting a consumer group's offsets (the lag mirror): a broker's refusal is named as one, a
cluster that did not answer as unavailable, an error it answered with by its name (retryable),
a request refused as invalid as such (not retried). The refusal by a real broker (a group with an active
member) is tests/integration/test_lag_mirror.py's; these are the error codes it cannot provoke."""

from concurrent.futures import Future

import pytest
from confluent_kafka import KafkaError, KafkaException

from kafka2pg import kafka_offsets
from kafka2pg.exceptions import (
    ConsumerGroupRefusedError,
    KafkaAuthenticationError,
    KafkaRequestError,
    KafkaUnavailableError,
)


class FailingAdmin:
    def __init__(self, code: int) -> None:
        self.code = code

    def alter_consumer_group_offsets(self, requests, request_timeout):
        future: Future = Future()
        future.set_exception(KafkaException(KafkaError(self.code)))
        return {requests[0]: future}

    def why(self) -> list:
        return []


@pytest.mark.parametrize(
    ("code", "expected", "says"),
    [
        (KafkaError.GROUP_AUTHORIZATION_FAILED, ConsumerGroupRefusedError, "Kafka refused to set consumer group"),
        (KafkaError.NON_EMPTY_GROUP, ConsumerGroupRefusedError, "no active member"),
        (KafkaError._TRANSPORT, KafkaUnavailableError, "did not answer"),
        (KafkaError._TIMED_OUT, KafkaUnavailableError, "did not answer"),
        (
            KafkaError.COORDINATOR_NOT_AVAILABLE,
            KafkaUnavailableError,
            "answered with an error: COORDINATOR_NOT_AVAILABLE",
        ),
        (KafkaError.REBALANCE_IN_PROGRESS, KafkaUnavailableError, "answered with an error: REBALANCE_IN_PROGRESS"),
        (KafkaError._INVALID_ARG, KafkaRequestError, "refused as invalid or unsupported: _INVALID_ARG"),
        (KafkaError.UNSUPPORTED_VERSION, KafkaRequestError, "a broker too old for the request"),
        (KafkaError.SASL_AUTHENTICATION_FAILED, KafkaAuthenticationError, "refused the client's credentials"),
        (KafkaError._MSG_TIMED_OUT, KafkaUnavailableError, "the Kafka client failed a request"),
    ],
)
def test_a_refusal_is_named_and_a_transport_failure_is_unavailable(code, expected, says, monkeypatch):
    _commit_fails_with(FailingAdmin(code), expected, says, monkeypatch)


def _commit_fails_with(admin, expected, says, monkeypatch) -> None:
    monkeypatch.setattr(kafka_offsets, "admin_client", lambda kafka, timeout_s: admin)
    monkeypatch.setattr(kafka_offsets, "_Admin", type(admin))

    with pytest.raises(expected) as raised:
        kafka_offsets.commit_group_offsets("127.0.0.1:9092", "lag", "orders", {0: 5}, timeout_s=1)

    assert says in str(raised.value)
    assert raised.value.terminal == (expected is not KafkaUnavailableError)  # Airflow retries only those


class PartlyFailingAdmin(FailingAdmin):
    """The request succeeds; the broker's answer holds an error for the partition (as Kafka
    reports a group commit's errors)."""

    def alter_consumer_group_offsets(self, requests, request_timeout):
        from types import SimpleNamespace

        future: Future = Future()
        future.set_result(SimpleNamespace(topic_partitions=[SimpleNamespace(partition=0, error=KafkaError(self.code))]))
        return {requests[0]: future}


@pytest.mark.parametrize(
    ("code", "expected", "says"),
    [
        (KafkaError.NON_EMPTY_GROUP, ConsumerGroupRefusedError, "no active member"),
        (KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaUnavailableError, "answered with an error: setting consumer group"),
        (KafkaError.UNSUPPORTED_VERSION, KafkaRequestError, "refused as invalid or unsupported"),
        (KafkaError._TRANSPORT, KafkaUnavailableError, "did not answer"),
        (KafkaError.SASL_AUTHENTICATION_FAILED, KafkaAuthenticationError, "refused the client's credentials"),
    ],
)
def test_an_error_the_broker_reports_for_a_partition_is_named_as_the_same_error_raised_would_be(
    code, expected, says, monkeypatch
):
    _commit_fails_with(PartlyFailingAdmin(code), expected, says, monkeypatch)
