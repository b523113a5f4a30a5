"""Least privilege: `migrate` runs as the owner, every DAG step as a runtime role holding only what
`kafka2pg grant` gave it; a database not ready for a pipeline fails its plan once, naming what is missing."""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from urllib.parse import quote, urlsplit

import psycopg
import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException
from psycopg import sql

from kafka2pg import cli, tasks
from kafka2pg.audit import audit_pipeline, format_audit
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import ConfigError, SchemaNotReadyError
from kafka2pg.grants import apply_grants
from kafka2pg.ledger import reset_head
from kafka2pg.migrations import STAGING_PRIVILEGES, migrate, migration_files
from kafka2pg.report import ledger_report
from kafka2pg.staging import stage_batch
from kafka2pg.status import pipeline_status
from kafka2pg.undo import abandon_replay, undo_batch

TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A LOGIN role with a password and no privilege but those `kafka2pg grant` gives it."""

    role: str
    password: str
    url: str

    def env(self, owner_env, monkeypatch):
        """The pipeline of `owner_env` as the runtime role sees it: settings and the tasks' environment."""
        settings = dataclasses.replace(owner_env.settings, database_url=self.url)
        use_environment(settings, monkeypatch)
        return dataclasses.replace(owner_env, settings=settings)


def use_environment(settings, monkeypatch) -> None:
    """The environment the tasks and the CLI read their settings from."""
    for name, value in (
        ("KAFKA2PG_BOOTSTRAP_SERVERS", settings.bootstrap_servers),
        ("KAFKA2PG_DATABASE_URL", settings.database_url),
        ("KAFKA2PG_PIPELINES", str(settings.pipelines_file)),
        ("KAFKA2PG_STATE_DIR", str(settings.state_dir)),
    ):
        monkeypatch.setenv(name, value)


@pytest.fixture
def runtime(db, base_settings):
    """The role, in a database where PUBLIC holds nothing either (PostgreSQL gives PUBLIC CONNECT and
    TEMPORARY on a database and USAGE on schema public by default; every other test connects as the
    superuser, which needs none of them). PostgreSQL's defaults come back afterwards."""
    role = f"k2p_runtime_{uuid.uuid4().hex[:8]}"
    password = secrets.token_urlsafe(18)
    database = sql.Identifier(db.execute("SELECT current_database()").fetchone()[0])
    db.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
    db.execute(sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(database))
    db.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    base = urlsplit(base_settings.database_url)
    netloc = f"{quote(role, safe='')}:{quote(password, safe='')}@{base.hostname}:{base.port}"
    yield Runtime(role, password, base._replace(netloc=netloc).geturl())
    db.execute(sql.SQL("GRANT CONNECT, TEMPORARY ON DATABASE {} TO PUBLIC").format(database))
    db.execute("GRANT USAGE ON SCHEMA public TO PUBLIC")
    db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))  # revokes its grants
    db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def target_of(env) -> sql.Identifier:
    return sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)


