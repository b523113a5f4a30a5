"""A pipeline's services from Airflow Connections: PostgreSQL (postgres provider's connection,
`postgres_conn_id`) and Kafka (apache-kafka provider's, `kafka_config_id`: the client config dict
in its extra), found by Airflow's own lookup, with the KAFKA2PG_* environment as the fallback of
the default connection ids (a connection a pipeline names must be defined).

Airflow is imported only when a lookup happens (tasks, the CLI), never at DAG-parse time.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext, redirect_stdout
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kafka2pg.config import (
    DEFAULT_KAFKA_CONN_ID,
    DEFAULT_POSTGRES_CONN_ID,
    Pipeline,
    Settings,
    common_settings,
    given_twice,
    kafka_from_env,
    repeated_json_keys,
)
from kafka2pg.database import describe, password_misread
from kafka2pg.exceptions import ConfigError
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.locations import COMMAND, env_setting, state_dir

log = logging.getLogger(__name__)

# What a postgres connection's extra may carry: any parameter of the libpq psycopg runs on (not
# `replication`: a replication connection runs no SQL kafka2pg sends), which, as the provider's
# hook passes them, wins over the connection's fields; and the provider's own keys, which are
# not libpq's and kafka2pg leaves out (it does not fetch IAM or Azure tokens: the password is
# the connection's, and a connection with `iam` set is refused).
_LIBPQ_EXTRAS = frozenset(d.keyword.decode() for d in psycopg.pq.Conninfo.get_defaults()) - {"replication"}
_PROVIDER_EXTRAS = frozenset(
    {
        "iam",
        "redshift",
        "redshift-serverless",
        "cursor",
        "cluster-identifier",
        "workgroup-name",
        "aws_conn_id",
        "sqlalchemy_scheme",
        "sqlalchemy_query",
        "azure_conn_id",
    }
)


def settings_for(pipeline: Pipeline, env: dict[str, str] | None = None) -> Settings:
    """The pipeline's services: its Airflow Connections, or else the environment's fallback."""
    return services(pipeline.postgres_conn_id, pipeline.kafka_config_id, env, f"pipeline {pipeline.name!r}")


def services(
    postgres_conn_id: str = DEFAULT_POSTGRES_CONN_ID,
    kafka_config_id: str = DEFAULT_KAFKA_CONN_ID,
    env: dict[str, str] | None = None,
    who: str = "kafka2pg",
) -> Settings:
    """Settings from these Airflow Connections, or else the environment's fallback."""
    env = dict(os.environ if env is None else env)
    database_url = _database(postgres_conn_id, env, who)
    kafka = _kafka(kafka_config_id, env, who)
    _require(
        who,
        [
            (postgres_conn_id, DEFAULT_POSTGRES_CONN_ID, "KAFKA2PG_DATABASE_URL", database_url),
            (kafka_config_id, DEFAULT_KAFKA_CONN_ID, "KAFKA2PG_BOOTSTRAP_SERVERS (or KAFKA2PG_KAFKA_CONFIG)", kafka),
        ],
        env,
    )
    log.debug("%s: PostgreSQL %s, Kafka %s", who, describe(database_url), kafka)
    return Settings(kafka=kafka, database_url=database_url, **common_settings(env))


def database_url(
    postgres_conn_id: str = DEFAULT_POSTGRES_CONN_ID, env: dict[str, str] | None = None, who: str = "kafka2pg"
) -> str:
    """The PostgreSQL connection alone, for the owner's commands that never ask Kafka (migrate,
    grant): KAFKA2PG_DATABASE_URL stands in for any connection id there, the owner's URL given
    for the run (each database's line names where it went)."""
    env = dict(os.environ if env is None else env)
    url = _database(postgres_conn_id, env, who, any_id=True)
    _require(who, [(postgres_conn_id, None, "KAFKA2PG_DATABASE_URL", url)], env)
    return url


def _database(conn_id: str, env: dict[str, str], who: str, any_id: bool = False) -> str | None:
    """The connection's URL, else (for the default connection id, or any with `any_id`)
    KAFKA2PG_DATABASE_URL; a warning when both lead to different places."""
    url = _postgres_url(conn_id)
    fallback = env_setting(env, "KAFKA2PG_DATABASE_URL") if any_id or conn_id == DEFAULT_POSTGRES_CONN_ID else None
    if url and fallback and not _same_conninfo(url, fallback):
        used = describe(url)
        if password_misread(fallback):  # `describe` would show what libpq took for its host or port
            ignored = "a URL libpq misreads: percent-encode the special characters of its password"
        else:
            ignored = describe(fallback)
            if used == ignored:  # the same server and database: another user, password or libpq option
                ignored += ", with another user, password or option"
        _warn_ignored(who, conn_id, used, "KAFKA2PG_DATABASE_URL", ignored)
    return url or fallback


