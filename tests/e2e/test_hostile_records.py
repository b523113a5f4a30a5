"""Hostile records, written by independent clients (confluent-kafka and kcat) among good ones,
through one `airflow dags test` run: each lands once, in the target with the values produced,
or in quarantine with its raw bytes and a reason naming the field and the rule."""

import json
import shutil
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from confluent_kafka import Producer
from psycopg import sql

from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import sample_events
from kafka2pg.kafka_offsets import client_config, partition_offsets

WEIRD_FIELD = 'we"ird.na me'
COLUMNS = [
    {"name": "event_id", "type": "text", "required": True},
    {"name": "customer_id", "type": "bigint", "required": True},
    {"name": "amount", "type": "numeric(12,2)"},
    {"name": "note", "type": "text"},
    {"name": "event_time", "type": "timestamptz", "field": "ts"},
    {"name": "sent_at", "type": "timestamptz", "field": "ms", "epoch": "milliseconds"},
    {"name": "day", "type": "date"},
    {"name": "ok", "type": "boolean"},
    {"name": "payload", "type": "jsonb"},
    {"name": "ratio", "type": "double precision"},
    {"name": "qty", "type": "integer"},
    {"name": "weird", "type": "text", "field": WEIRD_FIELD},
]
NOW = datetime.now(UTC).replace(microsecond=123456)


def doc(event_id: str, **fields) -> bytes:
    return json.dumps({"event_id": event_id, "customer_id": 7, **fields}, ensure_ascii=False).encode()


def raw(event_id: str, tail: bytes) -> bytes:
    """A JSON object written by hand: `tail` follows the key fields (it closes the object)."""
    return b'{"event_id":"' + event_id.encode() + b'","customer_id":7' + tail


