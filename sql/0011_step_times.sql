-- When each step of a batch ended (the clock at its state change, set by the batch store's
-- transition): the operator's batches page shows stage, validate and promote durations from them.
-- validated_at is the quality gate's verdict, promotable or rejected. Nullable, no default: adding
-- them rewrites no row of a long ledger; batches finished before this migration show none.
-- The history page reads a pipeline's replays, undos and resets newest first by index. Idempotent.
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS staged_at timestamptz;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS validated_at timestamptz;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS promoted_at timestamptz;
CREATE INDEX IF NOT EXISTS replays_pipeline_time ON kafka2pg.replays (pipeline, requested_at DESC, replay_id DESC);
CREATE INDEX IF NOT EXISTS ledger_resets_pipeline_time
    ON kafka2pg.ledger_resets (pipeline, reset_at DESC, reset_id DESC);
