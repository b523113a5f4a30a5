-- A check the quality gate left to promotion (the promoted-key probe, run by the target's unique
-- index) is marked by this column, not by the wording of its details. Idempotent.
ALTER TABLE kafka2pg.batch_checks ADD COLUMN IF NOT EXISTS deferred boolean NOT NULL DEFAULT false;
UPDATE kafka2pg.batch_checks SET deferred = true WHERE NOT deferred AND details LIKE 'deferred to promotion%';
