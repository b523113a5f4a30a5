"""The read_and_stage task: spark-submit of the stage job, with the pipeline's services resolved
from its Airflow Connections at run time and handed to the job in its environment.

Imported by the DAG factory when it builds a DAG (the spark provider is an Airflow import anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from kafka2pg.config import Pipeline, keep_log_options, secret_setting, stage_jvm_options
from kafka2pg.exceptions import TERMINAL_EXIT, ConfigError, SparkSessionLost, SparkUnavailableError, is_task_timeout
from kafka2pg.jars import spark_kafka_source

log = logging.getLogger(__name__)


def spark_submit_conf(pipeline: Pipeline, batches: int) -> tuple[str | None, dict[str, str]]:
    """spark-submit's `--jars` and `--conf` for a stage job of `pipeline` that may finish
    `batches` batches, from what this host has: the driver JVM's options (the JIT for the reader
    and the batches, the class-data archive set-up made for this java, kafka2pg's log4j2 file
    unless the pipeline's spark_conf names its own) and, for `kafka_reader: spark`, Spark's Kafka
    source (the jars set-up resolved, KAFKA2PG_SPARK_JARS, or `spark.jars.packages`). kafka2pg's
    Spark defaults are applied by the job's session (staging.SPARK_DEFAULTS); JVM options and
    packages only work on spark-submit's command line; settings named as secrets stay off it."""
    level = pipeline.spark_log_level
    jvm_options = stage_jvm_options(batches, log_level=level, kafka_reader=pipeline.kafka_reader)
    # Only Spark's Kafka source needs jars: the librdkafka reader is Python, shipped with the package.
    jars, source_conf = spark_kafka_source() if pipeline.kafka_reader == "spark" else (None, {})
    # Not the settings named as secrets: spark-submit's command line shows in `ps` and in the task
    # log's submit line; the job's session (staging.spark_session) gives them to Spark before its
    # context starts, which is when Spark reads them.
    own = {k: v for k, v in keep_log_options(pipeline.spark_conf, level).items() if not secret_setting(k)}
    conf = {"spark.driver.extraJavaOptions": jvm_options, **source_conf, **own}
    return jars, conf


