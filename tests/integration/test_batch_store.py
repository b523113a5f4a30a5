"""The batch store applies a lifecycle move only to the batch as it was loaded: same state,
same claim epoch, exactly one row; anything else raises and changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from kafka2pg.batch_store import load_batch, transition
from kafka2pg.database import transaction
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import LedgerConflictError
from kafka2pg.lifecycle import BatchState, IllegalTransition
from kafka2pg.opening import open_batch


def _state(db, batch_id: int) -> tuple[str, int, str | None]:
    return db.execute("SELECT state, epoch, error FROM kafka2pg.batches WHERE batch_id = %s", (batch_id,)).fetchone()


def test_a_move_applies_to_the_state_and_claim_it_was_loaded_with_and_to_nothing_else(make_pipeline, db):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, sample_events(5, seed=3))
    batch = open_batch(env.settings, env.pipeline).batch
    assert (batch.state, batch.epoch) == (BatchState.PLANNED, 1)

    with transaction(env.settings.database_url) as conn:
        stale_claim = dataclasses.replace(load_batch(conn, batch.batch_id), epoch=0)
        with pytest.raises(LedgerConflictError) as conflict:
            transition(conn, stale_claim, BatchState.ABANDONED, error="zombie")
    assert (conflict.value.batch_id, conflict.value.epoch, conflict.value.to_state) == (batch.batch_id, 0, "abandoned")
    assert _state(db, batch.batch_id) == ("planned", 1, None)

    with transaction(env.settings.database_url) as conn:
        stale_state = dataclasses.replace(load_batch(conn, batch.batch_id), state=BatchState.STAGED)
        with pytest.raises(LedgerConflictError) as conflict:
            transition(conn, stale_state, BatchState.VALIDATED)
    assert conflict.value.state == "staged"
    assert _state(db, batch.batch_id) == ("planned", 1, None)

    with transaction(env.settings.database_url) as conn:
        with pytest.raises(IllegalTransition):
            transition(conn, load_batch(conn, batch.batch_id), BatchState.PROMOTED)
    assert _state(db, batch.batch_id) == ("planned", 1, None)

    with transaction(env.settings.database_url) as conn:
        moved = transition(conn, load_batch(conn, batch.batch_id), BatchState.ABANDONED, error="superseded")
    assert moved.state is BatchState.ABANDONED
    assert _state(db, batch.batch_id) == ("abandoned", 1, "superseded")
