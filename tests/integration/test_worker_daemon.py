"""Spark's Python processes of a local master import PySpark from the installed package, not from
the zip inside it that Spark puts first on their path (kafka2pg.worker_daemon): in process, and
under spark-submit as the DAG's stage task runs the job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyspark

PACKAGE = str(Path(pyspark.__file__).parent / "__init__.py")


def test_a_local_sessions_workers_import_pyspark_from_the_package(spark):
    def pyspark_files(_):  # nested: pickled by value, the workers cannot import this test module
        import pyspark

        yield pyspark.__file__

    assert spark.sparkContext.getConf().get("spark.python.daemon.module") == "kafka2pg_worker_daemon"
    files = spark.sparkContext.parallelize(range(4), 2).mapPartitions(pyspark_files).collect()
    assert files == [PACKAGE, PACKAGE]


JOB = """
import sys
from kafka2pg.worker_daemon.kafka2pg_worker_daemon import skip_bundled_pyspark_zip

skip_bundled_pyspark_zip(sys.path)  # as kafka2pg.stage_job does
import pyspark
from pathlib import Path
from pyspark import SparkFiles
from kafka2pg.staging import spark_session, stop_session

def files(_):
    import pyspark
    yield pyspark.__file__

spark = spark_session(None, app_name="worker-daemon-probe", scratch=Path(sys.argv[1]) if sys.argv[1:] else None)
print("DRIVER", pyspark.__file__)
print("WORKERS", *spark.sparkContext.parallelize(range(4), 2).mapPartitions(files).collect())
print("DAEMON", spark.sparkContext.getConf().get("spark.python.daemon.module", "pyspark.daemon"))
print("FILES", SparkFiles.getRootDirectory())
stop_session(spark)
"""


def _submit(tmp_path: Path, master: str, *conf: str, args: tuple[str, ...] = ()) -> dict[str, list[str]]:
    job = tmp_path / "probe.py"
    job.write_text(JOB)
    command = [shutil.which("spark-submit"), "--master", master, *conf, str(job), *args]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("SPARK_LOCAL_DIRS", None)  # the tests' own (Spark prefers it to spark.local.dir): as a user runs it
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line[:1].isupper()}


def test_under_spark_submit_the_driver_and_the_workers_import_pyspark_from_the_package(tmp_path):
    seen = _submit(tmp_path, "local[2]")
    assert seen["DRIVER"] == [PACKAGE]
    assert seen["WORKERS"] == [PACKAGE, PACKAGE]
    assert seen["DAEMON"] == ["kafka2pg_worker_daemon"]


def test_a_daemon_set_on_spark_submits_command_line_is_left_alone(tmp_path):
    seen = _submit(tmp_path, "local[2]", "--conf", "spark.python.daemon.module=pyspark.daemon")
    assert seen["DAEMON"] == ["pyspark.daemon"]
    assert all(".zip" in f for f in seen["WORKERS"])  # Spark's own daemon: from the zip


def test_under_spark_submit_a_local_masters_files_are_in_the_jobs_scratch_folder(tmp_path):
    """The stage job gives Spark's local directories its scratch folder (kafka2pg.scratch) after
    spark-submit started the JVM: the session's files (and block manager) go there, not to /tmp."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (root,) = _submit(tmp_path, "local[2]", args=(str(scratch),))["FILES"]
    assert root.startswith(f"{scratch}/"), root
    (elsewhere,) = _submit(tmp_path, "local[2]")["FILES"]
    assert not elsewhere.startswith(f"{scratch}/"), elsewhere
