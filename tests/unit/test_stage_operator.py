"""The stage job's services (database password, Kafka secrets) never reach spark-submit's command
line, whatever the master: the provider's real command builder is run and its output inspected."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk.exceptions import AirflowFailException

from kafka2pg.config import get_pipeline
from kafka2pg.exceptions import ConfigError, DatabaseUnavailableError, SparkUnavailableError
from kafka2pg.scratch import folder_name
from kafka2pg.stage_operator import StageOperator, pip_spark_home, standalone_masters

SECRET = "pw-8c1f0e-never-printed"
SERVICES = {
    "KAFKA2PG_DATABASE_URL": f"postgresql://runtime:{SECRET}@db:5432/warehouse",
    "KAFKA2PG_KAFKA_CONFIG": json.dumps(
        {
            "bootstrap.servers": "k1:9093",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "runner",
            "sasl.password": SECRET,
        }
    ),
}


ORDERS = get_pipeline("orders", Path(__file__).resolve().parents[2] / "dags" / "pipelines.yaml")


class FakeSettings:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def to_env(self) -> dict[str, str]:
        return dict(SERVICES)


@pytest.fixture
def submitted(monkeypatch, tmp_path):
    """What `submit` would run: the command line and the environment spark-submit would get, and
    the scratch folders there were while it ran."""
    seen: dict = {}

    def submit(hook: SparkSubmitHook, application: str = "", **kwargs) -> None:
        seen["command"] = shlex.join(hook._build_spark_submit_command(application))
        seen["env"] = {**os.environ, **(hook._env or {})}
        seen["scratch"] = sorted((tmp_path / "spark" / "scratch").iterdir())

    monkeypatch.setattr(SparkSubmitHook, "submit", submit)
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
    for name in SERVICES:
        monkeypatch.delenv(name, raising=False)
    # A standalone master named here (spark://spark-master) answers: its check is tested below.
    monkeypatch.setattr("kafka2pg.stage_operator.socket.create_connection", lambda address, timeout: nullcontext())
    return seen


def stage_operator(**operator_args) -> StageOperator:
    return StageOperator(
        pipeline_name="orders",
        pipelines_file="/nonexistent/pipelines.yaml",
        task_id="read_and_stage",
        application="/opt/kafka2pg/jobs/stage_batch.py",
        conn_id="kafka2pg_spark",
        **operator_args,
    )


def run_stage(monkeypatch, spark_connection: dict, **operator_args) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_SPARK", json.dumps({"conn_type": "spark", **spark_connection}))
    stage_operator(env_vars={"TZ": "UTC"}, **operator_args).execute({})


@pytest.mark.parametrize(
    "connection",
    [
        {"host": "local[2]"},
        {"host": "spark://spark-master", "port": 7077},
        {"host": "yarn"},
        {"host": "yarn", "extra": {"deploy-mode": "client"}},
    ],
    ids=["local", "standalone", "yarn", "yarn-client"],
)
def test_services_reach_the_job_by_environment_not_command_line(monkeypatch, submitted, connection):
    run_stage(monkeypatch, connection)
    assert SECRET not in submitted["command"], submitted["command"]
    assert "KAFKA2PG_" not in submitted["command"]
    assert {name: submitted["env"].get(name) for name in SERVICES} == SERVICES
    assert submitted["env"]["TZ"] == "UTC" or "TZ" in submitted["command"]
    # Nothing left behind in the task's own environment.
    assert not any(name in os.environ for name in SERVICES)


def test_spark_submits_jvm_keeps_its_temporary_files_in_the_tasks_scratch_folder(monkeypatch, submitted, tmp_path):
    """Not in /tmp, where a JVM killed outright leaves them (lz4's native library, Spark's
    folders): the folder goes when the task ends, or with the next job's sweep if it is killed."""
    run_stage(monkeypatch, {"host": "local[2]"}, conf={"spark.driver.extraJavaOptions": "-Xmn24m"})
    (scratch,) = submitted["scratch"]
    assert scratch.name == folder_name(os.getpid())
    assert f"spark.driver.extraJavaOptions=-Xmn24m -Djava.io.tmpdir={scratch}" in submitted["command"]
    assert not scratch.exists()
    # A folder the conf names already is left alone.
    run_stage(monkeypatch, {"host": "local[2]"}, conf={"spark.driver.extraJavaOptions": "-Djava.io.tmpdir=/big"})
    assert "--conf spark.driver.extraJavaOptions=-Djava.io.tmpdir=/big --name" in submitted["command"]


