"""One Kafka client dict -> confluent-kafka's config and Spark's Kafka source options, property by property."""

import json
import re

import pytest

from kafka2pg.config import Settings
from kafka2pg.exceptions import ConfigError, KafkaAuthenticationError
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


def test_inline_pems_go_to_spark_inline_as_files_do():
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9094",
            "security.protocol": "SSL",
            "ssl.ca.pem": CA,
            "ssl.certificate.pem": CERT,
            "ssl.key.pem": KEY,
        }
    )
    assert kafka.confluent()["ssl.key.pem"] == KEY  # librdkafka reads them itself
    assert kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:9094",
        "kafka.security.protocol": "SSL",
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.certificates": CA,
        "kafka.ssl.keystore.type": "PEM",
        "kafka.ssl.keystore.certificate.chain": CERT,
        "kafka.ssl.keystore.key": KEY,
    }
    assert kafka.unmapped_for_spark() == []


def test_a_client_key_without_its_certificate_or_the_reverse_is_refused_for_spark(pem_files):
    key_only = KafkaConfig.of({"bootstrap.servers": "b:1", "ssl.key.location": str(pem_files["key"])})
    with pytest.raises(ConfigError, match="`ssl.key.location` or `ssl.key.pem` without `ssl.certificate.location`"):
        key_only.spark_options()
    certificate_only = KafkaConfig.of({"bootstrap.servers": "b:1", "ssl.certificate.pem": CERT})
    with pytest.raises(ConfigError, match="without `ssl.key.location` or `ssl.key.pem`: a client certificate needs"):
        certificate_only.spark_options()
    # The missing half given as the Java property itself: taken as it is.
    java_key = KafkaConfig.of({"bootstrap.servers": "b:1", "ssl.certificate.pem": CERT, "kafka.ssl.keystore.key": KEY})
    options = java_key.spark_options()
    assert options["kafka.ssl.keystore.certificate.chain"] == CERT and options["kafka.ssl.keystore.key"] == KEY


def test_a_key_given_as_a_file_and_inline_or_a_legacy_inline_key_is_refused_for_spark_only(pem_files):
    other_ca = CA.replace("ca", "other-ca")
    both_cas = KafkaConfig.of(
        {"bootstrap.servers": "b:1", "ssl.ca.location": str(pem_files["ca"]), "ssl.ca.pem": other_ca}
    )
    assert both_cas.confluent()["ssl.ca.pem"] == other_ca  # librdkafka trusts both
    assert both_cas.spark_options()["kafka.ssl.truststore.certificates"] == CA + other_ca
    both = {"bootstrap.servers": "b:1", "ssl.certificate.pem": CERT, "ssl.key.location": str(pem_files["key"])}
    both["ssl.key.pem"] = KEY
    assert KafkaConfig.of(both).confluent()["ssl.key.pem"] == KEY  # librdkafka takes one of them
    with pytest.raises(ConfigError, match="`ssl.key.location` and `ssl.key.pem` give the client's certificate or key"):
        KafkaConfig.of(both).spark_options()
    legacy = "-----BEGIN RSA PRIVATE KEY-----\nc2VjcmV0LWtleS1ib2R5\n-----END RSA PRIVATE KEY-----\n"
    kafka = KafkaConfig.of({"bootstrap.servers": "b:1", "ssl.certificate.pem": CERT, "ssl.key.pem": legacy})
    with pytest.raises(ConfigError, match="ssl.key.pem: the key holds a `RSA PRIVATE KEY`") as refused:
        kafka.spark_options()
    assert "c2VjcmV0LWtleS1ib2R5" not in str(refused.value) and "give the new key in ssl.key.pem" in str(refused.value)
    with pytest.raises(ConfigError, match="Kafka property ssl.ca.pem is not PEM"):
        KafkaConfig.of({"bootstrap.servers": "b:1", "ssl.ca.pem": "/etc/ssl/ca.pem"}).spark_options()