def counts(db, env) -> tuple[int, int]:
    """Rows in the target and in the quarantine (read as the owner)."""
    landed = db.execute(sql.SQL("SELECT count(*) FROM {}").format(target_of(env))).fetchone()[0]
    quarantined = db.execute(
        "SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]
    return landed, quarantined


def live_run(spark, env, run_id: str) -> dict:
    """One run of the live DAG's steps: plan, read_and_stage (Spark), validate, promote."""
    planned = tasks.plan(env.pipeline.name, run_id=run_id)
    assert planned is not None, "nothing planned"
    stage_batch(spark, env.settings, env.pipeline, planned["batch_id"], planned["epoch"])
    tasks.validate(env.pipeline.name, planned["batch_id"], planned["epoch"])
    return tasks.promote(env.pipeline.name, planned["batch_id"], planned["epoch"])


def test_every_step_runs_as_a_runtime_role_holding_only_the_granted_privileges(
    make_pipeline, spark, db, heads, runtime, monkeypatch
):
    owner_env = make_pipeline(partitions=2)  # migrated as the owner (the test cluster's superuser)
    apply_grants(owner_env.settings.database_url, [owner_env.pipeline], runtime.role)
    env = runtime.env(owner_env, monkeypatch)
    first = list(sample_events(80, seed=91))
    produce(env.settings.bootstrap_servers, env.topic, first)

    promoted = live_run(spark, env, "live-1")
    assert promoted["promoted"] == len(first) and counts(db, env) == (len(first), 0)
    assert sum(heads(env).values()) == len(first)

    # Rows the target refuses at promotion are isolated through a temporary table (TEMPORARY).
    db.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT small_customer CHECK (customer_id < 10000)").format(target_of(env))
    )
    # A key the first batch promoted: the check was left to the unique index, whose refusal has the
    # promotion run it again (the stored check re-marked: DELETE and INSERT, no UPDATE granted).
    second = list(sample_events(30, seed=92))
    for event in second[::7]:
        event["customer_id"] = 100_000
    refused = len(second[::7])
    second[1]["event_id"] = first[0]["event_id"]
    produce(env.settings.bootstrap_servers, env.topic, second)
    promoted = live_run(spark, env, "live-2")
    assert (promoted["promoted"], promoted["quarantined"]) == (len(second) - refused - 1, refused + 1)
    # Each quarantined row keeps the record's raw bytes, filled after the promotion committed.
    kept = db.execute(
        "SELECT count(*) FILTER (WHERE raw_value IS NOT NULL), count(*) FROM kafka2pg.quarantine WHERE batch_id = %s",
        (promoted["batch_id"],),
    ).fetchone()
    assert kept == (refused + 1, refused + 1)

    undone = undo_batch(env.settings, env.pipeline, promoted["batch_id"], confirm=True, reason="least privilege")
    assert undone.applied and counts(db, env) == (len(first), 0)
    assert sum(heads(env).values()) == len(first)

    # A replay (replace) of partition 0's loaded range, through the replay DAG's steps.
    head0 = heads(env)[0]
    params = {"mode": "replace", "offset_ranges": [{"partition": 0, "start": 0, "end": head0}]}
    planned = tasks.plan_replay(env.pipeline.name, params, run_id="replay-1", run_type="manual", requested_by="test")
    stage_batch(spark, env.settings, env.pipeline, planned["batch_id"], planned["epoch"])
    tasks.validate(env.pipeline.name, planned["batch_id"], planned["epoch"])
    replayed = tasks.finish_replay(env.pipeline.name, planned["batch_id"], planned["epoch"])
    assert replayed["promoted"] == head0 and counts(db, env) == (len(first), 0)
    # A replay whose run ended without it, abandoned by hand.
    left = tasks.plan_replay(env.pipeline.name, params, run_id="replay-2", run_type="manual", requested_by="test")
    stage_batch(spark, env.settings, env.pipeline, left["batch_id"], left["epoch"])
    assert abandon_replay(env.settings, env.pipeline, left["batch_id"], confirm=True).applied
    assert counts(db, env) == (len(first), 0)
    staged = sql.SQL("SELECT count(*) FROM {} WHERE batch_id = %s").format(
        sql.Identifier("kafka2pg", env.pipeline.staging_table)
    )
    assert db.execute(staged, (left["batch_id"],)).fetchone()[0] == 0
    state = db.execute("SELECT state FROM kafka2pg.batches WHERE batch_id = %s", (left["batch_id"],)).fetchone()[0]
    assert state == "abandoned"

    reset = reset_head(env.settings, env.pipeline, 1, 0, reason="test", confirm=True, archive_old_rows=True)
    assert reset.applied
    archived = db.execute(
        "SELECT count(*) FROM kafka2pg.archived_rows WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]
    assert archived == len(first) - head0 and counts(db, env) == (head0, 0)

    live_run(spark, env, "live-3")  # partition 1 from 0 again, and the undone batch's offsets
    produced = len(first) + len(second)
    assert counts(db, env) == (produced - refused - 1, refused + 1)
    assert sum(heads(env).values()) == produced
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits), format_audit(env.pipeline, audits)
    assert "STUCK" not in ledger_report(env.settings, env.pipeline)


def plan_fails_once(env) -> SchemaNotReadyError:
    """The plan task fails without retry (AirflowFailException); the kafka2pg error behind it."""
    with pytest.raises(AirflowFailException) as failed:
        tasks.plan(env.pipeline.name, run_id="not-ready")
    assert isinstance(failed.value.__cause__, SchemaNotReadyError)
    return failed.value.__cause__


