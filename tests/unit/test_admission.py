"""Record admission rules (pure): what lands, with which value, and the reason for what does not."""

import json
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafka2pg.admission import MAX_JSON_DEPTH, FieldRule, RecordDecoder

RULES = [
    FieldRule("event_id", "event_id", "text", required=True),
    FieldRule("customer_id", "customer_id", "bigint", required=True),
    FieldRule("amount", "amount", "numeric(12,2)"),
    FieldRule("note", "note", "text"),
    FieldRule("event_time", "ts", "timestamptz"),
    FieldRule("payload", "payload", "jsonb"),
    FieldRule("day", "day", "date"),
    FieldRule("flag", "flag", "boolean"),
    FieldRule("ratio", "ratio", "double precision"),
    FieldRule("qty", "qty", "integer"),
    FieldRule("epoch_ms", "epoch_ms", "timestamptz", epoch="milliseconds"),
    FieldRule("epoch_s", "epoch_s", "timestamptz", epoch="seconds"),
]
DECODER = RecordDecoder(RULES, ["event_id"])
BASE = b'{"event_id":"e1","customer_id":5'


def outcome(value: bytes | None):
    """The decoder's outcome, checked against the strict path: both must always agree."""
    admitted = DECODER.decode(value)
    assert admitted == DECODER.decode_strictly(value)
    return admitted


def admit_checked(decoder: RecordDecoder, values: list):
    """`decoder.admit(values)`, checked: each record's outcome is its own, as the strict path gives it."""
    admitted = decoder.admit(values)
    assert [admitted.outcome(i) for i in range(len(values))] == [decoder.decode_strictly(v) for v in values]
    return admitted


def field(name: str, value: bytes | None):
    admitted = outcome(value)
    assert admitted.reason is None, admitted.reason
    return admitted.values[[r.name for r in RULES].index(name)]


def reason(value: bytes | None) -> str:
    admitted = outcome(value)
    assert admitted.values is None
    return admitted.reason


def _ts(text: str) -> bytes:
    """A record whose `ts` field is the JSON string `text`."""
    return BASE + b',"ts":' + json.dumps(text).encode() + b"}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "value is null (a tombstone)"),
        (b"", "value is empty (0 bytes)"),
        (b"\xff\xfe", "value is not valid UTF-8 (byte 0xff at position 0: invalid start byte)"),
        (b'{"event_id":"a\xffb","customer_id":1}', "value is not valid UTF-8 (byte 0xff at position 14"),
        (b"[1, 2]", "value is a JSON array, not an object"),
        (b'"text"', "value is a JSON string, not an object"),
        (BASE + b"} }{garbage", "value is not valid JSON (Extra data at character 34"),
        (BASE + b',"note":"a\\u0000b"}', "field 'note': contains NUL (U+0000), not storable in text"),
        (b'{"event_id":"\\u0000","customer_id":1}', "field 'event_id': contains NUL (U+0000)"),
        (BASE + b',"payload":{"a":"\\u0000"}}', "field 'payload': contains NUL (U+0000), not storable in jsonb"),
        (BASE + b',"payload":{"\\u0000":1}}', "field 'payload': contains NUL (U+0000), not storable in jsonb"),
        (BASE + b',"payload":{"a":"\\ud800"}}', "field 'payload': contains a lone surrogate U+D800"),
        (BASE + b',"note":"\\udc00x"}', "field 'note': contains a lone surrogate U+DC00"),
        (BASE + b',"ts":"-5000-01-01T00:00:00Z"}', "field 'ts': timestamp out of range for timestamptz (year -5000"),
        (BASE + b',"ts":"+40000-01-01T00:00:00Z"}', "field 'ts': timestamp out of range for timestamptz (year 40000"),
        (BASE + b',"ts":"+67561-11-25T10:00:00Z"}', "field 'ts': timestamp out of range for timestamptz (year 67561"),
        (BASE + b',"ts":"+2016-12-31T23:59:59Z"}', "field 'ts': year written '+2016': kafka2pg reads years as four"),
        (BASE + b',"ts":-3e11}', "field 'ts': a number ('-3e11') for a timestamp: set the column's `epoch`"),
        (BASE + b',"ts":2069880429600}', "field 'ts': a number ('2069880429600') for a timestamp"),
        (BASE + b',"ts":"2025-11-25T10:00:00.1234567Z"}', "field 'ts': '2025-11-25T10:00:00.1234567Z' has sub-micro"),
        (BASE + b',"ts":"2025-11-25T23:59:60Z"}', "field 'ts': '2025-11-25T23:59:60Z' is not a valid timestamp"),
        (
            BASE + b',"ts":"0001-01-01T00:00:00+01:00"}',
            "field 'ts': timestamp out of range for timestamptz (outside years 1-9999 in UTC):"
            " '0001-01-01T00:00:00+01:00'",
        ),
        (
            BASE + b',"ts":"9999-12-31T23:59:59-00:01"}',
            "field 'ts': timestamp out of range for timestamptz (outside years 1-9999 in UTC):"
            " '9999-12-31T23:59:59-00:01'",
        ),
        (
            BASE + b',"ts":"2025-01-01T10:00:00+24:00"}',
            "field 'ts': '2025-01-01T10:00:00+24:00' has an impossible UTC offset +24:00",
        ),
        (BASE + b',"ts":"25/11/2025"}', "field 'ts': '25/11/2025' is not an ISO-8601 timestamp"),
        (BASE + b',"epoch_ms":-3e16}', "field 'epoch_ms': '-3e16' milliseconds since 1970 is out of range"),
        (BASE + b',"epoch_ms":1.0005}', "field 'epoch_ms': '1.0005' milliseconds has sub-microsecond digits"),
        (b'{"event_id":"' + b"x" * 12000 + b'","customer_id":1}', "business key is 12024 bytes, over the 2704-byte"),
        (BASE + b',"amount":1.234}', "field 'amount': '1.234' has 3 digits after the point; numeric(12,2) keeps 2"),
        (BASE + b',"amount":12345678901.5}', "field 'amount': '12345678901.5' has 11 digits before the point"),
        (BASE + b',"amount":1e400}', "field 'amount': '1e400' has 401 digits before the point"),
        (BASE + b',"amount":"12.50"}', "field 'amount': expected a JSON number for numeric(12,2), got a string"),
        (b'{"event_id":"e","customer_id":"5"}', "field 'customer_id': expected a JSON integer for bigint, got a str"),
        (b'{"event_id":"e","customer_id":true}', "field 'customer_id': expected a JSON integer for bigint, got a b"),
        (b'{"event_id":"e","customer_id":1.5}', "field 'customer_id': '1.5' is not a whole number"),
        (b'{"event_id":"e","customer_id":9223372036854775808}', "field 'customer_id': '9223372036854775808' is out"),
        (b'{"event_id":"e","customer_id":1e999999999}', "field 'customer_id': '1e999999999' is out of range"),
        (BASE + b',"qty":2147483648}', "field 'qty': '2147483648' is out of range for integer"),
        (BASE + b',"ratio":1e400}', "field 'ratio': '1e400' is out of range for double precision"),
        (BASE + b',"ratio":1e-400}', "field 'ratio': '1e-400' underflows double precision"),
        (BASE + b',"ratio":NaN}', "value is not valid JSON (NaN is not a JSON number)"),
        (BASE + b',"ratio":"1.5"}', "field 'ratio': expected a JSON number for double precision, got a string"),
        (BASE + b',"flag":1}', "field 'flag': expected true or false, got a number ('1')"),
        (BASE + b',"day":"2025-02-30"}', "field 'day': '2025-02-30' is not a valid date"),
        (BASE + b',"day":"2025-11-25T10:00Z"}', "field 'day': '2025-11-25T10:00Z' is not an ISO-8601 date"),
        (BASE + b',"payload":{"n":1e999999}}', "field 'payload': number '1e999999' is out of range for jsonb"),
        (
            BASE + b',"payload":{"n":1e99999999999999999999}}',
            "field 'payload': number '1e99999999999999999999' is out of range for jsonb",
        ),
        (BASE + b',"payload":' + b"[" * 5000 + b"]" * 5000 + b"}", "field 'payload': JSON nested deeper than 900"),
        (b"[" * 5000 + b"]" * 5000, "value: JSON nested deeper than 900 levels (the record counts as one)"),
        (b'{"customer_id":1}', "field 'event_id': required but missing"),
        (b'{"event_id":null,"customer_id":1}', "field 'event_id': required but null"),
        (
            b'{"event_id":"e","customer_id":1,"note":"x\x01y"}',
            "value is not valid JSON (Invalid control character at character 41:",
        ),
    ],
)
def test_a_record_postgresql_would_refuse_or_alter_is_refused_naming_field_and_rule(value, expected):
    assert reason(value).startswith(expected)


