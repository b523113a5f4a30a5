"""The Kafka client configuration: one dict of client properties (as the apache-kafka provider's
connection holds it, librdkafka's names) -> confluent-kafka's config and Spark's source options.

No client library is imported. Spark's Kafka source is the Java client, whose security
properties differ from librdkafka's; `spark_options` maps them property by property (and reads
the PEM files librdkafka would read, to pass them inline).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka2pg.exceptions import ConfigError, without_secrets

# Properties whose values are secrets: never shown (`redacted`), never logged.
SECRET_PROPERTIES = frozenset(
    {
        "sasl.password",
        "ssl.key.password",
        "ssl.keystore.password",
        "ssl.truststore.password",
        "sasl.jaas.config",
        "ssl.key.pem",
        "ssl.keystore.key",
        "sasl.oauthbearer.client.secret",
        # librdkafka's own OAUTHBEARER settings ("principal=… scope=…", free-form): a secret may be
        # among them, and librdkafka quotes the part it cannot read in its error.
        "sasl.oauthbearer.config",
    }
)
# A property for the Java client only (Spark's source), given with this prefix, goes to Spark as is
# and is left out of librdkafka's config.
JAVA_ONLY_PREFIX = "kafka."
# Properties that take a whole number (milliseconds, bytes, counts), by the name's last word; not
# librdkafka's linger.ms (alias queue.buffering.max.ms), which takes a fraction.
_WHOLE_NUMBER_KEY = re.compile(
    r"^(?!(linger|queue\.buffering\.max)\.ms$).*(^|\.)(ms|bytes|kbytes|messages|count|retries|size)$"
)
# librdkafka properties that mean the same, under the same name, in the Java client.
_SAME_IN_JAVA = frozenset(
    {
        "bootstrap.servers",
        "security.protocol",
        "client.id",
        "client.dns.lookup",
        "sasl.kerberos.service.name",
        # Java's timeout of every request; librdkafka's consumers ignore it (a producer property
        # there, with a warning): passed to both, as connections written for Spark's source give it.
        "request.timeout.ms",
        "metadata.max.age.ms",
        "reconnect.backoff.ms",
        "reconnect.backoff.max.ms",
        "retry.backoff.ms",
        "socket.connection.setup.timeout.ms",
        "fetch.min.bytes",
        "fetch.max.bytes",
    }
)
# librdkafka properties the Java client knows under another name (the socket buffer sizes).
_RENAMED_FOR_JAVA = {
    "socket.receive.buffer.bytes": "receive.buffer.bytes",
    "socket.send.buffer.bytes": "send.buffer.bytes",
}
# librdkafka properties whose 0 Java writes -1: the socket buffer sizes' "the system's default"
# (Java refuses 0), the idle time's "never close" (Java's 0 closes a connection as soon as it idles).
_ZERO_IS_MINUS_ONE_IN_JAVA = {**_RENAMED_FOR_JAVA, "connections.max.idle.ms": "connections.max.idle.ms"}
# The PEM material librdkafka takes as a file or inline: (file property, inline property). Spark's
# source gets each inline, type PEM: the CAs as `ssl.truststore.certificates`, the certificate as
# `ssl.keystore.certificate.chain`, the key as `ssl.keystore.key`.
_PEM_SOURCES = (
    ("ssl.ca.location", "ssl.ca.pem"),
    ("ssl.certificate.location", "ssl.certificate.pem"),
    ("ssl.key.location", "ssl.key.pem"),
)
# Names librdkafka does not take, refused with what to give instead: the Java client's names for
# librdkafka's renamed properties (librdkafka has no such property).
_REFUSED = {
    java: f"the Java client's name, unknown to librdkafka: give `{name}` (Spark's source gets it as {java})"
    for name, java in _RENAMED_FOR_JAVA.items()
}
# librdkafka properties handled by the mapping below (they become other Java properties).
_MAPPED = frozenset(
    {
        *_ZERO_IS_MINUS_ONE_IN_JAVA,
        *(name for source in _PEM_SOURCES for name in source),
        "ssl.endpoint.identification.algorithm",
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.password",
        "ssl.key.password",
    }
)
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# A PEM private key's armour; Java's PEM support (Spark's `ssl.keystore.key`) reads only PKCS#8's:
# `PRIVATE KEY` and `ENCRYPTED PRIVATE KEY`, not the legacy `RSA PRIVATE KEY` (PKCS#1), `EC PRIVATE
# KEY` (SEC1), ... that librdkafka (OpenSSL) reads too.
_PEM_KEY_BEGIN = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY-----")
_PKCS8_KINDS = ("", "ENCRYPTED ")


@dataclass(frozen=True)
class KafkaConfig:
    """Kafka client properties, librdkafka names (`bootstrap.servers`, `security.protocol`,
    `sasl.*`, `ssl.*`, ...), plus Java-only ones prefixed `kafka.`. Its repr, like its str, names
    the cluster only: a traceback or a debugger's view shows no secret."""

    properties: tuple[tuple[str, str], ...]

    def __repr__(self) -> str:
        return f"KafkaConfig({self})"

    @classmethod
    def of(cls, properties: Mapping[str, Any], where: str = "the Kafka configuration") -> KafkaConfig:
        """Checked: `bootstrap.servers` present, values scalar, no name librdkafka does not take
        as meant (`_REFUSED`), known security protocol, a mechanism for a SASL user name or
        password, a user name and password for the SASL mechanisms that log in with them."""
        if not isinstance(properties, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping of Kafka client properties, got {type(properties).__name__}"
            )
        items = {}
        for key, value in properties.items():
            if not isinstance(key, str) or isinstance(value, dict | list) or value is None:
                raise ConfigError(f"{where}: property {key!r} must be a name with a string, number or boolean value")
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # JSON's 30000.0: librdkafka reads "30000"
            items[key] = str(value).lower() if isinstance(value, bool) else str(value)
        refused = sorted(items.keys() & _REFUSED.keys())
        if refused:
            raise ConfigError(f"{where}: " + "; ".join(f"property `{key}` is {_REFUSED[key]}" for key in refused))
        for key, text in items.items():
            if _WHOLE_NUMBER_KEY.search(key) and not re.fullmatch(r"-?[0-9]+", text.strip()):
                raise ConfigError(
                    f"{where}: property `{key}` takes a whole number, got {text!r}: librdkafka would read only its "
                    "leading digits (30s as 30, 1e4 as 1), the Java client refuse it; write the number alone"
                )
        if {"sasl.mechanism", "sasl.mechanisms"} <= items.keys() and (
            items["sasl.mechanism"].upper() != items["sasl.mechanisms"].upper()
        ):
            raise ConfigError(
                f"{where}: sasl.mechanism {items['sasl.mechanism']!r} and its alias sasl.mechanisms "
                f"{items['sasl.mechanisms']!r} differ (librdkafka would use one, kafka2pg's messages and the Java "
                "client the other): give one of them"
            )
        if not items.get("bootstrap.servers", "").strip():
            raise ConfigError(f"{where}: `bootstrap.servers` is missing (e.g. broker1:9092,broker2:9092)")
        protocol = items.get("security.protocol", "PLAINTEXT").upper()
        if protocol not in _SECURITY_PROTOCOLS:
            raise ConfigError(f"{where}: security.protocol {protocol!r} is not one of {', '.join(_SECURITY_PROTOCOLS)}")
        given = items.get("sasl.mechanism") or items.get("sasl.mechanisms")
        credentials = [k for k in ("sasl.username", "sasl.password") if items.get(k)]
        java_protocol = items.get(f"{JAVA_ONLY_PREFIX}security.protocol", protocol).upper()
        for logins, used, named in (
            (credentials, protocol, "security.protocol"),
            (
                [k for k in (f"{JAVA_ONLY_PREFIX}sasl.jaas.config",) if items.get(k)],
                java_protocol,
                "the Java client's security.protocol",
            ),
        ):
            if logins and not used.startswith("SASL_"):
                _unsent_login(where, logins, used, named)
        if protocol.startswith("SASL_") and not given and credentials:
            raise ConfigError(
                f"{where}: security.protocol {protocol} with {' and '.join(credentials)} needs sasl.mechanism "
                f"({', '.join(_LOGIN_MODULES)}): without one both clients would log in with GSSAPI (Kerberos), "
                "which takes no user name or password"
            )
        mechanism = (given or "GSSAPI").upper()
        if protocol.startswith("SASL_") and mechanism in _LOGIN_MODULES:
            missing = [k for k in ("sasl.username", "sasl.password") if not items.get(k)]
            if missing:
                raise ConfigError(
                    f"{where}: security.protocol {protocol} with sasl.mechanism {mechanism} needs "
                    f"{' and '.join(missing)} (the client authenticates with a user name and password)"
                )
        return cls(tuple(sorted(items.items())))

    @classmethod
    def plain(cls, bootstrap_servers: str) -> KafkaConfig:
        return cls.of({"bootstrap.servers": bootstrap_servers})

    @property
    def as_dict(self) -> dict[str, str]:
        return dict(self.properties)

    @property
    def servers(self) -> str:
        return self.as_dict["bootstrap.servers"]

    @property
    def protocol(self) -> str:
        return self.as_dict.get("security.protocol", "PLAINTEXT").upper()

    def __str__(self) -> str:
        """Where the cluster is and how it is reached: what messages name (never a secret)."""
        if self.protocol == "PLAINTEXT":
            return self.servers
        mechanism = self.as_dict.get("sasl.mechanism") or self.as_dict.get("sasl.mechanisms")
        return f"{self.servers} ({self.protocol}{', ' + mechanism if mechanism else ''})"

    def redacted(self) -> dict[str, str]:
        return {k: "***" if _secret(k) else v for k, v in self.properties}

    def secrets(self) -> list[str]:
        """What a log must never show: each secret property's value, and each line of a PEM key
        (an inline one, or the file `ssl.key.location` names, when readable here: a log shows
        a multi-line value one line at a time). Not a PEM's armour lines, nor pieces so short
        they would hide innocent text."""
        found = []
        for key, value in self.properties:
            if _secret(key):
                found += [value, *_pem_lines(value)]
                found += _settings_pieces(value) if key.endswith("oauthbearer.config") else []
            elif key in _KEY_FILES:
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    found += _pem_lines(Path(value).read_text())
        return list(dict.fromkeys(text for text in (t.strip() for t in found) if len(text) >= _SHORTEST_MASKED))

    def scrub(self, text: str) -> str:
        """`text` (a client library's words: librdkafka's errors may quote a property's value) with
        every secret of `secrets` replaced by ***."""
        return without_secrets(text, self.secrets())

    def to_json(self) -> str:
        return json.dumps(self.as_dict)

    def confluent(self) -> dict[str, str]:
        """confluent-kafka's (librdkafka's) config: every property but the Java-only ones."""
        return {k: v for k, v in self.properties if not k.startswith(JAVA_ONLY_PREFIX)}

    def spark_options(self) -> dict[str, str]:
        """Spark's Kafka source options (`kafka.`-prefixed Java client properties).

        SASL username/password become `sasl.jaas.config` for PLAIN and SCRAM (with the mechanism
        given: no mechanism, no login; `of` refuses SASL credentials without one); the PEMs given
        to librdkafka as files (`ssl.ca.location`, `ssl.certificate.location` + `ssl.key.location`, a
        PKCS#8 key) or inline (`ssl.ca.pem`, `ssl.certificate.pem`, `ssl.key.pem`) are passed inline
        (`ssl.truststore.certificates`, both CAs if both are given, `ssl.keystore.certificate.chain` +
        `ssl.keystore.key`, type PEM), so the executors need no files; a certificate or key given both
        ways is refused. The socket buffer sizes take their Java names; librdkafka's 0 for them (the
        system's default) and for `connections.max.idle.ms` (never close) is Java's -1; hostname
        verification's `none` is Java's empty value. Java-only properties pass as given (and win).
        """
        props = self.as_dict
        options = {f"kafka.{k}": v for k, v in props.items() if k in _SAME_IN_JAVA}
        for name, java in _ZERO_IS_MINUS_ONE_IN_JAVA.items():
            if name in props:
                options[f"kafka.{java}"] = "-1" if props[name].strip() == "0" else props[name]
        if "ssl.endpoint.identification.algorithm" in props:
            algorithm = props["ssl.endpoint.identification.algorithm"].strip().lower()  # as librdkafka reads it
            options["kafka.ssl.endpoint.identification.algorithm"] = "" if algorithm == "none" else algorithm
        options.update({k: v for k, v in props.items() if k.startswith(JAVA_ONLY_PREFIX)})
        mechanism = (props.get("sasl.mechanism") or props.get("sasl.mechanisms") or "").upper()
        if mechanism:
            options["kafka.sasl.mechanism"] = mechanism
        if "sasl.username" in props and mechanism and "kafka.sasl.jaas.config" not in options:
            module = _LOGIN_MODULES.get(mechanism)
            if module is None:
                raise ConfigError(
                    f"sasl.mechanism {mechanism!r} with sasl.username: kafka2pg builds Spark's JAAS login for "
                    f"{', '.join(_LOGIN_MODULES)}; for another mechanism give `kafka.sasl.jaas.config` yourself"
                )
            options["kafka.sasl.jaas.config"] = (
                f"{module} required username={_jaas(props['sasl.username'])} "
                f"password={_jaas(props.get('sasl.password', ''))};"
            )
        ca, certificate, key = _PEM_SOURCES
        # librdkafka trusts the CAs of both `ssl.ca.location` and `ssl.ca.pem`; of a certificate or
        # key given both ways it uses one, which one unsaid: refused rather than guessed.
        both = [f"`{file}` and `{inline}`" for file, inline in (certificate, key) if file in props and inline in props]
        if both:
            raise ConfigError(
                f"Kafka properties {'; '.join(both)} give the client's certificate or key twice (a file, and "
                "inline): Spark's Kafka source takes one; give one"
            )
        if _given(props, ca):
            options.setdefault("kafka.ssl.truststore.type", "PEM")
            if "kafka.ssl.truststore.certificates" not in options:
                cas = [_read_pem(props, name) for name in ca if name in props]
                options["kafka.ssl.truststore.certificates"] = "\n".join(text.strip() for text in cas) + "\n"
        if _given(props, certificate) or _given(props, key):
            java = {certificate: "kafka.ssl.keystore.certificate.chain", key: "kafka.ssl.keystore.key"}
            missing = [
                source for source in (certificate, key) if not _given(props, source) and java[source] not in options
            ]
            if missing:
                (missing,) = missing
                given = key if missing is certificate else certificate
                raise ConfigError(
                    f"Kafka property `{given[0]}` or `{given[1]}` without `{missing[0]}` or `{missing[1]}`: "
                    "a client certificate needs its key and a key its certificate; give both"
                )
            options.setdefault("kafka.ssl.keystore.type", "PEM")
            if "kafka.ssl.keystore.certificate.chain" not in options:
                options["kafka.ssl.keystore.certificate.chain"] = _pem_of(props, certificate)
            if "kafka.ssl.keystore.key" not in options:
                options["kafka.ssl.keystore.key"] = _pkcs8_key(props, key)
            if "ssl.key.password" in props:
                options.setdefault("kafka.ssl.key.password", props["ssl.key.password"])
        return options

    def ignored_by(self, reader: str) -> list[str]:
        """The property names a stage `reader` does not pass to its client: the Java-only ones for
        `librdkafka`, the ones without a known Java equivalent for `spark` (Spark's source)."""
        if reader == "spark":
            return self.unmapped_for_spark()
        return sorted(k for k, _ in self.properties if k.startswith(JAVA_ONLY_PREFIX))

    def unmapped_for_spark(self) -> list[str]:
        """librdkafka properties Spark's source does not get (no Java equivalent known here)."""
        known = _SAME_IN_JAVA | _MAPPED
        return sorted(k for k, _ in self.properties if k not in known and not k.startswith(JAVA_ONLY_PREFIX))


