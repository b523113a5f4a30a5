"""The Great Expectations half of the quality gate: one GX validation of a staged batch.

GX is imported here only, inside the validate task (never at DAG-parse time). The batch's
accepted staging rows are loaded into a pandas DataFrame and validated by an ephemeral GX
context: GX's SQL backend computes uniqueness with NOT IN sub-queries that took minutes on
100k PostgreSQL rows here, while the same suite on a DataFrame takes about a second.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
import sys
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from psycopg import Connection, sql

from kafka2pg.config import Column, Pipeline, float_bound
from kafka2pg.withheld_imports import withheld

log = logging.getLogger(__name__)

PROVENANCE = ["kafka_topic", "kafka_partition", "kafka_offset"]
SAMPLE = 10


@dataclass(frozen=True)
class Expectation:
    """One expectation of the suite, as plain data (type name + kwargs) plus why it exists."""

    type: str
    kwargs: dict[str, Any]
    meaning: str

    @property
    def name(self) -> str:
        target = self.kwargs.get("column") or ",".join(self.kwargs.get("column_list", [])) or "table"
        return f"gx:{self.type}:{target}"


@dataclass(frozen=True)
class ExpectationResult:
    expectation: Expectation
    success: bool
    unexpected: int
    sample_offsets: list[str]
    error: str | None = None


@dataclass(frozen=True)
class GxOutcome:
    results: tuple[ExpectationResult, ...]
    rows: int
    seconds: float
    gx_version: str

    @property
    def success(self) -> bool:
        return bool(self.results) and all(r.success for r in self.results)


def suite_for(pipeline: Pipeline, expected_rows: int) -> list[Expectation]:
    """The expectations of a pipeline: defaults plus each column's declared rules."""
    suite = [
        Expectation(
            "ExpectCompoundColumnsToBeUnique",
            {"column_list": PROVENANCE},
            "provenance (topic, partition, offset) unique",
        ),
        Expectation(
            "ExpectTableRowCountToEqual",
            {"value": expected_rows},
            "completeness: accepted rows = records read - quarantined",
        ),
    ]
    if len(pipeline.business_key) == 1:
        suite.append(
            Expectation(
                "ExpectColumnValuesToBeUnique", {"column": pipeline.business_key[0]}, "business key unique in batch"
            )
        )
    elif pipeline.business_key:
        suite.append(
            Expectation(
                "ExpectCompoundColumnsToBeUnique",
                {"column_list": list(pipeline.business_key)},
                "business key unique in batch",
            )
        )
    required = [*pipeline.required_columns, *(k for k in pipeline.business_key if k not in pipeline.required_columns)]
    suite += [Expectation("ExpectColumnValuesToNotBeNull", {"column": c}, "required column not null") for c in required]
    for column in pipeline.columns:
        # GX compares floats: bounds and values rounded alike never fail a value inside the range,
        # and the gate's exact SQL check (rule_<column>) fails one outside it that rounding hides.
        # A business-key column stays exact for the uniqueness expectations: its range is the SQL
        # check's alone.
        if column.ranged and column.name not in pipeline.business_key:
            suite.append(
                Expectation(
                    "ExpectColumnValuesToBeBetween",
                    {
                        "column": column.name,
                        "min_value": float_bound(column.minimum),
                        "max_value": float_bound(column.maximum),
                    },
                    f"declared {column.range_words}",
                )
            )
        if column.allowed is not None:
            suite.append(
                Expectation(
                    "ExpectColumnValuesToBeInSet",
                    {"column": column.name, "value_set": list(column.allowed)},
                    f"declared {column.allowed_words}",
                )
            )
    return suite


def gx_columns(pipeline: Pipeline) -> tuple[list[str], list[Column]]:
    """The columns the suite looks at, provenance first and the rest in the pipeline's order, and
    the ranged columns among them it compares as floats (a business key's range is not its)."""
    ranged = [c for c in pipeline.columns if c.ranged and c.name not in pipeline.business_key]
    checked = {*pipeline.business_key, *pipeline.required_columns, *(c.name for c in ranged)}
    checked |= {c.name for c in pipeline.columns if c.allowed}
    return [*PROVENANCE, *(c.name for c in pipeline.columns if c.name in checked)], ranged


