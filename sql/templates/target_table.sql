-- Target table of one pipeline; the table name and the column list are filled in by
-- kafka2pg.migrations with psycopg sql.Identifier-composed fragments. Idempotent.
CREATE TABLE IF NOT EXISTS {table} (
    {columns},
    kafka_topic     text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    kafka_timestamp timestamptz,
    batch_id        bigint      NOT NULL,
    promoted_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset)
);
