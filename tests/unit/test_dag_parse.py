"""DAG files parse fast and light: a live and a replay DAG per pipeline, no heavy import at parse time."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, runpy
ns = runpy.run_path(sys.argv[1])
dags = {k: v for k, v in ns.items() if k.startswith("kafka2pg_")}
heavy = sorted(m for m in ("pyspark", "psycopg", "great_expectations", "confluent_kafka") if m in sys.modules)
dag = dags["kafka2pg_orders"]
replay = dags["kafka2pg_orders_replay"]
print(json.dumps({
    "dags": sorted(dags),
    "heavy": heavy,
    "tasks": sorted(dag.task_ids),
    "max_active_runs": dag.max_active_runs,
    "allowed_run_types": None if dag.allowed_run_types is None else sorted(dag.allowed_run_types),
    "stage_limit": dag.get_task("read_and_stage").max_active_tis_per_dag,
    "replay_max_active_runs": replay.max_active_runs,
    "replay_allowed_run_types": replay.allowed_run_types,
    "replay_stage_limit": replay.get_task("read_and_stage").max_active_tis_per_dag,
    "params": sorted(dag.params.keys()),
    "replay_tasks": sorted(replay.task_ids),
    "outlets": [[type(o).__name__, o.name] for d, t in ((dag, "promote"), (replay, "finish"))
                for o in d.get_task(t).outlets],
    "replay_params": {
        k: {**replay.params.get_param(k).schema, "description": replay.params.get_param(k).description}
        for k in replay.params.keys()
    },
    "replay_paused": replay.is_paused_upon_creation,
    "replay_timetable": type(replay.timetable).__name__,
    "stage_decided_at_parse": [
        [d.get_task("read_and_stage").conf, d.get_task("read_and_stage").jars] for d in (dag, replay)
    ],
}))
"""


def _parse_dag_file(env: dict[str, str] | None = None) -> dict:
    """The DAG file parsed in a fresh interpreter (so heavy imports show), summarised by PROBE."""
    inherited = {k: os.environ[k] for k in ("KAFKA2PG_STATE_DIR", "JAVA_HOME") if k in os.environ}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(ROOT / "dags" / "kafka2pg_pipelines.py")],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin", **inherited, **(env or {})},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_dag_file_builds_one_dag_per_pipeline_without_heavy_imports():
    result = _parse_dag_file()
    assert result["dags"] == ["kafka2pg_orders", "kafka2pg_orders_replay"]
    assert result["heavy"] == [], f"parsing the DAG imported {result['heavy']}"
    assert result["tasks"] == ["has_batch", "plan", "promote", "read_and_stage", "validate"]
    assert result["max_active_runs"] == 1
    # No backfill of the live DAG: Airflow would start up to the backfill's own max_active_runs beside it.
    assert result["allowed_run_types"] == [
        "asset_materialization",
        "asset_triggered",
        "manual",
        "operator_triggered",
        "scheduled",
    ]
    assert result["stage_limit"] is None
    # The replay DAG takes backfills; its Spark jobs at once are bounded for those runs too.
    assert result["replay_allowed_run_types"] is None
    assert result["replay_max_active_runs"] == result["replay_stage_limit"] == 4
    assert result["params"] == ["batches_per_run", "dry_run", "max_records_per_batch"]
    assert result["replay_tasks"] == ["finish", "has_batch", "plan", "read_and_stage", "validate"]
    params = result["replay_params"]
    assert sorted(params) == ["from_time", "mode", "offset_ranges", "reason", "to_time"]
    assert params["mode"]["enum"] == ["replace", "verify-only"]
    assert params["from_time"]["format"] == "date-time"
    assert all(schema.get("description") for schema in params.values())
    assert result["replay_paused"] is True
    assert result["replay_timetable"] == "CronDataIntervalTimetable"
    # The target's Asset (its URI names the server) is resolved at run time, through this alias.
    assert result["outlets"] == [["AssetAlias", "kafka2pg_orders"]] * 2
    # spark-submit's conf and jars are the worker's to decide when the task runs (stage_operator).
    assert result["stage_decided_at_parse"] == [[None, None], [None, None]]


