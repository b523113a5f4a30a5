"""`airflow dags test` on the real DAG file against the embedded stack: success, no-op, failure."""

import os
import re
from pathlib import Path

from psycopg import sql

from kafka2pg.devtools.airflow_cli import dags_test
from kafka2pg.devtools.producer import produce_sample
from kafka2pg.kafka_offsets import partition_offsets
from kafka2pg.locations import state_dir
from kafka2pg.task_log import LOG_WIDTH

ROOT = Path(__file__).resolve().parents[2]
# A log record in `airflow dags test` output: time and [level] first, [logger] and key=value fields last.
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\dT\S+ \[\w+\s*\] ")
RECORD_END = re.compile(r" ?\[(?P<logger>[\w.]+)\](?: \S+=\S*)*$")


def task_log(output: str, task_id: str) -> list[str]:
    """The lines a task logged in a `dags test` run: from its start to its end marker."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if f"[DAG TEST] starting task_id={task_id} " in line)
    end = next(i for i, line in enumerate(lines) if f"[DAG TEST] end task task_id={task_id} " in line)
    return lines[start : end + 1]


def kafka2pg_messages(lines: list[str]) -> list[str]:
    """The lines of kafka2pg's log records among a task's log lines (a multi-line message's lines
    included), without Airflow's prefix and suffix, which kafka2pg does not choose."""
    records: list[list[str]] = []
    for line in lines:
        if RECORD_START.match(line) or not records:
            records.append([RECORD_START.sub("", line)])
        else:
            records[-1].append(line)
    messages = []
    for record in records:
        end = RECORD_END.search(record[-1])
        if end is not None and end["logger"].startswith("kafka2pg"):
            messages += [*record[:-1], record[-1][: end.start()]]
    return messages


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
    # A short read_and_stage log at the default Spark log level: no Spark INFO, no warning per
    # read about kafka.group.id, a summary line of the batch.
    stage_log = task_log(output, "read_and_stage")
    assert len(stage_log) < 60, "\n".join(stage_log)
    assert "'kafka.group.id' has been set on this query" not in output
    # The stage job's scratch folder (kafka2pg.scratch): Spark's note on spark.local.dir filtered,
    # the folder removed at the job's end.
    assert "spark.local.dir will be overridden" not in output
    scratch = state_dir({**os.environ, **airflow_env(env)}) / "spark" / "scratch"
    assert scratch.is_dir() and not list(scratch.iterdir()), list(scratch.iterdir())
    assert sum("Kafka reads use consumer group" in line for line in stage_log) == 1
    summary = [line for line in stage_log if "summary step=stage" in line]
    assert len(summary) == 1 and "ranges=p0[0," in summary[0] and "records=400 rows=400 quarantined=0" in summary[0]
    (batch_id,) = db.execute(
        "SELECT batch_id FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,)
    ).fetchone()
    for step in ("plan", "validate", "promote"):
        assert f"summary step={step} pipeline={env.pipeline.name} batch={batch_id} " in "\n".join(
            task_log(output, step)
        )
    assert "report=" in next(line for line in task_log(output, "validate") if "summary step=validate" in line)
    # Check results and the batch report fit the log viewer (Airflow's own lines are not kafka2pg's).
    for step in ("validate", "promote"):
        messages = kafka2pg_messages(task_log(output, step))
        assert any("gx:ExpectCompoundColumnsToBeUnique" in m for m in messages), messages
        wide = [m for m in messages if len(m) > LOG_WIDTH]
        assert not wide, wide
        # The task's last line names the batch's report page (a path: this Airflow has no base_url);
        # only Airflow's post-execute group follows it.
        report = f"report: /kafka2pg/pipelines/{env.pipeline.name}/batches/{batch_id}/report"
        assert messages[-1].rstrip() == report, messages[-3:]
        lines = task_log(output, step)
        post_execute = next(i for i, line in enumerate(lines) if "::group::Post Execute" in line)
        assert f"] {report} [kafka2pg]" in lines[post_execute - 1], lines[post_execute - 3 : post_execute + 1]

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


def test_a_run_triggered_with_an_unknown_conf_key_fails_at_plan_naming_it(airflow_env, make_pipeline, db, tmp_path):
    env = make_pipeline()
    produce_sample(env.settings.bootstrap_servers, env.topic, 50, seed=13)
    code, output, _ = dags_test(
        env.pipeline.dag_id, airflow_env(env), tmp_path / "live.log", conf={"max_records_per_btach": 5}
    )
    assert code != 0
    plan_log = "\n".join(task_log(output, "plan"))
    assert "UnknownRunConfError" in plan_log and "unknown key(s) 'max_records_per_btach'" in plan_log, plan_log
    assert "did you mean 'max_records_per_batch' for 'max_records_per_btach'?" in plan_log
    assert "Known keys: batches_per_run, dry_run, max_records_per_batch" in plan_log
    assert "Spark-Submit cmd" not in output
    planned = db.execute("SELECT count(*) FROM kafka2pg.batches WHERE pipeline = %s", (env.pipeline.name,)).fetchone()
    assert planned[0] == 0, "nothing is planned with a misspelled key"

    # The replay DAG's Params are checked the same way.
    conf = {"mode": "verify-only", "offset_range": [{"partition": 0, "start": 0, "end": 5}]}
    code, output, _ = dags_test(env.pipeline.replay_dag_id, airflow_env(env), tmp_path / "replay.log", conf=conf)
    assert code != 0
    plan_log = "\n".join(task_log(output, "plan"))
    assert (
        "unknown key(s) 'offset_range'" in plan_log and "did you mean 'offset_ranges' for 'offset_range'?" in plan_log
    ), plan_log
    assert "Known keys: from_time, mode, offset_ranges, reason, to_time" in plan_log
