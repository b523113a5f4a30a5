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
    with pytest.raises(RetentionLossError) as lost:
        plan([state(0, 10, low=40, stable=100)])
    assert (lost.value.pipeline, lost.value.topic, lost.value.partition) == ("pipe", "topic", 0)
    assert lost.value.offsets == (10, 40)


def test_retention_loss_skip_records_a_gap_and_reads_from_low():
    result = plan([state(0, 10, low=40, stable=100)], on_retention_loss="skip")
    (part,) = result.partitions
    assert (part.gap.start, part.gap.end, part.gap.kind) == (10, 40, "retention_gap")
    assert (part.range.start, part.range.end) == (40, 100)
    assert part.expected_head == 10 and part.new_head == 100


def test_head_above_high_watermark_is_an_offset_regression():
    with pytest.raises(OffsetRegressionError) as regressed:
        plan([state(0, 50, stable=20, high=20)])
    assert (regressed.value.partition, regressed.value.head, regressed.value.high_watermark) == (0, 50, 20)


def test_open_transaction_waits_at_last_stable_offset():
    result = plan([state(0, 10, stable=10, high=15)])
    assert result.is_empty


def test_new_partition_latest_skips_existing_records_as_a_gap():
    result = plan([state(0, None, low=3, stable=9)], new_partition_start="latest")
    (part,) = result.partitions
    assert part.gap.kind == "skipped_new_partition" and (part.gap.start, part.gap.end) == (3, 9)
    assert part.range is None and part.new_head == 9


def test_a_headless_partition_an_abandoned_batch_planned_is_planned_from_where_it_started():
    """The batch abandoned before it read the partition (never loaded: no head) had planned it
    from an offset: retention since is a loss as below a head."""
    from dataclasses import replace

    def headless(planned_from, **kw):
        return replace(state(0, None, **kw), planned_from=planned_from)

    with pytest.raises(RetentionLossError) as lost:
        plan([headless(0, low=50, stable=300)])
    assert lost.value.offsets == (0, 50)
    (part,) = plan([headless(0, low=50, stable=300)], on_retention_loss="skip").partitions
    assert (part.gap.start, part.gap.end, part.gap.kind) == (0, 50, "retention_gap")
    assert (part.range.start, part.range.end, part.expected_head) == (50, 300, None)
    # Still held (or a topic recreated where no ID tells): planned as any partition without a head.
    (part,) = plan([headless(3, low=3, stable=40)]).partitions
    assert part.gap is None and (part.range.start, part.range.end) == (3, 40)
    (part,) = plan([headless(90, low=0, stable=40)]).partitions
    assert part.gap is None and (part.range.start, part.range.end) == (0, 40)


def test_plan_round_trips_through_json():
    result = plan([state(0, 10, low=40, stable=100), state(1, None, stable=5)], on_retention_loss="skip")
    assert BatchPlan.from_json(result.to_json()) == result
    identified = BatchPlan(result.pipeline, result.topic, result.partitions, "6pykna1_Q0mG5Yh8ZNhvvQ")
    assert BatchPlan.from_json(identified.to_json()) == identified
    older = result.to_json()
    del older["topic_id"]  # a plan recorded before kafka2pg recorded topic IDs
    assert BatchPlan.from_json(older).topic_id is None


def test_only_two_known_topic_ids_that_differ_make_a_plan_another_topics():
    result = plan([state(0, 10, low=0, stable=100)])
    identified = BatchPlan(result.pipeline, result.topic, result.partitions, "6pykna1_Q0mG5Yh8ZNhvvQ")
    assert identified.in_another_topic("Nw8aU4bDQ1yJz2h3sLk0Pg")
    assert not identified.in_another_topic("6pykna1_Q0mG5Yh8ZNhvvQ")
    assert not identified.in_another_topic(None)  # the cluster gives no ID (now)
    assert not result.in_another_topic("Nw8aU4bDQ1yJz2h3sLk0Pg")  # planned before IDs were recorded


def test_offset_range_rejects_inverted_bounds():
    with pytest.raises(ValueError):
        OffsetRange(0, 5, 4)


def test_ledger_breaks_names_holes_overlaps_and_a_head_mismatch():
    from kafka2pg.planner import ledger_breaks

    assert ledger_breaks([(0, 10), (10, 25)], 25) == []
    assert ledger_breaks([], None) == []
    assert ledger_breaks([(0, 10), (12, 20)], 20) == ["unrecorded hole [10, 12)"]
    assert ledger_breaks([(0, 10), (8, 20)], 20) == ["ranges overlap at [8, 10)"]
    assert ledger_breaks([(0, 10)], 12) == ["ledger ends at 10 but the head is 12"]
    assert ledger_breaks([], 0, start=0) == [], "just reset, nothing consumed since"
    assert ledger_breaks([(3, 10)], 10, start=0) == ["ledger restarts at 3 but the partition was reset to 0"]


def test_a_partition_the_topic_no_longer_has_is_an_offset_regression():
    with pytest.raises(OffsetRegressionError) as regressed:
        plan([state(0, 10), state(1, 10)], ledger_partitions=(0, 1, 2))
    assert regressed.value.partitions == [2] and regressed.value.partition is None


