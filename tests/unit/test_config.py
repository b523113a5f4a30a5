"""The pipelines file is validated with errors that name the file and the field."""

import re
from dataclasses import replace

import pytest
import yaml

from kafka2pg.config import (
    KAFKA_READERS,
    MAX_PIPELINE_NAME,
    VALUE_FORMATS,
    Pipeline,
    Settings,
    default_pipelines_file,
    get_pipeline,
    load_pipelines,
    read_pipelines,
)
from kafka2pg.exceptions import ConfigError, UnknownPipelineError

GOOD = {
    "name": "orders",
    "topic": "orders",
    "target_table": "public.orders",
    "business_key": ["event_id"],
    "columns": [{"name": "event_id", "type": "text", "required": True}, {"name": "n", "type": "numeric(10,2)"}],
}


def write(tmp_path, **changes):
    return write_all(tmp_path, {**GOOD, **changes})


def write_all(tmp_path, *specs):
    path = tmp_path / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"pipelines": list(specs)}))
    return path


def column(name="n", **spec):
    return {"name": name, "type": "text", **spec}


def test_shipped_pipelines_file_is_valid():
    pipelines = load_pipelines(default_pipelines_file())
    assert "orders" in pipelines and pipelines["orders"].business_key == ("event_id",)


def test_good_file_parses_with_defaults(tmp_path):
    pipeline = get_pipeline("orders", write(tmp_path))
    assert pipeline.max_records_per_batch == 100_000 and pipeline.batches_per_run == 1
    assert pipeline.duplicate_policy == "quarantine" and pipeline.on_retention_loss == "fail"
    assert pipeline.columns[1].spark_type == "decimal(10,2)"
    assert pipeline.spark_log_level == "WARN"
    assert get_pipeline("orders", write(tmp_path, spark_log_level="INFO")).spark_log_level == "INFO"
    assert pipeline.kafka_reader == "librdkafka"
    assert get_pipeline("orders", write(tmp_path, kafka_reader="spark")).kafka_reader == "spark"
    assert pipeline.value_format == "json"
    assert get_pipeline("orders", write(tmp_path, value_format="schema_registry_json")).value_format == (
        "schema_registry_json"
    )
    assert pipeline.task_timeout_minutes is None
    assert get_pipeline("orders", write(tmp_path, task_timeout_minutes=None)).task_timeout_minutes is None
    assert get_pipeline("orders", write(tmp_path, task_timeout_minutes=45)).task_timeout_minutes == 45.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"max_records_per_batch": 0},
            r"pipelines\[0\] \(orders\)\.max_records_per_batch: expected a positive integer",
        ),
        ({"batches_per_run": -2}, r"\(orders\)\.batches_per_run: expected a positive integer"),
        (
            {"max_records_per_batch": None},
            r"max_records_per_batch: expected a positive integer, got None \(leave it out for the default, 100000\)",
        ),
        ({"data_loss_warning_hours": None}, r"data_loss_warning_hours: expected a positive number, got None \(leave"),
        ({"task_timeout_minutes": 0}, r"\(orders\)\.task_timeout_minutes: expected a positive number, got 0$"),
        ({"task_timeout_minutes": 0.5}, r"\(orders\)\.task_timeout_minutes: expected at least 1 \(minute\), got 0.5$"),
        ({"task_timeout_minutes": float("inf")}, r"task_timeout_minutes: expected a positive number, got inf"),
        ({"task_timeout_minutes": "1h"}, r"task_timeout_minutes: expected a positive number, got '1h'"),
        ({"task_timeout_minutes": 1e13}, r"task_timeout_minutes: expected at most 527040 \(a year\), got 1e\+13"),
        (
            {"business_key": False},
            r"\(orders\)\.business_key: expected a column name or a list of column names, got False",
        ),
        ({"business_key": {}}, r"\(orders\)\.business_key: expected a column name or a list of column names, got \{\}"),
        ({"business_key": 0}, r"\(orders\)\.business_key: expected a column name or a list of column names, got 0"),
        ({"on_retention_loss": "ignore"}, r"on_retention_loss: expected one of fail, skip"),
        ({"kafka_reader": "java"}, r"\(orders\)\.kafka_reader: expected one of librdkafka, spark, got 'java'"),
        ({"value_format": "avro"}, r"\(orders\)\.value_format: expected one of json, schema_registry_json, got 'avro'"),
        ({"columns": [{"name": "x", "type": "money"}]}, r"columns\[0\]\.type: unsupported type 'money'"),
        ({"business_key": ["nope"]}, r"business_key: 'nope' is not one of the columns"),
        ({"business_key": ["event_id", "event_id"]}, r"business_key: 'event_id' is listed twice"),
        ({"target_table": "Bad-Name"}, r"target_table: expected 'table' or 'schema.table'"),
        (
            {"colums": []},
            r"unknown field\(s\) colums \(did you mean 'columns' for 'colums'\?\)\. A pipeline's fields: ",
        ),
        (
            {"columns": [{"name": "x", "type": "text", "requird": True}]},
            r"\[0\]: unknown field\(s\) requird \(did you mean 'required'",
        ),
        ({"name": "Orders!"}, r"pipelines\[0\]\.name: expected a lower-case identifier"),
        ({"columns": [{"name": "kafka_offset", "type": "bigint"}]}, r"'kafka_offset' is reserved"),
        # A `$` anchor lets a trailing newline through (into `public."orders\n"`): names must match whole.
        ({"name": "orders\n"}, r"pipelines\[0\]\.name: expected a lower-case identifier"),
        ({"target_table": "public.orders\n"}, r"\(orders\)\.target_table: expected 'table' or 'schema.table'"),
        ({"target_table": "sales\n.orders"}, r"\(orders\)\.target_table: expected 'table' or 'schema.table'"),
        ({"columns": [column("event_id\n")]}, r"\(orders\)\.columns\[0\]\.name: expected a lower-case identifier"),
        ({"topic": "orders\n"}, r"\(orders\)\.topic: expected a Kafka topic name"),
        ({"topic": "."}, r"\(orders\)\.topic: expected a Kafka topic name .*not '\.' or '\.\.'"),
        ({"topic": ".."}, r"\(orders\)\.topic: expected a Kafka topic name"),
        ({"lag_consumer_group": "lag group"}, r"\(orders\)\.lag_consumer_group: expected a Kafka consumer group id"),
        ({"lag_consumer_group": ""}, r"\(orders\)\.lag_consumer_group: expected a Kafka consumer group id"),
        ({"topic": "t" * 250}, r"\(orders\)\.topic: expected a Kafka topic name \(1-249 characters"),
        # Names PostgreSQL would truncate: `stg_<name>` of two pipelines could become one table.
        ({"name": "p" * (MAX_PIPELINE_NAME + 1)}, r"pipelines\[0\]\.name: .*at most 55 characters"),
        ({"target_table": "t" * 64}, r"\(orders\)\.target_table: .*at most 63 characters"),
        ({"target_table": "s" * 64 + ".t"}, r"\(orders\)\.target_table: .*at most 63 characters"),
        ({"columns": [column("c" * 64)]}, r"\(orders\)\.columns\[0\]\.name: .*at most 63 characters"),
        ({"target_table": "kafka2pg.orders"}, r"\(orders\)\.target_table: 'kafka2pg.orders' is kafka2pg's own"),
        ({"target_table": "kafka2pg_migrations"}, r"\(orders\)\.target_table: 'kafka2pg_migrations' is kafka2pg's"),
        ({"target_table": "pg_catalog.orders"}, r"\(orders\)\.target_table: schema 'pg_catalog' is PostgreSQL's"),
        ({"target_table": "information_schema.x"}, r"target_table: schema 'information_schema' is PostgreSQL's"),
        ({"columns": [column("xmin")]}, r"\(orders\)\.columns\[0\]\.name: 'xmin' is a PostgreSQL system column"),
        ({"columns": [column("ctid")]}, r"\(orders\)\.columns\[0\]\.name: 'ctid' is a PostgreSQL system column"),
        ({"columns": [column("tableoid")]}, r"columns\[0\]\.name: 'tableoid' is a PostgreSQL system column"),
        # PostgreSQL's numeric holds at most 1000 digits.
        (
            {"columns": [column(type="numeric(1001,2)")]},
            r"columns\[0\]\.type: 'numeric\(1001,2\)': precision must be 1 to 1000",
        ),
        (
            {"columns": [column(type="numeric(0,0)")]},
            r"columns\[0\]\.type: 'numeric\(0,0\)': precision must be 1 to 1000",
        ),
        ({"columns": [column(type="numeric(5,10)")]}, r"columns\[0\]\.type: .*scale 10 is above precision 5"),
        ({"columns": [column(type="numeric(\uff11\uff12,\uff12)")]}, r"columns\[0\]\.type: unsupported type"),
        ({"columns": [column(type="numeric(12,\u30002)")]}, r"columns\[0\]\.type: unsupported type"),
        ({"columns": [column(type="numeric(99999,2)")]}, r"columns\[0\]\.type: unsupported type"),
        ({"columns": [column("raw_key")]}, r"columns\[0\]\.name: 'raw_key' is reserved"),
        (
            {"columns": [column("a", field="ts"), column("b", field="ts")]},
            r"\(orders\)\.columns\[1\]\.field: JSON field 'ts' is already read by columns\[0\]",
        ),
        ({"columns": [column(field="ts\n")]}, r"\(orders\)\.columns\[0\]\.field: .*no control characters"),
        ({"business_key": ["n"], "columns": [column(type="jsonb")]}, r"\(orders\)\.business_key: 'n' is a jsonb"),
        ({"business_key": {"event_id": 1}}, r"\(orders\)\.business_key: expected a column name or a list"),
        ({"business_key": [["event_id"]]}, r"\(orders\)\.business_key: expected a column name or a list"),
        (
            {"columns": [{"name": "event_id", "type": "text", "required": False}]},
            r"\(orders\)\.columns\[0\]\.required: 'event_id' is in business_key.*remove `required: false`",
        ),
        # Not the value: it may hold the secrets of the settings it meant to give.
        (
            {"spark_conf": ["spark.x.secret=1"]},
            r"\(orders\)\.spark_conf: expected a mapping of Spark settings, got a list$",
        ),
        ({"spark_conf": {"spark.x": None}}, r"\(orders\)\.spark_conf: spark.x: expected a string or number"),
        ({"spark_log_level": "info"}, r"\(orders\)\.spark_log_level: expected one of WARN, ERROR, INFO, DEBUG"),
        # YAML's lists and mappings where a type name goes (unhashable: a TypeError escaped).
        ({"columns": [column(type=["text"])]}, r"columns\[0\]\.type: unsupported type \['text'\]"),
        ({"columns": [column(type={"a": 1})]}, r"columns\[0\]\.type: unsupported type \{'a': 1\}"),
        # Five fields are not yet a cron expression: Airflow refused it when it parsed the DAG file.
        ({"replay_interval": "a b c d e"}, r"\(orders\)\.replay_interval: expected a 5-field cron expression"),
        ({"replay_interval": "0 0 31 2 9"}, r"\(orders\)\.replay_interval: expected a 5-field cron expression"),
        # A bound no value can be compared with (.nan flagged every row) or beyond every value.
        (
            {"columns": [column(type="numeric(10,2)", min=float("nan"))]},
            r"columns\[0\]\.min: expected a finite number, got nan",
        ),
        (
            {"columns": [column(type="numeric(10,2)", max=float("inf"))]},
            r"columns\[0\]\.max: expected a finite number, got inf",
        ),
        ({"columns": [column(type="numeric(10,2)", max=10**400)]}, r"columns\[0\]\.max: expected a finite number"),
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
    # Where, not the line: it may hold a secret (a spark_conf value), and the error shows in Airflow's UI.
    bad.write_text('pipelines:\n  - name: a\n    spark_conf:\n      spark.authenticate.secret: "Rpc-s3cret-1187\n')
    with pytest.raises(ConfigError) as invalid:
        load_pipelines(bad)
    assert str(invalid.value).endswith(
        "not valid YAML: while scanning a quoted scalar (line 4, column 34); found unexpected end of stream "
        "(line 5, column 1)"
    ), str(invalid.value)
    bad.write_text(
        "pipelines:\n  - name: a\n    spark_conf:\n      spark.authenticate.secret: !!float Rpc-s3cret-1187\n"
    )
    with pytest.raises(ConfigError) as invalid:
        load_pipelines(bad)
    assert "Rpc-s3cret-1187" not in str(invalid.value) and "a value its tag" in str(invalid.value)
    with pytest.raises(ConfigError, match="a directory, not a pipelines file"):
        load_pipelines(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"pipelines: \xff\xfe\n")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_pipelines(binary)