def load_accepted(conn: Connection, pipeline: Pipeline, batch_id: int):
    """The batch's staged rows not flagged for quarantine, as a pandas DataFrame.

    Only the columns the suite looks at: a wide jsonb payload parsed into Python dicts for
    100k rows costs seconds and checks nothing.
    """
    import pandas as pd

    columns, ranged = gx_columns(pipeline)
    as_double = {c.name for c in ranged if _double_holds(c.type)}
    # A jsonb column can only be required (never a key, ranged or with allowed values): the suite
    # looks at its NULLs only, so it is read as text. Parsed into Python it would cost time and fail
    # on a value PostgreSQL keeps (a number of more than 4,300 digits), rejecting the batch.
    as_text = {c.name for c in pipeline.columns if c.type == "jsonb"}
    casts = {**dict.fromkeys(as_double, "float8"), **dict.fromkeys(as_text, "text")}
    selected = [
        sql.SQL("{}::{}").format(sql.Identifier(name), sql.SQL(casts[name])) if name in casts else sql.Identifier(name)
        for name in columns
    ]
    query = sql.SQL("SELECT {} FROM {} WHERE batch_id = %s AND quarantine_reason IS NULL").format(
        sql.SQL(", ").join(selected), sql.Identifier("kafka2pg", pipeline.staging_table)
    )
    with conn.transaction(), conn.cursor() as cur:  # a savepoint in the gate's transaction
        if as_double:  # float8 as text in full, whatever a role or database set
            cur.execute("SELECT set_config('extra_float_digits', '3', true)")
        cur.execute(query, (batch_id,))
        frame = pd.DataFrame(cur.fetchall(), columns=columns)
    # One topic per pipeline: as a category, GX's uniqueness and null checks on it hash one string.
    frame["kafka_topic"] = frame["kafka_topic"].astype("category")
    for column in ranged:  # GX compares floats; a numeric(p,s) PostgreSQL did not cast is a Decimal
        if column.name in as_double:
            frame[column.name] = frame[column.name].astype("float64")  # all NULL: None objects otherwise
        else:
            frame[column.name] = pd.to_numeric(frame[column.name])
    return frame


def _double_holds(pg_type: str) -> bool:
    """Whether PostgreSQL casts every value of a `numeric(p,s)` column to float8 without an
    error: a precision of at most 300 digits (kafka2pg's scale is at most the precision; float8
    ends near 1e308 and 1e-308). The cast rounds as Python's float() of the Decimal does (both
    read the decimal text, correctly rounded), and makes no Decimal of each value (about 0.08 s
    per 100k rows)."""
    from kafka2pg.admission import numeric_precision_scale  # pyarrow's and msgspec's import: only here

    if not pg_type.startswith("numeric("):
        return False
    precision, scale = numeric_precision_scale(pg_type)
    return precision <= 300 and 0 <= scale <= precision


def warm_up() -> None:
    """Import GX and validate a one-row frame (about 3 s of CPU, once per process), so that a
    caller can pay it while waiting on something else. Errors are left to the real validation."""
    import pandas as pd

    try:
        run_suite(
            pd.DataFrame({c: [0] for c in PROVENANCE}), [Expectation("ExpectTableRowCountToEqual", {"value": 1}, "")]
        )
    except Exception:  # noqa: BLE001 - the batch's own validation reports whatever this hit
        log.debug("Great Expectations warm-up failed", exc_info=True)
    # What exists now (Spark's, GX's and pandas' modules, mostly) lives as long as the process:
    # freezing it keeps the full collection after each batch's validation short (0.2 s -> 0.015 s).
    gc.freeze()


_warming: threading.Thread | None = None
_warming_started = threading.Lock()


def warm_up_in_background() -> threading.Thread:
    """`warm_up` in a daemon thread, started once per process (later calls return the same
    thread). A caller that will validate starts it as early as it can and joins it before its
    first validation, so GX is never imported by two threads at once."""
    global _warming
    with _warming_started:
        if _warming is None:
            _warming = threading.Thread(target=warm_up, name="kafka2pg-gx-warm-up", daemon=True)
            _warming.start()
        return _warming


def run_suite(frame, suite: list[Expectation]) -> GxOutcome:
    """Validate `frame` with GX; an expectation that raised counts as failed (fail closed)."""
    started = time.monotonic()
    # Before the import: importing GX logs a few hundred INFO lines into the task log.
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    with _slim_gx_import():
        import great_expectations as gx
        import great_expectations.expectations as gxe

        _skip_frame_fingerprint()
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = gx.data_context.types.base.ProgressBarsConfig(globally=False)
    asset = context.data_sources.add_pandas("kafka2pg").add_dataframe_asset("staged_batch")
    batch = asset.add_batch_definition_whole_dataframe("batch").get_batch(batch_parameters={"dataframe": frame})
    gx_suite = gx.ExpectationSuite(name="kafka2pg")
    ours = {}
    for expectation in suite:
        gx_expectation = getattr(gxe, expectation.type)(**expectation.kwargs)
        ours[_key(gx_expectation.expectation_type, expectation.kwargs)] = expectation
        gx_suite.add_expectation(gx_expectation)
    validation = batch.validate(
        gx_suite,
        result_format={
            "result_format": "SUMMARY",
            "unexpected_index_column_names": ["kafka_partition", "kafka_offset"],
            "partial_unexpected_count": SAMPLE,
        },
    )
    # GX may reorder results (expectations that errored come first): match them by type and target.
    by_key = {_key(r.expectation_config.type, r.expectation_config.kwargs): r for r in validation.results}
    results = [
        _result(e, by_key[key]) if key in by_key else ExpectationResult(e, False, 0, [], "GX returned no result")
        for key, e in ours.items()
    ]
    # GX's context, batch and validator reference each other and the DataFrame. Python frees such
    # cycles only in a full collection, which a process holding GX's and Spark's millions of
    # long-lived objects runs rarely: a multi-batch run kept every batch's frame (3M records: the
    # driver grew from 0.3 to 1.1 GB). The context of the latest validation stays GX's current
    # one until the next; collecting here frees every earlier one.
    del context, asset, batch, gx_suite, validation, by_key
    gc.collect()
    return GxOutcome(tuple(results), len(frame), time.monotonic() - started, gx.__version__)


