"""The single source of configuration truth: the pipelines file and the environment.

Both are validated into frozen dataclasses; every error names the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import yaml

from kafka2pg import locations
from kafka2pg.exceptions import ConfigError, UnknownPipelineError, did_you_mean
from kafka2pg.kafka_config import KafkaConfig

log = logging.getLogger(__name__)

# The Airflow Connections a pipeline's services come from, unless it names its own.
DEFAULT_POSTGRES_CONN_ID = "kafka2pg_postgres"
DEFAULT_KAFKA_CONN_ID = "kafka2pg_kafka"
# JVM options of the stage job's driver (in local mode also its executor); a pipeline's
# spark_conf may override them. With the librdkafka reader (the default) the JVM runs no
# per-record code, only Spark's per-batch machinery (planner, closure cleaner, task
# serialisation): C1-only JIT compiles it sooner and cheaper, however many batches the job
# stages (C2 cost about 0.8 core-seconds more per 1M records and gained nothing). A job that
# catches up several batches through Spark's Kafka source (kafka_reader: spark) repays C2's
# compile time from its second batch on, for the code run per record (the Kafka client, Arrow
# transfer). Raised tier-4 thresholds (invocations 5,000 -> 100,000, about once per record of a
# batch; minimum 600 -> 20,000; calls + loops 15,000 -> 100,000; loop back-edges 40,000 ->
# 400,000) leave its per-batch machinery to C1, which halves the compiler threads' CPU. Tuned
# for batches of ~100k records: with much smaller ones, per-record code reaches C2 later.
# Parallel GC suits a batch job; its heap starts at 64 MB, not at 1/64 of the machine's memory
# (378 MB on a 24 GB machine), and grows as the job needs: the librdkafka reader leaves the JVM
# little to hold, so with it the young generation stays at 24 MB (Parallel GC grows it to about
# 70 MB otherwise, for nothing: the JVM allocates little per batch). The measurements behind
# these choices: bench/README.md.
_STAGE_JVM_GC_AND_HEAP = "-XX:+UseParallelGC -Xms64m"
STAGE_JVM_OPTIONS_C1 = f"-XX:TieredStopAtLevel=1 {_STAGE_JVM_GC_AND_HEAP}"
STAGE_JVM_OPTIONS_LIBRDKAFKA = f"{STAGE_JVM_OPTIONS_C1} -Xmn24m"
STAGE_JVM_OPTIONS_TIERED = (
    f"{_STAGE_JVM_GC_AND_HEAP} -XX:Tier4InvocationThreshold=100000 -XX:Tier4MinInvocationThreshold=20000"
    " -XX:Tier4CompileThreshold=100000 -XX:Tier4BackEdgeThreshold=400000"
)


# Log levels of Spark's own logging (log4j2) a pipeline's spark_log_level may name; the first is the default.
SPARK_LOG_LEVELS = ("WARN", "ERROR", "INFO", "DEBUG", "TRACE", "FATAL", "OFF")
# How a pipeline's Spark tasks may read Kafka (`kafka_reader`); the first is the default.
KAFKA_READERS = ("librdkafka", "spark")
# What a record's value is: JSON text, or JSON after the Confluent Schema Registry's 5-byte header.
VALUE_FORMATS = ("json", "schema_registry_json")
# kafka2pg's log4j2 configuration of the stage driver: the level comes from a system property.
SPARK_LOG_CONFIG = locations.PACKAGE_DIR / "log4j2.properties"


def stage_jvm_options(
    batches: int = 1,
    state_dir: Path | None = None,
    log_level: str = SPARK_LOG_LEVELS[0],
    kafka_reader: str = KAFKA_READERS[0],
) -> str:
    """The stage JVM's options for a job that may finish `batches` batches with `kafka_reader`,
    with the class-data archive `./kafka2pg setup` made for this pyspark and java, when there is
    one, and Spark's logging at `log_level` (kafka2pg's log4j2.properties)."""
    if kafka_reader == "librdkafka":
        options = STAGE_JVM_OPTIONS_LIBRDKAFKA
    else:
        options = STAGE_JVM_OPTIONS_C1 if batches == 1 else STAGE_JVM_OPTIONS_TIERED
    archive = class_archive_path(state_dir)
    if archive.is_file():
        options += f" -XX:SharedArchiveFile={shlex.quote(str(archive))}"
    return f"{options} {spark_log_options(log_level)}"


def spark_log_options(level: str = SPARK_LOG_LEVELS[0]) -> str:
    """JVM options that give a Spark driver kafka2pg's log4j2 configuration at `level`. Spark
    starts logging before any Python code could call setLogLevel: the level must be there first."""
    if level not in SPARK_LOG_LEVELS:
        raise ConfigError(f"Spark log level must be one of {', '.join(SPARK_LOG_LEVELS)}, got {level!r}")
    return f"-Dlog4j2.configurationFile={shlex.quote(str(SPARK_LOG_CONFIG))} -Dkafka2pg.spark.log.level={level}"


# What a stage job reading through Spark's Kafka source says where the pipeline's own Log4j 2 file replaces kafka2pg's.
UNFILTERED_LOG = (
    "spark_conf names a Log4j 2 file of its own: kafka2pg's filters for Spark's Kafka source (its DEBUG lines "
    "print the client's settings) apply only if copied into it from kafka2pg/log4j2.properties"
)


DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
# A Log4j 2 configuration file named in JVM options (its property, and the older spelling it reads).
_OWN_LOG_CONFIG = re.compile(r"-Dlog4j2?[.]configurationFile=", re.IGNORECASE)


# Spark settings whose values are secrets, by name: Spark's own default spark.redaction.regex
# (secret, password, token, access.key) and the names Hadoop's stores give their keys and
# credentials (fs.azure.account.key.*, fs.azure.sas.*, fs.s3a.secret.key, fs.s3a.encryption.key,
# fs.gs.auth.service.account.private.key, *.credentials.*) ...
_SECRET_NAME = re.compile(
    r"secret|password|passphrase|token|credential|access[.]?key|account[.]key|[.]sas[.]|encryption[.]key"
    r"|private[._-]?key",
    re.I,
)
# ... but not the settings so named that hold no secret: a switch, a class or provider, a path
# (`spark.kubernetes.driver.secrets.<name>` is where a Kubernetes secret is mounted), a reference.
_NOT_SECRET = re.compile(
    r"[.](enabled|provider|providers|class|type|mode|regex)$|(file|path|location|dir)$|[.]secrets[.]|secretKeyRef|"
    r"renewal[.]credentials",
    re.I,
)
# A value the log masker must not learn: it would hide every number of its digits in the task log.
_NUMBER = re.compile(r"[-+]?[0-9.]+")
# A JVM system property in JVM options (`-Dname=value`, the value perhaps quoted).
_JVM_PROPERTY = re.compile(r"""-D([^=\s]+)=("[^"]*"|'[^']*'|\S+)""")


def secret_setting(name: str) -> bool:
    """Whether a Spark setting (or JVM system property) of this name holds a secret."""
    return bool(_SECRET_NAME.search(name)) and not _NOT_SECRET.search(name)


def spark_conf_secrets(spark_conf: dict[str, str]) -> list[str]:
    """The secrets in a pipeline's `spark_conf`: the values of settings named as secrets, and of
    JVM system properties so named in its JVM options (`-Djavax.net.ssl.trustStorePassword=…`,
    quoted or not); not a switch's or a number's words, which the log masker would hide
    wherever they appear."""
    named = [value for key, value in spark_conf.items() if secret_setting(key)]
    for value in spark_conf.values():
        for m in _JVM_PROPERTY.finditer(value):
            if secret_setting(m.group(1)):
                named += [m.group(2), m.group(2).strip("\"'")]
    return [v for v in dict.fromkeys(named) if v and v.lower() not in ("true", "false") and not _NUMBER.fullmatch(v)]


