"""Migrations create each pipeline's tables and indexes under names that fit PostgreSQL, and keep
what a database migrated by an earlier version already has."""

import dataclasses
import logging
import re
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import kafka2pg.migrations
import kafka2pg.opening
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import ObjectNameTakenError, SchemaNotReadyError
from kafka2pg.migrations import migrate, migration_files, require_ready
from kafka2pg.opening import open_batch
from kafka2pg.quality import validate_batch
from kafka2pg.staging import stage_batch
from kafka2pg.steps import promote_batch


def indexes(db, schema: str, table: str) -> dict[str, str]:
    """Index name -> its definition, of one table."""
    rows = db.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = %s", (schema, table)
    )
    return dict(rows.fetchall())


def table_name(length: int) -> str:
    """A fresh table name of `length` bytes."""
    return ("t_" + uuid.uuid4().hex * 2)[:length]


def rename_index(db, schema: str, old: str, new: str) -> None:
    db.execute(sql.SQL("ALTER INDEX {} RENAME TO {}").format(sql.Identifier(schema, old), sql.Identifier(new)))


def test_a_database_migrated_before_keeps_its_index_names_and_gets_no_second_index(make_pipeline, db):
    env = make_pipeline(create_topic=False, target_table=table_name(55))
    pipeline = env.pipeline
    # The names an earlier version gave: <table>_business_key cut to 63 bytes, stg_<name>_batch.
    old_key_index = f"{pipeline.target_table}_business_key"[:63]
    rename_index(db, "public", pipeline.business_key_index, old_key_index)
    rename_index(db, "kafka2pg", pipeline.staging_index, f"{pipeline.staging_table}_batch")
    migrate(env.settings.database_url, [pipeline])
    target = indexes(db, "public", pipeline.target_table)
    assert sorted(target) == sorted([old_key_index, f"{pipeline.target_table}_pkey"])
    assert list(indexes(db, "kafka2pg", pipeline.staging_table)) == [f"{pipeline.staging_table}_batch"]


def test_a_63_byte_target_gets_its_unique_business_key_index(make_pipeline, db):
    """The name an earlier version derived was the table's own name, so it was never created."""
    env = make_pipeline(create_topic=False, target_table=table_name(63))
    pipeline = env.pipeline
    target = indexes(db, "public", pipeline.target_table)
    assert "CREATE UNIQUE INDEX" in target[pipeline.business_key_index]
    assert "(event_id)" in target[pipeline.business_key_index]


def test_a_name_migrations_need_that_another_relation_holds_fails_naming_it(make_pipeline, db):
    first = make_pipeline(create_topic=False)
    pkey = f"{first.pipeline.target_table}_pkey"
    with pytest.raises(ObjectNameTakenError) as taken_error:
        make_pipeline(create_topic=False, target_table=pkey)
    assert (taken_error.value.relation, taken_error.value.taken_by) == (f"public.{pkey}", "an index")
    assert taken_error.value.field == "target_table"
    taken = f"taken_{first.pipeline.name}"
    db.execute(sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier("public", f"{taken}_business_key")))
    with pytest.raises(ObjectNameTakenError) as taken_error:
        make_pipeline(create_topic=False, target_table=taken)
    assert (taken_error.value.relation, taken_error.value.taken_by) == (f"public.{taken}_business_key", "a table")


def test_a_changed_business_key_keeps_the_old_index_and_says_so(make_pipeline, db, caplog):
    env = make_pipeline(create_topic=False)
    changed = dataclasses.replace(env.pipeline, business_key=("customer_id",))
    with caplog.at_level(logging.WARNING, logger="kafka2pg.migrations"):
        migrate(env.settings.database_url, [changed])
    assert "already has an index" in caplog.text and "customer_id" in caplog.text
    assert "(event_id)" in indexes(db, "public", env.pipeline.target_table)[env.pipeline.business_key_index]


def test_a_changed_column_type_stops_the_run_until_migrate_makes_staging_again_and_names_the_target_column(
    make_pipeline, db, caplog
):
    from kafka2pg.exceptions import ConfigError
    from kafka2pg.migrations import column_types

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(3, seed=97)))
    planned = open_batch(env.settings, env.pipeline).batch.batch_id
    retyped = tuple(dataclasses.replace(c, type="text") if c.name == "customer_id" else c for c in env.pipeline.columns)
    changed = dataclasses.replace(env.pipeline, columns=retyped)
    with pytest.raises(SchemaNotReadyError) as stopped:
        require_ready(env.settings, changed)
    message = str(stopped.value)
    assert "the staging table's column customer_id is bigint, the pipeline declares text" in message, message
    assert "run it again" in message, message

    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    insert = "INSERT INTO {} (batch_id, chunk, kafka_topic, kafka_partition, kafka_offset) VALUES (%s, 0, 't', 0, 0)"
    db.execute(sql.SQL(insert).format(staging), (planned,))  # a row of a batch still open
    with pytest.raises(ConfigError, match=rf"holds the rows of open batch\(es\) {planned} \(planned\)"):
        migrate(env.settings.database_url, [changed])
    assert column_types(db, "kafka2pg", env.pipeline.staging_table)["customer_id"] == "bigint"  # nothing changed

    db.execute("UPDATE kafka2pg.batches SET state = 'rejected' WHERE batch_id = %s", (planned,))  # only to look at
    with caplog.at_level(logging.WARNING, logger="kafka2pg.migrations"):
        migrate(env.settings.database_url, [changed])
    assert column_types(db, "kafka2pg", env.pipeline.staging_table)["customer_id"] == "text"
    assert "column customer_id is bigint, the pipeline declares text; migrate changes no existing target" in caplog.text
    require_ready(env.settings, changed)  # the target's type is the user's to change