def test_a_plan_on_a_database_not_ready_fails_once_naming_what_is_missing_and_changes_nothing(
    make_pipeline, db, heads, runtime, monkeypatch, tmp_path, capsys
):
    owner_env = make_pipeline(partitions=1)
    apply_grants(owner_env.settings.database_url, [owner_env.pipeline], runtime.role)
    env = runtime.env(owner_env, monkeypatch)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(10, seed=93)))
    staging = f"kafka2pg.{env.pipeline.staging_table}"

    newest = migration_files()[-1].name
    assert newest == "0012_topic_ids.sql"  # what it adds is taken away below: update both together
    applied_at = db.execute(
        "DELETE FROM public.kafka2pg_migrations WHERE name = %s RETURNING applied_at", (newest,)
    ).fetchone()[0]
    hidden = "ALTER TABLE kafka2pg.ledger_heads RENAME COLUMN {} TO {}"
    try:
        error = plan_fails_once(env)
        # As on a database that never had it: the column status reads to check the topic's identity.
        db.execute(hidden.format("topic_id", "topic_id_not_yet"))
        shown = ledger_report(env.settings, env.pipeline)  # status says so too, beside what it shows
        said = f"NOT READY for a run as role {runtime.role!r} (this command's): PostgreSQL at "
        assert said in shown and f"pending migration(s) {newest}" in shown and "run stops here" not in shown, shown
        assert "ledger:" in shown
        with psycopg.connect(env.settings.database_url, autocommit=True) as conn:  # and `status --json`
            data = pipeline_status(env.settings, env.pipeline, conn).to_json()
        assert data["not_ready_role"] == runtime.role and f"pending migration(s) {newest}" in data["not_ready"]
        assert data["blocked"] is None
        db.execute(hidden.format("topic_id_not_yet", "topic_id"))
        capsys.readouterr()
        assert cli.main(["verify", "--pipeline", env.pipeline.name]) == 1  # the pipeline does not advance
        audited = capsys.readouterr().out
        assert f"pending migration(s) {newest}" in audited and "result: NOT READY" in audited, audited
    finally:
        renamed = db.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = 'kafka2pg'"
            " AND table_name = 'ledger_heads' AND column_name = 'topic_id_not_yet'"
        ).fetchone()
        if renamed:
            db.execute(hidden.format("topic_id_not_yet", "topic_id"))
        db.execute("INSERT INTO public.kafka2pg_migrations (name, applied_at) VALUES (%s, %s)", (newest, applied_at))
    assert error.missing == (f"migration {newest}",)
    assert f"pending migration(s) {newest}" in str(error) and "run `./kafka2pg migrate`" in str(error)

    db.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier("kafka2pg", env.pipeline.staging_table)))
    error = plan_fails_once(env)
    assert error.missing == (f"table {staging}",) and "run `./kafka2pg migrate`" in str(error)

    # `migrate` brings the table back, but not the runtime role's privileges on it.
    migrate(owner_env.settings.database_url, [owner_env.pipeline])
    error = plan_fails_once(env)
    assert error.missing == tuple(f"{p} on {staging}" for p in STAGING_PRIVILEGES)
    assert f"run `./kafka2pg grant --role {runtime.role}`" in str(error)
    apply_grants(owner_env.settings.database_url, [owner_env.pipeline], runtime.role)

    # A deployment upgraded without `grant`: the raw bytes of rows refused at promotion could not be kept.
    role = sql.Identifier(runtime.role)
    db.execute(sql.SQL("REVOKE UPDATE (raw_key, raw_value, raw_headers) ON kafka2pg.quarantine FROM {}").format(role))
    error = plan_fails_once(env)
    assert error.missing == ("UPDATE (raw_key, raw_value, raw_headers) on kafka2pg.quarantine",)
    assert "after adding a pipeline or upgrading kafka2pg" in str(error)
    apply_grants(owner_env.settings.database_url, [owner_env.pipeline], runtime.role)

    # A column the pipelines file gained after the tables were created.
    document = yaml.safe_load(env.settings.pipelines_file.read_text())
    document["pipelines"][0]["columns"].append({"name": "channel", "type": "text"})
    wider = tmp_path / "wider.yaml"
    wider.write_text(yaml.safe_dump(document))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(wider))
    error = plan_fails_once(env)
    target = f"{env.pipeline.target_schema}.{env.pipeline.target_table}"
    assert error.missing == (f"column {target}.channel", f"column {staging}.channel")
    assert "does not change existing ones" in str(error)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))

    batches = db.execute("SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,))
    assert batches.fetchone()[0] == 0 and heads(env) == {}, "a plan that failed its check changed something"
    assert runtime.password not in str(error)
    assert tasks.plan(env.pipeline.name, run_id="ready")["batch_id"] > 0  # migrated and granted: it plans


def test_the_runtime_role_may_create_nothing_and_holds_only_what_each_table_needs(
    make_pipeline, db, runtime, monkeypatch, capsys
):
    env = make_pipeline(create_topic=False)
    role = runtime.role
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table).as_string(db)
    use_environment(env.settings, monkeypatch)  # the owner's URL: `grant` runs as the owner
    assert cli.main(["grant", "--role", role, "--print"]) == 0
    printed = capsys.readouterr().out
    assert f'GRANT SELECT, INSERT, DELETE ON {target} TO "{role}";' in printed
    assert not db.execute("SELECT has_table_privilege(%s, %s, 'SELECT')", (role, target)).fetchone()[0]
    assert cli.main(["grant", "--role", role]) == 0
    owner = urlsplit(env.settings.database_url).username
    with pytest.raises(ConfigError, match="could not grant everything") as refused:  # only an owner passes them on
        apply_grants(runtime.url, [env.pipeline], owner)
    assert "'kafka2pg_postgres' (e.g. AIRFLOW_CONN_KAFKA2PG_POSTGRES) for this command alone" in str(refused.value)
    # The runtime role granting itself: it is told who owns the objects (it used to be told it did).
    with pytest.raises(ConfigError) as itself:
        apply_grants(runtime.url, [env.pipeline], role)
    assert f"that is the role this command connects as. kafka2pg's objects are owned by role {owner!r}" in str(
        itself.value
    )
    with pytest.raises(ConfigError) as owning:
        apply_grants(env.settings.database_url, [env.pipeline], owner)
    assert "It owns kafka2pg's objects and needs no grant." in str(owning.value)

    def held(table: str) -> set[str]:
        return {
            p
            for p in TABLE_PRIVILEGES
            if db.execute("SELECT has_table_privilege(%s, %s, %s)", (role, table, p)).fetchone()[0]
        }

    assert not db.execute("SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)).fetchone()[0]
    for schema in ("public", "kafka2pg", env.pipeline.target_schema):
        assert not db.execute("SELECT has_schema_privilege(%s, %s, 'CREATE')", (role, schema)).fetchone()[0], schema
    assert held(target) == {"SELECT", "INSERT", "DELETE"}
    assert held(sql.Identifier("kafka2pg", env.pipeline.staging_table).as_string(db)) == set(STAGING_PRIVILEGES)
    control = [
        r[0]
        for r in db.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'kafka2pg' AND c.relkind IN ('r', 'p') AND c.relname NOT LIKE 'stg\\_%'"
        )
    ]
    granted = {name: held(f"kafka2pg.{name}") for name in control}
    assert all(granted.values()), f"tables a migration added without a grant in sql/grants.sql: {granted}"
    assert granted["archived_rows"] == {"INSERT"} and "DELETE" not in granted["batches"], granted
    assert not any({"TRUNCATE", "REFERENCES", "TRIGGER"} & privileges for privileges in granted.values()), granted
    sequences = db.execute(
        "SELECT c.relname, has_sequence_privilege(%s, c.oid, 'USAGE'), has_sequence_privilege(%s, c.oid, 'UPDATE')"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'kafka2pg'"
        " AND c.relkind = 'S'",
        (role, role),
    ).fetchall()
    assert sequences and all(usage and not update for _, usage, update in sequences), sequences

    with psycopg.connect(runtime.url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("CREATE TABLE kafka2pg.not_allowed (id int)")
    with pytest.raises(ConfigError, match="the role that owns kafka2pg's objects") as refused:
        migrate(runtime.url, [env.pipeline])
    # A defined connection wins over KAFKA2PG_DATABASE_URL: the advice says which to change.
    assert "owning role's postgres connection as 'kafka2pg_postgres' (e.g." in str(refused.value)
    assert "a defined connection wins over it" in str(refused.value)
    # PostgreSQL's words on one line, with their SQLSTATE, not the statement and a caret under it.
    assert "permission denied for schema" in str(refused.value) and "(SQLSTATE 42501)" in str(refused.value)
    assert "LINE 1" not in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    # The connection the advice names is the pipeline's own.
    elsewhere = dataclasses.replace(env.pipeline, postgres_conn_id="warehouse_owner")
    with pytest.raises(ConfigError, match="the role that owns kafka2pg's objects") as refused:
        migrate(runtime.url, [elsewhere])
    assert "connection as 'warehouse_owner' (e.g. AIRFLOW_CONN_WAREHOUSE_OWNER) for" in str(refused.value)
