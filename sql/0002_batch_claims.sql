-- Fencing: every run that claims a batch (plans it, or resumes it after a crash) bumps the
-- batch's epoch; each later step of that run checks the epoch it was given, so a zombie run
-- still holding an older epoch fails instead of writing. Idempotent.
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS epoch bigint NOT NULL DEFAULT 1;
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS claimed_at timestamptz NOT NULL DEFAULT now();
