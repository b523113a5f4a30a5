"""What a pipeline's status is (`kafka2pg status` and the Airflow overview page show the same):
per partition the head, watermarks, lag, margin and time to data loss; the last batch; the open
batches (STUCK ones among them); whether the database is ready for a run (NOT READY: what to run);
whether the ledger still fits the topic (BLOCKED: the error planning stops at).

Reads the ledger heads and the newest batch by index, whatever the ledger's length.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime

from psycopg import Connection

from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import NOT_READY_ERRORS
from kafka2pg.exceptions import (
    KafkaAuthenticationError,
    KafkaRequestError,
    KafkaUnavailableError,
    SchemaNotReadyError,
    TopicNotFoundError,
)
from kafka2pg.kafka_offsets import PartitionOffsets, TopicAdmin
from kafka2pg.ledger import head_status, read_heads
from kafka2pg.migrations import readiness_error
from kafka2pg.opening import blocked_words, loss_horizons, topic_admin
from kafka2pg.planner import LossHorizon
from kafka2pg.stuck import OpenBatch, StuckBatch, open_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionStatus:
    """One partition: the ledger head (None: never read) against the broker's offsets."""

    partition: int
    next_offset: int | None
    low_watermark: int
    last_stable_offset: int
    high_watermark: int
    lag: int  # records committed in Kafka and not yet ledgered: last stable offset - head
    margin: int  # records between the low watermark and the head, which retention deletes first
    seconds_to_loss: float | None  # None: nothing unread, no time-based retention, or not known
    at_risk: bool
    loss_time_unknown: bool = False  # the oldest unread record has no Kafka timestamp

    @property
    def time_to_loss(self) -> str:
        """As `kafka2pg status` prints it: caught up, no time limit, or hours (AT RISK); a head past
        the topic's end (the topic recreated: BLOCKED says so) is not caught up."""
        if self.next_offset is not None and self.next_offset > self.high_watermark:
            return "head past the topic's end"
        if self.lag <= 0:
            return "caught up"
        if self.loss_time_unknown:
            return "unknown (no Kafka timestamp)"
        if self.seconds_to_loss is None:
            return "no time limit"
        if self.seconds_to_loss <= 0:
            return "overdue (AT RISK)"
        return f"{self.seconds_to_loss / 3600:.1f}h" + (" (AT RISK)" if self.at_risk else "")


@dataclass(frozen=True)
class LastBatch:
    batch_id: int
    state: str
    updated_at: datetime
    age_seconds: float


@dataclass(frozen=True)
class PipelineStatus:
    pipeline: str
    topic: str
    target: str
    partitions: tuple[PartitionStatus, ...]
    last_batch: LastBatch | None
    open_batches: tuple[OpenBatch, ...]
    # What stops the next run's plan (a migration or a grant missing), as seen by the role
    # `not_ready_role` this status connected as (a run's role may differ); None: ready.
    not_ready: str | None
    not_ready_role: str | None
    # Kafka's error when it did not answer (then `partitions` is empty); None: it answered.
    kafka_error: str | None = None
    # The error planning stops at because the ledger's heads no longer fit the topic (deleted and
    # recreated, shrunk, offsets expired unread); None: they fit, or it is unknown (Kafka did not
    # answer, the database is NOT READY).
    blocked: str | None = None

    @property
    def stuck(self) -> tuple[StuckBatch, ...]:
        return tuple(b.stuck for b in self.open_batches if b.stuck is not None)

    def not_ready_lines(self, whose: str) -> list[str]:
        """What would stop the next run before it plans (a migration or a grant not run since an
        upgrade), for the role of `whose` connection."""
        if self.not_ready is None:
            return []
        return [f"NOT READY for a run as role {self.not_ready_role!r} ({whose}): {self.not_ready}"]

    def blocked_lines(self) -> list[str]:
        """What stops every plan (an open batch may still finish first) until an operator acts, when
        the ledger no longer fits the topic."""
        if self.blocked is None:
            return []
        return [BLOCKED_LINE + self.blocked]

    def open_batch_lines(self) -> list[str]:
        """One line per open batch not STUCK (a STUCK one has its own line), each saying what the
        next run does with it."""
        return [batch.describe() for batch in self.open_batches if batch.stuck is None]

    def to_json(self) -> dict:
        """For `kafka2pg status --json`: plain values, times as ISO-8601."""
        data = _plain(asdict(self))
        for partition, status in zip(data["partitions"], self.partitions, strict=True):
            partition["time_to_loss"] = status.time_to_loss
        for batch, shown in zip(self.open_batches, data["open_batches"], strict=True):
            shown["stuck"] = batch.stuck is not None  # then in `stuck` too, with its verdict
        data["stuck"] = [_plain(asdict(b)) for b in self.stuck]
        return data