def test_a_remote_driver_on_yarn_is_refused_before_submit(monkeypatch, submitted):
    with pytest.raises(AirflowFailException, match="deploy mode 'client'"):
        run_stage(monkeypatch, {"host": "yarn", "extra": {"deploy-mode": "cluster"}})
    assert submitted == {}


@pytest.mark.parametrize(
    "connection",
    [
        {"host": "spark://spark-master", "port": 7077, "extra": {"deploy-mode": "cluster"}},
        {"host": "local[2]", "extra": {"deploy-mode": "cluster"}},
    ],
    ids=["standalone", "local"],
)
def test_cluster_deploy_mode_outside_yarn_and_kubernetes_is_refused_before_submit(monkeypatch, submitted, connection):
    """The provider would raise a plain AirflowException ("env_vars is not supported in
    standalone-cluster mode") on every attempt: refused once, without retry, saying what to set."""
    with pytest.raises(AirflowFailException) as raised:
        run_stage(monkeypatch, connection)
    error = raised.value.__cause__
    assert isinstance(error, ConfigError) and error.terminal
    assert error.deploy_mode == "cluster" and error.master.startswith(connection["host"])
    assert "use deploy mode 'client'" in str(error)
    assert "remove 'deploy-mode' from the extra of connection 'kafka2pg_spark', or set it to 'client'" in str(error)
    assert submitted == {}


@pytest.mark.parametrize("master", ["local[2]", "yarn"])
def test_the_conf_the_provider_adds_at_execute_reaches_spark_submit(monkeypatch, submitted, master):
    """OpenLineage's parent-job conf is added by the provider in `execute`, after kafka2pg read the master."""
    monkeypatch.setattr(
        "airflow.providers.apache.spark.operators.spark_submit.inject_parent_job_information_into_spark_properties",
        lambda conf, context: {**conf, "spark.openlineage.parentJobName": "kafka2pg_orders.read_and_stage"},
    )
    run_stage(monkeypatch, {"host": master}, openlineage_inject_parent_job_info=True)
    assert "spark.openlineage.parentJobName=kafka2pg_orders.read_and_stage" in submitted["command"]
    assert SECRET not in submitted["command"]


