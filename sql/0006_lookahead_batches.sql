-- Lookahead: a run catching up a backlog (batches_per_run > 1) plans and stages batch N+1 while
-- batch N is validated and promoted. N+1 records N in after_batch_id and is planned from N's
-- planned ends, so for N's partitions its compare-and-set succeeds only once N is promoted. The open live
-- batch with the lowest id is the pipeline's root; a new run resumes (or abandons) it and
-- abandons any open batch after it. Idempotent.
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS after_batch_id bigint REFERENCES kafka2pg.batches;
DROP INDEX IF EXISTS kafka2pg.batches_one_open_live_batch;
-- Two planners racing cannot both open a batch from the heads (planners also hold lock_plan) ...
CREATE UNIQUE INDEX IF NOT EXISTS batches_one_open_live_root ON kafka2pg.batches (pipeline)
    WHERE kind = 'live' AND state IN ('planned', 'staged', 'validated') AND after_batch_id IS NULL;
-- ... nor two lookaheads after one batch.
CREATE UNIQUE INDEX IF NOT EXISTS batches_one_open_lookahead ON kafka2pg.batches (after_batch_id)
    WHERE kind = 'live' AND state IN ('planned', 'staged', 'validated') AND after_batch_id IS NOT NULL;