def test_settings_name_missing_environment_variables():
    with pytest.raises(ConfigError, match="KAFKA2PG_BOOTSTRAP_SERVERS, KAFKA2PG_DATABASE_URL"):
        Settings.from_env({})


def test_column_rules_parse_typed_and_bad_rules_name_the_field(tmp_path):
    ranged = {"name": "n", "type": "numeric(10,2)", "min": 0, "max": 10, "on_violation": "quarantine"}
    listed = {"name": "k", "type": "integer", "allowed": [1, 2]}
    columns = get_pipeline("orders", write(tmp_path, columns=[GOOD["columns"][0], ranged, listed])).columns
    assert (columns[1].minimum, columns[1].maximum, columns[1].on_violation) == (0, 10, "quarantine")
    exact = {**ranged, "type": "numeric(30,0)", "max": 2**53 + 1}  # as a float it would be 2**53
    assert get_pipeline("orders", write(tmp_path, columns=[GOOD["columns"][0], exact])).columns[1].maximum == 2**53 + 1
    assert (columns[2].allowed, columns[2].on_violation) == ((1, 2), "fail")
    assert columns[1].range_words == "range [0, 10]"  # as written, not as the floats they are read into
    assert replace(columns[1], maximum=None).range_words == "minimum 0"
    assert replace(columns[1], minimum=None, maximum=10.5).range_words == "maximum 10.5"
    assert replace(columns[1], minimum=-0.0).range_words == "range [-0, 10]"  # as "-0.0" is compared
    assert replace(columns[1], minimum=-1e300, maximum=1e16).range_words == "range [-1e+300, 1e+16]"
    assert replace(columns[1], maximum=2.0**53).range_words == "range [0, 9007199254740992]"
    assert replace(columns[1], maximum=10**20).range_words == "range [0, 100000000000000000000]"  # an int: exact
    assert columns[2].allowed_words == "allowed values [1, 2]"
    many = replace(columns[2], allowed=tuple(range(1000, 1183)))
    assert many.allowed_words == f"allowed values {list(many.allowed)!r:.120}… (183 values)"
    assert len(replace(columns[2], allowed=tuple(range(20))).allowed_words) == len("allowed values ") + 70
    for bad, message in (
        ({"type": "bigint", "min": 5, "max": 1}, r"columns\[1\]: min 5 is above max 1"),
        ({"type": "bigint", "max": "ten"}, r"columns\[1\].max: expected a finite number, got .ten."),
        ({"type": "text", "min": 1}, r"columns\[1\].min: only numeric columns can have a range, not text"),
        ({"type": "bigint", "allowed": [1, "2"]}, r"columns\[1\].allowed: values \['2'\] are not of the column's type"),
        ({"type": "jsonb", "allowed": [1]}, r"columns\[1\].allowed: only text, bigint, integer, boolean columns"),
        # Values the column's type cannot hold: the gate's typed array cast failed at run time.
        ({"type": "bigint", "allowed": [1, 2**63]}, r"columns\[1\].allowed: values \[9223372036854775808\] are not"),
        ({"type": "integer", "allowed": [-(2**31) - 1]}, r"columns\[1\].allowed: values \[-2147483649\] are not"),
        ({"type": "text", "allowed": ["a", "b\x00"]}, r"columns\[1\].allowed: values \['b\\x00'\] are not"),
        ({"type": "bigint", "on_violation": "ignore"}, r"columns\[1\].on_violation: expected one of fail, quarantine"),
        ({"type": "bigint", "on_violation": "quarantine"}, r"columns\[1\].on_violation: the column declares no rule"),
    ):
        path = write(tmp_path, columns=[GOOD["columns"][0], {"name": "n", **bad}])
        with pytest.raises(ConfigError, match=message):
            get_pipeline("orders", path)


