"""The audit command finds planted losses and duplicates and names their offsets."""

import os
import subprocess
import sys
from pathlib import Path

from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.devtools.producer import produce, produce_sample, sample_events

ROOT = Path(__file__).resolve().parents[2]


def verify_cli(env):
    return subprocess.run(
        [sys.executable, "-m", "kafka2pg", "verify", "--pipeline", env.pipeline.name],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT / "plugins"),
            "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
            "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
            "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        },
    )


def test_clean_pipeline_audits_clean_including_quarantine(make_pipeline, run_batch):
    env = make_pipeline(max_records_per_batch=100)
    produce_sample(env.settings.bootstrap_servers, env.topic, 250, seed=21)
    produce(env.settings.bootstrap_servers, env.topic, [b"garbage"], key_field=None)
    while run_batch(env) is not None:
        pass
    audits = audit_pipeline(env.settings, env.pipeline)
    assert sum(a.kafka_records for a in audits) == 251
    assert sum(a.matched for a in audits) == 251
    assert all(a.clean for a in audits)
    done = verify_cli(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "result: clean" in done.stdout


def test_planted_loss_and_duplicate_are_reported_with_offsets(make_pipeline, run_batch, db):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(40, seed=22)), key_field=None)
    run_batch(env)
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    db.execute(sql.SQL("DELETE FROM {} WHERE kafka_offset = 17").format(target))
    db.execute(
        sql.SQL(
            "INSERT INTO kafka2pg.quarantine (pipeline, batch_id, kafka_topic, kafka_partition, kafka_offset, reason)"
            " SELECT %s, batch_id, kafka_topic, kafka_partition, kafka_offset, 'planted'"
            " FROM {} WHERE kafka_offset = 23"
        ).format(target),
        (env.pipeline.name,),
    )
    (audit,) = audit_pipeline(env.settings, env.pipeline)
    assert (audit.missing, audit.duplicated, audit.unexplained) == (1, 1, 0)
    assert audit.missing_offsets == [17] and audit.duplicated_offsets == [23]
    done = verify_cli(env)
    assert done.returncode == 1
    assert "partition 0 missing offsets: 17" in done.stdout
    assert "partition 0 duplicated offsets: 23" in done.stdout
    assert "DISCREPANCIES FOUND" in done.stdout


def test_a_batch_promoted_while_the_audit_runs_is_not_a_discrepancy(make_pipeline, run_batch, spark, monkeypatch):
    """The audit reads the ledger and the rows in one snapshot: a promotion between its reads
    of one partition and the next is wholly outside it, not rows beyond the head it read."""
    from kafka2pg import audit
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    env = make_pipeline(partitions=3, max_records_per_batch=60)
    produce_sample(env.settings.bootstrap_servers, env.topic, 120, seed=23)
    run_batch(env)
    second = open_batch(env.settings, env.pipeline).batch
    stage_batch(spark, env.settings, env.pipeline, second.batch_id)
    validate_batch(env.settings, env.pipeline, second.batch_id)
    reads = audit._kafka_offsets
    promoted = []

    def promote_during_the_audit(*args, **kwargs):
        if not promoted:  # before the first partition is compared
            promoted.append(promote_batch(env.settings, env.pipeline, second.batch_id))
        return reads(*args, **kwargs)

    monkeypatch.setattr(audit, "_kafka_offsets", promote_during_the_audit)
    audits = audit_pipeline(env.settings, env.pipeline)
    assert promoted and promoted[0].promoted + promoted[0].quarantined == 60
    assert all(a.clean for a in audits), audits
    assert sum(a.matched for a in audits) == 60  # the first batch's: the second is after the snapshot
    monkeypatch.setattr(audit, "_kafka_offsets", reads)
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits) and sum(a.matched for a in audits) == 120