def test_a_missing_spark_connection_fails_before_submit_unless_yarn_is_configured(monkeypatch, submitted, tmp_path):
    for name in ("AIRFLOW_CONN_KAFKA2PG_SPARK", "HADOOP_CONF_DIR", "YARN_CONF_DIR", "SPARK_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    operator = stage_operator()
    with pytest.raises(AirflowFailException, match="'kafka2pg_spark'.* is not defined.*AIRFLOW_CONN_KAFKA2PG_SPARK"):
        operator.execute({})
    assert submitted == {}

    (tmp_path / "spark-env.sh").write_text("export HADOOP_CONF_DIR=/etc/hadoop/conf\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # spark-submit sources it: YARN may work
    operator.execute({})
    assert "--master yarn" in submitted["command"]

    submitted.clear()
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("HADOOP_CONF_DIR", "/etc/hadoop/conf")  # the provider's default, YARN, can work
    operator.execute({})
    assert "--master yarn" in submitted["command"]


@pytest.fixture
def spark_submit_on_path(monkeypatch, tmp_path):
    """`spark_submit_on_path(script)`: a `spark-submit` first on PATH that runs `script` (sh),
    for the provider's real submit; the pipeline's services resolved to stand-ins."""
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    def place(script: str) -> None:
        binary = tmp_path / "spark-submit"
        binary.write_text(f"#!/bin/sh\n{script}\n")
        binary.chmod(0o755)

    return place


def test_a_spark_submit_killed_by_a_signal_fails_the_task_saying_what_it_means(monkeypatch, spark_submit_on_path):
    """The job's Python driver's own error goes out through spark-submit's JVM: a JVM killed (the
    OOM killer, kill -9) leaves only the provider's "Cannot execute … Error code is: -9"."""
    from airflow.providers.common.compat.sdk import AirflowException

    from kafka2pg.exceptions import SparkSessionLost

    spark_submit_on_path('echo "reading 30000 offsets"; kill -9 $$')
    with pytest.raises(SparkSessionLost) as raised:
        run_stage(monkeypatch, {"host": "local[2]"})
    assert raised.value.signal == "SIGKILL" and not raised.value.terminal
    assert "spark-submit (Spark's JVM) was killed (SIGKILL: the kernel's out-of-memory killer" in str(raised.value)
    assert "Airflow's retry of the task goes on from there" in str(raised.value)
    assert "reading 30000 offsets" in str(raised.value.__cause__), "the provider's own account stays chained"

    spark_submit_on_path("kill -SEGV $$")
    with pytest.raises(SparkSessionLost, match="was ended by SIGSEGV"):
        run_stage(monkeypatch, {"host": "local[2]"})

    spark_submit_on_path("echo failed; exit 1")  # the job's own failure: its error is in its output
    with pytest.raises(AirflowException, match="Cannot execute") as raised:
        run_stage(monkeypatch, {"host": "local[2]"})
    assert not isinstance(raised.value, SparkSessionLost)


def test_a_spark_submit_that_airflow_itself_stopped_is_not_reported_as_killed(monkeypatch, spark_submit_on_path):
    from airflow.providers.common.compat.sdk import AirflowException

    from kafka2pg.exceptions import SparkSessionLost

    spark_submit_on_path("kill -9 $$")
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_SPARK", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    operator = stage_operator()
    operator._stopping = True  # as on_kill leaves it
    with pytest.raises(AirflowException, match="Cannot execute") as raised:
        operator.execute({})
    assert not isinstance(raised.value, SparkSessionLost)


@pytest.fixture
def pip_installed_spark(tmp_path, monkeypatch):
    """A pyspark-like bin folder on PATH (a spark-submit and the find_spark_home.py beside it,
    which prints the home it finds) and this test's Python under a path with a space."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "spark-submit").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "spark-submit").chmod(0o755)
    (bin_dir / "find_spark_home.py").write_text("import sys\nprint('/opt/found home/pyspark:' + sys.executable)\n")
    spaced = tmp_path / "My Airflow" / "python"
    spaced.parent.mkdir()
    spaced.symlink_to(sys.executable)
    monkeypatch.delenv("SPARK_HOME", raising=False)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("PYSPARK_DRIVER_PYTHON", str(spaced))
    return spaced


@pytest.mark.parametrize("connection", [{"host": "local[2]"}, {"host": "yarn"}], ids=["local", "yarn"])
def test_a_python_whose_path_has_a_space_gets_spark_submit_its_spark_home(
    monkeypatch, submitted, pip_installed_spark, connection
):
    """pyspark's find-spark-home runs $PYSPARK_DRIVER_PYTHON unquoted: the task runs its script
    with that Python, quoted, and hands spark-submit the home it prints."""
    run_stage(monkeypatch, connection)
    assert submitted["env"]["SPARK_HOME"] == f"/opt/found home/pyspark:{pip_installed_spark}"
    assert "SPARK_HOME" not in os.environ  # not left in the task's own environment


def test_spark_home_is_left_to_spark_submit_unless_its_script_would_fail(monkeypatch, pip_installed_spark, tmp_path):
    environ = dict(os.environ)
    assert pip_spark_home("spark-submit", environ) == f"/opt/found home/pyspark:{pip_installed_spark}"
    assert pip_spark_home("spark-submit", {**environ, "SPARK_HOME": "/opt/spark"}) is None
    assert pip_spark_home("spark-submit", {**environ, "PYSPARK_DRIVER_PYTHON": sys.executable}) is None
    # Without PYSPARK_DRIVER_PYTHON, PYSPARK_PYTHON, as pyspark's script takes it.
    fallback = {k: v for k, v in environ.items() if k != "PYSPARK_DRIVER_PYTHON"}
    assert pip_spark_home("spark-submit", {**fallback, "PYSPARK_PYTHON": str(pip_installed_spark)}) == (
        f"/opt/found home/pyspark:{pip_installed_spark}"
    )
    # A command with arguments is what the script runs, unquoted, as it should.
    assert pip_spark_home("spark-submit", {**environ, "PYSPARK_DRIVER_PYTHON": "/usr/bin/env python3"}) is None
    # A Spark distribution's spark-submit (no find_spark_home.py beside it) finds its home by its place.
    (tmp_path / "venv" / "bin" / "find_spark_home.py").unlink()
    assert pip_spark_home("spark-submit", environ) is None


def test_spark_home_is_left_to_spark_submit_when_finding_it_fails(monkeypatch, pip_installed_spark, tmp_path, caplog):
    """Whatever goes wrong while finding the home leaves spark-submit to try (and say why)."""
    environ = dict(os.environ)
    script = tmp_path / "venv" / "bin" / "find_spark_home.py"
    script.write_text("import sys\nprint('/half/found')\nsys.exit('no pyspark here')\n")
    assert pip_spark_home("spark-submit", environ) is None  # the script fails
    script.write_text("pass\n")
    assert pip_spark_home("spark-submit", environ) is None  # it prints no home
    missing = str(tmp_path / "My Airflow" / "gone" / "python")
    assert pip_spark_home("spark-submit", {**environ, "PYSPARK_DRIVER_PYTHON": missing}) is None
    unrunnable = tmp_path / "My Airflow" / "not a program"
    unrunnable.write_bytes(b"\x7fELF garbage")
    unrunnable.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="kafka2pg"):
        assert pip_spark_home("spark-submit", {**environ, "PYSPARK_DRIVER_PYTHON": str(unrunnable)}) is None
    assert "finding SPARK_HOME with" in caplog.text and "spark-submit tries it itself" in caplog.text


@pytest.mark.parametrize(("code", "retried"), [(3, False), (2, True), (1, True)])
def test_a_stage_job_that_exits_with_a_terminal_error_fails_the_task_without_a_retry(
    monkeypatch, tmp_path, code, retried
):
    """The job exits 3 for an error a retry cannot mend (a rejected batch, a configuration
    error): the task fails as Airflow's terminal failure, not retried; others stay retryable."""
    from airflow.providers.common.compat.sdk import AirflowException

    class Finished:
        returncode = code

    def submit(hook: SparkSubmitHook, application: str = "", **kwargs) -> None:
        hook._submit_sp = Finished()
        raise AirflowException(f"Cannot execute: spark-submit. Error code is: {code}.")

    monkeypatch.setattr(SparkSubmitHook, "submit", submit)
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
    with pytest.raises(AirflowException) as failed:
        run_stage(monkeypatch, {"host": "local[2]"})
    assert isinstance(failed.value, AirflowFailException) is not retried
    if not retried:
        assert "a retry of this task cannot mend" in str(failed.value)


def test_the_stage_job_exits_3_for_a_terminal_error_and_2_for_a_retryable_one(monkeypatch, capsys):
    from kafka2pg import runner, stage_job
    from kafka2pg.exceptions import ConfigError, DatabaseUnavailableError

    for error, code in ((ConfigError("bad column"), 3), (DatabaseUnavailableError("db down"), 2)):

        def fails(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(runner, "run_job", fails)
        assert stage_job.main(["--pipeline", "orders", "--batch-id", "1"]) == code
        assert f"kafka2pg stage failed: {error}" in capsys.readouterr().err


def test_the_jars_and_jvm_options_are_the_workers_decided_when_the_task_runs(monkeypatch, submitted, tmp_path):
    """Not where the DAG file was parsed: a dag-processor without resolved jars (or with them)
    must not decide for the worker, nor its java the class-data archive's path."""
    import dataclasses

    from kafka2pg.config import STAGE_JVM_OPTIONS_C1, STAGE_JVM_OPTIONS_LIBRDKAFKA, STAGE_JVM_OPTIONS_TIERED

    spark_reader = dataclasses.replace(ORDERS, kafka_reader="spark")
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), spark_reader))
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("KAFKA2PG_SPARK_JARS", "/opt/worker/jars/*.jar")
    run_stage(monkeypatch, {"host": "local[2]"}, application_args=["--pipeline", "orders", "--batches", "3"])
    assert "--jars '/opt/worker/jars/*.jar'" in submitted["command"]
    assert STAGE_JVM_OPTIONS_TIERED in submitted["command"]  # several batches through Spark's source
    monkeypatch.delenv("KAFKA2PG_SPARK_JARS")
    run_stage(monkeypatch, {"host": "local[2]"}, application_args=["--pipeline", "orders", "--batches", "1"])
    assert "spark.jars.packages=org.apache.spark:spark-sql-kafka-0-10_2.13:" in submitted["command"]
    assert "--jars" not in submitted["command"] and STAGE_JVM_OPTIONS_C1 in submitted["command"]
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
    run_stage(monkeypatch, {"host": "local[2]"})  # the librdkafka reader: no jars at all
    assert "--jars" not in submitted["command"] and "spark.jars.packages" not in submitted["command"]
    assert STAGE_JVM_OPTIONS_LIBRDKAFKA in submitted["command"]


