"""The local Kafka broker: one KRaft node (broker and controller) from the Maven Central jars, on
free 127.0.0.1 ports, formatted once; a restart keeps its ports, data and listeners.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kafka2pg.devtools.processes import alive, ensure_port_free, free_ports, runs, stop_pid, tail, wait_for_exit
from kafka2pg.devtools.secured_listeners import (
    SECURED_DIR,
    SecuredListener,
    load_secured,
    prepare_secured,
    scram_credential,
    secured_properties,
    unsecured_error,
    write_private,
)
from kafka2pg.exceptions import StackError
from kafka2pg.jars import DEFAULT_CACHE, resolve_jars
from kafka2pg.locations import COMMAND, preview_first

log = logging.getLogger(__name__)


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
        return runs(self.pid, str(Path(self.data_dir) / "server.properties"))

    def secured_listener(self) -> SecuredListener:
        """The secured listeners' addresses, files and users (passwords read from their 0600 file)."""
        if self.sasl_ssl_port is None or self.ssl_port is None:
            raise unsecured_error(f"the Kafka broker of {self.data_dir}")
        return load_secured(Path(self.data_dir) / SECURED_DIR, self.sasl_ssl_port, self.ssl_port)


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
            *(secured_properties(secured) if secured is not None else []),
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
            raise unsecured_error(f"the Kafka broker of {work_dir}")
        for number in ports.values():
            ensure_port_free(number, f"the Kafka broker of {work_dir}")
    else:
        names = ["port", "controller_port", *(["sasl_ssl_port", "ssl_port"] if secured else [])]
        ports = dict(zip(names, free_ports(len(names)), strict=True))
        state_file.write_text(json.dumps(ports))
    formatted = (work_dir / "logs" / "meta.properties").exists()
    listener = prepare_secured(work_dir, ports["sasl_ssl_port"], ports["ssl_port"]) if "ssl_port" in ports else None
    write_private(props_file, _kafka_properties(ports["port"], ports["controller_port"], work_dir, listener))
    (work_dir / "log4j2.properties").write_text(_LOG4J2)
    # Its temporary files (a compression codec's native library) in the broker's folder: a broker
    # killed outright cannot delete them, and /tmp would keep them.
    (work_dir / "tmp").mkdir(exist_ok=True)
    java = [
        shutil.which("java") or "java",
        "-Xms256m",
        "-Xmx1g",
        "-XX:+UseG1GC",
        f"-Djava.io.tmpdir={work_dir / 'tmp'}",
        f"-Dlog4j2.configurationFile={work_dir / 'log4j2.properties'}",
        "-cp",
        f"{jars}/*",
    ]
    if not formatted:
        credential = scram_credential(listener.scram) if listener is not None else ""
        format_args = ["kafka.tools.StorageTool", "format", "-t", new_cluster_id(), "-c", str(props_file)]
        # The salted password logs a client in as the user: in a file only its owner reads (java's
        # @argfile), never on a command line `ps` shows.
        arguments = work_dir / "format.args"
        write_private(arguments, _argfile([*format_args, *(["--add-scram", credential] if credential else [])]))
        try:
            done = subprocess.run([*java, f"@{arguments}"], capture_output=True, text=True, check=False)
        finally:
            arguments.unlink()
        if done.returncode != 0:
            output = f"{done.stdout}\n{done.stderr}"
            if credential:
                output = output.replace(credential, "<the SCRAM credential>")
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
    try:
        _wait_for_kafka(kafka, timeout_s)
    except BaseException:  # a broker that never came up, or Ctrl-C meanwhile: its own session, so stop it
        stop_pid(kafka.pid)
        raise
    return kafka


def _argfile(arguments: list[str]) -> str:
    """`arguments` as a java @argfile: one per line, each in single quotes (which keep a SCRAM
    credential's double quotes and a path's spaces), `\\` and `'` escaped as the launcher reads them."""
    return "".join("'" + a.replace("\\", "\\\\").replace("'", "\\'") + "'\n" for a in arguments)


def _wait_for_kafka(kafka: KafkaProcess, timeout_s: float) -> None:
    from confluent_kafka.admin import AdminClient

    from kafka2pg.kafka_offsets import client_config

    deadline = time.monotonic() + timeout_s
    admin = AdminClient(client_config(kafka.bootstrap_servers, 2))
    while time.monotonic() < deadline:
        if not alive(kafka.pid):
            raise StackError(f"Kafka broker exited during start-up; log {kafka.log_file}:\n{tail(kafka.log_file)}")
        try:
            metadata = admin.list_topics(timeout=2)
            if metadata.brokers:
                return
        except Exception as exc:  # noqa: BLE001 - any client error means "not ready yet"; we retry until the deadline
            log.debug("Kafka not ready yet: %s", exc)
        time.sleep(0.5)
    stop_pid(kafka.pid)
    raise StackError(f"Kafka broker not ready within {timeout_s:.0f}s; log {kafka.log_file}:\n{tail(kafka.log_file)}")


def restart_kafka(kafka: KafkaProcess, cache: Path = DEFAULT_CACHE) -> KafkaProcess:
    """Stop the broker (SIGTERM: controlled shutdown) and start it again with the same ports and data."""
    stop_pid(kafka.pid)
    return start_kafka(Path(kafka.data_dir), cache)


def start_recorded_kafka(kafka: KafkaProcess, cache: Path) -> KafkaProcess:
    """Start a stopped broker on its recorded ports and data; never a new, empty one."""
    if not (Path(kafka.data_dir) / "logs" / "meta.properties").exists():
        raise StackError(
            f"the Kafka broker's data recorded in {kafka.data_dir} is gone (no logs/meta.properties): nothing "
            f"was started. {preview_first('stack reset')} forgets this stack (and deletes what is left of it); "
            f"`{COMMAND} stack start` then starts a new, empty one."
        )
    wait_for_exit(kafka.pid, f"the Kafka broker of {kafka.data_dir}")
    return start_kafka(Path(kafka.data_dir), cache)
