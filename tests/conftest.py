"""Shared fixtures: one real Kafka broker + PostgreSQL per test run, one Spark session, and
a fresh topic, pipeline and target table per test so tests are independent."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = [
    {"name": "event_id", "type": "text", "required": True},
    {"name": "customer_id", "type": "bigint", "required": True},
    {"name": "amount", "type": "numeric(12,2)"},
    {"name": "currency", "type": "text"},
    {"name": "event_time", "type": "timestamptz", "field": "ts"},
    {"name": "payload", "type": "jsonb"},
]


def pytest_collection_modifyitems(items):
    for item in items:
        kind = Path(item.fspath).parent.name
        if kind in ("unit", "integration", "e2e", "fault"):
            item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture
def fresh_python():
    """Run Python code in a new interpreter that sees only kafka2pg's plugins folder (and the
    venv's packages): what a module imports or changes for the whole process, seen from nothing
    imported. Returns its stdout's last line; fails the test if the code raised."""
    import subprocess
    import sys

    def run(code: str, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin"},
        )
        if out.returncode:
            pytest.fail(f"the fresh interpreter exited {out.returncode}:\n{out.stderr[-3000:]}")
        return out.stdout.strip().splitlines()[-1]

    return run


@pytest.fixture
def sample_columns() -> list[dict]:
    """The column mapping of the sample events, a fresh copy a test may change."""
    return [dict(c) for c in COLUMNS]


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    from kafka2pg.devtools import local_stack

    # Secured listeners too (SASL_SSL, mTLS) beside the plain one most tests use.
    started = local_stack.start_stack(tmp_path_factory.mktemp("stack"), secured=True)
    yield started
    local_stack.discard_stack(started)


@pytest.fixture(scope="session")
def base_settings(stack, tmp_path_factory):
    from kafka2pg.config import Settings

    return Settings(
        kafka=stack.kafka.bootstrap_servers,
        database_url=stack.postgres.url,
        pipelines_file=tmp_path_factory.mktemp("cfg") / "none.yaml",
        kafka_timeout_s=10,
        state_dir=tmp_path_factory.mktemp("state"),
    )


@pytest.fixture(scope="session")
def spark(base_settings):
    from kafka2pg.jars import spark_jars
    from kafka2pg.staging import package_zip, spark_session

    # py4j logs at interpreter exit, after pytest closed its capture streams.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    session = spark_session("local[2]", app_name="kafka2pg-tests", jars=spark_jars())
    session.sparkContext.setLogLevel("ERROR")
    session.sparkContext.addPyFile(str(package_zip(base_settings.state_dir)))
    yield session
    session.stop()


@dataclasses.dataclass
class PipelineEnv:
    """A test's own topic, pipeline and settings (pipelines file written to tmp)."""

    settings: object
    pipeline: object
    topic: str
    partitions: int


@pytest.fixture
def make_pipeline(base_settings, tmp_path):
    from kafka2pg.config import get_pipeline
    from kafka2pg.kafka_offsets import ensure_topic
    from kafka2pg.migrations import migrate

    def make(partitions: int = 3, create_topic: bool = True, **overrides) -> PipelineEnv:
        suffix = uuid.uuid4().hex[:8]
        name = overrides.pop("name", f"p_{suffix}")
        topic = overrides.pop("topic", f"t-{suffix}")
        spec = {
            "name": name,
            "topic": topic,
            "target_table": f"public.target_{suffix}",
            "business_key": ["event_id"],
            "columns": COLUMNS,
            **overrides,
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"pipelines": [spec]}))
        settings = dataclasses.replace(base_settings, pipelines_file=path)
        pipeline = get_pipeline(name, path)
        if create_topic:
            ensure_topic(settings.bootstrap_servers, topic, partitions)
        migrate(settings.database_url, [pipeline])
        return PipelineEnv(settings, pipeline, topic, partitions)

    return make


@pytest.fixture
def write_by_hand(db):
    """`write_by_hand(env, event_id, topic, partition, offset)`: a row in `env`'s target as a
    manual write (or another loader) puts it there, with batch_id 0."""
    from psycopg import sql

    def write(env: PipelineEnv, event_id: str, topic: str, partition: int, offset: int) -> None:
        db.execute(
            sql.SQL(
                "INSERT INTO {} (event_id, customer_id, kafka_topic, kafka_partition, kafka_offset, batch_id)"
                " VALUES (%s, 1, %s, %s, %s, 0)"
            ).format(sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)),
            (event_id, topic, partition, offset),
        )

    return write


@pytest.fixture
def reconfigured(make_pipeline):
    """A pipeline with the same name, topic and target table as `env`'s, as an operator edits its
    entry in the pipelines file, with `changes` (every other setting: `make_pipeline`'s default,
    not `env`'s): `reconfigured(env, on_retention_loss="skip")`."""

    def again(env: PipelineEnv, **changes) -> PipelineEnv:
        target = f"{env.pipeline.target_schema}.{env.pipeline.target_table}"
        return make_pipeline(
            name=env.pipeline.name, topic=env.topic, target_table=target, create_topic=False, **changes
        )

    return again


def drive(spark, env: PipelineEnv, opened):
    """Stage, validate and promote (or finish, for a replay) an opened batch; None if none was opened."""
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    if opened.batch is None:
        return None
    batch_id = opened.batch.batch_id
    stage_batch(spark, env.settings, env.pipeline, batch_id)
    validate_batch(env.settings, env.pipeline, batch_id)
    return promote_batch(env.settings, env.pipeline, batch_id)