# GX's optional extras (SQL data sources, Spark's ML and Connect): GX imports them when it finds
# them (SQLAlchemy 0.28 s, PySpark's ML and Connect 0.3 s of CPU) and runs without them, as a GX
# installed without those extras does. A pandas validation never uses them.
GX_EXTRAS_WITHHELD = ("sqlalchemy", "pyspark.ml", "pyspark.sql.connect", "pyspark.testing")
# Modules GX needs but imports for one expectation kafka2pg's suite does not have (the KL
# divergence one: Altair for its chart, scipy.stats for its test; 1.1 s of CPU and about 100 MB):
# imported on their first use instead.
GX_DEFERRED = ("altair", "scipy.stats")


@contextmanager
def _slim_gx_import() -> Iterator[None]:
    """Import GX (once per process; nothing to do after) without `GX_EXTRAS_WITHHELD`, and with
    `GX_DEFERRED` standing in until first used: GX's import from 2.8 to 1.2-1.5 s of CPU, the
    driver's memory 128 MB less. Only the calling thread's imports are withheld. The stand-ins
    are in `sys.modules` for every thread while GX imports (a thread using one imports the real
    module) and leave it when GX is in, so a later import anywhere gets the real ones."""
    if "great_expectations" in sys.modules:
        yield
        return
    placed = {}
    for name in GX_DEFERRED:
        try:
            spec = None if name in sys.modules else importlib.util.find_spec(name)
        except ImportError:
            spec = None
        if spec is not None:
            placed[name] = sys.modules[name] = _Deferred(name, spec)
    try:
        with withheld(*GX_EXTRAS_WITHHELD):
            yield
    finally:
        with _deferred_loading:  # a stand-in another thread has just replaced by the real module stays
            for name, stand_in in placed.items():
                if sys.modules.get(name) is stand_in:
                    del sys.modules[name]


_deferred_loading = threading.RLock()


class _Deferred(types.ModuleType):
    """A module imported on the first use of one of its attributes (then read from the real one)."""

    def __init__(self, name: str, spec: importlib.machinery.ModuleSpec) -> None:
        super().__init__(name)
        self.__spec__ = spec

    def __getattr__(self, attr: str) -> Any:
        with _deferred_loading:
            real = sys.modules.get(self.__name__)
            if real is None or real is self:
                sys.modules.pop(self.__name__, None)
                log.debug("importing %s, deferred while importing Great Expectations", self.__name__)
                real = importlib.import_module(self.__name__)
        return getattr(real, attr)


def _skip_frame_fingerprint() -> None:
    """GX hashes every row of a DataFrame it is given (twice per validation: an md5 over
    pandas' row hashes, stored as the batch's `pandas_data_fingerprint` marker) unless the frame
    is larger than its HASH_THRESHOLD. That was half of a 100k-row validation's CPU (0.37 s ->
    0.16 s). Nothing reads the marker: our reports name the batch by its id. A GX without the
    setting is left alone (tests/unit/test_expectations.py fails then, so an upgrade notices)."""
    from great_expectations.execution_engine import pandas_execution_engine

    if hasattr(pandas_execution_engine, "HASH_THRESHOLD"):
        pandas_execution_engine.HASH_THRESHOLD = 0


def _key(expectation_type: str, kwargs: dict) -> tuple:
    return expectation_type, kwargs.get("column"), tuple(kwargs.get("column_list") or ())


def _result(expectation: Expectation, raw) -> ExpectationResult:
    info = raw.exception_info or {}
    error = info.get("exception_message") if info.get("raised_exception") else None
    result = raw.result or {}
    unexpected = result.get("unexpected_count")
    if unexpected is None and expectation.type == "ExpectTableRowCountToEqual":
        unexpected = abs(int(result.get("observed_value") or 0) - expectation.kwargs["value"])
    samples = [
        f"p{i['kafka_partition']}@{i['kafka_offset']}"
        for i in (result.get("partial_unexpected_index_list") or [])[:SAMPLE]
        if isinstance(i, dict)
    ]
    return ExpectationResult(expectation, bool(raw.success) and error is None, int(unexpected or 0), samples, error)
