"""What a replay is asked to do, parsed from a trigger's Params, the CLI or a backfill's data
interval: pure, no client library (opening and finishing replays: `kafka2pg.replay`)."""

from __future__ import annotations

import calendar
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kafka2pg.exceptions import ConfigError
from kafka2pg.planner import OffsetRange

MODES = ("replace", "verify-only")


@dataclass(frozen=True)
class ReplayRequest:
    """What to replay: explicit ranges, or a time window [start, end) mapped to offsets."""

    mode: str = "replace"
    ranges: tuple[OffsetRange, ...] = ()
    window: tuple[datetime, datetime] | None = None
    requested_by: str = ""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"replay mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if bool(self.ranges) == (self.window is not None):
            raise ConfigError("a replay needs either offset ranges or a time window (exactly one of them)")
        if self.window is not None and not self.window[0] < self.window[1]:
            raise ConfigError(f"replay time window: from {self.window[0]} must be before to {self.window[1]}")
        seen: set[int] = set()
        for r in self.ranges:
            if r.size == 0:
                raise ConfigError(f"replay range of partition {r.partition} is empty: [{r.start}, {r.end})")
            if r.partition in seen:
                raise ConfigError(
                    f"replay: one range per partition (partition {r.partition} has several); "
                    "replay them one after the other, or one range covering them"
                )
            seen.add(r.partition)


def parse_window(start: Any, end: Any, names: tuple[str, str], command: str = "replay") -> tuple[datetime, datetime]:
    """A time window's two ends, as `parse_time` reads each; refused when one names a time zone
    other than UTC and the other names none (read as UTC): 09:00+01:00 to 10:00 would be two
    hours, not one."""
    window = parse_time(start, names[0], command), parse_time(end, names[1], command)
    zones = [_as_written(value, name, command).utcoffset() for value, name in zip((start, end), names, strict=True)]
    if None in zones and any(zone for zone in zones):  # a zone ahead of or behind UTC, beside none
        raise ConfigError(
            f"{command}: {names[0]} {start!r} and {names[1]} {end!r}: one names a time zone and the other none "
            "(a time without a zone is read as UTC): give both a zone (Z for UTC) or neither"
        )
    return window


def _as_written(value: Any, name: str, command: str) -> datetime:
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(f"{command} {name}: not an ISO-8601 time: {value!r} (e.g. 2026-11-22T00:00:00Z)") from exc


def parse_time(value: Any, name: str, command: str = "replay") -> datetime:
    """ISO-8601 text (or a datetime) -> aware datetime; no zone means UTC. Errors name `command`
    and the field `name` the user gave it as."""
    moment = _as_written(value, name, command)
    moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    try:
        moment.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+05:00: before year 1 in UTC, which PostgreSQL stores BC
        raise ConfigError(f"{command} {name}: {value!r} is outside years 1-9999 in UTC") from None
    return moment