def keep_log_options(spark_conf: dict[str, str], level: str = SPARK_LOG_LEVELS[0]) -> dict[str, str]:
    """A pipeline's `spark_conf`, where it sets the driver's JVM options (which replace
    kafka2pg's), with kafka2pg's logging configuration at `level` added to them, unless they
    name a log4j configuration file of their own: the pipeline's spark_log_level and the
    filters that keep the Kafka clients' parameters out of the task log still apply."""
    options = spark_conf.get(DRIVER_JAVA_OPTIONS)
    if options is None or names_own_log_config(spark_conf):
        return spark_conf
    return {**spark_conf, DRIVER_JAVA_OPTIONS: f"{options} {spark_log_options(level)}".strip()}


def names_own_log_config(spark_conf: dict[str, str]) -> bool:
    """Whether a pipeline's `spark_conf` gives the driver a Log4j 2 configuration file of its
    own, in place of kafka2pg's (and its filters)."""
    return bool(_OWN_LOG_CONFIG.search(spark_conf.get(DRIVER_JAVA_OPTIONS) or ""))


def stage_jvm_conf(
    batches: int = 1, state_dir: Path | None = None, kafka_reader: str = KAFKA_READERS[0]
) -> dict[str, str]:
    """Spark conf with the stage JVM's options for a job that may finish `batches` batches with `kafka_reader`."""
    return {DRIVER_JAVA_OPTIONS: stage_jvm_options(batches, state_dir, kafka_reader=kafka_reader)}


def class_archive_path(state_dir: Path | None = None) -> Path:
    """Where the stage JVM's class-data archive (AppCDS) lives: one per pyspark version and java
    binary, under the state directory (KAFKA2PG_STATE_DIR). Made by `kafka2pg.class_archive`.

    The JVM maps Spark's classes from it instead of loading and verifying them from jars: Spark
    starts and runs its first batch sooner (bench/README.md). A JVM
    whose class path differs from the one recorded ignores it with a warning.
    """
    state = Path(state_dir) if state_dir else locations.state_dir()
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
_SPARK_TYPES: dict[str, str] = {
    "text": "string",
    "bigint": "bigint",
    "integer": "int",
    "double precision": "double",
    "boolean": "boolean",
    "timestamptz": "timestamp",
    "date": "date",
    "jsonb": "string",
}
# re.ASCII: \s and the digits must not match full-width or other Unicode characters, which
# PostgreSQL's parser refuses (the type goes into the DDL as written here).
_DECIMAL = re.compile(r"numeric\(([0-9]{1,4}),\s*([0-9]{1,4})\)", re.ASCII)
# PostgreSQL's limit for a declared numeric precision (admission reads numbers as exact decimals).
MAX_NUMERIC_PRECISION = 1000

# PostgreSQL keeps identifiers to 63 bytes (NAMEDATALEN - 1) and silently truncates longer ones,
# so two names kafka2pg derives could end up one. Every derived name is built to fit instead:
# the pipeline name is limited so that its longest derived name (the staging index) fits, and
# the business-key index name is shortened with a hash of the table name (`business_key_index`).
PG_NAME_MAX = 63
_STAGING_TABLE_PREFIX = "stg_"
# Not `stg_`: the staging index can never have another pipeline's staging table's name.
_STAGING_INDEX_PREFIX = "idx_stg_"
MAX_PIPELINE_NAME = PG_NAME_MAX - len(_STAGING_INDEX_PREFIX)
_BUSINESS_KEY_SUFFIX = "_business_key"
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
_RESERVED_COLUMNS = {
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
    "kafka_timestamp",
    "batch_id",
    "promoted_at",
    "chunk",
    "raw_key",
    "raw_value",
    "raw_headers",
    "quarantine_reason",
}
# Every PostgreSQL table has these; a column of the same name cannot be created.
_SYSTEM_COLUMNS = {"tableoid", "xmin", "cmin", "xmax", "cmax", "ctid"}
# kafka2pg's own tables live in the schema kafka2pg and in public.kafka2pg_migrations; the
# other schemas are PostgreSQL's (CREATE SCHEMA refuses names starting with pg_).
_CONTROL_SCHEMA = "kafka2pg"
_CONTROL_TABLES = {("public", "kafka2pg_migrations")}
EpochUnit = Literal["seconds", "milliseconds", "microseconds", "days"]
# The units each column type reads a JSON number in.
_EPOCH_UNITS: dict[str, tuple[EpochUnit, ...]] = {
    "timestamptz": ("seconds", "milliseconds", "microseconds"),
    "date": ("days",),
}


def spark_type_for(pg_type: str) -> str | None:
    """Spark SQL type name for a supported PostgreSQL type (as `Column.type` holds it), or None."""
    if pg_type in _SPARK_TYPES:
        return _SPARK_TYPES[pg_type]
    match = _DECIMAL.fullmatch(pg_type)
    return f"decimal({int(match[1])},{int(match[2])})" if match else None


def default_pipelines_file() -> Path:
    """The pipelines file when neither KAFKA2PG_PIPELINES nor the DAG file names one: the checkout's
    `dags/pipelines.yaml`; installed, `pipelines.yaml` in Airflow's DAGs folder (`[core] dags_folder`),
    where the README's installation puts it beside the DAG file."""
    if locations.CHECKOUT_PIPELINES_FILE is not None:
        return locations.CHECKOUT_PIPELINES_FILE
    from airflow.configuration import conf

    return Path(conf.get("core", "dags_folder")).expanduser() / "pipelines.yaml"


@dataclass(frozen=True)
class Column:
    """One target column filled from one field of the JSON value (in the value_root's object, or at `path`)."""

    name: str
    type: str
    field: str
    required: bool = False
    minimum: int | float | None = None  # an int as written, exact
    maximum: int | float | None = None
    allowed: tuple[str | int | bool, ...] | None = None
    on_violation: Literal["fail", "quarantine"] = "fail"
    #: timestamptz columns: how a JSON number in the field is read (seconds, milliseconds or
    #: microseconds since 1970-01-01 UTC); date columns: days (since 1970-01-01); None: a number
    #: is refused, only strings are read.
    epoch: EpochUnit | None = None
    #: number columns (bigint, integer, double precision, numeric): also read a number written as a
    #: JSON string ("12.50"), as Debezium's decimal.handling.mode=string and many APIs write money.
    quoted_numbers: bool = False
    #: the field's names from the record's own object, whatever the value_root (`path: source.ts_ms`);
    #: () reads `field` in the root's object.
    path: tuple[str, ...] = ()

    @property
    def spark_type(self) -> str:
        return spark_type_for(self.type) or "string"

    @property
    def ranged(self) -> bool:
        """Whether the column declares a range (a minimum, a maximum or both)."""
        return self.minimum is not None or self.maximum is not None

    @property
    def range_words(self) -> str:
        """The declared range in words: "range [0, 10.5]", "minimum 0" or "maximum 10.5" (a whole
        number as the pipelines file has it, not as the float it is read into)."""
        low, high = _bound_words(self.minimum), _bound_words(self.maximum)
        if self.maximum is None:
            return f"minimum {low}"
        if self.minimum is None:
            return f"maximum {high}"
        return f"range [{low}, {high}]"

    @property
    def allowed_words(self) -> str:
        """The declared allowed values in words, the list cut after `ALLOWED_SHOWN` characters (a
        quarantine reason repeats it in every row): "allowed values ['EUR', 'USD']",
        "allowed values ['AED', 'AFN', … (183 values)"."""
        shown = repr(list(self.allowed or ()))
        if len(shown) > ALLOWED_SHOWN:
            shown = f"{shown[:ALLOWED_SHOWN]}… ({len(self.allowed)} values)"
        return f"allowed values {shown}"


def float_bound(bound: int | float | None) -> float | None:
    """A range's bound as the float GX compares, or as older kafka2pg versions read it."""
    return None if bound is None else float(bound)


