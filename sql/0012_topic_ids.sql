-- Each ledger head records the ID of the topic its offset belongs to (Kafka's topic ID, KIP-516):
-- a topic deleted and recreated under the same name gets a new ID and numbers its offsets
-- from 0 again, so a head of the old topic must not be read as a position in the new one.
-- NULL: written before kafka2pg recorded IDs; the next promotion records the topic's ID.
ALTER TABLE kafka2pg.ledger_heads ADD COLUMN IF NOT EXISTS topic_id text;
