"""kafka2pg as a user installs it: the wheel pip-installed into a fresh virtualenv outside the checkout
(under a path with a space, its Python the executors' PYSPARK_PYTHON), a DAGs folder holding only the
DAG file and a pipelines.yaml, the services as Airflow Connections. That venv's `kafka2pg migrate` and
`airflow dags test` land every produced event, and nothing they run reads the checkout: an audit hook
in every Python process of the venv records any file opened or folder listed under it, and
spark-submit is given the job file inside the installed package."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from psycopg import sql

from kafka2pg.devtools.producer import produce_sample
from kafka2pg.kafka_offsets import ensure_topic
from kafka2pg.locations import state_dir

ROOT = Path(__file__).resolve().parents[2]
EVENTS = 400
log = logging.getLogger(__name__)

# Imported by a .pth file at the start of every Python process of the test venv (Airflow, the CLI, the
# Spark driver and its Python workers): records the process, then every `open` (imports included) and
# folder listing of a path under the checkout. The JVM reads only the jars named on its command line.
PROBE = '''"""Test probe: which processes ran, and what they opened or listed under the checkout."""
import os
import sys

_ROOT = {root!r}
_LOG = {log!r}
_EVENTS = frozenset(("open", "os.listdir", "os.scandir", "glob.glob", "os.chdir"))
_busy = False


def _write(line):
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)


def _hook(event, args):
    global _busy
    if _busy or event not in _EVENTS or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if path == _ROOT or path.startswith(_ROOT + os.sep):
        _busy = True
        try:
            _write(f"read {{os.getpid()}} {{event}} {{path}}")
        finally:
            _busy = False


with open("/proc/self/cmdline", "rb") as _cmdline:
    _write(f"start {{os.getpid()}} " + " ".join(p.decode(errors="replace") for p in _cmdline.read().split(b"\\0") if p))
sys.addaudithook(_hook)
'''


def run(command: list[str], env: dict[str, str], cwd: Path, log_file: Path, timeout: float = 900) -> str:
    """Run a step of the installation with its output in `log_file`; fail the test with its tail."""
    started = time.monotonic()
    with open(log_file, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout)
    output = log_file.read_text(errors="replace")
    log.info("%s: exit %s in %.0f s", " ".join(command[:3]), done.returncode, time.monotonic() - started)
    assert done.returncode == 0, f"{' '.join(command)} failed (log {log_file}):\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A plain venv with the wheel built from this checkout and its dependencies at requirements.txt's pins."""
    work = tmp_path_factory.mktemp("install")
    # Neither the checkout's package nor its venv: python3.11 is the system's.
    outside = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    checkout_venv = str(Path(sys.prefix) / "bin")
    outside["PATH"] = os.pathsep.join(p for p in outside["PATH"].split(os.pathsep) if p != checkout_venv)
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(work)],
        outside,
        work,
        work / "wheel.log",
    )
    wheel = next(work.glob("kafka2pg-*.whl"))
    # The pins as constraints (pip refuses extras there): the wheel's own dependencies decide what is
    # installed, so one missing from pyproject.toml fails this test; dev tools are not installed.
    constraints = work / "constraints.txt"
    constraints.write_text(re.sub(r"\[[^\]]*\]", "", (ROOT / "requirements.txt").read_text()))
    # Under a path with a space, as `/opt/My Airflow/venv` (pyspark's own spark-submit script runs
    # $PYSPARK_PYTHON unquoted: the stage task finds SPARK_HOME for it).
    target = work / "Airflow venv"
    run(["python3.11", "-m", "venv", str(target)], outside, work, work / "venv.log")
    # --no-compile: Python compiles what it imports; compiling every module of ~300 packages ahead
    # doubles the install time.
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    run([*pip, "-c", str(constraints), str(wheel)], outside, work, work / "pip.log")
    return target