def test_a_stage_task_timing_out_stops_the_job_then_records_the_timeout_as_the_batchs_stage_failure(
    monkeypatch, tmp_path
):
    """Airflow's execution_timeout raises AirflowTaskTimeout (no Exception) in the task while
    spark-submit runs: the job is stopped first, then the timeout is the batch's stage failure
    (the job's driver, stopped by SIGTERM, records nothing), and the timeout goes on to Airflow."""
    from airflow.sdk.exceptions import AirflowTaskTimeout

    events = []

    class Running:
        returncode = None

        def poll(self):
            return self.returncode

        def kill(self):  # the provider's on_kill, after ours
            events.append("provider kill")
            self.returncode = -9

        def wait(self, timeout=None):
            return self.returncode

    def submit(hook: SparkSubmitHook, application: str = "", **kwargs) -> None:
        hook._submit_sp = Running()
        raise AirflowTaskTimeout("Timeout, PID: 4242")

    monkeypatch.setattr(SparkSubmitHook, "submit", submit)
    monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
    monkeypatch.setattr("kafka2pg.stage_operator.stop_job", lambda process, application, grace: events.append("stop"))
    monkeypatch.setattr(
        "kafka2pg.stuck.record_failure",
        lambda settings, pipeline, batch_id, epoch, step, exc: events.append((pipeline, batch_id, epoch, step, exc)),
    )
    held = {"run-9": (9, 2)}  # batches 7 and 8 promoted; 9 open (10, its lookahead, after it)
    monkeypatch.setattr("kafka2pg.stuck.oldest_open_batch", lambda settings, pipeline, run_id: held.get(run_id))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_SPARK", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    first = ["--pipeline", "orders", "--batch-id", "7", "--epoch", "3", "--run-id", "run-9"]
    operator = stage_operator(application_args=first)
    with pytest.raises(AirflowTaskTimeout) as raised:
        operator.execute({})
    assert events[0] == "stop" and events[-1] == ("orders", 7, 3, "stage", raised.value), events
    assert operator._stopping

    # A job of several batches: the oldest its run still holds open is where it stopped.
    events.clear()
    with pytest.raises(AirflowTaskTimeout) as raised:
        stage_operator(application_args=[*first, "--batches", "5"]).execute({})
    assert events[0] == "stop" and events[-1] == ("orders", 9, 2, "stage", raised.value), events
    events.clear()  # the run holds none open (all promoted as it was stopped): nothing to record
    with pytest.raises(AirflowTaskTimeout):
        stage_operator(application_args=[*first[:-1], "run-8", "--batches", "5"]).execute({})
    assert events[0] == "stop" and not [e for e in events if isinstance(e, tuple)], events