class StageOperator(SparkSubmitOperator):
    """SparkSubmitOperator whose job reads the pipeline's services from its environment.

    The connections are looked up in `execute` (in the task, with Airflow's own lookup), not at
    DAG-parse time, and never go into a templated field: Airflow would keep rendered fields in
    its database and show them in the UI. The job (kafka2pg.runner) builds its Settings from its
    environment (`Settings.from_env`); that environment, which holds the database password and
    any Kafka secret, never goes on spark-submit's command line:

    - local and standalone masters: the provider hands `env_vars` to spark-submit's process;
    - YARN and Kubernetes masters, client deploy mode: the provider would turn `env_vars` into
      `--conf spark.yarn.appMasterEnv.*` / `spark.kubernetes.driverEnv.*` (visible in `ps` and in
      the submit line of the log), so the services go into this task's own environment instead,
      which spark-submit and the driver it starts here inherit, and are taken out after;
    - cluster deploy mode on YARN or Kubernetes (a remote driver) is refused: the only way the
      provider offers to reach a remote driver is that command line;
    - cluster deploy mode on any other master (a standalone `spark://` one) is refused too: the
      provider has no way at all to hand that driver an environment (it raises "env_vars is not
      supported in standalone-cluster mode", which Airflow would retry), and Spark standalone
      starts no Python driver in cluster mode anyway.
    """

    def __init__(self, *, pipeline_name: str, pipelines_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_name = pipeline_name
        self.pipelines_file = pipelines_file
        self._stopping = False  # on_kill was called: Airflow stops the task
        self._spark_dir: Path | None = None  # the state dir's spark folder, where the JVM's temporary files go
        self._settings: Any = None  # the pipeline's services, once resolved

    def execute(self, context: Any) -> None:
        from kafka2pg.tasks import airflow_errors, resolve

        with airflow_errors():
            settings, pipeline = resolve(self.pipeline_name, self.pipelines_file)
            self._settings = settings
            services = settings.to_env()
            # Decided here, on the worker, not where the DAG file was parsed: its jars, its
            # class-data archive (keyed on its java), its state directory.
            jars, conf = spark_submit_conf(pipeline, self._batches())
            self.jars = self.jars or jars
            self.conf = {**conf, **(self.conf or {})}
            self._spark_dir = settings.state_dir / "spark"
            # Only to read the master: the provider builds the submitting hook itself, after it
            # added its own conf (OpenLineage), with what this method sets.
            probe = self._get_hook()
            master, deploy_mode = probe._connection["master"], probe._connection["deploy_mode"]
            self._require_connection(probe, master)
            if deploy_mode == "cluster" and not remote_env_master(master):
                raise ConfigError(
                    f"Spark master {master!r} with deploy mode 'cluster': the spark provider refuses to hand "
                    "a driver started there the pipeline's services (\"env_vars is not supported in "
                    'standalone-cluster mode"), and Spark standalone starts no Python driver in cluster mode '
                    "anyway; use deploy mode 'client' "
                    "(the driver runs in this task, executors on the cluster): remove 'deploy-mode' from the extra "
                    f"of connection {self._conn_id!r}, or set it to 'client'",
                    master=master,
                    deploy_mode=deploy_mode,
                )
            if not remote_env_master(master):
                self._require_master(master)
                self.env_vars = {**(self.env_vars or {}), **services, **self._spark_home(probe, self.env_vars)}
                return self._submit(context)  # the provider builds its hook with these env_vars
            if deploy_mode == "cluster":
                raise ConfigError(
                    f"Spark master {master!r} with deploy mode 'cluster': the stage job's driver would run "
                    "remotely and the spark provider can hand it the pipeline's services (the database "
                    "password, Kafka secrets) only on spark-submit's command line; use deploy mode 'client' "
                    "(the driver runs in this task, executors on the cluster)",
                    master=master,
                    deploy_mode=deploy_mode,
                )
            # spark-submit runs with this task's environment (the provider puts env_vars on the
            # command line for these masters).
            services.update(self._spark_home(probe, {}))
        with _environment(services):
            return self._submit(context)

    def _batches(self) -> int:
        """The batches this job may finish (`--batches`, rendered from the plan's XCom; 1 without)."""
        return self._int_arg("--batches") or 1

    def _int_arg(self, name: str) -> int | None:
        """A job argument's value as rendered from the plan's XCom (None: not given)."""
        try:
            return int(self._arg(name) or "")
        except ValueError:
            return None

    def _arg(self, name: str) -> str | None:
        """A job argument's value as rendered (None: not given)."""
        args = [str(a) for a in self.application_args or []]
        try:
            return args[args.index(name) + 1]
        except (ValueError, IndexError):
            return None

    def _spark_home(self, hook: Any, env_vars: dict[str, str] | None) -> dict[str, str]:
        """SPARK_HOME for spark-submit, where pyspark's own script cannot find it (`pip_spark_home`)."""
        home = pip_spark_home(hook._connection["spark_binary"], {**os.environ, **(env_vars or {})})
        return {"SPARK_HOME": home} if home else {}

    def _submit(self, context: Any) -> None:
        """The provider's spark-submit; one that a signal ended (the stage job's Python driver's
        output, with its own error, goes through the JVM and ends with it) fails the task with
        `SparkSessionLost` (retried) saying what that means for the pipeline's batches, instead
        of only the provider's "Cannot execute" and the signal's number. Not when Airflow stops
        the task (`on_kill`): its own kill is no news."""
        from airflow.providers.common.compat.sdk import AirflowException

        from kafka2pg.scratch import job_scratch

        try:
            with job_scratch(self._spark_dir) as scratch:
                self._temporary_files_in(scratch)
                try:
                    return super().execute(context)
                except BaseException as exc:  # the job stopped while its scratch folder is still there
                    if is_task_timeout(exc):
                        self._interrupted(exc)
                    raise
        except AirflowException as exc:
            process = getattr(self._hook, "_submit_sp", None) if self._hook is not None else None
            code = getattr(process, "returncode", None)
            failed = str(exc).startswith("Cannot execute")  # the provider's own: not Airflow stopping the task
            if failed and not self._stopping and code == TERMINAL_EXIT:
                from airflow.sdk.exceptions import AirflowFailException

                raise AirflowFailException(
                    f"pipeline {self.pipeline_name!r}: the stage job failed with an error a retry of this task cannot "
                    "mend (`kafka2pg stage failed: …` in the log above says what to do); not retried"
                ) from exc
            if not failed or self._stopping or not isinstance(code, int) or code >= 0:
                raise
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            raise SparkSessionLost.submit_killed(self.pipeline_name, name) from exc

    def _interrupted(self, exc: BaseException) -> None:
        """The task interrupted (its execution_timeout): the job is stopped now (its driver gets
        SIGTERM and exits 143 recording nothing: it cannot tell a timeout from a hand stopping the
        task), then the timeout is recorded as the batch's stage failure, so a stage that times
        out run after run makes the batch STUCK. A job of several batches (`batches_per_run`)
        records it on the oldest batch its run still holds open: the one it stopped at (a job
        that moves on before its next timeout is not stuck). Airflow's own on_kill follows and
        returns at once. Whatever goes wrong here is logged: the timeout stands."""
        try:
            self.on_kill()
            self._record_failure(exc)
        except Exception:
            log.exception("pipeline=%s: could not stop or record the timed-out stage job", self.pipeline_name)

    def _record_failure(self, exc: BaseException) -> None:
        """`exc` as the stage failure of the batch the job works on (`stuck.job_batch`)."""
        from kafka2pg import stuck

        if self._settings is None:
            return
        batch_id, epoch, run_id = self._int_arg("--batch-id"), self._int_arg("--epoch"), self._arg("--run-id")
        held = stuck.job_batch(self._settings, self.pipeline_name, batch_id, epoch, run_id, self._batches())
        if held is not None:
            stuck.record_failure(self._settings, self.pipeline_name, *held, "stage", exc)

    def _temporary_files_in(self, scratch: Path) -> None:
        """spark-submit's JVM (the job's driver) keeps its temporary files (lz4's native library,
        Spark's temporary folders) in this task's scratch folder instead of /tmp, unless the conf
        names a folder: a JVM killed outright cannot delete them, and the next job's sweep removes
        the folder of a task that is gone (kafka2pg.scratch)."""
        from kafka2pg.scratch import jvm_temporary_files_in

        self.conf = jvm_temporary_files_in(dict(self.conf or {}), scratch)

    def _require_connection(self, hook: Any, master: str) -> None:
        """Without its connection the provider sends the job to YARN, where spark-submit fails
        unless a Hadoop configuration is there, after its JVM started and on every retry. A
        spark-env.sh (which spark-submit sources, and may set HADOOP_CONF_DIR) is given the benefit
        of the doubt."""
        if master != "yarn" or os.environ.get("HADOOP_CONF_DIR") or os.environ.get("YARN_CONF_DIR"):
            return
        conf_dirs = [
            os.environ.get("SPARK_CONF_DIR"),
            os.environ.get("SPARK_HOME") and f"{os.environ['SPARK_HOME']}/conf",
        ]
        if any(d and Path(d, "spark-env.sh").is_file() for d in conf_dirs):
            return
        from airflow.providers.common.compat.sdk import AirflowException

        try:
            hook.get_connection(self._conn_id)
        except AirflowException:  # as the provider catches it before defaulting to YARN
            raise ConfigError(
                f"Airflow connection {self._conn_id!r} (the Spark master of the stage job) is not defined, so "
                "spark-submit would send the job to YARN, and neither HADOOP_CONF_DIR nor YARN_CONF_DIR is set: "
                f'define it, e.g. AIRFLOW_CONN_{self._conn_id.upper()}=\'{{"conn_type": "spark", "host": '
                '"local[2]"}\' or a spark://host:7077 master (README, Connections)',
                conn_id=self._conn_id,
            ) from None

    def _require_master(self, master: str) -> None:
        """A standalone master (`spark://host:port`, several comma-separated for standby masters)
        none of which accepts a TCP connection: `SparkUnavailableError` (retried), recorded as the
        batch's stage failure, instead of a spark-submit whose driver retries registering for about
        a minute on every try and ends with a Java trace and the provider's "Cannot execute"."""
        addresses = standalone_masters(master)
        if not addresses:
            return
        refused = []
        for host, port in addresses:
            try:
                with socket.create_connection((host, port), timeout=MASTER_CONNECT_TIMEOUT_S):
                    return
            except OSError as exc:
                shown = f"[{host}]" if ":" in host else host  # an IPv6 address
                refused.append(f"{shown}:{port}: {exc.strerror or exc}")
        error = SparkUnavailableError(
            f"pipeline {self.pipeline_name!r}: no Spark master of {master!r} accepts a connection "
            f"({'; '.join(refused)}). Check that the master runs and that connection {self._conn_id!r} (the "
            "stage job's Spark master: its host and port) names it. Nothing was read; the batch stays planned "
            "and the retry (or the next run) stages it.",
            master=master,
            conn_id=self._conn_id,
        )
        self._record_failure(error)
        raise error

    def on_kill(self) -> None:
        """Airflow stopping the task (marked failed or success by hand, a timeout, a worker shutting
        down). The job's Python driver gets SIGTERM first (it cancels Spark's jobs and exits 143,
        the batch left as it was; not a failure of the batch, but a timeout is: `_interrupted`);
        the provider's SIGKILL follows if spark-submit is still there after `STOP_GRACE_S` (a
        driver left without its JVM then fails on its next call into Spark and records that)."""
        if self._stopping:  # Airflow's call after ours (`_interrupted`): the job is stopped
            return
        self._stopping = True
        process = getattr(self._hook, "_submit_sp", None) if self._hook is not None else None
        if process is not None and process.poll() is None:
            stop_job(process, str(self.application), STOP_GRACE_S)
        super().on_kill()


# The longest on_kill waits for spark-submit to exit after the driver's SIGTERM. Airflow 3's task
# supervisor, stopping a task, signals its whole process group and sends SIGKILL 5 s after SIGTERM:
# then that comes first.
STOP_GRACE_S = 30.0


def stop_job(process: subprocess.Popen, application: str, grace_s: float) -> bool:
    """SIGTERM the processes under `process` that run `application` (the job's Python driver,
    a child of spark-submit's JVM in client mode) and wait up to `grace_s` for `process` to
    exit; True if it did. Linux (/proc); elsewhere it only waits.

    While it waits, spark-submit's output is read here and logged: the provider's reader is the
    task's main thread, held by the signal handler that called this, and a job that writes more
    than a pipe holds while it stops would otherwise block until the SIGKILL."""
    reader = None
    if process.stdout is not None:
        reader = threading.Thread(
            target=_log_output, args=(process.stdout.fileno(),), name="kafka2pg-stop-output", daemon=True
        )
        reader.start()
    for pid in _descendants(process.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if application.encode() in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        return False
    if reader is not None:
        reader.join(timeout=5)  # the rest of its output, up to the pipe's end
    return True


def _log_output(fd: int) -> None:
    """Log what spark-submit writes to `fd` until it closes it. Reads the descriptor itself: the
    provider's buffered reader is locked by the main thread's read that the signal interrupted."""
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop() if chunk else b""
        for line in lines:
            if line.strip():
                log.info("%s", line.decode(errors="replace").rstrip())
        if not chunk:
            return


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(entry.parent.name))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


# How long the stage task waits for a standalone master to accept a TCP connection.
MASTER_CONNECT_TIMEOUT_S = 10


def standalone_masters(master: str) -> list[tuple[str, int]]:
    """(host, port) of each master a `spark://` URL names (port 7077 unless given); [] for others."""
    if not master.startswith("spark://"):
        return []
    found = []
    for part in master.removeprefix("spark://").split(","):
        try:
            parsed = urlsplit(f"spark://{part.strip()}")
            port = parsed.port or 7077
        except ValueError:  # a port that is no number: spark-submit says so itself
            return []
        if parsed.hostname:
            found.append((parsed.hostname, port))
    return found


def remote_env_master(master: str) -> bool:
    """Masters for which the spark provider puts `env_vars` on the command line (its own test)."""
    return "yarn" in master or "k8s" in master


def pip_spark_home(spark_binary: str, environ: dict[str, str]) -> str | None:
    """The SPARK_HOME a pip-installed pyspark's spark-submit would find for itself, found here
    when its own script cannot: `find-spark-home` runs `$PYSPARK_DRIVER_PYTHON` (else
    `$PYSPARK_PYTHON`) unquoted, so a Python whose path has a space (a virtualenv under
    `/opt/My Airflow`) fails every submit with "No such file or directory". Then this runs the
    same `find_spark_home.py` beside that spark-submit with the same Python, quoted. None (leave
    spark-submit alone) when SPARK_HOME is set, the Python's path has no whitespace, the
    spark-submit is not pyspark's (a Spark distribution finds its home by its own location), or
    the script fails (spark-submit then says why)."""
    python = environ.get("PYSPARK_DRIVER_PYTHON") or environ.get("PYSPARK_PYTHON") or ""
    if environ.get("SPARK_HOME") or not any(c.isspace() for c in python):
        return None
    if not os.access(python, os.X_OK):  # a command with arguments (`/usr/bin/env python3`): the script runs it
        return None
    found = shutil.which(spark_binary, path=environ.get("PATH"))
    script = found and Path(found).parent / "find_spark_home.py"  # as find-spark-home names it: unresolved
    if not script or not script.is_file():
        return None
    try:
        done = subprocess.run(
            [python, str(script)], env=environ, capture_output=True, text=True, errors="replace", timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("finding SPARK_HOME with %s failed (%s): spark-submit tries it itself", python, exc)
        return None
    home = done.stdout.strip()
    if done.returncode or not home:
        return None
    log.info(
        "SPARK_HOME for spark-submit: %s (pyspark's own script cannot run %r, whose path has a space)", home, python
    )
    return home


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment for the block, the previous values back after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