def test_stage_jvm_options_follow_the_runs_batches_and_reader_and_name_the_class_archive(tmp_path, monkeypatch):
    """C1-only JIT for the librdkafka reader (no per-record code in the JVM; a small young
    generation too) and for a job of one batch; tiered (C2) once Spark's Kafka source catches up
    several; the class-data archive once set-up has made one: what spark-submit gets once Airflow
    runs (with the run's batches_per_run, from the plan task's XCom)."""
    from kafka2pg.config import (
        STAGE_JVM_OPTIONS_C1,
        STAGE_JVM_OPTIONS_LIBRDKAFKA,
        STAGE_JVM_OPTIONS_TIERED,
        class_archive_path,
        get_pipeline,
        spark_log_options,
        stage_jvm_conf,
    )
    from kafka2pg.stage_operator import spark_submit_conf

    assert "TieredStopAtLevel=1" in STAGE_JVM_OPTIONS_C1
    assert "TieredStopAtLevel" not in STAGE_JVM_OPTIONS_TIERED
    assert "TieredStopAtLevel=1" in STAGE_JVM_OPTIONS_LIBRDKAFKA and "-Xmn" in STAGE_JVM_OPTIONS_LIBRDKAFKA
    assert "-Xmn" not in STAGE_JVM_OPTIONS_C1 + STAGE_JVM_OPTIONS_TIERED  # Spark's source allocates per record
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))
    spark_reader = tmp_path / "pipelines.yaml"
    shipped = (ROOT / "dags" / "pipelines.yaml").read_text()
    spark_reader.write_text(shipped.replace("    topic: orders\n", "    topic: orders\n    kafka_reader: spark\n", 1))

    def rendered(batches: int, path: Path = ROOT / "dags" / "pipelines.yaml") -> tuple[str, str]:
        """The live job's JVM options for a run of `batches`, and the replay job's (one batch)."""
        pipeline = get_pipeline("orders", path)
        live = spark_submit_conf(pipeline, batches)[1]["spark.driver.extraJavaOptions"]
        return live, spark_submit_conf(pipeline, 1)[1]["spark.driver.extraJavaOptions"]

    def rendered_spark_reader(batches: int) -> tuple[str, str]:
        return rendered(batches, spark_reader)

    # Spark's own logging at WARN (the pipelines' default spark_log_level) from kafka2pg's log4j2 file.
    logging = f" {spark_log_options('WARN')}"
    assert "-Dlog4j2.configurationFile=" in logging and logging.endswith("-Dkafka2pg.spark.log.level=WARN")
    c1, tiered, librdkafka = STAGE_JVM_OPTIONS_C1, STAGE_JVM_OPTIONS_TIERED, STAGE_JVM_OPTIONS_LIBRDKAFKA
    assert stage_jvm_conf(1) == {"spark.driver.extraJavaOptions": librdkafka + logging}
    assert stage_jvm_conf(2) == {"spark.driver.extraJavaOptions": librdkafka + logging}
    assert stage_jvm_conf(1, kafka_reader="spark") == {"spark.driver.extraJavaOptions": c1 + logging}
    assert stage_jvm_conf(2, kafka_reader="spark") == {"spark.driver.extraJavaOptions": tiered + logging}
    assert rendered(1) == (librdkafka + logging, librdkafka + logging)
    assert rendered(7)[0] == librdkafka + logging
    assert rendered_spark_reader(1) == (c1 + logging, c1 + logging)
    assert rendered_spark_reader(7)[0] == tiered + logging

    archive = class_archive_path()
    assert archive.parent.parent == tmp_path and archive.suffix == ".jsa"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"made by set-up")
    shared = f" -XX:SharedArchiveFile={archive}"
    assert stage_jvm_conf(1) == {"spark.driver.extraJavaOptions": librdkafka + shared + logging}
    assert rendered(1) == (librdkafka + shared + logging, librdkafka + shared + logging)
    assert rendered(7)[0] == librdkafka + shared + logging
    assert rendered_spark_reader(7)[0] == tiered + shared + logging


