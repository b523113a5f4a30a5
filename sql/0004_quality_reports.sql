-- Where each batch's quality report (self-contained HTML built from the GX results) was written.
ALTER TABLE kafka2pg.batches ADD COLUMN IF NOT EXISTS report_path text;
