"""`airflow dags test` on the real DAG file against the embedded stack: success, no-op, failure."""

from pathlib import Path

from psycopg import sql

from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import produce_sample
from kafka2pg.kafka_offsets import partition_offsets

ROOT = Path(__file__).resolve().parents[2]


def test_dag_run_lands_everything_then_second_run_is_a_noop_without_spark(airflow_env, make_pipeline, db, tmp_path):
    env = make_pipeline()
    produce_sample(env.settings.bootstrap_servers, env.topic, 400, seed=11)
    code, output, _ = dags_test(env.pipeline.dag_id, airflow_env(env), tmp_path / "run-1.log")
    assert code == 0, output[-3000:]
    assert "Spark-Submit cmd" in output or "spark-submit" in output
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 400
    heads = dict(
        db.execute(
            "SELECT kafka_partition, next_offset FROM kafka2pg.ledger_heads WHERE pipeline = %s", (env.pipeline.name,)
        ).fetchall()
    )
    watermarks = {o.partition: o.high for o in partition_offsets(env.settings.bootstrap_servers, env.topic)}
    assert heads == watermarks

    code, output, _ = dags_test(env.pipeline.dag_id, airflow_env(env), tmp_path / "run-2.log")
    assert code == 0, output[-3000:]
    assert "no batch planned, Spark not launched" in output
    assert "Spark-Submit cmd" not in output
    # A no-op run logs no error: `plan` hands `has_batch` an empty batch, not a missing XCom.
    assert "XCom not found" not in output and "[error" not in output, output[-3000:]
    batches = db.execute("SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,)).fetchone()
    assert batches[0] == 1


def test_one_dag_run_catches_up_a_backlog_with_batches_per_run(airflow_env, make_pipeline, db, tmp_path):
    env = make_pipeline(max_records_per_batch=150)
    produce_sample(env.settings.bootstrap_servers, env.topic, 400, seed=12)
    code, output, _ = dags_test(
        env.pipeline.dag_id, airflow_env(env), tmp_path / "run.log", conf={"batches_per_run": 5}
    )
    assert code == 0, output[-3000:]
    assert "--batches 5" in output and "--max-records-per-batch 150" in output
    assert "3 batch(es) promoted in this run (400 records read)" in output
    assert f"400 rows to {env.pipeline.target_schema}.{env.pipeline.target_table}, 0 to quarantine" in output
    target = sql.Identifier(env.pipeline.target_schema, env.pipeline.target_table)
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(target)).fetchone()[0] == 400
    states = db.execute(
        "SELECT state, count(*), count(DISTINCT run_id) FROM kafka2pg.batches WHERE pipeline = %s GROUP BY state",
        (env.pipeline.name,),
    ).fetchall()
    assert states == [("promoted", 3, 1)]
    # The DAG's own validate and promote tasks find the first batch finished by the job.
    assert "was already promoted: nothing changed" in output


def test_failing_task_makes_dags_test_exit_non_zero(airflow_env, make_pipeline, tmp_path):
    env = make_pipeline(create_topic=False)
    code, output, _ = dags_test(env.pipeline.dag_id, airflow_env(env), tmp_path / "run.log")
    assert code != 0
    assert "TopicNotFoundError" in output and env.topic in output