@pytest.mark.parametrize(("librdkafka", "java"), [("0", "-1"), ("60000", "60000")])
def test_an_idle_time_of_0_never_closes_for_librdkafka_and_is_minus_1_for_java(librdkafka, java):
    """Java's client takes 0 too, and closes every connection the moment it idles; its "never" is -1."""
    kafka = KafkaConfig.of({"bootstrap.servers": "b:1", "connections.max.idle.ms": librdkafka})
    assert kafka.confluent()["connections.max.idle.ms"] == librdkafka
    assert kafka.spark_options()["kafka.connections.max.idle.ms"] == java


def test_java_only_properties_go_to_spark_only_and_unknown_ones_to_librdkafka_only():
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:1",
            "kafka.security.protocol": "SASL_SSL",
            "kafka.sasl.jaas.config": "x required;",
            "enable.ssl.certificate.verification": "true",
        }
    )
    assert kafka.spark_options()["kafka.sasl.jaas.config"] == "x required;"
    assert "kafka.sasl.jaas.config" not in kafka.confluent()
    assert kafka.confluent()["enable.ssl.certificate.verification"] == "true"
    assert kafka.unmapped_for_spark() == ["enable.ssl.certificate.verification"]
    assert kafka.ignored_by("spark") == ["enable.ssl.certificate.verification"]
    assert kafka.ignored_by("librdkafka") == ["kafka.sasl.jaas.config", "kafka.security.protocol"]


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        ({}, "`bootstrap.servers` is missing"),
        ({"bootstrap.servers": "b:1", "security.protocol": "TLS"}, "security.protocol 'TLS' is not one of"),
        (
            {
                "bootstrap.servers": "b:1",
                "security.protocol": "SASL_SSL",
                "sasl.username": "u",
                "sasl.mechanism": "GSSAPI",
            },
            "give `kafka.sasl.jaas",
        ),
        (  # a login the client would never send: the connection would not be authenticated
            {"bootstrap.servers": "b:1", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "pw"},
            "sasl.username and sasl.password with security.protocol PLAINTEXT: a client logs in only over SASL_SSL",
        ),
        (  # the JAAS login given for Spark's Java client (the form it takes)
            {"bootstrap.servers": "b:1", "security.protocol": "ssl", "kafka.sasl.jaas.config": "x"},
            "kafka.sasl.jaas.config with the Java client's security.protocol SSL: .* set security.protocol SASL_SSL",
        ),
        (
            {
                "bootstrap.servers": "b:1",
                "security.protocol": "SASL_SSL",
                "kafka.security.protocol": "PLAINTEXT",
                "sasl.mechanism": "PLAIN",
                "sasl.username": "u",
                "sasl.password": "pw",
                "kafka.sasl.jaas.config": "x",
            },
            "kafka.sasl.jaas.config with the Java client's security.protocol PLAINTEXT",
        ),
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
        # librdkafka read only the leading digits: 30 ms, 1 ms, 1 byte.
        (
            {"bootstrap.servers": "b:1", "socket.timeout.ms": "30s"},
            "`socket.timeout.ms` takes a whole number, got '30s'",
        ),
        ({"bootstrap.servers": "b:1", "session.timeout.ms": "1e4"}, "`session.timeout.ms` takes a whole number"),
        ({"bootstrap.servers": "b:1", "fetch.min.bytes": 1.5}, "`fetch.min.bytes` takes a whole number, got '1.5'"),
        ({"bootstrap.servers": "b:1", "kafka.request.timeout.ms": "NaN"}, "`kafka.request.timeout.ms` takes a whole"),
        (
            {
                "bootstrap.servers": "b:1",
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "PLAIN",
                "sasl.mechanisms": "SCRAM-SHA-512",
                "sasl.username": "u",
                "sasl.password": "pw",
            },
            "sasl.mechanism 'PLAIN' and its alias sasl.mechanisms 'SCRAM-SHA-512' differ",
        ),
    ],
)
def test_bad_kafka_configuration_is_refused_naming_the_property(properties, message):
    with pytest.raises(ConfigError, match=message):
        KafkaConfig.of(properties).spark_options()


def test_numbers_librdkafka_reads_as_written_are_taken():
    kafka = KafkaConfig.of(
        {"bootstrap.servers": "b:1", "session.timeout.ms": 1e4, "linger.ms": "0.5", "fetch.min.bytes": " 10 "}
    )
    assert kafka.confluent()["session.timeout.ms"] == "10000"  # JSON's 1e4 is 10000.0: a whole number
    assert (kafka.confluent()["linger.ms"], kafka.confluent()["fetch.min.bytes"]) == ("0.5", " 10 ")


