"""Every error kafka2pg raises on purpose; each message says what, where and what to do.

Kafka2PgError
 ├── ConfigError              bad pipelines file / settings (names the field and the file)
 │    ├── UnknownPipelineError
 │    ├── UnknownRunConfError  a DAG run triggered with conf keys its DAG has no Param for
 │    ├── RunConfNotAppliedError a DAG run's conf Airflow did not apply to the Params (dag_run_conf_overrides_params)
 │    └── ObjectNameTakenError a table or index name migrations need belongs to another relation
 ├── ServiceUnavailableError  transient: retrying may help
 │    ├── KafkaUnavailableError
 │    ├── DatabaseUnavailableError
 │    └── SparkUnavailableError a standalone Spark master accepts no connection
 ├── StatementTimeoutError    PostgreSQL's statement_timeout cancelled a statement (retryable)
 ├── KafkaAuthenticationError the cluster refuses the client (credentials, TLS): not retried
 ├── KafkaRequestError        a request refused as invalid or unsupported: not retried
 ├── ConsumerGroupRefusedError Kafka refused to set the lag mirror's group offsets (active member, ACL)
 ├── TopicNotFoundError
 ├── SchemaNotReadyError      migrations, tables, columns or grants missing: the owner must act
 ├── RetentionLossError       ledger head below the partition's low watermark
 ├── OffsetRegressionError    ledger head above the high watermark (topic recreated?)
 ├── LedgerConflictError      compare-and-set on a ledger head failed (stale/concurrent run)
 ├── RangeLockedError         another promotion/replay/undo held a partition too long (retryable)
 ├── ReplayRefusedError       a replay/undo request the ledger cannot honour (beyond the head, ...)
 ├── BatchStateError          a batch is not in the state a step needs
 │    └── StagingLostError     staged rows vanished (PostgreSQL crash); batch back to planned
 ├── WitnessMismatchError     the gate's Kafka witnesses were asked about another staging (retryable)
 ├── StageInterrupted         SIGTERM stopped the Spark job; the batch stays resumable
 ├── TableRefusesRowsError    PostgreSQL refused most rows of a batch: the table is at fault, not the records
 ├── QualityGateFailed        validation blocked promotion
 │    └── KeyCollisionError   a key promoted since validation the checks run again did not explain
 ├── InstallationError        kafka2pg's own files (SQL) are missing from its installation
 └── StackError               the local embedded Kafka/PostgreSQL stack failed
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from kafka2pg.lifecycle import BatchState
from kafka2pg.locations import preview_first

# The stage job's exit code for a terminal error (a rejected batch, a configuration error): the
# stage operator fails its task without a retry, which could not mend it.
TERMINAL_EXIT = 3


# Stopping the process, not a failure of what it was doing.
PROCESS_STOPS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def is_task_timeout(exc: BaseException) -> bool:
    """An interruption that is neither an error nor the process stopping: Airflow's
    AirflowTaskTimeout (a task's execution_timeout), which is no Exception."""
    return not isinstance(exc, (Exception, *PROCESS_STOPS))


class Kafka2PgError(Exception):
    """Base class of every deliberate kafka2pg error.

    Besides its message, an error carries its evidence as fields (None when not known), so
    callers and tests read them instead of parsing prose.
    """

    #: True when retrying the same step cannot succeed (Airflow should not retry).
    terminal = True
    pipeline: str | None = None
    topic: str | None = None
    batch_id: int | None = None
    partition: int | None = None
    offsets: object = None  # an offset, a (start, end) range, or OffsetRanges of several partitions
    epoch: int | None = None
    state: str | None = None

    def __init__(self, message: str = "", **evidence: object) -> None:
        for name, value in evidence.items():
            setattr(self, name, value)
        self.evidence = {name: value for name, value in evidence.items() if value is not None}
        super().__init__(message)


class ConfigError(Kafka2PgError):
    """The pipelines file or the settings are invalid."""


class UnknownPipelineError(ConfigError):
    """A pipeline name that is not in the pipelines file."""


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """` (did you mean 'max_records_per_batch' for 'max_records_per_btach'?)`: the known name
    closest to each unknown one that has a close one, or "" when none has."""
    known = sorted(known)
    hints = [f"{close[0]!r} for {key!r}" for key in unknown if (close := difflib.get_close_matches(key, known, n=1))]
    return f" (did you mean {'; '.join(hints)}?)" if hints else ""


def without_secrets(text: str, secrets: Iterable[str]) -> str:
    """`text` (a client library's or server's words) with each of `secrets` replaced by ***, the
    longest first: a secret that holds another is never left partly shown."""
    for secret in sorted(dict.fromkeys(secrets), key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


class UnknownRunConfError(ConfigError):
    """A DAG run's conf names keys its DAG has no Param for (a typo would otherwise run with defaults)."""

    dag_id: str | None = None
    unknown: tuple[str, ...] = ()
    known: tuple[str, ...] = ()

    @classmethod
    def keys(cls, dag_id: str, unknown: Iterable[str], known: Iterable[str]) -> Self:
        """`unknown`: the conf's keys the DAG does not declare; `known`: the Params it declares."""
        unknown, known = tuple(sorted(unknown)), tuple(sorted(known))
        return cls(
            f"DAG {dag_id!r}: the run's conf has unknown key(s) {', '.join(map(repr, unknown))}"
            + did_you_mean(unknown, known)
            + f". Known keys: {', '.join(known) or 'none'}. Nothing was planned: trigger the run again "
            "with the keys spelled as the DAG's Params are.",
            dag_id=dag_id,
            unknown=unknown,
            known=known,
        )


class RunConfNotAppliedError(ConfigError):
    """A DAG run's conf sets a Param to a value the task did not get: Airflow's
    `[core] dag_run_conf_overrides_params` is False, so the tasks run with the DAG's defaults."""

    dag_id: str | None = None
    keys: tuple[str, ...] = ()

    @classmethod
    def ignored(cls, dag_id: str, differing: Mapping[str, tuple[object, object]]) -> Self:
        """`differing`: each Param the conf sets, with (the conf's value, the value the task got)."""
        keys = tuple(sorted(differing))
        shown = "; ".join(
            f"{key}={_json(differing[key][0])} in the conf, {_json(differing[key][1])} in the task's params"
            for key in keys
        )
        return cls(
            f"DAG {dag_id!r}: Airflow did not apply the run's conf to the DAG's Params ({shown}): "
            "[core] dag_run_conf_overrides_params is False where this task ran. Nothing was planned: set "
            "it to True (AIRFLOW__CORE__DAG_RUN_CONF_OVERRIDES_PARAMS=True) for the Airflow components that "
            "run tasks (the workers; the scheduler with the LocalExecutor), then clear this task or trigger "
            "the run again.",
            dag_id=dag_id,
            keys=keys,
        )


def _json(value: object) -> str:
    """A conf or Param value as the run's conf writes it (true, null, "replace")."""
    return json.dumps(value, default=str)


class ObjectNameTakenError(ConfigError):
    """A table or index name a pipeline needs is held by another relation in PostgreSQL."""


class ServiceUnavailableError(Kafka2PgError):
    """A service could not be reached; a retry may succeed."""

    terminal = False


class KafkaUnavailableError(ServiceUnavailableError):
    """The Kafka cluster did not answer within the timeout."""

    @classmethod
    def no_answer(
        cls, cluster: str, timeout_s: float, cause: str, *, topic: str | None = None, partition: int | None = None
    ) -> Self:
        """`cluster`: how the configuration names the cluster (servers and protocol, never a secret)."""
        return cls(
            f"Kafka at {cluster} did not answer within {timeout_s:.0f}s ({cause}). Check that the brokers run "
            "and that the pipeline's Kafka connection (kafka_config_id, default kafka2pg_kafka; or "
            "KAFKA2PG_BOOTSTRAP_SERVERS) is right.",
            cluster=cluster,
            timeout_s=timeout_s,
            cause=cause,
            topic=topic,
            partition=partition,
        )

    @classmethod
    def client_failed(cls, cluster: str, error: str, *, topic: str | None = None, partition: int | None = None) -> Self:
        """The Kafka client (librdkafka) failed a request on its own (`error`: its name and text)."""
        return cls(
            f"the Kafka client failed a request to Kafka at {cluster}: {error}. A retry may get past it; if it "
            "stays, check the brokers and the pipeline's Kafka connection (kafka_config_id, default kafka2pg_kafka).",
            cluster=cluster,
            cause=error,
            topic=topic,
            partition=partition,
        )

    @classmethod
    def answered(cls, cluster: str, error: str, *, topic: str | None = None, partition: int | None = None) -> Self:
        """Kafka answered a request with an error a retry may get past (a partition's leader or a
        group's coordinator moving, a rebalance); `error`: the error's name and text."""
        return cls(
            f"Kafka at {cluster} answered with an error: {error}. A retry may get past it (a partition's "
            "leader or a group's coordinator moving); if it stays, the brokers' logs say why.",
            cluster=cluster,
            cause=error,
            topic=topic,
            partition=partition,
        )


class KafkaRequestError(Kafka2PgError):
    """librdkafka or the broker refused a request kafka2pg made as malformed or unsupported: the
    same request fails again, so it is not retried."""

    @classmethod
    def refused(cls, cluster: str, error: str, *, topic: str | None = None, partition: int | None = None) -> Self:
        return cls(
            f"a request kafka2pg made to Kafka at {cluster} was refused as invalid or unsupported: {error}. "
            "Retrying sends the same request: this is a kafka2pg defect, or a broker too old for the request; "
            "report it with this message and the brokers' version.",
            cluster=cluster,
            cause=error,
            topic=topic,
            partition=partition,
        )


class ConsumerGroupRefusedError(Kafka2PgError):
    """Kafka answered, and refused to set a consumer group's offsets."""

    @classmethod
    def refused(cls, group: str, topic: str, detail: str) -> Self:
        return cls(
            f"Kafka refused to set consumer group {group}'s offsets on {topic}: {detail}. Kafka sets a group's "
            "offsets from outside only while it has no active member (another application consuming with this "
            "group id), and only for a client allowed to (Read on the group and on the topic).",
            group=group,
            topic=topic,
            detail=detail,
        )


class DatabaseUnavailableError(ServiceUnavailableError):
    """PostgreSQL could not be reached."""


class SparkUnavailableError(ServiceUnavailableError):
    """No master of a standalone Spark cluster (`spark://`) accepts a connection."""


class DatabaseRefusedError(Kafka2PgError):
    """PostgreSQL answered and refused the connection: a wrong password, an unknown role or
    database, no pg_hba.conf entry for it. Retrying the same settings cannot succeed."""


class StatementTimeoutError(Kafka2PgError):
    """PostgreSQL cancelled a statement of kafka2pg under the session's `statement_timeout` (a
    DBA's limit for the role or the database): the statement's transaction was rolled back. A
    retry may pass on a quieter server; the same batch on the same server usually fails again."""

    terminal = False


@contextmanager
def timeouts_named(pipeline: str, batch_id: int, step: str) -> Iterator[None]:
    """A `StatementTimeoutError` of one step of a batch with its message starting with which (as
    the stage's does): the transaction that timed out says nothing of its batch."""
    try:
        yield
    except StatementTimeoutError as exc:
        if exc.batch_id is not None:  # named already (a validation inside a promotion)
            raise
        evidence = {**exc.evidence, "pipeline": pipeline, "batch_id": batch_id}
        raise StatementTimeoutError(f"pipeline {pipeline!r} batch {batch_id}, {step}: {exc}", **evidence) from exc


class KafkaAuthenticationError(Kafka2PgError):
    """The Kafka cluster refuses the client: wrong credentials, an untrusted or missing certificate."""

    @classmethod
    def refused(cls, cluster: str, refusal: str, cause: str, *, topic: str | None = None) -> Self:
        """`refusal`: what the cluster did ("refused the client's credentials"); `cause`: librdkafka's words."""
        return cls(
            f"Kafka at {cluster} {refusal}: {cause}. Check the pipeline's Kafka connection "
            "(kafka_config_id, default kafka2pg_kafka): sasl.username / sasl.password / sasl.mechanism, "
            "or ssl.ca.location, ssl.certificate.location and ssl.key.location (or their inline ssl.*.pem). "
            "Retrying will not help.",
            cluster=cluster,
            refusal=refusal,
            cause=cause,
            topic=topic,
        )


class TopicNotFoundError(Kafka2PgError):
    """The pipeline's topic does not exist on the cluster."""


class SchemaNotReadyError(Kafka2PgError):
    """The database lacks what a run needs (a migration, a table, a column, a grant): `kafka2pg migrate`/`grant`."""

    #: What is missing, one item each: "migration 0008_step_failures.sql", "table kafka2pg.stg_orders",
    #: "column public.orders.amount", "DELETE on public.orders", "USAGE on schema sales".
    missing: tuple[str, ...] = ()

    def __init__(self, message: str, missing: tuple[str, ...] = (), **evidence: object) -> None:
        super().__init__(message, missing=missing, **evidence)


class RetentionLossError(Kafka2PgError):
    """Records expired or were deleted before the pipeline read them."""

    @classmethod
    def expired(cls, pipeline: str, topic: str, partition: int, head: int, low_watermark: int) -> Self:
        """The ledger head is below the low watermark: offsets [head, low_watermark) are gone."""
        return cls(
            f"pipeline {pipeline!r}, topic {topic!r}, partition {partition}: offsets "
            f"[{head}, {low_watermark}) ({low_watermark - head} records) expired or were deleted before they "
            "were read. Nothing was read. To accept the loss and record it in the ledger, set "
            "on_retention_loss: skip for this pipeline; otherwise restore the records upstream.",
            pipeline=pipeline,
            topic=topic,
            partition=partition,
            offsets=(head, low_watermark),
        )

    @classmethod
    def unwitnessed(
        cls,
        pipeline: str,
        batch_id: int,
        kind: str,
        topic: str,
        rng: tuple[int, int, int],
        low_watermark: int,
        gap: int,
    ) -> Self:
        """A staged batch's range (`rng`: partition, start, end) begins below the low watermark
        now: the gate cannot have Kafka count what its offsets without a staged record were."""
        partition, start, end = rng
        if kind == "replay":
            way_on = (
                f"{preview_first(f'abandon --pipeline {pipeline} --batch-id {batch_id}')} discards this replay "
                "(the target stays as it was); a replay from the low watermark on can then run."
            )
        else:
            reset = f"reset --pipeline {pipeline} --partition {partition} --to-offset {low_watermark} --reason ..."
            way_on = (
                f"{preview_first(reset)} abandons the batch and goes on from what Kafka still holds, the offsets "
                "before it lost (the batch's staged rows are deleted then: copy them from its staging table first "
                "if they are needed). A retention longer than a batch may wait for its gate prevents this."
            )
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}: Kafka no longer holds offsets [{start}, {low_watermark}) of "
            f"topic {topic!r} partition {partition} (retention deleted them after the batch was staged). The "
            f"batch's range [{start}, {end}) there has {gap} offset(s) without a staged record (transaction "
            "markers, aborted records, or records a read missed), which the quality gate has Kafka count before "
            f"it promotes a batch, and Kafka can no longer count them from {start}: the batch is not promoted. "
            f"Its staged rows stay in staging. {way_on}",
            pipeline=pipeline,
            batch_id=batch_id,
            topic=topic,
            partition=partition,
            offsets=(start, low_watermark),
        )


