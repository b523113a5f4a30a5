-- Gap accounting: per batch partition, why [start, end) holds fewer records than offsets,
-- witnessed by a consumer outside Spark; and explicit, recorded ledger resets. Idempotent.
ALTER TABLE kafka2pg.batch_partitions ADD COLUMN IF NOT EXISTS committed_records bigint;
ALTER TABLE kafka2pg.batch_partitions ADD COLUMN IF NOT EXISTS aborted_records bigint;
ALTER TABLE kafka2pg.batch_partitions ADD COLUMN IF NOT EXISTS marker_offsets bigint;
ALTER TABLE kafka2pg.batch_partitions ADD COLUMN IF NOT EXISTS compacted_offsets bigint;

-- A head moved by hand (topic recreated, cluster restored): who, when, from where to where.
-- Ledger ranges and rows of batches up to after_batch_id belong to the topic before the reset.
CREATE TABLE IF NOT EXISTS kafka2pg.ledger_resets (
    reset_id        bigserial   PRIMARY KEY,
    pipeline        text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    from_offset     bigint,
    to_offset       bigint      CHECK (to_offset >= 0),  -- NULL: head dropped, partition gone
    after_batch_id  bigint      NOT NULL,
    reason          text        NOT NULL,
    reset_by        text        NOT NULL,
    reset_at        timestamptz NOT NULL DEFAULT now()
);

-- Rows of the topic as it was before a reset, moved out of the target and the quarantine by
-- `kafka2pg reset --archive-old-rows` so the recreated topic's offsets do not collide with them.
CREATE TABLE IF NOT EXISTS kafka2pg.archived_rows (
    reset_id        bigint      NOT NULL REFERENCES kafka2pg.ledger_resets,
    pipeline        text        NOT NULL,
    source          text        NOT NULL CHECK (source IN ('target', 'quarantine')),
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    batch_id        bigint      NOT NULL,
    row_data        jsonb       NOT NULL,
    archived_at     timestamptz NOT NULL DEFAULT now()
);

-- After a reset, a recreated topic reuses offsets: ledger ranges carry the partition's
-- generation (how many resets it has had), so old and new ranges both stay on record.
ALTER TABLE kafka2pg.ledger_ranges ADD COLUMN IF NOT EXISTS generation integer NOT NULL DEFAULT 0;
ALTER TABLE kafka2pg.ledger_ranges DROP CONSTRAINT IF EXISTS ledger_ranges_pkey;
ALTER TABLE kafka2pg.ledger_ranges ADD CONSTRAINT ledger_ranges_pkey
    PRIMARY KEY (pipeline, kafka_partition, generation, start_offset);