def test_a_pipelines_own_driver_jvm_options_keep_kafka2pgs_logging_unless_they_name_a_log4j2_file(tmp_path):
    """spark_conf's spark.driver.extraJavaOptions replaces kafka2pg's JIT and heap options, not its
    log4j2 file: the pipeline's spark_log_level and the filters keeping the Kafka clients'
    parameters out of the task log go on applying, unless the pipeline names its own file."""
    from kafka2pg.config import get_pipeline, keep_log_options, names_own_log_config, spark_log_options
    from kafka2pg.stage_operator import spark_submit_conf

    shipped = (ROOT / "dags" / "pipelines.yaml").read_text()

    def rendered(options: str) -> str:
        own = tmp_path / "pipelines.yaml"
        extra = f"    spark_log_level: DEBUG\n    spark_conf:\n      spark.driver.extraJavaOptions: '{options}'\n"
        own.write_text(shipped.replace("    topic: orders\n", "    topic: orders\n" + extra, 1))
        pipeline = get_pipeline("orders", own)
        one, several = (spark_submit_conf(pipeline, n)[1]["spark.driver.extraJavaOptions"] for n in (1, 5))
        assert one == several
        return one

    debug = spark_log_options("DEBUG")
    assert rendered("-Djava.security.krb5.conf=/etc/krb5.conf") == f"-Djava.security.krb5.conf=/etc/krb5.conf {debug}"
    # Log4j 2's mitigation property is not a configuration file.
    assert rendered("-Dlog4j2.formatMsgNoLookups=true") == f"-Dlog4j2.formatMsgNoLookups=true {debug}"
    assert rendered("-Dlog4j2.configurationFile=/site/log4j2.xml") == "-Dlog4j2.configurationFile=/site/log4j2.xml"
    assert rendered("-XX:+UseG1GC -Dlog4j.configurationFile=/x.xml") == "-XX:+UseG1GC -Dlog4j.configurationFile=/x.xml"
    assert keep_log_options({"spark.sql.shuffle.partitions": "8"}) == {"spark.sql.shuffle.partitions": "8"}
    assert keep_log_options({"spark.driver.extraJavaOptions": ""}) == {
        "spark.driver.extraJavaOptions": spark_log_options("WARN")
    }
    # The stage job warns where the pipeline's own file replaces kafka2pg's: the same rule.
    assert names_own_log_config({"spark.driver.extraJavaOptions": "-XX:+UseSerialGC -Dlog4j.configurationFile=/x"})
    assert not names_own_log_config({"spark.driver.extraJavaOptions": "-Dlog4j2.formatMsgNoLookups=true"})
    assert not names_own_log_config({})


def test_a_session_started_with_the_pipelines_driver_jvm_options_keeps_kafka2pgs_logging(monkeypatch):
    """The CLI's, the bench's and the tests' Spark sessions (staging.spark_session, which starts
    the JVM itself) take a pipeline's extraJavaOptions by the DAG's rule."""
    from kafka2pg import staging
    from kafka2pg.config import spark_log_options

    given: dict[str, str] = {}

    class Builder:
        def appName(self, name):
            return self

        def master(self, master):
            return self

        def config(self, key, value):
            given[key] = value
            return self

        def getOrCreate(self):
            return "session"

    class Session:
        builder = Builder()

    monkeypatch.setattr(staging, "SparkSession", Session)
    own = {"spark.driver.extraJavaOptions": "-Dsite.option=1"}
    assert staging.spark_session("local[1]", app_name="t", conf=own) == "session"
    assert given["spark.driver.extraJavaOptions"] == f"-Dsite.option=1 {spark_log_options('WARN')}"
    assert own == {"spark.driver.extraJavaOptions": "-Dsite.option=1"}, "the pipeline's conf is left as it was"


COPIED = """
import json, sys, runpy
ns = runpy.run_path(sys.argv[1])
stage = ns["kafka2pg_copied"].get_task("read_and_stage")
print(json.dumps({
    "dags": sorted(k for k in ns if k.startswith("kafka2pg_")),
    "application": stage.application,
    "pipelines_file": stage.pipelines_file,
    "jars": stage.jars,
    "conf": stage.conf,
}))
"""


