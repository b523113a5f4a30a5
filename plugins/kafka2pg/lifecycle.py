"""The batch lifecycle in one piece: its states, the moves allowed between them, and the pure
decisions each step takes before it writes. No I/O and no client library here; the batch store
(`kafka2pg.batch_store`) applies a move, and every step reads as load -> decide -> apply.

    planned --stage--> staged --gate--> validated --promote--> promoted --undo--> undone
       |                 |  \\--gate--> rejected       |  \\--verify-only replay--> verified
       |                 |                             |
       +-----------------+--------- abandoned <--------+   (fenced, superseded, reset, undo)
    staged/validated --staging rows lost--> planned;  validated --key collision--> staged
"""

from __future__ import annotations

from enum import StrEnum


class BatchState(StrEnum):
    PLANNED = "planned"  # ranges recorded; nothing read yet
    STAGED = "staged"  # read from Kafka into the staging table, admission applied
    VALIDATED = "validated"  # the quality gate passed: promotable
    PROMOTED = "promoted"  # rows, quarantine and ledger heads committed together
    REJECTED = "rejected"  # the gate failed: nothing promoted, the heads unchanged
    ABANDONED = "abandoned"  # never promoted; its offsets are planned afresh
    VERIFIED = "verified"  # a verify-only replay compared its range and changed nothing
    UNDONE = "undone"  # a promoted batch whose rows were removed and heads rewound


# The run id of a replay started from the command line (`kafka2pg replay`): no Airflow DAG run,
# so no retries; only that process carries its batch on.
CLI_RUN_ID = "cli"

OPEN = frozenset({BatchState.PLANNED, BatchState.STAGED, BatchState.VALIDATED})
FINAL = frozenset(BatchState) - OPEN

_S = BatchState
TRANSITIONS: dict[BatchState, frozenset[BatchState]] = {
    _S.PLANNED: frozenset({_S.STAGED, _S.ABANDONED}),
    # back to planned: crash recovery emptied the UNLOGGED staging table
    _S.STAGED: frozenset({_S.VALIDATED, _S.REJECTED, _S.PLANNED, _S.ABANDONED}),
    # back to staged: the target refused a business key at promotion (validate again)
    _S.VALIDATED: frozenset({_S.PROMOTED, _S.VERIFIED, _S.STAGED, _S.PLANNED, _S.ABANDONED}),
    _S.PROMOTED: frozenset({_S.UNDONE}),
    _S.REJECTED: frozenset(),
    _S.ABANDONED: frozenset(),
    _S.VERIFIED: frozenset(),
    _S.UNDONE: frozenset(),
}

# How far along an open batch is; a move forward or to an end clears its recorded step failures.
_PROGRESS = {_S.PLANNED: 0, _S.STAGED: 1, _S.VALIDATED: 2}


class IllegalTransition(ValueError):
    """A move the lifecycle does not allow (a defect in the caller, not a data problem)."""

    def __init__(self, from_state: BatchState, to_state: BatchState) -> None:
        self.from_state = from_state
        self.to_state = to_state
        allowed = ", ".join(sorted(TRANSITIONS[from_state])) or "none: it is final"
        super().__init__(f"a batch cannot move from {from_state} to {to_state} (allowed from {from_state}: {allowed})")


def allowed(from_state: BatchState | str, to_state: BatchState | str) -> bool:
    return BatchState(to_state) in TRANSITIONS[BatchState(from_state)]


def require(from_state: BatchState | str, to_state: BatchState | str) -> None:
    """Raise `IllegalTransition` unless the lifecycle allows the move."""
    if not allowed(from_state, to_state):
        raise IllegalTransition(BatchState(from_state), BatchState(to_state))


def is_progress(from_state: BatchState | str, to_state: BatchState | str) -> bool:
    """A move forward or to an end (clears step failures); back (staging lost, a collision) is not."""
    to_state = BatchState(to_state)
    return to_state not in _PROGRESS or _PROGRESS[to_state] > _PROGRESS.get(BatchState(from_state), -1)


def is_open(state: BatchState | str) -> bool:
    return BatchState(state) in OPEN


# --- the pure decisions of the steps -------------------------------------------------------


class Action(StrEnum):
    RUN = "run"  # the step has work to do
    DONE = "done"  # an earlier attempt did it: report, change nothing
    REFUSE = "refuse"  # the batch is not in a state this step can take


def stage_action(state: BatchState | str) -> Action:
    state = BatchState(state)
    if state is _S.PLANNED:
        return Action.RUN
    return Action.REFUSE if state in (_S.REJECTED, _S.ABANDONED) else Action.DONE


def validate_action(state: BatchState | str) -> Action:
    state = BatchState(state)
    if state is _S.STAGED:
        return Action.RUN
    return Action.DONE if state in (_S.VALIDATED, _S.PROMOTED, _S.VERIFIED) else Action.REFUSE


def promote_action(state: BatchState | str, *, replay: bool = False) -> Action:
    state = BatchState(state)
    if state is _S.VALIDATED:
        return Action.RUN
    done = (_S.PROMOTED, _S.VERIFIED) if replay else (_S.PROMOTED,)
    return Action.DONE if state in done else Action.REFUSE


def gate_verdict(failed_checks: int) -> BatchState:
    """The quality gate fails closed: one failed check rejects the batch."""
    return _S.REJECTED if failed_checks else _S.VALIDATED


def replay_outcome(verify_only: bool) -> BatchState:
    """A replay's finish: `verify-only` compares and changes nothing; `replace` promotes."""
    return _S.VERIFIED if verify_only else _S.PROMOTED


def resume_or_abandon(state: BatchState | str, stale_partitions: list[int], expired_partitions: list[int]) -> bool:
    """Whether an unfinished batch is resumed with its exact ranges (True) or abandoned.

    Resumed while every head it expects is still in place and, if not read yet, Kafka still
    holds its start; otherwise planning afresh reports or records what changed.
    """
    if not is_open(state):
        raise ValueError(f"only an open batch is resumed or abandoned, not a {state} one")
    return not stale_partitions and not (BatchState(state) is _S.PLANNED and expired_partitions)