def test_the_masters_a_standalone_url_names():
    assert standalone_masters("spark://m1:7077,m2:7078") == [("m1", 7077), ("m2", 7078)]
    assert standalone_masters("spark://master") == [("master", 7077)]
    assert standalone_masters("spark://[::1]:7079") == [("::1", 7079)]
    assert standalone_masters("local[2]") == standalone_masters("yarn") == standalone_masters("k8s://https://a") == []


def test_a_standalone_master_that_accepts_no_connection_fails_the_task_at_once_recording_the_batchs_failure(
    monkeypatch, tmp_path
):
    """spark-submit would retry registering with a master nobody answers at for about a minute on
    every try, then end in a Java trace: checked before it, retried, the failure on the batch."""
    with socket.socket() as listening:  # a port just freed: nothing listens there
        listening.bind(("127.0.0.1", 0))
        free = listening.getsockname()[1]
    with socket.socket() as answering:
        answering.bind(("127.0.0.1", 0))
        answering.listen()
        standby = answering.getsockname()[1]
        submits, recorded = [], []
        monkeypatch.setattr(SparkSubmitHook, "submit", lambda hook, application="", **kwargs: submits.append(hook))
        monkeypatch.setattr("kafka2pg.tasks.resolve", lambda name, path: (FakeSettings(tmp_path), ORDERS))
        monkeypatch.setattr(
            "kafka2pg.stuck.record_failure",
            lambda settings, pipeline, batch_id, epoch, step, exc: recorded.append((pipeline, batch_id, epoch, step)),
        )
        args = {"application_args": ["--pipeline", "orders", "--batch-id", "7", "--epoch", "3"]}
        with pytest.raises(SparkUnavailableError) as raised:
            run_stage(monkeypatch, {"host": "spark://127.0.0.1", "port": free}, **args)
        assert submits == [] and recorded == [("orders", 7, 3, "stage")]
        assert not raised.value.terminal  # Airflow retries it
        assert str(raised.value).startswith(
            f"pipeline 'orders': no Spark master of 'spark://127.0.0.1:{free}' accepts a connection "
            f"(127.0.0.1:{free}: Connection refused). Check that the master runs and that connection "
            "'kafka2pg_spark' (the stage job's Spark master: its host and port) names it."
        )

        # A job of several batches, PostgreSQL down too: which batch the run holds is unknown, so
        # nothing is recorded, and the task still fails with the master's error.
        def database_down(settings, pipeline, run_id):
            raise DatabaseUnavailableError("PostgreSQL is down")

        monkeypatch.setattr("kafka2pg.stuck.oldest_open_batch", database_down)
        several = {"application_args": [*args["application_args"], "--run-id", "run-1", "--batches", "5"]}
        with pytest.raises(SparkUnavailableError):
            run_stage(monkeypatch, {"host": "spark://127.0.0.1", "port": free}, **several)
        assert submits == [] and recorded == [("orders", 7, 3, "stage")]
        # One master of several answering (a standby set-up) is enough.
        recorded.clear()
        run_stage(monkeypatch, {"host": f"spark://127.0.0.1:{free},127.0.0.1", "port": standby}, **args)
        assert len(submits) == 1 and recorded == []