def _same_conninfo(one: str, other: str) -> bool:
    """Whether two connection strings (URL or key=value) say the same to libpq: an empty value is
    no value (a connection without a password gives `password=''`), the port 5432 unless given."""

    def params(conninfo: str) -> dict[str, str]:
        given = {k: v for k, v in conninfo_to_dict(conninfo).items() if v not in (None, "")}
        return {"port": "5432", **given}

    try:
        return params(one) == params(other)
    except psycopg.ProgrammingError:  # a malformed one: the connection fails later, naming it
        return False


def _kafka(conn_id: str, env: dict[str, str], who: str) -> KafkaConfig | None:
    """The connection's client config, else (for the default connection id only) the environment's;
    a warning when both are set and differ."""
    config = _kafka_config(conn_id)
    if conn_id != DEFAULT_KAFKA_CONN_ID:
        return config
    if config is None:
        return kafka_from_env(env)
    variables = [v for v in ("KAFKA2PG_KAFKA_CONFIG", "KAFKA2PG_BOOTSTRAP_SERVERS") if env_setting(env, v)]
    if variables:
        try:
            fallback = kafka_from_env(env)
        except ConfigError as exc:  # not used: said, not raised
            ignored = f"unreadable: {exc}"
        else:
            ignored = None if fallback == config else str(fallback)
            if ignored == str(config):  # the same servers and protocol: other properties
                ignored += ", with other properties"
        if ignored is not None:
            _warn_ignored(who, conn_id, str(config), " and ".join(variables), ignored)
    return config


_warned: set[tuple[str, ...]] = set()


def _warn_ignored(who: str, conn_id: str, used: str, variables: str, ignored: str) -> None:
    """Say that the Airflow connection wins over the environment's fallback that leads elsewhere:
    what each names (never a user name or a secret), so that a forgotten connection or a stale
    variable does not go unnoticed. Once per process for the same pair (a CLI command or a web
    page reads every pipeline's services)."""
    said = (who, conn_id, used, variables, ignored)
    if said in _warned:
        return
    _warned.add(said)
    log.warning(
        "%s: the Airflow connection %r (%s) is used; %s (%s) is set too and ignored: the connection "
        "wins. Delete the connection to use the variable, or unset the variable to silence this",
        who,
        conn_id,
        used,
        variables,
        ignored,
    )


def _require(who: str, found: list[tuple[str, str | None, str, object]], env: dict[str, str]) -> None:
    """`found`: (connection id, the id the fallback's variables stand in for (None: any), those
    variables, what was found)."""
    missing = [
        f"neither the Airflow connection {conn_id!r} nor {variable} is defined"
        if default in (None, conn_id)
        else f"the Airflow connection {conn_id!r} is not defined ({variable} stands in for {default!r} only: "
        "a connection a pipeline names is never replaced by it, which could point the pipeline elsewhere)"
        for conn_id, default, variable, value in found
        if not value
    ]
    if missing:
        stack_env = state_dir(env) / "stack" / "stack.env"
        raise ConfigError(
            f"{who}: {'; '.join(missing)}. Define the connections (README, Configuration: "
            "AIRFLOW_CONN_* variables, the Airflow UI or a secrets backend), or start the local stack with "
            f"`{COMMAND} stack start` and `source {stack_env}`"
        )


def _postgres_url(conn_id: str) -> str | None:
    """A libpq conninfo string from a postgres connection (host, port, login, password, schema =
    the database, libpq parameters from its extra); None when the connection is not defined."""
    connection = _airflow_connection(conn_id)
    if connection is None:
        return None
    if _uri_misread(conn_id):
        variable = f"AIRFLOW_CONN_{conn_id.upper()}"
        raise ConfigError(
            f"the Airflow connection {conn_id!r}: {variable}'s URI cannot be read as written: an '@' comes after "
            "where Airflow's URI parser ends the host, so part of the password would be taken for the host or "
            "port. Percent-encode / ? # @ : in the password (%2F %3F %23 %40 %3A), or write the connection as a "
            "JSON object"
        )
    extra = _extra(connection, conn_id)
    unknown = sorted(k for k in extra if k not in _LIBPQ_EXTRAS | _PROVIDER_EXTRAS)
    if unknown:  # left out, a misspelt sslmode would connect without the TLS it asks for
        raise ConfigError(
            f"the Airflow connection {conn_id!r}: its extra gives {', '.join(map(repr, unknown))}, no parameter of "
            f"libpq {psycopg.pq.version() // 10000} (nor the postgres provider's own keys): correct or remove them"
        )
    if extra.get("iam", False):  # the provider's test: any value Python takes for true
        # Text is true to the provider whatever it says ('false' too): said, as the refusal looks odd otherwise.
        as_text = (
            " (the postgres provider takes any text but the empty one as true)" if isinstance(extra["iam"], str) else ""
        )
        raise ConfigError(
            f"the Airflow connection {conn_id!r}: its extra asks for a token in place of the password "
            f"(iam: {extra['iam']!r}{as_text}{', azure_conn_id' if 'azure_conn_id' in extra else ''}), which kafka2pg "
            "does not fetch: it signs in with the connection's login and password. Give those and remove `iam`"
        )
    fields = {
        "host": connection.host or "localhost",
        "port": str(connection.port or 5432),
        "user": connection.login or "",
        "password": connection.password or "",
        "dbname": connection.schema or "postgres",
    }
    return make_conninfo(**{**fields, **{k: str(v) for k, v in extra.items() if k in _LIBPQ_EXTRAS}})


