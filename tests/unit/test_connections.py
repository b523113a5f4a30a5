"""A pipeline's services from Airflow Connections (AIRFLOW_CONN_* here), the environment as the fallback."""

import json
import logging
import logging.handlers
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from psycopg.conninfo import conninfo_to_dict

from kafka2pg.config import load_pipelines
from kafka2pg.connections import database_url, settings_for
from kafka2pg.exceptions import ConfigError

PIPELINES = """
pipelines:
  - name: orders
    topic: orders
    target_table: public.orders
    columns: [{name: event_id, type: text}]
  - name: payments
    topic: payments
    target_table: public.payments
    postgres_conn_id: finance_db
    kafka_config_id: finance_kafka
    columns: [{name: event_id, type: text}]
"""


@pytest.fixture
def pipelines(tmp_path, monkeypatch):
    for name in ("KAFKA2PG_DATABASE_URL", "KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "pipelines.yaml"
    path.write_text(PIPELINES)
    return load_pipelines(path)


def test_connections_give_the_database_and_the_kafka_client_config(pipelines, monkeypatch):
    password = "p@ss:w/rd%20 'quoted'"
    postgres = {
        "conn_type": "postgres",
        "host": "db.example",
        "port": 6432,
        "login": "runner",
        "password": password,
        "schema": "warehouse",
        "extra": {"sslmode": "verify-full", "cursor": "dictcursor"},
    }
    kafka = {
        "conn_type": "kafka",
        "extra": {
            "bootstrap.servers": "k1:9093",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "app",
            "sasl.password": "secret",
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps(postgres))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", json.dumps(kafka))

    settings = settings_for(pipelines["orders"])

    assert conninfo_to_dict(settings.database_url) == {
        "host": "db.example",
        "port": "6432",
        "user": "runner",
        "password": password,
        "dbname": "warehouse",
        "sslmode": "verify-full",  # the provider's own `cursor` is not libpq's: left out
    }
    assert settings.kafka.as_dict == kafka["extra"]
    assert str(settings.kafka) == "k1:9093 (SASL_SSL, SCRAM-SHA-512)"


def test_each_pipeline_uses_its_own_connections(pipelines, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_FINANCE_DB", "postgres://fin:pw@fin-db:5432/finance")
    monkeypatch.setenv(
        "AIRFLOW_CONN_FINANCE_KAFKA", json.dumps({"conn_type": "kafka", "host": "fin-kafka", "port": 9092})
    )
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://fallback@h/db")
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "fallback:9092")

    settings = settings_for(pipelines["payments"])

    assert conninfo_to_dict(settings.database_url)["host"] == "fin-db"
    assert settings.kafka.servers == "fin-kafka:9092"  # from host:port when the extra has no bootstrap.servers
    other = settings_for(pipelines["orders"])  # no kafka2pg_* connections: the environment's fallback
    assert (other.database_url, other.kafka.servers) == ("postgresql://fallback@h/db", "fallback:9092")


def test_no_connection_and_no_fallback_names_both(pipelines):
    with pytest.raises(ConfigError) as error:
        settings_for(pipelines["orders"])
    message = str(error.value)
    assert "pipeline 'orders': neither the Airflow connection 'kafka2pg_postgres' nor KAFKA2PG_DATABASE_URL" in message
    assert "neither the Airflow connection 'kafka2pg_kafka' nor KAFKA2PG_BOOTSTRAP_SERVERS" in message


def test_a_connection_a_pipeline_names_is_never_replaced_by_the_environments_fallback(pipelines, monkeypatch):
    """A mistyped or missing `postgres_conn_id` / `kafka_config_id` must not point the pipeline at
    the servers the KAFKA2PG_* variables name (those of the default connections)."""
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://fallback@h/db")
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "fallback:9092")
    with pytest.raises(ConfigError) as error:
        settings_for(pipelines["payments"])
    message = str(error.value)
    assert "pipeline 'payments': the Airflow connection 'finance_db' is not defined (KAFKA2PG_DATABASE_URL stands" in (
        message
    )
    assert "the Airflow connection 'finance_kafka' is not defined (KAFKA2PG_BOOTSTRAP_SERVERS" in message
    # The owner's commands (migrate, grant) take the variable's URL for any connection id: the
    # documented `KAFKA2PG_DATABASE_URL=postgresql://OWNER@... kafka2pg migrate`.
    assert database_url("finance_db") == "postgresql://fallback@h/db"
    monkeypatch.setenv("AIRFLOW_CONN_FINANCE_DB", "postgres://fin:pw@fin-db:5432/finance")
    with pytest.raises(ConfigError, match="'finance_kafka' is not defined") as error:
        settings_for(pipelines["payments"])
    assert "finance_db" not in str(error.value)


def test_a_kafka_connection_without_servers_is_refused_naming_it(pipelines, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", json.dumps({"conn_type": "kafka", "extra": {"acks": "all"}}))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://u@h/db")
    with pytest.raises(
        ConfigError, match=r"the Airflow connection 'kafka2pg_kafka' \(its extra\): `bootstrap.servers`"
    ):
        settings_for(pipelines["orders"])


def test_a_connection_variable_airflow_cannot_read_is_refused_not_skipped_for_the_fallback(pipelines, monkeypatch):
    unreadable = json.dumps({"conn_type": "postgres", "password": "S3cretPW", "schema": "kafka2pg"})[:-1]
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", unreadable)  # its closing brace missing
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://fallback@h/db")
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "fallback:9092")
    with pytest.raises(ConfigError) as error:
        settings_for(pipelines["orders"])
    message = str(error.value)
    assert "the Airflow connection 'kafka2pg_postgres': AIRFLOW_CONN_KAFKA2PG_POSTGRES is set but Airflow" in message
    assert "S3cretPW" not in message