def test_the_installed_wheel_runs_a_dag_copied_alone_without_the_checkout(venv, stack, db, tmp_path, sample_columns):
    suffix = uuid.uuid4().hex[:8]
    name, topic = f"p_{suffix}", f"t-{suffix}"
    table = f"installed_{suffix}"
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "kafka2pg_pipelines.py", dags)
    spec = {
        "name": name,
        "topic": topic,
        "target_table": table,
        "business_key": ["event_id"],
        "columns": sample_columns,
    }
    (dags / "pipelines.yaml").write_text(yaml.safe_dump({"pipelines": [spec]}))
    ensure_topic(stack.kafka.bootstrap_servers, topic, 2)
    produced = produce_sample(stack.kafka.bootstrap_servers, topic, EVENTS, seed=21)

    # Spark's Kafka source: a copy of the jars set-up resolved (Maven Central is not needed offline).
    from kafka2pg.jars import spark_jars

    jars = tmp_path / "jars"
    jars.mkdir()
    for jar in spark_jars(state_dir()):
        shutil.copy(jar, jars)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    probe_log = tmp_path / "probe.log"
    (site_packages / "_kafka2pg_checkout_probe.py").write_text(PROBE.format(root=str(ROOT), log=str(probe_log)))
    (site_packages / "_kafka2pg_checkout_probe.pth").write_text("import _kafka2pg_checkout_probe\n")

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    # Built from nothing: no PYTHONPATH, no KAFKA2PG_* path, no venv but the new one on PATH.
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": str(venv / "bin" / "python"),  # the executors' Python: this venv's
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_CONN_KAFKA2PG_POSTGRES": json.dumps(stack.postgres.connection()),
        "AIRFLOW_CONN_KAFKA2PG_KAFKA": json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": stack.kafka.bootstrap_servers}}
        ),
        "AIRFLOW_CONN_KAFKA2PG_SPARK": json.dumps({"conn_type": "spark", "host": "local[2]"}),
        "KAFKA2PG_SPARK_JARS": ",".join(str(j) for j in sorted(jars.glob("*.jar"))),
        **({"JAVA_HOME": os.environ["JAVA_HOME"]} if "JAVA_HOME" in os.environ else {}),
    }
    bin_dir = venv / "bin"

    # pipelines.yaml is found in Airflow's DAGs folder: the CLI is given no path either.
    run([str(bin_dir / "airflow"), "db", "migrate"], env, cwd, tmp_path / "airflow-db.log")
    migrated = run([str(bin_dir / "kafka2pg"), "migrate"], env, cwd, tmp_path / "migrate.log")
    output = run([str(bin_dir / "airflow"), "dags", "test", f"kafka2pg_{name}"], env, cwd, tmp_path / "run.log")

    target = sql.Identifier("public", table)
    landed = db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0]
    assert (produced, landed) == (EVENTS, EVENTS), output[-4000:]
    job = site_packages / "kafka2pg" / "stage_job.py"
    submitted = [line for line in output.splitlines() if "Spark-Submit cmd:" in line]
    assert submitted and str(job) in submitted[0], output[-4000:]
    # Spark's logging configured from the log4j2 file the wheel ships.
    # (quoted for Spark's split of the options: the venv's path has a space)
    log_config = shlex.quote(str(site_packages / "kafka2pg" / "log4j2.properties"))
    assert f"-Dlog4j2.configurationFile={log_config} " in submitted[0]
    # pyspark's spark-submit could not find its home with that Python: the task found it.
    assert f"SPARK_HOME for spark-submit: {site_packages / 'pyspark'} " in output, output[-4000:]
    assert str(ROOT) not in migrated + output
    # What it tells the user to run is the installed command, not the checkout's wrapper.
    assert "run `kafka2pg grant --role THAT_ROLE`" in migrated and "./kafka2pg" not in migrated, migrated
    # The default state directory of an installation: under HOME, not in site-packages.
    assert (home / ".cache" / "kafka2pg" / "spark").is_dir()

    probe = probe_log.read_text().splitlines()
    started = [line for line in probe if line.startswith("start ")]
    assert any("kafka2pg migrate" in line for line in started)
    assert any("airflow dags test" in line for line in started)
    assert any(f"{job} --pipeline {name} " in line for line in started)  # the Spark driver
    assert [line for line in probe if line.startswith("read ")] == []
