"""docker-compose.yaml: a valid compose file for the whole stack (Kafka, PostgreSQL, Airflow's components,
Spark master and worker), healthy before anything depends on it, built from the Dockerfile at the pinned
versions, wired to the package's connection ids, and described the same way by the README's section.

No Docker engine runs here: `docker-compose config` validates and resolves the file, nothing is built or
started."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kafka2pg.config import DEFAULT_KAFKA_CONN_ID, DEFAULT_POSTGRES_CONN_ID, load_pipelines
from kafka2pg.dag_factory import SPARK_CONN_ID

ROOT = Path(__file__).resolve().parents[2]
AIRFLOW = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
REQUIRED = {"kafka", "postgres", "airflow-init", *AIRFLOW, "spark-master", "spark-worker"}
ONE_OFF = {"airflow-init", "airflow-cli"}  # run to completion: no health check
CONN_PREFIX = "AIRFLOW_CONN_"


@pytest.fixture(scope="module")
def services() -> dict:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is missing: ./kafka2pg test installs Debian's docker-compose package")
    done = subprocess.run(
        [compose, "-f", str(ROOT / "docker-compose.yaml"), "config"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["services"]


def _pin(package: str) -> str:
    found = re.search(rf"^{re.escape(package)}(?:\[[^\]]*\])?==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert found, f"{package} is not pinned in requirements.txt"
    return found.group(1)


def _published(service: dict) -> set[str]:
    """The service's ports published on the host, as `ip:port` (docker-compose writes them either way)."""
    found = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            found.add(f"{port.get('host_ip', '0.0.0.0')}:{port['published']}")
        else:
            parts = str(port).split("/")[0].split(":")
            found.add(":".join(parts[:-1]) if len(parts) == 3 else f"0.0.0.0:{parts[0]}")
    return found


def _connections(service: dict) -> dict[str, dict]:
    env = service["environment"]
    return {k.removeprefix(CONN_PREFIX).lower(): json.loads(v) for k, v in env.items() if k.startswith(CONN_PREFIX)}


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"^## Docker Compose\b.*?$(.*?)(?=^## )", text, re.M | re.S)
    assert found, "README.md has no '## Docker Compose' section"
    return found.group(1)


def test_compose_file_is_valid_and_has_the_whole_stack(services):
    assert REQUIRED <= set(services), f"missing services: {sorted(REQUIRED - set(services))}"
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["postgres"]["image"].startswith("postgres:15")
    assert "127.0.0.1:29092" in _published(services["kafka"])
    header = (ROOT / "docker-compose.yaml").read_text()
    assert "KAFKA2PG_BOOTSTRAP_SERVERS=127.0.0.1:29092" in header
    # Every published port is on 127.0.0.1 only: the UI has no login, the databases local passwords.
    for name, service in services.items():
        assert all(p.startswith("127.0.0.1:") for p in _published(service)), f"{name} publishes beyond 127.0.0.1"


def test_every_long_running_service_has_a_health_check(services):
    for name, service in services.items():
        if name in ONE_OFF:
            assert "healthcheck" not in service, f"{name} exits when done: a health check would never pass"
            continue
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name} has no health check"


def test_nothing_starts_before_what_it_needs_is_healthy_or_done(services):
    for name, service in services.items():
        for needed, how in service.get("depends_on", {}).items():
            condition = how["condition"]
            assert condition in ("service_healthy", "service_completed_successfully"), (name, needed, condition)
            if condition == "service_healthy":
                assert "healthcheck" in services[needed], f"{name} waits for {needed} to be healthy: it has no check"
            else:
                assert needed in ONE_OFF, f"{name} waits for {needed} to exit, but it runs for good"
    init = services["airflow-init"]["depends_on"]
    assert init["airflow-postgres"]["condition"] == init["postgres"]["condition"] == "service_healthy"
    for name in (*AIRFLOW, "airflow-cli"):
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully", name
    assert services["spark-worker"]["depends_on"]["spark-master"]["condition"] == "service_healthy"