def test_the_dag_file_copied_alone_reads_the_pipelines_file_beside_it_and_submits_the_packaged_job(
    tmp_path, monkeypatch
):
    """A DAGs folder holding only the DAG file and a pipelines.yaml: its DAGs come from that file, the
    tasks read that same file, spark-submit runs the job module inside the package, and without
    resolved jars Spark gets its Kafka source as spark.jars.packages for the installed pyspark (a
    pipeline with kafka_reader: spark; the default reader needs no jars)."""
    from importlib import metadata

    import kafka2pg.stage_job

    dags = tmp_path / "dags"
    dags.mkdir()
    dag_file = dags / "kafka2pg_pipelines.py"
    dag_file.write_text((ROOT / "dags" / "kafka2pg_pipelines.py").read_text())
    spec = {"name": "copied", "topic": "copied", "target_table": "copied", "columns": [{"name": "a", "type": "text"}]}
    (dags / "pipelines.yaml").write_text(json.dumps({"pipelines": [{**spec, "kafka_reader": "spark"}]}))

    def parse(**env: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", COPIED, str(dag_file)],
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
            env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin", **env},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    empty_state = tmp_path / "state"
    result = parse(KAFKA2PG_STATE_DIR=str(empty_state), KAFKA2PG_SPARK_JARS="/opt/jars/*.jar")
    assert result["dags"] == ["kafka2pg_copied", "kafka2pg_copied_replay"]
    assert result["pipelines_file"] == str(dags / "pipelines.yaml")
    assert result["application"] == kafka2pg.stage_job.__file__
    assert (result["jars"], result["conf"]) == (None, None)  # the worker's to decide, when the task runs

    from kafka2pg.config import get_pipeline
    from kafka2pg.stage_operator import spark_submit_conf

    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(empty_state))
    monkeypatch.delenv("KAFKA2PG_SPARK_JARS", raising=False)
    jars, conf = spark_submit_conf(get_pipeline("copied", dags / "pipelines.yaml"), 1)
    assert jars is None
    assert conf["spark.jars.packages"] == f"org.apache.spark:spark-sql-kafka-0-10_2.13:{metadata.version('pyspark')}"
    monkeypatch.setenv("KAFKA2PG_SPARK_JARS", "/opt/jars/*.jar")
    jars, conf = spark_submit_conf(get_pipeline("copied", dags / "pipelines.yaml"), 1)
    assert (jars, conf.get("spark.jars.packages")) == ("/opt/jars/*.jar", None)

    (dags / "pipelines.yaml").write_text(json.dumps({"pipelines": [spec]}))  # the default reader: librdkafka
    jars, conf = spark_submit_conf(get_pipeline("copied", dags / "pipelines.yaml"), 1)
    assert (jars, conf.get("spark.jars.packages")) == (None, None)


@pytest.mark.parametrize("schedule", [None, "@hourly"])
def test_the_live_dag_takes_every_kind_of_run_but_a_backfill_as_airflow_reads_it(tmp_path, monkeypatch, schedule):
    """What the dag-processor stores and the scheduler, the API and `airflow backfill create`
    check: backfill left out (the UI's Backfill is offered only for a DAG that allows it), every
    other kind of run Airflow has still allowed, with or without a schedule; the replay DAG
    takes backfills."""
    from airflow.sdk.api.datamodels._generated import DagRunType
    from airflow.serialization.serialized_objects import DagSerialization

    from kafka2pg.dag_factory import build_dags

    shipped = (ROOT / "dags" / "pipelines.yaml").read_text()
    own = tmp_path / "pipelines.yaml"
    own.write_text(
        shipped.replace("    topic: orders\n", f"    topic: orders\n    schedule: {json.dumps(schedule)}\n", 1)
    )
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(own))
    dags = build_dags()
    live = DagSerialization.from_dict(DagSerialization.to_dict(dags["kafka2pg_orders"]))
    assert live.timetable.periodic is (schedule is not None)
    assert set(live.allowed_run_types) == {t.value for t in DagRunType} - {"backfill"}
    replay = DagSerialization.from_dict(DagSerialization.to_dict(dags["kafka2pg_orders_replay"]))
    assert replay.allowed_run_types is None and replay.timetable.periodic
    assert replay.get_task("read_and_stage").max_active_tis_per_dag == 4
    assert "At most 4 runs stage" in replay.doc_md