def test_a_spark_session_that_cannot_start_is_recorded_as_the_batchs_stage_failure(monkeypatch, tmp_path):
    """The job's session start failing (a master giving up, a spark_conf Spark refuses) counts
    towards STUCK like a failed read: it used to leave no failure on the batch."""
    from kafka2pg import runner

    recorded = []
    refused = RuntimeError("Invalid initial heap size: -Xms1x")

    def no_session(*args, **kwargs):
        raise refused

    monkeypatch.setattr(runner, "spark_session", no_session)
    monkeypatch.setattr(
        "kafka2pg.stuck.record_failure",
        lambda settings, pipeline, batch_id, epoch, step, exc: recorded.append((pipeline, batch_id, epoch, step, exc)),
    )
    with pytest.raises(RuntimeError):
        runner._run_in_session(FakeSettings(tmp_path), ORDERS, 7, 3, 1, "run-1", None)
    assert recorded == [("orders", 7, 3, "stage", refused)]
    # A retry of a job of several batches whose planned batch an earlier attempt promoted: the
    # failure belongs to the oldest batch the run still holds open.
    recorded.clear()
    monkeypatch.setattr("kafka2pg.stuck.oldest_open_batch", lambda settings, pipeline, run_id: (9, 2))
    with pytest.raises(RuntimeError):
        runner._run_in_session(FakeSettings(tmp_path), ORDERS, 7, 3, 5, "run-1", None)
    assert recorded == [("orders", 9, 2, "stage", refused)]
