"""The batch lifecycle: every move between two states is either allowed or refused, as the
table below (written out independently of the module) says; and the steps' pure decisions."""

from __future__ import annotations

import itertools

import pytest

from kafka2pg.lifecycle import (
    FINAL,
    OPEN,
    TRANSITIONS,
    Action,
    BatchState,
    IllegalTransition,
    allowed,
    gate_verdict,
    is_progress,
    promote_action,
    replay_outcome,
    require,
    resume_or_abandon,
    stage_action,
    validate_action,
)

P, S, V = BatchState.PLANNED, BatchState.STAGED, BatchState.VALIDATED
PR, R, A = BatchState.PROMOTED, BatchState.REJECTED, BatchState.ABANDONED
VE, U = BatchState.VERIFIED, BatchState.UNDONE

EXPECTED = {
    (P, S),  # staged
    (P, A),  # superseded, fenced lookahead, reset, undo, expired offsets
    (S, V),  # the gate passed
    (S, R),  # the gate failed
    (S, P),  # staging rows lost
    (S, A),
    (V, PR),  # promoted (a live batch, or a replay that replaces)
    (V, VE),  # a verify-only replay
    (V, S),  # a key collision at promotion: validate again
    (V, P),  # staging rows lost
    (V, A),
    (PR, U),  # undo
}


def test_the_states_are_the_ones_the_database_allows():
    assert {str(s) for s in BatchState} == {
        "planned",
        "staged",
        "validated",
        "promoted",
        "rejected",
        "abandoned",
        "verified",
        "undone",
    }
    assert OPEN | FINAL == set(BatchState) and not OPEN & FINAL


@pytest.mark.parametrize(("from_state", "to_state"), list(itertools.product(BatchState, repeat=2)))
def test_every_transition_is_allowed_or_refused_as_the_table_says(from_state, to_state):
    expected = (from_state, to_state) in EXPECTED
    assert allowed(from_state, to_state) is expected
    assert allowed(str(from_state), str(to_state)) is expected
    if expected:
        require(from_state, to_state)
    else:
        with pytest.raises(IllegalTransition) as refused:
            require(from_state, to_state)
        assert (refused.value.from_state, refused.value.to_state) == (from_state, to_state)


def test_final_states_have_no_way_out_except_undoing_a_promotion():
    for state in FINAL:
        assert TRANSITIONS[state] == (frozenset({U}) if state is PR else frozenset())


def test_moving_forward_or_to_an_end_is_progress_and_moving_back_is_not():
    assert is_progress(P, S) and is_progress(S, V) and is_progress(V, PR) and is_progress(S, R)
    assert is_progress(P, A) and is_progress(V, A) and is_progress(PR, U)
    assert not is_progress(S, P) and not is_progress(V, P) and not is_progress(V, S)


def test_what_each_step_does_in_each_state():
    run, done, refuse = Action.RUN, Action.DONE, Action.REFUSE
    assert {s: stage_action(s) for s in BatchState} == {
        P: run, S: done, V: done, PR: done, VE: done, U: done, R: refuse, A: refuse
    }  # fmt: skip
    assert {s: validate_action(s) for s in BatchState} == {
        P: refuse, S: run, V: done, PR: done, VE: done, U: refuse, R: refuse, A: refuse
    }  # fmt: skip
    assert {s: promote_action(s) for s in BatchState} == {
        P: refuse, S: refuse, V: run, PR: done, VE: refuse, U: refuse, R: refuse, A: refuse
    }  # fmt: skip
    assert promote_action(VE, replay=True) is done and promote_action(U, replay=True) is refuse


def test_the_gate_fails_closed_and_a_replay_finishes_by_its_mode():
    assert gate_verdict(0) is V and gate_verdict(1) is R and gate_verdict(7) is R
    assert replay_outcome(verify_only=True) is VE and replay_outcome(verify_only=False) is PR


def test_an_unfinished_batch_is_resumed_unless_its_heads_moved_or_its_unread_offsets_expired():
    assert resume_or_abandon(P, [], []) and resume_or_abandon(V, [], [])
    assert not resume_or_abandon(S, [1], [])
    assert not resume_or_abandon(P, [], [0])
    assert resume_or_abandon(S, [], [0])  # already read: what Kafka deleted since does not matter
    with pytest.raises(ValueError, match="only an open batch"):
        resume_or_abandon(PR, [], [])
