"""A Spark standalone cluster on 127.0.0.1: one master and N workers, each a JVM started by pyspark's
own `spark-class` on free ports, with its log in a file; stopped (or a worker killed) by PID, never by name.

The JVMs get a bare environment (no PYTHONPATH, no KAFKA2PG_* or AIRFLOW_* variables), as the
machines of a user's cluster would: what executors need must come with the job (its addPyFile, --jars).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from kafka2pg.devtools.processes import alive, free_ports, proc_stat, runs, stop_pid, tail
from kafka2pg.exceptions import StackError

# Of the launching process's environment, what a JVM on a worker machine would have anyway.
_INHERITED = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "JAVA_HOME")
_EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


@dataclass
class SparkWorker:
    pid: int
    webui_port: int
    work_dir: str  # the worker's --work-dir: one folder per application, one per executor in it
    log_file: str

    def running(self) -> bool:
        """True when the recorded PID is this worker's JVM."""
        return runs(self.pid, self.work_dir)


@dataclass
class SparkCluster:
    pid: int  # the master's
    port: int
    webui_port: int
    work_dir: str
    log_file: str
    workers: list[SparkWorker]
    cores: int
    memory: str
    # Executors of killed workers that were still running at the kill: stopped with the cluster.
    orphans: list[int] = field(default_factory=list)
    # The master's and workers' Spark properties (--properties-file): RPC authentication's secret.
    properties_file: str | None = None

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def connection(self) -> dict:
        """The cluster as an Airflow spark connection (JSON form of AIRFLOW_CONN_*): the provider
        builds the master URL from host and port (spark://127.0.0.1:PORT)."""
        return {"conn_type": "spark", "host": "spark://127.0.0.1", "port": self.port}

    def state(self, patience_s: float = 120) -> dict:
        """The master's JSON status page: workers, running and completed applications. A slow or
        failed answer is asked again until `patience_s` has passed (a loaded machine answers late)."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=10) as response:
                    return json.load(response)
            except (OSError, json.JSONDecodeError) as exc:  # URLError and timeouts are OSErrors
                if time.monotonic() > deadline:
                    raise StackError(f"the Spark master's status page at 127.0.0.1:{self.webui_port}: {exc}") from exc
            time.sleep(0.5)

    def alive_workers(self, state: dict | None = None) -> int:
        """How many of this cluster's workers the master lists as ALIVE (a killed one stays listed, DEAD)."""
        ours = {f"http://127.0.0.1:{w.webui_port}" for w in self.workers}
        workers = (state or self.state())["workers"]
        return sum(1 for w in workers if w["state"] == "ALIVE" and w["webuiaddress"] in ours)

    def applications(self, name_contains: str = "") -> list[dict]:
        """Running and completed applications whose name holds `name_contains`, as the master lists them."""
        state = self.state()
        return [a for a in state["activeapps"] + state["completedapps"] if name_contains in a["name"]]

    def executor_logs(self, app_id: str) -> dict[str, str]:
        """The stderr of each executor the workers ran for `app_id`, by its path."""
        return {
            str(path): path.read_text(errors="replace")
            for worker in self.workers
            for path in sorted(Path(worker.work_dir).glob(f"{app_id}/*/stderr"))
        }


def spark_home() -> Path:
    """pyspark's own Spark distribution (its bin/spark-class and jars/)."""
    spec = find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise StackError("pyspark is not installed in this Python: run through ./kafka2pg, which sets up the venv")
    return Path(spec.origin).parent


def _environment() -> dict[str, str]:
    return {
        **{k: os.environ[k] for k in _INHERITED if k in os.environ},
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",  # the machine's hostname may resolve to an address nothing listens on
        "SPARK_DAEMON_MEMORY": "256m",  # master and worker JVMs; executors get spark.executor.memory
    }


def _spark_class(main_class: str, args: list[str], log_file: Path, env: dict[str, str] | None = None) -> int:
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), main_class, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**_environment(), **(env or {})},
            start_new_session=True,
        )
    return process.pid  # spark-class execs the JVM: this is its PID


def _start_worker(cluster: SparkCluster, index: int) -> SparkWorker:
    (webui_port,) = free_ports(1)
    work_dir = Path(cluster.work_dir) / f"worker-{index}"
    work_dir.mkdir(parents=True, exist_ok=True)
    log_file = Path(cluster.work_dir) / f"worker-{index}.log"
    args = [cluster.master_url, "--host", "127.0.0.1", "--cores", str(cluster.cores), "--memory", cluster.memory]
    args += ["--work-dir", str(work_dir), "--webui-port", str(webui_port), *_properties(cluster)]
    # The executors' scratch folders (spark-<uuid>/executor-<uuid>) under the cluster's folder, not
    # /tmp: the worker makes them in its SPARK_LOCAL_DIRS and a killed executor leaves them behind.
    local_dirs = work_dir / "local"
    local_dirs.mkdir(exist_ok=True)
    pid = _spark_class("org.apache.spark.deploy.worker.Worker", args, log_file, {"SPARK_LOCAL_DIRS": str(local_dirs)})
    return SparkWorker(pid, webui_port, str(work_dir), str(log_file))