def _bound_words(bound: int | float | None) -> str:
    """A range's bound without a whole number's ".0": 100000 for 100000.0 (below 1e16, where
    Python's str turns to an exponent); a whole number written without a point as written."""
    if isinstance(bound, int):
        return str(bound)
    if bound is not None and bound.is_integer() and abs(bound) < 1e16:
        return f"{bound:.0f}"  # -0.0 as -0, as its older words "-0.0" compare
    return str(bound)


# Of a column's allowed values, the characters of their list a quarantine reason shows.
ALLOWED_SHOWN = 120


@dataclass(frozen=True)
class Pipeline:
    """One topic loaded into one target table."""

    name: str
    topic: str
    target_schema: str
    target_table: str
    columns: tuple[Column, ...]
    business_key: tuple[str, ...] = ()
    # The path of fields from the record's JSON object to the object the columns' fields are in
    # (("payload",) for Kafka Connect's JSON with schemas, ("after",) for Debezium); () the record's own.
    value_root: tuple[str, ...] = ()
    # Where the value_root's object is null or missing, the object the fields are read from
    # instead (("before",) for a Debezium delete); () none: such a record is quarantined.
    value_root_fallback: tuple[str, ...] = ()
    # "schema_registry_json": each value is the JSON a Schema Registry JSON Schema serializer writes,
    # after its header (magic byte 0, the schema's 4-byte id).
    value_format: Literal["json", "schema_registry_json"] = VALUE_FORMATS[0]
    max_records_per_batch: int = 100_000
    max_records_per_partition: int | None = None
    batches_per_run: int = 1
    on_retention_loss: Literal["fail", "skip"] = "fail"
    new_partition_start: Literal["earliest", "latest"] = "earliest"
    duplicate_policy: Literal["quarantine", "fail"] = "quarantine"
    data_loss_warning_hours: float = 24.0
    # Each task of the pipeline's DAGs fails (and is retried) after this long (Airflow's
    # execution_timeout; the stage task's Spark job is stopped): None, no limit.
    task_timeout_minutes: float | None = None
    # How the stage job's Spark tasks read Kafka: librdkafka (confluent-kafka) in the Python task that
    # also admits and COPYs the records, or Spark's Kafka source (the Java client) feeding it.
    kafka_reader: Literal["librdkafka", "spark"] = KAFKA_READERS[0]
    spark_conf: dict[str, str] = field(default_factory=dict)
    spark_log_level: str = SPARK_LOG_LEVELS[0]
    schedule: str | None = None
    replay_interval: str = "0 0 * * *"
    postgres_conn_id: str = DEFAULT_POSTGRES_CONN_ID
    kafka_config_id: str = DEFAULT_KAFKA_CONN_ID
    # A Kafka consumer group the heads are mirrored into after each promotion, for Kafka's own lag
    # tools (None: off). Informational only: nothing of kafka2pg reads it back.
    lag_consumer_group: str | None = None

    @property
    def dag_id(self) -> str:
        return f"kafka2pg_{self.name}"

    @property
    def replay_dag_id(self) -> str:
        return f"kafka2pg_{self.name}_replay"

    @property
    def asset_alias(self) -> str:
        """The Airflow AssetAlias its promote and finish tasks emit the target table's Asset through."""
        return f"kafka2pg_{self.name}"

    @property
    def staging_table(self) -> str:
        return f"{_STAGING_TABLE_PREFIX}{self.name}"

    @property
    def staging_index(self) -> str:
        """The staging table's (batch_id, chunk) index. Databases migrated before this name was
        chosen keep theirs (`stg_<name>_batch`): migrations look the index up by its columns."""
        return f"{_STAGING_INDEX_PREFIX}{self.name}"

    @property
    def business_key_index(self) -> str:
        """The target's unique business-key index: `<table>_business_key`, or, when that would
        exceed 63 bytes, the table name cut to 41 bytes + `_<8 hex digits of the table name's
        SHA-256>_business_key` (63 bytes): never truncated by PostgreSQL, never the table's own
        name, and different for two long tables sharing a prefix."""
        name = f"{self.target_table}{_BUSINESS_KEY_SUFFIX}"
        if len(name) <= PG_NAME_MAX:
            return name
        digest = hashlib.sha256(self.target_table.encode()).hexdigest()[:8]
        keep = PG_NAME_MAX - len(_BUSINESS_KEY_SUFFIX) - len(digest) - 1
        return f"{self.target_table[:keep]}_{digest}{_BUSINESS_KEY_SUFFIX}"

    @property
    def required_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.required)


@dataclass(frozen=True)
class Settings:
    """Where the services are and how to reach them. Airflow tasks and the CLI build it from the
    pipeline's Airflow Connections (`kafka2pg.connections`); the Spark job, from the environment
    its operator passes (`from_env`, `to_env`)."""

    kafka: KafkaConfig
    database_url: str = field(repr=False)  # it may hold a password
    spark_master: str = "local[*]"
    pipelines_file: Path = field(default_factory=default_pipelines_file)
    kafka_timeout_s: float = 10.0
    state_dir: Path = field(default_factory=locations.default_state_dir)

    def __post_init__(self) -> None:
        if isinstance(self.kafka, str):  # a bootstrap-servers string: a PLAINTEXT cluster
            object.__setattr__(self, "kafka", KafkaConfig.plain(self.kafka))

    @property
    def bootstrap_servers(self) -> str:
        return self.kafka.servers

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """KAFKA2PG_KAFKA_CONFIG (a JSON object of client properties) or KAFKA2PG_BOOTSTRAP_SERVERS,
        and KAFKA2PG_DATABASE_URL."""
        env = dict(os.environ if env is None else env)
        kafka = kafka_from_env(env)
        database_url = locations.env_setting(env, "KAFKA2PG_DATABASE_URL")
        if kafka is None or not database_url:
            missing = [
                n
                for n, ok in (
                    ("KAFKA2PG_BOOTSTRAP_SERVERS", kafka),
                    ("KAFKA2PG_DATABASE_URL", database_url),
                )
                if not ok
            ]
            raise ConfigError(
                f"environment variable(s) {', '.join(missing)} not set: define the Airflow connections "
                "kafka2pg_kafka and kafka2pg_postgres (README, Configuration), or set these variables, or start "
                f"the local stack with `{locations.COMMAND} stack start` and "
                f"`source {locations.state_dir(env) / 'stack' / 'stack.env'}`"
            )
        return cls(
            kafka=kafka,
            database_url=database_url,
            **common_settings(env),
        )

    def to_env(self) -> dict[str, str]:
        """The environment `from_env` reads back: what the stage operator hands the Spark job."""
        return {
            "KAFKA2PG_KAFKA_CONFIG": self.kafka.to_json(),
            "KAFKA2PG_DATABASE_URL": self.database_url,
            "KAFKA2PG_PIPELINES": str(self.pipelines_file),
            "KAFKA2PG_KAFKA_TIMEOUT_S": str(self.kafka_timeout_s),
            "KAFKA2PG_STATE_DIR": str(self.state_dir),
        }


def given_twice(where: str, keys: list[str], reader: str = "JSON") -> ConfigError:
    """The refusal of `keys` a text gives more than once in one object: `reader` (JSON, YAML)
    keeps only the last value of each, without a word."""
    return ConfigError(
        f"{where}: {', '.join(keys)} given more than once ({reader} keeps only the last, silently): give each key once"
    )