def _secret(key: str) -> bool:
    bare = key.removeprefix(JAVA_ONLY_PREFIX)
    return bare in SECRET_PROPERTIES or any(word in bare for word in ("password", "secret", "passphrase", "key.pem"))


# Properties naming a file that holds a private key: its PEM lines are secrets too.
_KEY_FILES = frozenset({"ssl.key.location", "sasl.oauthbearer.assertion.private.key.file"})


def _settings_pieces(value: str) -> list[str]:
    """The `name=value` pieces of a space-separated settings string whose name looks secret, and
    their values (not `principal=…` or `scope=…`: masked, their words would hide innocent text)."""
    pieces = [p for p in value.split() if re.search(r"secret|password|token|key", p.partition("=")[0], re.I)]
    return pieces + [piece.partition("=")[2] for piece in pieces]


_PEM_ARMOUR = re.compile(r"-----(BEGIN|END) [A-Z0-9 ]+-----")
_SHORTEST_MASKED = 5  # Airflow's masker skips shorter ones by default ([logging] min_length_masked_secret)


def _pem_lines(text: str) -> list[str]:
    """The lines of a PEM text but its armour (none for a text that is not PEM)."""
    if "-----BEGIN" not in text:
        return []
    return [line for line in text.splitlines() if not _PEM_ARMOUR.fullmatch(line.strip())]


