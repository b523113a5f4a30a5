"""The local embedded stack: a real Apache Kafka broker (KRaft) and a throwaway PostgreSQL.

Kafka runs from Maven Central jars cached under .cache/jars; PostgreSQL from Debian's binaries
(initdb as the `postgres` user when we are root). Both bind 127.0.0.1 on free ports and are
stopped by the PIDs this module recorded, never by name. A recorded stack keeps its ports and
data: starting it again restarts only what is down; only `reset_stack` deletes data.
On request (`secured=True`) the broker also listens with SASL_SSL (SCRAM-SHA-512, PLAIN) and with
SSL requiring a client certificate (mTLS), with a CA, certificates and passwords made at its first start.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kafka2pg.exceptions import StackError
from kafka2pg.locations import default_state_dir

log = logging.getLogger(__name__)

MAVEN_DIR = Path(__file__).resolve().parent / "maven"
DEFAULT_CACHE = default_state_dir()


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


@dataclass
class KafkaProcess:
    pid: int
    port: int
    controller_port: int
    data_dir: str
    log_file: str
    sasl_ssl_port: int | None = None  # both set when started with secured=True
    ssl_port: int | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def running(self) -> bool:
        """True when the recorded PID is this broker (after a reboot it may be another program's)."""
        return _runs(self.pid, str(Path(self.data_dir) / "server.properties"))

    def secured_listener(self) -> SecuredListener:
        """The secured listeners' addresses, files and users (passwords read from their 0600 file)."""
        if self.sasl_ssl_port is None or self.ssl_port is None:
            raise _unsecured(f"the Kafka broker of {self.data_dir}")
        return _load_secured(Path(self.data_dir) / SECURED_DIR, self.sasl_ssl_port, self.ssl_port)


@dataclass
class PostgresProcess:
    pid: int
    port: int
    data_dir: str
    log_file: str
    bin_dir: str

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/kafka2pg"

    def connection(self) -> dict:
        """The cluster as an Airflow postgres connection (JSON form of AIRFLOW_CONN_*)."""
        return {
            "conn_type": "postgres",
            "host": "127.0.0.1",
            "port": self.port,
            "login": "postgres",
            "schema": "kafka2pg",
        }

    @property
    def cluster_dir(self) -> Path:
        """The folder start_postgres made: the data directory and the server log."""
        return Path(self.data_dir).parent

    def running(self) -> bool:
        """True when the recorded PID is this cluster's postmaster."""
        return _runs(self.pid, self.data_dir)


@dataclass
class Stack:
    kafka: KafkaProcess
    postgres: PostgresProcess

    def env(self) -> dict[str, str]:
        """The Airflow Connections of this stack (kafka2pg_postgres, kafka2pg_kafka) as AIRFLOW_CONN_*
        variables, and the KAFKA2PG_* fallback variables."""
        return {
            "AIRFLOW_CONN_KAFKA2PG_POSTGRES": json.dumps(self.postgres.connection()),
            "AIRFLOW_CONN_KAFKA2PG_KAFKA": json.dumps(
                {"conn_type": "kafka", "extra": {"bootstrap.servers": self.kafka.bootstrap_servers}}
            ),
            "KAFKA2PG_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
            "KAFKA2PG_DATABASE_URL": self.postgres.url,
        }


# ---------------------------------------------------------------- jars (Maven Central)


def jar_dir(cache: Path, name: str) -> Path:
    return cache / "jars" / name


def resolve_jars(cache: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """Resolve the Kafka broker and Spark Kafka source jars once; later calls are offline."""
    result = {}
    for name, pom in (("kafka", "kafka-broker.pom.xml"), ("spark", "spark-kafka.pom.xml")):
        target = jar_dir(cache, name)
        marker = target / ".complete"
        pom_path = MAVEN_DIR / pom
        if marker.exists() and marker.read_text() == pom_path.read_text():
            result[name] = target
            continue
        if shutil.which("mvn") is None:
            raise StackError("Maven (mvn) is not installed: `apt-get install maven`, or run ./kafka2pg setup")
        shutil.rmtree(target, ignore_errors=True)
        settings = os.environ.get("KAFKA2PG_MAVEN_SETTINGS", str(MAVEN_DIR / "settings.xml"))
        command = [
            "mvn",
            "-B",
            "-q",
            "-s",
            settings,
            "-f",
            str(pom_path),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={target}",
            "-DincludeScope=runtime",
        ]
        log.info("resolving %s jars from Maven Central into %s", name, target)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise StackError(f"Maven could not resolve {pom}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        marker.write_text(pom_path.read_text())
        result[name] = target
    return result


def spark_jars(cache: Path = DEFAULT_CACHE) -> list[Path]:
    """The Kafka source jars Spark lacks (those pyspark already ships are left out)."""
    import pyspark

    shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    jars = resolve_jars(cache)["spark"]
    return sorted(p for p in jars.glob("*.jar") if _artifact(p.name) not in shipped)


def _artifact(jar_name: str) -> str:
    stem = jar_name.removesuffix(".jar")
    parts = stem.split("-")
    while parts and parts[-1][:1].isdigit():
        parts.pop()
    return "-".join(parts)


# ---------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each stays bound until all are chosen."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def _runs(pid: int, needle: str) -> bool:
    """True when `pid` is alive and its command line holds `needle`: a recorded PID may belong to
    another program after a reboot, and must then be neither trusted nor signalled."""
    if not _alive(pid):
        return False
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc on this system: the PID is all we have


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, session, tty, tpgid, flags..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


_PF_KTHREAD = 0x00200000  # in /proc/PID/stat's flags: a kernel thread (no command line either)


def _exiting(pid: int) -> bool:
    """True while a killed `pid` is still torn down or a zombie: its command line is gone, but its
    PID (and, for a moment, its listening sockets) are not."""
    try:
        flags = int(_proc_stat(pid)[6])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not cmdline and not flags & _PF_KTHREAD


def _wait_for_exit(pid: int, what: str, timeout_s: float = 30) -> None:
    """Before restarting a killed process on its port and data: wait until it is fully gone. Its
    sockets hold the port until then, and PostgreSQL takes a zombie postmaster's PID, still in
    postmaster.pid, for a running server (the zombie's parent, often init, reaps it soon)."""
    deadline = time.monotonic() + timeout_s
    while _exiting(pid):
        if not _alive(pid):  # our own child, reaped by this call
            return
        if time.monotonic() > deadline:
            raise StackError(
                f"{what} (pid {pid}) was killed but is not gone after {timeout_s:.0f}s (a zombie its parent "
                "has not reaped?): it may still hold the port and data. Run `./kafka2pg stack start` again later."
            )
        time.sleep(0.1)


def _ensure_port_free(port: int, what: str) -> None:
    """Refuse to restart `what` when another process listens on its recorded port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers do: connections of the old process in TIME_WAIT do not hold the port.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(
                f"{what} must listen on its recorded port 127.0.0.1:{port}, but another process holds it "
                f"({exc.strerror}). Stop that process (`ss -ltnp 'sport = :{port}'` names it), then run "
                "`./kafka2pg stack start` again; the stack's data is kept."
            ) from exc


def _tail(path: str, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _give_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


# ---------------------------------------------------------------- Kafka


def _kafka_properties(port: int, controller_port: int, data_dir: Path, secured: SecuredListener | None = None) -> str:
    listeners, protocols = [f"PLAINTEXT://127.0.0.1:{port}"], ["PLAINTEXT:PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    if secured is not None:
        listeners += [f"SASL_SSL://{secured.sasl_ssl_bootstrap_servers}", f"SSL://{secured.ssl_bootstrap_servers}"]
        protocols += ["SASL_SSL:SASL_SSL", "SSL:SSL"]
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
            f"listeners={','.join(listeners)},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners={','.join(listeners)}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            f"listener.security.protocol.map={','.join(protocols)}",
            f"log.dirs={data_dir / 'logs'}",
            "num.partitions=1",
            "auto.create.topics.enable=false",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=3",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=3",
            "group.initial.rebalance.delay.ms=0",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "log.cleaner.backoff.ms=1000",
            *(_secured_properties(secured) if secured is not None else []),
            "",
        ]
    )


# ---------------------------------------------------------------- Kafka: secured listeners

SECURED_DIR = "secured"  # under the broker's data dir: CA, certificates, keys, users and passwords
SCRAM_MECHANISM = "SCRAM-SHA-512"
_SCRAM_ITERATIONS = 8192
_CERT_DAYS = "3650"  # a stack keeps its certificates across restarts: they must outlive its data
_CREDENTIALS = "credentials.json"
_BROKER_KEYSTORE = "broker-keystore.pem"
# Made together: when one is missing, all are made anew (clients then need the new ca.pem).
_TLS_FILES = ("ca.pem", "ca.key", _BROKER_KEYSTORE, "client.pem", "client.key", "client-keystore.pem")


def _secured_properties(secured: SecuredListener) -> list[str]:
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


def _unsecured(what: str) -> StackError:
    return StackError(
        f"{what} was started without secured listeners, and a recorded stack keeps the listeners it started "
        "with: nothing was started or changed. For secured listeners: `./kafka2pg stack reset --confirm` "
        "(deletes the stack's data), then `./kafka2pg stack start --secured` (in code: "
        "start_stack(..., secured=True))."
    )


def _write_private(path: Path, text: str) -> None:
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
    _write_private(directory / "ca.key", pem["ca.key"])
    _write_private(directory / _BROKER_KEYSTORE, pem["broker.key"] + pem["broker.pem"] + pem["ca.pem"])
    _write_private(directory / "client.key", pem["client.key"])
    _write_private(directory / "client-keystore.pem", pem["client.key"] + pem["client.pem"] + pem["ca.pem"])
    (directory / "client.pem").write_text(pem["client.pem"])
    (directory / "ca.pem").write_text(pem["ca.pem"])


def _load_secured(directory: Path, sasl_ssl_port: int, ssl_port: int) -> SecuredListener:
    credentials = directory / _CREDENTIALS
    try:
        users = json.loads(credentials.read_text())
    except FileNotFoundError as exc:
        raise StackError(
            f"the secured listeners' users and passwords ({credentials}) are gone, and the SCRAM users formatted "
            "into the broker's metadata cannot be recovered: `./kafka2pg stack reset --confirm`, then "
            "`./kafka2pg stack start --secured` makes a new stack (its topics and records are deleted)."
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


def _prepare_secured(work_dir: Path, sasl_ssl_port: int, ssl_port: int) -> SecuredListener:
    """Make what the secured listeners lack: certificates when any file is missing, users with random
    passwords (0600) before the storage is formatted. A restart finds and keeps them all."""
    directory = work_dir / SECURED_DIR
    directory.mkdir(mode=0o700, exist_ok=True)
    if not all((directory / name).exists() for name in _TLS_FILES):
        _make_certificates(directory)
    credentials = directory / _CREDENTIALS
    if not credentials.exists() and not (work_dir / "logs" / "meta.properties").exists():
        users = {
            SCRAM_MECHANISM: SaslUser("kafka2pg_scram", secrets.token_urlsafe(24)),
            "PLAIN": SaslUser("kafka2pg_plain", secrets.token_urlsafe(24)),
        }
        _write_private(credentials, json.dumps({m: asdict(u) for m, u in users.items()}, indent=2))
    return _load_secured(directory, sasl_ssl_port, ssl_port)


def _scram_credential(user: SaslUser) -> str:
    """StorageTool's --add-scram value for `user`, salted and hashed here (RFC 5802's SaltedPassword)
    so that the password itself is on no command line."""
    salt = secrets.token_bytes(32)
    salted = hashlib.pbkdf2_hmac("sha512", user.password.encode(), salt, _SCRAM_ITERATIONS)
    return (
        f"{SCRAM_MECHANISM}=[name={user.name},iterations={_SCRAM_ITERATIONS},"
        f'salt="{base64.b64encode(salt).decode()}",saltedpassword="{base64.b64encode(salted).decode()}"]'
    )


_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.kafkaorg.name = org.apache.kafka
logger.kafkaorg.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def new_cluster_id() -> str:
    """A random KRaft cluster id (22 URL-safe base64 characters) that never starts with "-": one
    in 64 does, and StorageTool's parser then reads `-t -xyz…` as a missing id and an unknown
    option (a broker start failed so). Kafka's own `Uuid.randomUuid()` draws again in that case too."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def start_kafka(
    work_dir: Path, cache: Path = DEFAULT_CACHE, timeout_s: float = 90, *, secured: bool = False
) -> KafkaProcess:
    """Format (once) and start a single-node KRaft broker; wait until it answers. `secured`: also open
    the listeners SecuredListener describes. A broker started before keeps its ports, data and
    listeners (secured ones too, with the same certificates and users), whatever `secured` says."""
    jars = resolve_jars(cache)["kafka"]
    work_dir.mkdir(parents=True, exist_ok=True)
    props_file = work_dir / "server.properties"
    state_file = work_dir / "ports.json"
    if state_file.exists():  # a restart keeps ports and data
        ports = json.loads(state_file.read_text())
        if secured and "sasl_ssl_port" not in ports:
            raise _unsecured(f"the Kafka broker of {work_dir}")
        for number in ports.values():
            _ensure_port_free(number, f"the Kafka broker of {work_dir}")
    else:
        names = ["port", "controller_port", *(["sasl_ssl_port", "ssl_port"] if secured else [])]
        ports = dict(zip(names, _free_ports(len(names)), strict=True))
        state_file.write_text(json.dumps(ports))
    formatted = (work_dir / "logs" / "meta.properties").exists()
    listener = _prepare_secured(work_dir, ports["sasl_ssl_port"], ports["ssl_port"]) if "ssl_port" in ports else None
    _write_private(props_file, _kafka_properties(ports["port"], ports["controller_port"], work_dir, listener))
    (work_dir / "log4j2.properties").write_text(_LOG4J2)
    java = [
        shutil.which("java") or "java",
        "-Xms256m",
        "-Xmx1g",
        "-XX:+UseG1GC",
        f"-Dlog4j2.configurationFile={work_dir / 'log4j2.properties'}",
        "-cp",
        f"{jars}/*",
    ]
    if not formatted:
        scram = ["--add-scram", _scram_credential(listener.scram)] if listener is not None else []
        done = subprocess.run(
            [*java, "kafka.tools.StorageTool", "format", "-t", new_cluster_id(), "-c", str(props_file), *scram],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            output = f"{done.stdout}\n{done.stderr}"
            if scram:
                output = output.replace(scram[1], "<the SCRAM credential>")
            raise StackError(f"Kafka storage format failed:\n{output}")
    log_file = work_dir / "kafka.log"
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            [*java, "kafka.Kafka", str(props_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    kafka = KafkaProcess(
        process.pid,
        ports["port"],
        ports["controller_port"],
        str(work_dir),
        str(log_file),
        ports.get("sasl_ssl_port"),
        ports.get("ssl_port"),
    )
    _wait_for_kafka(kafka, timeout_s)
    return kafka


def _wait_for_kafka(kafka: KafkaProcess, timeout_s: float) -> None:
    from confluent_kafka.admin import AdminClient

    from kafka2pg.kafka_offsets import client_config

    deadline = time.monotonic() + timeout_s
    admin = AdminClient(client_config(kafka.bootstrap_servers, 2))
    while time.monotonic() < deadline:
        if not _alive(kafka.pid):
            raise StackError(f"Kafka broker exited during start-up; log {kafka.log_file}:\n{_tail(kafka.log_file)}")
        try:
            metadata = admin.list_topics(timeout=2)
            if metadata.brokers:
                return
        except Exception as exc:  # noqa: BLE001 - any client error means "not ready yet"; we retry until the deadline
            log.debug("Kafka not ready yet: %s", exc)
        time.sleep(0.5)
    stop_pid(kafka.pid)
    raise StackError(f"Kafka broker not ready within {timeout_s:.0f}s; log {kafka.log_file}:\n{_tail(kafka.log_file)}")


def stop_pid(pid: int, timeout_s: float = 30) -> None:
    """SIGTERM, wait, then SIGKILL one process we started."""
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.1)


# ---------------------------------------------------------------- PostgreSQL


def postgres_bin_dir() -> Path:
    explicit = os.environ.get("KAFKA2PG_PG_BINDIR")
    candidates = (
        [Path(explicit)]
        if explicit
        else sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        )
    )
    for candidate in reversed(candidates):
        if (candidate / "initdb").exists():
            return candidate
    raise StackError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql: "
        "`apt-get install postgresql`, or set KAFKA2PG_PG_BINDIR"
    )


def _new_cluster_dir(work_dir: Path) -> Path:
    """Where a new cluster and its log live: `work_dir/postgres` when the `postgres` user can write
    there, else a temp folder (a root-only parent such as pytest's tmp dir is out of its reach)."""
    base = work_dir / "postgres"
    if base.exists():
        raise StackError(
            f"{base} already exists (a cluster no recorded stack names?): nothing was started. "
            "`./kafka2pg stack reset` shows what it would delete, `./kafka2pg stack reset --confirm` "
            "deletes it; or move the folder away."
        )
    base.mkdir(parents=True)
    _give_to_postgres(base)
    reachable = subprocess.run([*_as_postgres(), "test", "-w", str(base)], check=False).returncode == 0
    if reachable:
        return base
    base.rmdir()
    base = Path(tempfile.mkdtemp(prefix="kafka2pg-pg-"))
    base.chmod(0o755)
    _give_to_postgres(base)
    return base


def start_postgres(work_dir: Path, timeout_s: float = 60) -> PostgresProcess:
    """initdb a new cluster (see _new_cluster_dir) and start it on a free 127.0.0.1 port;
    `work_dir/logs/postgres.log` links to its log."""
    bin_dir = postgres_bin_dir()
    base = _new_cluster_dir(work_dir)
    log_dir = work_dir / "logs"
    data_dir = base / "data"
    data_dir.mkdir()
    log_file = base / "postgres.log"
    log_file.touch()
    for path in (data_dir, log_file):
        _give_to_postgres(path)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "postgres.log").unlink(missing_ok=True)
    (log_dir / "postgres.log").symlink_to(log_file)
    done = subprocess.run(
        [
            *_as_postgres(),
            str(bin_dir / "initdb"),
            "-D",
            str(data_dir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise StackError(f"initdb failed:\n{done.stdout}\n{done.stderr}")
    port = free_port()
    pid = _pg_ctl_start(bin_dir, data_dir, log_file, port, timeout_s)
    subprocess.run(
        [
            str(bin_dir / "psql") if (bin_dir / "psql").exists() else "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-q",
            "-c",
            "CREATE DATABASE kafka2pg",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return PostgresProcess(pid, port, str(data_dir), str(log_file), str(bin_dir))


def _pg_ctl_start(bin_dir: Path, data_dir: Path, log_file: Path, port: int, timeout_s: float) -> int:
    # fsync off (a throwaway cluster need not survive an OS crash) but synchronous_commit ON: a
    # commit is in the WAL before it returns, so a PostgreSQL crash (`restart -m immediate` in the
    # fault suite) never loses a committed transaction, as on a real server.
    options = (
        f"-p {port} -k {data_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=on -c full_page_writes=off -c max_connections=200 "
        "-c shared_buffers=256MB -c max_wal_size=4GB"
    )
    done = subprocess.run(
        [
            *_as_postgres(),
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data_dir),
            "-l",
            str(log_file),
            "-o",
            options,
            "-w",
            "-t",
            str(int(timeout_s)),
            "start",
        ],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise StackError(f"PostgreSQL did not start:\n{done.stdout}\n{done.stderr}\n{_tail(str(log_file))}")
    return int((data_dir / "postmaster.pid").read_text().splitlines()[0])


def restart_postgres(pg: PostgresProcess, *, mode: str = "fast", timeout_s: float = 60) -> PostgresProcess:
    """Stop the cluster (`fast`: clean shutdown; `immediate`: a crash, recovery on start) and start it
    again on the same port and data; open connections are cut. Used by fault-injection tests."""
    bin_dir, data_dir = Path(pg.bin_dir), Path(pg.data_dir)
    subprocess.run(
        [*_as_postgres(), str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", mode, "-w", "stop"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = _pg_ctl_start(bin_dir, data_dir, Path(pg.log_file), pg.port, timeout_s)
    return PostgresProcess(pid, pg.port, pg.data_dir, pg.log_file, pg.bin_dir)


def restart_kafka(kafka: KafkaProcess, cache: Path = DEFAULT_CACHE) -> KafkaProcess:
    """Stop the broker (SIGTERM: controlled shutdown) and start it again with the same ports and data."""
    stop_pid(kafka.pid)
    return start_kafka(Path(kafka.data_dir), cache)


def stop_postgres(pg: PostgresProcess) -> None:
    """Stop the cluster (a clean shutdown); its data stays."""
    if not pg.running():
        return
    if Path(pg.data_dir).exists():
        subprocess.run(
            [*_as_postgres(), str(Path(pg.bin_dir) / "pg_ctl"), "-D", pg.data_dir, "-m", "fast", "-w", "stop"],
            capture_output=True,
            text=True,
            check=False,
        )
    stop_pid(pg.pid)


def _start_recorded_kafka(kafka: KafkaProcess, cache: Path) -> KafkaProcess:
    """Start a stopped broker on its recorded ports and data; never a new, empty one."""
    if not (Path(kafka.data_dir) / "logs" / "meta.properties").exists():
        raise StackError(
            f"the Kafka broker's data recorded in {kafka.data_dir} is gone (no logs/meta.properties): nothing "
            "was started. `./kafka2pg stack reset --confirm` forgets this stack (and deletes what is left of "
            "it); `./kafka2pg stack start` then starts a new, empty one."
        )
    _wait_for_exit(kafka.pid, f"the Kafka broker of {kafka.data_dir}")
    return start_kafka(Path(kafka.data_dir), cache)


def _orphans(data_dir: str) -> list[int]:
    """Server processes a killed postmaster left running: their working directory is its data
    directory and their parent is no postmaster of it. They hold its shared memory, and a new
    postmaster refuses to start beside them ("pre-existing shared memory block is still in use")."""
    cwd, found = str(Path(data_dir).resolve()), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "cwd") != cwd or not (proc / "cmdline").read_bytes().startswith(b"postgres: "):
                continue
            parent = int(_proc_stat(int(proc.name))[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if not _runs(parent, data_dir):
            found.append(int(proc.name))
    return found


def _end_orphans(data_dir: str, grace_s: float = 5) -> list[int]:
    """Give a killed postmaster's leftover server processes `grace_s` to notice and exit (they do
    when they next wait), then stop those still running (one stuck in a long query); their PIDs."""
    deadline = time.monotonic() + grace_s
    while (left := _orphans(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        stop_pid(pid)
    return left


def _start_recorded_postgres(pg: PostgresProcess, timeout_s: float = 60) -> tuple[PostgresProcess, list[int]]:
    """Start a stopped (or killed) cluster on its recorded port and data directory; also return the
    PIDs of server processes a killed postmaster had left running, which had to be stopped first.
    The stale postmaster.pid a killed postmaster leaves is the new one's to take over."""
    data_dir = Path(pg.data_dir)
    if not (data_dir / "PG_VERSION").exists():
        raise StackError(
            f"the PostgreSQL data directory recorded in {data_dir} is gone: nothing was started. "
            "`./kafka2pg stack reset --confirm` forgets this stack (and deletes what is left of it); "
            "`./kafka2pg stack start` then starts a new, empty one."
        )
    _wait_for_exit(pg.pid, f"the postmaster of {data_dir}")
    ended = _end_orphans(pg.data_dir)
    _ensure_port_free(pg.port, f"PostgreSQL of {data_dir}")
    pid = _pg_ctl_start(Path(pg.bin_dir), data_dir, Path(pg.log_file), pg.port, timeout_s)
    return PostgresProcess(pid, pg.port, pg.data_dir, pg.log_file, pg.bin_dir), ended


# ---------------------------------------------------------------- the whole stack


def stack_dir(cache: Path = DEFAULT_CACHE) -> Path:
    return cache / "stack"


def start_stack(work_dir: Path, cache: Path = DEFAULT_CACHE, *, secured: bool = False) -> Stack:
    """Start a new Kafka and PostgreSQL under `work_dir`; stop whatever started if the other fails.
    `secured`: the broker also opens the listeners `stack.kafka.secured_listener()` describes."""
    kafka = start_kafka(work_dir / "kafka", cache, secured=secured)
    try:
        postgres = start_postgres(work_dir)
    except StackError:
        stop_pid(kafka.pid)
        raise
    return Stack(kafka, postgres)


def stop_stack(stack: Stack) -> None:
    """Stop both processes; their data stays for a later start (`start_or_resume`)."""
    if stack.kafka.running():
        stop_pid(stack.kafka.pid)
    stop_postgres(stack.postgres)


def stack_data(stack: Stack) -> list[Path]:
    """The folders holding the stack's data: the broker's (topics, records) and the cluster's."""
    return [Path(stack.kafka.data_dir), stack.postgres.cluster_dir]


def discard_stack(stack: Stack) -> None:
    """Stop a throwaway stack (a test session's, a benchmark's) and delete its data."""
    stop_stack(stack)
    for path in stack_data(stack):
        shutil.rmtree(path, ignore_errors=True)


def _secured_lines(kafka: KafkaProcess) -> list[str]:
    """Where the secured listeners are and where their files lie; never a password."""
    if kafka.ssl_port is None:
        return []
    secured = kafka.secured_listener()
    directory = secured.ca_pem.parent
    return [
        f"kafka: SASL_SSL at {secured.sasl_ssl_bootstrap_servers} (SCRAM-SHA-512 user {secured.scram.name}, "
        f"PLAIN user {secured.plain.name}), SSL requiring a client certificate at {secured.ssl_bootstrap_servers}; "
        f"CA {secured.ca_pem}, client certificate and key in {directory}, passwords in "
        f"{directory / _CREDENTIALS} (readable by its owner only)"
    ]


def start_or_resume(cache: Path = DEFAULT_CACHE, *, secured: bool = False) -> tuple[Stack, list[str]]:
    """`stack start`: with no stack recorded, start a new one (`secured`: with the secured listeners);
    otherwise start only the parts that are down, on their recorded ports, data and listeners. Never
    deletes anything. Returns the stack (recorded) and one line per part saying what was done."""
    recorded = load_stack(cache)
    if recorded is None:
        stack = start_stack(stack_dir(cache), cache, secured=secured)
        save_stack(stack, cache)
        return stack, [
            f"kafka: started a new broker at {stack.kafka.bootstrap_servers}, pid {stack.kafka.pid}, "
            f"data in {stack.kafka.data_dir}",
            *_secured_lines(stack.kafka),
            f"postgres: started a new cluster at 127.0.0.1:{stack.postgres.port}, pid {stack.postgres.pid}, "
            f"data in {stack.postgres.data_dir}",
        ]
    if secured and recorded.kafka.ssl_port is None:
        raise _unsecured(f"the local stack in {stack_dir(cache)}")
    stack, done = Stack(recorded.kafka, recorded.postgres), []
    if stack.kafka.running():
        done.append(f"kafka: running at {stack.kafka.bootstrap_servers}, pid {stack.kafka.pid}: left alone")
    else:
        stack.kafka = _start_recorded_kafka(stack.kafka, cache)
        save_stack(stack, cache)  # at once: a failure below must not lose the new PID
        done.append(
            f"kafka: was down (pid {recorded.kafka.pid}); restarted at {stack.kafka.bootstrap_servers} with its "
            f"data in {stack.kafka.data_dir}, pid {stack.kafka.pid}"
        )
    done += _secured_lines(stack.kafka)
    if stack.postgres.running():
        done.append(f"postgres: running at 127.0.0.1:{stack.postgres.port}, pid {stack.postgres.pid}: left alone")
    else:
        stack.postgres, ended = _start_recorded_postgres(stack.postgres)
        save_stack(stack, cache)
        leftovers = f" (first stopped {len(ended)} server process(es) it had left running: pids {ended})"
        done.append(
            f"postgres: was down (pid {recorded.postgres.pid}); restarted at 127.0.0.1:{stack.postgres.port} "
            f"with its data in {stack.postgres.data_dir}, pid {stack.postgres.pid}{leftovers if ended else ''}"
        )
    return stack, done


def save_stack(stack: Stack, cache: Path = DEFAULT_CACHE) -> Path:
    directory = stack_dir(cache)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state.json").write_text(json.dumps(asdict(stack), indent=2))
    env_file = directory / "stack.env"
    env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in stack.env().items()))
    return env_file


def load_stack(cache: Path = DEFAULT_CACHE) -> Stack | None:
    state = stack_dir(cache) / "state.json"
    if not state.exists():
        return None
    data = json.loads(state.read_text())
    return Stack(KafkaProcess(**data["kafka"]), PostgresProcess(**data["postgres"]))


def reset_targets(cache: Path = DEFAULT_CACHE) -> list[tuple[Path, str]]:
    """What `stack reset` deletes, the existing paths with what each holds: the recorded stack's
    data (wherever it lives) and the stack folder (record, logs, environment file)."""
    recorded = load_stack(cache)
    targets = []
    if recorded is not None:
        targets += [
            (Path(recorded.kafka.data_dir), "the Kafka broker's data: every topic and record"),
            (recorded.postgres.cluster_dir, "the PostgreSQL cluster: every database, table and row"),
        ]
    targets.append((stack_dir(cache), "the stack folder: its record, logs and environment file"))
    return [(path, what) for path, what in targets if path.exists()]


def reset_stack(cache: Path = DEFAULT_CACHE) -> list[tuple[Path, str]]:
    """Stop the recorded stack and delete everything `reset_targets` lists; returns what was deleted."""
    targets = reset_targets(cache)
    recorded = load_stack(cache)
    if recorded is not None:
        stop_stack(recorded)
    for path, _ in targets:
        shutil.rmtree(path, ignore_errors=True)
    return targets


def stack_status(stack: Stack) -> dict[str, str]:
    kafka = stack.kafka
    secured = f", SASL_SSL at 127.0.0.1:{kafka.sasl_ssl_port}, SSL (mTLS) at 127.0.0.1:{kafka.ssl_port}"
    return {
        "kafka": f"{'running' if kafka.running() else 'stopped'} pid {kafka.pid} at "
        f"{kafka.bootstrap_servers}{secured if kafka.ssl_port is not None else ''} (log {kafka.log_file})",
        "postgres": f"{'running' if stack.postgres.running() else 'stopped'} pid {stack.postgres.pid} at "
        f"127.0.0.1:{stack.postgres.port} (log {stack.postgres.log_file})",
    }
