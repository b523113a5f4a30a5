"""What writing each row once would save PostgreSQL: the staging write, the gate's SQL and the
promotion's INSERT ... SELECT, against one binary COPY of the same rows into the target.

Stages one real batch of N events (the bench's ~200-byte events, `stage_batch` in a Spark
session), then measures the CPU time of the PostgreSQL backend running each statement (read from
/proc: the server runs on this machine), best of `--rounds`, scaled to 1M rows:
  staging write   the staged rows, binary COPY into an empty copy of the staging table (its index too)
  gate SQL        the gate's SQL checks, its counts and the fetch of the accepted rows for GX
  promotion now   INSERT ... SELECT of the accepted rows into an empty copy of the target
  COPY to target  the same rows, binary COPY into another empty copy of the target (write-once)
and the CPU time of this process (the client side) for the work each way does outside PostgreSQL,
on the batch's rows as the chunk writers frame them (read and admitted here, untimed):
  now         the chunk writers' binary COPY encoding; the gate's rows for GX fetched into pandas
  write-once  each chunk as an Arrow IPC file, written, fsynced and hashed (SHA-256); the files read
              back and their hashes checked; the gate's counts in Arrow (per-partition rows,
              provenance and in-batch business-key duplicates, required NULLs, ranged minimums and
              maximums); the rows for GX from Arrow; the accepted rows' binary COPY encoding
    ./kafka2pg python bench/write_once.py [--events 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from harness import bench_spark, bench_stack, padded_events, planned_batch  # noqa: E402
from psycopg import Connection, sql  # noqa: E402

from kafka2pg import checks, expectations  # noqa: E402
from kafka2pg.admission import decoder_for  # noqa: E402
from kafka2pg.batch_store import load_batch  # noqa: E402
from kafka2pg.chunk_writer import frame, no_timestamp_as_null, refuse_unreadable_timestamps, staging_copy  # noqa: E402
from kafka2pg.config import Pipeline, Settings  # noqa: E402
from kafka2pg.copy_binary import copy_rows as encoded  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.kafka_reader import read_ranges  # noqa: E402
from kafka2pg.migrations import PROVENANCE, target_columns  # noqa: E402
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


def client_cpu(rounds: int, work: Callable[[], object]) -> float:
    """The least CPU time of this process over `rounds` runs of `work`."""
    best = float("inf")
    for _ in range(rounds):
        before = time.process_time()
        work()
        best = min(best, time.process_time() - before)
    return best


def framed_chunks(settings: Settings, pipeline: Pipeline, batch) -> list[pa.Table]:
    """The batch's staging rows as the chunk writers frame them: read and admitted in this process."""
    decoder = decoder_for(pipeline)
    tables = []
    for records in read_ranges(settings.kafka, batch.plan.topic, batch.plan.ranges, "wbench", 60):
        admitted = decoder.admit(records.column("value").to_pylist())
        records, admitted = refuse_unreadable_timestamps(no_timestamp_as_null(records), admitted)
        tables.append(frame(records, admitted, decoder, batch.batch_id, 0, batch.plan.topic))
    return tables