@pytest.mark.parametrize(("librdkafka", "java"), [("none", ""), ("NONE", ""), ("https", "https")])
def test_hostname_verification_off_is_none_for_librdkafka_and_empty_for_java(librdkafka, java):
    kafka = KafkaConfig.of(
        {"bootstrap.servers": "b:9093", "security.protocol": "SSL", "ssl.endpoint.identification.algorithm": librdkafka}
    )
    assert kafka.confluent()["ssl.endpoint.identification.algorithm"] == librdkafka
    assert kafka.spark_options()["kafka.ssl.endpoint.identification.algorithm"] == java
    assert kafka.unmapped_for_spark() == []


def test_socket_buffer_sizes_take_librdkafkas_names_and_javas_for_spark():
    kafka = KafkaConfig.of(
        {"bootstrap.servers": "b:1", "socket.receive.buffer.bytes": "262144", "socket.send.buffer.bytes": 0}
    )
    assert kafka.confluent() == {
        "bootstrap.servers": "b:1",
        "socket.receive.buffer.bytes": "262144",
        "socket.send.buffer.bytes": "0",
    }
    assert kafka.spark_options() == {
        "kafka.bootstrap.servers": "b:1",
        "kafka.receive.buffer.bytes": "262144",
        "kafka.send.buffer.bytes": "-1",  # librdkafka's 0 (the system's default) is Java's -1; Java refuses 0
    }
    assert kafka.unmapped_for_spark() == []


def test_librdkafka_takes_the_names_kafka2pg_passes_it():
    """librdkafka accepts the mapped names and values as the connection gives them (nothing connects:
    creating the client checks its configuration)."""
    from kafka2pg.kafka_offsets import admin_client

    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "127.0.0.1:1",
            "socket.receive.buffer.bytes": "262144",
            "socket.send.buffer.bytes": "0",
            "ssl.endpoint.identification.algorithm": "none",
        }
    )
    admin_client(kafka, 1.0)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "receive.buffer.bytes",
            "property `receive.buffer.bytes` is the Java client's name, unknown to librdkafka: "
            "give `socket.receive.buffer.bytes`",
        ),
        (
            "send.buffer.bytes",
            "property `send.buffer.bytes` is the Java client's name, unknown to librdkafka: "
            "give `socket.send.buffer.bytes`",
        ),
    ],
)
def test_a_name_librdkafka_does_not_take_as_meant_is_refused_naming_what_to_give(name, message):
    with pytest.raises(ConfigError, match=f"^the Airflow connection 'k' [(]its extra[)]: {message}"):
        KafkaConfig.of({"bootstrap.servers": "b:1", name: "65536"}, "the Airflow connection 'k' (its extra)")
    java_only = KafkaConfig.of({"bootstrap.servers": "b:1", f"kafka.{name}": "65536"})
    assert java_only.spark_options()[f"kafka.{name}"] == "65536"
    assert f"kafka.{name}" not in java_only.confluent()


@pytest.mark.parametrize(
    ("armour", "kind"),
    [("RSA PRIVATE KEY", "RSA PRIVATE KEY"), ("EC PRIVATE KEY", "EC PRIVATE KEY")],
)
def test_a_legacy_pem_key_is_refused_for_spark_only_naming_the_conversion(armour, kind, pem_files, tmp_path):
    key = tmp_path / "legacy.key"
    key.write_text(f"-----BEGIN {armour}-----\nTUlJRW93SUJBQUtDQVFFQWtleS1ib2R5\n-----END {armour}-----\n")
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9094",
            "security.protocol": "SSL",
            "ssl.ca.location": str(pem_files["ca"]),
            "ssl.certificate.location": str(pem_files["cert"]),
            "ssl.key.location": str(key),
            "ssl.key.password": "key-pass-8812",
        }
    )
    assert kafka.confluent()["ssl.key.location"] == str(key)  # librdkafka reads such a key
    assert "TUlJRW93SUJBQUtDQVFFQWtleS1ib2R5" in kafka.secrets()
    with pytest.raises(ConfigError) as refused:
        kafka.spark_options()
    message = str(refused.value)
    assert f"ssl.key.location: {str(key)!r} holds a `{kind}`" in message
    assert "PKCS#8" in message and "`openssl pkcs8 -topk8 -nocrypt -in key.pem -out key.pk8.pem`" in message
    assert "TUlJRW93" not in message and "key-pass-8812" not in message
    # A key given to Java itself: the file is not inlined, so not checked.
    own = KafkaConfig.of({**kafka.as_dict, "kafka.ssl.keystore.key": KEY})
    assert own.spark_options()["kafka.ssl.keystore.key"] == KEY


