"""The DAG end to end against a secured Kafka (SASL_SSL with SCRAM, SSL with client certificates),
configured only by Airflow Connections; a refused client fails fast and says why, no secret shown."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
from psycopg import sql

from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import produce, sample_events
from kafka2pg.exceptions import KafkaAuthenticationError
from kafka2pg.kafka_config import KafkaConfig
from kafka2pg.opening import open_batch

FALLBACKS = ("KAFKA2PG_BOOTSTRAP_SERVERS", "KAFKA2PG_KAFKA_CONFIG", "KAFKA2PG_DATABASE_URL")


def connections_only(airflow_home, env, stack, kafka_client: dict) -> dict[str, str]:
    """A DAG run's environment naming the services only as Airflow Connections."""
    run_env = {k: v for k, v in airflow_home.items() if k not in FALLBACKS}
    run_env["KAFKA2PG_PIPELINES"] = str(env.settings.pipelines_file)
    run_env["AIRFLOW_CONN_KAFKA2PG_POSTGRES"] = json.dumps(stack.postgres.connection())
    run_env["AIRFLOW_CONN_KAFKA2PG_KAFKA"] = json.dumps({"conn_type": "kafka", "extra": kafka_client})
    return run_env


@pytest.mark.parametrize("mode", ["scram", "mtls"])
def test_the_dag_loads_a_topic_through_a_secured_listener_configured_by_connections(
    mode, stack, airflow_home, make_pipeline, db, tmp_path
):
    secured = stack.kafka.secured_listener()
    client = secured.client_config(mode)
    env = make_pipeline(partitions=2)
    produce(KafkaConfig.of(client), env.topic, sample_events(300, seed=101))
    run_env = connections_only(airflow_home, env, stack, client)

    code, output, _ = dags_test(env.pipeline.dag_id, run_env, tmp_path / "run.log")

    assert code == 0, output[-4000:]
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 300
    verify = subprocess.run(
        [sys.executable, "-m", "kafka2pg", "verify", "--pipeline", env.pipeline.name],
        env={**run_env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verify.returncode == 0 and "result: clean" in verify.stdout, verify.stdout + verify.stderr
    for user in (secured.scram, secured.plain):
        assert user.password not in output + verify.stdout + verify.stderr


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"sasl.password": "not-the-password"}, "refused the client's credentials: "),
        ({"ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt"}, "failed the TLS handshake: "),
    ],
)
def test_a_refused_client_fails_the_plan_within_seconds_naming_the_listener_and_the_cause(
    change, expected, stack, make_pipeline
):
    secured = stack.kafka.secured_listener()
    env = make_pipeline(partitions=1)
    wrong = KafkaConfig.of({**secured.client_config("scram"), **change})
    settings = dataclasses.replace(env.settings, kafka=wrong, kafka_timeout_s=5)

    started = time.monotonic()
    with pytest.raises(KafkaAuthenticationError) as refused:
        open_batch(settings, env.pipeline)

    assert time.monotonic() - started < 60  # the client timeout (5 s) and a poll, on a loaded machine
    message = str(refused.value)
    assert f"Kafka at {secured.sasl_ssl_bootstrap_servers} (SASL_SSL, SCRAM-SHA-512) {expected}" in message
    assert secured.scram.password not in message and "not-the-password" not in message
    assert refused.value.terminal
