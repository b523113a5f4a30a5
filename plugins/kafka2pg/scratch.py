"""A stage job's scratch folder: `<state dir>/spark/scratch/<host>-<pid>-<start>`, one per process
that builds a Spark session, holding the package zip its executors import and, with a local
master, Spark's local directories (`spark.local.dir`: block manager, the session's copies of
added files) and the JVM's temporary files where this process starts the JVM.

The job removes it when it ends. A job killed outright (`kill -9`, the OOM killer, a node
lost and restarted) cannot; the next job on the same host removes every folder whose process is
gone (`sweep`), so killed jobs do not fill the disk with Spark's leftovers, as they would in
/tmp. A folder is named by its process's id and start time: a process id reused later by
another process does not keep a dead job's folder, and a live job's is never removed. Folders
of other hosts (a state directory on shared storage) are left to their own host.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

SCRATCH = "scratch"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (`/proc/<pid>/stat`), "0" where there is
    no /proc but the process exists, None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "0"


def folder_name(pid: int) -> str | None:
    """The scratch folder's name for the live process `pid` on this host, None if it is gone."""
    started = _started(pid)
    return None if started is None else f"{_host()}-{pid}-{started}"


@contextmanager
def job_scratch(spark_dir: Path) -> Iterator[Path]:
    """This process's scratch folder under `spark_dir`, made (folders of gone jobs swept first)
    and removed at the end of the block (what is left of it: Spark removes its own parts)."""
    root = spark_dir / SCRATCH
    root.mkdir(parents=True, exist_ok=True)
    sweep(spark_dir)
    folder = root / folder_name(os.getpid())
    folder.mkdir(exist_ok=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def jvm_temporary_files_in(conf: dict[str, str], folder: Path) -> dict[str, str]:
    """`conf` whose driver JVM keeps its temporary files (lz4's native library, Spark's temporary
    folders) in `folder`, unless its `spark.driver.extraJavaOptions` names a folder already."""
    options = conf.get("spark.driver.extraJavaOptions", "")
    if "-Djava.io.tmpdir=" in options:
        return conf
    return {**conf, "spark.driver.extraJavaOptions": f"{options} -Djava.io.tmpdir={shlex.quote(str(folder))}".strip()}


def sweep(spark_dir: Path) -> list[Path]:
    """Remove the scratch folders under `spark_dir` of this host's processes that are gone.
    Returns what it removed."""
    removed = []
    host = _host()
    root = spark_dir / SCRATCH
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        owner, _, rest = entry.name.rpartition("-")
        entry_host, _, pid = owner.rpartition("-")
        if entry_host != host or not pid.isdigit() or not rest.isdigit():
            continue  # another host's, or not a scratch folder
        if folder_name(int(pid)) == entry.name:
            continue  # its job is running
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        log.info("removed %s: the scratch folder of stage job process %s, which ended without removing it", entry, pid)
    return removed