def json_and_repeats(text: str) -> tuple[Any, list[str]]:
    """The JSON document `text` holds, and the keys it gives more than once in one object (JSON
    keeps the last); `json.JSONDecodeError` when it is no JSON."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict:
        seen = set()
        for key, _ in items:
            if key in seen and key not in repeated:
                repeated.append(key)
            seen.add(key)
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs), repeated


def repeated_json_keys(text: Any) -> list[str]:
    """The keys a JSON text gives more than once in one object (none when it is no JSON)."""
    try:
        return json_and_repeats(text)[1] if isinstance(text, str) else []
    except ValueError:
        return []


def kafka_from_env(env: dict[str, str]) -> KafkaConfig | None:
    """KAFKA2PG_KAFKA_CONFIG (JSON client properties; `bootstrap.servers` from
    KAFKA2PG_BOOTSTRAP_SERVERS when it has none) or KAFKA2PG_BOOTSTRAP_SERVERS; None if neither."""
    text = locations.env_setting(env, "KAFKA2PG_KAFKA_CONFIG")
    servers = locations.env_setting(env, "KAFKA2PG_BOOTSTRAP_SERVERS")
    if text:
        try:
            properties, repeated = json_and_repeats(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"KAFKA2PG_KAFKA_CONFIG is not a JSON object of Kafka client properties ({exc.msg})"
            ) from None
        if repeated:
            raise given_twice("KAFKA2PG_KAFKA_CONFIG", list(map(repr, repeated)))
        if isinstance(properties, dict) and "bootstrap.servers" not in properties and servers:
            properties = {"bootstrap.servers": servers, **properties}
        return KafkaConfig.of(properties, "KAFKA2PG_KAFKA_CONFIG")
    if servers:
        return KafkaConfig.plain(servers)
    return None


def common_settings(env: dict[str, str]) -> dict[str, Any]:
    """The settings that come from the environment however the services are found."""
    timeout = locations.env_setting(env, "KAFKA2PG_KAFKA_TIMEOUT_S", "10")
    try:
        kafka_timeout_s = float(timeout)
    except ValueError as exc:
        raise ConfigError(f"KAFKA2PG_KAFKA_TIMEOUT_S must be a number of seconds, got {timeout!r}") from exc
    # At least a second (librdkafka refuses socket timeouts under 10 ms); at most 300: a chunk writer's
    # transaction waits on Kafka reads, and PostgreSQL ends a session idle in one for 600 s.
    if not 1 <= kafka_timeout_s <= 300:
        raise ConfigError(f"KAFKA2PG_KAFKA_TIMEOUT_S must be 1 to 300 seconds, got {timeout!r}")
    return {
        "spark_master": locations.env_setting(env, "KAFKA2PG_SPARK_MASTER", "local[*]"),
        "pipelines_file": pipelines_file_from_env(env=env),
        "kafka_timeout_s": kafka_timeout_s,
        "state_dir": locations.state_dir(env),
    }


def pipelines_file_from_env(default: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """The pipelines file: KAFKA2PG_PIPELINES, else `default` (the DAG file passes the `pipelines.yaml`
    beside it), else `default_pipelines_file()`. Needs no service settings."""
    value = locations.env_setting(env, "KAFKA2PG_PIPELINES")
    return Path(value) if value else Path(default or default_pipelines_file())


def load_pipelines(path: Path | None = None) -> dict[str, Pipeline]:
    """Parse and validate the pipelines file into `Pipeline` objects keyed by name; any error
    in it is raised (an entry's own errors first, in the file's order, then clashes)."""
    pipelines, broken = read_pipelines(path)
    if broken:
        raise next(iter(broken.values()))
    return pipelines


class _Inexact(float):
    """A float whose YAML text has digits no float keeps (`written`): 0.30000000000000001 is 0.3."""

    written: str


class _MisreadInt(int):
    """A number YAML 1.1 reads in a base its text does not show (`written`): 010 is the octal
    number 8, 1:30 the base-60 number 90 (`reading` says which)."""

    written: str
    reading: str


class _MisreadFloat(float):
    """A float YAML 1.1 reads in base 60 (`written`): 1:30.5 is 90.5."""

    written: str
    reading = "the base-60 number"


_MISREAD = (_MisreadInt, _MisreadFloat)


class _Mapping(dict):
    """A mapping as YAML read it; `repeated`: its keys written more than once (PyYAML keeps the
    last one's value), a merge key's (`<<`) overridden keys not counted."""

    repeated: tuple = ()


class _PipelinesLoader(yaml.SafeLoader):
    """YAML's safe loader, marking a float written with more digits than it keeps (`_Inexact`),
    a number read in a base its text does not show (`_MISREAD`) and a mapping's keys given more
    than once (`_Mapping.repeated`): a value read as another than the one it looks like, or one
    of two values dropped, would change the pipeline silently."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.repeated: dict[yaml.Node, tuple] = {}  # a mapping node's keys given twice, as written

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Note the node's repeated keys as written (the first time it is flattened, before the
        mappings it merges are put into it; a merge key given twice too: the later one would win),
        with those of the mappings it merges, then flatten it as YAML does."""
        if node in self.repeated:
            super().flatten_mapping(node)
            return
        keys, merged = [], []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                keys.append("<<")
                merged.extend(value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node])
            elif key_node.tag == "tag:yaml.org,2002:value":  # `=`, which flattening makes a string
                keys.append("=")
            else:
                keys.append(self.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else object())
        self.repeated[node] = ()  # a mapping merging itself (through an alias) is flattened once
        super().flatten_mapping(node)
        repeated = [key for n, key in enumerate(keys) if key in keys[:n]]
        for other in merged:
            repeated.extend(self.repeated.get(other, ()))
        self.repeated[node] = tuple(dict.fromkeys(repeated))


def _int_as_written(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    value = loader.construct_yaml_int(node)
    digits = node.value.replace("_", "").lstrip("+-")
    if ":" in digits:
        reading = "the base-60 number"
    elif len(digits) > 1 and digits.startswith("0") and digits.isdigit() and int(digits, 10) != abs(value):
        reading = "the octal number"  # 010; not 00 or 07, which are the same number either way
    else:
        return value
    marked = _MisreadInt(value)
    marked.written, marked.reading = node.value, reading
    return marked


def _float_as_written(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    value = loader.construct_yaml_float(node)
    try:
        exact = not math.isfinite(value) or Decimal(node.value.replace("_", "")) == Decimal(repr(value))
    except InvalidOperation:  # YAML 1.1's base-60 floats (1:30.5): not a decimal text
        base60 = _MisreadFloat(value)
        base60.written = node.value
        return base60
    if exact:
        return value
    marked = _Inexact(value)
    marked.written = node.value
    return marked


def _mapping_as_written(loader: _PipelinesLoader, node: yaml.MappingNode) -> Iterator[dict]:
    data = _Mapping()
    yield data
    data.update(loader.construct_mapping(node))
    data.repeated = loader.repeated.get(node, ())


_PipelinesLoader.add_constructor("tag:yaml.org,2002:float", _float_as_written)
_PipelinesLoader.add_constructor("tag:yaml.org,2002:int", _int_as_written)
_PipelinesLoader.add_constructor("tag:yaml.org,2002:map", _mapping_as_written)


def _refuse_unlike_written(value: Any, here: str, seen: set[int] | None = None) -> None:
    """Refuse what a pipeline's entry holds other than as written: a key given twice (only the
    last counts) or a number YAML read in a base its text does not show (spark_conf's values
    not quoted: they may be secrets). A mapping or list an alias repeats is looked at once."""
    seen = set() if seen is None else seen
    if isinstance(value, dict | list):
        if id(value) in seen:
            return
        seen.add(id(value))
    if isinstance(value, dict):
        if getattr(value, "repeated", ()):
            others = [_key_text(key) for key in value.repeated if key != "<<"]
            if "<<" not in value.repeated:
                raise given_twice(here, others, "YAML")
            # PyYAML merges both: what they share comes from the later. In one `<<: [...]` the
            # first listed wins, so the later mapping goes first to keep what was read.
            merges = (
                "<< given more than once (PyYAML merges each; what they share comes from the later one): merge "
                "them with one << listing the later first, <<: [*later, *earlier] (in a list the first listed wins)"
            )
            if others:
                raise ConfigError(f"{given_twice(here, others, 'YAML')}; and {merges}")
            raise ConfigError(f"{here}: {merges}")
        for key, item in value.items():
            _refuse_unlike_written(key, f"{here}: the key {_key_text(key)}", seen)
            _refuse_unlike_written(item, f"{here}.{_key_text(key)}", seen)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_unlike_written(item, f"{here}[{index}]", seen)
    elif isinstance(value, _MISREAD):
        if ".spark_conf." in f"{here}.":
            what = f"a number with a leading zero or a colon is read by YAML 1.1 as {value.reading}"
        else:
            what = f"{value.written} is read by YAML 1.1 as {value.reading} {value!r}"
        raise ConfigError(
            f"{here}: {what}, not the decimal number it looks like: write the number meant without a leading "
            "zero or colon, or quote it if it is text"
        )


def read_pipelines(path: Path | None = None) -> tuple[dict[str, Pipeline], dict[str, ConfigError]]:
    """The pipelines file, each pipeline checked on its own: (the valid pipelines by name, the
    error of every other one by its name, or `pipelines[i]` where it has no usable name), both in
    the file's order. Of two pipelines that take the same name, target table or DAG id, the
    later one is in error (a duplicate name as `pipelines[i]`). An unreadable file, or one
    without a `pipelines:` list, raises `ConfigError`."""
    path = Path(path or pipelines_file_from_env())
    try:
        document = yaml.load(path.read_text(), _PipelinesLoader)  # a SafeLoader: plain data only
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: pipelines file not found (set KAFKA2PG_PIPELINES)") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{path}: a directory, not a pipelines file (KAFKA2PG_PIPELINES names the file)") from exc
    except (PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: the pipelines file cannot be read ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    except (ValueError, TypeError, OverflowError):  # a tagged value its tag cannot read (`!!int x`)
        raise ConfigError(
            f"{path}: not valid YAML: a value its tag (`!!int`, `!!float`, `!!timestamp`, ...) cannot read"
        ) from None
    if "pipelines" in getattr(document, "repeated", ()):
        raise ConfigError(f"{path}: 'pipelines:' given more than once (YAML keeps only the last, silently)")
    if not isinstance(document, dict) or not isinstance(document.get("pipelines"), list):
        raise ConfigError(f"{path}: expected a top-level 'pipelines:' list")
    pipelines: dict[str, Pipeline] = {}
    indexes: dict[str, int] = {}  # a valid pipeline's place in the file
    broken: dict[str, ConfigError] = {}
    for index, raw in enumerate(document["pipelines"]):
        named = raw.get("name") if isinstance(raw, dict) else None
        usable = isinstance(named, str) and _IDENTIFIER.fullmatch(named) and len(named) <= MAX_PIPELINE_NAME
        key = named if usable else f"pipelines[{index}]"
        if key in pipelines or key in broken:  # the name an earlier entry has: this one is in error
            key = f"pipelines[{index}]"
            broken[key] = ConfigError(f"{path}: pipelines[{index}].name: duplicate name {named!r}")
            continue
        try:
            pipelines[key] = _parse_pipeline(raw, f"{path}: pipelines[{index}]")
            indexes[key] = index
        except ConfigError as exc:
            broken[key] = exc
        except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as exc:  # a shape no check foresaw
            # This entry's error; the trace, in case the parser is at fault rather than the entry.
            log.warning("pipelines[%s] of %s could not be read", index, path, exc_info=True)
            broken[key] = ConfigError(
                f"{path}: pipelines[{index}]: not a pipeline kafka2pg can read ({type(exc).__name__}: {exc}); "
                "check each field's type against the pipelines-file reference"
            )
    for name, error in _clashes(path, [(indexes[p.name], p) for p in pipelines.values()]).items():
        broken[name] = error
        del pipelines[name]
    return pipelines, broken


def _claims(pipeline: Pipeline) -> list[tuple[tuple[str, str], str, str]]:
    """The names a pipeline takes where another pipeline could take them too, as
    ((namespace, name), field that decides it, what it is). Names in the schema kafka2pg
    (staging table and index) differ by design: they embed the (unique) pipeline name."""
    schema = f"relations of schema {pipeline.target_schema}"
    claims = [
        (("Airflow DAG ids", pipeline.dag_id), "name", "DAG id"),
        (("Airflow DAG ids", pipeline.replay_dag_id), "name", "replay DAG id"),
        ((schema, pipeline.target_table), "target_table", "target table"),
    ]
    if pipeline.business_key:
        claims.append(((schema, pipeline.business_key_index), "target_table", "business-key index"))
    return claims


def _clashes(path: Path, pipelines: list[tuple[int, Pipeline]]) -> dict[str, ConfigError]:
    """Two pipelines must not share a target table, a DAG id or a name migrations create in one
    schema: one of them would silently use (or never create) the other's. The later entry in the
    file is in error (a pipeline added beside a running one does not stop it)."""
    taken: dict[tuple[str, str], tuple[int, Pipeline, str]] = {}
    clashes: dict[str, ConfigError] = {}
    for index, pipeline in pipelines:
        for key, field_name, what in _claims(pipeline):
            if key in taken:
                other_index, other, other_what = taken[key]
                error = ConfigError(
                    f"{path}: pipelines[{index}] ({pipeline.name}).{field_name}: its {what} {key[1]!r} is also the "
                    f"{other_what} of pipeline {other.name!r} (pipelines[{other_index}]) among the {key[0]}. "
                    "Give each pipeline its own target table and name."
                )
                clashes.setdefault(pipeline.name, error)
            else:
                taken[key] = (index, pipeline, what)
    return clashes


def get_pipeline(name: str, path: Path | None = None) -> Pipeline:
    """The named pipeline (whatever errors the file's other pipelines have), its `ConfigError`,
    or `UnknownPipelineError` listing the known ones."""
    pipelines, broken = read_pipelines(path)
    if name in broken:
        raise broken[name]
    if name not in pipelines:
        known = ", ".join(sorted([*pipelines, *broken])) or "none"
        # An entry whose name is unusable (mistyped, upper case, its key misspelt) may be the one meant.
        unnamed = [str(error) for key, error in broken.items() if key.startswith("pipelines[")]
        maybe = "".join(f"; an entry without a usable name may be it: {error}" for error in unnamed)
        raise UnknownPipelineError(
            f"unknown pipeline {name!r} in {path or pipelines_file_from_env()} (known: {known}){maybe}", pipeline=name
        )
    return pipelines[name]


_PIPELINE_KEYS = {
    "name",
    "topic",
    "target_table",
    "columns",
    "business_key",
    "value_root",
    "value_root_fallback",
    "value_format",
    "max_records_per_batch",
    "max_records_per_partition",
    "batches_per_run",
    "on_retention_loss",
    "new_partition_start",
    "duplicate_policy",
    "data_loss_warning_hours",
    "task_timeout_minutes",
    "kafka_reader",
    "spark_conf",
    "spark_log_level",
    "schedule",
    "replay_interval",
    "postgres_conn_id",
    "kafka_config_id",
    "lag_consumer_group",
}


def _unknown_keys(raw: dict, known: set[str]) -> list[str]:
    """`raw`'s keys not in `known`, as text (YAML also makes keys of numbers, null, lists)."""
    return sorted(_key_text(key) for key in raw if key not in known)


def _key_text(key: Any) -> str:
    """A key of the file as an error shows it: as written, or quoted if it is no printable text."""
    return key if isinstance(key, str) and key.isprintable() and key.strip() == key and key else repr(key)


def _parse_pipeline(raw: Any, where: str) -> Pipeline:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = _unknown_keys(raw, _PIPELINE_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown)}{did_you_mean(unknown, _PIPELINE_KEYS)}. "
            f"A pipeline's fields: {', '.join(sorted(_PIPELINE_KEYS))}"
        )
    name = _identifier(raw, "name", where, MAX_PIPELINE_NAME)
    where = f"{where} ({name})"
    _refuse_unlike_written(raw, where)
    topic = topic_name(raw.get("topic"), f"{where}.topic")
    schema, table = _target(raw.get("target_table"), where)
    columns = _columns(raw.get("columns"), where)
    value_root = _value_root(raw.get("value_root"), where)
    _check_locations(columns, value_root, "value_root", where)
    fallback = _value_root_fallback(raw.get("value_root_fallback"), value_root, where)
    if fallback:
        _check_locations(columns, fallback, "value_root_fallback", where)
    business_key = _business_key(raw.get("business_key"), columns, where)
    for index, spec in enumerate(raw["columns"]):
        if spec.get("required") is False and spec["name"] in business_key:
            raise ConfigError(
                f"{where}.columns[{index}].required: {spec['name']!r} is in business_key, and a business key is "
                "always required (a record without it is quarantined): remove `required: false`"
            )
    return Pipeline(
        name=name,
        topic=topic,
        target_schema=schema,
        target_table=table,
        columns=columns,
        business_key=business_key,
        value_root=value_root,
        value_root_fallback=fallback,
        value_format=_choice(raw, "value_format", where, VALUE_FORMATS),
        max_records_per_batch=_positive_int(raw, "max_records_per_batch", where, 100_000),
        max_records_per_partition=_positive_int(raw, "max_records_per_partition", where, None),
        batches_per_run=_positive_int(raw, "batches_per_run", where, 1),
        on_retention_loss=_choice(raw, "on_retention_loss", where, ("fail", "skip")),
        new_partition_start=_choice(raw, "new_partition_start", where, ("earliest", "latest")),
        duplicate_policy=_choice(raw, "duplicate_policy", where, ("quarantine", "fail")),
        data_loss_warning_hours=_positive_number(raw, "data_loss_warning_hours", where, 24.0),
        task_timeout_minutes=_task_timeout(raw, where),
        kafka_reader=_choice(raw, "kafka_reader", where, KAFKA_READERS),
        spark_conf=_spark_conf(raw.get("spark_conf"), where),
        spark_log_level=_choice(raw, "spark_log_level", where, SPARK_LOG_LEVELS),
        schedule=_schedule(raw, where),
        replay_interval=_cron(raw, "replay_interval", where, "0 0 * * *"),
        postgres_conn_id=_conn_id(raw, "postgres_conn_id", where, DEFAULT_POSTGRES_CONN_ID),
        kafka_config_id=_conn_id(raw, "kafka_config_id", where, DEFAULT_KAFKA_CONN_ID),
        lag_consumer_group=_consumer_group(raw, where),
    )


