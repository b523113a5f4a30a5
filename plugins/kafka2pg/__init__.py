"""kafka2pg: exactly-once Kafka -> PostgreSQL micro-batches with an external offset ledger.

Airflow plans, Spark reads bounded offset ranges, PostgreSQL holds data and ledger together.
"""

__version__ = "0.1.0"