def test_type_is_stored_as_the_ddl_gets_it_and_a_business_key_may_be_one_name(tmp_path):
    spec = {**GOOD, "business_key": "event_id", "columns": [GOOD["columns"][0], column(type=" NUMERIC(38, 0) ")]}
    pipeline = get_pipeline("orders", write_all(tmp_path, spec))
    assert pipeline.business_key == ("event_id",)
    assert (pipeline.columns[1].type, pipeline.columns[1].spark_type) == ("numeric(38,0)", "decimal(38,0)")


def test_derived_names_fit_postgresql_and_never_collide(tmp_path):
    longest = "p" * MAX_PIPELINE_NAME
    pipeline = get_pipeline(longest, write(tmp_path, name=longest))
    assert all(len(n) <= 63 for n in (pipeline.staging_table, pipeline.staging_index))
    assert not pipeline.staging_index.startswith("stg_"), "never another pipeline's staging table"
    short = get_pipeline("orders", write(tmp_path, target_table="public." + "t" * 50))
    assert short.business_key_index == "t" * 50 + "_business_key", "the name earlier versions gave it"
    first, second = (
        get_pipeline("orders", write(tmp_path, target_table="t" * 60 + suffix)).business_key_index
        for suffix in ("abc", "xyz")
    )
    assert len(first) == len(second) == 63 and first != second
    assert first != "t" * 60 + "abc" and first.endswith("_business_key")


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            {"name": "returns", "target_table": "orders"},
            r"target table 'orders' is also the target table of pipeline 'orders'",
        ),
        (
            {"name": "orders_replay", "target_table": "r"},
            r"DAG id 'kafka2pg_orders_replay' is also the replay DAG id of",
        ),
        (
            {"name": "keys", "target_table": "public.orders_business_key"},
            r"target table 'orders_business_key' is also the business-key index of pipeline 'orders'",
        ),
    ],
)
def test_two_pipelines_cannot_share_a_name_postgresql_or_airflow_would_mix_up(tmp_path, second, message):
    path = write_all(tmp_path, GOOD, {**GOOD, "topic": "other", **second})
    with pytest.raises(ConfigError, match=message) as info:
        load_pipelines(path)
    assert f"{path}: pipelines[1] ({second['name']})." in str(info.value) and "(pipelines[0])" in str(info.value)
    load_pipelines(write_all(tmp_path, GOOD, {**GOOD, "name": "audit", "target_table": "audit.orders"}))


@pytest.mark.parametrize(
    ("value", "expected"), [(None, ()), ("payload", ("payload",)), ("a.b", ("a", "b")), (["a.b", "c"], ("a.b", "c"))]
)
def test_value_root_is_a_dotted_path_or_a_list_of_field_names(tmp_path, value, expected):
    extra = {} if value is None else {"value_root": value}
    pipeline = get_pipeline("orders", write(tmp_path, **extra))
    assert pipeline.value_root == expected
    from kafka2pg.admission import decoder_for

    assert decoder_for(pipeline).root == expected


@pytest.mark.parametrize("value", ["", "a..b", [], ["a", 1], 5, ["a\nb"], "\ud800", ["a", "x\udfff"]])
def test_a_value_root_that_names_no_object_path_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match=r"\(orders\)\.value_root: "):
        get_pipeline("orders", write(tmp_path, value_root=value))


def test_a_column_reads_a_field_outside_the_value_root_by_its_path_from_the_record(tmp_path):
    columns = [*GOOD["columns"], column("op", path="op"), column("lsn", type="bigint", path=["source", "lsn"])]
    pipeline = get_pipeline("orders", write(tmp_path, value_root="after", columns=columns))
    assert [(c.name, c.path) for c in pipeline.columns] == [
        ("event_id", ()),
        ("n", ()),
        ("op", ("op",)),
        ("lsn", ("source", "lsn")),
    ]
    from kafka2pg.admission import decoder_for

    value = b'{"after":{"event_id":"e","n":1},"op":"c","source":{"lsn":9},"event_id":"outer"}'
    assert decoder_for(pipeline).decode(value) == (("e", "1", "c", 9), None)


@pytest.mark.parametrize(
    ("root", "columns", "message"),
    [
        ("after", [column("op", path="op", field="op")], r"columns\[2\]: give field .* or path .*, not both"),
        ("after", [column("op", path="a..b")], r"columns\[2\]\.path: 'a\.\.b' has an empty field name"),
        ("after", [column("op", path=5)], r"columns\[2\]\.path: expected the field's names"),
        ("after", [column("op", path=["a"] * 101)], r"columns\[2\]\.path: 101 field names, at most 100"),
        # The same field as a column reading the root's object.
        (
            "after",
            [column("n2", path="after.n")],
            r"columns\[2\]\.path: JSON field 'after\.n' is already read by columns\[1\]",
        ),
        (
            "after",
            [column("raw", type="jsonb", path="after")],
            r"columns\[2\]\.path: 'after' is the value_root's object",
        ),
        (
            "a.b",
            [column("raw", type="jsonb", path="a")],
            r"columns\[2\]\.path: 'a' is the value_root's object or holds it",
        ),
        (
            None,
            [column("s", type="jsonb", path="source"), column("lsn", path="source.lsn")],
            r"columns\[2\]\.path: 'source' is an object columns\[3\] reads a field in \('source\.lsn'\)",
        ),
        (None, [column("s", path="n")], r"columns\[2\]\.path: JSON field 'n' is already read by columns\[1\]"),
    ],
)
def test_a_path_that_reads_no_field_of_its_own_is_refused(tmp_path, root, columns, message):
    extra = {} if root is None else {"value_root": root}
    with pytest.raises(ConfigError, match=message):
        get_pipeline("orders", write(tmp_path, columns=[*GOOD["columns"], *columns], **extra))