def _field_name(name: Any) -> bool:
    """Whether `name` can name a JSON field: a non-empty string of Unicode characters (no lone
    surrogate, which no JSON text's UTF-8 holds) without control characters."""
    if not isinstance(name, str) or not name or re.search(r"[\x00-\x1f\x7f]", name):
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _value_root(value: Any, where: str) -> tuple[str, ...]:
    return _field_path(
        value, f"{where}.value_root", "the JSON object the columns' fields are in", "for the record's own object"
    )


def _value_root_fallback(value: Any, root: tuple[str, ...], where: str) -> tuple[str, ...]:
    here = f"{where}.value_root_fallback"
    fallback = _field_path(
        value,
        here,
        "the JSON object the columns' fields are in where the value_root's is null or missing",
        "for no fallback",
    )
    if fallback and not root:
        raise ConfigError(
            f"{here}: there is no value_root to fall back from: the columns' fields are read from the record's own "
            "object, which is never null; set value_root too (value_root: after, value_root_fallback: before)"
        )
    shorter = min(len(root), len(fallback))
    if fallback and root[:shorter] == fallback[:shorter]:
        raise ConfigError(
            f"{here}: {'.'.join(fallback)!r} is the value_root {'.'.join(root)!r}, holds it or lies in it: "
            "name an object beside it (value_root: after, value_root_fallback: before)"
        )
    return fallback


