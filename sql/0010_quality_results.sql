-- Each batch's quality result (counts, Great Expectations results with sample offsets, the SQL
-- checks, the verdict) as the quality gate decided it, written in the verdict's transaction: the
-- report is rendered from this row, and files on disk are only an export. json, not jsonb: the
-- report shows the counts in the order the gate wrote them. Idempotent.
CREATE TABLE IF NOT EXISTS kafka2pg.quality_results (
    batch_id     bigint      PRIMARY KEY REFERENCES kafka2pg.batches ON DELETE CASCADE,
    verdict      text        NOT NULL CHECK (verdict IN ('promotable', 'rejected')),
    result       json        NOT NULL,
    validated_at timestamptz NOT NULL DEFAULT now()
);

-- The operator's pages read a batch's quarantine rows page by page, and each pipeline's open
-- batches (STUCK), without scanning a long ledger.
CREATE INDEX IF NOT EXISTS quarantine_batch ON kafka2pg.quarantine (batch_id, kafka_partition, kafka_offset);
CREATE INDEX IF NOT EXISTS batches_open ON kafka2pg.batches (pipeline, batch_id)
    WHERE state IN ('planned', 'staged', 'validated');
