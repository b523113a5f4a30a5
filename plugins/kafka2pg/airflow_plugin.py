"""The Airflow plugin: mounts the operator's pages (`kafka2pg.web`) on the api-server at /kafka2pg
and adds a "kafka2pg" entry to the UI's navigation. Found through the plugins folder and the wheel's
`airflow.plugins` entry point; importing it loads no database, Kafka or Spark client.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from kafka2pg.report_link import URL_PREFIX
from kafka2pg.web import app


class Kafka2PgPlugin(AirflowPlugin):
    name = "kafka2pg"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "kafka2pg"}]
    # The UI shows the overview in its own frame at /plugin/kafka2pg; the browser sends the
    # Airflow session cookie with it, which the pages check.
    external_views = [
        {
            "name": "kafka2pg",
            "href": f"{URL_PREFIX}/",
            "destination": "nav",
            "url_route": "kafka2pg",
        }
    ]
