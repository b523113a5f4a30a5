"""What the plan step's schema check reports missing, decided from the catalog's answer alone."""

import yaml

from kafka2pg.config import get_pipeline
from kafka2pg.database import migration_files
from kafka2pg.migrations import (
    MIGRATIONS_TABLE,
    QUARANTINE_PRIVILEGES,
    QUARANTINE_TABLE,
    RAW,
    STAGING_PRIVILEGES,
    TARGET_PRIVILEGES,
    TableFound,
    readiness,
    staging_columns,
    target_columns,
)

MIGRATIONS = ["0001_control_tables.sql", "0002_batch_claims.sql"]


def pipeline(tmp_path):
    spec = {
        "name": "orders",
        "topic": "orders",
        "target_table": "sales.orders",
        "columns": [{"name": "n", "type": "text"}],
    }
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": [spec]}))
    return get_pipeline("orders", path)


def table(schema, name, relkind="r", columns=(), privileges=(), usage=True, updatable=()) -> TableFound:
    return TableFound(
        schema, name, relkind, usage, frozenset(columns), frozenset(privileges), updatable=frozenset(updatable)
    )


def ready_catalog(p) -> dict:
    return {
        MIGRATIONS_TABLE: table(*MIGRATIONS_TABLE, columns=["name"], privileges=["SELECT"]),
        ("sales", "orders"): table("sales", "orders", columns=target_columns(p), privileges=TARGET_PRIVILEGES),
        ("kafka2pg", "stg_orders"): table(
            "kafka2pg", "stg_orders", columns=["batch_id", "chunk", *staging_columns(p)], privileges=STAGING_PRIVILEGES
        ),
        QUARANTINE_TABLE: table(*QUARANTINE_TABLE, columns=RAW, privileges=QUARANTINE_PRIVILEGES[:3], updatable=RAW),
    }


def test_a_migrated_and_granted_database_lacks_nothing(tmp_path):
    p = pipeline(tmp_path)
    assert readiness(p, ready_catalog(p), set(MIGRATIONS), MIGRATIONS).missing == ()


def test_a_database_migrated_up_to_0008_has_the_deferred_checks_migration_pending(tmp_path):
    p = pipeline(tmp_path)
    shipped = [f.name for f in migration_files()]
    applied = {m for m in shipped if m < "0009"}
    missing = readiness(p, ready_catalog(p), applied, shipped).missing
    assert missing[0] == "migration 0009_deferred_checks.sql"
    assert missing == tuple(f"migration {m}" for m in shipped if m not in applied)


def test_a_database_never_migrated_has_every_migration_pending_and_no_pipeline_table(tmp_path):
    p = pipeline(tmp_path)
    empty = {key: table(*key, relkind=None) for key in ready_catalog(p)}
    assert readiness(p, empty, None, MIGRATIONS).missing == (
        "migration 0001_control_tables.sql",
        "migration 0002_batch_claims.sql",
        "table sales.orders",
        "table kafka2pg.stg_orders",
    )


def test_a_view_in_the_targets_place_a_schema_without_usage_and_an_unreadable_ledger_are_named(tmp_path):
    p = pipeline(tmp_path)
    catalog = ready_catalog(p)
    catalog[("sales", "orders")] = table("sales", "orders", relkind="v")
    catalog[("kafka2pg", "stg_orders")] = table(
        "kafka2pg", "stg_orders", columns=["batch_id", "chunk", *staging_columns(p)], privileges=["SELECT"], usage=False
    )
    catalog[MIGRATIONS_TABLE] = table(*MIGRATIONS_TABLE, columns=["name"])
    assert readiness(p, catalog, None, MIGRATIONS).missing == (
        "table sales.orders (it is a view, not a table)",
        "SELECT on public.kafka2pg_migrations",
        "USAGE on schema kafka2pg",
        "INSERT on kafka2pg.stg_orders",
        "UPDATE on kafka2pg.stg_orders",
        "DELETE on kafka2pg.stg_orders",
    )


def test_a_quarantine_whose_raw_bytes_the_role_may_not_fill_is_named_after_an_upgrade(tmp_path):
    """The column grant `kafka2pg grant` gives since promotion fills refused rows' raw bytes:
    a deployment upgraded without running it again lacks it (a whole-table UPDATE would do)."""
    p = pipeline(tmp_path)
    catalog = ready_catalog(p)
    catalog[QUARANTINE_TABLE] = table(*QUARANTINE_TABLE, columns=RAW, privileges=QUARANTINE_PRIVILEGES[:3])
    assert readiness(p, catalog, set(MIGRATIONS), MIGRATIONS).missing == (
        "UPDATE (raw_key, raw_value, raw_headers) on kafka2pg.quarantine",
    )
    catalog[QUARANTINE_TABLE] = table(*QUARANTINE_TABLE, columns=RAW, privileges=["UPDATE", *QUARANTINE_PRIVILEGES[:3]])
    assert readiness(p, catalog, set(MIGRATIONS), MIGRATIONS).missing == ()
    catalog[QUARANTINE_TABLE] = table(
        *QUARANTINE_TABLE, columns=RAW, privileges=QUARANTINE_PRIVILEGES[:3], updatable=["raw_key", "raw_value"]
    )
    assert readiness(p, catalog, set(MIGRATIONS), MIGRATIONS).missing == (
        "UPDATE (raw_key, raw_value, raw_headers) on kafka2pg.quarantine",
    )


def test_quarantine_columns_a_pending_migration_adds_are_left_to_it(tmp_path):
    """A database from before the raw-bytes columns: `migrate` adds them, so they are not named
    as columns to add by hand (the pending migrations are)."""
    p = pipeline(tmp_path)
    catalog = ready_catalog(p)
    catalog[QUARANTINE_TABLE] = table(*QUARANTINE_TABLE, columns=["raw_value"], privileges=QUARANTINE_PRIVILEGES[:3])
    missing = readiness(p, catalog, set(MIGRATIONS[:1]), MIGRATIONS).missing
    assert missing[0] == f"migration {MIGRATIONS[1]}" and not [m for m in missing if m.startswith("column ")]
    assert readiness(p, catalog, set(MIGRATIONS), MIGRATIONS).missing[:2] == (
        "column kafka2pg.quarantine.raw_key",
        "column kafka2pg.quarantine.raw_headers",
    )


def test_the_owner_advice_names_each_pipelines_connection_and_a_variable_a_shell_can_set():
    from kafka2pg.config import Column, Pipeline
    from kafka2pg.migrations import as_the_owner

    def pipeline(conn_id: str) -> Pipeline:
        return Pipeline("orders", "orders", "public", "orders", (Column("n", "n", "text"),), postgres_conn_id=conn_id)

    plain = as_the_owner([pipeline("warehouse_owner")])
    assert "as 'warehouse_owner' (e.g. AIRFLOW_CONN_WAREHOUSE_OWNER) for this command alone" in plain
    dashed = as_the_owner([pipeline("wh-owner.pg"), pipeline("kafka2pg_postgres")])
    assert "as 'kafka2pg_postgres' (e.g. AIRFLOW_CONN_KAFKA2PG_POSTGRES) or 'wh-owner.pg' (e.g. " in dashed
    assert "env 'AIRFLOW_CONN_WH-OWNER.PG=…')" in dashed
