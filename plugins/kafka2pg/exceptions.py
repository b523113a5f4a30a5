"""Every error kafka2pg raises on purpose; each message says what, where and what to do.

Kafka2PgError
 ├── ConfigError              bad pipelines file / settings (names the field and the file)
 │    ├── UnknownPipelineError
 │    └── ObjectNameTakenError a table or index name migrations need belongs to another relation
 ├── ServiceUnavailableError  transient: retrying may help
 │    ├── KafkaUnavailableError
 │    └── DatabaseUnavailableError
 ├── KafkaAuthenticationError the cluster refuses the client (credentials, TLS): not retried
 ├── TopicNotFoundError
 ├── SchemaNotReadyError      migrations, tables, columns or grants missing: the owner must act
 ├── RetentionLossError       ledger head below the partition's low watermark
 ├── OffsetRegressionError    ledger head above the high watermark (topic recreated?)
 ├── LedgerConflictError      compare-and-set on a ledger head failed (stale/concurrent run)
 ├── RangeLockedError         another promotion/replay/undo held a partition too long (retryable)
 ├── ReplayRefusedError       a replay/undo request the ledger cannot honour (beyond the head, ...)
 ├── BatchStateError          a batch is not in the state a step needs
 │    └── StagingLostError     staged rows vanished (PostgreSQL crash); batch back to planned
 ├── StageInterrupted         SIGTERM stopped the Spark job; the batch stays resumable
 ├── TableRefusesRowsError    PostgreSQL refused most rows of a batch: the table is at fault, not the records
 ├── QualityGateFailed        validation blocked promotion
 │    └── KeyCollisionError   a business key promoted since validation; batch back to re-validation
 ├── InstallationError        kafka2pg's own files (SQL) are missing from its installation
 └── StackError               the local embedded Kafka/PostgreSQL stack failed
"""

from __future__ import annotations

from pathlib import Path


class Kafka2PgError(Exception):
    """Base class of every deliberate kafka2pg error."""

    #: True when retrying the same step cannot succeed (Airflow should not retry).
    terminal = True


class ConfigError(Kafka2PgError):
    """The pipelines file or the settings are invalid."""


class UnknownPipelineError(ConfigError):
    """A pipeline name that is not in the pipelines file."""


class ObjectNameTakenError(ConfigError):
    """A table or index name a pipeline needs is held by another relation in PostgreSQL."""


class ServiceUnavailableError(Kafka2PgError):
    """A service could not be reached; a retry may succeed."""

    terminal = False


class KafkaUnavailableError(ServiceUnavailableError):
    """The Kafka cluster did not answer within the timeout."""


class DatabaseUnavailableError(ServiceUnavailableError):
    """PostgreSQL could not be reached."""


class KafkaAuthenticationError(Kafka2PgError):
    """The Kafka cluster refuses the client: wrong credentials, an untrusted or missing certificate."""


class TopicNotFoundError(Kafka2PgError):
    """The pipeline's topic does not exist on the cluster."""


class SchemaNotReadyError(Kafka2PgError):
    """The database lacks what a run needs (a migration, a table, a column, a grant): `kafka2pg migrate`/`grant`."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        #: What is missing, one item each: "migration 0008_step_failures.sql", "table kafka2pg.stg_orders",
        #: "column public.orders.amount", "DELETE on public.orders", "USAGE on schema sales".
        self.missing = missing
        super().__init__(message)


class RetentionLossError(Kafka2PgError):
    """Records expired or were deleted before the pipeline read them."""


class OffsetRegressionError(Kafka2PgError):
    """The ledger is ahead of the topic: it was recreated, shrunk or restored."""


class LedgerConflictError(Kafka2PgError):
    """A ledger head moved under a batch: another run promoted first."""


class RangeLockedError(Kafka2PgError):
    """A partition's range lock stayed held by another promotion, replay or undo; retry later."""

    terminal = False


class ReplayRefusedError(Kafka2PgError):
    """A replay or undo that would break the ledger's promise (beyond the head, never loaded, gone)."""


class BatchStateError(Kafka2PgError):
    """A batch is not in a state the requested step accepts."""


class StagingLostError(BatchStateError):
    """A staged batch's rows are gone (crash recovery empties UNLOGGED tables); it must be re-staged."""


class StageInterrupted(Kafka2PgError):
    """The Spark job was asked to stop (SIGTERM) before it finished staging."""

    terminal = False


class QualityGateFailed(Kafka2PgError):
    """The quality gate rejected a batch; nothing was promoted."""


class KeyCollisionError(QualityGateFailed):
    """Promotion hit a business key promoted since the batch was validated (a replay, a manual write)."""


class TableRefusesRowsError(Kafka2PgError):
    """PostgreSQL refused so many of a batch's rows that the table, not the records, is at fault."""

    def __init__(self, table: str, refused: int, tried: int, example: str) -> None:
        self.table, self.refused, self.tried, self.example = table, refused, tried, example
        super().__init__(
            f"PostgreSQL refused {refused} of the first {tried} rows written to {table} (e.g. {example}). So many "
            "refusals point at the table (a constraint, trigger or column type the records cannot meet), not at "
            "some records: nothing of the batch was written and it stays where it was. Fix the table, then trigger "
            "a run: it resumes the batch."
        )


class InstallationError(Kafka2PgError):
    """A file kafka2pg ships (its SQL migrations) is missing from where the package looks for it."""

    def __init__(self, what: str, path: Path) -> None:
        self.what, self.path = what, path
        super().__init__(
            f"kafka2pg's {what} are not in {path}: this installation of kafka2pg is incomplete (a wheel built "
            "without the sql/ folder?). Nothing was changed. Reinstall kafka2pg from a complete wheel, or run it "
            "from its checkout."
        )


class StackError(Kafka2PgError):
    """The local embedded stack could not be installed, started or stopped."""
