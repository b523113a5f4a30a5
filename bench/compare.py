"""Ours vs what a user would pick instead, on one backlog, side by side in one process tree.

Contenders load the same Kafka backlog into identical empty target tables (same columns,
provenance primary key, business-key unique index):
  ours    the pipeline end to end (plan -> stage -> validate -> promote per batch), the stage
          job's own loop (kafka2pg.runner) in one Spark session, as a DAG run with batches_per_run
  ours-spark-source  the same with `kafka_reader: spark` (Spark's Kafka source instead of
          librdkafka in the tasks); only when named in --contenders
  peer    Spark Structured Streaming, Trigger.AvailableNow, foreachBatch -> JDBC
  worker  a hand-written confluent-kafka consumer: COPY each batch + its offsets in one transaction
  floor   PostgreSQL COPY of the same rows from a local file (the cost of landing the data at all)
  connect a Kafka Connect worker (standalone) with the Debezium JDBC sink, upsert on the business
          key, one task per partition, reading its own copy of the backlog as JSON with embedded
          schemas (written untimed before any contender runs)
Each contender runs in its own child process; the parent samples the child's whole process
tree (Spark JVM included) for peak RSS. Also: the fixed cost of an empty run and of a
1-record batch, ours with Spark local[1] vs local[2], and (unless --no-airflow) the fixed costs
and the whole backlog through `airflow dags test` of the real DAG (one run, batches_per_run
unlimited). With --rounds N every contender loads the backlog N times (each into a new table,
the order reversed every other round): the table shows each one's median run, the ratios are
the median of the per-round ratios (a shared machine drifts by tens of percent between runs).
    ./kafka2pg python bench/compare.py [--events 1000000] [--partitions 6] [--size 200] [--no-airflow]
                                       [--airflow-per-batch] [--rounds 1]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from harness import (  # noqa: E402
    JDBC_PROPERTIES,
    bench_pipeline,
    bench_spark,
    bench_stack,
    padded_events,
    spark_sql_decode,
)
from psycopg import sql  # noqa: E402

from kafka2pg.config import KAFKA_READERS, Settings  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.devtools.processes import free_port  # noqa: E402
from kafka2pg.devtools.producer import produce, sample_events  # noqa: E402
from kafka2pg.kafka_offsets import ensure_topic, partition_offsets  # noqa: E402
from kafka2pg.migrations import migrate  # noqa: E402

CONTENDERS = ("ours", "peer", "worker", "floor", "connect")
# Kafka Connect's JsonConverter wants a schema in every record; the sample pipeline's column types
# as Connect types (the sink binds text, timestamptz and jsonb values as strings PostgreSQL casts).
CONNECT_TYPES = {"text": "string", "bigint": "int64", "numeric": "double", "timestamptz": "string", "jsonb": "string"}
# As Kafka's bin/connect-standalone.sh starts the worker (KAFKA_HEAP_OPTS, KAFKA_JVM_PERFORMANCE_OPTS).
CONNECT_JVM = (
    "-Xms256M",
    "-Xmx2G",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-Djava.awt.headless=true",
)
CONNECT_DEADLINE_S = 1800


def connect_topic(topic: str) -> str:
    return f"{topic}-connect"


def connect_events(count: int, size: int) -> Iterator[dict]:
    """The same events as Kafka Connect's JsonConverter reads them (`schemas.enable`): a schema and
    a payload whose fields are named as the target's columns (a sink maps fields to columns by name)."""
    columns = bench_pipeline("connect").columns
    schema = {
        "type": "struct",
        "name": "order",
        "optional": False,
        "fields": [
            {"field": c.name, "type": CONNECT_TYPES[c.type.split("(")[0]], "optional": not c.required} for c in columns
        ],
    }
    for event in padded_events(count, size):
        payload = {c.name: event[c.field] for c in columns}
        payload.update({c.name: json.dumps(payload[c.name]) for c in columns if c.type == "jsonb"})
        yield {"schema": schema, "payload": payload}


# ------------------------------------------------------------------ contenders (child process)


