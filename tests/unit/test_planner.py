"""The offset arithmetic: ranges, caps, fair sharing, retention loss and regressions."""

import pytest

from kafka2pg.exceptions import OffsetRegressionError, RetentionLossError
from kafka2pg.planner import BatchPlan, OffsetRange, PartitionState, plan_batch


def state(p, head, low=0, stable=100, high=None):
    return PartitionState(p, head, low, stable, stable if high is None else high)


def plan(states, budget=1000, **kw):
    return plan_batch("pipe", "topic", states, max_records_per_batch=budget, **kw)


def test_new_partitions_start_at_low_watermark_and_read_to_last_stable_offset():
    result = plan([state(0, None, low=5, stable=50), state(1, None, low=0, stable=7)])
    assert [(r.partition, r.start, r.end) for r in result.ranges] == [(0, 5, 50), (1, 0, 7)]
    assert [p.expected_head for p in result.partitions] == [None, None]


def test_nothing_new_is_an_empty_plan():
    assert plan([state(0, 100), state(1, None, low=0, stable=0)]).is_empty


def test_budget_is_shared_fairly_and_leftovers_go_to_busier_partitions():
    result = plan([state(0, 0, stable=1000), state(1, 0, stable=10), state(2, 0, stable=1000)], budget=100)
    sizes = {r.partition: r.size for r in result.ranges}
    assert sizes[1] == 10
    assert abs(sizes[0] - sizes[2]) <= 1
    assert result.record_budget == 100


def test_per_partition_cap():
    result = plan([state(0, 0, stable=1000), state(1, 0, stable=1000)], budget=1000, max_records_per_partition=30)
    assert {r.partition: r.size for r in result.ranges} == {0: 30, 1: 30}


def test_consecutive_plans_are_contiguous():
    heads = {0: 0, 1: 0}
    seen = []
    for _ in range(5):
        result = plan([state(p, h, stable=57) for p, h in heads.items()], budget=25)
        for r in result.ranges:
            assert r.start == heads[r.partition]
            heads[r.partition] = r.end
            seen.append(r)
    assert heads == {0: 57, 1: 57}
    assert sum(r.size for r in seen) == 114


def test_head_below_low_watermark_fails_with_the_lost_offsets():
    with pytest.raises(RetentionLossError, match=r"partition 0: offsets \[10, 40\) \(30 records\)"):
        plan([state(0, 10, low=40, stable=100)])


def test_retention_loss_skip_records_a_gap_and_reads_from_low():
    result = plan([state(0, 10, low=40, stable=100)], on_retention_loss="skip")
    (part,) = result.partitions
    assert (part.gap.start, part.gap.end, part.gap.kind) == (10, 40, "retention_gap")
    assert (part.range.start, part.range.end) == (40, 100)
    assert part.expected_head == 10 and part.new_head == 100


def test_head_above_high_watermark_is_an_offset_regression():
    with pytest.raises(OffsetRegressionError, match="beyond the high watermark 20"):
        plan([state(0, 50, stable=20, high=20)])


def test_open_transaction_waits_at_last_stable_offset():
    result = plan([state(0, 10, stable=10, high=15)])
    assert result.is_empty


def test_new_partition_latest_skips_existing_records_as_a_gap():
    result = plan([state(0, None, low=3, stable=9)], new_partition_start="latest")
    (part,) = result.partitions
    assert part.gap.kind == "skipped_new_partition" and (part.gap.start, part.gap.end) == (3, 9)
    assert part.range is None and part.new_head == 9


def test_plan_round_trips_through_json():
    result = plan([state(0, 10, low=40, stable=100), state(1, None, stable=5)], on_retention_loss="skip")
    assert BatchPlan.from_json(result.to_json()) == result


def test_offset_range_rejects_inverted_bounds():
    with pytest.raises(ValueError):
        OffsetRange(0, 5, 4)


def test_ledger_breaks_names_holes_overlaps_and_a_head_mismatch():
    from kafka2pg.audit import ledger_breaks

    assert ledger_breaks([(0, 10), (10, 25)], 25) == []
    assert ledger_breaks([], None) == []
    assert ledger_breaks([(0, 10), (12, 20)], 20) == ["unrecorded hole [10, 12)"]
    assert ledger_breaks([(0, 10), (8, 20)], 20) == ["ranges overlap at [8, 10)"]
    assert ledger_breaks([(0, 10)], 12) == ["ledger ends at 10 but the head is 12"]
