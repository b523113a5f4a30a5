"""Airflow's plugins folder entry for kafka2pg's UI pages (the package itself is in .airflowignore).

An installed kafka2pg wheel registers the same plugin through its `airflow.plugins` entry point.
"""

from kafka2pg.airflow_plugin import Kafka2PgPlugin

__all__ = ["Kafka2PgPlugin"]
