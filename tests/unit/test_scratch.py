"""Stage jobs' scratch folders (kafka2pg.scratch): made per process, removed at the end, and the
folders of jobs killed before they could remove them swept by the next job on the host."""

import os
import subprocess
import sys

from kafka2pg import scratch
from kafka2pg.staging import _in_scratch, _Launched


def _gone_process_folder_name() -> str:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    name = scratch.folder_name(child.pid)
    child.communicate(b"")
    assert name is not None and scratch.folder_name(child.pid) is None
    return name


def test_a_job_has_its_folder_until_it_ends_and_sweeps_only_the_folders_of_gone_jobs(tmp_path):
    root = tmp_path / "scratch"
    root.mkdir()
    host, pid, started = scratch.folder_name(os.getppid()).rsplit("-", 2)
    alive = root / f"{host}-{pid}-{started}"  # a job still running: the parent of this process
    gone = root / _gone_process_folder_name()  # a job killed before it could remove its folder
    reused = root / f"{host}-{pid}-{int(started) + 1}"  # a gone job whose process id is in use again
    elsewhere = root / f"other_host-{pid}-{started}"  # a job of another host sharing the state directory
    unrelated = root / "notes"
    for folder in (alive, gone, reused, elsewhere, unrelated):
        (folder / "blockmgr-1").mkdir(parents=True)
        (folder / "blockmgr-1" / "shuffle_0_0_0.data").write_bytes(b"x" * 1000)

    with scratch.job_scratch(tmp_path) as mine:
        assert mine.parent == root and mine.is_dir()
        assert mine.name == scratch.folder_name(os.getpid())
        assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in (alive, elsewhere, unrelated, mine)), (
            "only the gone jobs' folders are swept"
        )
        (mine / "spark-1" / "userFiles-1").mkdir(parents=True)
        (mine / "kafka2pg-1.zip").write_bytes(b"zip")
    assert not mine.exists(), "a job's folder goes with its end, whatever Spark left in it"
    assert scratch.sweep(tmp_path) == []
    assert (alive / "blockmgr-1" / "shuffle_0_0_0.data").is_file()


def test_spark_local_dirs_go_to_the_scratch_folder_only_with_a_local_master(tmp_path):
    base = {"spark.driver.extraJavaOptions": "-Xms64m"}
    local = _in_scratch(base, tmp_path, _Launched("local[2]", frozenset()), starts_jvm=True)
    assert local["spark.local.dir"] == str(tmp_path)
    assert local["spark.driver.extraJavaOptions"] == f"-Xms64m -Djava.io.tmpdir={tmp_path}"
    assert base == {"spark.driver.extraJavaOptions": "-Xms64m"}, "the caller's conf is left as it was"

    cluster = _in_scratch(base, tmp_path, _Launched("spark://host:7077", frozenset()), starts_jvm=True)
    assert "spark.local.dir" not in cluster, "a cluster's executors keep their own local directories"
    assert cluster["spark.driver.extraJavaOptions"].endswith(f"-Djava.io.tmpdir={tmp_path}")

    # Under spark-submit: the JVM runs already; its master is unknown before it does.
    submitted = _in_scratch(base, tmp_path, _Launched("local[2]", frozenset({"spark.master"})), starts_jvm=False)
    assert submitted == {**base, "spark.local.dir": str(tmp_path)}
    assert _in_scratch(base, tmp_path, _Launched(None, frozenset()), starts_jvm=False) == base


def test_a_pipelines_own_settings_win(tmp_path):
    launched = _Launched("local[2]", frozenset())
    own = {"spark.local.dir": "/data/spark", "spark.driver.extraJavaOptions": "-Djava.io.tmpdir=/data/tmp"}
    assert _in_scratch(own, tmp_path, launched, starts_jvm=True) == own
    submitted = _Launched("local[2]", frozenset({"spark.local.dir"}))  # spark-submit's --conf or spark-defaults
    assert "spark.local.dir" not in _in_scratch({}, tmp_path, submitted, starts_jvm=False)
