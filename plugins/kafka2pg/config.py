"""The single source of configuration truth: the pipelines file and the environment.

Both are validated into frozen dataclasses; every error names the file and the field.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import yaml

from kafka2pg.exceptions import ConfigError, UnknownPipelineError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PIPELINES_FILE = PROJECT_ROOT / "dags" / "pipelines.yaml"
# JVM options of the stage job's driver (in local mode also its executor); a pipeline's
# spark_conf may override them. A job that stages one batch (batches_per_run 1, the default)
# lives seconds: C1-only JIT warms up sooner (a cold 100k batch: 7.3 s vs 8.6 s with C2). A job
# that catches up several batches repays C2's compile time from its second batch on: C2-compiled
# JSON decode and Arrow transfer stage a warm 100k batch in about 1.4 s instead of 2.0 s
# (README "Benchmark"). C2 only for code run per record: with the default tier-4 thresholds C2
# also compiled the driver's per-batch machinery (Spark's closure cleaner, planner, task
# serialisation), 13 of the JVM's 25 core-seconds over 1M records in 10 batches. Raised tier-4
# thresholds (invocations 5,000 -> 100,000, about once per record of a batch; minimum 600 ->
# 20,000; calls + loops 15,000 -> 100,000; loop back-edges 40,000 -> 400,000) leave that code to
# C1: the compiler threads' CPU fell 12.3-13.2 -> 6.6-7.2 s, the decoding threads' rose 9.0-10.1
# -> 9.7-10.8 s (JFR and per-thread /proc times, two A/B pairs). Tuned for batches of ~100k
# records: with much smaller ones, per-record code reaches C2 later. Parallel GC suits a batch job.
STAGE_JVM_OPTIONS_ONE_BATCH = "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC"
STAGE_JVM_OPTIONS_SEVERAL_BATCHES = (
    "-XX:+UseParallelGC -XX:Tier4InvocationThreshold=100000 -XX:Tier4MinInvocationThreshold=20000"
    " -XX:Tier4CompileThreshold=100000 -XX:Tier4BackEdgeThreshold=400000"
)


def stage_jvm_options(batches: int = 1, state_dir: Path | None = None) -> str:
    """The stage JVM's options for a job that may finish `batches` batches, with the class-data
    archive `./kafka2pg setup` made for this pyspark and java, when there is one."""
    options = STAGE_JVM_OPTIONS_ONE_BATCH if batches == 1 else STAGE_JVM_OPTIONS_SEVERAL_BATCHES
    archive = class_archive_path(state_dir)
    if archive.is_file():
        options += f" -XX:SharedArchiveFile={shlex.quote(str(archive))}"
    return options


def stage_jvm_conf(batches: int = 1, state_dir: Path | None = None) -> dict[str, str]:
    """Spark conf with the stage JVM's options for a job that may finish `batches` batches."""
    return {"spark.driver.extraJavaOptions": stage_jvm_options(batches, state_dir)}


def class_archive_path(state_dir: Path | None = None) -> Path:
    """Where the stage JVM's class-data archive (AppCDS) lives: one per pyspark version and java
    binary, under the state directory (KAFKA2PG_STATE_DIR). Made by `kafka2pg.class_archive`.

    The JVM maps Spark's classes from it instead of loading and verifying them from jars: Spark
    starts about 1.5 s sooner and the first batch about 0.5 s sooner (README "Benchmark"). A JVM
    whose class path differs from the one recorded ignores it with a warning.
    """
    state = Path(state_dir or os.environ.get("KAFKA2PG_STATE_DIR") or PROJECT_ROOT / ".cache")
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    identity = "no-java"
    if java is not None and Path(java).exists():
        real = Path(java).resolve()
        stat = real.stat()
        identity = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        spark = metadata.version("pyspark")
    except metadata.PackageNotFoundError:
        spark = "no-pyspark"
    key = hashlib.sha256(f"{spark}|{identity}".encode()).hexdigest()[:16]
    return state / "jvm" / f"spark-{spark}-{key}.jsa"