@pytest.mark.parametrize("password", ["Pa55@Zq9v:2024#x", "Pa55@Zq9v/x", "Pa55@Zq9v?x", "Zq9v/Pa55"])
def test_a_connection_uri_whose_password_airflow_misreads_is_refused_quoting_none_of_it(
    pipelines, monkeypatch, password
):
    """Airflow's URI parser ends the host at an unencoded / ? #: `Pa55@Zq9v:2024#x` would be read
    as host zq9v, port 2024, and both quoted by every message about the connection."""
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", f"postgres://kafka2pg:{password}@127.0.0.1:5432/kafka2pg")
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "k:9092")
    with pytest.raises(ConfigError) as error:
        settings_for(pipelines["orders"])
    message = str(error.value)
    # Or, where the misread port is no number, Airflow's own refusal of the variable.
    assert "AIRFLOW_CONN_KAFKA2PG_POSTGRES's URI cannot be read as written" in message or (
        password == "Zq9v/Pa55" and "AIRFLOW_CONN_KAFKA2PG_POSTGRES is set but Airflow cannot read it" in message
    ), message
    assert not [p for p in ("Pa55", "Zq9v", "zq9v", "2024") if p in message], message


@pytest.mark.parametrize(
    "uri",
    [
        "postgres://u:Pa55%40Zq9v%3A2024%23x@db.example:5432/warehouse",
        "postgres://u:Pa55@Zq9v@db.example:5432/warehouse",  # an '@' alone: Python's parser takes the last
        "postgres://u:pw@db.example:5432/warehouse?application_name=etl@host&sslmode=require",
    ],
)
def test_a_connection_uri_read_as_written_is_used(pipelines, monkeypatch, uri):
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", uri)
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "k:9092")
    assert conninfo_to_dict(settings_for(pipelines["orders"]).database_url)["host"] == "db.example"


K1 = json.dumps({"conn_type": "kafka", "host": "k1", "port": 9093})


@contextmanager
def connection_warnings() -> Iterator[list[logging.LogRecord]]:
    """The warnings kafka2pg.connections logs in the block. A handler on the logger itself:
    Airflow's logging set-up, on its first connection lookup (when the test runs first), takes
    pytest's capture handler off the root logger, and caplog would then see nothing."""
    logger = logging.getLogger("kafka2pg.connections")
    logged = logging.handlers.BufferingHandler(100)
    logged.setLevel(logging.WARNING)
    logger.addHandler(logged)
    try:
        yield logged.buffer
    finally:
        logger.removeHandler(logged)