def test_faithful_values_of_every_type():
    value = (
        b'{"event_id":"\\ud83d\\ude00 \xd9\x85 e\xcc\x81","customer_id":-9223372036854775808,"amount":-0.50,'
        b'"note":"","ts":"2025-11-25T10:00:00.123456+01:00","payload":"123","day":"9999-12-31","flag":false,'
        b'"ratio":5e-324,"qty":2147483647,"epoch_ms":2069880429600,"epoch_s":-1.5}'
    )
    values = dict(zip([r.name for r in RULES], outcome(value).values, strict=True))
    assert values == {
        "event_id": "\U0001f600 \u0645 e\u0301",
        "customer_id": -(2**63),
        "amount": "-0.50",
        "note": "",
        "event_time": datetime(2025, 11, 25, 9, 0, 0, 123456, tzinfo=UTC),
        "payload": '"123"',  # a JSON string stays a JSON string
        "day": date(9999, 12, 31),
        "flag": False,
        "ratio": 5e-324,
        "qty": 2**31 - 1,
        "epoch_ms": datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=2069880429600),
        "epoch_s": datetime(1969, 12, 31, 23, 59, 58, 500000, tzinfo=UTC),
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2025-11-25T10:00:00Z", datetime(2025, 11, 25, 10, tzinfo=UTC)),
        ("2025-11-25t10:00:00z", datetime(2025, 11, 25, 10, tzinfo=UTC)),
        ("2025-11-25 10:00:00", datetime(2025, 11, 25, 10, tzinfo=UTC)),  # no offset: UTC
        ("2025-11-25T10:00", datetime(2025, 11, 25, 10, tzinfo=UTC)),
        ("2025-11-25", datetime(2025, 11, 25, tzinfo=UTC)),
        ("2025-11-25T10:00:00.1234560-0230", datetime(2025, 11, 25, 12, 30, 0, 123456, tzinfo=UTC)),
        ("2025-11-25T10:00:00,5+01", datetime(2025, 11, 25, 9, 0, 0, 500000, tzinfo=UTC)),
        ("9999-12-31T23:59:59.999999Z", datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    ],
)
def test_timestamp_forms_accepted(text, expected):
    assert field("event_time", _ts(text)) == expected


def test_jsonb_keeps_the_json_value_as_written():
    assert field("payload", BASE + b',"payload":{"a":1.10,"b":[true,null]}}') == '{"a":1.10,"b":[true,null]}'
    assert field("payload", BASE + b',"payload":"{\\"a\\":1}"}') == '"{\\"a\\":1}"'
    assert field("payload", BASE + b',"payload":null}') is None


def test_a_repeated_field_keeps_its_last_value_as_jsonb_does():
    assert field("event_id", b'{"event_id":"a","customer_id":1,"event_id":"b"}') == "b"


def test_extra_fields_are_ignored_and_missing_optional_fields_are_null():
    admitted = outcome(BASE + b',"unknown":{"deep":[1,2,3]}}')
    assert admitted.values[:4] == ("e1", 5, None, None)


# ---------------------------------------------------------------- properties

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
names = st.sampled_from(["event_id", "customer_id", "amount", "note", "ts", "payload", "day", "flag", "ratio", "qty"])
field_values = (
    json_values
    | st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat())
    | st.dates().map(lambda d: d.isoformat())
    | st.decimals(allow_nan=False, allow_infinity=False).map(str)
    | st.sampled_from(["\x00", "\ud800", "\udfff", "\U0001f600", "", "1e400", "-0"])
)
fractions = st.from_regex(r"[.,][0-9]{1,9}", fullmatch=True) | st.just("")
zones = st.sampled_from(["", "Z", "z", "+01:00", "-0230", "+01", "+24:00", "-00:00"])
timestamps = st.builds(
    lambda moment, sep, fraction, zone: moment.strftime(f"%Y-%m-%d{sep}%H:%M:%S") + fraction + zone,
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)),
    st.sampled_from(["T", "t", " ", "_"]),
    fractions,
    zones,
)
fields = st.dictionaries(names, field_values | timestamps, max_size=10)
# Half of them valid apart from what the random fields change, so every rule gets reached.
documents = fields | fields.map(lambda more: {"event_id": "e", "customer_id": 1, **more})