def test_a_stage_job_started_before_migrate_retyped_staging_stages_nothing(make_pipeline, spark, db):
    """`migrate` made the staging table again with a column of another type of the same width
    (bigint to double precision) while a stage job started with the old pipelines file was about
    to write: its binary COPY would store the old bytes as other numbers, silently. Its chunk
    writer refuses, naming the column; nothing staged, the batch stays planned."""
    from kafka2pg.exceptions import ConfigError

    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(3, seed=98)))
    planned = open_batch(env.settings, env.pipeline).batch.batch_id
    retyped = tuple(
        dataclasses.replace(c, type="double precision") if c.name == "customer_id" else c for c in env.pipeline.columns
    )
    migrate(env.settings.database_url, [dataclasses.replace(env.pipeline, columns=retyped)])

    with pytest.raises(ConfigError) as refused:
        stage_batch(spark, env.settings, env.pipeline, planned)
    message = str(refused.value)
    assert "column customer_id is double precision, the pipeline declares bigint" in message, message
    assert "Nothing was staged; the batch stays planned" in message, message
    staging = sql.Identifier("kafka2pg", env.pipeline.staging_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(staging)).fetchone()[0] == 0
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (planned,)).fetchone()[0]
    assert state == "planned"


@pytest.fixture
def own_database(base_settings, db):
    """A database of its own in the test cluster (migrations change the whole schema), dropped after."""
    name = f"k2p_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(base_settings.database_url, dbname=name)
    db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_a_database_migrated_up_to_0008_names_migration_0009_at_every_step(
    make_pipeline, spark, own_database, monkeypatch
):
    """kafka2pg upgraded with its migrations from 0009 (batch_checks.deferred) on not applied yet:
    the plan step's readiness check names them, and so does a step that needs them for a batch
    planned before the upgrade (staging or the gate), instead of psycopg's UndefinedColumn or
    UndefinedTable. After `migrate` the batch goes on."""
    env = make_pipeline(partitions=1)
    shipped = migration_files()
    up_to_0008 = [p for p in shipped if p.name < "0009"]
    assert shipped[len(up_to_0008)].name == "0009_deferred_checks.sql"
    with monkeypatch.context() as patch:
        patch.setattr(kafka2pg.migrations, "migration_files", lambda: up_to_0008)
        migrate(own_database, [env.pipeline])
    settings = dataclasses.replace(env.settings, database_url=own_database)
    with psycopg.connect(own_database) as conn:
        applied = [r[0] for r in conn.execute("SELECT name FROM public.kafka2pg_migrations ORDER BY name")]
    assert applied == [p.name for p in up_to_0008]

    with pytest.raises(SchemaNotReadyError) as not_ready:
        require_ready(settings, env.pipeline)
    pending = tuple(p.name for p in shipped[len(up_to_0008) :])
    assert not_ready.value.missing == tuple(f"migration {name}" for name in pending)

    produce(settings.bootstrap_servers, env.topic, list(sample_events(3, seed=82)), key_field=None)
    with pytest.raises(SchemaNotReadyError) as not_ready:  # the plan reads the heads' topic IDs (0012)
        open_batch(settings, env.pipeline)
    assert not_ready.value.missing == tuple(f"migration {name}" for name in pending)
    with monkeypatch.context() as patch:  # a batch planned before the upgrade, by a kafka2pg without 0012
        patch.setattr(kafka2pg.opening, "check_topic_identity", lambda *args: None)
        batch_id = open_batch(settings, env.pipeline).batch.batch_id
    with pytest.raises(SchemaNotReadyError) as not_ready:  # staging or the gate, whichever needs it first
        stage_batch(spark, settings, env.pipeline, batch_id)
        validate_batch(settings, env.pipeline, batch_id)
    assert not_ready.value.missing == tuple(f"migration {name}" for name in pending)
    message = str(not_ready.value)
    assert f"pending migration(s) {', '.join(pending)}" in message and "Run `./kafka2pg migrate`" in message
    assert isinstance(not_ready.value.__cause__, psycopg.errors.UndefinedColumn | psycopg.errors.UndefinedTable)

    assert migrate(own_database, [env.pipeline]) == list(pending)
    require_ready(settings, env.pipeline)
    stage_batch(spark, settings, env.pipeline, batch_id)
    assert validate_batch(settings, env.pipeline, batch_id).state == "validated"
    assert promote_batch(settings, env.pipeline, batch_id).promoted == 3


def test_commands_on_a_database_never_migrated_say_to_migrate_instead_of_a_traceback(
    make_pipeline, own_database, monkeypatch, capsys
):
    """`grant` before `migrate`, and the commands that read the ledger (verify, report --html,
    quarantine): a SchemaNotReadyError naming `kafka2pg migrate`, exit 2 (verify's 1 means a
    discrepancy found, report's 1 no report yet)."""
    from kafka2pg import cli

    env = make_pipeline(partitions=1, create_topic=True)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", own_database)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    capsys.readouterr()
    for command in (
        ["grant", "--role", "pg_monitor"],  # a role that exists (a built-in one): the schema is what lacks
        ["verify"],
        ["report", "--html", "--pipeline", env.pipeline.name],
        ["quarantine", "--pipeline", env.pipeline.name],
    ):
        assert cli.main(command) == 2, command
        shown = capsys.readouterr().err
        assert "SchemaNotReadyError" in shown and re.search(r"[Rr]un `\./kafka2pg migrate`", shown), (command, shown)
        assert "Traceback" not in shown