# PostgreSQL column types a JSON field may be mapped to, and the Spark type read for each.
_TYPE_PATTERNS: dict[str, str] = {
    r"text": "string",
    r"bigint": "bigint",
    r"integer": "int",
    r"double precision": "double",
    r"boolean": "boolean",
    r"timestamptz": "timestamp",
    r"date": "date",
    r"jsonb": "string",
    r"numeric\((\d{1,2}),\s*(\d{1,2})\)": "decimal({0},{1})",
}
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_RESERVED_COLUMNS = {
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
    "kafka_timestamp",
    "batch_id",
    "promoted_at",
    "chunk",
    "raw_value",
    "quarantine_reason",
}


def spark_type_for(pg_type: str) -> str | None:
    """Spark SQL type name for a supported PostgreSQL type, or None if unsupported."""
    for pattern, spark_type in _TYPE_PATTERNS.items():
        match = re.fullmatch(pattern, pg_type.strip().lower())
        if match:
            return spark_type.format(*match.groups())
    return None


@dataclass(frozen=True)
class Column:
    """One target column filled from one top-level field of the JSON value."""

    name: str
    type: str
    field: str
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    allowed: tuple[str | int | bool, ...] | None = None
    on_violation: Literal["fail", "quarantine"] = "fail"

    @property
    def spark_type(self) -> str:
        return spark_type_for(self.type) or "string"


@dataclass(frozen=True)
class Pipeline:
    """One topic loaded into one target table."""

    name: str
    topic: str
    target_schema: str
    target_table: str
    columns: tuple[Column, ...]
    business_key: tuple[str, ...] = ()
    max_records_per_batch: int = 100_000
    max_records_per_partition: int | None = None
    batches_per_run: int = 1
    on_retention_loss: Literal["fail", "skip"] = "fail"
    new_partition_start: Literal["earliest", "latest"] = "earliest"
    duplicate_policy: Literal["quarantine", "fail"] = "quarantine"
    data_loss_warning_hours: float = 24.0
    spark_conf: dict[str, str] = field(default_factory=dict)
    schedule: str | None = None
    replay_interval: str = "0 0 * * *"

    @property
    def dag_id(self) -> str:
        return f"kafka2pg_{self.name}"

    @property
    def replay_dag_id(self) -> str:
        return f"kafka2pg_{self.name}_replay"

    @property
    def staging_table(self) -> str:
        return f"stg_{self.name}"

    @property
    def required_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.required)


@dataclass(frozen=True)
class Settings:
    """Where the services are; read from the environment (see README, Configuration)."""

    bootstrap_servers: str
    database_url: str
    spark_master: str = "local[*]"
    pipelines_file: Path = DEFAULT_PIPELINES_FILE
    kafka_timeout_s: float = 10.0
    state_dir: Path = PROJECT_ROOT / ".cache"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        missing = [name for name in ("KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_DATABASE_URL") if not env.get(name)]
        if missing:
            raise ConfigError(
                f"environment variable(s) {', '.join(missing)} not set: set them to your Kafka "
                "bootstrap servers and PostgreSQL URL, or start the local stack with "
                "`./kafka2pg stack start` and `source .cache/stack/stack.env`"
            )
        timeout = env.get("KAFKA2PG_KAFKA_TIMEOUT_S", "10")
        try:
            kafka_timeout_s = float(timeout)
        except ValueError as exc:
            raise ConfigError(f"KAFKA2PG_KAFKA_TIMEOUT_S must be a number of seconds, got {timeout!r}") from exc
        return cls(
            bootstrap_servers=env["KAFKA2PG_BOOTSTRAP_SERVERS"],
            database_url=env["KAFKA2PG_DATABASE_URL"],
            spark_master=env.get("KAFKA2PG_SPARK_MASTER", "local[*]"),
            pipelines_file=Path(env.get("KAFKA2PG_PIPELINES", DEFAULT_PIPELINES_FILE)),
            kafka_timeout_s=kafka_timeout_s,
            state_dir=Path(env.get("KAFKA2PG_STATE_DIR", PROJECT_ROOT / ".cache")),
        )


def pipelines_file_from_env() -> Path:
    """The pipelines file path, without requiring the service settings."""
    return Path(os.environ.get("KAFKA2PG_PIPELINES", DEFAULT_PIPELINES_FILE))