def _encode(document: dict, raw_numbers: bool) -> bytes:
    text = json.dumps(document, ensure_ascii=raw_numbers)
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(documents, st.booleans())
def test_any_json_document_gets_values_or_a_reason_and_both_paths_agree(document, ascii_only):
    admitted = outcome(_encode(document, ascii_only))
    assert (admitted.values is None) != (admitted.reason is None)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=300) | st.binary(max_size=40).map(lambda b: BASE + b))
def test_any_bytes_get_values_or_a_reason_and_both_paths_agree(value):
    admitted = outcome(value)
    assert (admitted.values is None) != (admitted.reason is None)


@settings(max_examples=300, deadline=None)
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)), st.integers(-1439, 1439))
def test_an_accepted_timestamp_is_the_same_instant(moment, offset_minutes):
    zone = timezone(timedelta(minutes=offset_minutes))
    local = moment.replace(tzinfo=zone)
    assert field("event_time", BASE + b',"ts":"' + local.isoformat().encode() + b'"}') == local.astimezone(UTC)


@settings(max_examples=300, deadline=None)
@given(st.decimals(allow_nan=False, allow_infinity=False, places=2, min_value=-(10**10) + 1, max_value=10**10 - 1))
def test_a_numeric_that_fits_lands_exactly(number):
    assert Decimal(field("amount", BASE + b',"amount":' + str(number).encode() + b"}")) == number


@settings(max_examples=400, deadline=None)
@given(timestamps)
def test_any_timestamp_text_gets_the_same_outcome_on_both_paths(text):
    outcome(_ts(text))


def test_field_names_with_quotes_dots_and_backslashes_are_read():
    decoder = RecordDecoder([FieldRule("a", 'we"ird\\na.me', "text"), FieldRule("b", "dotted.name", "bigint")])
    value = json.dumps({'we"ird\\na.me': "odd", "dotted.name": 5}).encode()
    assert decoder.decode(value) == decoder.decode_strictly(value) == (("odd", 5), None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"event_id":"e","customer_id":1e99999999999999999999}', "field 'customer_id': '1e99999999999999999999' is"),
        (BASE + b',"epoch_ms":1e1000000}', "field 'epoch_ms': '1e1000000' milliseconds since 1970 is out of range"),
        (BASE + b',"epoch_s":1.0000000000000000000000000001}', "field 'epoch_s': '1.0000000000000000000000000001' s"),
        (BASE + b',"epoch_ms":1e-999999999}', "field 'epoch_ms': '1e-999999999' milliseconds has sub-microsecond"),
        (b'{"a":' + b"1" * 5000 + b",}", "value is not valid JSON (Expecting property name"),
        (BASE + b',"payload":' + b"[" * 990 + b"1e99999" + b"]" * 990 + b"}", ""),  # too deep, or out of range
        (BASE + b',"payload":["\\\\u0000",' + b"1" * 5000 + b"]}", None),
        (BASE + b',"payload":{"n":0e-16384}}', "field 'payload': number '0e-16384' is out of range for jsonb"),
        (BASE + b',"ts":"2025-11-25T10:00:00\\u002e1234567Z"}', "field 'ts': '2025-11-25T10:00:00.1234567Z' has sub"),
        (BASE + b',"ts":"2025-12-31T23:59:59.999999\\u0039Z"}', "field 'ts': '2025-12-31T23:59:59.9999999Z' has sub"),
    ],
)
def test_values_found_by_review_get_a_reason_or_land_never_raise(value, expected):
    admitted = outcome(value)
    if expected is None:
        assert admitted.reason is None, admitted.reason
    else:
        assert admitted.reason is not None and admitted.reason.startswith(expected), admitted.reason


def test_a_numeric_zero_with_any_exponent_lands_as_zero():
    assert field("amount", BASE + b',"amount":0e-99999999999}') == "0"
    assert field("amount", BASE + b',"amount":-0.000}') == "0"
    assert field("amount", BASE + b',"amount":0.00}') == "0.00"


# ---------------------------------------------------------------- many records at once (admit)


records = st.one_of(
    documents.map(lambda document: _encode(document, True)),
    timestamps.map(_ts),
    st.binary(max_size=60).map(lambda b: BASE + b),
    st.sampled_from(
        [
            BASE + b"}",
            BASE + b',"amount":12.345}',
            BASE + b',"payload":[1e99999]}',
            b'{"event_id":"' + b"x" * 700 + b'","customer_id":1}',
            _ts("2026-02-29T00:00:00Z"),
            _ts("0000-12-31T23:00:00-01:00"),
            _ts("9999-12-31T23:00:00-01:00"),
        ]
    ),
)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(records, max_size=12))
def test_each_record_of_a_list_gets_its_own_outcome_as_the_strict_path_gives_it(values):
    admit_checked(DECODER, values)


def test_one_impossible_day_among_timestamps_leaves_the_others_as_they_are():
    values = [_ts("2026-03-01T10:00:00+01:00"), _ts("2026-02-29T10:00:00Z"), _ts("2026-03-02T10:00:00.5"), b"{"]
    admitted = DECODER.admit(values)
    times = admitted.columns[[r.name for r in RULES].index("event_time")].to_pylist()
    assert times == [
        datetime(2026, 3, 1, 9, tzinfo=UTC),
        None,
        datetime(2026, 3, 2, 10, 0, 0, 500000, tzinfo=UTC),
        None,
    ]
    assert admitted.reasons[0] is None and admitted.reasons[2] is None
    assert "2026-02-29T10:00:00Z" in admitted.reasons[1] and "not valid JSON" in admitted.reasons[3]


def test_timestamps_with_and_without_an_offset_in_one_column_are_each_read_as_their_instant():
    values = [_ts("2026-03-01T10:00:00+01:00"), _ts("2026-03-01 10:00:00"), _ts("2026-03-01T10:00:00.000001Z")]
    times = DECODER.admit(values).columns[[r.name for r in RULES].index("event_time")].to_pylist()
    assert times == [datetime(2026, 3, 1, h, 0, 0, us, tzinfo=UTC) for h, us in ((9, 0), (10, 0), (10, 1))]


