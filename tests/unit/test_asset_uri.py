"""The Asset a promotion announces: the target table's URI from the resolved connection (host, port,
database; never user or password), in the form Airflow keeps as is, and the event's extra."""

import json

import pytest
from airflow.sdk import Asset

from kafka2pg.asset_events import run_event, target_uri
from kafka2pg.batch_store import Batch
from kafka2pg.lifecycle import BatchState
from kafka2pg.planner import BatchPlan, Gap, OffsetRange, PartitionPlan


@pytest.mark.parametrize(
    ("conninfo", "uri"),
    [
        (
            "host=db.example.com port=6432 dbname=sales user=loader password=s3cret sslmode=require",
            "postgres://db.example.com:6432/sales/analytics/orders",
        ),
        (
            "postgresql://loader:s3cret@db.example.com/sales?sslmode=require",
            "postgres://db.example.com:5432/sales/analytics/orders",
        ),
        (
            "host=a.example.com,b.example.com port=5433,5434 dbname=sales user=loader password=s3cret",
            "postgres://a.example.com:5433/sales/analytics/orders",
        ),
        ("host=/var/run/postgresql dbname=sales", "postgres://%2Fvar%2Frun%2Fpostgresql:5432/sales/analytics/orders"),
        ("host=::1 dbname=sales", "postgres://[::1]:5432/sales/analytics/orders"),
        ("user=loader password=s3cret", "postgres://localhost:5432/loader/analytics/orders"),
    ],
)
def test_target_uri_names_host_port_database_schema_table_and_no_secret(conninfo, uri):
    built = target_uri(conninfo, "analytics", "orders")
    assert built == uri
    assert "s3cret" not in built and "loader@" not in built
    # Airflow's own sanitizer (the postgres provider's, for this scheme) keeps it unchanged, so a
    # downstream DAG scheduled on Asset("<uri>") and the event name one and the same asset.
    asset = Asset(uri=built)
    assert (asset.uri, asset.name) == (built, built)
    assert Asset(built) == asset


def test_a_run_event_sums_its_batches_and_joins_their_ranges():
    first = BatchPlan(
        "orders",
        "orders-topic",
        (
            PartitionPlan(0, 100, None, OffsetRange(0, 100, 160)),
            PartitionPlan(1, 5, Gap(1, 5, 9, "retention_gap"), OffsetRange(1, 9, 12)),
            PartitionPlan(2, None, None, None),
        ),
    )
    second = BatchPlan(
        "orders",
        "orders-topic",
        (
            PartitionPlan(0, 160, None, OffsetRange(0, 160, 170)),
            PartitionPlan(1, 12, Gap(1, 12, 15, "retention_gap"), OffsetRange(1, 15, 20)),
        ),
    )
    batches = [
        Batch(6, "orders", "orders-topic", BatchState.PROMOTED, first, rows_promoted=60, rows_quarantined=3),
        Batch(7, "orders", "orders-topic", BatchState.PROMOTED, second, rows_promoted=14, rows_quarantined=1),
    ]
    event = run_event("postgres://db:5432/sales/analytics/orders", batches)
    assert event.uri == "postgres://db:5432/sales/analytics/orders"
    assert json.loads(json.dumps(event.extra)) == {
        "batch_id": 6,
        "batch_ids": [6, 7],
        "kind": "live",
        "rows": 74,
        "quarantined": 4,
        "ranges": [
            {"partition": 0, "start": 100, "end": 170},
            {"partition": 1, "start": 9, "end": 12},
            {"partition": 1, "start": 15, "end": 20},
        ],
    }
    assert run_event("postgres://db:5432/sales/analytics/orders", []) is None
