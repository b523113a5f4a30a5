"""`./kafka2pg` sets up one command at a time per state directory: a second one started while
another holds the set-up waits, says so, and goes on once the first is done."""

import fcntl
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_setup_waits_for_the_first_and_then_goes_on():
    state = Path(os.environ.get("KAFKA2PG_STATE_DIR", ROOT / ".cache"))
    assert (state / "jars").is_dir(), "run through ./kafka2pg test: the set-up it made is used here"
    with open(state / ".setup.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a first command setting up holds it
        second = subprocess.Popen(
            [str(ROOT / "kafka2pg"), "setup"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "KAFKA2PG_STATE_DIR": str(state)},
        )
        try:
            said = ""
            deadline = time.monotonic() + 120
            while "waiting for it to finish" not in said:
                assert second.poll() is None, f"it did not wait: {second.communicate()}"
                assert time.monotonic() < deadline, said
                said += second.stderr.readline()
            assert second.poll() is None  # still waiting while the lock is held
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        _, rest = second.communicate(timeout=300)
    assert second.returncode == 0, said + rest
    assert "ready: venv" in rest, said + rest