def test_every_iso_form_of_a_timestamp_is_read_by_arrow_none_token_by_token(monkeypatch):
    """The column's fast path: Z, +hh:mm, -hh:mm and no offset, a `T` or a space, 0-6 digits
    after the point, mixed in one column, are all cast by Arrow (a token read one by one is the
    slow path: correct, but a record at a time)."""
    import kafka2pg.admission as admission

    one_by_one = []
    monkeypatch.setattr(admission, "_fast_timestamp", lambda token: one_by_one.append(token))
    texts = [
        "2026-03-01T10:00:00Z",
        "2026-03-01T10:00:00.123456+05:30",
        "2026-03-01 10:00:00.5-08:00",
        "2026-03-01T10:00:00",
        "2026-03-01 10:00:00.123456",
        "2026-03-01T10:00:00.12-00:00",
    ]
    times = DECODER.admit([_ts(t) for t in texts]).columns[[r.name for r in RULES].index("event_time")]
    assert one_by_one == []
    assert times.to_pylist() == [DECODER.decode_strictly(_ts(t)).values[4] for t in texts]


@pytest.mark.parametrize(
    "text",
    ["0000-12-31T23:00:00-01:00", "0001-01-01T00:30:00+01:00", "9999-12-31T23:00:00-01:00"],
)
def test_an_offset_timestamp_whose_year_or_instant_leaves_years_1_to_9999_is_refused_among_others(text):
    admitted = DECODER.admit([_ts("2026-01-01T00:00:00Z"), _ts(text)])
    assert admitted.reasons[0] is None
    assert admitted.outcome(1) == DECODER.decode_strictly(_ts(text))
    assert admitted.reasons[1].startswith("field 'ts': ") and repr(text) in admitted.reasons[1]


def test_a_refused_row_is_nulled_and_keeps_the_reason_given():
    admitted = DECODER.admit([BASE + b',"amount":1.5}', BASE + b',"amount":2.5}'])
    refused = admitted.refusing({1: "PostgreSQL refused the row"})
    assert refused.outcome(0) == admitted.outcome(0)
    assert refused.outcome(1) == (None, "PostgreSQL refused the row")
    assert all(column[1].as_py() is None for column in refused.columns)


def test_the_key_size_of_a_list_counts_a_null_key_column_and_a_key_of_fixed_width_columns():
    # Only a RecordDecoder built by hand: a pipeline's business-key columns are always required.
    text_key = RecordDecoder([FieldRule("a", "a", "text"), FieldRule("b", "b", "text")], ["a", "b"])
    values = [b'{"b":"' + b"x" * 2670 + b'"}', b'{"b":"' + b"x" * 2660 + b'"}']
    admitted = text_key.admit(values)
    assert [admitted.outcome(i) for i in range(2)] == [text_key.decode_strictly(v) for v in values]
    assert admitted.reasons[0].startswith("business key is 2710 bytes") and admitted.reasons[1] is None
    wide = RecordDecoder(
        [FieldRule(f"c{i}", f"c{i}", "bigint", required=True) for i in range(169)], [f"c{i}" for i in range(169)]
    )
    value = json.dumps({f"c{i}": i for i in range(169)}).encode()
    assert (
        wide.admit([value]).outcome(0)
        == wide.decode_strictly(value)
        == (None, "business key is 2720 bytes, over the 2704-byte index limit")
    )


def _nested(levels: int, field: bytes = b"payload") -> bytes:
    """A record whose `field` holds objects nested so that the whole value is `levels` deep."""
    inner = b'{"a":' * (levels - 1) + b"1" + b"}" * (levels - 1)
    return BASE + b',"' + field + b'":' + inner + b"}"


def test_nesting_is_refused_beyond_a_fixed_depth_naming_the_field_on_both_paths():
    assert MAX_JSON_DEPTH == 900
    assert str(field("payload", _nested(900))).count("{") == 899
    assert reason(_nested(901)) == "field 'payload': JSON nested deeper than 900 levels (the record counts as one)"
    escaped = _nested(901, b"pay\\u006coad")  # the field's name as JSON may spell it
    assert reason(escaped).startswith("field 'payload': JSON nested deeper")
    brackets = BASE + b',"note":"' + b"{[" * 2000 + b'"}'  # brackets inside a string nest nothing
    assert field("note", brackets) == "{[" * 2000


def test_an_open_string_of_escaped_quotes_before_many_brackets_is_judged_in_one_pass():
    # A backtracking tokenizer retried the open string from each escaped quote: quadratic, minutes here.
    value = BASE + b',"payload":"' + b'\\"' * 200_000 + b"[" * 950
    assert reason(value).startswith("value is not valid JSON (Unterminated string")


# ---------------------------------------------------------------- numbers written as strings (quoted_numbers)

QUOTED_RULES = [
    FieldRule("event_id", "event_id", "text", required=True),
    FieldRule("customer_id", "customer_id", "bigint", required=True, quoted_numbers=True),
    FieldRule("amount", "amount", "numeric(12,2)", quoted_numbers=True),
    FieldRule("ratio", "ratio", "double precision", quoted_numbers=True),
    FieldRule("qty", "qty", "integer", quoted_numbers=True),
]
QUOTED = RecordDecoder(QUOTED_RULES, ["event_id"])


def quoted_outcome(value: bytes):
    admitted = QUOTED.admit([value]).outcome(0)
    assert admitted == QUOTED.decode_strictly(value)
    return admitted


@pytest.mark.parametrize(
    ("number", "column"),
    [
        ("12.50", "amount"),
        ("-0.5", "amount"),
        ("1e3", "amount"),
        ("42", "customer_id"),
        ("-9223372036854775808", "customer_id"),
        ("1e3", "qty"),
        ("2.5e-3", "ratio"),
        ("0", "ratio"),
    ],
)
def test_a_number_written_as_a_string_lands_as_the_number_itself(number, column):
    as_string = quoted_outcome(
        b'{"event_id":"e","customer_id":1,"' + column.encode() + b'":"' + number.encode() + b'"}'
    )
    as_number = quoted_outcome(b'{"event_id":"e","customer_id":1,"' + column.encode() + b'":' + number.encode() + b"}")
    assert as_string.reason is None and as_string == as_number


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'"amount":" 12"', "field 'amount': expected a number or a string holding one, got a string ('\" 12\"')"),
        (b'"amount":"12.505"', "field 'amount': '12.505' has 3 digits after the point; numeric(12,2) keeps 2"),
        (b'"amount":"abc"', "field 'amount': expected a number or a string holding one, got a string"),
        (b'"amount":""', "field 'amount': expected a number or a string holding one, got a string ('\"\"')"),
        (b'"amount":"+1"', "field 'amount': expected a number or a string holding one"),
        (b'"amount":"012"', "field 'amount': expected a number or a string holding one"),
        (
            b'"amount":"1\\u0030"',
            "field 'amount': expected a number or a string holding one",
        ),  # escapes: not as written
        (b'"qty":"1.5"', "field 'qty': '1.5' is not a whole number, integer would round it"),
        (b'"qty":"2147483648"', "field 'qty': '2147483648' is out of range for integer"),
        (b'"ratio":"1e400"', "field 'ratio': '1e400' is out of range for double precision"),
        (b'"ratio":"NaN"', "field 'ratio': expected a number or a string holding one"),
        (b'"qty":true', "field 'qty': expected a JSON integer for integer, got a boolean"),
    ],
)
def test_a_string_that_is_not_a_number_the_column_holds_is_refused_naming_why(value, expected):
    admitted = quoted_outcome(b'{"event_id":"e","customer_id":1,' + value + b"}")
    assert admitted.values is None and admitted.reason.startswith(expected), admitted.reason