def _properties(cluster: SparkCluster) -> list[str]:
    return ["--properties-file", cluster.properties_file] if cluster.properties_file else []


def start_cluster(
    work_dir: Path,
    workers: int = 2,
    *,
    cores: int = 1,
    memory: str = "1g",
    timeout_s: float = 180,
    secret: str | None = None,
) -> SparkCluster:
    """Start a master and `workers` workers (`cores` and `memory` each) under `work_dir`; wait until
    the master lists every worker ALIVE. Stops whatever started if that does not happen in time.
    With `secret`, Spark's RPC authentication is on (`spark.authenticate`, in the daemons'
    properties file, readable by its owner only): an application must give the same secret."""
    work_dir.mkdir(parents=True, exist_ok=True)
    properties = None
    if secret is not None:
        properties = work_dir / "spark-daemons.conf"
        fd = os.open(properties, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"spark.authenticate true\nspark.authenticate.secret {secret}\n")
    port, webui_port = free_ports(2)
    log_file = work_dir / "master.log"
    cluster = SparkCluster(0, port, webui_port, str(work_dir), str(log_file), [], cores, memory)
    cluster.properties_file = properties and str(properties)
    master_args = ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui_port), *_properties(cluster)]
    cluster.pid = _spark_class("org.apache.spark.deploy.master.Master", master_args, log_file)
    try:
        for index in range(workers):
            cluster.workers.append(_start_worker(cluster, index))
        wait_for_workers(cluster, timeout_s)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def wait_for_workers(cluster: SparkCluster, timeout_s: float = 180) -> None:
    """Wait until the master lists all of the cluster's workers ALIVE; a JVM that exits meanwhile
    fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    jvms = [("master", cluster.pid, cluster.log_file)]
    jvms += [(f"worker {i}", w.pid, w.log_file) for i, w in enumerate(cluster.workers)]
    while True:
        for what, pid, log_file in jvms:
            if not alive(pid):
                raise StackError(f"the Spark {what} (pid {pid}) exited; log {log_file}:\n{tail(log_file)}")
        try:
            if cluster.alive_workers(cluster.state(patience_s=0)) == len(cluster.workers):
                return
        except StackError:
            pass  # the master's web UI is not up yet (or slow to answer): ask again until the deadline
        if time.monotonic() > deadline:
            raise StackError(
                f"the Spark master at {cluster.master_url} does not list {len(cluster.workers)} ALIVE workers "
                f"after {timeout_s:.0f}s; log {cluster.log_file}:\n{tail(cluster.log_file)}"
            )
        time.sleep(0.5)


def _executors(worker_pid: int) -> list[int]:
    """The executor JVMs a worker launched (its child processes running Spark's executor class)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(proc_stat(int(entry.name))[1]) == worker_pid and runs(int(entry.name), _EXECUTOR_CLASS):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
    return found


def kill_worker(cluster: SparkCluster, index: int) -> list[int]:
    """SIGKILL worker `index`'s JVM (a lost worker: no shutdown, no goodbye to the master). Returns
    the PIDs of the executors it had launched: Spark's WorkerWatcher ends each once it loses the
    worker; any still running when the cluster stops is stopped with it."""
    worker = cluster.workers[index]
    executors = _executors(worker.pid)
    os.kill(worker.pid, signal.SIGKILL)
    while alive(worker.pid):  # reaps our child
        time.sleep(0.05)
    cluster.orphans += executors
    return executors


def restore_workers(cluster: SparkCluster, timeout_s: float = 180) -> list[int]:
    """Start again, in their work dirs, the workers that are not running; wait until all are ALIVE.
    Returns the indexes of those restarted."""
    restarted = [i for i, w in enumerate(cluster.workers) if not w.running()]
    for index in restarted:
        cluster.workers[index] = _start_worker(cluster, index)
    wait_for_workers(cluster, timeout_s)
    return restarted


def stop_cluster(cluster: SparkCluster) -> None:
    """Stop the workers (each stops its executors), the master, then executors orphaned by kills."""
    for worker in cluster.workers:
        if worker.running():
            stop_pid(worker.pid)
    stop_pid(cluster.pid)
    for pid in cluster.orphans:
        if runs(pid, _EXECUTOR_CLASS):
            stop_pid(pid)