class OffsetRegressionError(Kafka2PgError):
    """The ledger is ahead of the topic: it was recreated, shrunk or restored."""

    @classmethod
    def beyond_high_watermark(cls, pipeline: str, topic: str, partition: int, head: int, high_watermark: int) -> Self:
        """The ledger head is above the high watermark: the topic lost offsets the ledger loaded."""
        return cls(
            f"pipeline {pipeline!r}, topic {topic!r}, partition {partition}: the ledger head "
            f"{head} is beyond the high watermark {high_watermark}. The topic was probably "
            "deleted and recreated, shrunk, or restored from a backup. Nothing was read. "
            "Inspect the topic, then realign the partition explicitly: "
            f"{preview_first(f'reset --pipeline {pipeline} --partition {partition} --to-offset <offset>')}.",
            pipeline=pipeline,
            topic=topic,
            partition=partition,
            head=head,
            high_watermark=high_watermark,
        )

    @classmethod
    def recreated(cls, pipeline: str, topic: str, partitions: list[int], ledgered: str, now: str) -> Self:
        """The ledger's heads of `partitions` are positions in a topic of the same name whose ID
        was `ledgered`; the topic's ID is `now`: it was deleted and recreated, offsets from 0 again."""
        reset = f"reset --pipeline {pipeline} --partition <p> --to-offset <offset>"
        return cls(
            f"pipeline {pipeline!r}, topic {topic!r}: the ledger heads of partition(s) {partitions} are offsets in "
            f"the topic with ID {ledgered}, but the topic now has ID {now}: it was deleted and recreated, and its "
            "offsets start again from 0, so the heads no longer say what was loaded. Nothing was read. Realign "
            f"each partition explicitly: {preview_first(reset)} (`--archive-old-rows` moves the old topic's rows "
            "away, whose offsets the new records reuse), "
            "or `--drop` instead of `--to-offset <offset>` for a partition the new topic does not have.",
            pipeline=pipeline,
            topic=topic,
            partitions=partitions,
            ledgered_topic_id=ledgered,
            topic_id=now,
        )

    @classmethod
    def recreated_since_planned(
        cls, pipeline: str, topic: str, batch_id: int, planned: str, now: str | None, *, read: bool = False
    ) -> Self:
        """Batch `batch_id` was planned in the topic with ID `planned`; it now has ID `now` (`read`:
        found once the batch was read, which may then have read the new topic's records)."""
        what = (
            " while the batch was being read: the read may have taken the new topic's records at the planned "
            "offsets. Nothing read counts: the batch stays planned and none of its rows is validated or promoted."
            if read
            else ", and the planned offsets are not the records planned. Nothing was read."
        )
        return cls(
            f"pipeline {pipeline!r}, topic {topic!r}: batch {batch_id} was planned in the topic with ID {planned}, "
            f"but the topic now has ID {now}: it was deleted and recreated{what} The next run abandons the batch "
            "once no ledger head is an offset in the old topic; until then it stops and says how to realign the "
            "ledger.",
            pipeline=pipeline,
            topic=topic,
            batch_id=batch_id,
            planned_topic_id=planned,
            topic_id=now,
        )

    @classmethod
    def partitions_gone(cls, pipeline: str, topic: str, partitions: list[int]) -> Self:
        """The ledger has heads for `partitions`, which the topic no longer has."""
        return cls(
            f"pipeline {pipeline!r}, topic {topic!r}: the ledger has heads for partition(s) {partitions} that "
            "the topic no longer has. It was probably deleted and recreated with fewer partitions. Nothing "
            "was read. Inspect the topic, then drop each one's head: "
            f"{preview_first(f'reset --pipeline {pipeline} --partition <p> --drop')}.",
            pipeline=pipeline,
            topic=topic,
            partitions=partitions,
        )


