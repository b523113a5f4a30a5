"""The local embedded stack: a real Apache Kafka broker (KRaft) and a throwaway PostgreSQL.

Kafka runs from Maven Central jars cached under .cache/jars; PostgreSQL from Debian's binaries
(initdb as the `postgres` user when we are root). Both bind 127.0.0.1 on free ports and are
stopped by the PIDs this module recorded, never by name.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from kafka2pg.config import PROJECT_ROOT
from kafka2pg.exceptions import StackError

log = logging.getLogger(__name__)

MAVEN_DIR = Path(__file__).resolve().parent / "maven"
DEFAULT_CACHE = PROJECT_ROOT / ".cache"


@dataclass
class KafkaProcess:
    pid: int
    port: int
    controller_port: int
    data_dir: str
    log_file: str

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


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


@dataclass
class Stack:
    kafka: KafkaProcess
    postgres: PostgresProcess

    def env(self) -> dict[str, str]:
        return {
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


def _kafka_properties(port: int, controller_port: int, data_dir: Path) -> str:
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
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
            "",
        ]
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


def start_kafka(work_dir: Path, cache: Path = DEFAULT_CACHE, timeout_s: float = 90) -> KafkaProcess:
    """Format (once) and start a single-node KRaft broker; wait until it answers."""
    jars = resolve_jars(cache)["kafka"]
    work_dir.mkdir(parents=True, exist_ok=True)
    props_file = work_dir / "server.properties"
    state_file = work_dir / "ports.json"
    if state_file.exists():  # a restart keeps ports and data
        ports = json.loads(state_file.read_text())
        port, controller_port = ports["port"], ports["controller_port"]
    else:
        port, controller_port = free_port(), free_port()
        state_file.write_text(json.dumps({"port": port, "controller_port": controller_port}))
    props_file.write_text(_kafka_properties(port, controller_port, work_dir))
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
    if not (work_dir / "logs" / "meta.properties").exists():
        cluster_id = new_cluster_id()
        done = subprocess.run(
            [*java, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props_file)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise StackError(f"Kafka storage format failed:\n{done.stdout}\n{done.stderr}")
    log_file = work_dir / "kafka.log"
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            [*java, "kafka.Kafka", str(props_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    kafka = KafkaProcess(process.pid, port, controller_port, str(work_dir), str(log_file))
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


def start_postgres(log_dir: Path, timeout_s: float = 60) -> PostgresProcess:
    """initdb a throwaway cluster in a temp folder and start it on a free 127.0.0.1 port."""
    bin_dir = postgres_bin_dir()
    # The cluster and its log live in a temp folder the `postgres` user can reach (a root-only
    # parent such as pytest's tmp dir is not); log_dir gets a symlink to the log.
    base = Path(tempfile.mkdtemp(prefix="kafka2pg-pg-"))
    base.chmod(0o755)
    data_dir = base / "data"
    data_dir.mkdir()
    log_file = base / "postgres.log"
    log_file.touch()
    for path in (base, data_dir, log_file):
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


def stop_postgres(pg: PostgresProcess, *, remove: bool = True) -> None:
    if _alive(pg.pid) and Path(pg.data_dir).exists():
        subprocess.run(
            [*_as_postgres(), str(Path(pg.bin_dir) / "pg_ctl"), "-D", pg.data_dir, "-m", "fast", "-w", "stop"],
            capture_output=True,
            text=True,
            check=False,
        )
    stop_pid(pg.pid)
    if remove:
        shutil.rmtree(Path(pg.data_dir).parent, ignore_errors=True)


# ---------------------------------------------------------------- the whole stack


def stack_dir(cache: Path = DEFAULT_CACHE) -> Path:
    return cache / "stack"


def start_stack(work_dir: Path, cache: Path = DEFAULT_CACHE) -> Stack:
    """Start Kafka and PostgreSQL under `work_dir`; stop whatever started if the other fails."""
    kafka = start_kafka(work_dir / "kafka", cache)
    try:
        postgres = start_postgres(work_dir / "logs")
    except StackError:
        stop_pid(kafka.pid)
        raise
    return Stack(kafka, postgres)


def stop_stack(stack: Stack) -> None:
    stop_pid(stack.kafka.pid)
    stop_postgres(stack.postgres)


def save_stack(stack: Stack, cache: Path = DEFAULT_CACHE) -> Path:
    directory = stack_dir(cache)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state.json").write_text(json.dumps(asdict(stack), indent=2))
    env_file = directory / "stack.env"
    env_file.write_text("".join(f"export {k}='{v}'\n" for k, v in stack.env().items()))
    return env_file


def load_stack(cache: Path = DEFAULT_CACHE) -> Stack | None:
    state = stack_dir(cache) / "state.json"
    if not state.exists():
        return None
    data = json.loads(state.read_text())
    return Stack(KafkaProcess(**data["kafka"]), PostgresProcess(**data["postgres"]))


def forget_stack(cache: Path = DEFAULT_CACHE) -> None:
    for name in ("state.json", "stack.env"):
        (stack_dir(cache) / name).unlink(missing_ok=True)
    shutil.rmtree(stack_dir(cache) / "kafka", ignore_errors=True)


def stack_status(stack: Stack) -> dict[str, str]:
    return {
        "kafka": f"{'running' if _alive(stack.kafka.pid) else 'stopped'} pid {stack.kafka.pid} at "
        f"{stack.kafka.bootstrap_servers} (log {stack.kafka.log_file})",
        "postgres": f"{'running' if _alive(stack.postgres.pid) else 'stopped'} pid {stack.postgres.pid} at "
        f"127.0.0.1:{stack.postgres.port} (log {stack.postgres.log_file})",
    }
