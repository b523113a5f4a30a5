"""`./kafka2pg` sets up one command at a time per state directory: a second one started while
another holds the set-up waits, says so, and goes on once the first is done."""

import fcntl
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_setup_waits_for_the_first_and_then_goes_on():
    state = Path(os.environ.get("KAFKA2PG_STATE_DIR", ROOT / ".cache"))
    assert (state / "jars").is_dir(), "run through ./kafka2pg test: the set-up it made is used here"
    lines: queue.Queue = queue.Queue()
    with open(state / ".setup.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a first command setting up holds it
        second = subprocess.Popen(
            [str(ROOT / "kafka2pg"), "setup"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "KAFKA2PG_STATE_DIR": str(state)},
        )
        threading.Thread(target=lambda: [lines.put(line) for line in second.stderr], daemon=True).start()
        try:
            said = ""
            deadline = time.monotonic() + 120
            while "waiting for it to finish" not in said:
                assert time.monotonic() < deadline, f"no word of waiting within 120 s: {said!r}"
                try:
                    said += lines.get(timeout=1)
                except queue.Empty:
                    assert second.poll() is None, f"it ended without waiting: {said!r}"
            assert second.poll() is None  # still waiting while the lock is held
        except BaseException:
            second.kill()
            raise
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    try:
        assert second.wait(timeout=300) == 0, said
    finally:
        second.kill()
    deadline = time.monotonic() + 30
    while "ready: venv" not in said and time.monotonic() < deadline:
        try:
            said += lines.get(timeout=1)
        except queue.Empty:
            pass
    assert "ready: venv" in said, said