class LedgerConflictError(Kafka2PgError):
    """A ledger head moved under a batch, or a newer claim took it over: another run went first."""

    @classmethod
    def fenced(cls, pipeline: str, batch_id: int, epoch: int, current_epoch: int, run_id: str | None):
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}: this run holds claim epoch {epoch} but run {run_id!r} "
            f"claimed the batch since (epoch {current_epoch}). This run stops without writing anything; the newer "
            "run carries the batch on. Nothing to do unless it also failed.",
            pipeline=pipeline,
            batch_id=batch_id,
            epoch=epoch,
            current_epoch=current_epoch,
            run_id=run_id,
        )

    @classmethod
    def head_moved(
        cls, pipeline: str, batch_id: int, partition: int, expected: int | None, found: int | None, moved_by: int | None
    ):
        by = "a ledger reset" if moved_by is None else f"batch {moved_by}"
        now = "no head" if found is None else f"head {found} (moved by {by})"
        why = "Another run promoted these offsets first" if moved_by is not None else "The ledger moved since"
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}, partition {partition}: planned from head {expected} but the "
            f"ledger has {now}. {why}; nothing from this batch was written. "
            "Trigger a new run to plan from the current head.",
            pipeline=pipeline,
            batch_id=batch_id,
            partition=partition,
            offsets=expected,
            found=found,
            moved_by=moved_by,
        )

    @classmethod
    def moved_on(cls, pipeline: str, batch_id: int, partition: int, moved_by: int | None):
        by = "a ledger reset" if moved_by is None else f"batch {moved_by}"
        return cls(
            f"pipeline {pipeline!r}: no batch can be planned after batch {batch_id}: partition {partition}'s head "
            f"was moved since by {by}. Another run carries the pipeline on; this run stops without planning.",
            pipeline=pipeline,
            batch_id=batch_id,
            partition=partition,
            moved_by=moved_by,
        )

    @classmethod
    def changed_since_loaded(cls, pipeline: str, batch_id: int, state: str, epoch: int, to_state: str):
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}: expected it {state} at claim epoch {epoch} to move it to "
            f"{to_state}, but another attempt changed it since; this step changed nothing.",
            pipeline=pipeline,
            batch_id=batch_id,
            state=state,
            epoch=epoch,
            to_state=to_state,
        )


