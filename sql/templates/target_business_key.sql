-- The business key is unique in the target: a duplicate that slipped past validation makes
-- promotion fail loudly instead of landing twice.
CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {table} ({columns});
