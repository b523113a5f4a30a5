"""Ctrl-C while a command's Spark JVM starts: the JVMs it launched are stopped (SIGTERM, then
SIGKILL); a second Ctrl-C during that wait kills at once instead of leaving one behind."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kafka2pg import staging

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)


def test_a_second_ctrl_c_while_a_child_is_stopped_kills_it_at_once_and_is_raised():
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"  # it ignores SIGTERM from now on
        second = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        second.start()
        with pytest.raises(KeyboardInterrupt):
            staging._stop_process(child.pid, grace_s=600)
        second.join()
        assert not Path(f"/proc/{child.pid}").exists(), "the child outlived the second Ctrl-C"
    finally:
        if child.returncode is None and Path(f"/proc/{child.pid}").exists():
            child.kill()
            child.wait()


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_and_reaped():
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        staging._stop_process(child.pid, grace_s=0.5)
        assert not Path(f"/proc/{child.pid}").exists()
    finally:
        if Path(f"/proc/{child.pid}").exists():
            child.kill()
            child.wait()