class RangeLockedError(Kafka2PgError):
    """A partition's range lock stayed held by another promotion, replay or undo; retry later."""

    terminal = False

    @classmethod
    def held(cls, pipeline: str, partition: int, purpose: str, waited_s: float, holder: str | None) -> Self:
        """`purpose`: what waited ("replay batch 7"); `holder`: the backend holding the lock, when known."""
        held_by = f" ({holder})" if holder else ""
        return cls(
            f"pipeline {pipeline!r}: {purpose} waited {waited_s}s for partition {partition}, which another "
            f"promotion, replay or undo still holds{held_by}; nothing was changed. Retry when it has finished "
            "(see kafka2pg.batches and kafka2pg.replays).",
            pipeline=pipeline,
            partition=partition,
            purpose=purpose,
            waited_s=waited_s,
            holder=holder,
        )


class ReplayRefusedError(Kafka2PgError):
    """A replay or undo that would break the ledger's promise (beyond the head, never loaded, gone)."""

    @classmethod
    def range_refused(
        cls,
        pipeline: str,
        partition: int,
        offsets: tuple[int, int],
        problem: str,
        *,
        batch_id: int | None = None,
        **evidence: object,
    ) -> Self:
        """A replay of `offsets` [start, end) of `partition` refused for `problem`, which `evidence`
        (head, low_watermark, ...) backs. With `batch_id` (the replay batch), refused as it finished."""
        start, end = offsets
        span = f"partition {partition} [{start}, {end})"
        if batch_id is None:
            message = f"pipeline {pipeline!r} {span}: {problem}"
        else:
            message = (
                f"pipeline {pipeline!r} replay batch {batch_id}: {span}: {problem}. Nothing was changed; trigger "
                "the replay again to re-read it now."
            )
        return cls(message, pipeline=pipeline, batch_id=batch_id, partition=partition, offsets=offsets, **evidence)