def run_ours(settings: Settings, topic: str, master: str, reader: str = KAFKA_READERS[0]) -> dict:
    """The stage job's own loop (kafka2pg.runner, batches_per_run unlimited) in one Spark session."""
    from kafka2pg.expectations import warm_up_in_background
    from kafka2pg.opening import open_batch
    from kafka2pg.runner import run_batches
    from kafka2pg.staging import stop_session

    name = f"ours_{master[6]}" if reader == KAFKA_READERS[0] else f"ours_{reader}_{master[6]}"
    pipeline = dataclasses.replace(bench_pipeline(_fresh(name), topic), kafka_reader=reader)
    migrate(settings.database_url, [pipeline])
    started = time.monotonic()
    warm_up_in_background()  # as kafka2pg.runner.run_job does for a job of several batches
    # The DAG gives spark-submit the Kafka source's jars only for the reader that uses them.
    spark = bench_spark(
        master, "bench-ours", settings.state_dir, batches=10**9, kafka_reader=reader, kafka_source=reader == "spark"
    )
    spark_start = time.monotonic() - started
    started = time.monotonic()
    first = open_batch(settings, pipeline, run_id="bench").batch
    first_plan = time.monotonic() - started
    result = run_batches(spark, settings, pipeline, first.batch_id, first.epoch, batches=10**9, run_id="bench")
    stop_session(spark)  # as kafka2pg.runner.run_job stops it
    phases = {"spark start": spark_start, **result.phases}
    phases["plan"] += first_plan
    return {"rows": _count(settings, pipeline), "batches": len(result.promoted), "phases": phases}