def test_an_encrypted_pkcs8_key_goes_to_spark_inline(pem_files, tmp_path):
    encrypted = "-----BEGIN ENCRYPTED PRIVATE KEY-----\nenc\n-----END ENCRYPTED PRIVATE KEY-----\n"
    key = tmp_path / "enc.key"
    key.write_text(encrypted)
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9094",
            "security.protocol": "SSL",
            "ssl.certificate.location": str(pem_files["cert"]),
            "ssl.key.location": str(key),
            "ssl.key.password": "kp",
        }
    )
    assert kafka.spark_options()["kafka.ssl.keystore.key"] == encrypted


@pytest.mark.parametrize(
    ("protocol", "credentials", "named"),
    [
        ("SASL_SSL", {"sasl.username": "u", "sasl.password": "pw"}, "sasl.username and sasl.password"),
        ("sasl_plaintext", {"sasl.username": "u"}, "sasl.username"),
        ("SASL_SSL", {"sasl.password": "pw"}, "sasl.password"),
    ],
)
def test_sasl_credentials_without_a_mechanism_are_refused(protocol, credentials, named):
    """Without sasl.mechanism both clients would use GSSAPI: no guess, the connection names it."""
    with pytest.raises(
        ConfigError,
        match=f"security.protocol {protocol.upper()} with {named} needs sasl.mechanism "
        "[(]PLAIN, SCRAM-SHA-256, SCRAM-SHA-512[)]",
    ):
        KafkaConfig.of({"bootstrap.servers": "b:1", "security.protocol": protocol, **credentials})


def test_sasl_without_credentials_or_a_login_protocol_is_taken_as_before():
    kerberos = KafkaConfig.of(
        {"bootstrap.servers": "b:1", "security.protocol": "SASL_SSL", "sasl.kerberos.service.name": "kafka"}
    )
    assert kerberos.spark_options() == {
        "kafka.bootstrap.servers": "b:1",
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.kerberos.service.name": "kafka",
    }
    gssapi = KafkaConfig.of(
        {"bootstrap.servers": "b:1", "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "GSSAPI"}
    )
    assert gssapi.spark_options()["kafka.sasl.mechanism"] == "GSSAPI"


def test_settings_round_trip_through_the_environment_the_stage_job_gets():
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:1",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": "u",
            "sasl.password": "s",
        }
    )
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


def test_the_environments_client_properties_giving_a_key_twice_are_refused_naming_the_key_not_its_values():
    from kafka2pg.config import kafka_from_env

    text = '{"bootstrap.servers": "b:1", "sasl.password": "Pw1x", "sasl.password": "Pw2x", "acks": "all"}'
    with pytest.raises(ConfigError) as info:  # JSON would keep the last silently
        kafka_from_env({"KAFKA2PG_KAFKA_CONFIG": text})
    assert "KAFKA2PG_KAFKA_CONFIG: 'sasl.password' given more than once" in str(info.value)
    assert "Pw1x" not in str(info.value) and "Pw2x" not in str(info.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"nonsense.prop": "1"}, 'No such configuration property: "nonsense.prop"'),
        ({"api.version.request": "maybe"}, 'Expected bool value for "api.version.request"'),
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