class BatchStateError(Kafka2PgError):
    """A batch is not in a state the requested step accepts."""

    @classmethod
    def wrong_state(cls, pipeline: str, batch_id: int, state: str, step: str, hint: str):
        return cls(
            f"batch {batch_id} of pipeline {pipeline!r} is {state}; {step}. {hint}",
            pipeline=pipeline,
            batch_id=batch_id,
            state=state,
            step=step,
        )

    @classmethod
    def other_pipeline(cls, pipeline: str, batch_id: int, owner: str) -> Self:
        """Batch `batch_id` was asked for under `pipeline` but belongs to `owner`."""
        return cls(
            f"batch {batch_id} belongs to pipeline {owner!r}, not {pipeline!r}",
            pipeline=pipeline,
            batch_id=batch_id,
            owner=owner,
        )


class StagingLostError(BatchStateError):
    """A staged batch's rows are gone (crash recovery empties UNLOGGED tables); it must be re-staged."""

    def __init__(self, pipeline: str, batch_id: int) -> None:
        super().__init__(
            f"pipeline {pipeline!r} batch {batch_id}: its staged rows are gone (PostgreSQL crash recovery empties "
            "UNLOGGED staging tables). Nothing was promoted; the batch is back to planned and the next run re-reads "
            "the same offsets from Kafka.",
            pipeline=pipeline,
            batch_id=batch_id,
            state=BatchState.PLANNED,
        )


