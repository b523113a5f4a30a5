"""The CLI as a user meets it: `produce` makes new sample events each time unless a seed repeats
a run's; no Airflow chatter; `status` shows every pipeline it can when one is broken."""

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import psycopg
import yaml
from confluent_kafka import Consumer

from kafka2pg import cli
from kafka2pg.database import describe
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.kafka_offsets import client_config
from kafka2pg.opening import open_batch


def _event_ids(servers: str, topic: str, count: int) -> list[str]:
    consumer = Consumer({**client_config(servers, 10), "group.id": f"g-{topic}", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    ids: list[str] = []
    try:
        while len(ids) < count:
            message = consumer.poll(30)
            assert message is not None, f"only {len(ids)} of {count} records read back"
            assert message.error() is None, message.error()
            ids.append(json.loads(message.value())["event_id"])
    finally:
        consumer.close()
    return ids


def test_produce_makes_new_events_each_time_and_the_same_ones_for_a_seed(base_settings, monkeypatch, capsys):
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", base_settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", base_settings.database_url)
    topic = f"produced-{uuid.uuid4().hex[:8]}"
    for args in ([], [], ["--seed", "7"], ["--seed", "7"]):
        assert cli.main(["produce", "--topic", topic, "--count", "5", "--partitions", "1", *args]) == 0
    printed = capsys.readouterr().out
    seeds = re.findall(r"produced 5 events to \S+ \(--seed (\d+) produces the same events again\)", printed)
    assert len(seeds) == 4 and seeds[2:] == ["7", "7"], printed
    ids = _event_ids(base_settings.bootstrap_servers, topic, 20)
    first, second, seeded, again = (ids[i : i + 5] for i in range(0, 20, 5))
    assert len(set(first + second)) == 10  # two runs without a seed: ten different events
    assert seeded == again and not set(seeded) & set(first + second)


def test_a_command_prints_no_airflow_info_lines_unless_verbose_and_verbose_keeps_its_own_debug_lines(base_settings):
    """`-v` is kafka2pg's debug logging, also after Airflow's first import (a connection's lookup)
    set the root logger up anew at INFO; never Airflow's debug lines (a trace for its absent
    airflow_local_settings read as a failure), never a password."""
    password = "Pw-" + uuid.uuid4().hex  # the local stack trusts its clients: a password is never asked for
    url = urlsplit(base_settings.database_url)
    assert url.password is None and url.username
    with_password = url._replace(netloc=f"{url.username}:{password}@{url.hostname}:{url.port}").geturl()
    env = {
        **os.environ,
        "KAFKA2PG_BOOTSTRAP_SERVERS": base_settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": with_password,
    }
    topic = f"quiet-{uuid.uuid4().hex[:8]}"
    for verbose in ([], ["-v"]):
        done = subprocess.run(
            [sys.executable, "-m", "kafka2pg", *verbose, "produce", "--topic", topic, "--count", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert ("INFO airflow." in done.stderr) is bool(verbose), done.stderr
        debug = f"DEBUG kafka2pg.connections: produce: PostgreSQL {describe(with_password)}, Kafka "
        assert (debug in done.stderr) is bool(verbose), done.stderr
        assert "Traceback" not in done.stderr and "DEBUG airflow" not in done.stderr, done.stderr
        assert password not in done.stderr + done.stdout


def test_status_shows_every_pipeline_it_can_when_one_is_broken_and_exits_2(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=1)
    spec = yaml.safe_load(env.settings.pipelines_file.read_text())
    suffix = uuid.uuid4().hex[:8]
    broken = {
        **spec["pipelines"][0],
        "name": f"{env.pipeline.name}_b",
        "topic": f"absent-{suffix}",
        "target_table": f"public.absent_{suffix}",
    }
    unconfigured = {  # its Kafka connection logs in with SASL/SCRAM and no password
        **spec["pipelines"][0],
        "name": f"{env.pipeline.name}_c",
        "target_table": f"public.unconfigured_{suffix}",
        "kafka_config_id": f"kafka_{suffix}",
    }
    login = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u"}
    monkeypatch.setenv(
        f"AIRFLOW_CONN_KAFKA_{suffix.upper()}",
        json.dumps({"conn_type": "kafka", "extra": {"bootstrap.servers": "127.0.0.1:1", **login}}),
    )
    spec["pipelines"] += [broken, unconfigured]
    env.settings.pipelines_file.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()

    assert cli.main(["status", "--json"]) == 2
    shown = capsys.readouterr()
    good, bad, wrong = json.loads(shown.out)
    assert f"pipeline {broken['name']}: error:" not in shown.err  # in its object, once
    assert good["pipeline"] == env.pipeline.name and "partitions" in good
    # Its topic missing: what PostgreSQL holds is shown all the same, with Kafka's error.
    assert bad["pipeline"] == broken["name"] and bad["kafka_error"].startswith("TopicNotFoundError: topic 'absent-")
    assert bad["partitions"] == [] and bad["open_batches"] == [] and "error" not in bad
    assert wrong["pipeline"] == unconfigured["name"]
    assert wrong["error"].startswith(f"ConfigError: the Airflow connection 'kafka_{suffix}' (its extra): ")
    assert "needs sasl.password" in wrong["error"]

    assert cli.main(["status"]) == 2
    shown = capsys.readouterr()
    assert f"pipeline {env.pipeline.name}: topic {env.topic}" in shown.out
    assert f"pipeline {broken['name']}: Kafka's offsets unknown: TopicNotFoundError" in shown.err
    assert f"pipeline {broken['name']}: topic absent-" in shown.out and "ledger: Kafka's offsets unknown" in shown.out


def test_status_as_a_role_without_privileges_says_to_grant_them_instead_of_a_traceback(
    make_pipeline, db, monkeypatch, capsys
):
    from urllib.parse import quote, urlsplit

    from psycopg import sql

    env = make_pipeline(partitions=1)
    role, password = f"k2p_nogrant_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    db.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
    try:
        base = urlsplit(env.settings.database_url)
        url = base._replace(netloc=f"{role}:{quote(password)}@{base.hostname}:{base.port}").geturl()
        monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
        monkeypatch.setenv("KAFKA2PG_DATABASE_URL", url)
        monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
        capsys.readouterr()

        assert cli.main(["status", "--json"]) == 2
        (entry,) = json.loads(capsys.readouterr().out)
        # What the role lacks, all of it, as a run's plan says it (not only the first table it met).
        said = entry["error"]
        assert said.startswith("SchemaNotReadyError: PostgreSQL at ") and f"role '{role}' lacks " in said, said
        assert "USAGE on schema kafka2pg" in said and "INSERT on kafka2pg.quarantine" in said, said
        assert f"kafka2pg grant --role {role}" in said and password not in said
        assert cli.main(["status"]) == 2
        assert f"pipeline {env.pipeline.name}: error: SchemaNotReadyError" in capsys.readouterr().err
        # verify's exit 1 means a discrepancy: a pipeline it could not audit is 2, saying why.
        assert cli.main(["verify"]) == 2
        said = capsys.readouterr().err
        assert f"pipeline {env.pipeline.name}: not audited: SchemaNotReadyError" in said
        # All the role lacks, as status says it, on one line (not PostgreSQL's statement and caret).
        assert "USAGE on schema kafka2pg" in said and "INSERT on kafka2pg.quarantine" in said, said
        assert "LINE 1" not in said and len(said.strip().splitlines()) == 1, said
        for command in (["report", "--html"], ["quarantine"]):
            assert cli.main([*command, "--pipeline", env.pipeline.name]) == 2
            shown = capsys.readouterr().err
            assert "SchemaNotReadyError" in shown and f"grant --role {role}" in shown, (command, shown)
    finally:
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_verify_of_a_pipeline_added_since_migrate_names_its_missing_tables(
    make_pipeline, tmp_path, monkeypatch, capsys
):
    """A pipeline added to the file and not migrated yet: `verify` cannot audit it (exit 2) and says
    which of its tables are missing and what to run, on one line; not a version's migration."""
    env = make_pipeline(partitions=1)
    spec = yaml.safe_load(env.settings.pipelines_file.read_text())["pipelines"][0]
    added = {**spec, "name": f"{spec['name']}_added", "target_table": f"{spec['target_table']}_added"}
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({"pipelines": [spec, added]}))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(both))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()
    assert cli.main(["verify", "--pipeline", added["name"]]) == 2
    said = capsys.readouterr().err
    assert f"pipeline {added['name']}: not audited: SchemaNotReadyError" in said, said
    assert f"missing table(s) {added['target_table']}" in said and "kafka2pg migrate" in said, said
    assert "LINE 1" not in said and "this version of kafka2pg" not in said, said
    assert len(said.strip().splitlines()) == 1, said
    assert cli.main(["verify", "--pipeline", spec["name"]]) == 0  # the migrated one is audited


def test_migrate_and_grant_need_only_the_database_not_kafka(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=1)
    for name in ("KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG", "AIRFLOW_CONN_KAFKA2PG_KAFKA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    assert cli.main(["migrate"]) == 0
    assert cli.main(["grant", "--role", "some_runtime_role", "--print"]) == 0
    printed = capsys.readouterr().out
    assert "pipeline tables ensured" in printed and "GRANT" in printed, printed
    # which database it migrated, without the password
    assert f"kafka2pg_postgres ({describe(env.settings.database_url)}): migrations applied" in printed, printed
    assert f"-- kafka2pg_postgres ({describe(env.settings.database_url)})\n" in printed, printed
    assert cli.main(["offsets", "--pipeline", env.pipeline.name, "--from", "2026-01-02", "--to", "2026-01-01"]) == 2
    assert "--from 2026-01-02 must be before --to 2026-01-01" in capsys.readouterr().err
    # A role that does not exist: the CREATE ROLE to copy quotes its name as PostgreSQL reads it.
    assert cli.main(["grant", "--role", 'a"; DROP TABLE x; --']) == 2
    said = capsys.readouterr().err
    assert '(CREATE ROLE "a""; DROP TABLE x; --" LOGIN PASSWORD ...)' in said, said
    assert "`./kafka2pg grant --role 'a\"; DROP TABLE x; --'` again" in said, said


def test_stage_and_report_of_a_batch_not_there_or_done_say_so_without_starting_spark(
    make_pipeline, monkeypatch, capsys
):
    import kafka2pg.staging

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark started for a batch that does not exist")

    env = make_pipeline(partitions=1)
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setattr(kafka2pg.staging, "spark_session", no_spark)
    assert cli.main(["stage", "--pipeline", env.pipeline.name, "--batch-id", "987654321"]) == 2
    assert "batch 987654321 does not exist in kafka2pg.batches" in capsys.readouterr().err
    assert cli.main(["report", "--batch-id", "987654321"]) == 2
    assert "batch 987654321 does not exist in kafka2pg.batches" in capsys.readouterr().err
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(3, seed=56)))
    planned = open_batch(env.settings, env.pipeline).batch
    assert cli.main(["report", "--pipeline", env.pipeline.name, "--batch-id", str(planned.batch_id)]) == 1
    expected = f"pipeline {env.pipeline.name}: no quality report yet for batch {planned.batch_id} (planned)"
    assert expected in capsys.readouterr().out
    # A batch with nothing to stage (set by hand here: staging it needs Spark) is said so, no Spark.
    stage = ["stage", "--pipeline", env.pipeline.name, "--batch-id", str(planned.batch_id)]
    with psycopg.connect(env.settings.database_url, autocommit=True) as conn:
        conn.execute("UPDATE kafka2pg.batches SET state = 'promoted' WHERE batch_id = %s", (planned.batch_id,))
        assert cli.main(stage) == 0
        assert f"batch {planned.batch_id} is already promoted: nothing to stage" in capsys.readouterr().out
        conn.execute("UPDATE kafka2pg.batches SET state = 'abandoned' WHERE batch_id = %s", (planned.batch_id,))
        assert cli.main(stage) == 2
        assert "it cannot be staged" in capsys.readouterr().err