def test_without_quoted_numbers_a_string_holding_a_number_is_refused_saying_how_to_read_it():
    for value in (BASE + b',"amount":"12.50"}', BASE + b',"qty":"5"}', BASE + b',"ratio":"0.5"}'):
        assert reason(value).endswith(": set the column's quoted_numbers: true to read numbers written as strings")
    assert "quoted_numbers" not in reason(BASE + b',"amount":"abc"}')  # a string holding no number: no such hint


quoted_fields = st.dictionaries(
    st.sampled_from(["customer_id", "amount", "ratio", "qty"]),
    st.integers(-(2**64), 2**64).map(str)
    | st.decimals(allow_nan=False, allow_infinity=False).map(str)
    | st.floats(allow_nan=False).map(repr)
    | st.text(max_size=6),
    max_size=4,
).map(lambda fields: {"event_id": "e", **fields})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(quoted_fields.map(lambda document: json.dumps(document).encode()), max_size=12))
def test_quoted_numbers_of_a_list_get_each_the_outcome_the_strict_path_gives(values):
    admitted = admit_checked(QUOTED, values)
    for index, value in enumerate(values):  # a string holding a number lands as that number, as written, would
        document = json.loads(value)
        written = ", ".join(
            f"{json.dumps(k)}: {v if k != 'event_id' and _is_number(v) else json.dumps(v)}" for k, v in document.items()
        )
        assert admitted.outcome(index) == QUOTED.decode_strictly(("{" + written + "}").encode())


def _is_number(text: str) -> bool:
    import re

    return re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", text) is not None


# ---------------------------------------------------------------- fields inside an envelope (value_root)

ROOTED = RecordDecoder(RULES, ["event_id"], ("payload",))
DEEP = RecordDecoder(RULES[:3], ["event_id"], ("envelope", "data"))


def rooted(decoder: RecordDecoder, value: bytes):
    admitted = decoder.admit([value]).outcome(0)
    assert admitted == decoder.decode_strictly(value)
    return admitted


def test_the_columns_are_read_from_the_object_at_the_value_root():
    inner = BASE + b',"amount":1.5,"flag":true}'
    assert rooted(ROOTED, b'{"schema":{"type":"struct"},"payload":' + inner + b"}") == outcome(inner)
    deep = rooted(DEEP, b'{"envelope":{"data":{"event_id":"x","customer_id":2},"v":1},"event_id":"no"}')
    assert deep.values == ("x", 2, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"payload":null}', "field 'payload' (the pipeline's value_root): null"),
        (b'{"schema":{}}', "field 'payload' (the pipeline's value_root): missing"),
        (b'{"payload":[1]}', "field 'payload' (the pipeline's value_root): expected a JSON object, got an array"),
        (b'{"payload":"{}"}', "field 'payload' (the pipeline's value_root): expected a JSON object, got a string"),
        (b'{"payload":{"customer_id":1}}', "field 'payload.event_id': required but missing"),
        (b'{"payload":{"event_id":"e","customer_id":"1"}}', "field 'payload.customer_id': expected a JSON integer"),
        (b'{"payload":{"event_id":"e","customer_id":1,"ts":5}}', "field 'payload.ts': a number ('5') for a timestamp"),
    ],
)
def test_a_record_without_the_value_root_object_or_with_a_bad_field_in_it_is_refused_naming_the_path(value, expected):
    admitted = rooted(ROOTED, value)
    assert admitted.values is None and admitted.reason.startswith(expected), admitted.reason


def test_a_deeper_value_root_names_the_level_that_is_not_an_object():
    assert rooted(DEEP, b'{"envelope":{"data":7}}').reason.startswith(
        "field 'envelope.data' (the pipeline's value_root): expected a JSON object, got a number ('7')"
    )
    assert rooted(DEEP, b'{"envelope":{}}').reason == "field 'envelope.data' (the pipeline's value_root): missing"


enveloped = st.one_of(
    documents.map(lambda document: {"schema": {"type": "struct"}, "payload": document}),
    st.dictionaries(st.sampled_from(["payload", "schema"]), json_values, max_size=2),
    st.tuples(documents, documents).map(lambda two: {"payload": two[0], "x": 1, "payload ": two[1]}),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(enveloped.map(lambda document: _encode(document, True)), max_size=10))
def test_records_in_envelopes_get_each_the_outcome_the_strict_path_gives(values):
    admit_checked(ROOTED, values)


def test_a_repeated_value_root_keeps_its_last_object_as_a_repeated_field_does():
    value = b'{"payload":{"event_id":"a","customer_id":1},"payload":{"event_id":"b","customer_id":2}}'
    assert rooted(ROOTED, value).values[:2] == ("b", 2)


def test_a_value_root_msgspec_cannot_name_is_read_by_the_strict_path():
    decoder = RecordDecoder(RULES[:2], ["event_id"], ('we"ird.root',))
    value = json.dumps({'we"ird.root': {"event_id": "e", "customer_id": 3}}).encode()
    assert decoder.decode(value) == decoder.decode_strictly(value) == (("e", 3), None)


# ---------------------------------------------------------------- fields outside the value_root (path)

