"""Whether the `kafka2pg replay` process that planned a replay batch still runs.

A CLI replay has no run to retry it: killed, its batch stays open for good, and only an operator
can abandon it. So the process holds, for as long as it lives, a transaction-scoped advisory
lock on its batch, from a connection of its own whose transaction stays open (a statement every
PING_S seconds keeps PostgreSQL's idle-in-transaction timeout away; the lock is taken before the
batch's plan commits, so no one sees the batch without it). A killed process's session ends and
the lock with it; a frozen one (SIGSTOP), or a host gone without closing its connection, loses
it when PostgreSQL ends its session idle in its transaction (`IDLE_IN_TRANSACTION_TIMEOUT_S`).
`status` reads the lock to say whether the process runs, and `abandon` refuses a batch whose
process still does.
"""

from __future__ import annotations

import logging
import threading

import psycopg
from psycopg import Connection

from kafka2pg.database import connect

log = logging.getLogger(__name__)

_KEY = "kafka2pg.replay-process"
PING_S = 30.0


def _lock_key(batch_id: int) -> int:
    """The lock's second key: the batch id as PostgreSQL's int4 (pg_locks shows it as an oid)."""
    key = batch_id % 2**32
    return key - 2**32 if key >= 2**31 else key


class ReplayProcess:
    """The lock a `kafka2pg replay` process holds on its batch; use as a context manager around
    the replay, and pass `hold` to `open_replay` as its `on_planned`."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: Connection | None = None
        self._done = threading.Event()
        self._pinger: threading.Thread | None = None

    def __enter__(self) -> ReplayProcess:
        return self

    def hold(self, batch_id: int) -> None:
        """Take the batch's lock (called inside the plan's transaction, before it commits: a
        connection refused here rolls the plan back)."""
        self._conn = connect(self._url)  # its transaction begins with the lock and stays open
        taken = self._conn.execute(
            "SELECT pg_try_advisory_xact_lock(hashtext(%s), %s)", (_KEY, _lock_key(batch_id))
        ).fetchone()[0]
        if not taken:  # not expected: a batch id is planned once
            log.warning("replay batch %s: another session holds its replay-process lock", batch_id)
            return
        self._pinger = threading.Thread(target=self._ping, args=(batch_id,), name="kafka2pg-replay-lock", daemon=True)
        self._pinger.start()

    def _ping(self, batch_id: int) -> None:
        while not self._done.wait(PING_S):
            try:
                self._conn.execute("SELECT 1")
            except psycopg.Error as exc:
                if not self._done.is_set():
                    log.warning(
                        "replay batch %s: cannot keep the lock that tells status and abandon this process runs (%s); "
                        "once PostgreSQL ends that session, status shows the batch as left by a process that is "
                        "gone, and an abandon would fence this replay",
                        batch_id,
                        " ".join(str(exc).split())[:200],
                    )
                return

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._pinger is not None:
            self._pinger.join(timeout=60)
            if self._pinger.is_alive():  # a ping stuck on the network: closing under it is unsafe
                log.warning("the replay-process lock's session did not answer; left to end with this process")
                return
        if self._conn is not None:
            self._conn.close()  # the lock goes with its transaction


def process_locks(conn: Connection) -> dict[int, int]:
    """The replay-process locks held now: lock key (pg_locks' objid) -> the holding backend's pid.
    Read before the batches it is matched with: a process that ends in between then finished its batch."""
    rows = conn.execute(
        "SELECT objid::bigint, min(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid = hashtext(%s)::oid AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database()) GROUP BY objid",
        (_KEY,),
    ).fetchall()
    return dict(rows)


def running_pid(locks: dict[int, int], batch_id: int) -> int | None:
    """The backend pid of the session of the batch's running `kafka2pg replay` process, if one runs."""
    return locks.get(batch_id % 2**32)