def run_peer(settings: Settings, topic: str, work: Path) -> dict:
    from pyspark.sql import functions as F

    pipeline = bench_pipeline(_fresh("peer"), topic)
    migrate(settings.database_url, [pipeline])
    # The JVM as a Structured Streaming user starts it (JDK 17 defaults: tiered JIT, G1), not
    # kafka2pg's C1-only stage JVM.
    spark = bench_spark("local[2]", "bench-peer", work, {"spark.driver.extraJavaOptions": "-XX:+UseG1GC"})
    url = settings.database_url.replace("postgresql://postgres@", "jdbc:postgresql://")
    columns = [c.name for c in pipeline.columns]

    def write(frame, epoch_id):
        accepted = frame.where(F.col("quarantine_reason").isNull()).select(
            *columns,
            "kafka_topic",
            "kafka_partition",
            "kafka_offset",
            "kafka_timestamp",
            F.lit(epoch_id).alias("batch_id"),
        )
        accepted.write.jdbc(
            url,
            f"public.{pipeline.target_table}",
            mode="append",
            properties=JDBC_PROPERTIES,
        )

    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", settings.bootstrap_servers)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .option("maxOffsetsPerTrigger", str(pipeline.max_records_per_batch))
        .load()
    )
    query = (
        spark_sql_decode(stream, pipeline)
        .writeStream.foreachBatch(write)
        .option("checkpointLocation", str(work / f"{pipeline.name}-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return {"rows": _count(settings, pipeline)}


def run_worker(settings: Settings, topic: str, batch_size: int = 50_000) -> dict:
    """The pattern people write by hand: consume, COPY a batch and its offsets in one transaction."""
    from confluent_kafka import Consumer, TopicPartition

    from kafka2pg.kafka_offsets import client_config

    pipeline = bench_pipeline(_fresh("worker"), topic)
    migrate(settings.database_url, [pipeline])
    columns = [c.name for c in pipeline.columns]
    ends = {o.partition: o.last_stable for o in partition_offsets(settings.bootstrap_servers, topic)}
    consumer = Consumer(
        {
            **client_config(settings.bootstrap_servers, 10),
            "group.id": "bench-worker",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.message.max.bytes": 4_194_304,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    done: dict[int, int] = {p: 0 for p in ends}
    target = sql.Identifier("public", pipeline.target_table)
    copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(
        target,
        sql.SQL(", ").join(
            map(sql.Identifier, [*columns, "kafka_topic", "kafka_partition", "kafka_offset", "batch_id"])
        ),
    )
    with connect(settings.database_url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_worker_offsets (p int PRIMARY KEY, next_offset bigint)")
        conn.commit()
        while any(done[p] < ends[p] for p in ends):
            messages = consumer.consume(num_messages=batch_size, timeout=1.0)
            with conn.transaction(), conn.cursor() as cur:
                with cur.copy(copy_sql) as copy:
                    for message in messages:
                        event = json.loads(message.value())
                        copy.write_row(_row(event, topic, message.partition(), message.offset()))
                        done[message.partition()] = message.offset() + 1
                cur.executemany(
                    "INSERT INTO bench_worker_offsets VALUES (%s, %s)"
                    " ON CONFLICT (p) DO UPDATE SET next_offset = EXCLUDED.next_offset",
                    list(done.items()),
                )
    consumer.close()
    return {"rows": _count(settings, pipeline)}


def write_floor_file(settings: Settings, topic: str, path: Path) -> None:
    """The floor's input: every record of the backlog, decoded, as CSV. Made once before any
    contender runs, so it also warms the broker's read path for all of them alike (the first
    reader of a fresh broker otherwise pays its JIT warm-up: about 2 core-seconds per 1M)."""
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        for partition in {o.partition: o for o in partition_offsets(settings.bootstrap_servers, topic)}.values():
            ranges = [(0, partition.last_stable)]
            consumer_rows = _rows(settings, topic, partition.partition, ranges)
            writer.writerows(consumer_rows)


def run_floor(settings: Settings, topic: str, work: Path) -> dict:
    """COPY the same decoded rows from a local file (`write_floor_file`) into the same table."""
    pipeline = bench_pipeline(_fresh("floor"), topic)
    migrate(settings.database_url, [pipeline])
    columns = [c.name for c in pipeline.columns]
    path = work / "floor.csv"
    started = time.monotonic()
    copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        sql.Identifier("public", pipeline.target_table),
        sql.SQL(", ").join(
            map(sql.Identifier, [*columns, "kafka_topic", "kafka_partition", "kafka_offset", "batch_id"])
        ),
    )
    with connect(settings.database_url) as conn, conn.cursor() as cur, open(path, "rb") as data:
        with cur.copy(copy_sql) as copy:
            while chunk := data.read(1 << 20):
                copy.write(chunk)
        conn.commit()
    return {"rows": _count(settings, pipeline), "timed_seconds": time.monotonic() - started}


def run_connect(settings: Settings, topic: str, work: Path) -> dict:
    """A Kafka Connect worker in standalone mode running the Debezium JDBC sink, one task per
    partition, upsert on the business key; done when its consumer group has committed the topic's
    end offsets, then stopped. `timed_seconds`: from this process's start to done."""
    from kafka2pg.jars import connect_plugin_path, resolve_jars

    pipeline = bench_pipeline(_fresh("connect"), connect_topic(topic))
    migrate(settings.database_url, [pipeline])
    jars = resolve_jars(names=("connect",))["connect"]
    ends = {o.partition: o.high for o in partition_offsets(settings.bootstrap_servers, pipeline.topic)}
    name = f"bench-{pipeline.name}"
    port = free_port()
    worker_file, connector_file, log_config = (
        work / f"{name}{ext}" for ext in (".worker", ".connector", ".log4j2.properties")
    )
    _write_properties(
        worker_file,
        {
            "bootstrap.servers": settings.bootstrap_servers,
            "key.converter": "org.apache.kafka.connect.storage.StringConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter.schemas.enable": "true",
            "offset.storage.file.filename": str(work / f"{name}.offsets"),
            # sink offsets are committed this often (default 60 s): how soon the bench sees "done"
            "offset.flush.interval.ms": "1000",
            "plugin.path": str(connect_plugin_path(jars)),
            # what the worker advises at start when every plugin has ServiceLoader manifests (as
            # here): the default also scans every jar by reflection, about 30 s of a loaded machine
            "plugin.discovery": "service_load",
            "listeners": f"http://127.0.0.1:{port}",
            # the peer's JDBC batch (10,000 rows); Connect hands a task at most max.poll.records at once
            "consumer.max.poll.records": "10000",
        },
    )
    url = settings.database_url.replace("postgresql://postgres@", "jdbc:postgresql://")
    _write_properties(
        connector_file,
        {
            "name": name,
            "connector.class": "io.debezium.connector.jdbc.JdbcSinkConnector",
            "tasks.max": str(len(ends)),
            "topics": pipeline.topic,
            "connection.url": f"{url}?reWriteBatchedInserts=true&stringtype=unspecified",
            "connection.username": "postgres",
            "connection.password": "",
            "collection.name.format": pipeline.target_table,
            # upsert on the business key: a record redelivered after a crash updates its row
            # instead of stopping the task on the target's unique index
            "insert.mode": "upsert",
            "primary.key.mode": "record_value",
            "primary.key.fields": ",".join(pipeline.business_key),
            "schema.evolution": "none",  # the target exists, created as the other contenders' are
            "batch.size": "10000",
            # the provenance columns every contender fills (the target's primary key)
            "transforms": "provenance",
            "transforms.provenance.type": "org.apache.kafka.connect.transforms.InsertField$Value",
            "transforms.provenance.topic.field": "kafka_topic",
            "transforms.provenance.partition.field": "kafka_partition",
            "transforms.provenance.offset.field": "kafka_offset",
            "transforms.provenance.timestamp.field": "kafka_timestamp",
            "transforms.provenance.static.field": "batch_id",
            "transforms.provenance.static.value": "0",
        },
    )
    log_config.write_text(CONNECT_LOG4J2)
    command = [
        shutil.which("java") or "java",
        *CONNECT_JVM,
        f"-Dlog4j2.configurationFile={log_config}",
        "-cp",
        f"{jars}/*",
        "org.apache.kafka.connect.cli.ConnectStandalone",
        str(worker_file),
        str(connector_file),
    ]
    log = work / f"{name}.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_sink(settings, f"connect-{name}", pipeline.topic, ends, worker, port, name, log)
        done = time.time() - psutil.Process().create_time()
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return {"rows": _count(settings, pipeline), "timed_seconds": done}


CONNECT_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = STDOUT
logger.connect.name = org.apache.kafka.connect.runtime.Worker
logger.connect.level = INFO
"""


def _wait_for_sink(
    settings: Settings,
    group: str,
    topic: str,
    ends: dict[int, int],
    worker: subprocess.Popen,
    port: int,
    name: str,
    log: Path,
) -> None:
    """Until the sink's consumer group has committed every partition's end offset; fails on a
    worker that exited, a failed task, or the deadline."""
    from confluent_kafka import Consumer, TopicPartition

    from kafka2pg.kafka_offsets import client_config

    watcher = Consumer({**client_config(settings.bootstrap_servers, 10), "group.id": group})
    deadline = time.monotonic() + CONNECT_DEADLINE_S
    try:
        while True:
            if worker.poll() is not None:
                raise SystemExit(f"the Connect worker exited ({worker.returncode}); log {log}:\n{_tail(log)}")
            failed = _failed_tasks(port, name)
            if failed:
                raise SystemExit(f"Connect task failed: {failed[:3000]}\nlog {log}")
            # an empty partition has no commit to wait for (its committed offset stays unset)
            pending = [TopicPartition(topic, p) for p, end in ends.items() if end > 0]
            committed = watcher.committed(pending, timeout=10) if pending else []
            if all(tp.offset >= ends[tp.partition] for tp in committed):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"Connect did not finish in {CONNECT_DEADLINE_S}s: committed {committed}, ends {ends}")
            time.sleep(0.5)
    finally:
        watcher.close()


def _failed_tasks(port: int, name: str) -> str:
    """The traces of the connector's failed tasks ("" while none failed, or the REST API is not up yet)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/connectors/{name}/status", timeout=5) as answer:
            status = json.load(answer)
    except (urllib.error.URLError, ConnectionError):
        return ""
    states = [status["connector"], *status.get("tasks", [])]
    return "\n".join(s.get("trace", "FAILED") for s in states if s["state"] == "FAILED")


def _write_properties(path: Path, values: dict[str, str]) -> None:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


def _rows(settings: Settings, topic: str, partition: int, ranges):
    from confluent_kafka import Consumer, TopicPartition

    from kafka2pg.kafka_offsets import client_config

    consumer = Consumer(
        {**client_config(settings.bootstrap_servers, 10), "group.id": "bench-floor", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, partition, 0)])
    end = ranges[0][1]
    offset = 0
    while offset < end:
        for message in consumer.consume(num_messages=10_000, timeout=1.0):
            event = json.loads(message.value())
            offset = message.offset() + 1
            yield _row(event, topic, partition, message.offset())
    consumer.close()


def _row(event: dict, topic: str, partition: int, offset: int) -> tuple:
    """A target row (the sample columns, provenance, batch 0) from a decoded event."""
    fields = (event["event_id"], event["customer_id"], event["amount"], event["currency"], event["ts"])
    return (*fields, json.dumps(event["payload"]), topic, partition, offset, 0)


def _fresh(name: str) -> str:
    """A contender's pipeline and table name, new in each round (`--rounds`): every run loads the
    whole backlog into its own empty table."""
    return name + os.environ.get("BENCH_ROUND_SUFFIX", "")


def _count(settings: Settings, pipeline) -> int:
    with connect(settings.database_url) as conn:
        return conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("public", pipeline.target_table))
        ).fetchone()[0]


def run_fixed_costs(settings: Settings, topic: str) -> dict:
    """What an empty run costs outside Airflow (plan only: no Spark), and a 1-record batch."""
    from kafka2pg.opening import open_batch
    from kafka2pg.quality import validate_batch
    from kafka2pg.staging import stage_batch
    from kafka2pg.steps import promote_batch

    name = _fresh("fixed")  # the warm-up's pipeline is its own
    pipeline = bench_pipeline(name, f"{topic}-{name}")
    ensure_topic(settings.bootstrap_servers, pipeline.topic, 1)
    migrate(settings.database_url, [pipeline])
    started = time.monotonic()
    empty = open_batch(settings, pipeline)
    empty_s = time.monotonic() - started
    assert empty.batch is None
    produce(settings.bootstrap_servers, pipeline.topic, list(sample_events(1)))
    started = time.monotonic()
    spark = bench_spark("local[2]", "bench-fixed", settings.state_dir, kafka_source=pipeline.kafka_reader == "spark")
    batch = open_batch(settings, pipeline).batch
    stage_batch(spark, settings, pipeline, batch.batch_id, batch.epoch)
    validate_batch(settings, pipeline, batch.batch_id, batch.epoch)
    promote_batch(settings, pipeline, batch.batch_id, batch.epoch)
    one_s = time.monotonic() - started
    spark.stop()
    return {"empty_run_s": empty_s, "one_record_batch_s": one_s}


def run_airflow(settings: Settings, topic: str, work: Path) -> dict:
    """Through `airflow dags test` of the real DAG file: the two fixed costs, which add Airflow's
    own task overhead (process start-up, DAG parsing, XCom, one process per task) and spark-submit's
    cold JVM to the in-process figures, and the whole backlog loaded by ONE DAG run with
    batches_per_run unlimited (the job's loop; what a user runs to catch up). Metadata DB untimed."""
    import yaml

    from kafka2pg.config import default_pipelines_file, load_pipelines
    from kafka2pg.devtools.airflow_cli import dags_test, ensure_airflow_db
    from kafka2pg.jars import spark_jars
    from kafka2pg.locations import default_state_dir

    spec = next(p for p in yaml.safe_load(default_pipelines_file().read_text())["pipelines"])
    fixed = {**spec, "name": "airflow_fixed", "topic": f"{topic}-airflow", "target_table": "public.airflow_fixed"}
    backlog = {**spec, "name": "airflow_backlog", "topic": topic, "target_table": "public.airflow_backlog"}
    per_batch = {**spec, "name": "airflow_per_batch", "topic": topic, "target_table": "public.airflow_per_batch"}
    pipelines = work / "airflow-pipelines.yaml"
    pipelines.write_text(yaml.safe_dump({"pipelines": [fixed, backlog, per_batch]}))
    migrate(settings.database_url, list(load_pipelines(pipelines).values()))  # the DAGs' plan steps run no DDL
    # ./kafka2pg already exports the DAG and plugin folders; only what differs from it is set here.
    env = {
        **os.environ,
        # kept across runs: `airflow db migrate` once (untimed anyway), not in every smoke test
        "AIRFLOW_HOME": str(default_state_dir() / "bench-airflow"),
        "AIRFLOW_CONN_KAFKA2PG_SPARK": '{"conn_type": "spark", "host": "local[2]"}',  # as ours in process
        "KAFKA2PG_PIPELINES": str(pipelines),
        # the jars resolved once under .cache (the state dir here is this run's scratch folder)
        "KAFKA2PG_SPARK_JARS": ",".join(str(j) for j in spark_jars()),
    }
    ensure_airflow_db(env)
    ensure_topic(settings.bootstrap_servers, fixed["topic"], 1)

    def dag_run(dag_id: str, attempt: str, conf: dict | None = None) -> tuple[str, float]:
        log = work / f"airflow-{attempt}.log"
        code, output, seconds = dags_test(dag_id, env, log, conf)
        if code != 0:
            print(f"airflow {attempt} run failed (log {log}):\n{output[-3000:]}")
            raise SystemExit(1)
        return output, seconds

    for attempt in ("warm-up", "empty"):  # the first run also serialises the DAG: not counted
        output, empty_s = dag_run("kafka2pg_airflow_fixed", attempt)
        if "Spark not launched" not in output:
            raise SystemExit(f"airflow {attempt} run launched Spark:\n{output[-3000:]}")
    produce(settings.bootstrap_servers, fixed["topic"], list(sample_events(1)))
    _, one_s = dag_run("kafka2pg_airflow_fixed", "one")
    _, backlog_s = dag_run("kafka2pg_airflow_backlog", "backlog", {"batches_per_run": 10**6})
    per_batch_s = None
    if os.environ.get("BENCH_AIRFLOW_PER_BATCH"):  # the same backlog, one batch per DAG run (the default)
        started = time.monotonic()
        for per_batch_runs in range(1, 10**6):
            output, _ = dag_run("kafka2pg_airflow_per_batch", f"per-batch-{per_batch_runs}")
            if "Spark not launched" in output:
                break
        per_batch_s = time.monotonic() - started
    with connect(settings.database_url) as conn:
        landed = conn.execute("SELECT count(*) FROM public.airflow_fixed").fetchone()[0]
        backlog_rows = conn.execute("SELECT count(*) FROM public.airflow_backlog").fetchone()[0]
        batches = conn.execute(
            "SELECT count(*) FROM kafka2pg.batches WHERE pipeline = 'airflow_backlog' AND state = 'promoted'"
        ).fetchone()[0]
        result = {
            "empty_run_s": empty_s,
            "one_record_batch_s": one_s,
            "rows": landed,
            "backlog_s": backlog_s,
            "backlog_rows": backlog_rows,
            "backlog_batches": batches,
        }
        if per_batch_s is not None:
            per_batch_rows = conn.execute("SELECT count(*) FROM public.airflow_per_batch").fetchone()[0]
            result.update(per_batch_s=per_batch_s, per_batch_runs=per_batch_runs, per_batch_rows=per_batch_rows)
    return result


def child(name: str, master: str) -> int:
    settings = Settings.from_env()
    work = Path(os.environ["BENCH_WORK"])
    topic = os.environ["BENCH_TOPIC"]
    if name == "ours":
        result = run_ours(settings, topic, master)
    elif name == "ours-spark-source":
        result = run_ours(settings, topic, master, reader="spark")
    elif name == "peer":
        result = run_peer(settings, topic, work)
    elif name == "worker":
        result = run_worker(settings, topic)
    elif name == "floor":
        result = run_floor(settings, topic, work)
    elif name == "connect":
        result = run_connect(settings, topic, work)
    elif name == "airflow":
        result = run_airflow(settings, topic, work)
    else:
        result = run_fixed_costs(settings, topic)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------ parent: orchestrate and measure


def _busy_core_seconds() -> float:
    """CPU time the whole machine spent busy since boot (all cores, /proc/stat): user, nice,
    system, irq, softirq (guest time is already inside user and nice; idle, iowait, steal are not busy)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return sum(ticks[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """CPU time of a server: the process, its live children (PostgreSQL's backends, checkpointer,
    WAL writer) and the children it has reaped (exited backends)."""
    process = psutil.Process(pid)
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:  # exited meanwhile: counted as reaped in the next snapshot
            continue
        total += child_times.user + child_times.system
    return total


def _cpu_snapshot(servers: dict[str, int]) -> dict[str, float]:
    return {
        "at": time.monotonic(),
        "machine": _busy_core_seconds(),
        **{name: _cpu_seconds(pid) for name, pid in servers.items()},
    }


def measure(name: str, env: dict, master: str = "local[2]", servers: dict[str, int] | None = None) -> dict:
    """Run one contender in a child process; wall time and peak RSS of its whole process tree, and
    the CPU core-seconds the machine spent meanwhile, split into `servers` (name -> pid) and the rest."""
    command = [sys.executable, __file__, "--run-one", name, "--master", master]
    servers = servers or {}
    before = _cpu_snapshot(servers)
    started = time.monotonic()
    logs = Path(env["BENCH_WORK"]) / f"{name}-{master[6]}{env.get('BENCH_ROUND_SUFFIX', '')}"
    errors, out = logs.with_suffix(".stderr"), logs.with_suffix(".stdout")
    # To files, not pipes: a child that printed more than a pipe holds would block until it exits.
    with open(errors, "w") as err, open(out, "w") as stdout:
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=err, text=True)
    peak = 0
    root = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    wall = time.monotonic() - started
    time.sleep(0.5)  # the child's PostgreSQL backends exit (and are reaped) just after it
    after = _cpu_snapshot(servers)
    cpu = {key: after[key] - before[key] for key in after}  # "at": the seconds the snapshots span
    output = out.read_text(errors="replace")
    line = next((x for x in output.splitlines() if x.startswith("RESULT ")), None)
    if process.returncode != 0 or line is None:
        raise SystemExit(
            f"contender {name} failed (exit {process.returncode}):\n{output[-3000:]}\n"
            f"stderr ({errors}):\n{errors.read_text(errors='replace')[-3000:]}"
        )
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": wall, "peak_rss_mb": peak / 2**20, "cpu": cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--size", type=int, default=200, help="approximate JSON bytes per event")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="load the backlog this many times per contender, alternating their order; the table shows "
        "each contender's median run and the ratios their median over rounds (for a noisy machine)",
    )
    parser.add_argument("--no-scaling", action="store_true", help="skip ours with local[1]")
    parser.add_argument("--no-airflow", action="store_true", help="skip the figures through `airflow dags test`")
    parser.add_argument(
        "--airflow-per-batch",
        action="store_true",
        help="also load the backlog through the DAG with one batch per run (the default), run after run",
    )
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--master", default="local[2]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = sorted(set(args.contenders.split(",")) - {*CONTENDERS, "ours-spark-source"})
    if unknown and not args.run_one:
        parser.error(f"--contenders: unknown {', '.join(unknown)} (known: {', '.join(CONTENDERS)}, ours-spark-source)")
    if args.run_one:
        return child(args.run_one, args.master)
    with bench_stack("kafka2pg-compare-") as (settings, stack, work):
        topic = "bench"
        ensure_topic(settings.bootstrap_servers, topic, args.partitions)
        started = time.monotonic()
        produced = produce(settings.bootstrap_servers, topic, padded_events(args.events, args.size))
        megabytes = sum(o.high for o in partition_offsets(settings.bootstrap_servers, topic)) * args.size / 2**20
        print(
            f"backlog: {produced} events of ~{args.size} B ({megabytes:.0f} MB), {args.partitions} partitions, "
            f"produced in {time.monotonic() - started:.1f}s; machine: {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
        )
        started = time.monotonic()
        write_floor_file(settings, topic, work / "floor.csv")
        print(
            f"read the backlog once for the floor's file (warms the broker for all): {time.monotonic() - started:.1f}s"
        )
        names = args.contenders.split(",")
        if "connect" in names:
            started = time.monotonic()
            ensure_topic(settings.bootstrap_servers, connect_topic(topic), args.partitions)
            produce(
                settings.bootstrap_servers, connect_topic(topic), connect_events(args.events, args.size), key_field=None
            )
            print(f"wrote the backlog again for connect, with embedded schemas: {time.monotonic() - started:.1f}s")
        env = {
            **os.environ,
            **stack.env(),
            "BENCH_WORK": str(work),
            "BENCH_TOPIC": topic,
            "KAFKA2PG_STATE_DIR": str(work),
            "SPARK_LOCAL_IP": "127.0.0.1",
            **({"BENCH_AIRFLOW_PER_BATCH": "1"} if args.airflow_per_batch else {}),
        }
        servers = {"PostgreSQL": stack.postgres.pid, "Kafka broker": stack.kafka.pid}
        # Untimed: one Spark start and batch reads Spark's jars, the class-data archive and the
        # Python packages into the page cache, as on a machine that has run a job before; on a
        # cold cache the first contender to start Spark (ours in round 1) paid it (seconds).
        started = time.monotonic()
        measure("fixed", {**env, "BENCH_ROUND_SUFFIX": "_warm_up"})
        print(f"warm-up, untimed (a Spark start and a 1-record batch): {time.monotonic() - started:.1f}s", flush=True)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_no in range(args.rounds):
            # Odd rounds run the contenders in reverse order: neither always goes first.
            suffix = f"_r{round_no + 1}" if round_no else ""
            for name in names if round_no % 2 == 0 else names[::-1]:
                runs[name].append(measure(name, {**env, "BENCH_ROUND_SUFFIX": suffix}, servers=servers))
                label = f" (round {round_no + 1})" if args.rounds > 1 else ""
                phases = runs[name][-1].get("phases")
                detail = f": {', '.join(f'{k} {v:.1f}s' for k, v in phases.items())}" if phases else ""
                print(f"  {name}: {runs[name][-1]['wall_s']:.1f}s{label}{detail}", flush=True)
        results = {name: _median_run(rs) for name, rs in runs.items()}
        if "ours" in results and not args.no_scaling:
            results["ours local[1]"] = measure("ours", env, "local[1]", servers)
        fixed = measure("fixed", env)
        airflow = None if args.no_airflow else measure("airflow", env)
        print_table(results, produced, megabytes, fixed, airflow, runs)
        landed = all(r["rows"] == produced for rs in [*runs.values(), results.values()] for r in rs) and (
            airflow is None
            or (airflow["rows"] == 1 and airflow["backlog_rows"] == produced == airflow.get("per_batch_rows", produced))
        )
        if not landed:  # inside the stack's block: the run's folder and logs are kept
            print("not every contender landed every event", file=sys.stderr)
            raise SystemExit(1)
    return 0


def _seconds(run: dict) -> float:
    return run.get("timed_seconds", run["wall_s"])


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time (of an even count, the faster of the middle two)."""
    return sorted(runs, key=_seconds)[(len(runs) - 1) // 2]


def print_table(
    results: dict,
    produced: int,
    megabytes: float,
    fixed: dict,
    airflow: dict | None = None,
    runs: dict[str, list[dict]] | None = None,
) -> None:
    """`results`: one run per contender (the median one with --rounds, all rounds in `runs`)."""
    print(f"\n{'contender':<14} {'rows':>9} {'wall s':>8} {'rec/s':>9} {'MB/s':>7} {'peak RSS MB':>12}")
    for name, r in results.items():
        seconds = r.get("timed_seconds", r["wall_s"])
        print(
            f"{name:<14} {r['rows']:>9} {seconds:>8.1f} {produced / seconds:>9.0f} {megabytes / seconds:>7.1f} "
            f"{r['peak_rss_mb']:>12.0f}"
        )
    print(f"\nCPU core-seconds while each ran (the machine: {os.cpu_count()} cores x wall at most)")
    print(f"{'contender':<14} {'machine':>8} {'busy %':>7} {'PostgreSQL':>11} {'Kafka':>6} {'the rest':>9}")
    for name, r in results.items():
        cpu = r["cpu"]
        rest = cpu["machine"] - cpu.get("PostgreSQL", 0) - cpu.get("Kafka broker", 0)
        busy = 100 * cpu["machine"] / ((os.cpu_count() or 1) * cpu["at"])
        print(
            f"{name:<14} {cpu['machine']:>8.1f} {busy:>7.0f} {cpu.get('PostgreSQL', 0):>11.1f} "
            f"{cpu.get('Kafka broker', 0):>6.1f} {rest:>9.1f}"
        )
    ours = results.get("ours")
    runs = runs or {name: [r] for name, r in results.items()}
    if ours:
        for other in ("peer", "worker", "floor", "connect"):
            if other in results:
                # Paired by round (same minutes of the box's drift); the median of the rounds.
                ratios = sorted(_seconds(o) / _seconds(u) for o, u in zip(runs[other], runs["ours"], strict=True))
                line = f"throughput ours/{other}: {statistics.median(ratios):.2f}"
                if len(ratios) > 1:
                    line += f" (median of {len(ratios)} rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
                print(line)
        print(
            "ours per phase: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in ours["phases"].items())
            + f" ({ours['batches']} batches)"
        )
    print(
        f"fixed costs: empty run (plan, no Spark) {fixed['empty_run_s']:.2f}s; "
        f"1-record batch incl. Spark start {fixed['one_record_batch_s']:.1f}s"
    )
    if airflow:
        print(
            f"through `airflow dags test` (one process per task, spark-submit per batch): empty run "
            f"{airflow['empty_run_s']:.1f}s, 1-record batch {airflow['one_record_batch_s']:.1f}s; Airflow's own "
            f"overhead of an empty run: {airflow['empty_run_s'] - fixed['empty_run_s']:.1f}s"
        )
        rows, seconds = airflow["backlog_rows"], airflow["backlog_s"]
        line = (
            f"ours through the DAG, one `airflow dags test` run with batches_per_run unlimited: {rows} rows in "
            f"{seconds:.1f}s ({rows / seconds:.0f} rec/s, {airflow['backlog_batches']} batches)"
        )
        if "peer" in results:
            peer = results["peer"].get("timed_seconds", results["peer"]["wall_s"])
            line += f"; throughput ours-via-DAG/peer: {peer / seconds:.2f}"
        print(line)
        if "per_batch_s" in airflow:
            print(
                f"the same backlog with one batch per DAG run (batches_per_run 1): {airflow['per_batch_rows']} rows "
                f"in {airflow['per_batch_s']:.1f}s over {airflow['per_batch_runs']} runs (the last one empty)"
            )
    print(
        "floor = COPY from a local file only (file prepared untimed); wall of other contenders includes start-up;"
        " 'the rest' = the contender's own processes (Spark JVM, Python) and anything else on the machine"
    )


if __name__ == "__main__":
    sys.exit(main())