def _cli_environment(env, environ=None) -> dict[str, str]:
    """`environ` (this process's by default) with the pipeline's settings, for a CLI command."""
    return {
        **(os.environ if environ is None else environ),
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_STATE_DIR": str(env.settings.state_dir),
    }


@contextlib.contextmanager
def _stage_waiting_on_its_chunk_locks(env, tmp_path, environ=None):
    """`kafka2pg stage` of a new batch of 200 records in a process group of its own, yielded
    (with its stderr file) once its Spark tasks wait on their chunk locks, which this holds
    until the block ends: the job is surely under way, and cannot finish, while the block runs."""
    import time

    produce(env.settings.bootstrap_servers, env.topic, sample_events(200, seed=83))
    batch_id = open_batch(env.settings, env.pipeline, run_id="kill").batch.batch_id
    holder = psycopg.connect(env.settings.database_url, autocommit=True)
    for chunk in range(4):
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"kafka2pg.stage:{batch_id}:{chunk}",))
    stderr = tmp_path / "stage.stderr"
    with open(stderr, "w") as err:
        command = subprocess.Popen(
            [sys.executable, "-m", "kafka2pg", "stage", "--pipeline", env.pipeline.name, "--batch-id", str(batch_id)],
            env=_cli_environment(env, environ),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        waiting = 0
        while not waiting:
            assert command.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.2)
            waiting = holder.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE %s",
                ("%pg_advisory_xact_lock(hashtextextended%",),
            ).fetchone()[0]
        yield batch_id, command, stderr, holder
    finally:
        holder.close()
        if command.poll() is None:
            os.killpg(command.pid, 9)
            command.wait()


