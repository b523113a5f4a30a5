"""Errors carry their evidence as fields and build their messages from them; only transient
failures (a service away, a range lock held, a stopped Spark job) are retryable."""

import inspect

import pytest

from kafka2pg import exceptions
from kafka2pg.exceptions import (
    BatchStateError,
    ConsumerGroupRefusedError,
    DatabaseUnavailableError,
    Kafka2PgError,
    KafkaAuthenticationError,
    KafkaUnavailableError,
    OffsetRegressionError,
    QualityGateFailed,
    RangeLockedError,
    ReplayRefusedError,
    RetentionLossError,
    ServiceUnavailableError,
    SparkSessionLost,
    SparkUnavailableError,
    StageInterrupted,
    StatementTimeoutError,
    WitnessMismatchError,
)

# (error, its evidence exactly, what its message must say)
BUILT = {
    "spark session lost": (
        SparkSessionLost.staging("orders", 7),
        {"pipeline": "orders", "batch_id": 7, "state": "planned"},
        ["pipeline 'orders' batch 7: Spark's JVM stopped answering", "stays planned", "run the stage step again"],
    ),
    "spark-submit killed": (
        SparkSessionLost.submit_killed("orders", "SIGKILL"),
        {"pipeline": "orders", "signal": "SIGKILL"},
        ["pipeline 'orders': the stage job's spark-submit (Spark's JVM) was killed (SIGKILL", "stays planned", "retry"],
    ),
    "spark-submit crashed": (
        SparkSessionLost.submit_killed("orders", "SIGSEGV"),
        {"pipeline": "orders", "signal": "SIGSEGV"},
        ["spark-submit (Spark's JVM) was ended by SIGSEGV;"],
    ),
    "group refused": (
        ConsumerGroupRefusedError.refused("lag", "orders", "orders[0]: UNKNOWN_MEMBER_ID"),
        {"group": "lag", "topic": "orders", "detail": "orders[0]: UNKNOWN_MEMBER_ID"},
        [
            "Kafka refused to set consumer group lag's offsets on orders: orders[0]: UNKNOWN_MEMBER_ID",
            "no active member",
            "Read on the group and on the topic",
        ],
    ),
    "no_answer": (
        KafkaUnavailableError.no_answer("broker1:9092", 3, "while listing offsets", topic="orders", partition=2),
        {
            "cluster": "broker1:9092",
            "timeout_s": 3,
            "cause": "while listing offsets",
            "topic": "orders",
            "partition": 2,
        },
        ["Kafka at broker1:9092 did not answer within 3s (while listing offsets)", "Check that the brokers run"],
    ),
    "no_answer, topic unknown": (
        KafkaUnavailableError.no_answer("broker1:9092", 10, "KafkaError{...}"),
        {"cluster": "broker1:9092", "timeout_s": 10, "cause": "KafkaError{...}"},
        ["Kafka at broker1:9092 did not answer within 10s"],
    ),
    "refused": (
        KafkaAuthenticationError.refused(
            "b:9093 (SASL_SSL, SCRAM-SHA-512)", "refused the client's credentials", "SASL authentication error"
        ),
        {
            "cluster": "b:9093 (SASL_SSL, SCRAM-SHA-512)",
            "refusal": "refused the client's credentials",
            "cause": "SASL authentication error",
        },
        [
            "Kafka at b:9093 (SASL_SSL, SCRAM-SHA-512) refused the client's credentials: SASL authentication error",
            "Retrying will not help",
        ],
    ),
    "expired": (
        RetentionLossError.expired("orders", "orders-topic", 1, 10, 40),
        {"pipeline": "orders", "topic": "orders-topic", "partition": 1, "offsets": (10, 40)},
        ["pipeline 'orders', topic 'orders-topic', partition 1: offsets [10, 40) (30 records)", "on_retention_loss"],
    ),
    "beyond_high_watermark": (
        OffsetRegressionError.beyond_high_watermark("orders", "orders-topic", 0, 50, 10),
        {"pipeline": "orders", "topic": "orders-topic", "partition": 0, "head": 50, "high_watermark": 10},
        [
            "partition 0: the ledger head 50 is beyond the high watermark 10",
            "`./kafka2pg reset --pipeline orders --partition 0 --to-offset <offset>` then, if its preview is right, "
            "the same with `--confirm`.",
        ],
    ),
    "partitions_gone": (
        OffsetRegressionError.partitions_gone("orders", "orders-topic", [2, 3]),
        {"pipeline": "orders", "topic": "orders-topic", "partitions": [2, 3]},
        [
            "heads for partition(s) [2, 3] that the topic no longer has",
            "`./kafka2pg reset --pipeline orders --partition <p> --drop` then, if its preview is right, the same "
            "with `--confirm`.",
        ],
    ),
    "held": (
        RangeLockedError.held("orders", 4, "replay batch 7", 300, "backend pid 42, application 'kafka2pg'"),
        {
            "pipeline": "orders",
            "partition": 4,
            "purpose": "replay batch 7",
            "waited_s": 300,
            "holder": "backend pid 42, application 'kafka2pg'",
        },
        ["replay batch 7 waited 300s for partition 4", "(backend pid 42, application 'kafka2pg')", "Retry"],
    ),
    "held, holder unknown": (
        RangeLockedError.held("orders", 4, "undo of batch 3", 300, None),
        {"pipeline": "orders", "partition": 4, "purpose": "undo of batch 3", "waited_s": 300},
        ["undo of batch 3 waited 300s for partition 4, which another promotion, replay or undo still holds;"],
    ),
    "range_refused": (
        ReplayRefusedError.range_refused("orders", 0, (5, 90), "the range reaches beyond the live head 80", head=80),
        {"pipeline": "orders", "partition": 0, "offsets": (5, 90), "head": 80},
        ["pipeline 'orders' partition 0 [5, 90): the range reaches beyond the live head 80"],
    ),
    "range_refused, finishing": (
        ReplayRefusedError.range_refused(
            "orders", 1, (0, 10), "batch 9, newer than this replay, ...", batch_id=7, head=10, newer_batch_id=9
        ),
        {"pipeline": "orders", "batch_id": 7, "partition": 1, "offsets": (0, 10), "head": 10, "newer_batch_id": 9},
        ["pipeline 'orders' replay batch 7: partition 1 [0, 10): batch 9, newer", "Nothing was changed"],
    ),
    "other_pipeline": (
        BatchStateError.other_pipeline("orders", 12, "payments"),
        {"pipeline": "orders", "batch_id": 12, "owner": "payments"},
        ["batch 12 belongs to pipeline 'payments', not 'orders'"],
    ),
    "rejected": (
        QualityGateFailed.rejected(
            "orders", 5, {"provenance_unique": "2 provenance duplicates", "gx:x": "1 unexpected"}, "/r/5.html", "stg_o"
        ),
        {
            "pipeline": "orders",
            "batch_id": 5,
            "state": "rejected",
            "failed": {"provenance_unique": "2 provenance duplicates", "gx:x": "1 unexpected"},
            "report": "/r/5.html",
        },
        [
            "pipeline 'orders' batch 5 rejected, nothing promoted",
            "provenance_unique: 2 provenance duplicates; gx:x: 1 unexpected",
            "Report: /r/5.html.",
            "kafka2pg.stg_o",
        ],
    ),
    "rejected, report not written": (
        QualityGateFailed.rejected("orders", 5, {"provenance_unique": "2 provenance duplicates"}, None, "stg_o"),
        {
            "pipeline": "orders",
            "batch_id": 5,
            "state": "rejected",
            "failed": {"provenance_unique": "2 provenance duplicates"},
        },
        ["pipeline 'orders' batch 5 rejected", "Report: not written (see the task log)."],
    ),
    "restaged": (
        WitnessMismatchError.restaged(
            "orders",
            5,
            "staged",
            3,
            {0: 7},
            "asked while it was planned at claim epoch 3 with records read {0: 7}",
            [0],
        ),
        {
            "pipeline": "orders",
            "batch_id": 5,
            "state": "staged",
            "epoch": 3,
            "reads": {0: 7},
            "witnessed": "asked while it was planned at claim epoch 3 with records read {0: 7}",
            "unwitnessed": [0],
        },
        [
            "(asked while it was planned at claim epoch 3 with records read {0: 7}) do not match the batch as it is "
            "now, staged at claim epoch 3 with records read {0: 7}",
            "partitions [0] have a gap no witness counted",
            "Nothing was decided or changed",
        ],
    ),
}


