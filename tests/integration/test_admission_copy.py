"""What admission accepts goes through the stage step's COPY into a real table and reads back
equal to what the producer wrote; random records never stop the write."""

import json
import math
from datetime import UTC, date, datetime
from decimal import Decimal

import psycopg
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from kafka2pg.admission import decoder_for
from kafka2pg.chunk_writer import copy_isolating, frame, staging_copy

COLUMNS = [
    {"name": "event_id", "type": "text", "required": True},
    {"name": "customer_id", "type": "bigint", "required": True},
    {"name": "amount", "type": "numeric(12,2)"},
    {"name": "note", "type": "text"},
    {"name": "event_time", "type": "timestamptz", "field": "ts"},
    {"name": "payload", "type": "jsonb"},
    {"name": "day", "type": "date"},
    {"name": "flag", "type": "boolean"},
    {"name": "ratio", "type": "double precision"},
    {"name": "qty", "type": "integer"},
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
events = st.fixed_dictionaries(
    {"event_id": st.text(min_size=1), "customer_id": st.integers(-(2**63), 2**63 - 1)},
    optional={
        "amount": st.decimals(places=2, min_value=-(10**10) + 1, max_value=10**10 - 1, allow_nan=False),
        "note": st.text(),
        "ts": st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.timezones()),
        "payload": json_values,
        "day": st.dates(),
        "flag": st.booleans(),
        "ratio": st.floats(allow_nan=False, allow_infinity=False),
        "qty": st.integers(-(2**31), 2**31 - 1),
        "extra": json_values,
    },
)


def _encode(event: dict) -> bytes:
    wire = {
        k: (str(v) if isinstance(v, Decimal) else v.isoformat() if hasattr(v, "isoformat") else v)
        for k, v in event.items()
    }
    text = json.dumps(wire, ensure_ascii=False)
    if "amount" in event:  # a JSON number, exactly as written
        text = text.replace(json.dumps(str(event["amount"])), str(event["amount"]))
    return text.encode("utf-8", "surrogatepass")


def _expected(event: dict) -> dict:
    """What the target must hold for an accepted event: the producer's values, independently."""
    ts = event.get("ts")
    return {
        "event_id": event["event_id"],
        "customer_id": event["customer_id"],
        "amount": event.get("amount"),
        "note": event.get("note"),
        "event_time": None if ts is None else (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).astimezone(UTC),
        "payload": event.get("payload"),
        "day": event.get("day"),
        "flag": event.get("flag"),
        "ratio": event.get("ratio"),
        "qty": event.get("qty"),
    }


def _same(name: str, stored, produced) -> bool:
    if name == "payload":  # jsonb keeps a JSON number's decimal value exactly: compare as decimals
        exact = {"parse_float": Decimal, "parse_int": Decimal}
        return (
            stored is None
            and produced is None
            or (stored is not None and json.loads(stored, **exact) == json.loads(json.dumps(produced), **exact))
        )
    if isinstance(stored, float) and isinstance(produced, float):
        return stored == produced and math.copysign(1, stored) == math.copysign(1, produced)
    return stored == produced


def _record_batch(values: list[bytes]) -> pa.RecordBatch:
    rows = len(values)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([0] * rows, pa.int32()),
            pa.array(range(rows), pa.int64()),
            pa.array([datetime(2026, 1, 1, tzinfo=UTC)] * rows, pa.timestamp("us", tz="UTC")),
            pa.array([b"k\x00\xff"] * rows, pa.binary()),
            pa.array(values, pa.binary()),
        ],
        names=["partition", "offset", "timestamp", "key", "value"],
    )


@pytest.fixture(scope="module")
def staged(base_settings, tmp_path_factory):
    """A pipeline's real staging table, and a function that COPYs records into it and reads them back."""
    return _stager(base_settings, tmp_path_factory.mktemp("admission"), "p_admission_copy", COLUMNS)


# Every number column reads numbers written as strings too, and the date column day counts.
QUOTED_COLUMNS = [{"name": "day", "type": "date", "epoch": "days"}] + [
    {**c, "quoted_numbers": True} if c["name"] in ("customer_id", "amount", "ratio", "qty") else c
    for c in COLUMNS
    if c["name"] != "day"
]


@pytest.fixture(scope="module")
def staged_quoted(base_settings, tmp_path_factory):
    return _stager(base_settings, tmp_path_factory.mktemp("quoted"), "p_admission_quoted", QUOTED_COLUMNS)