# kind: (value, key, headers, expected) -- expected is ("target", {column: value}) or
# ("quarantine", reason prefix). Partitions are assigned round-robin, writers alternate.
DEEP = b"[" * 3000 + b"]" * 3000
KINDS = {
    "binary value": (
        b"\xff\xfe\x00\x01",
        b"\x00key",
        [("trace", b"\x00\x01\xff"), ("empty", b""), ("none", None)],
        ("quarantine", "value is not valid UTF-8 (byte 0xff at position 0"),
    ),
    "invalid UTF-8 inside JSON": (
        raw("u1", b',"note":"a\xc3\x28b"}'),
        b"k1",
        [("source", b"kcat"), ("h\u00e9", "v\u00e9".encode())],
        ("quarantine", "value is not valid UTF-8 (byte 0xc3"),
    ),
    "raw NUL byte": (
        raw("u2", b',"note":"a\x00b"}'),
        None,
        [],
        ("quarantine", "value is not valid JSON (Invalid control character"),
    ),
    "NUL escape in text": (
        raw("u3", b',"note":"a\\u0000b"}'),
        None,
        [],
        ("quarantine", "field 'note': contains NUL (U+0000)"),
    ),
    "NUL escape in jsonb": (
        raw("u4", b',"payload":{"k":"\\u0000"}}'),
        None,
        [],
        ("quarantine", "field 'payload': contains NUL"),
    ),
    "NUL escape in business key": (
        b'{"event_id":"a\\u0000","customer_id":1}',
        None,
        [],
        ("quarantine", "field 'event_id': contains NUL"),
    ),
    "lone surrogate in jsonb": (
        raw("u5", b',"payload":{"k":"\\ud800"}}'),
        None,
        [],
        ("quarantine", "field 'payload': contains a lone surrogate U+D800"),
    ),
    "lone surrogate in text": (
        raw("u6", b',"note":"\\udfff"}'),
        None,
        [],
        ("quarantine", "field 'note': contains a lone surrogate U+DFFF"),
    ),
    "year -5000": (
        doc("u7", ts="-5000-01-01T00:00:00Z"),
        None,
        [],
        ("quarantine", "field 'ts': timestamp out of range for timestamptz (year -5000"),
    ),
    "year 40000": (
        doc("u8", ts="+40000-01-01T00:00:00Z"),
        None,
        [],
        ("quarantine", "field 'ts': timestamp out of range for timestamptz (year 40000"),
    ),
    "year 67561": (
        doc("u9", ts="+67561-11-25T10:00:00Z"),
        None,
        [],
        ("quarantine", "field 'ts': timestamp out of range for timestamptz (year 67561"),
    ),
    "negative epoch number": (
        raw("u10", b',"ts":-3e11}'),
        None,
        [],
        ("quarantine", "field 'ts': a number ('-3e11') for a timestamp"),
    ),
    "epoch millis without a unit": (
        doc("u11", ts=2069880429600),
        None,
        [],
        ("quarantine", "field 'ts': a number ('2069880429600')"),
    ),
    "epoch millis out of range": (
        doc("u12", ms=-(10**15)),
        None,
        [],
        ("quarantine", "field 'ms': '-1000000000000000' milliseconds since 1970 is out of range"),
    ),
    "sub-microsecond timestamp": (
        doc("u13", ts="2025-11-25T10:00:00.1234567Z"),
        None,
        [],
        ("quarantine", "field 'ts': '2025-11-25T10:00:00.1234567Z' has sub-microsecond"),
    ),
    "odd timestamp format": (
        doc("u14", ts="25/11/2025 10:00"),
        None,
        [],
        ("quarantine", "field 'ts': '25/11/2025 10:00' is not an ISO-8601 timestamp"),
    ),
    "12 KB business key": (
        doc("k" * 12_000),
        None,
        [],
        ("quarantine", "business key is 12024 bytes, over the 2704-byte index limit"),
    ),
    "trailing garbage": (raw("u15", b"} }{garbage"), None, [], ("quarantine", "value is not valid JSON (Extra data")),
    "tombstone": (None, b"gone", [], ("quarantine", "value is null (a tombstone)")),
    "empty value": (b"", b"empty", [], ("quarantine", "value is empty (0 bytes)")),
    "JSON array": (b"[1, 2]", None, [], ("quarantine", "value is a JSON array, not an object")),
    "deep nesting": (
        raw("u16", b',"payload":' + DEEP + b"}"),
        None,
        [],
        ("quarantine", "field 'payload': JSON nested deeper than 900 levels"),
    ),
    "number as string": (
        doc("u17", qty="5"),
        None,
        [],
        ("quarantine", "field 'qty': expected a JSON integer for integer, got a string"),
    ),
    "boolean for a number": (
        doc("u18", customer_id=True),
        None,
        [],
        ("quarantine", "field 'customer_id': expected a JSON integer for bigint, got a boolean"),
    ),
    "numeric scale": (
        raw("u19", b',"amount":1.234}'),
        None,
        [],
        ("quarantine", "field 'amount': '1.234' has 3 digits after the point"),
    ),
    "numeric precision": (
        raw("u20", b',"amount":1e20}'),
        None,
        [],
        ("quarantine", "field 'amount': '1e20' has 21 digits before the point"),
    ),
    "bigint overflow": (
        raw("u21", b',"customer_id":9223372036854775808}'),
        None,
        [],
        ("quarantine", "field 'customer_id': '9223372036854775808' is out of range for bigint"),
    ),
    "double overflow": (
        raw("u22", b',"ratio":1e400}'),
        None,
        [],
        ("quarantine", "field 'ratio': '1e400' is out of range for double precision"),
    ),
    "impossible date": (
        doc("u23", day="2025-02-30"),
        None,
        [],
        ("quarantine", "field 'day': '2025-02-30' is not a valid date"),
    ),
    "missing business key": (b'{"customer_id":1}', None, [], ("quarantine", "field 'event_id': required but missing")),
    "huge invalid value": (
        raw("u24", b',"note":"' + b"x" * 900_000 + b"}"),
        None,
        [],
        ("quarantine", "value is not valid JSON"),
    ),
    # Records that land, with the values as produced.
    "emoji, RTL and combining characters": (
        doc(
            "\U0001f600-\u05e9\u05dc\u05d5\u05dd-e\u0301", note="\u202eRTL \u0645\u0631\u062d\u0628\u0627 a\u0308\u0304"
        ),
        "\U0001f511".encode(),
        [("h\u00e9", b"\x00\xff")],
        (
            "target",
            {
                "event_id": "\U0001f600-\u05e9\u05dc\u05d5\u05dd-e\u0301",
                "note": "\u202eRTL \u0645\u0631\u062d\u0628\u0627 a\u0308\u0304",
            },
        ),
    ),
    "field name with quotes and dots": (
        doc("t1", **{WEIRD_FIELD: "odd name"}),
        None,
        [],
        ("target", {"weird": "odd name"}),
    ),
    "jsonb string stays a string": (doc("t2", payload="hello"), None, [], ("target", {"payload": '"hello"'})),
    "jsonb numeric-looking string": (doc("t3", payload="123"), None, [], ("target", {"payload": '"123"'})),
    "jsonb object in a string": (
        doc("t4", payload='{"a":1}'),
        None,
        [],
        ("target", {"payload": json.dumps('{"a":1}')}),
    ),
    "jsonb big numbers": (
        raw("t5", b',"payload":{"n":1e300,"i":123456789012345678901234567890}}'),
        None,
        [],
        ("target", {"payload": '{"n": 1e300, "i": 123456789012345678901234567890}'}),
    ),
    "10,000 fields": (
        doc("t6", note="wide", **{f"f{i}": i for i in range(10_000)}),
        None,
        [],
        ("target", {"note": "wide"}),
    ),
    "binary key and headers": (
        doc("t7", note="keyed"),
        b"\x00\xff\xfe key",
        [("bin", b"\x00\x01"), ("none", None)],
        ("target", {"note": "keyed"}),
    ),
    "timestamp with an offset": (
        doc("t8", ts="2025-11-25T10:00:00.123456-02:30"),
        None,
        [],
        ("target", {"event_time": datetime(2025, 11, 25, 12, 30, 0, 123456, tzinfo=UTC)}),
    ),
    "timestamp without an offset": (
        doc("t9", ts="2025-11-25 10:00"),
        None,
        [],
        ("target", {"event_time": datetime(2025, 11, 25, 10, 0, tzinfo=UTC)}),
    ),
    "epoch milliseconds with a unit": (
        doc("t10", ms=2069880429600),
        None,
        [],
        ("target", {"sent_at": datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=2069880429600)}),
    ),
    "extreme numbers": (
        raw("t11", b',"amount":-9999999999.99,"ratio":5e-324,"qty":-2147483648}'),
        None,
        [],
        ("target", {"amount": Decimal("-9999999999.99"), "ratio": 5e-324, "qty": -(2**31)}),
    ),
    "trailing zeros beyond the scale": (
        raw("t12", b',"amount":1.2300}'),
        None,
        [],
        ("target", {"amount": Decimal("1.23")}),
    ),
    "empty string is not null": (doc("t13", note=""), None, [], ("target", {"note": "", "day": None})),
    "repeated field keeps the last": (
        b'{"event_id":"first","customer_id":7,"event_id":"t14"}',
        None,
        [],
        ("target", {"event_id": "t14"}),
    ),
    "huge valid value": (doc("t15", note="y" * 900_000), None, [], ("target", {"note": "y" * 900_000})),
    "every type": (
        doc(
            "t16",
            amount=12.5,
            ts=NOW.isoformat(),
            day="2024-02-29",
            ok=False,
            payload={"k": [1, None, "x"]},
            ratio=0.1,
            qty=3,
        ),
        b"k",
        [],
        (
            "target",
            {
                "amount": Decimal("12.50"),
                "event_time": NOW,
                "day": date(2024, 2, 29),
                "ok": False,
                "payload": '{"k": [1, null, "x"]}',
                "ratio": 0.1,
                "qty": 3,
            },
        ),
    ),
    "jsonb numbers printing past 1 GB": (
        raw("u31", b',"payload":[' + b",".join([b"1e99999"] * 700) + b"]}"),  # 70 MB of digits as text
        None,
        [],
        ("quarantine", "field 'payload': its numbers print more than 67,108,864 characters longer than"),
    ),
    "Schema Registry header": (
        b"\x00\x00\x00\x01\x85" + doc("u1r"),
        None,
        [],
        ("quarantine", "value starts with a Schema Registry header (magic byte 0, schema id 389) before its JSON: set"),
    ),
}