@pytest.mark.parametrize("name", BUILT)
def test_a_built_error_holds_exactly_its_evidence_and_says_it(name):
    error, evidence, said = BUILT[name]
    assert error.evidence == evidence
    assert all(getattr(error, field) == value for field, value in evidence.items())
    message = str(error)
    assert [s for s in said if s not in message] == []


def test_evidence_not_given_reads_as_none():
    error = KafkaUnavailableError.no_answer("broker1:9092", 3, "timeout")
    assert (error.topic, error.partition, error.pipeline, error.batch_id, error.offsets) == (None,) * 5
    assert "topic" not in error.evidence


RETRYABLE = {
    ServiceUnavailableError,
    KafkaUnavailableError,
    DatabaseUnavailableError,
    SparkUnavailableError,
    RangeLockedError,
    StageInterrupted,
    SparkSessionLost,  # a JVM killed or crashed: the next attempt starts its own
    WitnessMismatchError,  # the next attempt asks Kafka again about the batch as staged then
    StatementTimeoutError,  # a statement cancelled on a busy server may pass on a quieter one
}
ERRORS = [c for _, c in inspect.getmembers(exceptions, inspect.isclass) if issubclass(c, Kafka2PgError)]


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__name__)
def test_only_transient_errors_are_retryable(error):
    assert error.terminal is (error not in RETRYABLE)