def _stager(base_settings, directory, name: str, columns: list[dict]):
    import yaml

    from kafka2pg.config import get_pipeline
    from kafka2pg.migrations import migrate

    path = directory / "p.yaml"
    spec = {"name": name, "topic": f"t-{name}", "target_table": f"public.{name}"}
    path.write_text(yaml.safe_dump({"pipelines": [{**spec, "business_key": ["event_id"], "columns": columns}]}))
    pipeline = get_pipeline(name, path)
    migrate(base_settings.database_url, [pipeline])
    decoder = decoder_for(pipeline)
    table = sql.Identifier("kafka2pg", pipeline.staging_table)
    statement = staging_copy(pipeline)
    names = [c["name"] for c in columns]
    selected = [sql.SQL("{}::text").format(sql.Identifier(n)) if n == "payload" else sql.Identifier(n) for n in names]

    def copy(values: list[bytes]):
        admitted = decoder.admit(values)
        outcomes = [admitted.outcome(i) for i in range(len(values))]
        with psycopg.connect(base_settings.database_url) as conn:
            conn.execute(sql.SQL("TRUNCATE {}").format(table))
            refused = copy_isolating(
                conn, statement, frame(_record_batch(values), admitted, decoder, 1, 0, "t"), into="staging"
            )
            rows = conn.execute(
                sql.SQL(
                    "SELECT {}, raw_key, raw_value, raw_headers, quarantine_reason FROM {} ORDER BY kafka_offset"
                ).format(sql.SQL(", ").join(selected), table)
            ).fetchall()
        return (
            outcomes,
            refused,
            [dict(zip([*names, "raw_key", "raw_value", "raw_headers", "reason"], r, strict=True)) for r in rows],
        )

    return copy


@settings(
    max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None
)
@given(st.lists(events, min_size=1, max_size=8))
def test_what_admission_accepts_reads_back_as_produced(staged, batch):
    values = [_encode(e) for e in batch]
    outcomes, refused, rows = staged(values)
    assert refused == {}, "PostgreSQL refused a row admission accepted"
    assert len(rows) == len(batch)
    for event, outcome, row in zip(batch, outcomes, rows, strict=True):
        if outcome.reason is not None:
            assert row["reason"] == outcome.reason and row["raw_value"] == _encode(event)
            continue
        assert row["reason"] is None and row["raw_value"] is None
        for name, value in _expected(event).items():
            assert _same(name, row[name], value), (name, row[name], value)


@settings(
    max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], deadline=None
)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=5))
def test_random_bytes_never_stop_the_write_and_keep_their_raw_bytes(staged, values):
    outcomes, refused, rows = staged(values)
    assert refused == {} and len(rows) == len(values)
    for value, row in zip(values, rows, strict=True):
        assert row["reason"] is not None
        assert (row["raw_key"], row["raw_value"]) == (b"k\x00\xff", value)


@pytest.mark.parametrize("amount", ["12.5" + "0" * 40, "1." + "0" * 5000, "1.50E+3", "150E-2", "-0.000", "-0"])
def test_an_amount_in_any_json_form_reads_back_as_its_value(staged, amount):
    """A JSON number admission accepts for numeric(12,2), whatever its form (runs of zeros after
    the point, exponents, a negative zero), lands as its exact value."""
    value = b'{"event_id": "e", "customer_id": 1, "amount": ' + amount.encode() + b"}"
    outcomes, refused, rows = staged([value])
    assert outcomes[0].reason is None and refused == {}
    assert rows[0]["amount"] == Decimal(amount)


@pytest.mark.parametrize(
    ("field", "written", "expected"),
    [
        ("amount", "12.50", Decimal("12.50")),
        ("amount", "-1.5E+3", Decimal("-1500")),
        ("amount", "0." + "0" * 300, Decimal(0)),
        ("customer_id", "9223372036854775807", 9223372036854775807),
        ("qty", "-2147483648", -2147483648),
        ("ratio", "2.5e-3", 0.0025),
    ],
)
def test_a_number_written_as_a_string_reads_back_as_that_number(staged_quoted, field, written, expected):
    """A `quoted_numbers` column: the string's number lands in the real column as its exact value."""
    value = json.dumps({"event_id": "e", "customer_id": 1, field: written}).encode()
    outcomes, refused, rows = staged_quoted([value])
    assert outcomes[0].reason is None and refused == {}
    assert rows[0][field] == expected and type(rows[0][field]) is type(expected)


def test_a_day_count_reads_back_as_its_date(staged_quoted):
    value = b'{"event_id": "e", "customer_id": 1, "day": -719162}'
    outcomes, refused, rows = staged_quoted([value, value.replace(b"-719162", b"20420")])
    assert [o.reason for o in outcomes] == [None, None] and refused == {}
    assert [r["day"] for r in rows] == [date(1, 1, 1), date(2025, 11, 28)]