def test_gap_accounting_explains_aborted_markers_and_compaction_and_flags_what_does_not_add_up():
    from kafka2pg.planner import account_gap

    rng = OffsetRange(0, 0, 78)
    dense = account_gap(OffsetRange(0, 5, 15), 10, None, None, compacted_topic=False)
    assert (dense.gap, dense.aborted, dense.markers, dense.problem) == (0, 0, 0, None)
    tx = account_gap(rng, 55, committed=55, data_records=75, compacted_topic=False)
    assert (tx.aborted, tx.markers, tx.compacted, tx.problem) == (20, 3, 0, None)
    compacted = account_gap(rng, 40, committed=40, data_records=40, compacted_topic=True)
    assert (compacted.aborted, compacted.markers, compacted.compacted) == (0, 0, 38)
    lost = account_gap(rng, 50, committed=55, data_records=75, compacted_topic=False)
    assert lost.problem == "partition 0 [0, 78): Spark read 50 records but a read_committed consumer finds 55"
    with pytest.raises(ValueError, match="needs the witness counts"):
        account_gap(rng, 50, None, None, compacted_topic=False)


def test_loss_horizon_estimates_time_left_from_the_oldest_unread_record():
    from kafka2pg.planner import loss_horizon

    hour = 3_600_000
    behind = loss_horizon(state(0, 40, low=10, stable=100), head_timestamp_ms=0, now_ms=hour, retention_ms=3 * hour)
    assert (behind.unread, behind.records_margin, behind.seconds_left) == (60, 30, 7200)
    assert behind.at_risk(warning_hours=3) and not behind.at_risk(warning_hours=1)
    caught_up = loss_horizon(state(0, 100, stable=100), head_timestamp_ms=None, now_ms=hour, retention_ms=hour)
    assert (caught_up.unread, caught_up.seconds_left, caught_up.at_risk(24)) == (0, None, False)
    no_limit = loss_horizon(state(0, None, low=5, stable=100), head_timestamp_ms=0, now_ms=hour, retention_ms=None)
    assert (no_limit.unread, no_limit.records_margin, no_limit.seconds_left) == (95, 0, None)
    # Kafka's -1, "no timestamp", is not an instant of 1969: the time is unknown, not overdue
    unstamped = loss_horizon(state(0, 40, low=10, stable=100), head_timestamp_ms=-1, now_ms=hour, retention_ms=hour)
    assert (unstamped.seconds_left, unstamped.unstamped, unstamped.at_risk(24)) == (None, True, False)
    assert not loss_horizon(state(0, 40, stable=100), head_timestamp_ms=-1, now_ms=hour, retention_ms=None).unstamped


def simulate(backlogs, budget):
    """Plan batches until the backlogs are read, as the ledger would see them: after each batch,
    the heads it read move to its ends, stamped with its batch id. Returns each batch's records
    per partition and the final heads."""
    heads = {p: 0 for p in backlogs}
    moved = {p: None for p in backlogs}
    batches = []
    while len(batches) <= sum(backlogs.values()):
        states = [PartitionState(p, heads[p], 0, n, n, moved[p]) for p, n in backlogs.items()]
        result = plan(states, budget=budget)
        if result.is_empty:
            break
        for r in result.ranges:
            assert r.start == heads[r.partition]
            heads[r.partition], moved[r.partition] = r.end, len(batches) + 1
        batches.append({r.partition: r.size for r in result.ranges})
    return batches, heads


@pytest.mark.parametrize(
    ("backlogs", "budget"),
    [
        ({0: 40, 1: 40, 2: 40}, 1),
        ({p: 30 for p in range(5)}, 2),
        ({0: 200, 1: 3, 2: 50, 3: 1, 4: 120}, 2),
        ({0: 500, 1: 7, 2: 90}, 1),
        ({p: 25 + 10 * p for p in range(7)}, 3),
    ],
)
def test_a_budget_below_the_partitions_with_data_serves_each_within_ceil_p_over_budget_batches(backlogs, budget):
    batches, heads = simulate(backlogs, budget)
    total = sum(backlogs.values())
    assert heads == backlogs and sum(sum(b.values()) for b in batches) == total, "every record exactly once"
    assert len(batches) == -(-total // budget), "each batch uses the whole budget while records are left"
    bound = -(-len(backlogs) // budget)
    for partition, backlog in backlogs.items():
        read = waited = 0
        for batch in batches:
            if read == backlog:
                break  # caught up: nothing left to wait for
            waited = 0 if partition in batch else waited + 1
            read += batch.get(partition, 0)
            assert waited < bound, f"p{partition} waited {waited} batches in a row (budget {budget})"


def test_records_that_do_not_divide_evenly_go_to_the_partitions_read_longest_ago():
    stamped = [PartitionState(p, 0, 0, 100, 100, last) for p, last in ((0, 9), (1, 4), (2, 7))]
    assert {r.partition: r.size for r in plan(stamped, budget=5).ranges} == {0: 1, 1: 2, 2: 2}
    assert [r.partition for r in plan(stamped, budget=1).ranges] == [1]
    never_moved = [*stamped[:2], PartitionState(2, None, 0, 100, 100)]
    assert [r.partition for r in plan(never_moved, budget=1).ranges] == [2]


def test_a_time_to_data_loss_already_past_reads_as_overdue_never_as_negative_hours():
    from kafka2pg.planner import time_left
    from kafka2pg.status import PartitionStatus

    assert time_left(5400) == "~1.5 h"
    assert time_left(-3600 * 1e6).startswith("overdue (past retention.ms")
    overdue = PartitionStatus(0, 10, 0, 20, 20, 10, 10, -3600 * 1e6, True)
    assert overdue.time_to_loss == "overdue (AT RISK)"
    assert PartitionStatus(0, 10, 0, 20, 20, 10, 10, 7200, False).time_to_loss == "2.0h"
    unknown = PartitionStatus(0, 10, 0, 20, 20, 10, 10, None, False, loss_time_unknown=True)
    assert unknown.time_to_loss == "unknown (no Kafka timestamp)"
