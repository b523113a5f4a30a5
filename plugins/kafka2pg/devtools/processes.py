"""The local stack's processes as the operating system sees them: free ports, whether a recorded
PID is still the program we started, and stopping one by its PID (never by name).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from pathlib import Path

from kafka2pg.exceptions import StackError
from kafka2pg.locations import COMMAND

# Ports are chosen from here on, outside the kernel's ephemeral range.
_PORTS_FROM = 10_000
_random = random.SystemRandom()  # not the process's shared, seedable generator


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1, each bound until all are chosen, outside the
    kernel's ephemeral range (ip_local_port_range): a port from that range is also the source
    port the kernel gives outgoing connections, so while a stack's service is down (killed,
    stopped) one could take its recorded port (a client retrying that port can even connect to
    itself on it), and the restart on it would fail. The kernel's own choice if none is free."""
    low, high = ephemeral_range()
    outside = [*range(_PORTS_FROM, low), *range(max(high + 1, _PORTS_FROM), 65536)]
    candidates = _random.sample(outside, min(200, len(outside)))
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in [*candidates, *[0] * count]:
            if len(ports) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.enter_context(s)
            ports.append(s.getsockname()[1])
        return ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def runs(pid: int, needle: str) -> bool:
    """True when `pid` is alive and its command line holds `needle`: a recorded PID may belong to
    another program after a reboot, and must then be neither trusted nor signalled."""
    if not alive(pid):
        return False
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc on this system: the PID is all we have


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, session, tty, tpgid, flags..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


_PF_KTHREAD = 0x00200000  # in /proc/PID/stat's flags: a kernel thread (no command line either)


def _exiting(pid: int) -> bool:
    """True while a killed `pid` is still torn down or a zombie: its command line is gone, but its
    PID (and, for a moment, its listening sockets) are not."""
    try:
        flags = int(proc_stat(pid)[6])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not cmdline and not flags & _PF_KTHREAD


def wait_for_exit(pid: int, what: str, timeout_s: float = 30) -> None:
    """Before restarting a killed process on its port and data: wait until it is fully gone. Its
    sockets hold the port until then, and PostgreSQL takes a zombie postmaster's PID, still in
    postmaster.pid, for a running server (the zombie's parent, often init, reaps it soon)."""
    deadline = time.monotonic() + timeout_s
    while _exiting(pid):
        if not alive(pid):  # our own child, reaped by this call
            return
        if time.monotonic() > deadline:
            raise StackError(
                f"{what} (pid {pid}) was killed but is not gone after {timeout_s:.0f}s (a zombie its parent "
                f"has not reaped?): it may still hold the port and data. Run `{COMMAND} stack start` again later."
            )
        time.sleep(0.1)


def ensure_port_free(port: int, what: str) -> None:
    """Refuse to restart `what` when another process listens on its recorded port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers do: connections of the old process in TIME_WAIT do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(
                f"{what} must listen on its recorded port 127.0.0.1:{port}, but another process holds it "
                f"({exc.strerror}). Stop that process (`ss -ltnp 'sport = :{port}'` names it), then run "
                f"`{COMMAND} stack start` again; the stack's data is kept."
            ) from exc


def tail(path: str, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def stop_pid(pid: int, timeout_s: float = 30) -> None:
    """SIGTERM, wait, then SIGKILL one process we started."""
    if not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    while alive(pid):
        time.sleep(0.1)