class WitnessMismatchError(Kafka2PgError):
    """The quality gate asked Kafka about a batch's offset gaps as it was staged before; it is
    staged differently now (or was not staged then). Retryable: the next attempt asks again."""

    terminal = False

    @classmethod
    def restaged(
        cls,
        pipeline: str,
        batch_id: int,
        state: str,
        epoch: int,
        reads: Mapping[int, int],
        witnessed: str,
        unwitnessed: list[int],
    ) -> Self:
        """`witnessed`: what the witnesses were asked about ("asked while it was planned at claim
        epoch 3 with records read {0: 0}"); `unwitnessed`: partitions with a gap no witness counted."""
        gaps = f"; partitions {unwitnessed} have a gap no witness counted" if unwitnessed else ""
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}: the quality gate's Kafka witnesses of its offset gaps "
            f"({witnessed}) do not match the batch as it is now, {state} at claim epoch {epoch} with records read "
            f"{dict(reads)} (staged again meanwhile){gaps}. Nothing was decided or changed. Validate it again "
            "(Airflow retries the task): the next attempt asks Kafka about the batch as it is staged then.",
            pipeline=pipeline,
            batch_id=batch_id,
            state=state,
            epoch=epoch,
            reads=dict(reads),
            witnessed=witnessed,
            unwitnessed=unwitnessed,
        )


