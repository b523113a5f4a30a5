"""The Airflow Asset events of a run (DESIGN step 5): the target table's URI, built from the resolved
PostgreSQL connection without its credentials, and one event for the batches a run promoted.

The DAG's tasks emit them through the pipeline's AssetAlias (dag_factory); nothing depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from kafka2pg.batch_store import Batch, promoted_in_run
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction
from kafka2pg.planner import OffsetRange


@dataclass(frozen=True)
class TableEvent:
    """One Asset event: the target table's URI and what the run's batches brought to it."""

    uri: str
    extra: dict


def target_uri(database_url: str, schema: str, table: str) -> str:
    """`postgres://host:port/database/schema/table`, the form the postgres provider's URI sanitizer
    accepts unchanged (port written out), so a downstream `Asset("<this uri>")` is the same asset.
    Only host, port and database name are taken from the connection: never user or password."""
    params = conninfo_to_dict(database_url)
    host = _first(params.get("host")) or "localhost"
    port = _first(params.get("port")) or "5432"
    database = params.get("dbname") or params.get("user") or "postgres"  # libpq's default database: the user's
    if host.startswith("/"):  # a Unix socket directory
        host = quote(host, safe="")
    elif ":" in host:  # IPv6
        host = f"[{host}]"
    path = "/".join(quote(part, safe="") for part in (database, schema, table))
    return f"postgres://{host}:{port}/{path}"


def run_event(uri: str, batches: list[Batch]) -> TableEvent | None:
    """The event of the batches one task run promoted (None: none): the first batch's id (the one the
    run planned), every id, kind (live or replay), rows promoted to the target, rows quarantined, and
    the offset ranges read (end exclusive, adjacent ranges of a partition joined).

    One event per run, not one per batch: Airflow gives a downstream run the events up to the moment
    the first of them queued it, so a second event of the same task run would wait for a later one."""
    if not batches:
        return None
    return TableEvent(
        uri,
        {
            "batch_id": batches[0].batch_id,
            "batch_ids": [b.batch_id for b in batches],
            "kind": batches[0].kind,
            "rows": sum(b.rows_promoted or 0 for b in batches),
            "quarantined": sum(b.rows_quarantined or 0 for b in batches),
            "ranges": _joined([r for b in batches for r in b.plan.ranges]),
        },
    )


def run_event_of(settings: Settings, pipeline: Pipeline, batch_id: int, run_id: str | None) -> TableEvent | None:
    """The event of a run that finished `batch_id`: the batch, and a live run's further batches its
    Spark job promoted; None when nothing was promoted (a verify-only replay)."""
    uri = target_uri(settings.database_url, pipeline.target_schema, pipeline.target_table)
    with transaction(settings.database_url) as conn:
        batches = promoted_in_run(conn, pipeline, batch_id, run_id)
    return run_event(uri, batches)


def _joined(ranges: list[OffsetRange]) -> list[dict]:
    joined: list[dict] = []
    for r in sorted(ranges, key=lambda r: (r.partition, r.start)):
        last = joined[-1] if joined else None
        if last is not None and last["partition"] == r.partition and last["end"] == r.start:
            last["end"] = r.end
        else:
            joined.append({"partition": r.partition, "start": r.start, "end": r.end})
    return joined


def _first(value: str | None) -> str | None:
    """The first of libpq's comma-separated hosts or ports: one name for the table wherever it is served."""
    return value.split(",")[0].strip() if value else None
