-- A batch's (and a chunk's) staged rows are read, replaced and deleted by batch_id and chunk.
CREATE INDEX IF NOT EXISTS {index} ON {table} ({columns});
