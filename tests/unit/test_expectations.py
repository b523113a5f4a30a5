"""The Great Expectations half of the gate, on DataFrames (no services): what a run keeps alive."""

import json
import threading
import time
import weakref

import pandas as pd
import pytest

from kafka2pg.config import get_pipeline
from kafka2pg.expectations import run_suite, suite_for


def frame(rows: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "kafka_topic": ["t"] * rows,
            "kafka_partition": [i % 3 for i in range(rows)],
            "kafka_offset": list(range(rows)),
            "event_id": [f"e{i}" for i in range(rows)],
            "customer_id": list(range(rows)),
        }
    )


def test_validating_a_batch_frees_the_frame_of_the_batch_before():
    """GX's context, batch and validator form reference cycles holding the DataFrame; a
    multi-batch run kept every batch's frame until a rare full collection (the driver grew
    by about 25 MB per 100k-record batch). Each validation frees the ones before it."""
    suite = suite_for(get_pipeline("orders"), 1000)
    first = frame(1000)
    assert run_suite(first, suite).success
    freed = weakref.ref(first)
    del first
    assert run_suite(frame(1000), suite).success
    assert freed() is None


def test_validation_does_not_fingerprint_the_frame(monkeypatch):
    """GX's md5 over every row (a batch marker nothing reads) was half of a batch's validation
    CPU; run_suite turns it off. Fails if a GX upgrade drops the setting it uses."""
    from great_expectations.execution_engine import pandas_execution_engine

    assert hasattr(pandas_execution_engine, "HASH_THRESHOLD")
    hashed = []
    original = pandas_execution_engine.hash_pandas_dataframe
    monkeypatch.setattr(
        pandas_execution_engine, "hash_pandas_dataframe", lambda df: hashed.append(len(df)) or original(df)
    )
    data = frame(1000).assign(kafka_topic=lambda f: f.kafka_topic.astype("category"))
    data.loc[5, "event_id"] = "e4"  # a duplicate: the checks still see every row
    outcome = run_suite(data, suite_for(get_pipeline("orders"), 1000))
    assert hashed == []
    by_type = {r.expectation.type: r for r in outcome.results}
    assert not by_type["ExpectColumnValuesToBeUnique"].success
    assert by_type["ExpectColumnValuesToBeUnique"].unexpected == 2
    assert by_type["ExpectCompoundColumnsToBeUnique"].success


def test_a_job_of_several_batches_starts_the_gx_import_before_spark(monkeypatch, tmp_path):
    """GX's import (seconds of CPU) runs beside Spark's start, while the driver waits on the JVM,
    in one thread per process, joined before the job leaves, also when Spark fails to start; a
    job of one batch, which does not validate, does not import GX."""
    from types import SimpleNamespace

    from kafka2pg import expectations, runner

    class SparkStarted(Exception):
        pass

    warmed = threading.Event()
    seen = []

    def spark_session(*args, **kwargs):
        seen.append(expectations._warming)
        raise SparkStarted

    def warm_up():
        time.sleep(0.3)  # the import takes a while: the job must wait for it to end
        warmed.set()

    monkeypatch.setattr(expectations, "warm_up", warm_up)
    monkeypatch.setattr(expectations, "_warming", None)
    settings = SimpleNamespace(pipelines_file=None, state_dir=tmp_path)
    monkeypatch.setattr(runner, "Settings", SimpleNamespace(from_env=lambda: settings))
    monkeypatch.setattr(runner, "get_pipeline", lambda name, path: get_pipeline("orders"))
    monkeypatch.setattr(runner, "spark_session", spark_session)
    monkeypatch.setattr("kafka2pg.stuck.record_failure", lambda *args: None)  # no database here

    with pytest.raises(SparkStarted):
        runner.run_job("orders", 1, batches=1)
    assert seen == [None] and not warmed.is_set()
    with pytest.raises(SparkStarted):
        runner.run_job("orders", 1, batches=3)
    assert warmed.is_set()  # joined as the job left
    with pytest.raises(SparkStarted):
        runner.run_job("orders", 1, batches=3)
    first, again = seen[1:]
    assert first is not None and again is first  # started before the session, once


SLIM_PROBE = """
import json, sys
import pandas as pd, pyspark.sql
from kafka2pg.config import get_pipeline
from kafka2pg.expectations import run_suite, suite_for
data = pd.DataFrame({"kafka_topic": ["t"] * 9, "kafka_partition": [0] * 9, "kafka_offset": list(range(9)),
                     "event_id": ["a", "b", "c", "d", "e", "f", "g", "h", "a"], "customer_id": list(range(9))})
outcome = run_suite(data, suite_for(get_pipeline("orders"), 9))
heavy = ["altair.vegalite", "sqlalchemy", "scipy.stats._stats_py", "pyspark.ml", "pyspark.sql.connect"]
loaded = [m for m in heavy if m in sys.modules]
left = [m for m in ("altair", "scipy.stats") if m in sys.modules]  # no stand-in stays behind
from great_expectations.expectations.core import expect_column_kl_divergence_to_be_less_than as kl
import sqlalchemy
unique = [r.unexpected for r in outcome.results if r.expectation.type == "ExpectColumnValuesToBeUnique"]
print(json.dumps({"loaded": loaded, "left": left, "unique": unique, "chart": kl.alt.Chart.__name__,
    "entropy": round(kl.stats.entropy([1, 1]), 3), "altair": type(sys.modules["altair"]).__name__,
    "sqlalchemy": sqlalchemy.__name__}))
"""


def test_gx_is_imported_without_its_extras_and_defers_what_only_other_expectations_use(fresh_python):
    """GX imports SQLAlchemy and PySpark's ML/Connect when it finds them, and Altair and scipy.stats
    for one expectation our suite lacks: about half its import's CPU and 128 MB of the driver. A
    validation in a fresh interpreter leaves them unimported and still judges the frame; the
    deferred modules work on first use, and the withheld ones import normally afterwards."""
    result = json.loads(fresh_python(SLIM_PROBE))
    assert result["loaded"] == [] and result["left"] == []
    assert result["unique"] == [2]
    assert result["chart"] == "Chart" and result["entropy"] == 0.693
    assert result["altair"] == "module" and result["sqlalchemy"] == "sqlalchemy"


def test_a_rules_meaning_in_the_suite_reads_as_the_quarantine_reason_does():
    """The report's meaning of a column's rule shows a long allowed list cut, as a quarantine
    reason does, and a range's whole-number bounds without ".0"."""
    from dataclasses import replace

    orders = get_pipeline("orders")
    by_name = {c.name: c for c in orders.columns}
    many = replace(by_name["currency"], allowed=tuple(f"C{i:03d}" for i in range(183)))
    ranged = replace(by_name["amount"], minimum=0.0, maximum=1000.0)
    pipeline = replace(
        orders, columns=tuple({"currency": many, "amount": ranged}.get(c.name, c) for c in orders.columns)
    )
    meanings = {
        e.kwargs.get("column"): e.meaning for e in suite_for(pipeline, 10) if e.type != "ExpectColumnValuesToNotBeNull"
    }
    assert meanings[many.name] == f"declared {many.allowed_words}" and meanings[many.name].endswith("… (183 values)")
    assert len(meanings[many.name]) < 200
    assert meanings[ranged.name] == f"declared {ranged.range_words}" and ".0" not in meanings[ranged.name]
