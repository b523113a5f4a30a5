"""The local throwaway PostgreSQL: a cluster made by Debian's initdb (as the `postgres` user when we
are root) and run by pg_ctl on a free 127.0.0.1 port; restarts keep its port and data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kafka2pg.devtools.processes import (
    ensure_port_free,
    free_port,
    proc_stat,
    runs,
    stop_pid,
    tail,
    wait_for_exit,
)
from kafka2pg.exceptions import StackError
from kafka2pg.locations import COMMAND, preview_first


@dataclass
class PostgresProcess:
    pid: int
    port: int
    data_dir: str
    log_file: str
    bin_dir: str

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/kafka2pg"

    def connection(self) -> dict:
        """The cluster as an Airflow postgres connection (JSON form of AIRFLOW_CONN_*)."""
        return {
            "conn_type": "postgres",
            "host": "127.0.0.1",
            "port": self.port,
            "login": "postgres",
            "schema": "kafka2pg",
        }

    @property
    def cluster_dir(self) -> Path:
        """The folder start_postgres made: the data directory and the server log."""
        return Path(self.data_dir).parent

    def running(self) -> bool:
        """True when the recorded PID is this cluster's postmaster."""
        return runs(self.pid, self.data_dir)


def _as_postgres() -> list[str]:
    # By its path: root's PATH from a plain `su` has no /usr/sbin.
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    return [runuser, "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _give_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def postgres_bin_dir() -> Path:
    explicit = os.environ.get("KAFKA2PG_PG_BINDIR")
    candidates = (
        [Path(explicit)]
        if explicit
        else sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        )
    )
    for candidate in reversed(candidates):
        if (candidate / "initdb").exists():
            return candidate
    raise StackError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql: "
        "`apt-get install postgresql`, or set KAFKA2PG_PG_BINDIR"
    )


def _new_cluster_dir(work_dir: Path) -> Path:
    """Where a new cluster and its log live: `work_dir/postgres` when the `postgres` user can write
    there, else a temp folder (a root-only parent such as pytest's tmp dir is out of its reach)."""
    base = work_dir / "postgres"
    if base.exists():
        raise StackError(
            f"{base} already exists (a cluster no recorded stack names?): nothing was started. "
            f"{preview_first('stack reset')} deletes it; or move the folder away."
        )
    base.mkdir(parents=True)
    _give_to_postgres(base)
    reachable = subprocess.run([*_as_postgres(), "test", "-w", str(base)], check=False).returncode == 0
    if reachable:
        return base
    base.rmdir()
    base = Path(tempfile.mkdtemp(prefix="kafka2pg-pg-"))
    base.chmod(0o755)
    _give_to_postgres(base)
    return base


