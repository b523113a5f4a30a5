-- A quarantined record keeps its raw key, value and headers as bytes, whatever they hold (not
-- valid UTF-8, NUL, binary): nothing is lost, and a replay with a fixed config can load it.
-- raw_headers is a bytea[n][2] array: one {key, value} pair per header, in the record's order.
ALTER TABLE kafka2pg.quarantine ADD COLUMN IF NOT EXISTS raw_key bytea;
ALTER TABLE kafka2pg.quarantine ADD COLUMN IF NOT EXISTS raw_headers bytea[];
ALTER TABLE kafka2pg.quarantine ALTER COLUMN raw_value TYPE bytea USING convert_to(raw_value, 'UTF8');

-- The staging tables created before this migration get the same columns (their rows are transient).
DO $$
DECLARE
    staging record;
BEGIN
    FOR staging IN
        SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'kafka2pg' AND c.relkind = 'r' AND c.relname LIKE 'stg\_%'
    LOOP
        EXECUTE format(
            'ALTER TABLE kafka2pg.%I ADD COLUMN IF NOT EXISTS raw_key bytea,'
            ' ADD COLUMN IF NOT EXISTS raw_headers bytea[],'
            ' ALTER COLUMN raw_value TYPE bytea USING convert_to(raw_value, %L)',
            staging.relname, 'UTF8');
    END LOOP;
END
$$;
