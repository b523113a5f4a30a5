"""The operator's overview and batches pages on a long ledger: timed with 100 batches (the baseline)
and again after 10,000 more, in the same run; prints the ratios and the plans of the pages' ledger
queries (the history page's too).

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

from kafka2pg.browse import BATCHES_QUERY, HISTORY_QUERY  # noqa: E402
from kafka2pg.config import get_pipeline  # noqa: E402
from kafka2pg.database import connect  # noqa: E402
from kafka2pg.devtools.producer import produce, sample_events  # noqa: E402
from kafka2pg.kafka_offsets import ensure_topic  # noqa: E402
from kafka2pg.lifecycle import BatchState  # noqa: E402
from kafka2pg.migrations import migrate  # noqa: E402
from kafka2pg.stuck import OPEN_STATES, STUCK_AFTER_RUNS  # noqa: E402
from kafka2pg.web import PAGE_SIZE, app, dag_reader, require_airflow_user  # noqa: E402

NAME = "bench_overview"
# The overview's ledger reads (kafka2pg.status, kafka2pg.stuck) and the batches and history
# pages' (kafka2pg.browse), with this run's values.
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
    "batches page": (BATCHES_QUERY, (NAME, None, None, PAGE_SIZE)),
    "history page": (HISTORY_QUERY, {"pipeline": NAME, "at": None, "source": None, "id": None, "limit": PAGE_SIZE}),
}


def add_batches(database_url: str, count: int, state: BatchState = BatchState.PROMOTED) -> None:
    """`count` batches of the pipeline with one partition range and a quality result each, as
    promotion leaves them."""
    with connect(database_url, autocommit=True) as conn:
        conn.execute(
            "WITH new AS (INSERT INTO kafka2pg.batches (pipeline, topic, state, plan, records_planned, records_read,"
            " rows_promoted, rows_quarantined, run_id) SELECT %s, %s, %s, '{}', 100, 100, 100, 0, 'bench__' || g"
            " FROM generate_series(1, %s) g RETURNING batch_id)"
            " , parts AS (INSERT INTO kafka2pg.batch_partitions (batch_id, kafka_partition, start_offset, end_offset,"
            " records_read) SELECT batch_id, 0, batch_id * 100, batch_id * 100 + 100, 100 FROM new)"
            " INSERT INTO kafka2pg.quality_results (batch_id, verdict, result)"
            " SELECT batch_id, 'promotable', '{}' FROM new",
            (NAME, NAME, str(state), count),
        )
        conn.execute("ANALYZE kafka2pg.batches")
        conn.execute("ANALYZE kafka2pg.batch_partitions")
        conn.execute("ANALYZE kafka2pg.quality_results")


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
        app.dependency_overrides[dag_reader] = lambda: lambda dag_id: True
        client = TestClient(app)

        def overview() -> None:
            response = client.get("/")
            assert response.status_code == 200 and "pipeline-bench_overview" in response.text, response.text[:500]

        def batches() -> None:
            response = client.get(f"/pipelines/{NAME}/batches")
            assert response.status_code == 200 and response.text.count("<tr data-batch=") == PAGE_SIZE, response.text

        add_batches(settings.database_url, 100)
        overview()  # warm-up: imports, Kafka client metadata
        batches()
        baseline = {page: best_of(args.rounds, page) for page in (overview, batches)}
        add_batches(settings.database_url, args.batches)
        long = {page: best_of(args.rounds, page) for page in (overview, batches)}
        found = plans(settings.database_url)
    for page, seconds in long.items():
        print(
            f"{page.__name__} page, best of {args.rounds}: {baseline[page] * 1000:.0f} ms with 100 batches, "
            f"{seconds * 1000:.0f} ms with {100 + args.batches}: ratio {seconds / baseline[page]:.2f}"
        )
    for what, plan in found.items():
        print(f"-- {what}\n{plan}")
    long_tables = ("batches", "quality_results")
    full_scans = [what for what, plan in found.items() if any(f"Seq Scan on {t} " in plan for t in long_tables)]
    if full_scans:
        print(f"FULL SCAN of kafka2pg.batches or kafka2pg.quality_results in: {', '.join(full_scans)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