def test_a_value_root_fallback_reads_a_deletes_row_from_before(tmp_path):
    columns = [*GOOD["columns"], column("op", path="op")]
    pipeline = get_pipeline(
        "orders", write(tmp_path, value_root="after", value_root_fallback="before", columns=columns)
    )
    assert (pipeline.value_root, pipeline.value_root_fallback) == (("after",), ("before",))
    assert get_pipeline("orders", write(tmp_path, value_root="after")).value_root_fallback == ()
    from kafka2pg.admission import decoder_for

    value = b'{"before":{"event_id":"e","n":1},"after":null,"op":"d"}'
    assert decoder_for(pipeline).decode(value) == (("e", "1", "d"), None)
    # The same event in the JsonConverter's envelope with schemas: beside each other in payload.
    columns = [*GOOD["columns"], column("op", path="payload.op")]
    enveloped = get_pipeline(
        "orders",
        write(tmp_path, value_root="payload.after", value_root_fallback="payload.before", columns=columns),
    )
    value = b'{"schema":{},"payload":{"before":{"event_id":"e","n":1},"after":null,"op":"d"}}'
    assert decoder_for(enveloped).decode(value) == (("e", "1", "d"), None)


@pytest.mark.parametrize(
    ("root", "fallback", "columns", "message"),
    [
        (None, "before", [], r"value_root_fallback: there is no value_root to fall back from"),
        ("after", "after", [], r"value_root_fallback: 'after' is the value_root 'after', holds it or lies in it"),
        ("a.b", "a", [], r"value_root_fallback: 'a' is the value_root 'a\.b', holds it or lies in it"),
        ("a", "a.b", [], r"value_root_fallback: 'a\.b' is the value_root 'a', holds it or lies in it"),
        ("after", "a..b", [], r"value_root_fallback: 'a\.\.b' has an empty field name"),
        ("after", ["a"] * 101, [], r"value_root_fallback: 101 field names, at most 100"),
        # The fallback's fields are read as the root's are: by the columns' fields only.
        (
            "after",
            "before",
            [column("raw", type="jsonb", path="before")],
            r"columns\[2\]\.path: 'before' is the value_root_fallback's object or holds it",
        ),
        (
            "after",
            "before",
            [column("n2", path="before.n")],
            r"columns\[2\]\.path: JSON field 'before\.n' is already read by columns\[1\] in records read from the "
            "value_root_fallback",
        ),
    ],
)
def test_a_value_root_fallback_that_is_no_other_object_is_refused(tmp_path, root, fallback, columns, message):
    extra = {} if root is None else {"value_root": root}
    with pytest.raises(ConfigError, match=message):
        get_pipeline(
            "orders",
            write(tmp_path, value_root_fallback=fallback, columns=[*GOOD["columns"], *columns], **extra),
        )


def test_quoted_numbers_is_for_number_columns_only(tmp_path):
    columns = [
        GOOD["columns"][0],
        column("amount", type="numeric(12,2)", quoted_numbers=True),
        column("n", type="bigint"),
    ]
    pipeline = get_pipeline("orders", write(tmp_path, columns=columns))
    assert [c.quoted_numbers for c in pipeline.columns] == [False, True, False]
    from kafka2pg.admission import rules_for

    assert [r.quoted_numbers for r in rules_for(pipeline)] == [False, True, False]
    for bad, message in (
        (
            {"type": "text", "quoted_numbers": True},
            r"columns\[1\]\.quoted_numbers: only number columns \(bigint, integer, double precision, numeric\)",
        ),
        ({"type": "timestamptz", "quoted_numbers": True}, r"columns\[1\]\.quoted_numbers: only number columns"),
        ({"type": "bigint", "quoted_numbers": "yes"}, r"columns\[1\]\.quoted_numbers: expected true or false"),
    ):
        path = write(tmp_path, columns=[GOOD["columns"][0], column("at", **bad)])
        with pytest.raises(ConfigError, match=message):
            get_pipeline("orders", path)


def test_epoch_reads_numbers_in_timestamptz_and_date_columns_only(tmp_path):
    columns = [
        GOOD["columns"][0],
        column("at", type="timestamptz", field="ts", epoch="milliseconds"),
        column("day", type="date", epoch="days"),
    ]
    pipeline = get_pipeline("orders", write(tmp_path, columns=columns))
    assert [c.epoch for c in pipeline.columns] == [None, "milliseconds", "days"]
    for bad, message in (
        (
            {"type": "bigint", "epoch": "seconds"},
            r"columns\[1\]\.epoch: only timestamptz and date columns read epoch numbers, not bigint",
        ),
        (
            {"type": "timestamptz", "epoch": "nanoseconds"},
            r"columns\[1\]\.epoch: expected seconds or milliseconds or microseconds for a timestamptz column",
        ),
        ({"type": "timestamptz", "epoch": "days"}, r"columns\[1\]\.epoch: expected seconds or milli"),
        ({"type": "date", "epoch": "seconds"}, r"columns\[1\]\.epoch: expected days for a date column, got 'seconds'"),
        ({"type": "timestamptz", "epoch": 1000}, r"\(orders\)\.columns\[1\]\.epoch: expected seconds"),
    ):
        path = write(tmp_path, columns=[GOOD["columns"][0], column("at", **bad)])
        with pytest.raises(ConfigError, match=message) as info:
            get_pipeline("orders", path)
        assert str(path) in str(info.value)


def test_the_reader_and_value_format_types_name_exactly_what_config_accepts():
    import typing

    assert typing.get_args(typing.get_type_hints(Pipeline)["kafka_reader"]) == KAFKA_READERS
    assert typing.get_args(typing.get_type_hints(Pipeline)["value_format"]) == VALUE_FORMATS


def test_a_relative_state_directory_is_made_absolute(tmp_path, monkeypatch):
    from kafka2pg.locations import state_dir

    monkeypatch.chdir(tmp_path)
    assert state_dir({"KAFKA2PG_STATE_DIR": "relst"}) == tmp_path / "relst"


def test_jars_resolve_under_the_state_directory_set_when_called(tmp_path, monkeypatch):
    from kafka2pg import jars

    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))
    for name in jars.SET_UP:  # as if resolved: nothing to fetch
        target = jars.jar_dir(tmp_path, name)
        target.mkdir(parents=True)
        (target / ".complete").write_text((jars.MAVEN_DIR / jars.POMS[name]).read_text())
    assert jars.resolve_jars() == {name: jars.jar_dir(tmp_path, name) for name in jars.SET_UP}