def test_a_stage_whose_spark_jvm_is_killed_from_outside_says_so_and_stages_again(make_pipeline, spark, tmp_path):
    """`kill -9` of the stage's Spark JVM while its tasks write: the command ends with what
    happened (not a py4j trace, nor the failed stop of the dead session hiding it), the batch stays
    planned, and staging it again reads every record once."""
    import psutil

    from kafka2pg.staging import stage_batch

    env = make_pipeline(partitions=2)
    with _stage_waiting_on_its_chunk_locks(env, tmp_path) as (batch_id, command, stderr, locks):
        tree = psutil.Process(command.pid).children(recursive=True)
        (jvm,) = [p for p in tree if p.name() == "java"]
        jvm.kill()
        # PySpark's daemon takes its workers down with it (the JVM stays a zombie until the command reaps it).
        _, alive = psutil.wait_procs([p for p in tree if p.pid != jvm.pid], timeout=120)
        assert not alive, alive
        locks.close()
        assert command.wait(timeout=300) == 2, stderr.read_text()[-3000:]
    last = stderr.read_text().strip().splitlines()[-1]
    assert last.startswith(f"error: SparkSessionLost: pipeline {env.pipeline.name!r} batch {batch_id}: Spark's JVM")
    assert "stays planned" in last
    assert not list((env.settings.state_dir / "spark" / "scratch").iterdir()), "the job removed its scratch folder"
    again = stage_batch(spark, env.settings, env.pipeline, batch_id)
    assert again.state == "staged" and sum(r.records for r in again.reads) == 200