def _jaas(value: str) -> str:
    """A JAAS option value, quoted (quotes and backslashes escaped)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _given(props: Mapping[str, str], source: tuple[str, str]) -> bool:
    return source[0] in props or source[1] in props


def _pem_of(props: Mapping[str, str], source: tuple[str, str]) -> str:
    """The PEM text of a (file, inline) source: the inline value if given, else the file's."""
    file, inline = source
    return _read_pem(props, inline if inline in props else file)


def _read_pem(props: Mapping[str, str], name: str) -> str:
    """The PEM text property `name` gives: its value (an inline `….pem` property), or the content
    of the file it names. A message names the property and the file, never the content."""
    if name.endswith(".pem"):
        text, what = props[name], f"Kafka property {name}"
    else:
        path = props[name]
        what = f"Kafka property {name}: {path!r}"
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"Kafka property {name}: cannot read the PEM file {path!r} ({exc.strerror})") from None
    if "-----BEGIN" not in text:
        raise ConfigError(f"{what} is not PEM (no `-----BEGIN` line)")
    return text


def _pkcs8_key(props: Mapping[str, str], source: tuple[str, str]) -> str:
    """The client key for Spark's `ssl.keystore.key`: a legacy PEM key (PKCS#1 `RSA PRIVATE KEY`,
    SEC1 `EC PRIVATE KEY`, ...) is refused, Java's PEM support would fail on it at the first
    connection. The message names the property (and file) and the key's kind, never its content."""
    text = _pem_of(props, source)
    legacy = [kind for kind in _PEM_KEY_BEGIN.findall(text) if kind not in _PKCS8_KINDS]
    if legacy:
        file, inline = source
        where = f"{inline}: the key" if inline in props else f"{file}: {props[file]!r}"
        then = (
            f"and give the new key in {inline}"
            if inline in props
            else f"and name the new file in {file} (librdkafka reads it too)"
        )
        raise ConfigError(
            f"Kafka property {where} holds a `{legacy[0]}PRIVATE KEY`, a format librdkafka "
            "reads but Spark's Kafka source (Java) does not: it takes PKCS#8 keys only (`PRIVATE KEY`, "
            "`ENCRYPTED PRIVATE KEY`). Convert it, e.g. `openssl pkcs8 -topk8 -nocrypt -in key.pem -out "
            "key.pk8.pem` (to keep it encrypted, with ssl.key.password: `-v1 PBE-SHA1-3DES` instead of "
            f"`-nocrypt`), {then}"
        )
    return text


KafkaLike = KafkaConfig | str  # a plain bootstrap-servers string means PLAINTEXT


def scrubbed(kafka: KafkaLike, text: str) -> str:
    """`text` without the secrets of `kafka`'s configuration (`KafkaConfig.scrub`)."""
    return kafka.scrub(text) if isinstance(kafka, KafkaConfig) else text


def kafka_config(kafka: KafkaLike) -> KafkaConfig:
    return kafka if isinstance(kafka, KafkaConfig) else KafkaConfig.plain(kafka)


def _unsent_login(where: str, logins: list[str], protocol: str, named: str) -> None:
    """Refuse a SASL login a client would never send (its protocol is not SASL_*): the connection
    would silently not authenticate."""
    they, them = ("they", "them") if len(logins) > 1 else ("it", "it")
    wanted = "SASL_SSL" if protocol == "SSL" else "SASL_SSL (or SASL_PLAINTEXT)"
    raise ConfigError(
        f"{where}: {' and '.join(logins)} with {named} {protocol}: a client logs in only over SASL_SSL "
        f"or SASL_PLAINTEXT, so {they} would never be sent and the connection would not be authenticated: set "
        f"security.protocol {wanted}, or remove {them}"
    )