def _write_confluent(producer: Producer, topic: str, partition: int, value, key, headers) -> int:
    offsets = []

    def delivered(err, msg):
        assert err is None, err
        offsets.append(msg.offset())

    producer.produce(topic, value=value, key=key, headers=headers or None, partition=partition, on_delivery=delivered)
    producer.flush(30)
    return offsets[0]


def _write_kcat(env, tmp_path, partition: int, value: bytes | None, key: bytes | None, headers) -> int:
    """kcat writes the file as one message (-Z: an empty file is a null value, a tombstone)."""
    before = {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}[partition]
    path = tmp_path / "message.bin"
    path.write_bytes(value or b"")
    command = ["kcat", "-P", "-b", env.settings.bootstrap_servers, "-t", env.topic, "-p", str(partition)]
    if value is None:
        command.append("-Z")
    if key is not None:
        command += ["-k", key.decode()]
    for name, header in headers:
        command += ["-H", f"{name}={header.decode()}"]
    subprocess.run([*command, str(path)], check=True, timeout=60, capture_output=True)
    after = {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}[partition]
    assert after == before + 1
    return before


def _kcat_can_write(value, key, headers) -> bool:
    """kcat takes keys and header values as text arguments, and writes an empty file as null only."""
    textual = all(v is not None and b"\x00" not in v for _, v in headers)
    return value != b"" and (key is None or b"\x00" not in key and key.isascii()) and textual


