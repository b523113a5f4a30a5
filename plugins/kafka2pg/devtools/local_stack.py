"""The local embedded stack: a real Apache Kafka broker (KRaft) and a throwaway PostgreSQL.

Kafka runs from Maven Central jars cached under .cache/jars (kafka2pg.jars, devtools.broker);
PostgreSQL from Debian's binaries (devtools.postgres). Both bind 127.0.0.1 on free ports and are
stopped by the PIDs recorded here, never by name. A recorded stack keeps its ports and data:
starting it again restarts only what is down; only `reset_stack` deletes data. On request
(`secured=True`) the broker also opens the listeners of devtools.secured_listeners.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from kafka2pg.devtools.broker import KafkaProcess, start_kafka, start_recorded_kafka
from kafka2pg.devtools.postgres import PostgresProcess, start_postgres, start_recorded_postgres, stop_postgres
from kafka2pg.devtools.processes import stop_pid
from kafka2pg.devtools.secured_listeners import CREDENTIALS, unsecured_error
from kafka2pg.files import write_whole
from kafka2pg.locations import default_state_dir

DEFAULT_CACHE = default_state_dir()


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


def stack_dir(cache: Path = DEFAULT_CACHE) -> Path:
    return cache / "stack"


def start_stack(work_dir: Path, cache: Path = DEFAULT_CACHE, *, secured: bool = False) -> Stack:
    """Start a new Kafka and PostgreSQL under `work_dir`; stop whatever started if the other fails.
    `secured`: the broker also opens the listeners `stack.kafka.secured_listener()` describes."""
    kafka = start_kafka(work_dir / "kafka", cache, secured=secured)
    try:
        postgres = start_postgres(work_dir)
    except BaseException:  # a failure or Ctrl-C: the broker runs in a session of its own
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
        f"{directory / CREDENTIALS} (readable by its owner only)"
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
        raise unsecured_error(f"the local stack in {stack_dir(cache)}")
    stack, done = Stack(recorded.kafka, recorded.postgres), []
    if stack.kafka.running():
        done.append(f"kafka: running at {stack.kafka.bootstrap_servers}, pid {stack.kafka.pid}: left alone")
    else:
        stack.kafka = start_recorded_kafka(stack.kafka, cache)
        save_stack(stack, cache)  # at once: a failure below must not lose the new PID
        done.append(
            f"kafka: was down (pid {recorded.kafka.pid}); restarted at {stack.kafka.bootstrap_servers} with its "
            f"data in {stack.kafka.data_dir}, pid {stack.kafka.pid}"
        )
    done += _secured_lines(stack.kafka)
    if stack.postgres.running():
        done.append(f"postgres: running at 127.0.0.1:{stack.postgres.port}, pid {stack.postgres.pid}: left alone")
    else:
        stack.postgres, ended = start_recorded_postgres(stack.postgres)
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
    write_whole(directory / "state.json", json.dumps(asdict(stack), indent=2))
    env_file = directory / "stack.env"
    write_whole(env_file, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in stack.env().items()))
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