def test_secrets_are_every_secret_value_and_each_line_of_the_client_key(tmp_path):
    key = tmp_path / "client.key"
    body = ["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7", "VJTUt9Us8cKjMzEfYyjiWA4R4/M2bS1G"]
    key.write_text("-----BEGIN PRIVATE KEY-----\n" + "\n".join(body) + "\n-----END PRIVATE KEY-----\n")
    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "b:9093",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": "app-user",
            "sasl.password": "pw-0451-x",
            "kafka.sasl.jaas.config": 'Module required\n  clientSecret="cs-9911";',
            "ssl.key.pem": "-----BEGIN PRIVATE KEY----- SU5MSU5FX0tFWQ== -----END PRIVATE KEY-----",
            "ssl.key.location": str(key),
            "ssl.ca.location": str(tmp_path / "not-read.pem"),
        }
    )
    secrets = kafka.secrets()
    one_line_pem = "-----BEGIN PRIVATE KEY----- SU5MSU5FX0tFWQ== -----END PRIVATE KEY-----"
    assert {"pw-0451-x", 'Module required\n  clientSecret="cs-9911";', one_line_pem, *body} <= set(secrets)
    assert not {"app-user", "b:9093", str(key), "Module required"} & set(secrets)  # a JAAS value is one secret
    assert not [s for s in secrets if re.fullmatch(r"-----(BEGIN|END) [A-Z ]+-----", s) or s != s.strip() or not s]
    shown = repr(Settings(database_url="postgresql://etl:Db-pass-7731@db/warehouse", kafka=kafka))
    assert "b:9093" in shown
    assert "pw-0451-x" not in shown and "cs-9911" not in shown and "Db-pass-7731" not in shown
    # A key file the task cannot read: the other secrets still.
    unreadable = KafkaConfig.of({"bootstrap.servers": "b", "ssl.key.location": str(tmp_path / "gone.key")})
    assert unreadable.secrets() == []


def test_a_task_has_airflow_mask_the_services_secrets_in_its_log(tmp_path, monkeypatch):
    """Airflow masks a connection's password itself, not a password inside KAFKA2PG_DATABASE_URL
    or the lines of a client key file: a task's resolve registers them."""
    from airflow.sdk.log import redact

    from kafka2pg.tasks import mask_secrets

    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nQk9EWV9MSU5FX09GX1RIRV9LRVk=\n-----END PRIVATE KEY-----\n")
    kafka = KafkaConfig.of({"bootstrap.servers": "b:9093", "ssl.key.location": str(key)})
    settings = Settings(database_url="postgresql://etl:Db-pass%407731@db:5432/warehouse", kafka=kafka)
    line = (
        "at DEBUG: key Qk9EWV9MSU5FX09GX1RIRV9LRVk= url postgresql://etl:Db-pass%407731@db:5432/warehouse"
        " pw Db-pass@7731"
    )
    assert redact(line) == line  # nothing known yet

    mask_secrets(settings)

    assert redact(line) == "at DEBUG: key *** url postgresql://etl:***@db:5432/warehouse pw ***"
    mask_secrets(Settings(database_url="postgresql://etl:bad%zz@db/x", kafka=kafka))  # malformed: no raise
    # The client key's password, given in the URL's query.
    mask_secrets(Settings(database_url="postgresql://etl@db/x?sslkey=/k.pem&sslpassword=Key-pw-6612", kafka=kafka))
    assert redact("could not load the key (Key-pw-6612)") == "could not load the key (***)"
    # libpq 18's SCRAM keys, each as good as the password to whoever reads them.
    client_key, server_key = "c2NyYW1DbGllbnRLZXk0NDE5", "c2NyYW1TZXJ2ZXJLZXk4ODI3"
    url = f"postgresql://etl@db/x?scram_client_key={client_key}&scram_server_key={server_key}"
    mask_secrets(Settings(database_url=url, kafka=kafka))
    assert redact(f"keys {client_key} {server_key}") == "keys *** ***"