def kafka_ms(moment: datetime) -> int:
    """The first Kafka timestamp (whole milliseconds since 1970) at or after `moment`: the bound to
    look offsets up by for a window [from, to) (rounded up: a record a microsecond before `from`
    is not in it)."""
    utc = moment.astimezone(UTC)  # plain arithmetic: Airflow's data interval is pendulum's own DateTime
    micros = calendar.timegm(utc.timetuple()) * 1_000_000 + utc.microsecond
    return -(-micros // 1000)


# One "partition:start-end" of the command line's form: ASCII digits only (Python's int() would
# also take "+1", "1_000" and other scripts' digits, which no user means as an offset).
_RANGE_TEXT = re.compile(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*-\s*([0-9]+)\s*")
# What Kafka's partition numbers (int32) and offsets (int64) can be.
_LIMITS = {"partition": 2**31 - 1, "start": 2**63 - 1, "end": 2**63 - 1}


def _shown(text: str) -> str:
    """`text` quoted for an error, cut short when long (a 5,000-digit argument)."""
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def parse_ranges(value: Any, name: str = "offset_ranges") -> tuple[OffsetRange, ...]:
    """[{"partition": p, "start": s, "end": e}, ...] or "p:s-e,p:s-e" -> offset ranges (end exclusive).

    `name` is what the user wrote the value as (a DAG Param or a command-line flag), for errors.
    """
    if value in (None, "", []):
        return ()
    items: list[tuple[str, Any]] = []  # (how the user wrote it, the range as a mapping)
    if isinstance(value, str):
        parts = value.split(",")
        for number, part in enumerate(parts, 1):
            match = _RANGE_TEXT.fullmatch(part)
            if match is None:
                where = f" (part {number} of {_shown(value)})" if len(parts) > 1 else ""
                raise ConfigError(f"replay {name}: expected 'partition:start-end,...', got {_shown(part)}{where}")
            # More digits than an int64 has is beyond every limit (and int() refuses 4,300).
            numbers = [int(g) if len(g.lstrip("0")) <= 19 else 2**64 for g in match.groups()]
            for (field, limit), given in zip(_LIMITS.items(), numbers, strict=True):
                if given > limit:
                    raise ConfigError(f"replay {name} {_shown(part.strip())}: the {field} is above {limit}")
            items.append((repr(part.strip()), dict(zip(_LIMITS, numbers, strict=True))))
    elif isinstance(value, list | tuple):
        items = [(repr(item), item) for item in value]
    else:
        raise ConfigError(f"replay {name}: expected a list of {{partition, start, end}}, got {value!r}")
    ranges = []
    for shown, item in items:
        if not isinstance(item, Mapping) or set(item) != {"partition", "start", "end"}:
            raise ConfigError(f"replay {name} {shown}: expected exactly the keys partition, start, end")
        values = [whole_number(item[key]) for key in ("partition", "start", "end")]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ConfigError(f"replay {name} {shown}: partition, start and end must be integers >= 0")
        for (field, limit), given in zip(_LIMITS.items(), values, strict=True):
            if given > limit:
                raise ConfigError(f"replay {name} {_shown(shown)}: the {field} is above {limit}")
        if values[2] <= values[1]:
            raise ConfigError(f"replay {name} {shown}: end (exclusive) must be greater than start")
        ranges.append(OffsetRange(*values))
    return tuple(sorted(ranges, key=lambda r: (r.partition, r.start)))


def whole_number(value: Any) -> Any:
    """A JSON number written 500.0 (a run conf, an API client: JSON has one number type, and
    Airflow's Param schema "integer" accepts it) as the int it is, where a float holds it exactly;
    anything else as given, for the caller to refuse if not an int."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:  # 2**53 + 1 reads as 2**53
        return int(value)
    return value


# How the DAG's trigger form names the request's fields; the CLI passes its flags instead.
PARAM_NAMES = {"offset_ranges": "offset_ranges", "from_time": "from_time", "to_time": "to_time"}
CLI_NAMES = {"offset_ranges": "--offsets", "from_time": "--from", "to_time": "--to"}


def request_from_params(
    params: Mapping[str, Any],
    *,
    run_type: str | None = None,
    interval: tuple[datetime | None, datetime | None] = (None, None),
    requested_by: str = "",
    names: Mapping[str, str] = PARAM_NAMES,
) -> ReplayRequest | None:
    """The replay DAG's Params (+ the run's data interval for backfills) -> a request.

    Explicit `offset_ranges`, else `from_time`/`to_time`, else (backfill runs only) the run's
    data interval. Any other run without ranges or window is an error (a manual run, one a
    TriggerDagRunOperator or an asset started): its data interval is not something the user
    chose. A backfill's conf naming ranges or a window is an error too: every date's run would
    replay the same records. A scheduled run (the DAG was unpaused so that backfills run)
    replays nothing: None. Errors name the fields as `names` says (the Params by default;
    `CLI_NAMES` for the command line).
    """
    offsets, begin, until = names["offset_ranges"], names["from_time"], names["to_time"]
    mode = params.get("mode") or "replace"
    reason = params.get("reason") or ""
    ranges = parse_ranges(params.get("offset_ranges"), offsets)
    start, end = params.get("from_time"), params.get("to_time")
    if ranges and (start or end):
        raise ConfigError(f"replay: give {offsets} OR {begin}/{until}, not both")
    if run_type == "backfill" and (ranges or start or end):
        raise ConfigError(
            f"replay: a backfill's runs each replay their own data interval; its run conf names "
            f"{offsets if ranges else f'{begin}/{until}'}, which every date's run would replay again. "
            "Trigger one run with them instead, or leave them out of the backfill's conf."
        )
    if ranges:
        return ReplayRequest(mode, ranges, None, requested_by, reason)
    if start or end:
        if not (start and end):
            raise ConfigError(f"replay: a time window needs both {begin} and {until}")
        window = parse_window(start, end, (begin, until))
        return ReplayRequest(mode, (), window, requested_by, reason)
    if run_type == "scheduled":
        return None
    if run_type == "backfill" and interval[0] is not None and interval[1] is not None and interval[0] < interval[1]:
        window = (parse_time(interval[0], "data_interval_start"), parse_time(interval[1], "data_interval_end"))
        return ReplayRequest(mode, (), window, requested_by, reason or "backfill run over its data interval")
    raise ConfigError(
        'replay: nothing to replay. Give offset_ranges (e.g. [{"partition": 0, "start": 0, "end": 100}]) or '
        "from_time and to_time in the trigger form, or create a backfill over dates (each run replays its "
        "data interval)."
    )
