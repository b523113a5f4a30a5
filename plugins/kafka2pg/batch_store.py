"""The batch store: rows of kafka2pg.batches, their claims, and the one place a batch changes
state (`transition`), as `UPDATE ... WHERE state = %s AND epoch = %s` on exactly one row."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from psycopg import Connection
from psycopg.types.json import Jsonb

from kafka2pg.config import Pipeline
from kafka2pg.exceptions import BatchStateError, LedgerConflictError, StagingLostError
from kafka2pg.lifecycle import CLI_RUN_ID, OPEN, BatchState, is_progress, require
from kafka2pg.planner import BatchPlan, describe_ranges
from kafka2pg.rows import clear_staging, staged_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """One row of kafka2pg.batches with its plan."""

    batch_id: int
    pipeline: str
    topic: str
    state: BatchState
    plan: BatchPlan
    epoch: int = 1
    run_id: str | None = None
    records_read: int | None = None
    rows_staged: int | None = None
    rows_quarantined: int | None = None
    rows_promoted: int | None = None
    kind: str = "live"


def load_batch(conn: Connection, batch_id: int, *, for_update: bool = False) -> Batch:
    query = (
        "SELECT batch_id, pipeline, topic, state, plan, epoch, run_id, records_read, rows_staged,"
        " rows_quarantined, rows_promoted, kind FROM kafka2pg.batches WHERE batch_id = %s"
    )
    # NO KEY UPDATE: steps on one batch exclude each other as with FOR UPDATE (a batch's id never
    # changes), but a lookahead planned after it may insert its reference (a foreign-key check).
    row = conn.execute(query + (" FOR NO KEY UPDATE" if for_update else ""), (batch_id,)).fetchone()
    if row is None:
        raise BatchStateError(f"batch {batch_id} does not exist in kafka2pg.batches", batch_id=batch_id)
    return Batch(row[0], row[1], row[2], BatchState(row[3]), BatchPlan.from_json(row[4]), *row[5:])


def promoted_in_run(conn: Connection, pipeline: Pipeline, batch_id: int, run_id: str | None) -> list[Batch]:
    """The batch, if promoted, and the live batches after it the same run promoted (a Spark job
    with batches_per_run > 1 promotes a run's further batches itself), in batch order."""
    rows = conn.execute(
        "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND state = %s"
        " AND (batch_id = %s OR (kind = 'live' AND run_id = %s AND batch_id > %s)) ORDER BY batch_id",
        (pipeline.name, str(BatchState.PROMOTED), batch_id, run_id, batch_id),
    ).fetchall()
    return [load_batch(conn, r[0]) for r in rows]


def load_claimed(conn: Connection, pipeline: Pipeline, batch_id: int, epoch: int | None, *, lock: bool = True) -> Batch:
    """Lock a batch for one step of a run; the run's claim (`epoch`) must still be the newest.

    `epoch=None` (manual CLI use) accepts the current claim. A zombie run holding an older
    epoch gets `LedgerConflictError` before it writes anything. `lock=False` only reads it (a
    planner under the plan lock, which every claim takes too, reading the batch it follows).
    """
    batch = load_batch(conn, batch_id, for_update=lock)
    if batch.pipeline != pipeline.name:
        raise BatchStateError.other_pipeline(pipeline.name, batch_id, batch.pipeline)
    if epoch is not None and batch.epoch != epoch:
        raise LedgerConflictError.fenced(pipeline.name, batch_id, epoch, batch.epoch, batch.run_id)
    return batch


# The column recording when a step ended, by the state it moves a batch to (the operator's
# batches page shows the steps' durations from them); the clock, not the transaction's start.
_STEP_ENDED = {
    BatchState.STAGED: "staged_at",
    BatchState.VALIDATED: "validated_at",
    BatchState.REJECTED: "validated_at",
    BatchState.PROMOTED: "promoted_at",
}
_CLEAR_FAILURES = ", failed_step = NULL, failed_epoch = NULL, failures = 0, failing_since = NULL, last_failure = NULL"


def transition(conn: Connection, batch: Batch, to_state: BatchState, **counts: int | str | None) -> Batch:
    """Move the batch from the state and claim it was loaded with to `to_state` (a move the
    lifecycle allows), setting `counts` columns; a move forward clears its recorded step
    failures, and the end of a step records when it ended (`_STEP_ENDED`). Exactly one row must
    match: a batch changed since it was loaded (another attempt, a newer claim) raises instead
    of being overwritten. Returns the moved batch."""
    require(batch.state, to_state)
    assignments = "".join(f", {name} = %({name})s" for name in counts)
    if is_progress(batch.state, to_state):
        assignments += _CLEAR_FAILURES
    if BatchState(to_state) in _STEP_ENDED and is_progress(batch.state, to_state):
        # Forward moves only: a batch sent back to `staged` (a key collision) keeps when it was staged.
        assignments += f", {_STEP_ENDED[BatchState(to_state)]} = clock_timestamp()"
    moved = conn.execute(
        f"UPDATE kafka2pg.batches SET state = %(to)s, updated_at = now(){assignments}"  # noqa: S608 - names are code constants
        " WHERE batch_id = %(batch_id)s AND state = %(from)s AND epoch = %(epoch)s",
        {"to": str(to_state), "from": str(batch.state), "epoch": batch.epoch, "batch_id": batch.batch_id, **counts},
    ).rowcount
    if moved != 1:
        raise LedgerConflictError.changed_since_loaded(
            batch.pipeline, batch.batch_id, batch.state, batch.epoch, BatchState(to_state)
        )
    log.info("pipeline=%s batch_id=%s state %s -> %s", batch.pipeline, batch.batch_id, batch.state, to_state)
    return replace(batch, state=BatchState(to_state))


def staging_lost(conn: Connection, pipeline: Pipeline, batch: Batch, staged: dict[int, int] | None = None) -> bool:
    """True when a staged batch's rows are no longer all there (crash recovery empties UNLOGGED
    tables); the batch is then put back to `planned` so the next run re-reads it from Kafka.
    `staged`: the batch's `staged_counts`, when the caller has them from this transaction."""
    read = dict(
        conn.execute(
            "SELECT kafka_partition, coalesce(records_read, 0) FROM kafka2pg.batch_partitions"
            " WHERE batch_id = %s AND coalesce(records_read, 0) > 0",
            (batch.batch_id,),
        ).fetchall()
    )
    if (staged_counts(conn, pipeline, batch.batch_id) if staged is None else staged) == read:
        return False
    log.error("pipeline=%s batch_id=%s staging rows lost; batch reset to planned", pipeline.name, batch.batch_id)
    transition(
        conn, batch, BatchState.PLANNED, error="staging rows lost (PostgreSQL crash recovery?); re-staged by next run"
    )
    return True


def raise_staging_lost(pipeline: Pipeline, batch_id: int) -> None:
    raise StagingLostError(pipeline.name, batch_id)


def open_batch_id(conn: Connection, pipeline: Pipeline) -> int | None:
    """The pipeline's unfinished live batch (the root: lowest id; a lookahead comes after it), locked."""
    ids = open_live_ids(conn, pipeline)
    return ids[0] if ids else None


_OPEN_LIVE = (
    "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s AND kind = 'live' AND state = ANY(%s)"
    " AND batch_id > %s ORDER BY batch_id"
)
_OPEN_LIVE_LOCKED = _OPEN_LIVE + " FOR UPDATE"


def open_live_ids(conn: Connection, pipeline: Pipeline, after: int = 0, *, locked: bool = True) -> list[int]:
    """The pipeline's open live batches (with ids above `after`), locked unless not `locked`, in id
    order."""
    rows = conn.execute(
        _OPEN_LIVE_LOCKED if locked else _OPEN_LIVE,
        (pipeline.name, [str(s) for s in OPEN], after),
    ).fetchall()
    return [r[0] for r in rows]


def abandon_lookaheads(conn: Connection, pipeline: Pipeline, reason: str) -> list[int]:
    """Abandon every open live batch after the root: the lookahead of a run now fenced off."""
    ids = open_live_ids(conn, pipeline)[1:]
    for batch_id in ids:
        abandon_unpromoted(conn, pipeline, load_batch(conn, batch_id), reason)
    return ids


def abandon_unpromoted(conn: Connection, pipeline: Pipeline, batch: Batch, reason: str) -> None:
    """Mark an open batch `abandoned` and drop its staging rows: nothing of it was promoted, and
    its offsets are planned afresh by the next run."""
    transition(conn, batch, BatchState.ABANDONED, error=reason)
    clear_staging(conn, pipeline, batch.batch_id)


def claim(conn: Connection, batch: Batch, run_id: str | None, *, job_retry: bool = False) -> Batch:
    """Take an unfinished batch over: bump its epoch so the previous run's later steps are fenced.

    `job_retry`: the claim of an Airflow retry of a stage job of several batches, taking over the
    batch its earlier try held (same run): a failure that try recorded at the current epoch moves
    to the new one, so STUCK, which counts runs, does not count the retry's failure as another
    run's. A plan task's claim (a new run, or a run cleared in Airflow's UI) counts as a run."""
    epoch = conn.execute(
        "UPDATE kafka2pg.batches SET epoch = epoch + 1, claimed_at = now(), updated_at = now(),"
        " failed_epoch = CASE WHEN %(airflow)s AND run_id = %(run)s AND failed_epoch = epoch"
        "   THEN epoch + 1 ELSE failed_epoch END, run_id = %(run)s"
        " WHERE batch_id = %(batch)s RETURNING epoch",
        # an Airflow run's id; the CLI's processes share one, each a run of its own
        {"run": run_id, "batch": batch.batch_id, "airflow": job_retry and run_id not in (None, CLI_RUN_ID)},
    ).fetchone()[0]
    log.warning(
        "pipeline=%s batch_id=%s resumed in state %s: claim epoch %s -> %s (previous run %s is fenced off)",
        batch.pipeline,
        batch.batch_id,
        batch.state,
        batch.epoch,
        epoch,
        batch.run_id,
    )
    return replace(batch, epoch=epoch, run_id=run_id)


def insert_batch(
    conn: Connection,
    pipeline: Pipeline,
    plan: BatchPlan,
    run_id: str | None,
    kind: str = "live",
    *,
    after_batch_id: int | None = None,
) -> Batch:
    """Record a planned batch (live or replay) with its ranges; `after_batch_id`: a lookahead."""
    batch_id = conn.execute(
        "INSERT INTO kafka2pg.batches (pipeline, topic, kind, state, plan, run_id, records_planned, after_batch_id)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING batch_id",
        (
            pipeline.name,
            pipeline.topic,
            kind,
            str(BatchState.PLANNED),
            Jsonb(plan.to_json()),
            run_id,
            plan.record_budget,
            after_batch_id,
        ),
    ).fetchone()[0]
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO kafka2pg.batch_partitions (batch_id, kafka_partition, start_offset, end_offset)"
            " VALUES (%s, %s, %s, %s)",
            [(batch_id, r.partition, r.start, r.end) for r in plan.ranges],
        )
    log.info("pipeline=%s batch_id=%s planned %s %s", pipeline.name, batch_id, kind, _describe(plan))
    return Batch(batch_id, pipeline.name, pipeline.topic, BatchState.PLANNED, plan, run_id=run_id, kind=kind)


def _describe(plan: BatchPlan) -> str:
    parts = [describe_ranges(plan.ranges)] if plan.ranges else []
    parts += [f"p{g.partition} {g.kind}[{g.start},{g.end})" for g in plan.gaps]
    return " ".join(parts)


def key_probe_deferred(conn: Connection, batch_id: int) -> bool:
    """Whether the batch's promoted-key check is still to run: its last validation left it to
    promotion, or a key collision at promotion sent the batch back to run it again."""
    return conn.execute(
        "SELECT EXISTS (SELECT FROM kafka2pg.batch_checks WHERE batch_id = %s AND deferred)", (batch_id,)
    ).fetchone()[0]