def warned(pipelines, monkeypatch, **variables: str) -> tuple:
    """The orders pipeline's services with these variables set, and the warnings that logged."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with connection_warnings() as records:
        settings = settings_for(pipelines["orders"])
    return settings, [r.getMessage() for r in records]


def test_a_connection_beside_a_different_fallback_is_used_and_the_ignored_variable_named(pipelines, monkeypatch):
    settings, warnings = warned(
        pipelines,
        monkeypatch,
        AIRFLOW_CONN_KAFKA2PG_POSTGRES="postgres://runner:C0nnPW@db.example:6432/warehouse",
        AIRFLOW_CONN_KAFKA2PG_KAFKA=K1,
        KAFKA2PG_DATABASE_URL="postgresql://old:EnvPW@127.0.0.1:5432/kafka2pg",
        KAFKA2PG_BOOTSTRAP_SERVERS="127.0.0.1:9092",
    )

    assert conninfo_to_dict(settings.database_url)["host"] == "db.example"
    assert settings.kafka.servers == "k1:9093"
    assert any(
        "the Airflow connection 'kafka2pg_postgres' (db.example:6432/warehouse) is used; KAFKA2PG_DATABASE_URL "
        "(127.0.0.1:5432/kafka2pg) is set too and ignored" in w
        for w in warnings
    ), warnings
    assert any(
        "the Airflow connection 'kafka2pg_kafka' (k1:9093) is used; KAFKA2PG_BOOTSTRAP_SERVERS (127.0.0.1:9092)" in w
        for w in warnings
    ), warnings
    assert not any(secret in w for w in warnings for secret in ("C0nnPW", "EnvPW", "runner", "old:"))


def test_the_same_services_from_a_connection_and_the_environment_say_nothing(pipelines, monkeypatch):
    url = "postgresql://u:pw@db.example:5432/warehouse"
    settings, warnings = warned(
        pipelines,
        monkeypatch,
        AIRFLOW_CONN_KAFKA2PG_POSTGRES="postgres://u:pw@db.example:5432/warehouse",
        AIRFLOW_CONN_KAFKA2PG_KAFKA=K1,
        KAFKA2PG_DATABASE_URL=url,
        KAFKA2PG_BOOTSTRAP_SERVERS="k1:9093",
    )

    assert conninfo_to_dict(settings.database_url) == conninfo_to_dict(url)
    assert [w for w in warnings if "ignored" in w] == []


def test_another_role_on_the_same_database_and_an_unreadable_kafka_fallback_are_named_not_raised(
    pipelines, monkeypatch
):
    settings, messages = warned(
        pipelines,
        monkeypatch,
        AIRFLOW_CONN_KAFKA2PG_POSTGRES="postgres://runner:pw@db.example:5432/warehouse",
        AIRFLOW_CONN_KAFKA2PG_KAFKA=K1,
        KAFKA2PG_DATABASE_URL="postgresql://owner:S3cret@db.example:5432/warehouse",
        KAFKA2PG_KAFKA_CONFIG='{"bootstrap.servers": ',
    )

    assert settings.kafka.servers == "k1:9093"
    warnings = " | ".join(messages)
    assert "(db.example:5432/warehouse, with another user, password or option) is set too and ignored" in warnings
    assert "KAFKA2PG_KAFKA_CONFIG (unreadable: KAFKA2PG_KAFKA_CONFIG is not a JSON object" in warnings
    assert "S3cret" not in warnings and "owner" not in warnings


def test_the_local_stacks_connection_and_fallback_say_the_same_once_warned_never(pipelines, monkeypatch):
    # As `./kafka2pg stack start` writes them (stack.env): no password, the port given on both sides.
    postgres = {"conn_type": "postgres", "host": "127.0.0.1", "port": 5433, "login": "postgres", "schema": "kafka2pg"}
    kafka = {"conn_type": "kafka", "extra": {"bootstrap.servers": "127.0.0.1:9092"}}
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps(postgres))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", json.dumps(kafka))
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://postgres@127.0.0.1:5433/kafka2pg")
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "127.0.0.1:9092")

    with connection_warnings() as records:
        settings_for(pipelines["orders"])
        monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://postgres@127.0.0.1/kafka2pg")  # 5432
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps({**postgres, "port": None}))
        settings_for(pipelines["orders"])
    assert [r.getMessage() for r in records] == []

    # A different one is said once per process, however often the services are read.
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    with connection_warnings() as records:
        for _ in range(3):
            settings_for(pipelines["orders"])
    assert len([r for r in records if "KAFKA2PG_BOOTSTRAP_SERVERS (127.0.0.1:19092)" in r.getMessage()]) == 1


def test_an_ignored_url_libpq_misreads_is_not_shown(pipelines, monkeypatch):
    _, messages = warned(
        pipelines,
        monkeypatch,
        AIRFLOW_CONN_KAFKA2PG_POSTGRES="postgres://runner:pw@db.example:5432/warehouse",
        AIRFLOW_CONN_KAFKA2PG_KAFKA=K1,
        KAFKA2PG_DATABASE_URL="postgresql://admin:p/w@db/x",  # read as host 'admin', port 'p'
        KAFKA2PG_KAFKA_CONFIG=json.dumps(
            {"bootstrap.servers": "k1:9093", "client.id": "clientX", "ssl.key.password": "Kafka$ecret"}
        ),
    )

    warnings = " | ".join(messages)
    assert "KAFKA2PG_DATABASE_URL (a URL libpq misreads: percent-encode" in warnings
    assert "KAFKA2PG_KAFKA_CONFIG (k1:9093, with other properties) is set too and ignored" in warnings
    assert not any(secret in warnings for secret in ("admin", "p/w", "Kafka$ecret", "clientX"))


def test_a_key_given_twice_in_a_connections_json_is_refused_naming_the_key_not_its_values(pipelines, monkeypatch):
    """JSON keeps a repeated key's last value silently: a client setting given twice (a SASL
    mechanism, a protocol) would run with whichever came last."""
    monkeypatch.setenv("KAFKA2PG_DATABASE_URL", "postgresql://u@h/db")
    extra = '{"bootstrap.servers": "k:9092", "sasl.password": "S3cr3tA", "sasl.password": "S3cr3tB"}'
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", json.dumps({"conn_type": "kafka", "extra": extra}))
    with pytest.raises(ConfigError) as info:  # the extra as stored (a string, as the UI stores it)
        settings_for(pipelines["orders"])
    message = str(info.value)
    assert "the Airflow connection 'kafka2pg_kafka', its JSON: 'sasl.password' given more than once" in message
    assert "S3cr3t" not in message
    variable = '{"conn_type": "kafka", "extra": {"bootstrap.servers": "k:9092", "acks": "all", "acks": "1"}}'
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", variable)  # the variable's JSON, read by Airflow first
    with pytest.raises(ConfigError, match=r"its JSON: 'acks' given more than once"):
        settings_for(pipelines["orders"])
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_KAFKA", variable.replace('"acks": "1"', '"retries": "1"'))
    assert settings_for(pipelines["orders"]).kafka  # each key once: read


def test_every_libpq_parameter_in_a_postgres_extra_is_used_and_any_other_key_refused(pipelines, monkeypatch):
    """A libpq parameter outside a fixed list was dropped silently (`require_auth`,
    `ssl_min_protocol_version`: a hardened connection connected with less); a key libpq does not
    have (a misspelt `sslmode`) is refused, as the provider's hook would fail on it."""
    monkeypatch.setenv("KAFKA2PG_BOOTSTRAP_SERVERS", "k:9092")
    hardened = {
        "sslmode": "verify-full",
        "ssl_min_protocol_version": "TLSv1.3",
        "require_auth": "scram-sha-256",
        "tcp_user_timeout": "5000",
        "dbname": "from_extra",  # as the provider's hook: the extra's parameters win over the fields
        "iam": False,  # the provider's own key: left out
    }
    connection = {"conn_type": "postgres", "host": "db", "login": "rt", "password": "pw", "schema": "wh"}
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps({**connection, "extra": hardened}))
    assert conninfo_to_dict(settings_for(pipelines["orders"]).database_url) == {
        "host": "db",
        "port": "5432",
        "user": "rt",
        "password": "pw",
        **{k: v for k, v in hardened.items() if k != "iam"},
    }
    tokens = (  # no token fetched; text is true to the provider, 'false' too, and the refusal says so
        ({"iam": True, "aws_conn_id": "aws"}, r"True\)"),
        ({"iam": "false", "azure_conn_id": "az"}, r"'false' \(the postgres provider takes any text but the empty"),
    )
    for token, shown in tokens:
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps({**connection, "extra": token}))
        with pytest.raises(ConfigError, match=rf"its extra asks for a token in place of the password \(iam: {shown}"):
            settings_for(pipelines["orders"])
    for wrong in ({"sslmod": "verify-full"}, {"replication": "database"}):
        monkeypatch.setenv("AIRFLOW_CONN_KAFKA2PG_POSTGRES", json.dumps({**connection, "extra": wrong}))
        with pytest.raises(ConfigError, match=rf"its extra gives '{next(iter(wrong))}', no parameter of libpq"):
            settings_for(pipelines["orders"])