def load_pipelines(path: Path | None = None) -> dict[str, Pipeline]:
    """Parse and validate the pipelines file into `Pipeline` objects keyed by name."""
    path = Path(path or pipelines_file_from_env())
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: pipelines file not found (set KAFKA2PG_PIPELINES)") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("pipelines"), list):
        raise ConfigError(f"{path}: expected a top-level 'pipelines:' list")
    pipelines: dict[str, Pipeline] = {}
    for index, raw in enumerate(document["pipelines"]):
        pipeline = _parse_pipeline(raw, f"{path}: pipelines[{index}]")
        if pipeline.name in pipelines:
            raise ConfigError(f"{path}: pipelines[{index}].name: duplicate name {pipeline.name!r}")
        pipelines[pipeline.name] = pipeline
    return pipelines


def get_pipeline(name: str, path: Path | None = None) -> Pipeline:
    """The named pipeline, or `UnknownPipelineError` listing the known ones."""
    pipelines = load_pipelines(path)
    if name not in pipelines:
        known = ", ".join(sorted(pipelines)) or "none"
        raise UnknownPipelineError(f"unknown pipeline {name!r} in {path or pipelines_file_from_env()} (known: {known})")
    return pipelines[name]


_PIPELINE_KEYS = {
    "name",
    "topic",
    "target_table",
    "columns",
    "business_key",
    "max_records_per_batch",
    "max_records_per_partition",
    "batches_per_run",
    "on_retention_loss",
    "new_partition_start",
    "duplicate_policy",
    "data_loss_warning_hours",
    "spark_conf",
    "schedule",
    "replay_interval",
}


def _parse_pipeline(raw: Any, where: str) -> Pipeline:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(raw) - _PIPELINE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
    name = _identifier(raw, "name", where)
    where = f"{where} ({name})"
    topic = raw.get("topic")
    if not isinstance(topic, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic):
        raise ConfigError(f"{where}.topic: expected a Kafka topic name, got {topic!r}")
    schema, table = _target(raw.get("target_table"), where)
    columns = _columns(raw.get("columns"), where)
    names = {c.name for c in columns}
    business_key = raw.get("business_key") or []
    if isinstance(business_key, str):
        business_key = [business_key]
    for i, key in enumerate(business_key):
        if key not in names:
            raise ConfigError(f"{where}.business_key: {key!r} is not one of the columns")
        if key in business_key[:i]:
            raise ConfigError(f"{where}.business_key: {key!r} is listed twice")
    return Pipeline(
        name=name,
        topic=topic,
        target_schema=schema,
        target_table=table,
        columns=columns,
        business_key=tuple(business_key),
        max_records_per_batch=_positive_int(raw, "max_records_per_batch", where, 100_000),
        max_records_per_partition=_positive_int(raw, "max_records_per_partition", where, None),
        batches_per_run=_positive_int(raw, "batches_per_run", where, 1),
        on_retention_loss=_choice(raw, "on_retention_loss", where, ("fail", "skip")),
        new_partition_start=_choice(raw, "new_partition_start", where, ("earliest", "latest")),
        duplicate_policy=_choice(raw, "duplicate_policy", where, ("quarantine", "fail")),
        data_loss_warning_hours=_positive_number(raw, "data_loss_warning_hours", where, 24.0),
        spark_conf={str(k): str(v) for k, v in (raw.get("spark_conf") or {}).items()},
        schedule=_schedule(raw, where),
        replay_interval=_cron(raw, "replay_interval", where, "0 0 * * *"),
    )


def _positive_number(raw: dict, key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}.{key}: expected a positive number, got {value!r}")
    return float(value)


def _schedule(raw: dict, where: str) -> str | None:
    value = raw.get("schedule")
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{where}.schedule: expected a cron expression or preset like '@hourly', got {value!r}")
    return value