# A Debezium change event's row in `after`, its operation and source position beside it.
CHANGES = RecordDecoder(
    [
        *RULES[:3],
        FieldRule("op", "op", "text", required=True, path=("op",)),
        FieldRule("source_ts", "source.ts_ms", "timestamptz", epoch="milliseconds", path=("source", "ts_ms")),
        FieldRule("lsn", "source.lsn", "bigint", path=("source", "lsn")),
        FieldRule("source", "source", "jsonb", path=("meta",)),
    ],
    ["event_id"],
    ("after",),
)
CHANGE = b'"after":{"event_id":"e","customer_id":2,"amount":1.5}'


def test_a_column_reads_a_field_outside_the_value_root_by_its_path_from_the_record():
    value = b'{"before":null,' + CHANGE + b',"op":"c","source":{"ts_ms":1764064800000,"lsn":77}}'
    event_id, customer_id, amount, op, source_ts, lsn, meta = rooted(CHANGES, value).values
    assert (event_id, customer_id, amount, op, lsn, meta) == ("e", 2, "1.5", "c", 77, None)
    assert source_ts == datetime(2025, 11, 25, 10, tzinfo=UTC)
    # An object on the way missing or null: its field is missing, as a field in the root is.
    for source in (b"", b',"source":null', b',"source":{}'):
        value = b"{" + CHANGE + b',"op":"r"' + source + b"}"
        assert rooted(CHANGES, value).values == ("e", 2, "1.5", "r", None, None, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"after":null,"op":"d"}', "field 'after' (the pipeline's value_root): null"),
        (b"{" + CHANGE + b"}", "field 'op': required but missing"),
        (b"{" + CHANGE + b',"op":null}', "field 'op': required but null"),
        (b"{" + CHANGE + b',"op":"u","source":"x"}', "field 'source': expected a JSON object, got a string"),
        (b"{" + CHANGE + b',"op":"u","source":{"lsn":"7"}}', "field 'source.lsn': expected a JSON integer for bigint"),
        (b"{" + CHANGE + b',"op":"u","meta":{"k":"\\u0000"}}', "field 'meta': contains NUL"),
    ],
)
def test_a_field_outside_the_value_root_is_refused_by_the_same_rules_naming_its_path(value, expected):
    admitted = rooted(CHANGES, value)
    assert admitted.values is None and admitted.reason.startswith(expected), admitted.reason


def test_records_whose_fields_outside_the_root_are_well_formed_take_the_fast_path():
    """An object on a path missing or null too (Debezium's `before` on a create, `transaction`
    without transaction metadata): not left to the strict path."""
    values = [b"{" + CHANGE + b',"op":"u","source":{"ts_ms":1,"lsn":2}}', b"{" + CHANGE + b',"op":"c"}']
    values.append(b"{" + CHANGE + b',"op":"c","source":null}')
    _, doubts = CHANGES._parse(values)
    assert doubts == set()


change_fields = {
    "after": documents | json_values,
    "op": json_values | st.sampled_from(["c", "u", "d", "r"]),
    "source": st.dictionaries(st.sampled_from(["ts_ms", "lsn", "db"]), field_values, max_size=3) | json_values,
    "meta": json_values,
}
changes = st.fixed_dictionaries({}, optional=change_fields)


# Nothing required: the root's object alone decides whether a record without it is refused.
LOOSE = RecordDecoder(
    [FieldRule("note", "note", "text"), FieldRule("op", "op", "text", path=("op",)), *CHANGES.rules[4:6]],
    root=("after",),
)


def test_a_record_without_the_value_root_is_refused_whatever_it_has_outside_it():
    assert (
        rooted(LOOSE, b'{"op":"c","source":{"lsn":1}}').reason == "field 'after' (the pipeline's value_root): missing"
    )
    assert rooted(LOOSE, b'{"after":{},"op":"c"}').values == (None, "c", None, None)


# A root two objects deep, paths three deep beside it and through it.
DEEPER = RecordDecoder(
    [
        FieldRule("x", "x", "bigint", required=True),
        FieldRule("y", "y", "text"),
        FieldRule("acd", "a.c.d", "text", path=("a", "c", "d")),
        FieldRule("aby", "a.b.z", "jsonb", path=("a", "b", "z")),
        FieldRule("cd", "c.d", "date", path=("c", "d")),
        FieldRule("ccc", "c.c.c", "numeric(5,2)", path=("c", "c", "c")),
    ],
    ["acd"],
    ("a", "b"),
)
nested = st.recursive(
    field_values, lambda inner: st.dictionaries(st.sampled_from(["a", "b", "c", "d", "x", "y", "z"]), inner, max_size=4)
)
deeper = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), nested, max_size=4)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(deeper.map(lambda document: _encode(document, True)), max_size=10))
def test_records_with_a_deep_root_and_deep_paths_get_each_the_outcome_the_strict_path_gives(values):
    admit_checked(DEEPER, values)


def test_paths_beside_and_through_a_deep_root_are_read_on_the_fast_path():
    value = b'{"a":{"b":{"x":1,"y":"y","z":[1]},"c":{"d":"acd"}},"c":{"d":"2025-11-25","c":{"c":1.5}}}'
    assert DEEPER._parse([value])[1] == set()
    assert rooted(DEEPER, value).values == (1, "y", "acd", "[1]", date(2025, 11, 25), "1.5")
    assert rooted(DEEPER, b'{"a":{"b":{"x":1},"c":{"d":"k"}},"c":null}').values == (1, None, "k", None, None, None)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(changes.map(lambda document: _encode(document, True)), max_size=10), st.sampled_from([CHANGES, LOOSE]))
def test_records_with_fields_outside_the_root_get_each_the_outcome_the_strict_path_gives(values, decoder):
    admit_checked(decoder, values)


# The same change events with deletes read from `before` (value_root_fallback).
DELETES = RecordDecoder(CHANGES.rules, ["event_id"], ("after",), ("before",))