@pytest.fixture
def run_batch(spark):
    """Plan, stage, validate and promote one batch with the same functions the DAG runs."""
    from kafka2pg.opening import open_batch

    return lambda env, **plan_args: drive(spark, env, open_batch(env.settings, env.pipeline, **plan_args))


@pytest.fixture
def replay(spark):
    """Plan, stage, validate and finish one replay with the same functions the replay DAG runs."""
    from kafka2pg.replay import open_replay

    return lambda env, request: drive(spark, env, open_replay(env.settings, env.pipeline, request))


@pytest.fixture
def end_at_deadline():
    """`with end_at_deadline(url, pid, seconds) as rescued:` should the block still run after
    `seconds`, PostgreSQL's backend `pid` (what the block waits for) is terminated and `rescued`
    gets True: a test that waits on a lock asserts `not rescued` instead of hanging."""
    import contextlib
    import threading

    import psycopg

    @contextlib.contextmanager
    def guard(url: str, pid: int, seconds: float = 120):
        rescued: list[bool] = []

        def rescue() -> None:
            rescued.append(True)
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

        timer = threading.Timer(seconds, rescue)
        timer.start()
        try:
            yield rescued
        finally:
            timer.cancel()

    return guard


@pytest.fixture
def db(base_settings):
    import psycopg

    with psycopg.connect(base_settings.database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def heads(db):
    """The pipeline's ledger heads, next offset per partition: `heads(env)`, or `heads(env, conn)`
    over another connection (a thread's own)."""

    def read(env: PipelineEnv, conn=None) -> dict[int, int]:
        rows = (conn or db).execute(
            "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
        )
        return dict(rows.fetchall())

    return read


@pytest.fixture
def behind_range_lock(db):
    """`with behind_range_lock(env, action) as outcome:` runs `action` in a thread while a
    transaction holds the pipeline's range lock of partition 0 (as a replay finishing there does),
    and enters once the action waits for it; leaving releases the lock and joins the thread:
    `outcome[0]` is what the action returned or raised."""
    import threading
    import time
    from contextlib import contextmanager

    import psycopg

    @contextmanager
    def waiting(env: PipelineEnv, action):
        outcome: list = []

        def run() -> None:
            try:
                outcome.append(action())
            except BaseException as exc:  # noqa: BLE001 - the test reads what the thread met
                outcome.append(exc)

        worker = threading.Thread(target=run, daemon=True)
        with psycopg.connect(env.settings.database_url) as holder:
            holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s), 0)", (f"kafka2pg.range:{env.pipeline.name}",))
            worker.start()
            deadline = time.monotonic() + 120
            while not db.execute(  # the range lock's key, as kafka2pg.ledger.lock_partitions takes it
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 0"
                " AND objsubid = 2 AND classid = hashtext(%s)::oid"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                (f"kafka2pg.range:{env.pipeline.name}",),
            ).fetchone()[0]:
                assert worker.is_alive() and time.monotonic() < deadline, outcome
                time.sleep(0.1)
            yield outcome
            holder.rollback()
        worker.join(120)
        assert not worker.is_alive()

    return waiting


@pytest.fixture
def ledgered(db):
    """What kafka2pg.batches and the ledger say about batches, in an Asset event's terms:
    `ledgered(batch_id, ...)`, the first id being the run's planned batch."""

    def read(*batch_ids: int) -> dict:
        rows = db.execute(
            "SELECT sum(rows_promoted), sum(rows_quarantined), min(kind) FROM kafka2pg.batches"
            " WHERE batch_id = ANY(%s)",
            (list(batch_ids),),
        ).fetchone()
        ranges = db.execute(
            "SELECT kafka_partition, min(start_offset), max(end_offset) FROM kafka2pg.batch_partitions"
            " WHERE batch_id = ANY(%s) GROUP BY kafka_partition ORDER BY kafka_partition",
            (list(batch_ids),),
        ).fetchall()
        return {
            "batch_id": batch_ids[0],
            "batch_ids": list(batch_ids),
            "kind": rows[2],
            "rows": rows[0],
            "quarantined": rows[1],
            "ranges": [{"partition": p, "start": s, "end": e} for p, s, e in ranges],
        }

    return read


def pytest_configure(config):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Spark's scratch folders (spark-*, blockmgr-*: the shipped files, about 12 MB a session) go
    # under one folder of this test run, removed at its end: a Spark JVM a test kills cannot
    # delete its own, and /tmp would keep them.
    if "SPARK_LOCAL_DIRS" not in os.environ:
        config.kafka2pg_spark_scratch = tempfile.mkdtemp(prefix="kafka2pg-tests-spark-")
        os.environ["SPARK_LOCAL_DIRS"] = config.kafka2pg_spark_scratch
    # Every test names its own services; connections of a sourced stack.env must not win over them.
    for name in [n for n in os.environ if n.startswith("AIRFLOW_CONN_KAFKA2PG")]:
        del os.environ[name]
    for marker, text in (
        ("unit", "pure logic, no services"),
        ("integration", "real Kafka broker, PostgreSQL and Spark"),
        ("e2e", "airflow dags test against the embedded stack (slow)"),
        ("fault", "fault injection: kills, restarts and races on the real stack (slow)"),
    ):
        config.addinivalue_line("markers", f"{marker}: {text}")


def pytest_unconfigure(config):
    scratch = getattr(config, "kafka2pg_spark_scratch", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        os.environ.pop("SPARK_LOCAL_DIRS", None)