def write_files(tables: list[pa.Table], folder: Path) -> dict[Path, str]:
    """Each chunk as an Arrow IPC file, fsynced, and its SHA-256 (a manifest would record it)."""
    hashes = {}
    for n, table in enumerate(tables):
        path = folder / f"chunk-{n}.arrow"
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        data = sink.getvalue()
        with open(path, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        hashes[path] = hashlib.sha256(data).hexdigest()
    return hashes


def read_files(hashes: dict[Path, str]) -> pa.Table:
    """The chunk files read back, each refused unless its hash is the manifest's."""
    tables = []
    for path, digest in hashes.items():
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError(f"{path} is not the file written")
        tables.append(pa.ipc.open_file(pa.py_buffer(data)).read_all())
    return pa.concat_tables(tables)


def arrow_gate(table: pa.Table, pipeline: Pipeline) -> dict:
    """The gate's counts over the batch's rows in Arrow (one topic per batch: provenance is
    partition and offset)."""
    per_partition = table.group_by("kafka_partition").aggregate([([], "count_all")])
    provenance = table.group_by(["kafka_partition", "kafka_offset"]).aggregate([([], "count_all")])
    accepted = table.filter(pc.is_null(table.column("quarantine_reason")))
    keys = accepted.group_by(list(pipeline.business_key)).aggregate([([], "count_all")])
    return {
        "partitions": per_partition.num_rows,
        "provenance duplicates": table.num_rows - provenance.num_rows,
        "key duplicates": accepted.num_rows - keys.num_rows,
        "required NULLs": {c: accepted.column(c).null_count for c in pipeline.required_columns},
        "ranges": {c.name: pc.min_max(accepted.column(c.name)).as_py() for c in pipeline.columns if c.ranged},
    }


def rows_for_gx(table: pa.Table, pipeline: Pipeline):
    """The accepted rows' columns the GX suite reads, as the pandas frame `expectations.load_accepted` makes."""
    accepted = table.filter(pc.is_null(table.column("quarantine_reason")))
    names, ranged_columns = expectations.gx_columns(pipeline)
    ranged = {c.name for c in ranged_columns}
    as_text = {c.name for c in pipeline.columns if c.type == "jsonb"}
    columns = [
        pc.cast(accepted.column(n), pa.float64())
        if n in ranged
        else (pc.cast(accepted.column(n), pa.string()) if n in as_text else accepted.column(n))
        for n in names
    ]
    frame = pa.Table.from_arrays(columns, names=names).to_pandas()
    frame["kafka_topic"] = frame["kafka_topic"].astype("category")
    return frame


def promotion_rows(table: pa.Table, pipeline: Pipeline) -> pa.Buffer:
    """The accepted rows' binary COPY into the target, encoded."""
    accepted = table.filter(pc.is_null(table.column("quarantine_reason")))
    names = target_columns(pipeline)
    types = dict(zip(["batch_id", "chunk", *PROVENANCE], staging_copy(pipeline).types, strict=False))
    types |= {c.name: c.type for c in pipeline.columns}
    return encoded(accepted.select(names), [types[n] for n in names])


def client_figures(settings: Settings, pipeline: Pipeline, batch, rounds: int) -> tuple[int, dict[str, float]]:
    """The client side's CPU seconds, best of `rounds`, for each piece of work either way does
    outside PostgreSQL, and the rows they ran on."""
    tables = framed_chunks(settings, pipeline, batch)
    table = pa.concat_tables(tables)
    types = staging_copy(pipeline).types
    with tempfile.TemporaryDirectory(prefix="kafka2pg-write-once-") as folder:
        hashes = write_files(tables, Path(folder))
        figures = {
            "now: staging COPY encoding (the tasks)": client_cpu(rounds, lambda: [encoded(t, types) for t in tables]),
            "now: the gate's rows for GX, fetched": client_cpu(
                rounds, lambda: _fetched_for_gx(settings.database_url, pipeline, batch.batch_id)
            ),
            "write-once: IPC files written, fsynced, hashed": client_cpu(
                rounds, lambda: write_files(tables, Path(folder))
            ),
            "write-once: files read back, hashes checked": client_cpu(rounds, lambda: read_files(hashes)),
            "write-once: the gate's counts in Arrow": client_cpu(rounds, lambda: arrow_gate(table, pipeline)),
            "write-once: the rows for GX from Arrow": client_cpu(rounds, lambda: rows_for_gx(table, pipeline)),
            "write-once: promotion COPY encoding": client_cpu(rounds, lambda: promotion_rows(table, pipeline)),
        }
    return table.num_rows, figures


def _fetched_for_gx(url: str, pipeline: Pipeline, batch_id: int):
    with connect(url) as conn:
        return expectations.load_accepted(conn, pipeline, batch_id)


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
        framed, client = client_figures(settings, pipeline, batch, args.rounds)
        with connect(url) as conn:
            landed = {
                n: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(copies[n])).fetchone()[0] for n in copies
            }
    if landed != {"staging": staged_rows, "insert": rows, "copy": rows}:
        print(f"the copies hold {landed} rows, not the batch's {staged_rows} staged, {rows} accepted: no figures")
        return 1
    scale = 1_000_000 / rows
    if framed != staged_rows:
        print(f"the framed chunks hold {framed} rows, not the batch's {staged_rows} staged: no figures")
        return 1
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
    print(f"The client side's CPU (this process), {framed} framed rows, best of {args.rounds}, per 1M rows:")
    for label, seconds in client.items():
        print(f"  {label:<50} {seconds * scale:6.2f} core-s")
    client_now = sum(v for k, v in client.items() if k.startswith("now"))
    client_once = sum(v for k, v in client.items() if k.startswith("write-once"))
    print(
        f"  {'client side now':<50} {client_now * scale:6.2f} core-s\n"
        f"  {'client side write-once':<50} {client_once * scale:6.2f} core-s\n"
        f"both sides: now {(now + client_now) * scale:.2f}, write-once {(once + client_once) * scale:.2f} core-s per 1M"
        f" (write-once saves {(now + client_now - once - client_once) * scale:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
