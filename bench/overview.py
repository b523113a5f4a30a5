"""The operator's overview page on a long ledger: timed with 100 batches (the baseline) and again
after 10,000 more, in the same run; prints the ratio and the plans of the page's ledger queries.

A flat ratio means the page reads the ledger by index, whatever its length.
    ./kafka2pg python bench/overview.py [--batches 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from harness import bench_stack, best_of  # noqa: E402

from kafka2pg.config import get_pipeline  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.devtools.producer import produce, sample_events  # noqa: E402
from kafka2pg.kafka_offsets import ensure_topic  # noqa: E402
from kafka2pg.lifecycle import BatchState  # noqa: E402
from kafka2pg.migrations import migrate  # noqa: E402
from kafka2pg.stuck import OPEN_STATES, STUCK_AFTER_RUNS  # noqa: E402
from kafka2pg.web import app, require_airflow_user  # noqa: E402

NAME = "bench_overview"
# The overview's ledger reads (kafka2pg.status, kafka2pg.stuck), with this run's values.
QUERIES = {
    "last batch": (
        "SELECT batch_id, state, updated_at FROM kafka2pg.batches WHERE pipeline = %s ORDER BY batch_id DESC LIMIT 1",
        (NAME,),
    ),
    "stuck batches": (
        "SELECT b.batch_id FROM kafka2pg.batches b LEFT JOIN kafka2pg.batch_partitions p USING (batch_id)"
        " WHERE b.pipeline = %s AND b.failures >= %s AND b.state = ANY(%s) GROUP BY b.batch_id",
        (NAME, STUCK_AFTER_RUNS, OPEN_STATES),
    ),
    "ledger heads": ("SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (NAME,)),
}


def add_batches(database_url: str, count: int, state: BatchState = BatchState.PROMOTED) -> None:
    """`count` batches of the pipeline with one partition range each, as promotion leaves them."""
    with connect(database_url, autocommit=True) as conn:
        conn.execute(
            "WITH new AS (INSERT INTO kafka2pg.batches (pipeline, topic, state, plan, records_planned, records_read,"
            " rows_promoted, rows_quarantined, run_id) SELECT %s, %s, %s, '{}', 100, 100, 100, 0, 'bench__' || g"
            " FROM generate_series(1, %s) g RETURNING batch_id)"
            " INSERT INTO kafka2pg.batch_partitions (batch_id, kafka_partition, start_offset, end_offset, records_read)"
            " SELECT batch_id, 0, batch_id * 100, batch_id * 100 + 100, 100 FROM new",
            (NAME, NAME, str(state), count),
        )
        conn.execute("ANALYZE kafka2pg.batches")
        conn.execute("ANALYZE kafka2pg.batch_partitions")


def plans(database_url: str) -> dict[str, str]:
    with connect(database_url, autocommit=True) as conn:
        return {
            what: "\n".join(r[0] for r in conn.execute("EXPLAIN " + query, params))  # noqa: S608 - fixed text above
            for what, (query, params) in QUERIES.items()
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with bench_stack("kafka2pg-bench-overview-") as (settings, _stack, work):
        spec = {**yaml.safe_load((Path(__file__).resolve().parents[1] / "dags/pipelines.yaml").read_text())}
        (orders,) = spec["pipelines"]
        pipelines_file = work / "pipelines.yaml"
        pipelines_file.write_text(yaml.safe_dump({"pipelines": [{**orders, "name": NAME, "topic": NAME}]}))
        pipeline = get_pipeline(NAME, pipelines_file)
        ensure_topic(settings.bootstrap_servers, pipeline.topic, 3)
        produce(settings.bootstrap_servers, pipeline.topic, sample_events(300))
        migrate(settings.database_url, [pipeline])
        os.environ.update(
            KAFKA2PG_PIPELINES=str(pipelines_file),
            KAFKA2PG_DATABASE_URL=settings.database_url,
            KAFKA2PG_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
        )
        app.dependency_overrides[require_airflow_user] = lambda: "bench"
        client = TestClient(app)

        def overview() -> None:
            response = client.get("/")
            assert response.status_code == 200 and "pipeline-bench_overview" in response.text, response.text[:500]

        add_batches(settings.database_url, 100)
        overview()  # warm-up: imports, Kafka client metadata
        baseline = best_of(args.rounds, overview)
        add_batches(settings.database_url, args.batches)
        long = best_of(args.rounds, overview)
        found = plans(settings.database_url)
    print(
        f"overview page, best of {args.rounds}: {baseline * 1000:.0f} ms with 100 batches, "
        f"{long * 1000:.0f} ms with {100 + args.batches}: ratio {long / baseline:.2f}"
    )
    for what, plan in found.items():
        print(f"-- {what}\n{plan}")
    full_scans = [what for what, plan in found.items() if "Seq Scan on batches" in plan]
    if full_scans:
        print(f"FULL SCAN of kafka2pg.batches in: {', '.join(full_scans)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