def test_every_hostile_record_lands_once_in_target_or_quarantine_through_one_dag_run(
    airflow_env,
    make_pipeline,
    db,
    tmp_path,
):
    assert shutil.which("kcat"), "kcat is not installed: run the suite through ./kafka2pg test, which installs it"
    env = make_pipeline(partitions=3, columns=COLUMNS, max_records_per_batch=40, batches_per_run=100)
    producer = Producer({**client_config(env.settings.bootstrap_servers, 10), "message.max.bytes": 2_000_000})
    placed = {}  # kind -> (partition, offset, writer)
    good = []
    events = iter(sample_events(150, seed=91))
    for index, (kind, (value, key, headers, _)) in enumerate(KINDS.items()):
        partition = index % 3
        for event in [next(events), next(events)]:  # good records around each hostile one
            good.append(
                (partition, _write_confluent(producer, env.topic, partition, doc(event["event_id"]), None, []), event)
            )
        if index % 2 and _kcat_can_write(value, key, headers):
            placed[kind] = (partition, _write_kcat(env, tmp_path, partition, value, key, headers), "kcat")
        else:
            placed[kind] = (
                partition,
                _write_confluent(producer, env.topic, partition, value, key, headers),
                "confluent-kafka",
            )
    assert sum(writer == "kcat" for *_, writer in placed.values()) >= 10

    code, output, _ = dags_test(env.pipeline.dag_id, airflow_env(env), tmp_path / "run.log")
    assert code == 0, output[-4000:]
    assert "state=failed" not in output and "Marking task as FAILED" not in output, output[-4000:]

    columns = [c["name"] for c in COLUMNS]
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    landed = {
        (r[0], r[1]): dict(zip(columns, r[2:], strict=True))
        for r in db.execute(
            sql.SQL("SELECT kafka_partition, kafka_offset, {} FROM {}").format(
                sql.SQL(", ").join(
                    sql.SQL("{}::text").format(sql.Identifier(c)) if c == "payload" else sql.Identifier(c)
                    for c in columns
                ),
                target,
            )
        )
    }
    quarantined = {
        (r[0], r[1]): r[2:]
        for r in db.execute(
            "SELECT kafka_partition, kafka_offset, reason, raw_key, raw_value, raw_headers FROM kafka2pg.quarantine"
            " WHERE pipeline = %s",
            (env.pipeline.name,),
        )
    }
    # Every offset in exactly one place.
    highs = {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}
    every = {(p, o) for p, high in highs.items() for o in range(high)}
    assert set(landed) | set(quarantined) == every
    assert not set(landed) & set(quarantined)

    problems = []
    for kind, (value, key, headers, (place, expected)) in KINDS.items():
        where = placed[kind][:2]
        if place == "quarantine":
            if where not in quarantined:
                problems.append(f"{kind}: expected in quarantine, landed as {landed.get(where)}")
                continue
            reason, raw_key, raw_value, raw_headers = quarantined[where]
            if not reason.startswith(expected):
                problems.append(f"{kind}: reason {reason!r}, expected {expected!r}")
            if (raw_key, raw_value) != (key, value):
                problems.append(f"{kind}: raw key/value not kept byte for byte")
            stored = [tuple(h) for h in raw_headers or []]
            if stored != [(n.encode(), v) for n, v in headers]:
                problems.append(f"{kind}: headers {stored} != {headers}")
        else:
            if where not in landed:
                problems.append(f"{kind}: expected in the target, quarantined: {quarantined.get(where, ('?',))[0]}")
                continue
            row = landed[where]
            for column, produced in expected.items():
                stored = row[column]
                if column == "payload":  # jsonb by value, numbers as exact decimals
                    exact = {"parse_float": Decimal, "parse_int": Decimal}
                    stored, produced = json.loads(stored, **exact), json.loads(produced, **exact)
                if stored != produced:
                    problems.append(f"{kind}: {column} = {str(stored)[:80]!r}, produced {str(produced)[:80]!r}")
    assert not problems, "\n".join(problems)

    for partition, offset, event in good:
        row = landed[(partition, offset)]
        assert (row["event_id"], row["customer_id"]) == (event["event_id"], 7)

    environment = airflow_env(env)
    verify = subprocess.run(
        [sys.executable, "-m", "kafka2pg", "verify", "--pipeline", env.pipeline.name],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0 and "result: clean" in verify.stdout, verify.stdout + verify.stderr
