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
