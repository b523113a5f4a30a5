"""One Kafka client dict -> confluent-kafka's config and Spark's Kafka source options, property by property."""

import json

import pytest

from kafka2pg.config import Settings
from kafka2pg.exceptions import ConfigError
from kafka2pg.kafka_config import KafkaConfig

CA = "-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
CERT = "-----BEGIN CERTIFICATE-----\nclient\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n"


@pytest.fixture
def pem_files(tmp_path):
    paths = {}
    for name, text in (("ca", CA), ("cert", CERT), ("key", KEY)):
        paths[name] = tmp_path / f"{name}.pem"
        paths[name].write_text(text)
    return paths


def test_plaintext_passes_bootstrap_servers_to_both():
    kafka = KafkaConfig.plain("b1:9092,b2:9092")
    assert kafka.confluent() == {"bootstrap.servers": "b1:9092,b2:9092"}
    assert kafka.spark_options() == {"kafka.bootstrap.servers": "b1:9092,b2:9092"}
    assert str(kafka) == "b1:9092,b2:9092"


@pytest.mark.parametrize(
    ("mechanism", "module"),
    [
        ("SCRAM-SHA-512", "org.apache.kafka.common.security.scram.ScramLoginModule"),
        ("SCRAM-SHA-256", "org.apache.kafka.common.security.scram.ScramLoginModule"),
        ("PLAIN", "org.apache.kafka.common.security.plain.PlainLoginModule"),
    ],
)
def test_sasl_username_password_become_the_java_jaas_login(mechanism, module, pem_files):
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9093",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": mechanism,
            "sasl.username": "app",
            "sasl.password": 'p"a\\ss',
            "ssl.ca.location": str(pem_files["ca"]),
        }
    )
    assert kafka.confluent() == dict(kafka.properties)  # librdkafka takes its own names as they are
    assert kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:9093",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": mechanism,
        "kafka.sasl.jaas.config": f'{module} required username="app" password="p\\"a\\\\ss";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.certificates": CA,
    }
    assert str(kafka) == f"b:9093 (SASL_SSL, {mechanism})"
    assert kafka.redacted()["sasl.password"] == "***"


def test_mtls_files_go_to_spark_inline(pem_files):
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9094",
            "security.protocol": "SSL",
            "ssl.ca.location": str(pem_files["ca"]),
            "ssl.certificate.location": str(pem_files["cert"]),
            "ssl.key.location": str(pem_files["key"]),
            "ssl.key.password": "kp",
            "ssl.endpoint.identification.algorithm": "https",
        }
    )
    options = kafka.spark_options()
    assert options["kafka.ssl.keystore.type"] == "PEM"
    assert options["kafka.ssl.keystore.certificate.chain"] == CERT
    assert options["kafka.ssl.keystore.key"] == KEY
    assert options["kafka.ssl.key.password"] == "kp"
    assert options["kafka.ssl.endpoint.identification.algorithm"] == "https"
    assert "ssl.key.location" in kafka.confluent()


def test_java_only_properties_go_to_spark_only_and_unknown_ones_to_librdkafka_only():
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:1",
            "kafka.sasl.jaas.config": "x required;",
            "enable.ssl.certificate.verification": "true",
        }
    )
    assert kafka.spark_options()["kafka.sasl.jaas.config"] == "x required;"
    assert "kafka.sasl.jaas.config" not in kafka.confluent()
    assert kafka.confluent()["enable.ssl.certificate.verification"] == "true"
    assert kafka.unmapped_for_spark() == ["enable.ssl.certificate.verification"]
    assert kafka.ignored_by("spark") == ["enable.ssl.certificate.verification"]
    assert kafka.ignored_by("librdkafka") == ["kafka.sasl.jaas.config"]


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        ({}, "`bootstrap.servers` is missing"),
        ({"bootstrap.servers": "b:1", "security.protocol": "TLS"}, "security.protocol 'TLS' is not one of"),
        ({"bootstrap.servers": "b:1", "sasl.username": "u", "sasl.mechanism": "GSSAPI"}, "give `kafka.sasl.jaas"),
        ({"bootstrap.servers": "b:1", "ssl.ca.location": "/nope/ca.pem"}, "cannot read the PEM file '/nope/ca.pem'"),
        ({"bootstrap.servers": "b:1", "x": {"nested": 1}}, "property 'x' must be a name with a string"),
        (
            {
                "bootstrap.servers": "b:1",
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "u",
            },
            "security.protocol SASL_SSL with sasl.mechanism SCRAM-SHA-512 needs sasl.password",
        ),
        (
            {
                "bootstrap.servers": "b:1",
                "security.protocol": "sasl_plaintext",
                "sasl.mechanisms": "plain",
                "sasl.password": "pw",
            },
            "with sasl.mechanism PLAIN needs sasl.username [(]the client",
        ),
    ],
)
def test_bad_kafka_configuration_is_refused_naming_the_property(properties, message):
    with pytest.raises(ConfigError, match=message):
        KafkaConfig.of(properties).spark_options()


def test_settings_round_trip_through_the_environment_the_stage_job_gets():
    kafka = KafkaConfig.of({"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.password": "s"})
    settings = Settings(kafka=kafka, database_url="host=h password=p dbname=d")
    again = Settings.from_env(settings.to_env())
    assert (again.kafka, again.database_url, again.pipelines_file) == (
        kafka,
        settings.database_url,
        settings.pipelines_file,
    )


def test_the_environments_client_properties_take_their_servers_from_bootstrap_servers_when_they_have_none():
    from kafka2pg.config import kafka_from_env

    properties = {"security.protocol": "SSL", "ssl.ca.location": "/ca.pem"}
    env = {"KAFKA2PG_KAFKA_CONFIG": json.dumps(properties), "KAFKA2PG_BOOTSTRAP_SERVERS": "b:1"}
    assert kafka_from_env(env).as_dict == {"bootstrap.servers": "b:1", **properties}
    own = {**env, "KAFKA2PG_KAFKA_CONFIG": json.dumps({**properties, "bootstrap.servers": "own:2"})}
    assert kafka_from_env(own).servers == "own:2"
    with pytest.raises(ConfigError, match="KAFKA2PG_KAFKA_CONFIG: `bootstrap.servers` is missing"):
        kafka_from_env({"KAFKA2PG_KAFKA_CONFIG": json.dumps(properties)})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"nonsense.prop": "1"}, 'No such configuration property: "nonsense.prop"'),
        ({"socket.timeout.ms": "soon"}, 'Invalid value for configuration property "socket.timeout.ms"'),
    ],
)
def test_a_configuration_librdkafka_refuses_is_a_config_error_naming_it_for_each_client(extra, message):
    from kafka2pg.kafka_offsets import admin_client
    from kafka2pg.kafka_reader import RangeReader

    kafka = KafkaConfig.of({"bootstrap.servers": "127.0.0.1:1", **extra})
    with pytest.raises(ConfigError, match=f"librdkafka refuses the Kafka client configuration .*{message}"):
        admin_client(kafka, 1.0)
    with pytest.raises(ConfigError, match=message):
        RangeReader(kafka, "t", 1.0)
