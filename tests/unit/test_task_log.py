"""What task logs show: one summary line per batch and step, lines within the log viewer's width,
and a DAG run's conf checked against its DAG's Params, and against the Params Airflow resolved
from it, before anything is planned."""

import pytest
from airflow.exceptions import AirflowFailException

from kafka2pg.exceptions import RunConfNotAppliedError, UnknownRunConfError
from kafka2pg.planner import OffsetRange
from kafka2pg.replay_request import whole_number
from kafka2pg.task_log import LOG_WIDTH, fit, shorten_ranges, step_summary, table
from kafka2pg.tasks import check_run_conf

LIVE_PARAMS = ("max_records_per_batch", "batches_per_run", "dry_run")
# The live DAG's Params as Airflow resolves them for a task when the run's conf sets none.
DEFAULTS = {"max_records_per_batch": None, "batches_per_run": None, "dry_run": False}


def test_a_summary_line_names_the_step_batch_ranges_counts_seconds_and_report():
    line = step_summary(
        "validate",
        "orders",
        7,
        5.04,
        ranges=[OffsetRange(0, 0, 146), OffsetRange(1, 10, 20)],
        checks=12,
        failed=0,
        flagged=None,
        report="/reports/orders/batch-7.html",
    )
    assert line == (
        "summary step=validate pipeline=orders batch=7 ranges=p0[0,146) p1[10,20) checks=12 failed=0 seconds=5.0 "
        "report=/reports/orders/batch-7.html"
    )


def test_the_ranges_of_many_partitions_are_cut_short_with_a_count():
    ranges = [OffsetRange(p, 1_000_000, 2_000_000) for p in range(40)]
    text = shorten_ranges(ranges)
    assert text.startswith("p0[1000000,2000000) p1[1000000,2000000) ") and len(text) <= 80
    shown = text.count("[")
    assert text.endswith(f" ... (+{40 - shown} partitions)")
    assert len(step_summary("stage", "orders", 1, 1.0, ranges=ranges, records=40_000_000)) <= LOG_WIDTH


def test_long_lines_are_wrapped_within_the_width_and_short_ones_kept():
    details = "deferred to promotion: the target's unique business-key index refuses a promoted key " * 3
    text = fit(f"batch_id=1 check business_key_not_already_promoted ok  {details}\nshort line")
    lines = text.splitlines()
    assert len(lines) > 2 and all(len(line) <= LOG_WIDTH for line in lines)
    assert lines[-1] == "short line" and lines[1].startswith("    ")
    assert (
        " ".join(line.strip() for line in lines[:-1]).split()
        == f"batch_id=1 check business_key_not_already_promoted ok  {details}".split()
    )


def test_a_table_too_wide_wraps_its_last_column_a_narrow_one_stays_as_it_was():
    rows = [
        ["gx:ExpectCompoundColumnsToBeUnique:kafka_topic,kafka_partition,kafka_offset", "ok", 0, "provenance unique"],
        [
            "business_key_not_already_promoted",
            "ok",
            0,
            "deferred to promotion: " + "the target's index refuses it " * 5,
        ],
    ]
    wide = table(["check", "result", "unexpected", "details"], rows)
    assert all(len(line) <= LOG_WIDTH for line in wide.splitlines()), wide
    assert len(wide.splitlines()) > 3 and "refuses it" in wide.splitlines()[-1]
    narrow = table(["partition", "lag"], [[0, 5], [1, None]])
    assert narrow == "partition  lag\n        0    5\n        1    -"
    reasons = table(
        ["offset", "raw bytes", "reason"], [[3381, 62, "not UTF-8"], [3383, 112, "contains NUL"]], text_last=True
    )
    assert reasons == "offset  raw bytes  reason\n  3381         62  not UTF-8\n  3383        112  contains NUL"