@pytest.mark.parametrize(
    ("conf", "launched", "expected_base"),
    [
        ({}, None, "(?i)secret|password|token|access[.]?key"),  # Spark's default
        ({}, "(?i)credential|apikey", "(?i)credential|apikey"),  # a site's spark-defaults.conf, kept
        ({"spark.redaction.regex": "(?i)pipeline"}, "(?i)site", "(?i)pipeline"),  # the pipeline's spark_conf
    ],
    ids=["spark-default", "site", "pipeline"],
)
def test_spark_hides_the_inline_client_key_with_the_redaction_regex_in_force(conf, launched, expected_base):
    """Spark's Kafka source hides the client parameters its regex matches (by name or value):
    kafka2pg adds the inline key's name and PEM armour to whatever regex is in force."""
    from kafka2pg.staging import redaction_conf

    regex = redaction_conf({"spark.app.name": "x", **conf}, launched)["spark.redaction.regex"]
    assert regex.startswith(expected_base + "|")
    java_like = re.compile(regex.replace("(?i)", "", 1), re.IGNORECASE if regex.startswith("(?i)") else 0)
    for shown_as_hidden in ("ssl.keystore.key", "kafka.ssl.keystore.key", "-----BEGIN PRIVATE KEY-----\nMIIE"):
        assert java_like.search(shown_as_hidden)
    assert not java_like.search("kafka.ssl.keystore.type") and not java_like.search("bootstrap.servers")
    assert redaction_conf({"spark.redaction.regex": regex}, None) == {"spark.redaction.regex": regex}  # added once


def test_request_timeout_ms_reaches_both_clients_as_before():
    """Java's timeout of every request; librdkafka's consumers ignore it (a producer property
    there): a connection written for Spark's source keeps working, and Spark gets it."""
    config = KafkaConfig.of({"bootstrap.servers": "b:1", "request.timeout.ms": "45000"})
    assert config.spark_options()["kafka.request.timeout.ms"] == "45000"
    assert config.as_dict["request.timeout.ms"] == "45000"


def test_librdkafka_quoting_an_oauthbearer_setting_shows_none_of_its_secrets():
    """librdkafka's OAUTHBEARER settings are free-form `name=value` pieces, and its error quotes the
    piece it cannot read: the error kafka2pg raises (CLI, status, the ledger's last failure) and
    the masked secrets hold none of them."""
    from kafka2pg.kafka_offsets import partition_offsets

    kafka = KafkaConfig.of(
        {
            "bootstrap.servers": "127.0.0.1:1",
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "OAUTHBEARER",
            "enable.sasl.oauthbearer.unsecure.jwt": "true",
            "sasl.oauthbearer.config": "principal=svc clientSecret=Tok-5521-x",
        }
    )
    assert {"clientSecret=Tok-5521-x", "Tok-5521-x"} <= set(kafka.secrets())
    assert not {"principal=svc", "svc"} & set(kafka.secrets())  # its words would hide innocent text
    with pytest.raises(KafkaAuthenticationError) as refused:
        partition_offsets(kafka, "t", 10.0)
    said = str(refused.value)
    assert "Unrecognized sasl.oauthbearer.config" in said and "Tok-5521-x" not in said, said
    passphrase = KafkaConfig.of(
        {"bootstrap.servers": "b", "sasl.oauthbearer.assertion.private.key.passphrase": "Pass-7781-q"}
    )
    assert passphrase.secrets() == ["Pass-7781-q"]


def test_blank_settings_in_the_environment_are_unset_and_white_space_around_a_value_is_not_part_of_it(tmp_path):
    """As `${NAME:-default}` (and the ./kafka2pg wrapper): a blank KAFKA2PG_SPARK_MASTER was ''
    (local[*] in the wrapper), a blank KAFKA2PG_DATABASE_URL counted as set (libpq then takes
    the local socket and the PG* variables), and KAFKA2PG_STATE_DIR=' /x' was '<cwd>/ /x'."""
    env = {
        "KAFKA2PG_BOOTSTRAP_SERVERS": " b:1 ",
        "KAFKA2PG_DATABASE_URL": "postgresql://u@h/db\n",
        "KAFKA2PG_SPARK_MASTER": "",
        "KAFKA2PG_STATE_DIR": f" {tmp_path} ",
        "KAFKA2PG_KAFKA_TIMEOUT_S": " 5 ",
        "KAFKA2PG_KAFKA_CONFIG": "  ",
    }
    settings = Settings.from_env(env)
    assert (settings.bootstrap_servers, settings.database_url) == ("b:1", "postgresql://u@h/db")
    assert (settings.spark_master, settings.state_dir, settings.kafka_timeout_s) == ("local[*]", tmp_path, 5.0)
    with pytest.raises(ConfigError, match=r"environment variable\(s\) KAFKA2PG_DATABASE_URL not set"):
        Settings.from_env({**env, "KAFKA2PG_DATABASE_URL": " "})