def test_where_the_value_root_is_null_or_missing_the_fields_are_read_from_the_fallback():
    before = b'"before":{"event_id":"e","customer_id":2,"amount":1}'
    deleted = rooted(DELETES, b"{" + before + b',"after":null,"op":"d","source":{"lsn":9}}')
    assert deleted.values == ("e", 2, "1", "d", None, 9, None)
    assert rooted(DELETES, b"{" + before + b',"op":"d"}').values == ("e", 2, "1", "d", None, None, None)
    # Where the root's object is there, the fallback is never read, whatever it holds.
    assert rooted(DELETES, b'{"before":"x",' + CHANGE + b',"op":"u"}').values == ("e", 2, "1.5", "u", None, None, None)
    # Without a fallback the same delete is refused, as before.
    assert rooted(CHANGES, b"{" + before + b',"after":null,"op":"d"}').reason == (
        "field 'after' (the pipeline's value_root): null"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b'{"before":{"customer_id":2},"after":null,"op":"d"}', "field 'before.event_id': required but missing"),
        (b'{"before":{"event_id":"e","customer_id":"2"},"op":"d"}', "field 'before.customer_id': expected a JSON"),
        (
            b'{"before":null,"after":null,"op":"d"}',
            "field 'after' (the pipeline's value_root): null, and field 'before' (the pipeline's value_root_fallback): "
            "null",
        ),
        (
            b'{"op":"d"}',
            "field 'after' (the pipeline's value_root): missing, and field 'before' (the pipeline's "
            "value_root_fallback): missing",
        ),
        (
            b'{"before":[],"after":null}',
            "field 'after' (the pipeline's value_root): null, and field 'before' (the pipeline's value_root_fallback): "
            "expected a JSON object",
        ),
        # A root's object that is not an object is refused, never replaced by the fallback.
        (
            b'{"before":{"event_id":"e","customer_id":2},"after":7}',
            "field 'after' (the pipeline's value_root): expected",
        ),
    ],
)
def test_a_record_read_from_the_fallback_is_refused_naming_the_fallbacks_fields(value, expected):
    admitted = rooted(DELETES, value)
    assert admitted.values is None and admitted.reason.startswith(expected), admitted.reason


def test_a_root_and_fallback_that_share_the_missing_object_name_it_once():
    enveloped = RecordDecoder(RULES[:2], ["event_id"], ("payload", "after"), ("payload", "before"))
    assert rooted(enveloped, b'{"schema":{},"payload":null}').reason == (
        "field 'payload' (the pipeline's value_root and value_root_fallback): null"
    )
    assert rooted(enveloped, b'{"payload":{"before":{"event_id":"e","customer_id":1}}}').values == ("e", 1)


# Rows that mostly land, beside any document, so that deletes read from the fallback land too.
change_rows = st.fixed_dictionaries(
    {"event_id": st.text(max_size=4), "customer_id": st.integers(-(2**64), 2**64)},
    optional={"amount": st.integers(-(10**11), 10**11) | field_values},
)
deletes = st.fixed_dictionaries(
    {
        "op": st.sampled_from(["c", "u", "d"]) | json_values,
        "before": st.none() | change_rows | documents | json_values,
        "after": st.none() | change_rows | documents | json_values,
    },
    optional={key: values for key, values in change_fields.items() if key not in ("op", "after")},
)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(deletes.map(lambda document: _encode(document, True)), max_size=10))
def test_records_with_a_value_root_fallback_get_each_the_outcome_the_strict_path_gives(values):
    admit_checked(DELETES, values)


def test_debeziums_default_value_types_are_read_as_design_md_says():
    """ZonedTimestamp (a UTC string), MicroTimestamp (epoch: microseconds), Date (epoch: days),
    a numeric with decimal.handling.mode string (quoted_numbers); its default for numeric, base64
    bytes, is refused."""
    decoder = RecordDecoder(
        [
            FieldRule("id", "id", "bigint", required=True),
            FieldRule("updated_at", "updated_at", "timestamptz"),
            FieldRule("created_at", "created_at", "timestamptz", epoch="microseconds"),
            FieldRule("born", "born", "date", epoch="days"),
            FieldRule("price", "price", "numeric(10,2)", quoted_numbers=True),
        ],
        ["id"],
        ("after",),
        ("before",),
    )
    row = b'"id":1,"updated_at":"2025-11-25T10:00:00.123456Z","created_at":1764064800123456,"born":20417'
    admitted = rooted(decoder, b'{"after":{' + row + b',"price":"12.50"},"op":"c"}')
    moment = datetime(2025, 11, 25, 10, 0, 0, 123456, tzinfo=UTC)
    assert admitted.values == (1, moment, moment, date(2025, 11, 25), "12.50")
    refused = rooted(decoder, b'{"after":{' + row + b',"price":"BOI="},"op":"c"}').reason
    assert refused.startswith("field 'after.price': expected a number or a string holding one"), refused


def test_paths_msgspec_cannot_name_or_a_field_inside_another_columns_field_take_the_strict_path():
    weird = RecordDecoder([RULES[0], FieldRule("op", "op", "text", path=('we"ird', "op"))], ["event_id"])
    value = json.dumps({"event_id": "e", 'we"ird': {"op": "c"}}).encode()
    assert weird.decode(value) == weird.decode_strictly(value) == (("e", "c"), None)
    nested = RecordDecoder(
        [RULES[0], FieldRule("s", "s", "jsonb", path=("s",)), FieldRule("lsn", "s.lsn", "bigint", path=("s", "lsn"))]
    )
    value = b'{"event_id":"e","s":{"lsn":3}}'
    assert nested.decode(value) == nested.decode_strictly(value) == (("e", '{"lsn":3}', 3), None)


# ---------------------------------------------------------------- dates as day counts (epoch: days)

DAYS = RecordDecoder([FieldRule("event_id", "event_id", "text", True), FieldRule("day", "day", "date", epoch="days")])


def days_outcome(day: bytes):
    value = b'{"event_id":"e","day":' + day + b"}"
    admitted = DAYS.admit([value]).outcome(0)
    assert admitted == DAYS.decode_strictly(value)
    return admitted


@pytest.mark.parametrize(
    ("day", "expected"),
    [
        (b"0", date(1970, 1, 1)),
        (b"20420", date(2025, 11, 28)),
        (b"-1", date(1969, 12, 31)),
        (b"2e1", date(1970, 1, 21)),
        (b"-719162", date(1, 1, 1)),
        (b"2932896", date(9999, 12, 31)),
        (b'"2025-11-29"', date(2025, 11, 29)),
    ],
)
def test_a_date_column_with_epoch_days_reads_a_day_count_or_an_iso_date(day, expected):
    assert days_outcome(day).values == ("e", expected)


@pytest.mark.parametrize(
    ("day", "expected"),
    [
        (b"1.5", "field 'day': '1.5' is not a whole number of days"),
        (b"2932897", "field 'day': '2932897' days since 1970 is out of range for date (years 1-9999)"),
        (b"-719163", "field 'day': '-719163' days since 1970 is out of range"),
        (b"1e999999999", "field 'day': '1e999999999' days since 1970 is out of range"),
        (b"true", "field 'day': expected an ISO-8601 date string (YYYY-MM-DD), got a boolean"),
        (b'"2025-02-30"', "field 'day': '2025-02-30' is not a valid date"),
    ],
)
def test_a_day_count_that_is_no_date_is_refused_naming_why(day, expected):
    admitted = days_outcome(day)
    assert admitted.values is None and admitted.reason.startswith(expected), admitted.reason


