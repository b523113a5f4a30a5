"""docker-compose.yaml is a valid compose file wired to the same configuration as the README."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_and_has_kafka_and_postgres():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.fail("docker-compose is missing: ./kafka2pg test installs Debian's docker-compose package")
    done = subprocess.run([compose, "-f", str(ROOT / "docker-compose.yaml"), "config"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["postgres"]["image"].startswith("postgres:15")
    header = (ROOT / "docker-compose.yaml").read_text()
    assert "KAFKA2PG_BOOTSTRAP_SERVERS=127.0.0.1:29092" in header
    assert "127.0.0.1:29092:29092" in str(services["kafka"]["ports"]) or any(
        str(p.get("published")) == "29092" for p in services["kafka"]["ports"] if isinstance(p, dict)
    )