@pytest.mark.parametrize(
    ("conf", "unknown", "hint"),
    [
        (
            {"max_records_per_btach": 5},
            ("max_records_per_btach",),
            "(did you mean 'max_records_per_batch' for 'max_records_per_btach'?)",
        ),
        (
            {"dry_run": True, "zzz": 1, "batch_per_run": 2},
            ("batch_per_run", "zzz"),
            "(did you mean 'batches_per_run' for 'batch_per_run'?)",
        ),
    ],
)
def test_a_run_conf_with_a_key_the_dag_does_not_know_fails_without_retry_naming_it(conf, unknown, hint):
    with pytest.raises(AirflowFailException) as raised:
        check_run_conf("kafka2pg_orders", conf, LIVE_PARAMS, DEFAULTS)
    error = raised.value.__cause__
    assert isinstance(error, UnknownRunConfError) and error.terminal
    assert (error.dag_id, error.unknown, error.known) == ("kafka2pg_orders", unknown, tuple(sorted(LIVE_PARAMS)))
    assert hint in str(error) and "Known keys: batches_per_run, dry_run, max_records_per_batch" in str(error)


@pytest.mark.parametrize("conf", [None, {}, {"dry_run": True, "batches_per_run": 3}])
def test_a_run_conf_of_known_keys_or_none_passes(conf):
    """As Airflow resolves the Params with [core] dag_run_conf_overrides_params True: the conf's values."""
    check_run_conf("kafka2pg_orders", conf, LIVE_PARAMS, {**DEFAULTS, **(conf or {})})


@pytest.mark.parametrize(
    ("conf", "keys", "said"),
    [
        ({"dry_run": True}, ("dry_run",), "dry_run=true in the conf, false in the task's params"),
        (
            {"dry_run": False, "batches_per_run": 3, "max_records_per_batch": 5},
            ("batches_per_run", "max_records_per_batch"),
            "batches_per_run=3 in the conf, null in the task's params; max_records_per_batch=5 in the conf, null",
        ),
    ],
)
def test_a_run_conf_airflow_did_not_apply_to_the_params_fails_without_retry_naming_the_setting(conf, keys, said):
    """[core] dag_run_conf_overrides_params False: the task gets the DAG's defaults, not the conf's
    values (a dry run would load). A conf value equal to the default changes nothing and passes."""
    with pytest.raises(AirflowFailException) as raised:
        check_run_conf("kafka2pg_orders", conf, LIVE_PARAMS, DEFAULTS)
    error = raised.value.__cause__
    assert isinstance(error, RunConfNotAppliedError) and error.terminal
    assert (error.dag_id, error.keys) == ("kafka2pg_orders", keys)
    message = str(error)
    assert said in message
    assert "[core] dag_run_conf_overrides_params is False" in message
    assert "AIRFLOW__CORE__DAG_RUN_CONF_OVERRIDES_PARAMS=True" in message and "Nothing was planned" in message
    check_run_conf("kafka2pg_orders", {"dry_run": False, "batches_per_run": None}, LIVE_PARAMS, DEFAULTS)


def test_a_whole_number_from_a_json_run_conf_reaches_the_plan_as_an_int(monkeypatch):
    """JSON has one number type: Airflow's "integer" Param accepts 5.0, which the stage job's
    --batches and --max-records-per-batch would refuse as "5.0"."""
    from airflow.sdk import Param

    import kafka2pg.migrations
    import kafka2pg.opening
    from kafka2pg import tasks

    assert Param(None, type=["null", "integer"], minimum=1).resolve(5.0) == 5.0  # what the task is handed
    seen = {}

    def open_batch(settings, pipeline, *, max_records_per_batch, run_id, dry_run):
        seen["cap"] = max_records_per_batch
        return type("Opened", (), {"batch": None, "message": "nothing to do"})()

    monkeypatch.setattr(tasks, "resolve", lambda name, file=None: (None, None))
    monkeypatch.setattr(kafka2pg.migrations, "require_ready", lambda settings, pipeline: None)
    monkeypatch.setattr(kafka2pg.opening, "open_batch", open_batch)
    assert tasks.plan("orders", max_records_per_batch=5.0, batches_per_run=2.0) is None
    assert seen["cap"] == 5 and type(seen["cap"]) is int
    assert whole_number(2.0) == 2 and type(whole_number(2.0)) is int
    assert whole_number(None) is None and whole_number(7) == 7 and whole_number(2.5) == 2.5