def _cron(raw: dict, key: str, where: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or len(value.split()) != 5:
        raise ConfigError(f"{where}.{key}: expected a 5-field cron expression like '0 0 * * *', got {value!r}")
    return value


def _identifier(raw: dict, key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ConfigError(
            f"{where}.{key}: expected a lower-case identifier ([a-z_][a-z0-9_]*, at most 63 chars), got {value!r}"
        )
    return value


def _target(value: Any, where: str) -> tuple[str, str]:
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) == 1:
        parts = ["public", *parts]
    if len(parts) != 2 or not all(_IDENTIFIER.match(p) for p in parts):
        raise ConfigError(f"{where}.target_table: expected 'table' or 'schema.table' in lower case, got {value!r}")
    return parts[0], parts[1]


def _columns(value: Any, where: str) -> tuple[Column, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}.columns: expected a non-empty list of columns")
    columns = []
    for index, raw in enumerate(value):
        here = f"{where}.columns[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{here}: expected a mapping with name and type")
        unknown = sorted(set(raw) - {"name", "type", "field", "required", "min", "max", "allowed", "on_violation"})
        if unknown:
            raise ConfigError(f"{here}: unknown field(s) {', '.join(unknown)}")
        name = _identifier(raw, "name", here)
        if name in _RESERVED_COLUMNS:
            raise ConfigError(f"{here}.name: {name!r} is reserved for provenance/bookkeeping")
        pg_type = raw.get("type")
        if not isinstance(pg_type, str) or spark_type_for(pg_type) is None:
            supported = "text, bigint, integer, double precision, boolean, timestamptz, date, "
            raise ConfigError(f"{here}.type: unsupported type {pg_type!r} (supported: {supported}jsonb, numeric(p,s))")
        json_field = raw.get("field", name)
        if not isinstance(json_field, str) or not json_field:
            raise ConfigError(f"{here}.field: expected the JSON field name, got {json_field!r}")
        required = raw.get("required", False)
        if not isinstance(required, bool):
            raise ConfigError(f"{here}.required: expected true or false, got {required!r}")
        columns.append(Column(name, pg_type.strip().lower(), json_field, required, *_rules(raw, here, pg_type)))
    names = [c.name for c in columns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{where}.columns: duplicate column name(s) {', '.join(duplicates)}")
    return tuple(columns)


_NUMERIC = re.compile(r"(bigint|integer|double precision|numeric\(\d+,\s*\d+\))")
_ALLOWED_TYPES = {"text": str, "bigint": int, "integer": int, "boolean": bool}


def _rules(raw: dict, here: str, pg_type: str) -> tuple:
    """A column's declared value rules: min/max (numeric columns), allowed values (text, integer,
    boolean columns, typed like the column), and what a violation does."""
    pg_type = pg_type.strip().lower()
    bounds = []
    for key in ("min", "max"):
        value = raw.get(key)
        if value is None:
            bounds.append(None)
            continue
        if not _NUMERIC.fullmatch(pg_type):
            raise ConfigError(f"{here}.{key}: only numeric columns can have a range, not {pg_type}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{here}.{key}: expected a number, got {value!r}")
        bounds.append(float(value))
    if None not in bounds and bounds[0] > bounds[1]:
        raise ConfigError(f"{here}: min {bounds[0]} is above max {bounds[1]}")
    allowed = raw.get("allowed")
    if allowed is not None:
        kind = _ALLOWED_TYPES.get(pg_type)
        if kind is None:
            raise ConfigError(f"{here}.allowed: only {', '.join(_ALLOWED_TYPES)} columns can list allowed values")
        if not isinstance(allowed, list) or not allowed:
            raise ConfigError(f"{here}.allowed: expected a non-empty list of values, got {allowed!r}")
        wrong = [v for v in allowed if not isinstance(v, kind) or (kind is int and isinstance(v, bool))]
        if wrong:
            raise ConfigError(f"{here}.allowed: values {wrong!r} are not of the column's type {pg_type}")
        allowed = tuple(allowed)
    on_violation = _choice(raw, "on_violation", here, ("fail", "quarantine"))
    return bounds[0], bounds[1], allowed, on_violation


def _positive_int(raw: dict, key: str, where: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{key}: expected a positive integer, got {value!r}")
    return value


def _choice(raw: dict, key: str, where: str, choices: tuple[str, ...]) -> Any:
    value = raw.get(key, choices[0])
    if value not in choices:
        raise ConfigError(f"{where}.{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value
