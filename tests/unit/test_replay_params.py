"""The replay DAG's Params -> a replay request: explicit ranges, a time window, a backfill's interval."""

from datetime import UTC, datetime

import pytest

from kafka2pg.exceptions import ConfigError
from kafka2pg.planner import OffsetRange
from kafka2pg.replay_request import (
    ReplayRequest,
    kafka_ms,
    parse_ranges,
    parse_time,
    parse_window,
    request_from_params,
)

DAY = (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 2, tzinfo=UTC))


def test_offset_ranges_from_the_form_or_the_command_line():
    form = [{"partition": 1, "start": 5, "end": 9}, {"partition": 0, "start": 0, "end": 3}]
    assert parse_ranges(form) == (OffsetRange(0, 0, 3), OffsetRange(1, 5, 9))
    assert parse_ranges("1:5-9, 0:0-3") == parse_ranges(form)
    # JSON has one number type: 9.0 from a run conf is 9; a fraction or a float past 2**53 is not
    assert parse_ranges([{"partition": 1.0, "start": 5.0, "end": 9.0}]) == (OffsetRange(1, 5, 9),)
    with pytest.raises(ConfigError, match="integers >= 0"):  # 2**53 + 1 reads as 2**53: not exact
        parse_ranges([{"partition": 0, "start": 0, "end": float(2**53)}])
    assert type(parse_ranges([{"partition": 1.0, "start": 5.0, "end": 9.0}])[0].end) is int
    for inexact in (9.5, 2.0**60):
        with pytest.raises(ConfigError, match="integers >= 0"):
            parse_ranges([{"partition": 0, "start": 0, "end": inexact}])
    request = request_from_params({"offset_ranges": form}, run_type="manual")
    assert request.mode == "replace" and request.ranges == parse_ranges(form) and request.window is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([{"partition": 0, "start": 5, "end": 5}], "must be greater than start"),
        ([{"partition": 0, "start": -1, "end": 5}], "integers >= 0"),
        ([{"partition": 2**31, "start": 0, "end": 5}], "the partition is above 2147483647"),
        ([{"partition": 0, "start": 0, "end": 2**63}], "the end is above 9223372036854775807"),
        ([{"partition": 0, "start": 0}], "exactly the keys"),
        ("0:5", "partition:start-end"),
        ("0:0-10,", "got '' \\(part 2 of '0:0-10,'\\)"),
        ("0:+1-10", "got '0:\\+1-10'"),
        ("0:1_0-20", "partition:start-end"),
        ("0:\uff11-9", "partition:start-end"),
        (7, "expected a list"),
    ],
)
def test_bad_offset_ranges_are_refused_with_the_reason(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_ranges(value)


@pytest.mark.parametrize("second", [OffsetRange(0, 5, 20), OffsetRange(0, 50, 60)])
def test_one_range_per_partition(second):
    with pytest.raises(ConfigError, match="one range per partition"):
        ReplayRequest("replace", (OffsetRange(0, 0, 10), second))


def test_time_window_without_a_zone_is_utc_and_must_be_ordered():
    request = request_from_params({"from_time": "2026-11-01T00:00:00", "to_time": "2026-11-02T00:00:00Z"})
    assert request.window == DAY
    with pytest.raises(ConfigError, match="must be before"):
        request_from_params({"from_time": "2026-11-02T00:00:00Z", "to_time": "2026-11-01T00:00:00Z"})
    with pytest.raises(ConfigError, match="needs both"):
        request_from_params({"from_time": "2026-11-02T00:00:00Z"})
    with pytest.raises(ConfigError, match="not an ISO-8601"):
        request_from_params({"from_time": "yesterday", "to_time": "today"})


def test_a_window_with_a_zone_at_one_end_and_none_at_the_other_is_refused_unless_the_zone_is_utc():
    """09:00+01:00 to 10:00 read the end as UTC: a window of two hours where one was meant."""
    with pytest.raises(ConfigError, match=r"one names a time zone and the other none .*give both a zone"):
        request_from_params({"from_time": "2026-03-01T09:00+01:00", "to_time": "2026-03-01T10:00"})
    with pytest.raises(ConfigError, match=r"offsets: --from '2026-03-01T09:00' and --to '2026-03-01T10:00-05:00'"):
        parse_window("2026-03-01T09:00", "2026-03-01T10:00-05:00", ("--from", "--to"), "offsets")
    both = request_from_params({"from_time": "2026-03-01T09:00+01:00", "to_time": "2026-03-01T10:00+01:00"})
    assert both.window == (datetime(2026, 3, 1, 8, tzinfo=UTC), datetime(2026, 3, 1, 9, tzinfo=UTC))
    utc = request_from_params({"from_time": "2026-03-01T09:00", "to_time": "2026-03-01T10:00+00:00"})
    assert utc.window == (datetime(2026, 3, 1, 9, tzinfo=UTC), datetime(2026, 3, 1, 10, tzinfo=UTC))


def test_errors_name_the_fields_as_the_user_wrote_them():
    from kafka2pg.replay_request import CLI_NAMES

    cases = [
        ({"offset_ranges": "0:0-1", "from_time": "2026-11-01"}, "give --offsets OR --from/--to, not both"),
        ({"from_time": "2026-11-01"}, "needs both --from and --to"),
        ({"from_time": "2026-11-01", "to_time": "soon"}, "replay --to: not an ISO-8601 time: 'soon'"),
        ({"offset_ranges": "0:0"}, "replay --offsets: expected 'partition:start-end,...'"),
        ({"offset_ranges": "1:0-5, 0:5-3"}, "replay --offsets '0:5-3': end (exclusive) must be greater than start"),
        ({"offset_ranges": "0:" + "1" * 5000 + "-9"}, "replay --offsets '0:111111111111111111111111111111111111"),
        ({"offset_ranges": "0:" + "1" * 5000 + "-9"}, "... (5004 characters): the start is above 9223372036854775807"),
        (
            {"offset_ranges": "0:0-" + "9" * 30},
            "replay --offsets '0:0-999999999999999999999999999999': the end is above",
        ),
        ({"offset_ranges": f"{2**31}:0-1"}, "replay --offsets '2147483648:0-1': the partition is above 2147483647"),
        (
            {"offset_ranges": "0:1-2,x" * 20},
            "got 'x0:1-2' (part 2 of '0:1-2,x0:1-2,x0:1-2,x0:1-2,x0:1-2,x0:1-2'... (140 characters))",
        ),
    ]
    for params, message in cases:
        with pytest.raises(ConfigError) as refused:
            request_from_params(params, run_type="manual", names=CLI_NAMES)
        assert message in str(refused.value)
    with pytest.raises(ConfigError, match="needs both from_time and to_time"):
        request_from_params({"to_time": "2026-11-01"}, run_type="manual")


def test_a_backfill_run_replays_its_data_interval_a_bare_manual_run_is_an_error_a_scheduled_one_a_noop():
    request = request_from_params({"mode": "verify-only"}, run_type="backfill", interval=DAY, requested_by="ann")
    assert (request.mode, request.window, request.requested_by) == ("verify-only", DAY, "ann")
    with pytest.raises(ConfigError, match="nothing to replay"):
        request_from_params({}, run_type="manual", interval=DAY)
    assert request_from_params({}, run_type="scheduled", interval=DAY) is None, "a timer never replays"
    with pytest.raises(ConfigError, match="not both"):
        request_from_params({"offset_ranges": "0:0-1", "from_time": "2026-11-01"}, run_type="backfill")
    # Only a backfill's interval is one the user chose: a run a TriggerDagRunOperator, an asset
    # or an unknown source started with a logical date replays nothing it was not asked to.
    for run_type in ("operator_triggered", "asset_triggered", "asset_materialization", None):
        with pytest.raises(ConfigError, match="nothing to replay"):
            request_from_params({}, run_type=run_type, interval=DAY)
    # A backfill's conf applies to each of its runs: ranges or a window there would replay the
    # same records once per date.
    for conf, named in (({"offset_ranges": "0:0-1"}, "offset_ranges"), ({"from_time": "2026-11-01"}, "from_time")):
        with pytest.raises(ConfigError, match=f"a backfill's runs each replay their own data interval; .*{named}"):
            request_from_params(
                {**conf, "to_time": "2026-11-02"} if "from_time" in conf else conf, run_type="backfill", interval=DAY
            )
    with pytest.raises(ConfigError, match="mode"):
        request_from_params({"mode": "delete", "offset_ranges": "0:0-1"})


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        (["--to-offset", "5", "--drop"], "argument --drop: not allowed with argument --to-offset"),
        ([], "one of the arguments --to-offset --drop is required"),
    ],
)
def test_reset_takes_a_new_offset_or_drop_never_both_nor_neither(capsys, arguments, refusal):
    from kafka2pg.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["reset", "--pipeline", "orders", "--partition", "0", *arguments])
    assert exited.value.code == 2 and refusal in capsys.readouterr().err
    args = build_parser().parse_args(["reset", "--pipeline", "orders", "--partition", "0", "--drop"])
    assert args.drop and args.to_offset is None


