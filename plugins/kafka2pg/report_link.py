"""Where a batch's quality report page is on the api-server (the plugin's pages): the "Quality
report" link the validate and promote (replay: finish) tasks carry, and the last line they log.

The worker computes the link when the task ends and Airflow keeps it in the task's XCom; the
api-server only reads it back, so the link needs neither this package nor the plugin there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import quote

import attrs
from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

log = logging.getLogger("kafka2pg")

#: Where the plugin mounts the operator's pages on the api-server.
URL_PREFIX = "/kafka2pg"
#: The task whose result names the run's batch (`dag_factory`: both DAGs start with it).
PLAN_TASK_ID = "plan"


def report_path(pipeline: str, batch_id: int) -> str:
    """The batch's report page, relative to the api-server's root:
    `/kafka2pg/pipelines/orders/batches/7/report`."""
    return f"{URL_PREFIX}/pipelines/{quote(pipeline, safe='')}/batches/{int(batch_id)}/report"


def report_url(pipeline: str, batch_id: int, base_url: str | None) -> str:
    """The report page under Airflow's `[api] base_url` (`https://airflow.example.com/kafka2pg/...`);
    without one, the path alone, which the UI opens on its own origin."""
    path = report_path(pipeline, batch_id)
    return f"{base_url.rstrip('/')}{path}" if base_url else path


def planned_report_url(pipeline: str, planned: Mapping | None, base_url: str | None) -> str:
    """The report page of the batch a `plan` task handed over; "" (no link) when it planned none."""
    if not planned or planned.get("batch_id") is None:
        return ""
    return report_url(pipeline, planned["batch_id"], base_url)


def airflow_base_url() -> str:
    """Airflow's `[api] base_url`, "" when not set (read where the task runs)."""
    from airflow.sdk.configuration import conf

    return conf.get("api", "base_url", fallback="") or ""


def log_report_page(pipeline: str, context: Mapping, result: object = None) -> None:
    """Log `report: <url>` of the run's batch; nothing when the run planned none. A task hook: as a
    post-execute hook it gets the task's result, which names the batch; as a failure or retry
    callback only the context, and the batch comes from the plan task's XCom."""
    if isinstance(result, Mapping):
        batch = result
    else:
        pull = getattr(context.get("ti"), "xcom_pull", None)
        batch = pull(task_ids=PLAN_TASK_ID) if pull else None
    url = planned_report_url(pipeline, batch, airflow_base_url())
    if url:
        log.info("report: %s", url)


@attrs.define
class QualityReportLink(BaseOperatorLink):
    """The report page of the run's batch: the one its `plan` task planned, which the validate and
    promote tasks work on. In a run of several batches (`batches_per_run`) that is the run's
    first; the further ones are on the pipeline's batches page. No batch, no link."""

    pipeline: str
    name = "Quality report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        # Called in the worker as the task ends, with the running task instance (which can pull
        # XComs); elsewhere Airflow reads the link this left in XCom instead.
        pull = getattr(ti_key, "xcom_pull", None)
        if pull is None:
            return ""
        return planned_report_url(self.pipeline, pull(task_ids=PLAN_TASK_ID), airflow_base_url())