@pytest.mark.parametrize("timeout", ["0", "-5", "0.5", "301"])
def test_a_kafka_timeout_outside_1_to_300_seconds_is_refused_naming_the_variable(timeout):
    from kafka2pg.config import common_settings

    with pytest.raises(ConfigError, match=r"KAFKA2PG_KAFKA_TIMEOUT_S must be 1 to 300 seconds"):
        common_settings({"KAFKA2PG_KAFKA_TIMEOUT_S": timeout})


def test_status_of_a_pipelines_file_without_pipelines_says_so(tmp_path, monkeypatch, capsys):
    from kafka2pg import cli

    path = tmp_path / "pipelines.yaml"
    path.write_text("pipelines: []\n")
    monkeypatch.setenv("KAFKA2PG_PIPELINES", str(path))
    assert cli.main(["status"]) == 0
    assert f"{path}: its 'pipelines:' list is empty: no pipeline to show" in capsys.readouterr().err


def test_a_field_name_with_a_lone_surrogate_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"columns\[1\]\.field: expected the JSON field name"):
        get_pipeline("orders", write(tmp_path, columns=[GOOD["columns"][0], column("n", field="\ud800")]))


@pytest.mark.parametrize(
    "changes",
    [
        {"columns": [*GOOD["columns"], column("odd", field='we"ird')]},
        {"columns": [*GOOD["columns"], column("odd", path=["source", "back\\slash"])]},
        {"value_root": ["after", "back\\slash"]},
    ],
)
def test_a_run_says_when_a_field_name_keeps_every_record_off_the_fast_path(tmp_path, changes):
    from kafka2pg.admission import strict_only_note

    assert strict_only_note(get_pipeline("orders", write(tmp_path))) is None
    # Only the records read from the fallback take the strict path, as every such record does.
    fallback = get_pipeline("orders", write(tmp_path, value_root="after", value_root_fallback=['be"fore']))
    assert strict_only_note(fallback) is None
    note = strict_only_note(get_pipeline("orders", write(tmp_path, **changes)))
    assert note and "a quote or a backslash" in note and "strict path" in note


def test_each_pipeline_is_checked_on_its_own_and_a_broken_one_spoils_only_itself(tmp_path):
    from kafka2pg.config import read_pipelines

    path = write_all(
        tmp_path,
        GOOD,
        {**GOOD, "name": "typo", "topic": "typo", "target_table": "public.typo", "colums": []},
        {**GOOD, "name": "Bad Name"},
        {**GOOD, "name": "twin", "topic": "twin"},  # the target table orders already has
    )
    pipelines, broken = read_pipelines(path)
    assert list(pipelines) == ["orders"] and list(broken) == ["typo", "pipelines[2]", "twin"]
    assert "unknown field(s) colums" in str(broken["typo"])
    assert str(broken["twin"]).endswith(
        "pipelines[3] (twin).target_table: its target table 'orders' is also the target table of pipeline 'orders' "
        "(pipelines[0]) among the relations of schema public. Give each pipeline its own target table and name."
    )
    # The same name twice: the later entry is in error, the earlier keeps its name.
    pipelines, broken = read_pipelines(write_all(tmp_path, GOOD, {**GOOD, "topic": "other"}))
    assert list(pipelines) == ["orders"] and pipelines["orders"].topic == "orders"
    assert list(broken) == ["pipelines[1]"]
    assert "pipelines[1].name: duplicate name 'orders'" in str(broken["pipelines[1]"])
    path = write_all(
        tmp_path, GOOD, {**GOOD, "name": "typo", "topic": "typo", "target_table": "public.typo", "colums": []}
    )
    assert get_pipeline("orders", path).name == "orders"  # whatever its neighbour holds
    with pytest.raises(ConfigError, match="colums"):
        get_pipeline("typo", path)
    with pytest.raises(ConfigError, match="colums"):
        load_pipelines(path)  # the CLI's migrate, grant and status: the file must be right as a whole
    with pytest.raises(UnknownPipelineError, match=r"known: orders, typo"):
        get_pipeline("nope", path)
    # An entry whose name cannot be read (upper case, or its key misspelt) may be the one asked for.
    path = write_all(tmp_path, {**GOOD, "name": "Orders"})
    with pytest.raises(UnknownPipelineError) as unknown:
        get_pipeline("orders", path)
    assert "(known: pipelines[0]); an entry without a usable name may be it: " in str(unknown.value)
    assert "pipelines[0].name: expected a lower-case identifier" in str(unknown.value)


@pytest.mark.parametrize(
    ("schedule", "refusal"),
    [
        ("None", "got the text 'None': for runs only when triggered, leave schedule out"),
        ("every hour", "got 'every hour' (not a cron expression croniter reads)"),
        ("61 * * * *", "(not a cron expression croniter reads)"),
        ("", "got ''"),
    ],
)
def test_a_schedule_airflow_could_not_read_is_refused(tmp_path, schedule, refusal):
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        get_pipeline("orders", write(tmp_path, schedule=schedule))
    for fine in ("@hourly", "@once", "*/5 * * * *", "0 3 * * 1-5", None):
        assert get_pipeline("orders", write(tmp_path, schedule=fine)).schedule == fine
    # as checked, without the spaces around it (Airflow refuses " @daily ")
    assert get_pipeline("orders", write(tmp_path, schedule=" @daily ")).schedule == "@daily"