def _plain(value: object) -> object:
    """`value` with its datetimes as ISO-8601 text, for JSON."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value.isoformat() if isinstance(value, datetime) else value


def pipeline_status(settings: Settings, pipeline: Pipeline, conn: Connection) -> PipelineStatus:
    """Ask Kafka for the partitions' offsets and read the ledger over `conn` (autocommit; no lock
    is taken)."""
    not_ready = readiness_error(settings, pipeline, conn)
    try:
        return _read_status(settings, pipeline, conn, not_ready)
    except NOT_READY_ERRORS as exc:  # the tables cannot be read: what is missing, all of it, and what to run
        if not_ready is None:
            raise
        raise not_ready from exc


def _read_status(
    settings: Settings, pipeline: Pipeline, conn: Connection, not_ready: SchemaNotReadyError | None
) -> PipelineStatus:
    kafka = topic_admin(settings, pipeline)  # one client for the offsets, the topic's ID and its retention
    try:
        offsets, kafka_error = kafka.offsets(), None
    except KAFKA_TROUBLE as exc:  # what PostgreSQL holds is shown all the same
        offsets, kafka_error = None, f"{type(exc).__name__}: {exc}"
    blocked = None
    # Not on a database NOT READY: a run stops there first, and the ledger may lack what is read.
    if offsets is not None and not_ready is None:
        try:
            blocked = blocked_words(settings, pipeline, conn, offsets, kafka)
        except KAFKA_TROUBLE as exc:  # the topic's ID unknown: the offsets are still worth showing
            log.warning("pipeline=%s whether the ledger fits the topic is unknown: %s", pipeline.name, exc)
    heads = None if offsets is None else read_heads(conn, pipeline.name)
    partitions = () if offsets is None else _partitions(settings, pipeline, offsets, heads, kafka)
    row = conn.execute(
        "SELECT batch_id, state, updated_at, extract(epoch FROM now() - updated_at)::float8"
        " FROM kafka2pg.batches WHERE pipeline = %s ORDER BY batch_id DESC LIMIT 1",
        (pipeline.name,),
    ).fetchone()
    return PipelineStatus(
        pipeline.name,
        pipeline.topic,
        f"{pipeline.target_schema}.{pipeline.target_table}",
        partitions,
        None if row is None else LastBatch(*row),
        tuple(open_batches(conn, pipeline.name)),
        None if not_ready is None else str(not_ready),
        None if not_ready is None else not_ready.role,
        kafka_error,
        blocked,
    )


BLOCKED_LINE = "BLOCKED: no batch can be planned until an operator acts: "

# Kafka not answering, or refusing: the partitions' offsets are unknown.
KAFKA_TROUBLE = (KafkaUnavailableError, KafkaRequestError, KafkaAuthenticationError, TopicNotFoundError)


def _partitions(
    settings: Settings, pipeline: Pipeline, offsets: list[PartitionOffsets], heads: dict[int, int], kafka: TopicAdmin
) -> tuple[PartitionStatus, ...]:
    horizons = {h.partition: h for h in loss_horizons(settings, pipeline, offsets, heads, kafka)}
    stable = {o.partition: o.last_stable for o in offsets}
    return tuple(
        _partition(
            h.partition, h.next_offset, h.low, stable[h.partition], h.high, h.lag, horizons[h.partition], pipeline
        )
        for h in head_status(heads, offsets)
    )


def _partition(
    partition: int,
    head: int | None,
    low: int,
    last_stable: int,
    high: int,
    lag: int,
    horizon: LossHorizon,
    pipeline: Pipeline,
) -> PartitionStatus:
    seconds = horizon.seconds_left if horizon.unread else None
    return PartitionStatus(
        partition,
        head,
        low,
        last_stable,
        high,
        lag,
        horizon.records_margin,
        seconds,
        horizon.at_risk(pipeline.data_loss_warning_hours),
        horizon.unstamped and bool(horizon.unread),
    )
