-- Staging table of one pipeline: rows of unpromoted batches, written by the Spark job in
-- chunks (one per Spark task) that a retry replaces. UNLOGGED: a crash loses only staging
-- rows, and a batch whose staging is lost is simply staged again from Kafka.
CREATE UNLOGGED TABLE IF NOT EXISTS {table} (
    batch_id          bigint  NOT NULL,
    chunk             integer NOT NULL,
    kafka_topic       text    NOT NULL,
    kafka_partition   integer NOT NULL,
    kafka_offset      bigint  NOT NULL,
    kafka_timestamp   timestamptz,
    {columns},
    raw_key           bytea,  -- raw_*: only for a record admission refused (kafka2pg.admission)
    raw_value         bytea,
    raw_headers       bytea[],
    quarantine_reason text
);