def _uri_misread(conn_id: str) -> bool:
    """Whether the connection's AIRFLOW_CONN_* variable is a URI whose password Airflow reads
    partly as the host or port: an unencoded `/`, `?` or `#` in it ends the URI's authority early,
    leaving the `@` that ends the user-info in the path, a query key or the fragment (where no
    well-written URI has one: a query's values may)."""
    raw = os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}", "").strip()
    if not raw or raw.startswith("{") or "://" not in raw:
        return False
    parts = urlsplit(raw)
    keys = (piece.partition("=")[0] for piece in parts.query.split("&"))
    return "@" in parts.fragment or "@" in parts.path or any("@" in key for key in keys)


def _kafka_config(conn_id: str) -> KafkaConfig | None:
    """The client config dict in a kafka connection's extra (as the apache-kafka provider keeps
    it); `bootstrap.servers` from host:port when the extra has none."""
    connection = _airflow_connection(conn_id)
    if connection is None:
        return None
    properties = dict(_extra(connection, conn_id))
    if "bootstrap.servers" not in properties and connection.host:
        properties["bootstrap.servers"] = f"{connection.host}:{connection.port or 9092}"
    return KafkaConfig.of(properties, f"the Airflow connection {conn_id!r} (its extra)")


def _extra(connection: Any, conn_id: str) -> dict:
    try:
        extra = connection.extra_dejson
    except ValueError:
        extra = None
    if not isinstance(extra, dict):
        raise ConfigError(f"the Airflow connection {conn_id!r}: its extra is not a JSON object")
    # JSON keeps a repeated key's last value without a word: its extra as stored, and the
    # AIRFLOW_CONN_* variable's JSON (which Airflow has read before the extra is stored).
    variable = os.environ.get(f"AIRFLOW_CONN_{conn_id.upper()}", "").strip()
    repeated = repeated_json_keys(connection.extra) or repeated_json_keys(
        variable if variable.startswith("{") else None
    )
    if repeated:
        raise given_twice(f"the Airflow connection {conn_id!r}, its JSON", list(map(repr, repeated)))
    return extra


def _airflow_connection(conn_id: str) -> Any | None:
    """Airflow's lookup of a connection: inside a task through the Task SDK (environment, secrets
    backends, the API server); elsewhere (the CLI) environment, secrets backends and the metadata
    database. None when it is not defined, or when Airflow is not installed here; a `ConfigError`
    when its AIRFLOW_CONN_* variable is set but unreadable."""
    try:
        # Airflow's first import sets its logging up, writing to what sys.stdout is then; outside
        # a task (where it was imported before) that would be where a CLI command's own output
        # goes (`status --json`): its log lines go to stderr instead.
        with redirect_stdout(sys.stderr) if "airflow" not in sys.modules else nullcontext():
            from airflow.exceptions import AirflowNotFoundException
    except ImportError:
        return None
    if _in_task():
        from airflow.sdk import BaseHook

        lookup, output = BaseHook.get_connection, nullcontext()
    else:
        from airflow.models.connection import Connection

        # Airflow's log lines (e.g. about masking a short secret) go to stdout, where a CLI command's
        # own output goes (`status --json`): they go to stderr instead.
        lookup, output = Connection.get_connection_from_secrets, redirect_stdout(sys.stderr)
    try:
        with output:
            return lookup(conn_id)
    except AirflowNotFoundException:
        variable = f"AIRFLOW_CONN_{conn_id.upper()}"
        if os.environ.get(variable, "").strip():
            # Airflow skips a value it cannot parse as if it were not set: never fall back silently.
            raise ConfigError(
                f"the Airflow connection {conn_id!r}: {variable} is set but Airflow cannot read it as a "
                'connection; write it as a JSON object ({"conn_type": ..., "host": ..., ...}) or a URI '
                "(postgres://user:password@host:5432/database, with special characters percent-encoded)"
            ) from None
        return None


def _in_task() -> bool:
    try:
        from airflow.sdk.execution_time import task_runner
    except ImportError:
        return False
    return getattr(task_runner, "SUPERVISOR_COMMS", None) is not None