def test_airflow_and_the_spark_worker_run_the_image_of_the_dockerfile_at_the_pinned_versions(services):
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name in ("airflow-init", *AIRFLOW, "airflow-cli", "spark-worker"):
        build = services[name].get("build")
        assert build, f"{name} is not built from the Dockerfile"
        assert Path(build["context"]).resolve() == ROOT and build.get("dockerfile", "Dockerfile") == "Dockerfile"
    # The image's Airflow is requirements.txt's, and the pins constrain what pip installs.
    assert f"ARG AIRFLOW_VERSION={_pin('apache-airflow')}\n" in dockerfile
    assert re.search(r"^FROM apache/airflow:slim-\$\{AIRFLOW_VERSION\}-python3\.11$", dockerfile, re.M)
    assert "-c /tmp/kafka2pg/constraints.txt" in dockerfile and "requirements.txt" in dockerfile
    # The master is the official Spark image of pyspark's version: the worker and the driver run pyspark's.
    assert services["spark-master"]["image"] == f"apache/spark:{_pin('pyspark')}"
    # Spark's Kafka source is resolved into the image from the package's own POM, not at job start.
    assert "COPY plugins/kafka2pg/maven/spark-kafka.pom.xml" in dockerfile
    assert re.search(r"^ENV KAFKA2PG_SPARK_JARS=/opt/kafka2pg/jars/\*\.jar$", dockerfile, re.M)
    # What the Dockerfile copies is in the build context; the rest (.venv, .cache) is not.
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore
    for line in re.findall(r"^COPY (?!.*--from=)(?:--\S+ )*(.+) \S+$", dockerfile, re.M):
        for source in line.split():
            admitted = [source, *(str(parent) for parent in Path(source).parents if str(parent) != ".")]
            assert (ROOT / source).exists() and any(f"!{path}" in ignore for path in admitted), (
                f"COPY {source}: not in the build context"
            )


def test_connections_are_the_package_defaults_and_point_at_the_services(services):
    raw = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    common = raw["x-airflow-common"]["environment"]
    shared = services["airflow-scheduler"]["environment"]
    assert set(shared) == set(common)
    for name in ("airflow-init", *AIRFLOW, "airflow-cli"):
        assert services[name]["environment"] == shared, f"{name} does not share x-airflow-common's environment"
    connections = _connections(services["airflow-scheduler"])
    assert set(connections) == {DEFAULT_POSTGRES_CONN_ID, DEFAULT_KAFKA_CONN_ID, SPARK_CONN_ID}
    database, postgres = connections[DEFAULT_POSTGRES_CONN_ID], services["postgres"]["environment"]
    assert (database["conn_type"], database["host"], database["port"]) == ("postgres", "postgres", 5432)
    assert (database["login"], database["password"], database["schema"]) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    kafka = connections[DEFAULT_KAFKA_CONN_ID]
    assert kafka["conn_type"] == "kafka"
    assert f"PLAINTEXT://{kafka['extra']['bootstrap.servers']}" in services["kafka"]["environment"][
        "KAFKA_ADVERTISED_LISTENERS"
    ].split(",")
    spark = connections[SPARK_CONN_ID]
    master = services["spark-master"]["command"]
    assert spark["conn_type"] == "spark"
    assert spark["host"] == f"spark://{master[master.index('--host') + 1]}:{master[master.index('--port') + 1]}"
    assert spark["host"] in services["spark-worker"]["command"]
    metadata = services["airflow-scheduler"]["environment"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert "@airflow-postgres:5432/" in metadata and "airflow-postgres" in services


def test_readme_compose_section_and_the_file_agree(services):
    section = _readme_section()
    named = set()
    for cell in re.findall(r"^\| (`[\w-]+`(?:, `[\w-]+`)*) \|", section, re.M):
        named |= set(re.findall(r"`([\w-]+)`", cell))
    assert named == set(services), (
        f"README only: {sorted(named - set(services))}; file only: {sorted(set(services) - named)}"
    )
    published = set().union(*(_published(s) for s in services.values()))
    assert set(re.findall(r"`(127\.0\.0\.1:\d+)`", section)) == published
    connections = re.search(r"^Connections\b(.*?)(?:\n\n)", section, re.M | re.S)
    assert connections, "the README section has no 'Connections' paragraph"
    assert set(re.findall(r"`(kafka2pg_\w+)`", connections.group(1))) == set(
        _connections(services["airflow-scheduler"])
    )
    # The demo line: one `docker compose run` of a service of the file, the same line as the file's header,
    # producing to the topic of the pipeline whose DAG it runs.
    (run,) = re.findall(r"^docker compose run .*$", section, re.M)
    assert run in (ROOT / "docker-compose.yaml").read_text()
    service = re.search(r"docker compose run --rm ([\w-]+) ", run).group(1)
    assert service in services
    topic = re.search(r"kafka2pg produce --topic (\S+)", run).group(1)
    dag_id = re.search(r"airflow dags test (\S+)", run).group(1)
    pipelines = {p.dag_id: p for p in load_pipelines(ROOT / "dags" / "pipelines.yaml").values()}
    assert dag_id in pipelines and pipelines[dag_id].topic == topic
