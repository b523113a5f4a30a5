"""Through a connection pooler: PgBouncer (Debian's package) in session pooling, the mode
docs/operations.md supports, between every kafka2pg connection and the stack's PostgreSQL."""

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from kafka2pg.audit import audit_pipeline
from kafka2pg.database import session
from kafka2pg.devtools.processes import free_port, stop_pid
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import ConfigError
from kafka2pg.opening import open_batch
from kafka2pg.runner import run_batches

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


@pytest.fixture
def pgbouncer(stack):
    """`pgbouncer(pool_mode, pool_size)`: a PgBouncer in front of the stack's PostgreSQL with
    `pool_size` server connections (each serves many of kafka2pg's short-lived ones in turn),
    as (its URL for the `kafka2pg` database, its port)."""
    if not Path(PGBOUNCER).exists():
        pytest.fail("PgBouncer is missing: ./kafka2pg test installs Debian's pgbouncer package")
    started = []

    def start(pool_mode: str, pool_size: int) -> tuple[str, int]:
        # Not under pytest's tmp dir, which only root may enter: PgBouncer, run as the postgres
        # user when we are root (it refuses root), writes its log here.
        home = Path(tempfile.mkdtemp(prefix="kafka2pg-pgbouncer-"))
        started.append([None, home])
        home.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(home, "postgres", "postgres")
        port = free_port()
        (home / "users.txt").write_text('"postgres" ""\n')
        ini = home / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"kafka2pg = host=127.0.0.1 port={stack.postgres.port} dbname=kafka2pg\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {home / 'users.txt'}\nadmin_users = postgres\n"
            f"logfile = {home / 'pgbouncer.log'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 200\n"
            "server_reset_query = DISCARD ALL\n"
        )
        as_postgres = ["-u", "postgres"] if os.geteuid() == 0 else []
        process = subprocess.Popen([PGBOUNCER, *as_postgres, str(ini)], stdout=subprocess.DEVNULL)
        started[-1][0] = process
        url = f"postgresql://postgres@127.0.0.1:{port}/kafka2pg"
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(url, connect_timeout=5).close()
                return url, port
            except psycopg.OperationalError:
                log = home / "pgbouncer.log"
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"PgBouncer did not start: {log.read_text() if log.exists() else 'no log'}")
                time.sleep(0.2)

    yield start
    for process, home in started:
        try:
            if process is not None:
                stop_pid(process.pid)
                process.wait(timeout=30)
        finally:
            shutil.rmtree(home, ignore_errors=True)


def _transactions_pooled(port: int, database: str = "kafka2pg") -> int:
    """PgBouncer's own count of the transactions it passed on to `database` (its admin console
    speaks only the simple query protocol: psql)."""
    command = f"psql -X -h 127.0.0.1 -p {port} -U postgres -d pgbouncer -AF, -c"
    out = subprocess.run(
        [*command.split(), "SHOW STATS"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    names = out[0].split(",")
    row = next(dict(zip(names, line.split(","), strict=True)) for line in out[1:] if line.startswith(f"{database},"))
    return int(row["total_xact_count"])


def test_a_backlog_lands_exactly_once_through_pgbouncer_in_session_pooling(make_pipeline, spark, db, pgbouncer):
    """Every connection kafka2pg opens (the plan, the Spark tasks' chunk writers, the gate, the
    promotion, the audit) goes through PgBouncer, whose few server connections each serve many
    clients in turn: the session settings each client makes are made again on each one, and the
    batches land exactly once in several runs of several batches."""
    url, port = pgbouncer("session", 8)
    env = make_pipeline(max_records_per_batch=400)
    env = dataclasses.replace(env, settings=dataclasses.replace(env.settings, database_url=url))
    events = list(sample_events(2000, seed=41))
    produce(env.settings.bootstrap_servers, env.topic, [*events, events[7], events[1500]])  # two producer retries
    promoted = []
    for run in ("run-1", "run-2"):
        opened = open_batch(env.settings, env.pipeline, run_id=run).batch
        result = run_batches(spark, env.settings, env.pipeline, opened.batch_id, opened.epoch, batches=3, run_id=run)
        promoted += result.promoted
    assert len(promoted) == 6, promoted
    table = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    rows, keys, offsets = db.execute(
        sql.SQL(
            "SELECT count(*), count(DISTINCT event_id), count(DISTINCT (kafka_partition, kafka_offset)) FROM {}"
        ).format(table)
    ).fetchone()
    assert (rows, keys, offsets) == (2000, 2000, 2000)
    quarantined = db.execute(
        "SELECT count(*) FROM kafka2pg.quarantine WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()[0]
    assert quarantined == 2, "the two producer retries"
    audits = audit_pipeline(env.settings, env.pipeline)
    assert all(a.clean for a in audits) and sum(a.matched for a in audits) == 2002, audits
    assert _transactions_pooled(port) > 100


def test_a_pooler_pooling_transactions_is_named_with_what_to_change(pgbouncer):
    """Under transaction pooling, a statement psycopg prepared on one server connection is missing
    on the next, or its name was taken there by another client: kafka2pg says which setting of the
    pooler to change (a configuration error, not retried), not psycopg's words alone. Both
    clients here share the pooler's one server connection, so the second one's sixth run of a
    statement (psycopg prepares it then) meets the name the first one prepared."""
    url, _ = pgbouncer("transaction", 1)
    statement = "SELECT %s::int + 1"
    with session(url) as first:
        for _ in range(10):
            first.execute(statement, (1,))
    with pytest.raises(ConfigError) as refused, session(url) as second:
        for _ in range(10):
            second.execute(statement, (2,))
    message = str(refused.value)
    assert "most likely a connection pooler that pools transactions or statements" in message
    assert '(prepared statement "_pg3_0" already exists)' in message
    assert "pool_mode = session" in message and "server_reset_query = DISCARD ALL" in message
    assert "nothing was changed" in message and refused.value.terminal
