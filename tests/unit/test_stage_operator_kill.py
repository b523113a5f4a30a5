"""Airflow stopping the stage task: the job's Python driver under spark-submit gets SIGTERM and
time to stop cleanly before the provider's SIGKILL."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kafka2pg.stage_operator import stop_job

DRIVER = """
import pathlib, signal, sys, time
def stop(*_):
    pathlib.Path(sys.argv[1]).write_text("stopped")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".ready").write_text("")
time.sleep(120)
"""


@contextlib.contextmanager
def spark_submit_stand_in(tmp_path, driver: str, shell: str, **popen) -> Iterator[tuple[subprocess.Popen, Path]]:
    """spark-submit's stand-in: `shell` (bash, given the driver's command line as {driver}) in a
    session of its own, started and waited on until the driver is ready; killed with its group
    afterwards. Yields the stand-in and the driver's file."""
    application = tmp_path / "stage_job.py"
    application.write_text(driver)
    command = f"{sys.executable} {application} {tmp_path / 'driver'}"
    parent = subprocess.Popen(["bash", "-c", shell.format(driver=command)], start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "driver.ready").exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the driver did not start"
            time.sleep(0.05)
        yield parent, application
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_the_jobs_driver_under_spark_submit_gets_sigterm_and_spark_submit_exits_with_it(tmp_path):
    # A parent that runs the driver and exits with its status; a sibling that is not the job
    # must be left alone.
    shell = 'sleep 120 & other=$!; {driver}; status=$?; kill $other; exit "$status"'
    with spark_submit_stand_in(tmp_path, DRIVER, shell) as (parent, application):
        assert stop_job(parent, str(application), 60)

        assert (tmp_path / "driver").read_text() == "stopped"
        assert parent.returncode == 143


def test_without_the_jobs_driver_it_only_waits_and_says_whether_spark_submit_exited(tmp_path):
    parent = subprocess.Popen(["sleep", "120"])
    try:
        assert not stop_job(parent, str(tmp_path / "stage_job.py"), 0.5)
        assert parent.poll() is None
    finally:
        parent.kill()
        parent.wait()


LOUD_DRIVER = """
import pathlib, signal, sys, time
def stop(*_):
    for n in range(20000):  # about 1 MB: far more than a pipe holds
        print(f"stopping line {n} " + "x" * 40, flush=False)
    sys.stdout.flush()
    pathlib.Path(sys.argv[1]).write_text("stopped")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".ready").write_text("")
time.sleep(120)
"""


def test_what_the_job_writes_while_it_stops_is_read_and_logged_so_it_can_exit(tmp_path, caplog):
    # As the provider starts spark-submit: output piped, read by the task's main thread, which
    # the signal handler calling on_kill holds (nobody else reads it here either).
    piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "universal_newlines": True}
    with spark_submit_stand_in(tmp_path, LOUD_DRIVER, '{driver}; exit "$?"', **piped) as (parent, application):
        caplog.set_level("INFO", logger="kafka2pg.stage_operator")

        assert stop_job(parent, str(application), 60)

        assert (tmp_path / "driver").read_text() == "stopped"
        logged = [r.getMessage() for r in caplog.records if r.name == "kafka2pg.stage_operator"]
        assert len(logged) == 20000
        assert logged[-1].startswith("stopping line 19999 ")