def test_a_windows_bounds_round_up_to_kafkas_milliseconds():
    """[from, to) in Kafka's whole milliseconds: a record stamped 10:00:00.000 is before a window
    from 10:00:00.0005, and one to 10:00:00.0005 holds it."""
    at = parse_time("2026-11-22T10:00:00Z", "from_time")
    whole = kafka_ms(at)
    assert whole == 1_795_341_600_000
    assert kafka_ms(parse_time("2026-11-22T10:00:00.0005Z", "from_time")) == whole + 1
    assert kafka_ms(parse_time("2026-11-22T10:00:00.001Z", "from_time")) == whole + 1
    assert kafka_ms(parse_time("2026-11-22T11:00:00.000999+01:00", "from_time")) == whole + 1
    assert kafka_ms(parse_time("1969-12-31T23:59:59.9995Z", "from_time")) == 0
    # A backfill's data interval, as Airflow hands it to the task: pendulum's DateTime.
    pendulum = pytest.importorskip("pendulum")
    assert kafka_ms(parse_time(pendulum.datetime(2026, 11, 22, 10), "data_interval_start")) == whole
    assert kafka_ms(pendulum.datetime(2026, 11, 22, 11, 0, 0, 500, tz="Europe/Paris")) == whole + 1


def test_a_time_outside_years_1_to_9999_in_utc_is_refused_naming_the_command():
    with pytest.raises(ConfigError, match=r"replay --from: '0001-01-01T00:00\+05:00' is outside years 1-9999 in UTC"):
        parse_time("0001-01-01T00:00+05:00", "--from")
    with pytest.raises(ConfigError, match=r"offsets --to: '9999-12-31T23:00-05:00' is outside years 1-9999 in UTC"):
        parse_time("9999-12-31T23:00-05:00", "--to", "offsets")
    with pytest.raises(ConfigError, match=r"offsets --to: not an ISO-8601 time: 'soon'"):
        parse_time("soon", "--to", "offsets")
    assert parse_time("0001-01-01T00:00Z", "--from").year == 1
    assert parse_time("9999-12-31T23:59:59.999999Z", "--to").year == 9999
