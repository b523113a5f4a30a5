"""The README's main command: local stack -> sample events -> `airflow dags test` twice -> report.

Proves the walking skeleton on one machine: N events produced, N rows landed, lag 0, and a
second run that is a no-op without Spark.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from pathlib import Path

from kafka2pg.config import get_pipeline, pipelines_file_from_env
from kafka2pg.devtools import local_stack
from kafka2pg.devtools.airflow_cli import dags_test, ensure_airflow_db
from kafka2pg.exceptions import StackError
from kafka2pg.jars import resolve_jars
from kafka2pg.locations import COMMAND, preview_first, state_dir
from kafka2pg.task_log import fit, printable

PIPELINE = "orders"


def _task_states(output: str) -> str:
    ran = re.findall(r"\[DAG TEST\] running task <TaskInstance: [\w.-]+?\.(\w+) ", output)
    skipped = " (downstream skipped)" if "Skipping downstream tasks" in output else ""
    return "tasks run: " + ", ".join(dict.fromkeys(ran)) + skipped


def _plan_message(output: str) -> str:
    found = re.search(r"pipeline=\S+ (nothing new[^\[]*|planned batch[^\[]*|resuming[^\[]*)", output)
    return found.group(1).strip() if found else "(plan message not found in the log)"


# Rows of the target the demo shows: what landed, as a user's query would see it.
SAMPLE_ROWS = 3


def _sample(table: str, landed: int, columns: list[str], rows: list[tuple[str | None, ...]]) -> str:
    """The target's first rows by provenance, their values as PostgreSQL's text, a row per
    paragraph of `column: value` (the table is too wide for columns side by side); long values
    are cut, control characters escaped, a NULL shown as NULL."""
    if not rows:
        return f"no rows in {table}"
    lines = [f"the first {len(rows)} of the {landed} rows in {table} (by partition and offset):"]
    for row in rows:
        values = (
            f"{name}: {'NULL' if value is None else printable(_cut(value))}"
            for name, value in zip(columns, row, strict=True)
        )
        lines.append(fit("  " + ", ".join(values), indent="    "))
    return "\n".join(lines)


def _cut(text: str, most: int = 60) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def run(*, events: int, keep: bool) -> int:
    cache = state_dir()
    if local_stack.reset_targets(cache):  # said before any step starts
        # The demo counts what it lands from an empty stack, and never deletes data it did not make.
        raise StackError(
            f"a local stack already exists in {local_stack.stack_dir(cache)}, with its data: the demo starts "
            f"its own, empty one (a demo running in another terminal, or one kept with --keep?). Once nothing uses "
            f"it, {preview_first('stack reset')} stops and deletes it; then run the demo again."
        )
    print("[1/6] Kafka and Spark jars (resolved from Maven Central once, then cached)")
    resolve_jars(cache)
    print("[2/6] starting a real Kafka broker (KRaft) and a throwaway PostgreSQL on 127.0.0.1")
    stack = local_stack.start_stack(local_stack.stack_dir(cache), cache)
    env_file = local_stack.save_stack(stack, cache)
    try:
        return _run_with_stack(stack, events, cache)
    finally:
        if keep:
            print(f"stack left running: `source {env_file}` to use it, `{COMMAND} stack stop` to stop it")
        else:
            kept = _keep_logs(stack, cache / "demo")
            local_stack.reset_stack(cache)
            print(
                f"the demo's stack stopped and deleted{'; its logs kept: ' if kept else ''}{', '.join(map(str, kept))}"
            )


def _keep_logs(stack: local_stack.Stack, logs: Path) -> list[Path]:
    """Copy the broker's and PostgreSQL's logs beside the Airflow runs' before the stack (and its
    logs with it) is deleted: what a failed demo is read by."""
    kept = []
    for source, name in ((stack.kafka.log_file, "kafka.log"), (stack.postgres.log_file, "postgres.log")):
        with contextlib.suppress(OSError):  # none written, or no room: the stack is deleted all the same
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, logs / name)
            kept.append(logs / name)
    return kept


def _run_with_stack(stack: local_stack.Stack, events: int, cache: Path) -> int:
    from kafka2pg.connections import settings_for
    from kafka2pg.devtools.producer import produce_sample
    from kafka2pg.kafka_offsets import ensure_topic
    from kafka2pg.migrations import migrate
    from kafka2pg.report import batch_report, ledger_report

    # The DAG runs (and this process) find the stack through the Airflow Connections
    # kafka2pg_postgres and kafka2pg_kafka, defined here as AIRFLOW_CONN_* variables; not through
    # the KAFKA2PG_* fallback variables.
    connections = {k: v for k, v in stack.env().items() if k.startswith("AIRFLOW_CONN_")}
    os.environ.update(connections)
    for fallback in ("KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG", "KAFKA2PG_DATABASE_URL"):
        os.environ.pop(fallback, None)
    env = dict(os.environ)
    pipeline = get_pipeline(PIPELINE, pipelines_file_from_env())
    settings = settings_for(pipeline, env)
    print(f"      kafka {stack.kafka.bootstrap_servers}, postgres 127.0.0.1:{stack.postgres.port}")
    migrations = logging.getLogger("kafka2pg.migrations")
    level = migrations.level
    migrations.setLevel(logging.WARNING)  # one line for them all, below
    try:
        applied = migrate(settings.database_url, [pipeline])
    finally:
        migrations.setLevel(level)
    print(f"      applied {len(applied)} migrations and created the pipeline's tables (`{COMMAND} migrate`)")
    ensure_topic(settings.kafka, pipeline.topic, 3)
    print(f"[3/6] producing {events} sample events to topic {pipeline.topic!r} (3 partitions)")
    produce_sample(settings.kafka, pipeline.topic, events)
    print("[4/6] preparing Airflow's metadata DB (once)")
    ensure_airflow_db(env)
    logs = cache / "demo"
    print(f"[5/6] airflow dags test {pipeline.dag_id}  (log {logs / 'run-1.log'})")
    code, output, seconds = dags_test(pipeline.dag_id, env, logs / "run-1.log")
    print(f"      exit {code} in {seconds:.0f}s; {_task_states(output)}")
    print(f"      plan: {_plan_message(output)}")
    if code != 0:
        print(output[-4000:])
        return code
    print(f"[6/6] airflow dags test {pipeline.dag_id} again: must be a no-op  (log {logs / 'run-2.log'})")
    code2, output2, seconds2 = dags_test(pipeline.dag_id, env, logs / "run-2.log")
    noop = "Spark not launched" in output2 and "spark-submit" not in output2
    print(f"      exit {code2} in {seconds2:.0f}s; {_task_states(output2)}")
    print(f"      plan: {_plan_message(output2)}")
    print("      no-op: nothing new, no batch planned, Spark not launched" if noop else "      NOT a no-op!")
    from psycopg import sql

    from kafka2pg.database import connect

    with connect(settings.database_url) as conn:
        last = conn.execute(
            "SELECT max(batch_id) FROM kafka2pg.batches WHERE pipeline = %s", (pipeline.name,)
        ).fetchone()[0]
        target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
        landed = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0]
        columns = [c.name for c in conn.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(target)).description]
        rows = conn.execute(  # every value as PostgreSQL's text shows it
            sql.SQL("SELECT {} FROM {} ORDER BY kafka_topic, kafka_partition, kafka_offset LIMIT {}").format(
                sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c in columns),
                target,
                sql.Literal(SAMPLE_ROWS),
            )
        ).fetchall()
    print()
    print(batch_report(settings, pipeline, last) if last else ledger_report(settings, pipeline))
    print()
    print(_sample(f"{pipeline.target_schema}.{pipeline.target_table}", landed, columns, rows))
    print()
    verdict = landed == events and code2 == 0 and noop
    print(f"{'OK' if verdict else 'FAILED'}: produced {events}, landed {landed}")
    return 0 if verdict else 1