@pytest.mark.parametrize("minutes", [None, 90, 1.5])
def test_task_timeout_minutes_is_every_tasks_execution_timeout_as_airflow_reads_it(tmp_path, monkeypatch, minutes):
    """A wedged task (a lock wait, a Spark job that hangs) would hold the live DAG's one run for
    good: with `task_timeout_minutes` every task of both DAGs, in the DAG the scheduler reads,
    fails after that long (the stage task's Spark job stopped by its on_kill) and is retried."""
    from datetime import timedelta

    from airflow.serialization.serialized_objects import DagSerialization

    from kafka2pg.dag_factory import build_dags

    shipped = (ROOT / "dags" / "pipelines.yaml").read_text()
    own = tmp_path / "pipelines.yaml"
    setting = "" if minutes is None else f"    task_timeout_minutes: {minutes}\n"
    own.write_text(shipped.replace("    topic: orders\n", f"    topic: orders\n{setting}", 1))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(own))
    built = build_dags()
    expected = None if minutes is None else timedelta(minutes=minutes)
    for dag_id in ("kafka2pg_orders", "kafka2pg_orders_replay"):
        dag = DagSerialization.from_dict(DagSerialization.to_dict(built[dag_id]))
        assert dag.task_dict and {t.execution_timeout for t in dag.tasks} == {expected}, dag_id
        assert {t.retries for t in dag.tasks} == {2}


@pytest.fixture
def dags(monkeypatch):
    """The shipped pipelines file's DAGs, built in this process."""
    from kafka2pg.dag_factory import build_dags

    monkeypatch.delenv("KAFKA2PG_PIPELINES", raising=False)
    return build_dags(ROOT / "dags")


class Run:
    """The DAG run a task's context holds: its conf."""

    def __init__(self, conf: dict):
        self.conf = conf
        self.triggering_user_name = "ann"
        self.run_type = "backfill"


@pytest.mark.parametrize(
    ("dag_id", "conf", "planner"),
    [
        ("kafka2pg_orders", {"dry_run": True}, "plan"),
        ("kafka2pg_orders_replay", {"mode": "verify-only"}, "plan_replay"),
    ],
)
def test_a_run_conf_airflow_does_not_apply_to_the_params_stops_the_plan_task(dags, monkeypatch, dag_id, conf, planner):
    """The plan task gets the Params as Airflow's task runner resolves them (process_params):
    with [core] dag_run_conf_overrides_params False, the DAG's defaults whatever the conf says
    (a dry run would load, a verify-only backfill would replace rows). The task fails before
    planning anything; with the setting True it plans with the conf's values."""
    from airflow.sdk.definitions.param import process_params

    from kafka2pg import tasks
    from kafka2pg.exceptions import RunConfNotAppliedError

    planned: list[dict] = []
    monkeypatch.setattr(tasks, planner, lambda *args, **kwargs: planned.append({**kwargs, "args": args}))
    dag = dags[dag_id]
    plan = dag.get_task("plan")

    def run_plan() -> None:
        params = process_params(dag, plan, conf, suppress_exception=False)
        plan.python_callable(params=params, run_id="backfill__x", dag_run=Run(conf), dag=dag)

    monkeypatch.setenv("AIRFLOW__CORE__DAG_RUN_CONF_OVERRIDES_PARAMS", "False")
    with pytest.raises(AirflowFailException, match="dag_run_conf_overrides_params is False") as raised:
        run_plan()
    assert isinstance(raised.value.__cause__, RunConfNotAppliedError)
    assert raised.value.__cause__.keys == tuple(conf)
    assert planned == []

    monkeypatch.setenv("AIRFLOW__CORE__DAG_RUN_CONF_OVERRIDES_PARAMS", "True")
    run_plan()
    (call,) = planned
    if planner == "plan":
        assert call["dry_run"] is True
    else:
        assert call["args"][1]["mode"] == "verify-only"