def start_postgres(work_dir: Path, timeout_s: float = 60) -> PostgresProcess:
    """initdb a new cluster (see _new_cluster_dir) and start it on a free 127.0.0.1 port;
    `work_dir/logs/postgres.log` links to its log."""
    bin_dir = postgres_bin_dir()
    base = _new_cluster_dir(work_dir)
    log_dir = work_dir / "logs"
    data_dir = base / "data"
    data_dir.mkdir()
    log_file = base / "postgres.log"
    log_file.touch()
    for path in (data_dir, log_file):
        _give_to_postgres(path)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "postgres.log").unlink(missing_ok=True)
    (log_dir / "postgres.log").symlink_to(log_file)
    done = subprocess.run(
        [
            *_as_postgres(),
            str(bin_dir / "initdb"),
            "-D",
            str(data_dir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise StackError(f"initdb failed:\n{done.stdout}\n{done.stderr}")
    port = free_port()
    pid = _pg_ctl_start(bin_dir, data_dir, log_file, port, timeout_s)
    started = PostgresProcess(pid, port, str(data_dir), str(log_file), str(bin_dir))
    try:
        _create_database(bin_dir, port)
    except BaseException:  # pg_ctl detached it: nothing else would stop it
        stop_postgres(started)
        raise
    return started


def _create_database(bin_dir: Path, port: int) -> None:
    subprocess.run(
        [
            str(bin_dir / "psql") if (bin_dir / "psql").exists() else "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-q",
            "-c",
            "CREATE DATABASE kafka2pg",
        ],
        capture_output=True,
        text=True,
        check=True,
    )


def _pg_ctl_start(bin_dir: Path, data_dir: Path, log_file: Path, port: int, timeout_s: float) -> int:
    # fsync off (a throwaway cluster need not survive an OS crash) but synchronous_commit ON: a
    # commit is in the WAL before it returns, so a PostgreSQL crash (`restart -m immediate` in the
    # fault suite) never loses a committed transaction, as on a real server.
    # No Unix-domain socket (everything connects to 127.0.0.1): its path, in the data folder,
    # would have to fit in 107 bytes, which a checkout a few folders deep does not.
    options = (
        f"-p {port} -c unix_socket_directories='' -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=on -c full_page_writes=off -c max_connections=200 "
        "-c shared_buffers=256MB -c max_wal_size=4GB"
    )
    done = subprocess.run(
        [
            *_as_postgres(),
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data_dir),
            "-l",
            str(log_file),
            "-o",
            options,
            "-w",
            "-t",
            str(int(timeout_s)),
            "start",
        ],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise StackError(f"PostgreSQL did not start:\n{done.stdout}\n{done.stderr}\n{tail(str(log_file))}")
    return int((data_dir / "postmaster.pid").read_text().splitlines()[0])


def restart_postgres(pg: PostgresProcess, *, mode: str = "fast", timeout_s: float = 60) -> PostgresProcess:
    """Stop the cluster (`fast`: clean shutdown; `immediate`: a crash, recovery on start) and start it
    again on the same port and data; open connections are cut. Used by fault-injection tests."""
    bin_dir, data_dir = Path(pg.bin_dir), Path(pg.data_dir)
    subprocess.run(
        [*_as_postgres(), str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", mode, "-w", "stop"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = _pg_ctl_start(bin_dir, data_dir, Path(pg.log_file), pg.port, timeout_s)
    return PostgresProcess(pid, pg.port, pg.data_dir, pg.log_file, pg.bin_dir)


def stop_postgres(pg: PostgresProcess) -> None:
    """Stop the cluster (a clean shutdown); its data stays."""
    if not pg.running():
        return
    if Path(pg.data_dir).exists():
        subprocess.run(
            [*_as_postgres(), str(Path(pg.bin_dir) / "pg_ctl"), "-D", pg.data_dir, "-m", "fast", "-w", "stop"],
            capture_output=True,
            text=True,
            check=False,
        )
    stop_pid(pg.pid)


def _orphans(data_dir: str) -> list[int]:
    """Server processes a killed postmaster left running: their working directory is its data
    directory and their parent is no postmaster of it. They hold its shared memory, and a new
    postmaster refuses to start beside them ("pre-existing shared memory block is still in use")."""
    cwd, found = str(Path(data_dir).resolve()), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "cwd") != cwd or not (proc / "cmdline").read_bytes().startswith(b"postgres: "):
                continue
            parent = int(proc_stat(int(proc.name))[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if not runs(parent, data_dir):
            found.append(int(proc.name))
    return found


def _end_orphans(data_dir: str, grace_s: float = 5) -> list[int]:
    """Give a killed postmaster's leftover server processes `grace_s` to notice and exit (they do
    when they next wait), then stop those still running (one stuck in a long query); their PIDs."""
    deadline = time.monotonic() + grace_s
    while (left := _orphans(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        stop_pid(pid)
    return left


def start_recorded_postgres(pg: PostgresProcess, timeout_s: float = 60) -> tuple[PostgresProcess, list[int]]:
    """Start a stopped (or killed) cluster on its recorded port and data directory; also return the
    PIDs of server processes a killed postmaster had left running, which had to be stopped first.
    The stale postmaster.pid a killed postmaster leaves is the new one's to take over."""
    data_dir = Path(pg.data_dir)
    if not (data_dir / "PG_VERSION").exists():
        raise StackError(
            f"the PostgreSQL data directory recorded in {data_dir} is gone: nothing was started. "
            f"{preview_first('stack reset')} forgets this stack (and deletes what is left of it); "
            f"`{COMMAND} stack start` then starts a new, empty one."
        )
    wait_for_exit(pg.pid, f"the postmaster of {data_dir}")
    ended = _end_orphans(pg.data_dir)
    ensure_port_free(pg.port, f"PostgreSQL of {data_dir}")
    pid = _pg_ctl_start(Path(pg.bin_dir), data_dir, Path(pg.log_file), pg.port, timeout_s)
    return PostgresProcess(pid, pg.port, pg.data_dir, pg.log_file, pg.bin_dir), ended
