"""What `kafka2pg quarantine` prints: a record's bytes quoted in a reason cannot move the
terminal's cursor or colour it; a batch without quarantined rows says why, by its state."""

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
