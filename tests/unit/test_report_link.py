"""The "Quality report" link of the validate and promote (finish) tasks: the report page's URL, and
the link as the DAGs carry it through Airflow's serialization to the api-server."""

import logging
from pathlib import Path

import pytest
from airflow.serialization.serialized_objects import DagSerialization

from kafka2pg.dag_factory import build_dags
from kafka2pg.report_link import QualityReportLink, log_report_page, planned_report_url, report_path, report_url

ROOT = Path(__file__).resolve().parents[2]
LINKED = {"kafka2pg_orders": ("validate", "promote"), "kafka2pg_orders_replay": ("validate", "finish")}


class RunningTask:
    """What the worker hands a link and a hook: a task instance that can pull the plan task's XCom."""

    def __init__(self, planned):
        self.planned = planned

    def xcom_pull(self, task_ids):
        assert task_ids == "plan"
        return self.planned


def test_the_report_url_is_the_plugins_report_page_under_airflows_base_url():
    assert report_path("orders", 7) == "/kafka2pg/pipelines/orders/batches/7/report"
    assert report_url("orders", 7, None) == "/kafka2pg/pipelines/orders/batches/7/report"
    assert report_url("orders", 7, "") == "/kafka2pg/pipelines/orders/batches/7/report"
    assert report_url("orders", 7, "https://airflow.example.com/") == (
        "https://airflow.example.com/kafka2pg/pipelines/orders/batches/7/report"
    )
    # Airflow served under a path: the pages are under it too.
    assert report_url("orders", 7, "https://example.com/airflow") == (
        "https://example.com/airflow/kafka2pg/pipelines/orders/batches/7/report"
    )


def test_the_pipeline_name_is_one_escaped_path_segment():
    assert report_path("a b/../c?d#e", 3) == "/kafka2pg/pipelines/a%20b%2F..%2Fc%3Fd%23e/batches/3/report"


def test_no_batch_no_link():
    for planned in (None, {}, {"batch_id": None}):
        assert planned_report_url("orders", planned, "https://airflow.example.com") == ""
    assert planned_report_url("orders", {"batch_id": 12, "epoch": 1}, None) == (
        "/kafka2pg/pipelines/orders/batches/12/report"
    )


def test_the_link_and_the_log_line_name_the_planned_batch_under_the_configured_base_url(monkeypatch, caplog):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.test:8080")
    link = QualityReportLink("orders")
    assert link.name == "Quality report"
    assert link.get_link(None, ti_key=RunningTask({"batch_id": 5, "epoch": 2})) == (
        "http://airflow.test:8080/kafka2pg/pipelines/orders/batches/5/report"
    )
    assert link.get_link(None, ti_key=RunningTask({})) == ""
    with caplog.at_level(logging.INFO, logger="kafka2pg"):
        # After a success, from the task's result; after a failure, from the plan task's XCom.
        log_report_page("orders", {"ti": RunningTask({"batch_id": 99})}, {"batch_id": 5, "state": "validated"})
        log_report_page("orders", {"ti": RunningTask({"batch_id": 6})})
        log_report_page("orders", {"ti": RunningTask({})})
    assert [r.getMessage() for r in caplog.records] == [
        "report: http://airflow.test:8080/kafka2pg/pipelines/orders/batches/5/report",
        "report: http://airflow.test:8080/kafka2pg/pipelines/orders/batches/6/report",
    ]


@pytest.fixture
def dags(monkeypatch):
    monkeypatch.delenv("KAFKA2PG_PIPELINES", raising=False)
    return build_dags(ROOT / "dags")


def test_validate_and_promote_carry_the_link_through_serialization_and_nothing_else_does(dags):
    for dag_id, linked in LINKED.items():
        dag = dags[dag_id]
        # What the dag-processor stores and the api-server reads back: the link's name and XCom key.
        served = DagSerialization.from_dict(DagSerialization.to_dict(dag))
        for task_id in dag.task_ids:
            links = {link.name: link.xcom_key for link in served.get_task(task_id).operator_extra_links}
            expected = {"Quality report": "_link_QualityReportLink"} if task_id in linked else {}
            assert links == expected, (dag_id, task_id)
