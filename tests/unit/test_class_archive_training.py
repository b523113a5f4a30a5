"""The Spark class-data archive's training: one that exits with an error is not retried by every
later command (each would wait for it again), one that timed out or was killed is; the archives
an interrupted training JVM wrote on its way out are removed."""

import os
import subprocess
import sys

from kafka2pg import class_archive
from kafka2pg.config import class_archive_path


def test_a_failed_training_is_recorded_and_not_run_again_until_its_marker_is_deleted(tmp_path, monkeypatch):
    runs = []

    def failing(argv, **_):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "java.lang.OutOfMemoryError")

    monkeypatch.setattr(class_archive.subprocess, "run", failing)
    assert class_archive.ensure(tmp_path) is None
    assert class_archive.ensure(tmp_path) is None
    assert len(runs) == 1, "the training ran again after it had failed"
    failed = class_archive_path(tmp_path).with_name(class_archive_path(tmp_path).name + ".failed")
    assert "OutOfMemoryError" in failed.read_text()
    failed.unlink()
    assert class_archive.ensure(tmp_path) is None
    assert len(runs) == 2


def test_a_training_over_its_time_or_killed_by_a_signal_is_tried_again(tmp_path, monkeypatch):
    """A busy machine or the OOM killer: the next command may succeed."""
    runs = []

    def slow(argv, **_):
        runs.append(argv)
        raise subprocess.TimeoutExpired(argv, class_archive.TIMEOUT_S)

    def killed(argv, **_):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, -9, "", "")

    for outcome in (slow, killed, killed):
        monkeypatch.setattr(class_archive.subprocess, "run", outcome)
        assert class_archive.ensure(tmp_path) is None
    assert len(runs) == 3


def test_archives_left_by_an_interrupted_training_are_removed_when_their_process_is_gone(tmp_path, monkeypatch):
    folder = class_archive_path(tmp_path).parent
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = folder / f"spark-4.2.0-abc.jsa.{gone.stdout.strip()}.partial"
    running = folder / f"spark-4.2.0-abc.jsa.{os.getpid()}.partial"  # another ensure still training
    for partial in (orphan, running):
        partial.write_bytes(b"x" * 10)
    monkeypatch.setattr(class_archive.subprocess, "run", lambda argv, **_: subprocess.CompletedProcess(argv, 1, "", ""))
    class_archive.ensure(tmp_path)
    assert not orphan.exists()
    assert running.exists()