def test_a_pipeline_in_error_gets_stand_in_dags_that_say_why_and_the_others_are_built(tmp_path, monkeypatch):
    """One broken entry in the pipelines file no longer takes every pipeline's DAGs (and their
    running tasks, which parse the file again) down with it."""
    from airflow.sdk.exceptions import AirflowFailException

    from kafka2pg.dag_factory import INVALID_PIPELINES_DAG, build_dags

    good = {"name": "good", "topic": "good", "target_table": "good", "columns": [{"name": "a", "type": "text"}]}
    bad = {**good, "name": "bad", "topic": "bad", "target_table": "bad", "columns": [{"name": "a", "type": "text[]"}]}
    unnamed = {**good, "name": "Not A Name", "target_table": "other"}
    path = tmp_path / "pipelines.yaml"
    path.write_text(json.dumps({"pipelines": [good, bad, unnamed]}))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(path))
    dags = build_dags()
    assert sorted(dags) == sorted(
        ["kafka2pg_good", "kafka2pg_good_replay", "kafka2pg_bad", "kafka2pg_bad_replay", INVALID_PIPELINES_DAG]
    )
    assert "read_and_stage" in dags["kafka2pg_good"].task_ids
    for dag_id, said in (
        ("kafka2pg_bad", "text[]"),
        ("kafka2pg_bad_replay", "text[]"),
        (INVALID_PIPELINES_DAG, "Not A"),
    ):
        stand_in = dags[dag_id]
        assert stand_in.task_ids == ["configuration_error"] and type(stand_in.timetable).__name__ == "NullTimetable"
        assert stand_in.description.startswith("CONFIGURATION ERROR: ") and said in stand_in.doc_md
        with pytest.raises(AirflowFailException, match=re.escape(said)):
            stand_in.get_task("configuration_error").python_callable()


def _built_with_other_refused(tmp_path, monkeypatch, builder: str, error: str) -> dict:
    """build_dags of pipelines "good" and "other", whose DAG `builder` raises ValueError(`error`)."""
    from kafka2pg import dag_factory

    good = {"name": "good", "topic": "good", "target_table": "good", "columns": [{"name": "a", "type": "text"}]}
    other = {**good, "name": "other", "topic": "other", "target_table": "other"}
    path = tmp_path / "pipelines.yaml"
    path.write_text(json.dumps({"pipelines": [good, other]}))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(path))
    real = getattr(dag_factory, builder)

    def refused(pipeline, pipelines_file):
        if pipeline.name == "other":
            raise ValueError(error)
        return real(pipeline, pipelines_file)

    monkeypatch.setattr(dag_factory, builder, refused)
    return dag_factory.build_dags()


def test_a_pipeline_whose_dag_airflow_refuses_to_build_stands_in_alone(tmp_path, monkeypatch):
    dags = _built_with_other_refused(tmp_path, monkeypatch, "build_dag", "a schedule Airflow cannot read")
    assert "read_and_stage" in dags["kafka2pg_good"].task_ids
    assert dags["kafka2pg_other"].task_ids == ["configuration_error"]
    assert "Airflow refused its DAG (ValueError: a schedule Airflow cannot read)" in dags["kafka2pg_other"].doc_md


def test_an_errors_text_cannot_close_its_code_block_in_the_stand_in_dags_doc(tmp_path, monkeypatch):
    """The doc of a pipeline in error shows the error in a Markdown code block, which Airflow's UI
    renders: a key written with backticks and newlines stays inside it, quoted."""
    from kafka2pg.dag_factory import build_dags

    key = "x\n```\n# Pipeline OK\n[fix it](https://evil.example/login)\n````"
    good = {"name": "good", "topic": "good", "target_table": "good", "columns": [{"name": "a", "type": "text"}]}
    path = tmp_path / "pipelines.yaml"
    path.write_text(json.dumps({"pipelines": [{**good, key: 1}]}))
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(path))
    doc = build_dags()["kafka2pg_good"].doc_md
    fence = "`" * 5  # one more than the longest run of backticks in the error
    block = doc.split("\n\n", 1)[1]
    assert block.startswith(fence + "\n") and block.endswith("\n" + fence) and block.count(fence) == 2, doc
    assert repr(key) in block and "\n# Pipeline OK" not in block


