"""What writing each row once would save PostgreSQL: the staging write, the gate's SQL and the
promotion's INSERT ... SELECT, against one binary COPY of the same rows into the target.

Stages one real batch of N events (the bench's ~200-byte events, `stage_batch` in a Spark
session), then measures the CPU time of the PostgreSQL backend running each statement (read from
/proc: the server runs on this machine), best of `--rounds`, scaled to 1M rows:
  staging write   the staged rows, binary COPY into an empty copy of the staging table (its index too)
  gate SQL        the gate's SQL checks, its counts and the fetch of the accepted rows for GX
  promotion now   INSERT ... SELECT of the accepted rows into an empty copy of the target
  COPY to target  the same rows, binary COPY into another empty copy of the target (write-once)
    ./kafka2pg python bench/write_once.py [--events 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bench_spark, bench_stack, padded_events, planned_batch  # noqa: E402
from psycopg import Connection, sql  # noqa: E402

from kafka2pg import checks, expectations  # noqa: E402
from kafka2pg.batch_store import load_batch  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.migrations import target_columns  # noqa: E402
from kafka2pg.rows import staged_counts  # noqa: E402
from kafka2pg.staging import stage_batch  # noqa: E402

SIZE = 200  # bytes of JSON per event, as bench/compare.py's default


def backend_cpu(conn: Connection) -> float:
    """CPU seconds the connection's PostgreSQL backend has used so far."""
    fields = Path(f"/proc/{conn.info.backend_pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(url: str, rounds: int, prepare: Callable[[Connection], None], work: Callable[[Connection], None]) -> float:
    """The least backend CPU of `rounds` runs of `work`, each on a new connection after `prepare`."""
    best = float("inf")
    for _ in range(rounds):
        with connect(url, autocommit=True) as conn:
            prepare(conn)
            conn.execute("CHECKPOINT")
            before = backend_cpu(conn)
            with conn.transaction():
                work(conn)
            best = min(best, backend_cpu(conn) - before)
    return best


def copy_rows(conn: Connection, query: sql.Composable, into: sql.Composable) -> None:
    """Binary COPY of `query`'s rows `into` a table (and columns), the bytes held in memory first
    (a client sending them)."""
    with connect(conn.info.dsn, autocommit=True) as source:
        with source.cursor().copy(sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(query)) as out:
            data = b"".join(bytes(block) for block in out)
    with conn.cursor().copy(sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(into)) as copy:
        for start in range(0, len(data), 1 << 17):
            copy.write(data[start : start + (1 << 17)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with bench_stack("kafka2pg-bench-") as (settings, _, work):
        pipeline, batch = planned_batch(settings, "wbench", padded_events(args.events, SIZE), 6, args.events)
        spark = bench_spark("local[2]", "wbench", work)
        stage_batch(spark, settings, pipeline, batch.batch_id)
        spark.stop()

        url = settings.database_url
        staging = sql.Identifier("kafka2pg", pipeline.staging_table)
        target = sql.Identifier(pipeline.target_schema, pipeline.target_table)
        copies = {name: sql.Identifier("public", f"wbench_{name}") for name in ("staging", "insert", "copy")}
        names = [*target_columns(pipeline)]
        columns = sql.SQL(", ").join(map(sql.Identifier, names))
        accepted = sql.SQL("SELECT {} FROM {} WHERE batch_id = {} AND quarantine_reason IS NULL").format(
            columns, staging, sql.Literal(batch.batch_id)
        )
        with connect(url, autocommit=True) as conn:
            rows = conn.execute(sql.SQL("SELECT count(*) FROM ({}) a").format(accepted)).fetchone()[0]
            staged_rows = sum(staged_counts(conn, pipeline, batch.batch_id).values())
            conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {} INCLUDING ALL)").format(copies["staging"], staging))
            for name in ("insert", "copy"):
                conn.execute(sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(copies[name], target))
        everything = sql.SQL("SELECT * FROM {} WHERE batch_id = {}").format(staging, sql.Literal(batch.batch_id))

        def truncate(table: sql.Identifier) -> Callable[[Connection], None]:
            return lambda conn: conn.execute(sql.SQL("TRUNCATE {}").format(table))

        def gate(conn: Connection) -> None:
            witnesses = checks.gap_witnesses(settings, pipeline, batch.batch_id)
            loaded = load_batch(conn, batch.batch_id)
            counted = staged_counts(conn, pipeline, batch.batch_id)
            checks.run_checks(conn, pipeline, loaded, False, counted, witnesses)  # the key probe deferred, as in a run
            checks.quarantined_rows(conn, pipeline, batch.batch_id)
            expectations.load_accepted(conn, pipeline, batch.batch_id)

        figures = {
            "staging write (binary COPY into staging)": measured(
                url,
                args.rounds,
                truncate(copies["staging"]),
                lambda conn: copy_rows(conn, everything, copies["staging"]),
            ),
            "gate SQL (checks, counts, rows for GX)": measured(url, args.rounds, lambda conn: None, gate),
            "promotion now (INSERT ... SELECT)": measured(
                url,
                args.rounds,
                truncate(copies["insert"]),
                lambda conn: conn.execute(
                    sql.SQL("INSERT INTO {} ({}) {}").format(copies["insert"], columns, accepted)
                ),
            ),
            "write-once promotion (binary COPY)": measured(
                url,
                args.rounds,
                truncate(copies["copy"]),
                lambda conn: copy_rows(conn, accepted, sql.SQL("{} ({})").format(copies["copy"], columns)),
            ),
        }
        with connect(url) as conn:
            landed = {
                n: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(copies[n])).fetchone()[0] for n in copies
            }
    if landed != {"staging": staged_rows, "insert": rows, "copy": rows}:
        print(f"the copies hold {landed} rows, not the batch's {staged_rows} staged, {rows} accepted: no figures")
        return 1
    scale = 1_000_000 / rows
    print(f"PostgreSQL backend CPU, {rows} staged rows, best of {args.rounds}, per 1M rows:")
    for label, seconds in figures.items():
        print(f"  {label:<44} {seconds * scale:6.2f} core-s")
    now = sum(list(figures.values())[:3])
    once = figures["write-once promotion (binary COPY)"]
    print(
        f"  {'now: staging + gate + INSERT':<44} {now * scale:6.2f} core-s\n"
        f"  {'write-once: COPY into the target only':<44} {once * scale:6.2f} core-s"
        f" (saves {(now - once) * scale:.2f}, before the work write-once moves out of PostgreSQL)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