# The most names a value_root or a column's path may have (a record nests at most 900 levels).
MAX_PATH_NAMES = 100


def _field_path(value: Any, here: str, what: str, off: str) -> tuple[str, ...]:
    """A dotted path (`payload`, `envelope.data`) or a list of field names (for a name with a dot);
    `off`: what leaving it out means (for a `no` YAML read as false)."""
    if value is None:
        return ()
    names = value.split(".") if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{here}: expected {what}, as a dotted path (payload, after) or a list of field names, "
            f"got {_got(value, off=off)}"
        )
    for name in names:
        if not _field_name(name):
            raise ConfigError(
                f"{here}: {value!r} has an empty field name, or one with a control character or a lone surrogate"
            )
    if len(names) > MAX_PATH_NAMES:
        raise ConfigError(f"{here}: {len(names)} field names, at most {MAX_PATH_NAMES}")
    return tuple(names)


def _check_locations(columns: tuple[Column, ...], root: tuple[str, ...], key_of_root: str, where: str) -> None:
    """Each column reads its own field, and not an object the value_root (or its fallback,
    `key_of_root` says which) is or another column's field is in (a column reads one JSON value:
    the object itself, as jsonb, would be read twice)."""
    reading = " in records read from the value_root_fallback" if key_of_root == "value_root_fallback" else ""
    located = [(c.path or (*root, c.field), index, "path" if c.path else "field") for index, c in enumerate(columns)]
    seen: dict[tuple[str, ...], int] = {}
    for location, index, key in located:
        shown = ".".join(location)
        if location in seen:
            raise ConfigError(
                f"{where}.columns[{index}].{key}: JSON field {shown!r} is already read by columns[{seen[location]}]"
                f"{reading}: each column reads its own field"
            )
        seen[location] = index
        if root[: len(location)] == location:
            raise ConfigError(
                f"{where}.columns[{index}].{key}: {shown!r} is the {key_of_root}'s object or holds it: read its "
                "fields as columns instead"
            )
    for location, index, key in located:
        for inner, other, _ in located:
            if len(inner) > len(location) and inner[: len(location)] == location:
                raise ConfigError(
                    f"{where}.columns[{index}].{key}: {'.'.join(location)!r} is an object columns[{other}] reads a "
                    f"field in ({'.'.join(inner)!r}){reading}: read its fields as columns instead"
                )


def topic_name(value: Any, where: str) -> str:
    """`value` if it is a name Kafka takes for a topic; else a ConfigError naming `where` (if not empty)."""
    # Kafka's own rule (Topic.validate): 1-249 of these characters, and not "." or "..".
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", value) or value in (".", ".."):
        raise ConfigError(
            f"{where}{': ' if where else ''}expected a Kafka topic name (1-249 characters of A-Z a-z 0-9 . _ -, "
            f"not '.' or '..'), got {_got(value)}"
        )
    return value


def _business_key(value: Any, columns: tuple[Column, ...], where: str) -> tuple[str, ...]:
    keys = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{where}.business_key: expected a column name or a list of column names, got {_got(value)}")
    by_name = {c.name: c for c in columns}
    for i, key in enumerate(keys):
        if key not in by_name:
            raise ConfigError(f"{where}.business_key: {key!r} is not one of the columns")
        if key in keys[:i]:
            raise ConfigError(f"{where}.business_key: {key!r} is listed twice")
        if by_name[key].type == "jsonb":
            # Equal jsonb values can differ as text, and the quality gate's uniqueness check of a
            # key of several columns cannot compare JSON documents (every batch would fail it).
            raise ConfigError(
                f"{where}.business_key: {key!r} is a jsonb column; a business key must be scalar: map the "
                "identifying JSON field to a text, bigint or other scalar column and use that"
            )
    return tuple(keys)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found wrong, and where (line and column), without the line itself: a pipelines
    file's line may hold a secret (a spark_conf value), and the error is shown in Airflow's UI."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses: its code and position, no text
        return " ".join(str(exc).split())
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    said = [
        f"{words} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else str(words)
        for words, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark))
        if words
    ]
    return "; ".join(said) or type(exc).__name__


