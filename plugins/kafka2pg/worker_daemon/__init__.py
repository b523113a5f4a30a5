"""A folder holding one top-level module, `kafka2pg_worker_daemon`, that Spark's Python workers
of a local master import by name (kafka2pg.staging puts only this folder on their path)."""
