"""No secret is ever printed: a full DAG run, failed runs and failing commands with known passwords,
then every output and log file searched for them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg import sql

from kafka2pg.config import UNFILTERED_LOG
from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import produce, produce_sample, sample_events
from kafka2pg.kafka_config import KafkaConfig

PG_PASSWORD = "Pg-S3cret-4f9e"
WRONG_KAFKA_PASSWORD = "Wr0ng-Pa55-kafka"
MALFORMED_PG_PASSWORD = "Bad%Pa55zz"


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kafka2pg", *args], env=env, capture_output=True, text=True, timeout=300
    )


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def leaks(secrets: list[str], outputs: list[str], airflow_home, env, stack, tmp_path) -> list[tuple[str, str]]:
    """Each secret found in an output or in a file a run may have written, with where."""
    found = [(secret, "output") for secret in secrets for text in outputs if secret in text]
    logs = files_under(
        Path(airflow_home["AIRFLOW_HOME"]),  # task logs, and the metadata DB (rendered fields, XComs)
        env.settings.state_dir,  # quality reports, Spark's package zip
        tmp_path,  # the dags test logs
        Path(stack.kafka.log_file).parent,  # the broker's logs
        Path(stack.postgres.log_file).parent,
    )
    assert logs
    for path in logs:
        if path.name in ("credentials.json", "server.properties") or path.suffix in (".pem", ".key", ".jar", ".jsa"):
            continue  # where the stack keeps its own secrets (0600)
        content = path.read_bytes()
        found += [(secret, str(path)) for secret in secrets if secret.encode() in content]
    return found


def test_no_password_in_any_output_or_log_of_runs_and_failures(stack, airflow_home, make_pipeline, db, tmp_path):
    secured = stack.kafka.secured_listener()
    scram = secured.client_config("scram")
    env = make_pipeline(partitions=2)
    produce(KafkaConfig.of(scram), env.topic, sample_events(200, seed=111))
    postgres = {**stack.postgres.connection(), "password": PG_PASSWORD}  # trust auth ignores it; it is still sent
    base = {k: v for k, v in airflow_home.items() if not k.startswith("KAFKA2PG_")}
    base["KAFKA2PG_PIPELINES"] = str(env.settings.pipelines_file)
    base["KAFKA2PG_STATE_DIR"] = str(env.settings.state_dir)

    def with_connections(kafka: dict, pg: dict) -> dict[str, str]:
        return {
            **base,
            "AIRFLOW_CONN_KAFKA2PG_KAFKA": json.dumps({"conn_type": "kafka", "extra": kafka}),
            "AIRFLOW_CONN_KAFKA2PG_POSTGRES": json.dumps(pg),
        }

    good = with_connections(scram, postgres)
    outputs = []
    code, output, _ = dags_test(env.pipeline.dag_id, good, tmp_path / "good.log")
    assert code == 0, output[-3000:]
    outputs.append(output)
    wrong_kafka = with_connections({**scram, "sasl.password": WRONG_KAFKA_PASSWORD}, postgres)
    code, output, _ = dags_test(env.pipeline.dag_id, wrong_kafka, tmp_path / "wrong-kafka.log")
    assert code != 0 and "refused the client's credentials" in output, output[-3000:]
    outputs.append(output)
    malformed = with_connections(scram, postgres)  # no postgres connection; a URL libpq cannot parse
    del malformed["AIRFLOW_CONN_KAFKA2PG_POSTGRES"]
    malformed["KAFKA2PG_DATABASE_URL"] = f"postgresql://postgres:{MALFORMED_PG_PASSWORD}@127.0.0.1:1/x"
    for args, environment in (
        (["status", "--pipeline", env.pipeline.name], good),
        (["verify", "--pipeline", env.pipeline.name], good),
        (["status", "--pipeline", env.pipeline.name], wrong_kafka),
        (["status", "--pipeline", env.pipeline.name], malformed),
        (["plan", "--pipeline", env.pipeline.name], malformed),
    ):
        result = run_cli(args, environment)
        outputs += [result.stdout, result.stderr]
    assert "refused the client's credentials" in outputs[-6] + outputs[-5]
    assert "the PostgreSQL connection string is malformed" in outputs[-4] + outputs[-3]

    secrets = [PG_PASSWORD, WRONG_KAFKA_PASSWORD, MALFORMED_PG_PASSWORD, secured.scram.password, secured.plain.password]
    assert not leaks(secrets, outputs, airflow_home, env, stack, tmp_path)
    assert os.environ.get("AIRFLOW_CONN_KAFKA2PG_KAFKA") is None


@pytest.mark.parametrize(
    ("spark_conf", "inline_pem"),
    [({}, False), ({"spark.driver.extraJavaOptions": "-Dkafka2pg.test.site.option=1 -XX:+UseSerialGC"}, True)],
    ids=["kafka2pg-jvm-options-pem-files", "pipelines-own-jvm-options-inline-pem"],
)
def test_no_client_key_in_the_task_log_with_spark_logging_at_debug(
    stack, airflow_home, make_pipeline, db, tmp_path, spark_conf, inline_pem
):
    """Spark's Kafka source logs its Kafka clients' parameters at DEBUG, the client key kafka2pg
    passes inline among them: a pipeline reading through it over mTLS at spark_log_level DEBUG
    prints Spark's DEBUG lines, and not one line of the key; also where the pipeline gives the
    driver JVM options of its own, and the connection gives the CA, certificate and key inline
    (librdkafka's `ssl.*.pem`, which both readers then use)."""
    mtls = stack.kafka.secured_listener().client_config("mtls")
    key = Path(mtls["ssl.key.location"]).read_text().splitlines()
    if inline_pem:
        for kind in ("ca", "certificate", "key"):
            mtls[f"ssl.{kind}.pem"] = Path(mtls.pop(f"ssl.{kind}.location")).read_text()
    env = make_pipeline(partitions=1, kafka_reader="spark", spark_log_level="DEBUG", spark_conf=spark_conf)
    produce(KafkaConfig.of(mtls), env.topic, sample_events(50, seed=112))
    run_env = {k: v for k, v in airflow_home.items() if not k.startswith("KAFKA2PG_")}
    run_env["KAFKA2PG_PIPELINES"] = str(env.settings.pipelines_file)
    run_env["KAFKA2PG_STATE_DIR"] = str(env.settings.state_dir)
    run_env["AIRFLOW_CONN_KAFKA2PG_KAFKA"] = json.dumps({"conn_type": "kafka", "extra": mtls})
    run_env["AIRFLOW_CONN_KAFKA2PG_POSTGRES"] = json.dumps(stack.postgres.connection())

    code, output, _ = dags_test(env.pipeline.dag_id, run_env, tmp_path / "debug.log")

    assert code == 0, output[-3000:]
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 50
    assert re.search(r" DEBUG [A-Za-z]+: ", output), "Spark did not log at DEBUG"
    # Spark's Kafka source logged none of its clients' parameters (kafka2pg's logging configuration),
    assert "Admin params" not in output
    # and the job says the driver logs through kafka2pg's file.
    assert "kafka.group.id is filtered" in output and UNFILTERED_LOG not in output
    key_lines = [line for line in key if "-----" not in line and len(line) >= 40]
    assert len(key_lines) >= 3
    # and no line of the key shows anywhere (that, the redaction regex and Airflow's masker).
    assert not leaks(key_lines, [output], airflow_home, env, stack, tmp_path)


def test_a_pipelines_own_log4j2_file_is_reported_in_the_task_log(airflow_env, make_pipeline, db, tmp_path):
    """A pipeline reading through Spark's Kafka source whose driver JVM options name a Log4j 2
    file of their own runs with that file, not kafka2pg's: the stage job warns that kafka2pg's
    filters are not in force."""
    own = tmp_path / "site-log4j2.properties"
    own.write_text(
        "appender.console.type = Console\nappender.console.name = console\n"
        "rootLogger.level = warn\nrootLogger.appenderRef.stdout.ref = console\n"
    )
    options = {"spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={own}"}
    env = make_pipeline(partitions=1, kafka_reader="spark", spark_conf=options)
    produce_sample(env.settings.bootstrap_servers, env.topic, 20, seed=113)

    code, output, _ = dags_test(env.pipeline.dag_id, airflow_env(env), tmp_path / "own-log4j2.log")

    assert code == 0, output[-3000:]
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 20
    assert UNFILTERED_LOG in output and "kafka.group.id is filtered" not in output
