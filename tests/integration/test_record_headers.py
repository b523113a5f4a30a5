"""A record's headers in quarantine, written by an independent client (kcat): a header key that
is not UTF-8 (Kafka's protocol allows any bytes) neither stops the batch nor crashes its reader."""

import json
import shutil
import subprocess

from psycopg import sql

from kafka2pg.devtools.producer import produce, sample_events


def _kcat(env, tmp_path, value: bytes, headers: list[bytes]) -> None:
    """One message on partition 0, its headers given to kcat as name=value arguments (bytes)."""
    path = tmp_path / "message.bin"
    path.write_bytes(value)
    command = [b"kcat", b"-P", b"-b", env.settings.bootstrap_servers.encode(), b"-t", env.topic.encode(), b"-p", b"0"]
    for header in headers:
        command += [b"-H", header]
    subprocess.run([*command, bytes(path)], check=True, timeout=60, capture_output=True)


def test_a_quarantined_record_whose_header_key_is_not_utf8_is_kept_without_its_headers(
    make_pipeline, run_batch, db, tmp_path
):
    assert shutil.which("kcat"), "kcat is not installed: run the suite through ./kafka2pg test, which installs it"
    env = make_pipeline(partitions=1)
    # Many quarantined records with headers first: the reader's call of each record's headers is
    # then warm (the interpreter specialises a call site after some dozens of calls).
    for n in range(80):
        _kcat(env, tmp_path, b"not json %d" % n, [b"trace=%d" % n])
    _kcat(env, tmp_path, b"not json either", [b"ok=1", b"\xff\xfebad=v"])
    good = next(iter(sample_events(1, seed=7)))
    _kcat(env, tmp_path, json.dumps(good).encode(), [b"\xc3(=landed"])  # a good record: its headers are not read
    produce(env.settings.bootstrap_servers, env.topic, [b"tail"], key_field=None)

    result = run_batch(env)

    assert (result.promoted, result.quarantined) == (1, 82)
    rows = db.execute(
        "SELECT kafka_offset, raw_value, raw_headers FROM kafka2pg.quarantine WHERE pipeline = %s ORDER BY 1",
        (env.pipeline.name,),
    ).fetchall()
    assert [[bytes(part) for part in pair] for pair in rows[5][2]] == [[b"trace", b"5"]]
    assert bytes(rows[80][1]) == b"not json either" and not rows[80][2]  # its key and value kept
    assert [o for o, *_ in rows] == [*range(81), 82]
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT kafka_offset, event_id FROM {}").format(target)).fetchall() == [
        (81, good["event_id"])
    ]
