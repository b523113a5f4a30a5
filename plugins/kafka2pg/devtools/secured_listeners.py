"""The broker's secured listeners: SASL_SSL (SCRAM-SHA-512, PLAIN) and SSL requiring a client
certificate (mTLS), with the CA, certificates, users and passwords made at the broker's first start.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kafka2pg.exceptions import StackError
from kafka2pg.locations import COMMAND, preview_first

SECURED_DIR = "secured"  # under the broker's data dir: CA, certificates, keys, users and passwords
SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_ITERATIONS = 8192
_CERT_DAYS = "3650"  # a stack keeps its certificates across restarts: they must outlive its data
CREDENTIALS = "credentials.json"
_BROKER_KEYSTORE = "broker-keystore.pem"
# Made together: when one is missing, all are made anew (clients then need the new ca.pem).
_TLS_FILES = ("ca.pem", "ca.key", _BROKER_KEYSTORE, "client.pem", "client.key", "client-keystore.pem")

ClientMode = Literal["scram", "plain", "mtls"]


@dataclass(frozen=True)
class SaslUser:
    """A user of the SASL_SSL listener; its password is left out of repr, hence out of logs and reports."""

    name: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class SecuredListener:
    """What a client needs to reach the broker's secured listeners.

    SASL_SSL (`sasl_ssl_bootstrap_servers`) takes SCRAM-SHA-512 (`scram`) and PLAIN (`plain`) users and
    asks for no client certificate; SSL (`ssl_bootstrap_servers`) requires a certificate signed by the
    stack's CA (mTLS). Both present a broker certificate for IP 127.0.0.1 and DNS localhost, signed by
    `ca_pem`. Keys are unencrypted PKCS#8; `client_keystore_pem` holds the client key and certificate
    chain in one file, as Java clients want it (`ssl.keystore.type=PEM`; Java reads an encrypted PEM key
    only when PBES1-encrypted, not with OpenSSL's default PBES2).
    """

    sasl_ssl_bootstrap_servers: str
    ssl_bootstrap_servers: str
    ca_pem: Path
    client_cert: Path
    client_key: Path
    client_keystore_pem: Path
    scram: SaslUser
    plain: SaslUser

    def client_config(self, mode: ClientMode) -> dict[str, str]:
        """librdkafka (confluent-kafka) settings for one way in: "scram" (SASL_SSL, SCRAM-SHA-512),
        "plain" (SASL_SSL, PLAIN) or "mtls" (SSL with the client certificate)."""
        if mode == "mtls":
            return {
                "bootstrap.servers": self.ssl_bootstrap_servers,
                "security.protocol": "SSL",
                "ssl.ca.location": str(self.ca_pem),
                "ssl.certificate.location": str(self.client_cert),
                "ssl.key.location": str(self.client_key),
            }
        mechanism, user = {"scram": (SCRAM_MECHANISM, self.scram), "plain": ("PLAIN", self.plain)}[mode]
        return {
            "bootstrap.servers": self.sasl_ssl_bootstrap_servers,
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": mechanism,
            "sasl.username": user.name,
            "sasl.password": user.password,
            "ssl.ca.location": str(self.ca_pem),
        }


def secured_properties(secured: SecuredListener) -> list[str]:
    """The broker side of SecuredListener. SCRAM users live in the cluster metadata (added when the
    storage is formatted), PLAIN users in the listener's JAAS config; the file holding it is 0600."""
    plain = secured.plain
    return [
        f"listener.name.sasl_ssl.sasl.enabled.mechanisms={SCRAM_MECHANISM},PLAIN",
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
        "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule "
        f'required user_{plain.name}="{plain.password}";',
        "listener.name.sasl_ssl.ssl.client.auth=none",
        "listener.name.ssl.ssl.client.auth=required",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={secured.ca_pem.parent / _BROKER_KEYSTORE}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={secured.ca_pem}",
    ]


def unsecured_error(what: str) -> StackError:
    return StackError(
        f"{what} was started without secured listeners, and a recorded stack keeps the listeners it started "
        f"with: nothing was started or changed. For secured listeners: {preview_first('stack reset')} "
        f"(deletes the stack's data), then `{COMMAND} stack start --secured` (in code: "
        "start_stack(..., secured=True))."
    )


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: keys, passwords, a broker config that holds passwords."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # O_CREAT's mode applies to a new file only
        out.write(text)


def _openssl(work: Path, *args: str) -> None:
    if shutil.which("openssl") is None:
        raise StackError(
            "openssl is not installed; it makes the secured listeners' certificates: `apt-get install openssl`"
        )
    done = subprocess.run(["openssl", *args], cwd=work, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StackError(
            f"`openssl {args[0]}` failed while making the secured listeners' certificates:\n{done.stderr[-2000:]}"
        )


def _make_certificates(directory: Path) -> None:
    """A CA; a broker certificate for IP 127.0.0.1 and DNS localhost (clients check the address they
    dial against it); a client certificate for mTLS. EC P-256 keys as unencrypted PKCS#8 PEM, which
    librdkafka and Java's PEM key stores both read."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        work = Path(tmp)
        for name in ("ca", "broker", "client"):
            _openssl(work, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")
        _openssl(
            work,
            *("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kafka2pg local stack CA", "-days", _CERT_DAYS),
            *("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"),
            *("-out", "ca.pem"),
        )
        for name, subject, extensions in (
            ("broker", "/CN=localhost", ["extendedKeyUsage=serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost"]),
            ("client", "/CN=kafka2pg-client", ["extendedKeyUsage=clientAuth"]),
        ):
            lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature", *extensions, ""]
            (work / f"{name}.ext").write_text("\n".join(lines))
            _openssl(work, "req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr")
            _openssl(
                work,
                *("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key"),
                *("-set_serial", f"0x{secrets.token_hex(16)}", "-days", _CERT_DAYS),
                *("-extfile", f"{name}.ext", "-out", f"{name}.pem"),
            )
        pem = {name: (work / name).read_text() for name in ("ca.pem", "ca.key", "broker.pem", "broker.key")}
        pem |= {name: (work / name).read_text() for name in ("client.pem", "client.key")}
    write_private(directory / "ca.key", pem["ca.key"])
    write_private(directory / _BROKER_KEYSTORE, pem["broker.key"] + pem["broker.pem"] + pem["ca.pem"])
    write_private(directory / "client.key", pem["client.key"])
    write_private(directory / "client-keystore.pem", pem["client.key"] + pem["client.pem"] + pem["ca.pem"])
    (directory / "client.pem").write_text(pem["client.pem"])
    (directory / "ca.pem").write_text(pem["ca.pem"])


def load_secured(directory: Path, sasl_ssl_port: int, ssl_port: int) -> SecuredListener:
    credentials = directory / CREDENTIALS
    try:
        users = json.loads(credentials.read_text())
    except FileNotFoundError as exc:
        raise StackError(
            f"the secured listeners' users and passwords ({credentials}) are gone, and the SCRAM users formatted "
            f"into the broker's metadata cannot be recovered: {preview_first('stack reset')}, then "
            f"`{COMMAND} stack start --secured` makes a new stack (its topics and records are deleted)."
        ) from exc
    return SecuredListener(
        sasl_ssl_bootstrap_servers=f"127.0.0.1:{sasl_ssl_port}",
        ssl_bootstrap_servers=f"127.0.0.1:{ssl_port}",
        ca_pem=directory / "ca.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        client_keystore_pem=directory / "client-keystore.pem",
        scram=SaslUser(**users[SCRAM_MECHANISM]),
        plain=SaslUser(**users["PLAIN"]),
    )


def prepare_secured(work_dir: Path, sasl_ssl_port: int, ssl_port: int) -> SecuredListener:
    """Make what the secured listeners lack: certificates when any file is missing, users with random
    passwords (0600) before the storage is formatted. A restart finds and keeps them all."""
    directory = work_dir / SECURED_DIR
    directory.mkdir(mode=0o700, exist_ok=True)
    if not all((directory / name).exists() for name in _TLS_FILES):
        _make_certificates(directory)
    credentials = directory / CREDENTIALS
    if not credentials.exists() and not (work_dir / "logs" / "meta.properties").exists():
        users = {
            SCRAM_MECHANISM: SaslUser("kafka2pg_scram", secrets.token_urlsafe(24)),
            "PLAIN": SaslUser("kafka2pg_plain", secrets.token_urlsafe(24)),
        }
        write_private(credentials, json.dumps({m: asdict(u) for m, u in users.items()}, indent=2))
    return load_secured(directory, sasl_ssl_port, ssl_port)


def scram_credential(user: SaslUser) -> str:
    """StorageTool's --add-scram value for `user`, salted and hashed here (RFC 5802's SaltedPassword)
    so that the password itself is on no command line."""
    salt = secrets.token_bytes(32)
    salted = hashlib.pbkdf2_hmac("sha512", user.password.encode(), salt, _SCRAM_ITERATIONS)
    return (
        f"{SCRAM_MECHANISM}=[name={user.name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{base64.b64encode(salt).decode()}",saltedpassword="{base64.b64encode(salted).decode()}"]'
    )