def test_a_live_dag_whose_replay_dag_airflow_refuses_is_not_registered_beside_its_stand_in(tmp_path, monkeypatch):
    """Airflow collects every DAG a `with DAG(...)` block closed in the DAG file, not only those it
    hands over: a half-built pair's live DAG would run beside the stand-in that says why not."""
    from airflow.sdk.definitions._internal.contextmanager import DagContext

    monkeypatch.setattr(DagContext, "current_autoregister_module_name", "json")  # any module loaded
    monkeypatch.setattr(DagContext, "autoregistered_dags", set())
    dags = _built_with_other_refused(tmp_path, monkeypatch, "build_replay_dag", "a timetable Airflow cannot read")
    assert dags["kafka2pg_other"].task_ids == ["configuration_error"]
    assert "read_and_stage" in dags["kafka2pg_good"].task_ids
    assert [dag.dag_id for dag, _ in DagContext.autoregistered_dags] == []


def test_spark_conf_secrets_stay_off_spark_submits_command_line_and_out_of_the_task_log(tmp_path, monkeypatch):
    """A pipeline's spark_conf holding Spark's RPC secret, a cloud store's key and a trust store's
    password in the driver's JVM options: spark-submit's command line (in `ps`, and in the task
    log's submit line) gets the settings Spark reads at launch, not the ones named as secrets (the
    job's session gives those to Spark); Airflow's masker learns every secret value."""
    from airflow.sdk.log import redact

    from kafka2pg.config import Settings, get_pipeline, spark_conf_secrets
    from kafka2pg.kafka_config import KafkaConfig
    from kafka2pg.stage_operator import spark_submit_conf
    from kafka2pg.tasks import mask_secrets

    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path / "state"))
    spec = yaml.safe_load((ROOT / "dags" / "pipelines.yaml").read_text())["pipelines"][0]
    spec["spark_conf"] = {
        "spark.authenticate": "true",
        "spark.authenticate.secret": "Rpc-s3cret-1187",
        "spark.hadoop.fs.azure.account.key.acct.blob.core.windows.net": "QWNjb3VudEtleQ==",
        "spark.kubernetes.authenticate.oauthToken": "k8s-tok-5531",
        "spark.hadoop.fs.azure.sas.c.acct.blob.core.windows.net": "sv=2024&sig=SasSig-7702",
        "spark.driver.extraJavaOptions": (
            '-Djavax.net.ssl.trustStorePassword=Trust-pw-2209 -Dx.y=plain -Dk.password="a b"'
        ),
        "spark.driver.memory": "1g",
        # Named so, and no secret: a switch, a provider class, where a Kubernetes secret is mounted.
        "spark.security.credentials.hive.enabled": "false",
        "spark.hadoop.fs.s3a.aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        "spark.kubernetes.driver.secrets.db-cert": "/etc/secrets",
    }
    (tmp_path / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": [spec]}))
    pipeline = get_pipeline(spec["name"], tmp_path / "pipelines.yaml")

    conf = spark_submit_conf(pipeline, 1)[1]

    assert (conf["spark.authenticate"], conf["spark.driver.memory"]) == ("true", "1g")
    submitted = " ".join(f"{k}={v}" for k, v in conf.items())
    for secret in ("Rpc-s3cret-1187", "QWNjb3VudEtleQ==", "k8s-tok-5531", "SasSig-7702"):
        assert secret not in submitted, submitted
    assert conf["spark.kubernetes.driver.secrets.db-cert"] == "/etc/secrets"
    assert "-Djavax.net.ssl.trustStorePassword=Trust-pw-2209" in conf["spark.driver.extraJavaOptions"]  # JVM-only
    secrets = spark_conf_secrets(pipeline.spark_conf)
    assert sorted(secrets) == sorted(
        [
            "Rpc-s3cret-1187",
            "QWNjb3VudEtleQ==",
            "k8s-tok-5531",
            "sv=2024&sig=SasSig-7702",
            "Trust-pw-2209",
            '"a b"',
            "a b",
        ]
    )
    line = f"Spark-Submit cmd: spark-submit --conf {submitted} (Rpc-s3cret-1187, k8s-tok-5531)"
    mask_secrets(
        Settings(database_url="postgresql://etl@db/x", kafka=KafkaConfig.of({"bootstrap.servers": "b"})), secrets
    )
    shown = redact(line)
    for secret in secrets:
        assert secret not in shown, shown
    assert "-Dx.y=plain" in shown and "hive.enabled=false" in shown and "/etc/secrets" in shown