def _spark_conf(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        # Not the value: it may hold the secrets of the settings it meant to give.
        raise ConfigError(f"{where}.spark_conf: expected a mapping of Spark settings, got a {type(value).__name__}")
    wrong = sorted(_key_text(k) for k, v in value.items() if not isinstance(v, str | int | float | bool))
    if wrong:
        raise ConfigError(f"{where}.spark_conf: {', '.join(wrong)}: expected a string or number as the value")
    return {str(k): str(v) for k, v in value.items()}


_CONN_ID = re.compile(r"[A-Za-z0-9_.-]{1,250}")


def _conn_id(raw: dict, key: str, where: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or not _CONN_ID.fullmatch(value):
        raise ConfigError(
            f"{where}.{key}: expected an Airflow connection id (letters, digits, _ . -), got {_got(value)}"
        )
    return value


def _consumer_group(raw: dict, where: str) -> str | None:
    value = raw.get("lag_consumer_group")
    if value is not None and (not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", value)):
        raise ConfigError(
            f"{where}.lag_consumer_group: expected a Kafka consumer group id (1-249 characters of A-Z a-z 0-9 . _ -), "
            f"got {_got(value, off='to commit the heads to no consumer group')}"
        )
    return value


def _positive_number(raw: dict, key: str, where: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    number = _finite(value)
    if number is None or not number > 0:
        raise ConfigError(f"{where}.{key}: expected a positive number, got {value!r}{_null_note(value, default)}")
    return number


def _finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number (not a bool, nor an integer beyond float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _task_timeout(raw: dict, where: str) -> float | None:
    """At least a minute: a task's fixed costs (Airflow's start, spark-submit's JVM) take seconds,
    and Airflow reads a timeout that rounds to 0 as none."""
    minutes = _positive_number(raw, "task_timeout_minutes", where, None)
    if minutes is not None and minutes < 1:
        raise ConfigError(f"{where}.task_timeout_minutes: expected at least 1 (minute), got {minutes:g}")
    if minutes is not None and minutes > MAX_TASK_TIMEOUT_MINUTES:
        raise ConfigError(
            f"{where}.task_timeout_minutes: expected at most {MAX_TASK_TIMEOUT_MINUTES} (a year), got {minutes:g}"
            " (leave it out for no limit)"
        )
    return minutes


# A year: Airflow keeps the timeout as a timedelta, which a larger number of minutes overflows.
MAX_TASK_TIMEOUT_MINUTES = 366 * 24 * 60


def _null_note(value: Any, default: Any) -> str:
    """For a field given as null that has a default: how to get it (null is not "no limit")."""
    return f" (leave it out for the default, {default})" if value is None else ""


# Airflow's schedule presets (its cron presets, @once and @continuous).
SCHEDULE_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly", "@once", "@continuous")


def _schedule(raw: dict, where: str) -> str | None:
    value = raw.get("schedule")
    if value is None:
        return None
    expected = f"{where}.schedule: expected a cron expression or one of {', '.join(SCHEDULE_PRESETS)}"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{expected}, got {_got(value, off='for runs only when triggered', quote='')}")
    if value.strip().lower() in ("none", "null", "~"):
        raise ConfigError(
            f"{expected}, got the text {value!r}: for runs only when triggered, leave schedule out (or write null)"
        )
    if value.strip() not in SCHEDULE_PRESETS and not _croniter_reads(value):
        raise ConfigError(f"{expected}, got {value!r} (not a cron expression croniter reads)")
    return value.strip()  # as checked: Airflow refuses a preset with a space around it


def _croniter_reads(value: str) -> bool:
    """Whether croniter, Airflow's own cron parser, reads `value` (True where it is not installed:
    the config is read without Airflow too, and Airflow checks it where it runs)."""
    try:
        from croniter import croniter
    except ImportError:
        return True
    return croniter.is_valid(value)


def _cron(raw: dict, key: str, where: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str) or len(value.split()) != 5:
        raise ConfigError(
            f"{where}.{key}: expected a 5-field cron expression like '0 0 * * *', got {_got(value, quote='')}"
        )
    if not _croniter_reads(value):
        raise ConfigError(
            f"{where}.{key}: expected a 5-field cron expression like '0 0 * * *', got {value!r} "
            "(not a cron expression croniter reads)"
        )
    return value


def _identifier(raw: dict, key: str, where: str, max_length: int = PG_NAME_MAX) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value) or len(value) > max_length:
        raise ConfigError(
            f"{where}.{key}: expected a lower-case identifier ([a-z_][a-z0-9_]*, at most {max_length} "
            f"characters), got {_got(value)}"
        )
    return value


def _target(value: Any, where: str) -> tuple[str, str]:
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) == 1:
        parts = ["public", *parts]
    if len(parts) != 2 or not all(_IDENTIFIER.fullmatch(p) and len(p) <= PG_NAME_MAX for p in parts):
        raise ConfigError(
            f"{where}.target_table: expected 'table' or 'schema.table' in lower case (each at most "
            f"{PG_NAME_MAX} characters of a-z 0-9 _), got {_got(value)}"
        )
    schema, table = parts
    if schema == _CONTROL_SCHEMA or (schema, table) in _CONTROL_TABLES:
        raise ConfigError(
            f"{where}.target_table: {value!r} is kafka2pg's own (the schema kafka2pg holds its ledger and "
            "staging tables, public.kafka2pg_migrations its migrations): choose another schema or table"
        )
    if schema.startswith("pg_") or schema == "information_schema":
        raise ConfigError(f"{where}.target_table: schema {schema!r} is PostgreSQL's own: choose another schema")
    return schema, table


def _columns(value: Any, where: str) -> tuple[Column, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}.columns: expected a non-empty list of columns")
    columns = []
    for index, raw in enumerate(value):
        here = f"{where}.columns[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"{here}: expected a mapping with name and type")
        unknown = _unknown_keys(raw, _COLUMN_KEYS)
        if unknown:
            raise ConfigError(
                f"{here}: unknown field(s) {', '.join(unknown)}{did_you_mean(unknown, _COLUMN_KEYS)}. "
                f"A column's fields: {', '.join(sorted(_COLUMN_KEYS))}"
            )
        name = _identifier(raw, "name", here)
        if name in _RESERVED_COLUMNS:
            raise ConfigError(f"{here}.name: {name!r} is reserved for provenance/bookkeeping")
        if name in _SYSTEM_COLUMNS:
            raise ConfigError(f"{here}.name: {name!r} is a PostgreSQL system column of every table: rename it")
        pg_type = _column_type(raw.get("type"), here)
        path = _field_path(
            raw.get("path"), f"{here}.path", "the field's names from the record's own object", "to read its field"
        )
        if path and "field" in raw:
            raise ConfigError(
                f"{here}: give field (a name in the value_root's object) or path (from the record's own "
                "object), not both"
            )
        json_field = ".".join(path) if path else _json_field(raw.get("field", name), here)
        required = raw.get("required", False)
        if not isinstance(required, bool):
            raise ConfigError(f"{here}.required: expected true or false, got {required!r}")
        minimum, maximum, allowed, on_violation = _rules(raw, here, pg_type)
        columns.append(
            Column(
                name,
                pg_type,
                json_field,
                required,
                minimum,
                maximum,
                allowed,
                on_violation,
                epoch=_epoch(raw, here, pg_type),
                quoted_numbers=_quoted_numbers(raw, here, pg_type),
                path=path,
            )
        )
    names = [c.name for c in columns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{where}.columns: duplicate column name(s) {', '.join(duplicates)}")
    return tuple(columns)


_COLUMN_KEYS = {
    "name",
    "type",
    "field",
    "required",
    "min",
    "max",
    "allowed",
    "on_violation",
    "epoch",
    "quoted_numbers",
    "path",
}


def _column_type(value: Any, here: str) -> str:
    """The column's type as PostgreSQL DDL will get it: lower case, `numeric(p,s)` without spaces."""
    pg_type = value.strip().lower() if isinstance(value, str) else value
    if isinstance(pg_type, str) and pg_type in _SPARK_TYPES:
        return pg_type
    match = _DECIMAL.fullmatch(pg_type) if isinstance(pg_type, str) else None
    if match is None:
        supported = ", ".join(_SPARK_TYPES)
        raise ConfigError(
            f"{here}.type: unsupported type {value!r} (supported: {supported}, numeric(p,s))"
            f"{_boolean_note(value, quote='')}"
        )
    precision, scale = int(match[1]), int(match[2])
    if not 1 <= precision <= MAX_NUMERIC_PRECISION:
        raise ConfigError(
            f"{here}.type: {value!r}: precision must be 1 to {MAX_NUMERIC_PRECISION} (PostgreSQL's limit)"
        )
    if scale > precision:
        raise ConfigError(f"{here}.type: {value!r}: scale {scale} is above precision {precision}")
    return f"numeric({precision},{scale})"


def _json_field(value: Any, here: str) -> str:
    if not _field_name(value):
        raise ConfigError(
            f"{here}.field: expected the JSON field name (no control characters such as a newline, no lone surrogate), "
            f"got {_got(value)}"
        )
    return value


def _epoch(raw: dict, here: str, pg_type: str) -> EpochUnit | None:
    value = raw.get("epoch")
    if value is None:
        return None
    units = _EPOCH_UNITS.get(pg_type)
    if units is None:
        raise ConfigError(f"{here}.epoch: only timestamptz and date columns read epoch numbers, not {pg_type}")
    if value not in units:
        raise ConfigError(f"{here}.epoch: expected {' or '.join(units)} for a {pg_type} column, got {value!r}")
    return value


def _quoted_numbers(raw: dict, here: str, pg_type: str) -> bool:
    value = raw.get("quoted_numbers", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{here}.quoted_numbers: expected true or false, got {value!r}")
    if value and not _NUMERIC.fullmatch(pg_type):
        raise ConfigError(
            f"{here}.quoted_numbers: only number columns (bigint, integer, double precision, numeric) read "
            f"numbers written as strings, not {pg_type}"
        )
    return value


_NUMERIC = re.compile(r"bigint|integer|double precision|numeric\([0-9]+,[0-9]+\)")
_ALLOWED_TYPES = {"text": str, "bigint": int, "integer": int, "boolean": bool}
# What PostgreSQL's integer types hold.
_INTEGER_RANGES = {"bigint": (-(2**63), 2**63 - 1), "integer": (-(2**31), 2**31 - 1)}


def _holds(pg_type: str, kind: type, value: Any) -> bool:
    """Whether a column of `pg_type` (`kind` in Python) holds `value`: its type, an integer
    type's range, text without a NUL."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        return False
    if pg_type in _INTEGER_RANGES:
        low, high = _INTEGER_RANGES[pg_type]
        return low <= value <= high
    return not (isinstance(value, str) and "\x00" in value)


def _rules(raw: dict, here: str, pg_type: str) -> tuple:
    """A column's declared value rules: min/max (numeric columns), allowed values (text, integer,
    boolean columns, typed like the column), and what a violation does. `pg_type` as
    `_column_type` returns it."""
    bounds = []
    for key in ("min", "max"):
        value = raw.get(key)
        if value is None:
            bounds.append(None)
            continue
        if not _NUMERIC.fullmatch(pg_type):
            raise ConfigError(f"{here}.{key}: only numeric columns can have a range, not {pg_type}")
        bound = _finite(value)
        if bound is None:
            raise ConfigError(f"{here}.{key}: expected a finite number, got {value!r}")
        if isinstance(value, _Inexact):
            raise ConfigError(
                f"{here}.{key}: {value.written} is read as the float {bound!r}, not the number written (a bound is "
                "a float): write it with at most 15 significant digits, or as a whole number (kept exact)"
            )
        # A whole number stays exact: as a float, 9007199254740993 would be 9007199254740992.
        bounds.append(value if isinstance(value, int) else bound)
    if None not in bounds and bounds[0] > bounds[1]:
        raise ConfigError(f"{here}: min {bounds[0]} is above max {bounds[1]}")
    allowed = raw.get("allowed")
    if allowed is not None:
        kind = _ALLOWED_TYPES.get(pg_type)
        if kind is None:
            raise ConfigError(f"{here}.allowed: only {', '.join(_ALLOWED_TYPES)} columns can list allowed values")
        if not isinstance(allowed, list) or not allowed:
            raise ConfigError(f"{here}.allowed: expected a non-empty list of values, got {allowed!r}")
        wrong = [v for v in allowed if not _holds(pg_type, kind, v)]
        if wrong:
            # YAML 1.1 reads an unquoted NO, off or 42 as a boolean or a number.
            unquoted = kind is str and any(isinstance(v, bool | int | float) for v in wrong)
            hint = ": quote the values meant as text (YAML reads yes/no/on/off as booleans)" if unquoted else ""
            raise ConfigError(f"{here}.allowed: values {wrong!r} are not of the column's type {pg_type}{hint}")
        allowed = tuple(allowed)
    on_violation = _choice(raw, "on_violation", here, ("fail", "quarantine"))
    if on_violation == "quarantine" and bounds == [None, None] and allowed is None:
        raise ConfigError(f"{here}.on_violation: the column declares no rule to violate (min, max or allowed)")
    return bounds[0], bounds[1], allowed, on_violation


def _positive_int(raw: dict, key: str, where: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{key}: expected a positive integer, got {value!r}{_null_note(value, default)}")
    return value


# What `_boolean_note` advises where quoting the word gives a value the field takes.
QUOTE_ADVICE = "quote a word meant as text: 'no', 'OFF'"


def _got(value: Any, *, off: str = "", quote: str = QUOTE_ADVICE) -> str:
    """`value` as a refusal of text shows it, with `_boolean_note`."""
    return f"{value!r}{_boolean_note(value, off=off, quote=quote)}"


# The words YAML 1.1 (PyYAML) reads as booleans, in any of their three casings.
BOOLEAN_WORDS = frozenset({"yes", "no", "on", "off", "true", "false"})


def _boolean_note(value: Any, *, off: str = "", quote: str = QUOTE_ADVICE) -> str:
    """For a boolean (or a list holding one) where text belongs: how YAML 1.1 came to read it,
    since the word the file shows is gone by then. `off`: for a field that null leaves off, what
    leaving it out means (a `no` or `off` was likely meant so, and quoted it would be a name);
    `quote`: the advice on quoting the word, empty where no quoted word is a value the field takes."""
    if not (isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value))):
        return ""
    advice = []
    if off and value is False:
        advice.append(f"{off}, leave the key out (or write null)")
    if quote:
        advice.append(quote)
    return " (YAML reads an unquoted yes, no, on, off, true or false as a boolean" + (
        f": {'; '.join(advice)})" if advice else ")"
    )


def _choice(raw: dict, key: str, where: str, choices: tuple[str, ...]) -> Any:
    value = raw.get(key, choices[0])
    if value not in choices:
        words = [f"'{c}'" for c in choices if c.lower() in BOOLEAN_WORDS]  # spark_log_level's OFF
        quote = f"quoted, as written here: {' or '.join(words)}" if words else ""
        raise ConfigError(f"{where}.{key}: expected one of {', '.join(choices)}, got {_got(value, quote=quote)}")
    return value