def test_a_head_a_reset_moved_is_not_blamed_on_a_batch_named_none():
    from kafka2pg.exceptions import LedgerConflictError

    by_batch = str(LedgerConflictError.head_moved("orders", 7, 0, 100, 150, 6))
    assert "has head 150 (moved by batch 6). Another run promoted these offsets first" in by_batch
    by_reset = str(LedgerConflictError.head_moved("orders", 7, 0, 100, 0, None))
    assert "has head 0 (moved by a ledger reset). The ledger moved since" in by_reset and "None" not in by_reset


def test_a_secret_holding_another_is_hidden_whole_and_an_empty_one_hides_nothing():
    """Secrets are replaced longest first: the shorter one inside a longer one (a password's piece,
    a PEM line of a key) replaced first would leave the rest of the longer one on show."""
    text = "login refused for 'svc:Tr0ub4dor&3' (password Tr0ub4dor&3)"
    hidden = exceptions.without_secrets(text, ["Tr0ub", "svc:Tr0ub4dor&3", "Tr0ub4dor&3", ""])
    assert hidden == "login refused for '***' (password ***)"
    assert exceptions.without_secrets("nothing to hide", ["", "absent"]) == "nothing to hide"


def test_a_suggested_change_is_its_preview_first():
    """A message names a command that changes data (reset, abandon, undo, stack reset) without
    `--confirm`: the same command with it applies the change, so one copied from an error first
    shows what it would change. No message in the package suggests a command ending in `--confirm`."""
    import re
    from pathlib import Path

    package = Path(exceptions.__file__).parent
    suggested = [
        f"{path.name}:{number}"
        for path in package.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"--confirm`(?! applies| to apply)", line) and "`--confirm`" not in line
    ]
    assert suggested == []
    gone = str(OffsetRegressionError.partitions_gone("orders", "orders-topic", [2]))
    assert "`./kafka2pg reset --pipeline orders --partition <p> --drop` then, if its preview is right" in gone
