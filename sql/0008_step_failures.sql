-- A step that fails on an open batch is recorded with it, so a batch that fails the same step
-- run after run (a wedge) is reported STUCK by `kafka2pg status`, `verify` and the task log.
-- failures counts consecutive runs (claim epochs) that failed at failed_step; any state change
-- of the batch clears them.
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS failed_step text;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS failed_epoch bigint;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS failures integer NOT NULL DEFAULT 0;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS failing_since timestamptz;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS last_failure text;