def test_a_stage_job_killed_outright_leaves_its_spark_files_to_the_next_one_not_to_tmp(make_pipeline, tmp_path):
    """`kill -9` of the whole stage job (driver, JVM, Python workers): what Spark wrote (its
    block manager, the session's files, the package zip, the JVM's temporary files such as
    lz4-java's library) is in the job's scratch folder under the state directory, none of it in
    /tmp; the next stage job on the host removes the folder and stages the batch in full."""
    import tempfile

    import psutil

    env = make_pipeline(partitions=2)
    scratch = env.settings.state_dir / "spark" / "scratch"
    tmp = tempfile.gettempdir()
    before = set(os.listdir(tmp))
    # Without the tests' own SPARK_LOCAL_DIRS (Spark prefers it to spark.local.dir): as a user runs it.
    environment = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_DIRS"}
    with _stage_waiting_on_its_chunk_locks(env, tmp_path, environment) as (batch_id, command, _, _):
        (folder,) = [f for f in scratch.iterdir() if f.name.split("-")[-2] == str(command.pid)]
        written = {p.name.split("-")[0] for p in folder.rglob("*")}
        assert {"blockmgr", "userFiles", "kafka2pg"} <= written, written
        tree = [psutil.Process(command.pid), *psutil.Process(command.pid).children(recursive=True)]
        (jvm,) = [p for p in tree if p.name() == "java"]
        lz4 = {m.path for m in jvm.memory_maps() if "lz4" in m.path}  # lz4-java's library, unpacked at start
        assert lz4 and all(path.startswith(f"{folder}/") for path in lz4), lz4
        used = set()
        for process in tree:
            with contextlib.suppress(psutil.Error):  # a zombie (spark-class's shell) has none
                used |= {f.path for f in process.open_files()} | {m.path for m in process.memory_maps()}
        # What the job made in /tmp: its files under entries new there (the tests' own folders, a
        # checkout or its venv may be in /tmp too). HotSpot's counters are there whatever
        # java.io.tmpdir says (for jps and jstat), and the next JVM removes those of a dead one.
        made = {f"{tmp}/{name}" for name in set(os.listdir(tmp)) - before if not name.startswith("hsperfdata_")}
        assert not [path for path in used if path.startswith(tuple(f"{m}/" for m in made)) or path in made], used
        os.killpg(command.pid, 9)
        _, alive = psutil.wait_procs(tree, timeout=120)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    assert folder.is_dir(), "a job killed outright cannot remove its folder"
    left = [n for n in set(os.listdir(tmp)) - before if n.startswith(("spark-", "blockmgr-"))]
    assert not left, f"the killed job left {left} in {tmp}"

    done = subprocess.run(
        [sys.executable, "-m", "kafka2pg", "stage", "--pipeline", env.pipeline.name, "--batch-id", str(batch_id)],
        env=_cli_environment(env, environment),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"batch {batch_id}: read 200 records" in done.stdout, done.stdout
    assert not folder.exists(), "the next job swept the killed one's folder"
    assert not list(scratch.iterdir()), "and removed its own"


def test_report_of_a_batch_id_alone_shows_the_pipeline_whose_batch_it_is(make_pipeline, monkeypatch, capsys, tmp_path):
    first, second = make_pipeline(partitions=1), make_pipeline(partitions=1)
    specs = [yaml.safe_load(e.settings.pipelines_file.read_text())["pipelines"][0] for e in (first, second)]
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({"pipelines": specs}))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", first.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", first.settings.bootstrap_servers)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(both))
    produce(second.settings.bootstrap_servers, second.topic, list(sample_events(2, seed=57)))
    planned = open_batch(second.settings, second.pipeline).batch

    assert cli.main(["report", "--batch-id", str(planned.batch_id)]) == 1
    printed = capsys.readouterr().out.strip()
    assert printed == f"pipeline {second.pipeline.name}: no quality report yet for batch {planned.batch_id} (planned)"


