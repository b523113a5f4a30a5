"""Each batch's quality result in kafka2pg.quality_results: stored in the quality gate's
transaction with the verdict, read back to render the report (Airflow pages, `kafka2pg report`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import partial

from psycopg import Connection
from psycopg.types.json import Json


def store_result(conn: Connection, batch_id: int, payload: dict) -> datetime:
    """Record (or replace, for a batch validated again) the batch's result, in the caller's
    transaction; its `validated_at`, which tells this result from a later one of the batch."""
    return conn.execute(
        "INSERT INTO kafka2pg.quality_results (batch_id, verdict, result) VALUES (%s, %s, %s)"
        " ON CONFLICT (batch_id) DO UPDATE SET verdict = EXCLUDED.verdict, result = EXCLUDED.result,"
        " validated_at = now() RETURNING validated_at",
        (batch_id, payload["verdict"], Json(payload, dumps=partial(json.dumps, default=str))),
    ).fetchone()[0]


def load_result(conn: Connection, pipeline: str, batch_id: int) -> dict | None:
    """The stored result of the pipeline's batch; None when the batch has none (not validated yet)."""
    row = conn.execute(
        "SELECT r.result FROM kafka2pg.quality_results r JOIN kafka2pg.batches b USING (batch_id)"
        " WHERE b.batch_id = %s AND b.pipeline = %s",
        (batch_id, pipeline),
    ).fetchone()
    return None if row is None else row[0]


def latest_result_batch(conn: Connection, pipeline: str) -> int | None:
    """The newest of the pipeline's batches with a stored result (None: none validated yet)."""
    row = conn.execute(
        "SELECT max(r.batch_id) FROM kafka2pg.quality_results r JOIN kafka2pg.batches b USING (batch_id)"
        " WHERE b.pipeline = %s",
        (pipeline,),
    ).fetchone()
    return row[0]