@pytest.mark.parametrize("topic", ["bad topic!", "", ".."])
def test_produce_refuses_a_topic_name_kafka_would_refuse_before_connecting(topic, capsys):
    """Kafka's rule for topic names, as for the pipelines file: a usage error (2), not a Kafka outage."""
    from kafka2pg import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["produce", "--topic", topic, "--count", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --topic: expected a Kafka topic name" in err and "Unavailable" not in err, err


@pytest.mark.parametrize("key", [1, None, True, "", " name", "a\x1b[2Jb"])
def test_a_key_yaml_reads_as_no_string_is_named_as_an_unknown_field(tmp_path, key):
    """...or as text an error would not show as written (empty, blanks around it, control characters): quoted."""
    from kafka2pg.config import read_pipelines

    path = write_all(tmp_path, GOOD, {**GOOD, "name": "other", "topic": "other", "target_table": "other", key: "x"})
    pipelines, broken = read_pipelines(path)
    assert list(pipelines) == ["orders"] and list(broken) == ["other"]
    assert f"pipelines[1]: unknown field(s) {key!r}" in str(broken["other"])
    column_key = write(tmp_path, columns=[{"name": "n", "type": "text", key: 1}])
    with pytest.raises(ConfigError, match=rf"columns\[0\]: unknown field\(s\) {re.escape(repr(key))}"):
        load_pipelines(column_key)


def test_an_entry_no_check_foresaw_spoils_only_itself(tmp_path, monkeypatch):
    """A shape of entry that slips past every check and fails its parsing with a TypeError (or
    the like) is that entry's configuration error: the others are read (their DAGs are built)."""
    from kafka2pg import config

    real = config._target

    def target(value, where):
        if value == "public.odd":
            raise TypeError("unhashable type: 'list'")
        return real(value, where)

    monkeypatch.setattr(config, "_target", target)
    path = write_all(tmp_path, GOOD, {**GOOD, "name": "odd", "topic": "odd", "target_table": "public.odd"})
    pipelines, broken = config.read_pipelines(path)
    assert list(pipelines) == ["orders"] and list(broken) == ["odd"]
    assert str(broken["odd"]) == (
        f"{path}: pipelines[1]: not a pipeline kafka2pg can read (TypeError: unhashable type: 'list'); "
        "check each field's type against the pipelines-file reference"
    )


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["report", "--batch-id", "99999999999999999999"], "argument --batch-id: out of range: 99999999999999999999"),
        (["quarantine", "--pipeline", "p", "--limit", str(2**63)], "argument --limit: out of range"),
        (["quarantine", "--pipeline", "p", "--limit", "0"], "argument --limit: out of range: 0 (from 1 to 9223"),
        (["quarantine", "--pipeline", "p", "--limit", "1_000"], "argument --limit: not a whole number: '1_000'"),
        (["produce", "--count", "+5"], "argument --count: not a whole number: '+5'"),
        (["produce", "--count", "\uff15"], "argument --count: not a whole number"),
        (["reset", "--pipeline", "p", "--partition", "-1", "--drop"], "--partition: out of range: -1 (from 0 to"),
        (["reset", "--pipeline", "p", "--partition", str(2**63), "--drop"], "(from 0 to 2147483647)"),
        (["produce", "--count", "1" * 5000], "--count: out of range: 11111111111111111111... (5000 characters)"),
        (["reset", "--pipeline", "p", "--partition", "0", "--to-offset", " 7"], "argument --to-offset: not a whole"),
        (["undo", "--pipeline", "p", "--batch-id", "1", "--reason", "\udcff\udcfe"], "is not valid UTF-8"),
        (["grant", "--role", "x\udcff"], "argument 'x\\udcff' is not valid UTF-8"),
        (["abandon", "--pipeline", "p", "--batch-id", "-" + "9" * 19], "argument --batch-id: out of range"),
    ],
)
def test_arguments_no_database_or_terminal_takes_are_usage_errors(argv, refusal, capsys):
    """Before any connection: a number beyond PostgreSQL's bigint, bytes that are no UTF-8 (a
    traceback each, after the undo's transaction had begun)."""
    from kafka2pg import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err


def test_whole_number_flags_take_leading_zeros_and_a_minus_where_the_range_has_room():
    from kafka2pg.cli import build_parser

    args = build_parser().parse_args(["produce", "--count", "0" * 30 + "7", "--seed", "-" + "0" * 25 + "5"])
    assert (args.count, args.seed) == (7, -5)


@pytest.mark.parametrize(("confirm", "code", "said"), [(False, 1, "would abandon: "), (True, 0, "abandoned: ")])
def test_abandon_previews_without_confirm_and_exits_1_as_nothing_changed(monkeypatch, capsys, confirm, code, said):
    from kafka2pg import cli, undo

    asked = {}

    def abandon_replay(settings, pipeline, batch_id, **kwargs):
        asked.update(batch_id=batch_id, **kwargs)
        return undo.Abandon(batch_id, 3, kwargs["confirm"], "batch 7 (replay, staged): mark it abandoned")

    monkeypatch.setattr(cli, "_pipeline", lambda args: (None, None))
    monkeypatch.setattr(undo, "abandon_replay", abandon_replay)
    argv = ["abandon", "--pipeline", "p", "--batch-id", "7", "--reason", "killed"] + ["--confirm"] * confirm
    assert cli.main(argv) == code
    out = capsys.readouterr().out
    assert out.startswith(said + "batch 7 (replay, staged): mark it abandoned")
    assert ("re-run with --confirm" in out) is not confirm
    assert asked == {"batch_id": 7, "confirm": confirm, "reason": "killed", "requested_by": ""}


def test_verbose_leaves_kafka2pgs_logging_as_it_found_it_for_whoever_calls_main_in_process(capsys):
    import logging

    from kafka2pg import cli

    own = logging.getLogger("kafka2pg")
    before = (own.level, own.propagate, list(own.handlers))
    for _ in range(2):
        assert cli.main(["-v", "replay", "--pipeline", "p"]) == 2  # nothing to replay: a ConfigError
    assert (own.level, own.propagate, list(own.handlers)) == before
    assert capsys.readouterr().err.count("error: ConfigError: replay: nothing to replay") == 2


def test_report_out_to_a_path_it_cannot_write_is_an_error_not_a_trace(tmp_path, monkeypatch, capsys):
    from kafka2pg import cli
    from kafka2pg.exceptions import ConfigError

    args = type("Args", (), {"out": tmp_path})()  # a directory
    with pytest.raises(ConfigError, match=rf"report --out {tmp_path}: cannot write it: Is a directory"):
        cli._write_report(args, "<html></html>")


@pytest.mark.parametrize("key", ["task_timeout_minutes", "data_loss_warning_hours"])
def test_a_number_beyond_floats_range_is_named_not_an_overflow_of_the_whole_file(tmp_path, key):
    from kafka2pg.config import read_pipelines

    huge = {**GOOD, "name": "huge", "topic": "huge", "target_table": "huge", key: 10**400}
    pipelines, broken = read_pipelines(write_all(tmp_path, GOOD, huge))
    assert list(pipelines) == ["orders"] and list(broken) == ["huge"]
    assert f"pipelines[1] (huge).{key}: expected a positive number, got 1000" in str(broken["huge"])


def test_the_cli_ends_ctrl_c_a_gone_reader_and_postgresqls_refusals_without_a_trace(capsys):
    import argparse

    import psycopg

    from kafka2pg import cli

    def raising(exc):
        def command(args):
            raise exc

        return command

    assert cli._run(argparse.Namespace(func=raising(KeyboardInterrupt()))) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
    assert cli._run(argparse.Namespace(func=raising(BrokenPipeError()))) == 1  # `status | head`
    refused = psycopg.errors.RaiseException("refused by the DBA's trigger")
    assert cli._run(argparse.Namespace(func=raising(refused), verbose=False)) == 2
    err = capsys.readouterr().err
    assert err == "error: RaiseException (SQLSTATE P0001): refused by the DBA's trigger\n", err
    assert cli._run(argparse.Namespace(func=raising(refused), verbose=True)) == 2  # -v: the trace too
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):  # a defect of kafka2pg's own keeps its trace
        cli._run(argparse.Namespace(func=raising(ZeroDivisionError())))


@pytest.mark.parametrize(
    ("written", "read"),
    [
        ("123456789012345678.25", 1.2345678901234568e17),
        ("0.30000000000000001", 0.3),
        ("!!float 1.00000000000000001", 1.0),
    ],
)
def test_a_bound_written_with_more_digits_than_a_float_keeps_is_refused(tmp_path, written, read):
    """A range bound is read as a float: one whose text a float does not keep would be another
    rule than the one written, silently."""
    path = write(tmp_path, columns=[GOOD["columns"][0], column(type="numeric(20,2)", max=1.5)])
    path.write_text(path.read_text().replace("max: 1.5", f"max: {written}"))
    with pytest.raises(
        ConfigError, match=r"columns\[1\]\.max: .* is read as the float .*, not the number written"
    ) as info:
        load_pipelines(path)
    assert f"max: {written.removeprefix('!!float ')} is read as the float {read!r}," in str(info.value)


