"""What the commands print of a batch: a record's bytes quoted in a reason cannot move the
terminal's cursor or colour it; a batch without quarantined rows says why, by its state; a
STUCK batch's advice is said once."""

from kafka2pg.config import Column, Pipeline
from kafka2pg.lifecycle import BatchState
from kafka2pg.report import _none_quarantined, _printable


def test_control_characters_in_a_reason_are_escaped_and_the_rest_kept():
    reason = "field 'note': 'a\nb\x1b[31mred\x00' é 😀\t"
    assert _printable(reason) == "field 'note': 'a\\nb\\x1b[31mred\\x00' é 😀\\t"


def test_a_batch_without_quarantined_rows_says_why_by_its_state():
    pipeline = Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),))
    said = {state: _none_quarantined(pipeline, state) for state in BatchState}
    assert said.pop(BatchState.PROMOTED) == ""  # promoted with nothing to quarantine: nothing to add
    assert all(said.values()), [s for s, text in said.items() if not text]
    assert "staging table" not in said[BatchState.UNDONE] + said[BatchState.VERIFIED] + said[BatchState.ABANDONED]
    assert "kafka2pg.stg_orders" in said[BatchState.VALIDATED] and "staging table, kafka2pg.stg_orders" in (
        _none_quarantined(pipeline, None)
    )


def test_a_stuck_batch_gives_the_errors_own_advice_once():
    from datetime import UTC, datetime

    from kafka2pg.stuck import StuckBatch

    def described(error: str) -> str:
        since = datetime(2026, 1, 2, tzinfo=UTC)
        return StuckBatch("orders", 7, "validated", "promote", 2, since, error, "p0[0,10)").describe()

    advised = described("PostgreSQL refused 3 rows. Fix the table, then trigger a run: it resumes the batch.")
    assert advised.endswith("it resumes the batch. See docs/operations.md (STUCK batches).")
    assert advised.count("trigger a run") == 1 and ".." not in advised
    plain = described("KafkaUnavailableError: no broker answered")
    assert plain.endswith(
        "no broker answered. Fix the cause and trigger a run (it resumes the batch), or see docs/operations.md "
        "(STUCK batches)."
    )
