-- Replays and undos: a replay re-reads a range the ledger already loaded and replaces its rows
-- (or only reports differences); an undo removes the newest batch and rewinds its heads.
-- Each is recorded here: who, when, which ranges, row counts before and after. Idempotent.
ALTER TABLE kafka2pg.batches DROP CONSTRAINT IF EXISTS batches_state_check;
ALTER TABLE kafka2pg.batches ADD CONSTRAINT batches_state_check CHECK (state IN
    ('planned', 'staged', 'validated', 'promoted', 'rejected', 'abandoned', 'verified', 'undone'));

CREATE TABLE IF NOT EXISTS kafka2pg.replays (
    replay_id              bigserial   PRIMARY KEY,
    batch_id               bigint      NOT NULL REFERENCES kafka2pg.batches,  -- the replay batch, or the undone batch
    pipeline               text        NOT NULL,
    topic                  text        NOT NULL,
    operation              text        NOT NULL CHECK (operation IN ('replace', 'verify-only', 'undo')),
    ranges                 jsonb       NOT NULL,  -- [{"partition": p, "start": s, "end": e}], end exclusive
    window_from            timestamptz,
    window_to              timestamptz,
    requested_by           text        NOT NULL,
    reason                 text        NOT NULL DEFAULT '',
    run_id                 text,
    target_rows_before     bigint,
    quarantine_rows_before bigint,
    target_rows_after      bigint,
    quarantine_rows_after  bigint,
    differences            jsonb,
    requested_at           timestamptz NOT NULL DEFAULT now(),
    finished_at            timestamptz
);
CREATE INDEX IF NOT EXISTS replays_pipeline ON kafka2pg.replays (pipeline, replay_id DESC);
