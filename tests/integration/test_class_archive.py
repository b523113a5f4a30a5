"""The stage JVM's class-data archive: set-up makes it, a stage JVM maps Spark's classes from it,
and a failed training run leaves nothing a JVM could trip over."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kafka2pg import class_archive
from kafka2pg.config import STAGE_JVM_OPTIONS_C1, class_archive_path, stage_jvm_options

START_SPARK = """
import sys
from pyspark import SparkContext
from kafka2pg.jars import spark_jars
from kafka2pg.staging import spark_session

spark = spark_session("local[1]", app_name="archive-probe", jars=spark_jars(),
                      conf={"spark.driver.extraJavaOptions": sys.argv[1]})
assert spark.range(10).count() == 10
gateway = SparkContext._gateway
spark.stop()
gateway.proc.stdin.close()
gateway.proc.wait(timeout=120)
"""


def _classes_loaded(options: str, log: Path) -> dict[str, str]:
    """Start a stage-like Spark JVM with `options`; each org.apache.spark class it loaded -> its source."""
    subprocess.run(
        [sys.executable, "-c", START_SPARK, f"{options} -Xlog:class+load=info:file={log}"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    loaded = {}
    for line in log.read_text().splitlines():
        parts = line.split("] ", 1)[-1].split(" source: ", 1)
        # Lambda forms are generated at run time (their "source" is the class defining them).
        if len(parts) == 2 and parts[0].startswith("org.apache.spark.") and "$$Lambda" not in parts[0]:
            loaded[parts[0]] = parts[1]
    return loaded


def test_a_stage_jvm_maps_sparks_classes_from_the_archive_setup_made(tmp_path):
    archive = class_archive.ensure()  # `./kafka2pg setup` made it already; made here otherwise
    assert archive is not None and archive == class_archive_path()
    assert class_archive.ensure() == archive  # idempotent: the same file, not made again
    with_archive = _classes_loaded(stage_jvm_options(1), tmp_path / "with.log")
    without = _classes_loaded(STAGE_JVM_OPTIONS_C1, tmp_path / "without.log")

    shared = [name for name, source in with_archive.items() if "shared objects file" in source]
    assert with_archive["org.apache.spark.SparkContext"].startswith("shared objects file")
    assert len(shared) > 0.9 * len(with_archive), f"only {len(shared)} of {len(with_archive)} Spark classes mapped"
    assert not [name for name, source in without.items() if "shared objects file" in source]


def test_a_failed_training_run_leaves_no_archive(tmp_path, monkeypatch):
    """A JVM given a truncated archive crashes: a failed run must leave neither archive nor partial
    file, only the marker that keeps later commands from training again."""
    java_home = tmp_path / "broken-jdk"
    (java_home / "bin").mkdir(parents=True)
    java = java_home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'this java is broken' >&2\nexit 1\n")
    java.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(java_home))
    state = tmp_path / "state"

    assert class_archive.ensure(state) is None
    assert not class_archive_path(state).exists()
    assert [p.name for p in (state / "jvm").iterdir()] == [f"{class_archive_path(state).name}.failed"]
    assert "SharedArchiveFile" not in stage_jvm_options(1, state)
    assert os.environ["JAVA_HOME"] == str(java_home)
