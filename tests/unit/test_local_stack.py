"""The local stack's pure helpers (the broker and PostgreSQL themselves are exercised by every
integration test)."""

from __future__ import annotations

import uuid

from kafka2pg import local_stack


def test_a_kraft_cluster_id_never_starts_with_a_dash(monkeypatch):
    """One random id in 64 starts with "-" (URL-safe base64 of a first byte 0xf8-0xfb); StorageTool
    then took `-t -…` for a missing id and failed to format the broker's storage."""
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" + bytes(15))])
    monkeypatch.setattr(local_stack.uuid, "uuid4", lambda: next(draws))
    cluster_id = local_stack.new_cluster_id()
    assert cluster_id == "AQAAAAAAAAAAAAAAAAAAAA"
    assert next(draws, None) is None, "the dash-led id must have been drawn and refused"
    monkeypatch.undo()
    ids = {local_stack.new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_stack_reset_without_confirm_deletes_nothing(tmp_path, monkeypatch, capsys):
    """`stack reset` lists what it would delete and exits 1; only --confirm deletes. The recorded
    PIDs belong to no running broker or cluster, so nothing is stopped either."""
    from kafka2pg import cli

    work = local_stack.stack_dir(tmp_path)
    kafka_dir, cluster = work / "kafka", tmp_path / "elsewhere" / "kafka2pg-pg-x"
    for folder in (kafka_dir / "logs", cluster / "data"):
        folder.mkdir(parents=True)
        (folder / "kept").write_text("data")
    stack = local_stack.Stack(
        local_stack.KafkaProcess(1, 9, 10, str(kafka_dir), str(kafka_dir / "kafka.log")),
        local_stack.PostgresProcess(1, 11, str(cluster / "data"), str(cluster / "postgres.log"), "/nonexistent"),
    )
    local_stack.save_stack(stack, tmp_path)
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))

    assert cli.main(["stack", "reset"]) == 1
    output = capsys.readouterr().out
    assert "would stop the local stack and delete" in output and "nothing changed" in output
    assert all(str(path) in output for path in (kafka_dir, cluster, work))
    assert (kafka_dir / "logs" / "kept").exists() and (cluster / "data" / "kept").exists()
    assert local_stack.load_stack(tmp_path) == stack

    assert cli.main(["stack", "reset", "--confirm"]) == 0
    assert not kafka_dir.exists() and not cluster.exists() and not work.exists()
    assert cli.main(["stack", "reset"]) == 0, "nothing left to delete"
