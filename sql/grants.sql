-- The runtime role's privileges on kafka2pg's own objects (Airflow tasks, the Spark job, the CLI's
-- run-time commands). Not a migration: `kafka2pg grant --role NAME` fills in the role and the
-- database, adds each pipeline's tables (templates/pipeline_grants.sql) and applies it as the role
-- owning these objects; `--print` shows it. The runtime role gets no CREATE anywhere: schema changes
-- are `kafka2pg migrate`'s alone. Re-run it after adding a pipeline or a migration that adds a table.

-- TEMPORARY: promotion numbers the rows PostgreSQL refused in a temporary table to isolate them.
GRANT CONNECT, TEMPORARY ON DATABASE {database} TO {role};
GRANT USAGE ON SCHEMA public, kafka2pg TO {role};

-- Every plan checks that each migration in sql/ is recorded here.
GRANT SELECT ON public.kafka2pg_migrations TO {role};

-- Batches (their partitions, their replay records) are planned, claimed and moved on; never deleted.
GRANT SELECT, INSERT, UPDATE ON kafka2pg.batches, kafka2pg.batch_partitions, kafka2pg.replays TO {role};
-- Heads move by compare-and-set; an undo or a reset deletes and re-inserts them.
GRANT SELECT, INSERT, UPDATE, DELETE ON kafka2pg.ledger_heads TO {role};
-- Deleted only where something is taken back: an undo deletes its batch's ledger ranges; a replay,
-- an undo or `reset --archive-old-rows` their range's quarantine rows; (re-)validation a batch's checks.
GRANT SELECT, INSERT, DELETE ON kafka2pg.ledger_ranges, kafka2pg.quarantine, kafka2pg.batch_checks TO {role};
-- A row PostgreSQL refused at promotion is quarantined first, its raw bytes read again from Kafka
-- after the promotion commits: updated in those columns only.
GRANT UPDATE (raw_key, raw_value, raw_headers) ON kafka2pg.quarantine TO {role};
GRANT SELECT, INSERT ON kafka2pg.ledger_resets TO {role};
-- Each batch's quality result: written (or replaced) with the gate's verdict, cleared when the
-- batch is read again; the operator's pages and `kafka2pg report` read it.
GRANT SELECT, INSERT, UPDATE, DELETE ON kafka2pg.quality_results TO {role};
-- `reset --archive-old-rows` moves rows here; only the operator reads them.
GRANT INSERT ON kafka2pg.archived_rows TO {role};
-- The bigserial ids of batches, resets and replays.
GRANT USAGE ON SEQUENCE kafka2pg.batches_batch_id_seq, kafka2pg.ledger_resets_reset_id_seq,
    kafka2pg.replays_replay_id_seq TO {role};