@pytest.mark.parametrize(
    ("written", "bound"),
    [
        ("0.1", 0.1),
        ("123456789012345.5", 123456789012345.5),
        ("1_000.25", 1000.25),
        ("1.5e+3", 1500.0),
        ("12345678901234567890123", 12345678901234567890123),
    ],
)
def test_a_bound_a_float_keeps_or_a_whole_number_is_read_as_written(tmp_path, written, bound):
    path = write(tmp_path, columns=[GOOD["columns"][0], column(type="numeric(30,2)", max=1.5)])
    path.write_text(path.read_text().replace("max: 1.5", f"max: {written}"))
    (loaded,) = [c for c in get_pipeline("orders", path).columns if c.name == "n"]
    assert loaded.maximum == bound and type(loaded.maximum) is type(bound)


def _written(tmp_path, text: str):
    """A good pipelines file with `text` appended to its pipeline's fields (in place of its columns
    when `text` gives them)."""
    path = write_all(tmp_path, {k: v for k, v in GOOD.items() if k != "columns" or not text.startswith("columns:")})
    path.write_text(path.read_text() + "".join(f"  {line}\n" for line in text.splitlines()))
    return path


@pytest.mark.parametrize(
    ("text", "field", "said"),
    [
        ("max_records_per_batch: 010", "max_records_per_batch", "010 is read by YAML 1.1 as the octal number 8,"),
        ("batches_per_run: -0_20", "batches_per_run", "-0_20 is read by YAML 1.1 as the octal number -16,"),
        ("task_timeout_minutes: 1:30", "task_timeout_minutes", "1:30 is read by YAML 1.1 as the base-60 number 90,"),
        (
            "data_loss_warning_hours: 1:30.5",
            "data_loss_warning_hours",
            "1:30.5 is read by YAML 1.1 as the base-60 number 90.5,",
        ),
        (
            "columns:\n- {name: event_id, type: text}\n- {name: k, type: integer, allowed: [1, 012]}",
            "columns[1].allowed[1]",
            "012 is read by YAML 1.1 as the octal number 10,",
        ),
        ("batches_per_run: 00010", "batches_per_run", "00010 is read by YAML 1.1 as the octal number 8,"),
        ("spark_conf: {spark.secret.pin: 0755}", "spark_conf.spark.secret.pin", "a number with a leading zero"),
    ],
)
def test_a_number_yaml_reads_in_a_base_its_text_does_not_show_is_refused(tmp_path, text, field, said):
    """PyYAML reads YAML 1.1: 010 is 8 and 1:30 is 90. Read silently, the pipeline would run with
    another number than the one written; the error names the field (a spark_conf value unquoted)."""
    path = _written(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        get_pipeline("orders", path)
    message = str(info.value)
    assert f"pipelines[0] (orders).{field}: {said}" in message, message
    assert "without a leading zero or colon, or quote it" in message
    if "spark_conf" in text:
        assert "0755" not in message and "493" not in message


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ("max_records_per_batch: 07", "max_records_per_batch", 7),  # the same number in either base
        ("max_records_per_batch: 1_000", "max_records_per_batch", 1000),
        ("max_records_per_batch: 0x10", "max_records_per_batch", 16),  # its base shown
    ],
)
def test_a_number_whose_text_shows_its_base_is_read_as_written(tmp_path, text, field, value):
    path = _written(tmp_path, text)
    assert getattr(get_pipeline("orders", path), field) == value


_BOOLEAN_HINT = r"(True|False|\[.*\]).* \(YAML reads an unquoted yes, no, on, off, true or false as a boolean: quote"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("columns:\n- {name: event_id, type: text}\n- {name: no, type: text}", "columns[1].name"),
        ("columns:\n- {name: event_id, type: text}\n- {name: ok, type: text, field: On}", "columns[1].field"),
        ("spark_log_level: OFF", "spark_log_level"),
        ("lag_consumer_group: yes", "lag_consumer_group"),
        ("postgres_conn_id: on", "postgres_conn_id"),
        ("value_root: yes", "value_root"),
    ],
)
def test_a_word_yaml_reads_as_a_boolean_where_text_belongs_is_refused_with_the_fix(tmp_path, text, field):
    with pytest.raises(ConfigError, match=rf"\.{re.escape(field)}: .*{_BOOLEAN_HINT}"):
        get_pipeline("orders", _written(tmp_path, text))


@pytest.mark.parametrize(("field", "value"), [("business_key", ["event_id", False]), ("topic", True)])
def test_a_boolean_where_a_topic_or_key_name_belongs_is_refused_with_the_fix(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"\.{field}: .*{_BOOLEAN_HINT}"):
        get_pipeline("orders", write(tmp_path, **{field: value}))


@pytest.mark.parametrize(
    ("text", "field", "means", "then"),
    [
        ("lag_consumer_group: off", "lag_consumer_group", "to commit the heads to no consumer group", "; quote"),
        ("schedule: no", "schedule", "for runs only when triggered", r"\)$"),  # no quoted word is a schedule
        ("value_root: no", "value_root", "for the record's own object", "; quote"),
    ],
)
def test_a_no_or_off_yaml_reads_as_false_where_null_means_off_says_to_leave_the_key_out(
    tmp_path, text, field, means, then
):
    """Quoted, `'off'` would be a consumer group named off (or a field named no): the refusal
    says first how to leave the field off, which is what the word most likely meant."""
    hint = rf"got False \(YAML reads an unquoted .* as a boolean: {means}, leave the key out \(or write null\){then}"
    with pytest.raises(ConfigError, match=rf"\.{field}: .*{hint}"):
        get_pipeline("orders", _written(tmp_path, text))


@pytest.mark.parametrize(
    "text",
    [
        "duplicate_policy: off",
        "kafka_reader: yes",
        "value_format: on",
        "schedule: yes",
        "replay_interval: on",
        "columns:\n- {name: event_id, type: text}\n- {name: ok, type: yes}",
    ],
)
def test_a_boolean_where_quoting_cannot_give_an_allowed_value_is_explained_without_the_quoting_advice(tmp_path, text):
    with pytest.raises(
        ConfigError, match=r"(True|False)( \(supported: .*\))? \(YAML reads an unquoted .* as a boolean\)$"
    ):
        get_pipeline("orders", _written(tmp_path, text))


def test_a_boolean_where_a_choice_is_a_boolean_word_names_that_choice_as_written(tmp_path):
    """`spark_log_level: off` quoted is `'off'`, still refused: the choice is `OFF`."""
    with pytest.raises(ConfigError, match=r"got False \(YAML reads .* as a boolean: quoted, as written here: 'OFF'\)$"):
        get_pipeline("orders", _written(tmp_path, "spark_log_level: off"))


