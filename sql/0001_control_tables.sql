-- kafka2pg control tables: batches, their planned ranges, the ledger and the quarantine.
-- Idempotent: safe to apply again.
CREATE SCHEMA IF NOT EXISTS kafka2pg;

CREATE TABLE IF NOT EXISTS kafka2pg.batches (
    batch_id         bigserial PRIMARY KEY,
    pipeline         text        NOT NULL,
    topic            text        NOT NULL,
    kind             text        NOT NULL DEFAULT 'live' CHECK (kind IN ('live', 'replay')),
    state            text        NOT NULL CHECK (state IN
                         ('planned', 'staged', 'validated', 'promoted', 'rejected', 'abandoned')),
    plan             jsonb       NOT NULL,
    run_id           text,
    records_planned  bigint      NOT NULL DEFAULT 0,
    records_read     bigint,
    rows_staged      bigint,
    rows_quarantined bigint,
    rows_promoted    bigint,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- At most one unfinished live batch per pipeline: two planners racing cannot both open one.
CREATE UNIQUE INDEX IF NOT EXISTS batches_one_open_live_batch
    ON kafka2pg.batches (pipeline)
    WHERE kind = 'live' AND state IN ('planned', 'staged', 'validated');

CREATE INDEX IF NOT EXISTS batches_pipeline_state ON kafka2pg.batches (pipeline, batch_id DESC);

-- Per partition of a batch: the planned range [start_offset, end_offset) and what was read.
CREATE TABLE IF NOT EXISTS kafka2pg.batch_partitions (
    batch_id        bigint  NOT NULL REFERENCES kafka2pg.batches ON DELETE CASCADE,
    kafka_partition integer NOT NULL,
    start_offset    bigint  NOT NULL,
    end_offset      bigint  NOT NULL CHECK (end_offset > start_offset),
    records_read    bigint,
    min_offset_read bigint,
    max_offset_read bigint,
    PRIMARY KEY (batch_id, kafka_partition)
);

-- The ledger head: the next offset to read, per pipeline and partition.
CREATE TABLE IF NOT EXISTS kafka2pg.ledger_heads (
    pipeline        text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    next_offset     bigint      NOT NULL CHECK (next_offset >= 0),
    last_batch_id   bigint,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, kafka_partition)
);

-- Every consumed or deliberately skipped range, contiguous per partition up to the head.
CREATE TABLE IF NOT EXISTS kafka2pg.ledger_ranges (
    pipeline        text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    start_offset    bigint      NOT NULL,
    end_offset      bigint      NOT NULL CHECK (end_offset > start_offset),
    kind            text        NOT NULL CHECK (kind IN ('batch', 'retention_gap', 'skipped_new_partition')),
    batch_id        bigint      NOT NULL REFERENCES kafka2pg.batches,
    records         bigint,
    committed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, kafka_partition, start_offset)
);

-- Records that were read but not promoted, with the reason; never silently dropped.
CREATE TABLE IF NOT EXISTS kafka2pg.quarantine (
    pipeline        text        NOT NULL,
    batch_id        bigint      NOT NULL REFERENCES kafka2pg.batches,
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    kafka_timestamp timestamptz,
    reason          text        NOT NULL,
    raw_value       text,
    record          jsonb,
    quarantined_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, kafka_topic, kafka_partition, kafka_offset)
);

-- Outcome of each validation check per batch (the quality gate's evidence).
CREATE TABLE IF NOT EXISTS kafka2pg.batch_checks (
    batch_id         bigint  NOT NULL REFERENCES kafka2pg.batches ON DELETE CASCADE,
    check_name       text    NOT NULL,
    success          boolean NOT NULL,
    unexpected_count bigint  NOT NULL DEFAULT 0,
    details          text,
    checked_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, check_name)
);
