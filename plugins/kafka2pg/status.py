"""What a pipeline's status is (`kafka2pg status` and the Airflow overview page show the same):
per partition the head, watermarks, lag, margin and time to data loss; the last batch; STUCK ones.

Reads the ledger heads and the newest batch by index, whatever the ledger's length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from psycopg import Connection

from kafka2pg.config import Pipeline, Settings
from kafka2pg.kafka_offsets import partition_offsets
from kafka2pg.ledger import head_status, read_heads
from kafka2pg.opening import loss_horizons
from kafka2pg.planner import LossHorizon
from kafka2pg.stuck import StuckBatch, stuck_batches


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
    seconds_to_loss: float | None  # None: nothing unread, or no time-based retention
    at_risk: bool

    @property
    def time_to_loss(self) -> str:
        """As `kafka2pg status` prints it: caught up, no time limit, or hours (AT RISK)."""
        if self.lag <= 0:
            return "caught up"
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
    stuck: tuple[StuckBatch, ...]

    def to_json(self) -> dict:
        """For `kafka2pg status --json`: plain values, times as ISO-8601."""
        data = asdict(self)
        for partition, status in zip(data["partitions"], self.partitions, strict=True):
            partition["time_to_loss"] = status.time_to_loss
        if self.last_batch is not None:
            data["last_batch"]["updated_at"] = self.last_batch.updated_at.isoformat()
        for stuck in data["stuck"]:
            stuck["since"] = stuck["since"].isoformat()
        return data


def pipeline_status(settings: Settings, pipeline: Pipeline, conn: Connection) -> PipelineStatus:
    """Ask Kafka for the partitions' offsets and read the ledger over `conn` (no lock is taken)."""
    offsets = partition_offsets(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    heads = head_status(conn, pipeline, offsets)
    horizons = {h.partition: h for h in loss_horizons(settings, pipeline, offsets, read_heads(conn, pipeline.name))}
    stable = {o.partition: o.last_stable for o in offsets}
    partitions = tuple(
        _partition(
            h.partition, h.next_offset, h.low, stable[h.partition], h.high, h.lag, horizons[h.partition], pipeline
        )
        for h in heads
    )
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
        tuple(stuck_batches(conn, pipeline.name)),
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
    )