def test_the_boolean_hint_is_not_given_for_other_wrong_values_and_quoting_the_word_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"spark_log_level: expected one of .*, got 3$"):
        get_pipeline("orders", _written(tmp_path, "spark_log_level: 3"))
    quoted = "columns:\n- {name: event_id, type: text}\n- {name: 'no', type: text}\nspark_log_level: 'OFF'"
    pipeline = get_pipeline("orders", _written(tmp_path, quoted))
    assert (pipeline.columns[1].name, pipeline.spark_log_level) == ("no", "OFF")
    assert type(pipeline.columns[1].name) is str


def test_allowed_text_values_yaml_reads_as_booleans_or_numbers_are_named_with_the_fix(tmp_path):
    text = "columns:\n- {name: event_id, type: text}\n- {name: country, type: text, allowed: [DK, NO, SE]}"
    with pytest.raises(ConfigError, match=r"values \[False\] are not of the column's type text: quote the values"):
        get_pipeline("orders", _written(tmp_path, text))
    spec = {"name": "k", "type": "bigint", "allowed": [1, "2"]}  # not text: no such advice
    with pytest.raises(ConfigError, match=r"values \['2'\] are not of the column's type bigint$"):
        get_pipeline("orders", write(tmp_path, columns=[GOOD["columns"][0], spec]))


@pytest.mark.parametrize(
    ("text", "where", "keys"),
    [
        ("max_records_per_batch: 5\nmax_records_per_batch: 50", "pipelines[0] (orders)", "max_records_per_batch"),
        (
            "columns:\n- {name: event_id, type: text}\n- {name: n, type: bigint, max: 5, max: 50, min: 1, min: 0}",
            "pipelines[0] (orders).columns[1]",
            "max, min",
        ),
        ("spark_conf:\n  spark.a: x\n  spark.a: y", "pipelines[0] (orders).spark_conf", "spark.a"),
    ],
)
def test_a_key_given_twice_is_refused_not_read_as_its_last_value(tmp_path, text, where, keys):
    """PyYAML keeps a repeated key's last value without a word: the pipeline would run with
    whichever came last, the other silently ignored."""
    with pytest.raises(ConfigError) as info:
        get_pipeline("orders", _written(tmp_path, text))
    assert f"{where}: {keys} given more than once (YAML keeps only the last, silently)" in str(info.value)


def test_a_merge_keys_values_may_be_overridden_and_pipelines_given_twice_is_refused(tmp_path):
    path = write(tmp_path)
    base = "defaults: &base {max_records_per_batch: 5, batches_per_run: 2}\n"
    path.write_text(base + path.read_text() + "  <<: *base\n  max_records_per_batch: 7\n")
    pipeline = get_pipeline("orders", path)  # YAML's merge: the entry's own key wins, as YAML means
    assert (pipeline.max_records_per_batch, pipeline.batches_per_run) == (7, 2)
    path.write_text(path.read_text() + "pipelines: []\n")
    with pytest.raises(ConfigError, match="'pipelines:' given more than once"):
        load_pipelines(path)


ENTRY = "- {name: orders, topic: orders, target_table: public.orders, columns: [{name: event_id, type: text}]"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("d: &d {batches_per_run: 2, batches_per_run: 3}\npipelines:\n" + ENTRY + ", <<: *d}", "batches_per_run given"),
        (
            "d: &d {batches_per_run: 2}\ne: &e {batches_per_run: 3}\npipelines:\n" + ENTRY + ", <<: *d, <<: *e}",
            "<< given more than once (PyYAML merges each; what they share comes from the later one): merge them "
            "with one << listing the later first, <<: [*later, *earlier] (in a list the first listed wins)",
        ),
        (
            "d: &d {batches_per_run: 2}\npipelines:\n" + ENTRY + ", <<: *d, <<: *d, topic: a, topic: b}",
            "topic given more than once (YAML keeps only the last, silently): give each key once; and << given",
        ),
        (
            "pipelines:\n" + ENTRY + ", spark_conf: {010: x}}",
            "spark_conf: the key 8: 010 is read by YAML 1.1 as the octal",
        ),
        ("pipelines:\n" + ENTRY + ", spark_conf: &r {x: *r}}", "spark_conf: x: expected a string or number"),
    ],
)
def test_yaml_merges_aliases_and_keys_are_read_as_written_or_refused_per_pipeline(tmp_path, text, said):
    """A key given twice in a mapping a pipeline merges (or two merge keys, the later silently
    winning) and a key in a base its text does not show are that pipeline's errors; an alias of
    the mapping holding it is looked at once (no recursion without end)."""
    path = tmp_path / "pipelines.yaml"
    path.write_text(text + "\n" + ENTRY.replace("orders", "other") + "}\n")
    pipelines, broken = read_pipelines(path)
    assert list(pipelines) == ["other"] and said in str(broken["orders"]), broken


def test_yaml_forms_that_repeat_no_key_still_load(tmp_path):
    """`=` as a key (YAML 1.1's value key, text once flattened), and a mapping whose own key
    overrides one it merges, merged again elsewhere after it was flattened."""
    path = tmp_path / "pipelines.yaml"
    path.write_text(
        "x: {=: 1}\nbase: &base {spark.a: '1', spark.b: '1'}\npipelines:\n"
        + ENTRY
        + ", spark_conf: &conf {<<: *base, spark.b: '2'}}\nlater: {<<: *conf}\n"
    )
    assert load_pipelines(path)["orders"].spark_conf == {"spark.a": "1", "spark.b": "2"}


def test_the_one_merge_key_the_refusal_of_two_suggests_keeps_what_the_two_gave(tmp_path):
    """`<<: *d, <<: *e` reads what both give from e; the suggested `<<: [*later, *earlier]` too."""
    path = tmp_path / "pipelines.yaml"
    anchors = "d: &d {batches_per_run: 2, max_records_per_batch: 5}\ne: &e {batches_per_run: 3}\npipelines:\n"
    path.write_text(anchors + ENTRY + ", <<: [*e, *d]}\n")
    pipeline = load_pipelines(path)["orders"]
    assert (pipeline.batches_per_run, pipeline.max_records_per_batch) == (3, 5)


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--pipeline", "orders", "--offsets", "0:0-100", "--offsets", "1:0-50"],
        ["replay", "--pipeline", "orders", "--offsets", "0:0-1", "--mode", "verify-only", "--mode", "replace"],
        ["reset", "--pipeline", "orders", "--partition", "0", "--partition", "1", "--drop"],
        ["undo", "--pipeline", "orders", "--batch-id", "7", "--batch-id", "8"],
        ["status", "--pipeline", "orders", "--pipeline", "payments"],
    ],
)
def test_an_option_given_twice_is_refused_not_read_as_its_last_value(argv, capsys):
    """argparse keeps a repeated option's last value silently: a replay given two ranges would
    replay the second only."""
    from kafka2pg.cli import build_parser

    repeated = next(a for n, a in enumerate(argv) if a.startswith("--") and a in argv[:n])
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert f"error: {repeated} given more than once: give it once" in capsys.readouterr().err
    second = argv.index(repeated, argv.index(repeated) + 1)
    once = argv[:second] + argv[second + 2 :]
    assert build_parser().parse_args(once).command == argv[0]  # each once: read