class StageInterrupted(Kafka2PgError):
    """The Spark job was asked to stop (SIGTERM) before it finished staging."""

    terminal = False


class SparkSessionLost(Kafka2PgError):
    """Spark's JVM stopped answering while it staged a batch: killed from outside, or crashed."""

    terminal = False

    @classmethod
    def staging(cls, pipeline: str, batch_id: int) -> SparkSessionLost:
        return cls(
            f"pipeline {pipeline!r} batch {batch_id}: Spark's JVM stopped answering while it staged the batch "
            "(killed from outside, or it crashed: its log or the kernel's, for an out-of-memory kill, says which). "
            "Nothing was promoted and the batch stays planned; the chunks it committed are replaced by the next "
            "attempt: run the stage step again (Airflow retries the task).",
            pipeline=pipeline,
            batch_id=batch_id,
            state="planned",
        )

    @classmethod
    def submit_killed(cls, pipeline: str, signal_name: str) -> SparkSessionLost:
        """spark-submit (the stage job's JVM, which carries its Python driver's output) ended by a signal."""
        cause = (
            "killed (SIGKILL: the kernel's out-of-memory killer, a container's memory limit or kill -9; the "
            "kernel's log says which)"
            if signal_name == "SIGKILL"
            else f"ended by {signal_name}"
        )
        return cls(
            f"pipeline {pipeline!r}: the stage job's spark-submit (Spark's JVM) was {cause}; the job's own account "
            "went with it. Its batches are as the ledger says: a batch it was staging stays planned (chunks it "
            "committed are replaced by the next attempt), and a promotion commits whole or not at all. Airflow's "
            "retry of the task goes on from there.",
            pipeline=pipeline,
            signal=signal_name,
        )