def test_without_epoch_a_day_count_is_refused():
    assert reason(BASE + b',"day":20420}') == (
        "field 'day': a number ('20420') for a date: set the column's `epoch: days` to read numbers of days since "
        "1970-01-01"
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.lists(
        st.integers(-(10**7), 10**7).map(str) | st.floats(allow_nan=False).map(repr) | field_values.map(json.dumps),
        max_size=10,
    )
)
def test_day_counts_of_a_list_get_each_the_outcome_the_strict_path_gives(days):
    values = [b'{"event_id":"e","day":' + d.encode() + b"}" for d in days]
    admit_checked(DAYS, values)


REGISTRY = RecordDecoder(RULES, ["event_id"], value_format="schema_registry_json")


def registry_framed(value: bytes, schema_id: int = 42) -> bytes:
    """`value` as a Schema Registry JSON Schema serializer writes it: magic byte 0, the schema id, the JSON."""
    return b"\x00" + schema_id.to_bytes(4, "big") + value


def test_values_behind_a_schema_registry_header_are_admitted_as_their_json():
    good, bad = BASE + b"}", BASE + b',"qty":1.5}'
    values = [registry_framed(good), good, registry_framed(bad), registry_framed(b""), None, b"", b"\x00\x00\x00"]
    admitted = REGISTRY.admit(values)
    outcomes = [admitted.outcome(i) for i in range(len(values))]
    assert outcomes == [REGISTRY.admit([v]).outcome(0) for v in values] == [REGISTRY.decode_strictly(v) for v in values]
    assert outcomes[0] == DECODER.decode(good) and outcomes[0].reason is None
    assert outcomes[1].reason == (
        "value has no Schema Registry header (a magic byte 0 and a 4-byte schema id; plain JSON? it starts "
        "with '{'), and the pipeline's value_format is schema_registry_json"
    )
    assert outcomes[2] == DECODER.decode(bad) and outcomes[2].reason.startswith("field 'qty': ")
    assert outcomes[3].reason == "value is a Schema Registry header (schema id 42) without JSON after it"
    assert [o.reason for o in outcomes[4:]] == [
        "value is null (a tombstone)",
        "value is empty (0 bytes)",
        "value has no Schema Registry header (a magic byte 0 and a 4-byte schema id; it starts with 0x00 0x00 "
        "0x00), and the pipeline's value_format is schema_registry_json",
    ]
    assert all(column.null_count == len(values) - 1 for column in admitted.columns[:2])


def test_a_plain_json_pipeline_names_the_schema_registry_header_it_finds():
    assert reason(registry_framed(BASE + b"}", schema_id=0x85)) == (
        "value starts with a Schema Registry header (magic byte 0, schema id 133) before its JSON: set the "
        "pipeline's value_format: schema_registry_json"
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=60) | documents.map(lambda d: registry_framed(_encode(d, True))))
def test_any_bytes_behind_a_header_or_not_get_values_or_a_reason_alone_or_in_a_list(value):
    admitted = REGISTRY.admit([value, registry_framed(BASE + b"}")])
    assert admitted.outcome(0) == REGISTRY.decode(value) == REGISTRY.decode_strictly(value)
    assert admitted.outcome(1).reason is None
    assert (admitted.outcome(0).values is None) != (admitted.outcome(0).reason is None)


def test_an_epoch_with_a_megabyte_of_trailing_zeros_is_read_exactly():
    """Its zeros are dropped in one pass (one at a time, the digits were copied once per zero:
    hours for this record)."""
    zeros = b"0" * 1_000_000
    (values, reason) = outcome(BASE + b',"epoch_s":-1.5' + zeros + b"}")
    assert reason is None and values[[r.name for r in RULES].index("epoch_s")] == datetime(
        1969, 12, 31, 23, 59, 58, 500000, tzinfo=UTC
    )
    (_, reason) = outcome(BASE + b',"epoch_ms":1.0005' + zeros + b"}")
    assert reason.startswith("field 'epoch_ms': '1.0005") and "has sub-microsecond digits" in reason, reason[-200:]


def test_a_jsonb_value_of_many_digit_runs_just_short_of_the_search_is_admitted():
    """Runs of 5,999 digits (each within numeric) are each tried once by the search for a number
    too long for numeric, not once per digit."""
    decoder = RecordDecoder([FieldRule("event_id", "event_id", "text", True), FieldRule("doc", "doc", "jsonb")])
    runs = b",".join([b"1" * 5_999] * 200)
    (values, reason) = decoder.decode(b'{"event_id":"e","doc":[' + runs + b"]}")
    assert reason is None and len(values[1]) == len(runs) + 2


def test_a_jsonb_value_whose_numbers_print_past_postgresqls_text_limit_is_refused():
    """PostgreSQL prints a jsonb number in full: 1e99999 is 100,000 characters of text. A small
    record of many such numbers would be stored and never printed again (its text past 1 GB:
    the gate reading a required jsonb column, a SELECT, a pg_dump would fail on it every time)."""
    bomb = BASE + b',"payload":[' + b",".join([b"1e99999"] * 700) + b"]}"  # 70 MB of digits
    (_, reason) = outcome(bomb)
    assert reason is not None and reason.startswith("field 'payload': its numbers print more than 67,108,864"), reason
    assert "could not print it back as text" in reason
    four_digits = BASE + b',"payload":[' + b",".join([b"1e9999"] * 7000) + b"]}"  # 49 KB, 70 MB of digits
    (_, reason) = outcome(four_digits)
    assert reason is not None and "could not print it back as text" in reason, reason
    fine = BASE + b',"payload":[1e300,2.5e-10,0e99999,"1e99999",' + b",".join([b"1e9999"] * 6000) + b"]}"
    admitted = admit_checked(DECODER, [bomb, fine, four_digits])
    assert admitted.reasons[0] is not None and admitted.reasons[1] is None, admitted.reasons
    assert admitted.reasons[2] is not None
    # written in full, the same digits print as written: no expansion
    (_, reason) = outcome(BASE + b',"payload":[' + b",".join([b"1" + b"0" * 9999] * 50) + b"]}")
    assert reason is None
