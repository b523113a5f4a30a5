"""The steps of a run that span more than one transaction, orchestrated here so the modules
below them stay free of each other: promotion (live or a replay's finish) with its retry after
a business-key collision, which runs the quality gate's deferred check in between."""

from __future__ import annotations

import logging

import psycopg
from confluent_kafka import KafkaException
from psycopg import Connection

from kafka2pg.batch_store import Batch, key_probe_deferred, load_claimed, raise_staging_lost, transition
from kafka2pg.checks import probe_keys_again
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import transaction
from kafka2pg.exceptions import BatchStateError, Kafka2PgError, KeyCollisionError, timeouts_named
from kafka2pg.kafka_offsets import commit_group_offsets
from kafka2pg.ledger import read_heads
from kafka2pg.lifecycle import BatchState
from kafka2pg.promote import PromoteResult, promote_live
from kafka2pg.quality import validate_batch
from kafka2pg.raw_bytes import QUARANTINE, keep_raw_bytes
from kafka2pg.replay import ReplayResult, finish_replay

log = logging.getLogger(__name__)


def promote_batch(
    settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None = None
) -> PromoteResult | ReplayResult:
    """Promote a validated batch (a replay batch: finish it); a second call changes nothing.

    `epoch` is the run's claim (None: the current one): a fenced-off zombie run fails with
    `LedgerConflictError` here even if the heads have not moved yet. When the target's unique
    index refuses a business key (one the gate left to it, or one promoted since the gate ran),
    the gate's promoted-key check runs again now, flags those rows to quarantine (or rejects the
    batch under duplicate_policy: fail), and the rest is promoted.
    """
    with timeouts_named(pipeline.name, batch_id, "promotion"):
        result = _promote(settings, pipeline, batch_id, epoch)
    if result.quarantined:  # again when already promoted: an attempt may have stopped before the fill
        # The rows PostgreSQL refused at promotion, and flagged rows a validation that stopped left without.
        keep_raw_bytes(settings, pipeline, batch_id, QUARANTINE)
    if pipeline.lag_consumer_group and isinstance(result, PromoteResult) and not result.already_promoted:
        mirror_heads(settings, pipeline)  # a live promotion moved the heads (a replay moves none)
    return result


def mirror_heads(settings: Settings, pipeline: Pipeline) -> None:
    """Commit the ledger heads as the pipeline's `lag_consumer_group` offsets, so Kafka's own lag
    tools see its progress. Best effort, after the promotion committed: a failure is a warning."""
    try:
        with transaction(settings.database_url) as conn:
            heads = read_heads(conn, pipeline.name)
        if heads:
            commit_group_offsets(
                settings.kafka, pipeline.lag_consumer_group, pipeline.topic, heads, settings.kafka_timeout_s
            )
    except (psycopg.Error, Kafka2PgError, KafkaException) as exc:  # informational only: the promotion stands
        log.warning(
            "pipeline=%s heads not mirrored into consumer group %s (%s: %s); the promotion stands",
            pipeline.name,
            pipeline.lag_consumer_group,
            type(exc).__name__,
            exc,
        )


# What `_send_back` and `_sent_back` find: the deferred check is still to run (or the batch is past it: its state).
_CHECK = "check"


def _promote(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None) -> PromoteResult | ReplayResult:
    try:
        return _promote_once(settings, pipeline, batch_id, epoch)
    except KeyCollisionError as exc:
        after = _send_back(settings, pipeline, batch_id, epoch)
        if after is None:
            raise
        why = f"a business key is already in the target ({exc.detail or exc.constraint})"  # escaped by rows.py
    except BatchStateError as exc:
        after = _sent_back(settings, pipeline, batch_id, epoch, exc)
        if after is None:
            raise
        why = "an earlier attempt stopped after a key collision"  # a retry of the promote task
    if after is _CHECK:
        log.warning("pipeline=%s batch_id=%s %s: running the promoted-key check again", pipeline.name, batch_id, why)
        validate_batch(settings, pipeline, batch_id, epoch, probe_promoted_keys=True)
    else:
        log.info(
            "pipeline=%s batch_id=%s is %s now (another attempt checked it since this one read it): trying again",
            pipeline.name,
            batch_id,
            after,
        )
    try:
        return _promote_once(settings, pipeline, batch_id, epoch)
    except KeyCollisionError:
        _send_back(settings, pipeline, batch_id, epoch)
        raise


def _promote_once(
    settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None
) -> PromoteResult | ReplayResult:
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        finish = finish_replay if batch.kind == "replay" else promote_live
        result = finish(conn, pipeline, batch)  # None: its staging rows were lost
    if result is None:
        raise_staging_lost(pipeline, batch_id)
    return result


def _send_back(settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None) -> str | None:
    """After a key collision: the validated batch goes back to `staged`, its promoted-key check
    to run again; `_CHECK` when that check can explain the collision (the batch has one: its gate
    deferred it to promotion, or ran it before a key was promoted since, by a live batch after a
    replay's gate, by a replay or by hand after a live batch's), else None. A batch no longer
    `validated` was sent back (or sent back and checked) by a twin attempt that collided too:
    what `_after_twin` says."""
    with transaction(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, batch_id, epoch)
        if batch.state is not BatchState.VALIDATED:
            return _after_twin(conn, batch)
        transition(conn, batch, BatchState.STAGED, error="business key promoted since validation: validate again")
        return _CHECK if probe_keys_again(conn, batch_id) else None


def _sent_back(
    settings: Settings, pipeline: Pipeline, batch_id: int, epoch: int | None, refused: BatchStateError
) -> str | None:
    """After a promotion refused the batch as `staged`: what `_after_twin` says of it now (an
    attempt stopped between a collision and the check, or one is at it now, or has run it since
    this one read the batch); None when it was refused for another state."""
    if refused.evidence.get("state") != BatchState.STAGED:
        return None
    with transaction(settings.database_url) as conn:
        return _after_twin(conn, load_claimed(conn, pipeline, batch_id, epoch))


def _after_twin(conn: Connection, batch: Batch) -> str | None:
    """What is left of a promotion another attempt may have sent back: its state when it is
    `validated`, `promoted`, `verified` or `rejected` (trying again promotes it, reports it
    done, or says it was rejected); `_CHECK` when it is `staged` with its promoted-key check to
    run again (or a replay: no other run resumes it); else None."""
    if batch.state in (BatchState.VALIDATED, BatchState.PROMOTED, BatchState.VERIFIED, BatchState.REJECTED):
        return batch.state.value
    sent_back = batch.state is BatchState.STAGED and (
        batch.kind == "replay" or key_probe_deferred(conn, batch.batch_id)
    )
    return _CHECK if sent_back else None