class QualityGateFailed(Kafka2PgError):
    """The quality gate rejected a batch; nothing was promoted."""

    @staticmethod
    def summary(failed: Mapping[str, str]) -> str:
        """The failed checks in one line: `name: details; name: details`."""
        return "; ".join(f"{name}: {details}" for name, details in failed.items())

    @classmethod
    def rejected(
        cls, pipeline: str, batch_id: int, failed: Mapping[str, str], report: Path | str | None, staging_table: str
    ) -> Self:
        """`failed`: the failed checks' details by check name; `report`: the data-docs file of the run
        (None: it could not be written)."""
        written = report or "not written (see the task log)"
        return cls(
            f"pipeline {pipeline!r} batch {batch_id} rejected, nothing promoted, ledger unchanged: "
            f"{cls.summary(failed)}. Report: {written}. Inspect kafka2pg.batch_checks and the staging table "
            f"kafka2pg.{staging_table} (its rows of batch {batch_id} stay until the next batch is planned); fix the "
            "data or the pipeline config, then trigger a new run.",
            pipeline=pipeline,
            batch_id=batch_id,
            state=BatchState.REJECTED,
            failed=dict(failed),
            report=report,
        )


class KeyCollisionError(QualityGateFailed):
    """Promotion hit a business key promoted since the batch was validated (a replay, a manual write)."""

    def __init__(self, pipeline: str, batch_id: int, constraint: str | None, detail: str | None) -> None:
        super().__init__(
            f"pipeline {pipeline!r} batch {batch_id}: promotion hit a unique key already in the target ({detail}); "
            "nothing was promoted. A replay or a manual write loaded it after this batch was validated, and the "
            "duplicate checks run again did not explain it (no business key; the key landed while they ran; or a "
            "unique index stricter than equality, e.g. another collation, which refuses keys the checks do not "
            "find: see docs/design.md). The batch goes back to staged: the next run (trigger one) validates it "
            "again and judges the row.",
            pipeline=pipeline,
            batch_id=batch_id,
            constraint=constraint,
            detail=detail,
        )


# An error's own advice to resume its batch: a STUCK line quoting the error does not add its own.
RESUMES_ON_TRIGGER = "then trigger a run: it resumes the batch"


class TableRefusesRowsError(Kafka2PgError):
    """PostgreSQL refused so many of a batch's rows that the table, not the records, is at fault."""

    def __init__(self, table: str, refused: int, tried: int, example: str) -> None:
        super().__init__(
            f"PostgreSQL refused {refused} of the first {tried} rows written to {table} (e.g. {example}). So many "
            "refusals point at the table (a constraint, trigger or column type the records cannot meet), not at "
            "some records: nothing of the batch was written and it stays where it was. Fix the table, "
            f"{RESUMES_ON_TRIGGER}.",
            table=table,
            refused=refused,
            tried=tried,
            example=example,
        )


class InstallationError(Kafka2PgError):
    """A file kafka2pg ships (its SQL migrations) is missing from where the package looks for it."""

    def __init__(self, what: str, path: Path) -> None:
        super().__init__(
            f"kafka2pg's {what} are not in {path}: this installation of kafka2pg is incomplete (a wheel built "
            "without the sql/ folder?). Nothing was changed. Reinstall kafka2pg from a complete wheel, or run it "
            "from its checkout.",
            what=what,
            path=path,
        )


class StackError(Kafka2PgError):
    """The local embedded stack could not be installed, started or stopped."""
