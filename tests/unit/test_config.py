"""The pipelines file is validated with errors that name the file and the field."""

import pytest
import yaml

from kafka2pg.config import DEFAULT_PIPELINES_FILE, Settings, get_pipeline, load_pipelines
from kafka2pg.exceptions import ConfigError, UnknownPipelineError

GOOD = {
    "name": "orders",
    "topic": "orders",
    "target_table": "public.orders",
    "business_key": ["event_id"],
    "columns": [{"name": "event_id", "type": "text", "required": True}, {"name": "n", "type": "numeric(10,2)"}],
}


def write(tmp_path, **changes):
    spec = {**GOOD, **changes}
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": [spec]}))
    return path


def test_shipped_pipelines_file_is_valid():
    pipelines = load_pipelines(DEFAULT_PIPELINES_FILE)
    assert "orders" in pipelines and pipelines["orders"].business_key == ("event_id",)


def test_good_file_parses_with_defaults(tmp_path):
    pipeline = get_pipeline("orders", write(tmp_path))
    assert pipeline.max_records_per_batch == 100_000 and pipeline.batches_per_run == 1
    assert pipeline.duplicate_policy == "quarantine" and pipeline.on_retention_loss == "fail"
    assert pipeline.columns[1].spark_type == "decimal(10,2)"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"max_records_per_batch": 0},
            r"pipelines\[0\] \(orders\)\.max_records_per_batch: expected a positive integer",
        ),
        ({"batches_per_run": -2}, r"\(orders\)\.batches_per_run: expected a positive integer"),
        ({"on_retention_loss": "ignore"}, r"on_retention_loss: expected one of fail, skip"),
        ({"columns": [{"name": "x", "type": "money"}]}, r"columns\[0\]\.type: unsupported type 'money'"),
        ({"business_key": ["nope"]}, r"business_key: 'nope' is not one of the columns"),
        ({"business_key": ["event_id", "event_id"]}, r"business_key: 'event_id' is listed twice"),
        ({"target_table": "Bad-Name"}, r"target_table: expected 'table' or 'schema.table'"),
        ({"colums": []}, r"unknown field\(s\) colums"),
        ({"name": "Orders!"}, r"pipelines\[0\]\.name: expected a lower-case identifier"),
        ({"columns": [{"name": "kafka_offset", "type": "bigint"}]}, r"'kafka_offset' is reserved"),
    ],
)
def test_bad_field_is_named(tmp_path, changes, message):
    path = write(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as info:
        load_pipelines(path)
    assert str(path) in str(info.value)


def test_unknown_pipeline_lists_known_ones(tmp_path):
    with pytest.raises(UnknownPipelineError, match=r"unknown pipeline 'nope'.*known: orders"):
        get_pipeline("nope", write(tmp_path))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="pipelines file not found"):
        load_pipelines(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipelines: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipelines(bad)


def test_settings_name_missing_environment_variables():
    with pytest.raises(ConfigError, match="KAFKA2PG_BOOTSTRAP_SERVERS, KAFKA2PG_DATABASE_URL"):
        Settings.from_env({})


def test_column_rules_parse_typed_and_bad_rules_name_the_field(tmp_path):
    ranged = {"name": "n", "type": "numeric(10,2)", "min": 0, "max": 10, "on_violation": "quarantine"}
    listed = {"name": "k", "type": "integer", "allowed": [1, 2]}
    columns = get_pipeline("orders", write(tmp_path, columns=[GOOD["columns"][0], ranged, listed])).columns
    assert (columns[1].minimum, columns[1].maximum, columns[1].on_violation) == (0.0, 10.0, "quarantine")
    assert (columns[2].allowed, columns[2].on_violation) == ((1, 2), "fail")
    for bad, message in (
        ({"type": "bigint", "min": 5, "max": 1}, r"columns\[1\]: min 5.0 is above max 1.0"),
        ({"type": "bigint", "max": "ten"}, r"columns\[1\].max: expected a number"),
        ({"type": "text", "min": 1}, r"columns\[1\].min: only numeric columns can have a range, not text"),
        ({"type": "bigint", "allowed": [1, "2"]}, r"columns\[1\].allowed: values \['2'\] are not of the column's type"),
        ({"type": "jsonb", "allowed": [1]}, r"columns\[1\].allowed: only text, bigint, integer, boolean columns"),
        ({"type": "bigint", "on_violation": "ignore"}, r"columns\[1\].on_violation: expected one of fail, quarantine"),
    ):
        path = write(tmp_path, columns=[GOOD["columns"][0], {"name": "n", **bad}])
        with pytest.raises(ConfigError, match=message):
            get_pipeline("orders", path)
