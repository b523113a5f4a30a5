"""Whether the `kafka2pg replay` process that planned a replay batch still runs.

A CLI replay has no run to retry it: killed, its batch stays open for good, and only an operator
can abandon it. So the process holds, for as long as it lives, a session advisory lock on its
batch from a connection of its own. A killed process's session ends and the lock with it (a
host gone without closing its connection: when PostgreSQL's TCP keepalive gives up on it).
`status` reads the lock to say whether the process runs, and `abandon` refuses a batch whose
process still does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from psycopg import Connection

from kafka2pg.database import connect

_KEY = "kafka2pg.replay-process"


@contextmanager
def held_while_running(url: str, batch_id: int) -> Iterator[None]:
    """While the block runs, this process's session holds the batch's replay-process lock."""
    conn = connect(url, autocommit=True)
    try:
        conn.execute("SELECT pg_advisory_lock(hashtext(%s), hashtext(%s))", (_KEY, str(batch_id)))
        yield
    finally:
        conn.close()


def running_replays(conn: Connection, batch_ids: Iterable[int]) -> dict[int, int]:
    """Of the given batches, those whose replay process runs: batch id -> its session's backend pid."""
    ids = sorted(set(batch_ids))
    if not ids:
        return {}
    rows = conn.execute(
        "SELECT b.id, min(l.pid) FROM unnest(%s::bigint[]) AS b(id) JOIN pg_locks l ON l.locktype = 'advisory'"
        " AND l.granted AND l.objsubid = 2 AND l.classid = hashtext(%s)::oid AND l.objid = hashtext(b.id::text)::oid"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) GROUP BY b.id",
        (ids, _KEY),
    ).fetchall()
    return dict(rows)