def test_status_json_on_stdout_is_json_alone_when_airflow_logs_on_its_first_import(tmp_path):
    """Airflow sets its logging up when first imported (here: to read a connection) and logs to
    what stdout then is, e.g. that a short SASL user name cannot be masked: that goes to stderr,
    and `status --json | jq` reads JSON."""
    pipelines = tmp_path / "pipelines.yaml"
    spec = {"name": "orders", "topic": "orders", "target_table": "public.orders", "kafka_config_id": "kafka_short"}
    pipelines.write_text(yaml.safe_dump({"pipelines": [{**spec, "columns": [{"name": "n", "type": "text"}]}]}))
    login = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u"}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KAFKA2PG_", "AIRFLOW_CONN_"))},
        "KAFKA2PG_PIPELINES": str(pipelines),
        "KAFKA2PG_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/nothing",
        "AIRFLOW_CONN_KAFKA_SHORT": json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": "127.0.0.1:1", **login, "sasl.password": "pw-12345"}}
        ),
    }
    done = subprocess.run(
        [sys.executable, "-m", "kafka2pg", "status", "--json"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    (entry,) = json.loads(done.stdout)
    assert entry["pipeline"] == "orders" and entry["error"].startswith("DatabaseUnavailableError: "), entry
    assert "too short" in done.stderr and "pw-12345" not in done.stdout + done.stderr


def test_status_of_a_pipeline_added_but_not_migrated_says_not_ready_in_text_and_json_alike(
    make_pipeline, monkeypatch, capsys
):
    env = make_pipeline(partitions=1)
    spec = yaml.safe_load(env.settings.pipelines_file.read_text())
    added = {
        **spec["pipelines"][0],
        "name": f"{env.pipeline.name}_new",
        "target_table": f"public.new_{uuid.uuid4().hex[:8]}",
    }
    spec["pipelines"].append(added)
    env.settings.pipelines_file.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()

    assert cli.main(["status", "--pipeline", added["name"]]) == 0
    text = capsys.readouterr().out
    assert "rows landed in target: unknown (NOT READY); records in quarantine: 0" in text, text
    missing = f"missing table(s) {added['target_table']}, kafka2pg.stg_{added['name']}"
    assert "NOT READY for a run as role " in text and missing in text and "run `./kafka2pg migrate`" in text, text
    assert "ledger:" in text
    assert cli.main(["status", "--pipeline", added["name"], "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert missing in shown["not_ready"] and shown["open_batches"] == [] and shown["stuck"] == []


def test_a_reader_gone_before_the_output_is_written_leaves_no_traceback(make_pipeline):
    """`./kafka2pg status | head -1`: the pipe closes while status writes."""
    env = make_pipeline(partitions=1)
    environment = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},  # stdout buffered, as usual
        "KAFKA2PG_PIPELINES": str(env.settings.pipelines_file),
        "KAFKA2PG_DATABASE_URL": env.settings.database_url,
        "KAFKA2PG_BOOTSTRAP_SERVERS": env.settings.bootstrap_servers,
    }
    read, write = os.pipe()
    os.close(read)  # every write to the pipe fails (EPIPE): the reader is gone
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kafka2pg", "status"],
            env=environment,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_arguments_that_would_be_ignored_are_refused(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=1)
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", env.settings.bootstrap_servers)
    capsys.readouterr()
    assert cli.main(["status", "--pipeline", ""]) == 2  # not every pipeline
    assert "unknown pipeline ''" in capsys.readouterr().err
    assert cli.main(["report", "--pipeline", env.pipeline.name, "--out", "x.html"]) == 2
    assert "give --html too" in capsys.readouterr().err


def test_status_with_kafka_down_still_shows_what_postgresql_holds_and_exits_2(make_pipeline, monkeypatch, capsys):
    env = make_pipeline(partitions=1)
    produce(env.settings.bootstrap_servers, env.topic, list(sample_events(3, seed=75)))
    batch = open_batch(env.settings, env.pipeline, run_id="run-k").batch
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(env.settings.pipelines_file))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", env.settings.database_url)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("KAFKA2PG_KAFKA_TIMEOUT_S", "2")
    capsys.readouterr()

    assert cli.main(["status"]) == 2
    shown = capsys.readouterr()
    assert f"open: batch {batch.batch_id} (live, planned) p0[0,3)" in shown.out, shown.out
    assert "ledger: Kafka's offsets unknown, not shown (KafkaUnavailableError: " in shown.out
    assert f"pipeline {env.pipeline.name}: Kafka's offsets unknown: KafkaUnavailableError" in shown.err
    assert cli.main(["status", "--json"]) == 2
    (data,) = json.loads(capsys.readouterr().out)
    assert data["kafka_error"].startswith("KafkaUnavailableError: ") and data["partitions"] == []
    assert [b["batch_id"] for b in data["open_batches"]] == [batch.batch_id]


def test_an_error_postgresql_raises_in_words_kafka2pg_has_none_for_is_one_line_with_its_detail_and_where(
    base_settings, db, monkeypatch, capsys
):
    """A DBA's function raising with a DETAIL and a HINT, its message quoting a value with a line
    break, called from another function: exit 2 and ONE line on stderr with PostgreSQL's message,
    detail, hint, SQLSTATE and the functions it was raised in, not psycopg's multi-line text."""
    name = f"kafka2pg_test_raise_{uuid.uuid4().hex[:8]}"
    db.execute(
        f"CREATE FUNCTION public.{name}() RETURNS void LANGUAGE plpgsql AS $$ BEGIN"
        " RAISE EXCEPTION 'refused value %', E'a\\nb' USING DETAIL = 'the DBA''s rule 7', HINT = 'ask the DBA',"
        " ERRCODE = 'P0099'; END $$"
    )
    db.execute(
        f"CREATE FUNCTION public.{name}_outer() RETURNS void LANGUAGE plpgsql AS"
        f" $$ BEGIN PERFORM public.{name}(); END $$"
    )

    def refused(_args):
        with psycopg.connect(base_settings.database_url) as conn:
            conn.execute(f"SELECT public.{name}_outer()")
        return 0

    monkeypatch.setattr(cli, "cmd_migrate", refused)
    try:
        code = cli.main(["migrate"])
    finally:
        db.execute(f"DROP FUNCTION public.{name}_outer(); DROP FUNCTION public.{name}()")

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        "error: ProgrammingError (SQLSTATE P0099): refused value a\\nb; detail: the DBA's rule 7; hint: ask the DBA;"
        " where: "
        f'PL/pgSQL function {name}() line 1 at RAISE <- SQL statement "SELECT public.{name}()"'
    ), err
    assert "LINE 1" not in err and "CONTEXT" not in err, err
