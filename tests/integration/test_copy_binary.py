"""The binary COPY encoder (kafka2pg.copy_binary) against PostgreSQL itself: every value it
encodes lands equal to the same value given to PostgreSQL as text, for each type the staging
table uses, NULLs, slices (the refused-row bisection COPYs slices) and numerics of every width."""

from datetime import UTC, date, datetime, timedelta
from decimal import Context, Decimal

import psycopg
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from kafka2pg.copy_binary import HEADER, TRAILER, copy_rows

# (PostgreSQL type, Arrow type the stage step hands the encoder, values as Python has them)
NUMERICS = ["numeric(12,2)", "numeric(4,4)", "numeric(18,0)", "numeric(16,2)", "numeric(17,2)", "numeric(40,10)"]


def _decimals(kind: str):
    precision, scale = (int(n) for n in kind[len("numeric(") : -1].split(","))

    def exact(unscaled: int) -> Decimal:  # unscaled * 10**-scale, without a context's rounding
        sign, digits, _ = Decimal(unscaled).as_tuple()
        return Decimal((sign, digits, -scale))

    def zeros(text: str, count: int) -> str:  # trailing zeros after the point change nothing
        return text + ("" if "." in text else ".") + "0" * count

    # The admission's texts: plain, at most `scale` significant digits after the point (fewer too),
    # and as many zeros after them as the record had.
    return st.tuples(st.integers(-(10**precision) + 1, 10**precision - 1).map(exact), st.integers(0, 45)).flatmap(
        lambda dz: st.sampled_from(
            [format(dz[0], "f"), format(dz[0].normalize(Context(prec=1000)), "f"), zeros(format(dz[0], "f"), dz[1])]
        )
    )


COLUMNS = {
    "bigint": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "integer": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "double precision": (pa.float64(), st.floats(allow_nan=False, allow_infinity=False)),
    "boolean": (pa.bool_(), st.booleans()),
    "timestamptz": (
        pa.timestamp("us", tz="UTC"),
        st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)),
    ),
    "date": (pa.date32(), st.dates()),
    "text": (pa.string(), st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]))),
    "jsonb": (pa.string(), st.sampled_from(['{"a": [1, 2.50, null]}', '"x\\u00e9"', "12345678901234567890.5", "{}"])),
    "bytea": (pa.binary(), st.binary(max_size=50)),
    **{kind: (pa.string(), _decimals(kind)) for kind in NUMERICS},
}
NAMES = [f"c{i}" for i in range(len(COLUMNS))]
rows = st.lists(st.tuples(*(st.none() | strategy for _, strategy in COLUMNS.values())), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def tables(base_settings):
    definition = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(name), sql.SQL(kind)) for name, kind in zip(NAMES, COLUMNS, strict=True)
    )
    with psycopg.connect(base_settings.database_url, autocommit=True) as conn:
        for table in ("copy_binary_got", "copy_binary_want"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
            conn.execute(sql.SQL("CREATE TABLE {} ({})").format(sql.Identifier(table), definition))
    return base_settings.database_url


def _arrow(values: list[tuple], skip: int) -> pa.Table:
    """The rows as Arrow columns, after `skip` rows of noise (the encoder gets a slice)."""
    noise = [tuple(None for _ in COLUMNS)] * skip
    table = pa.table(
        {
            name: pa.array([row[i] for row in noise + values], arrow_type)
            for i, (name, (arrow_type, _)) in enumerate(zip(NAMES, COLUMNS.values(), strict=True))
        }
    )
    return table.slice(skip)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(values=rows, skip=st.integers(0, 3))
def test_each_value_lands_as_postgresql_reads_its_text(tables, values, skip):
    _lands_as_its_text(tables, values, skip)


def _lands_as_its_text(database_url: str, values: list[tuple], skip: int) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("TRUNCATE copy_binary_got, copy_binary_want")
        _copy_in(conn, "copy_binary_got", _arrow(values, skip), list(COLUMNS))
        casts = sql.SQL(", ").join(sql.SQL("%s::{}").format(sql.SQL(kind)) for kind in COLUMNS)
        texts = [tuple(None if v is None else v if isinstance(v, bytes) else str(v) for v in row) for row in values]
        conn.cursor().executemany(sql.SQL("INSERT INTO copy_binary_want VALUES ({})").format(casts), texts)
        assert _differ(conn, "copy_binary_got", "copy_binary_want") == (0, 0, len(values))


def _copy_in(conn: psycopg.Connection, table: str, rows: pa.Table, types: list[str]) -> None:
    """`rows` encoded by copy_rows for `types`, written by one binary COPY into `table`."""
    statement = sql.SQL("COPY {} FROM STDIN WITH (FORMAT binary)").format(sql.Identifier(table))
    with conn.cursor() as cur, cur.copy(statement) as copy:
        copy.write(HEADER + copy_rows(rows, types).to_pybytes() + TRAILER)


def _differ(conn: psycopg.Connection, got: str, want: str) -> tuple[int, int, int]:
    """Rows only in `got`, only in `want` (compared as their text too: a numeric's scale, a zero's
    sign), and rows in `got`."""
    got_rows = sql.SQL("SELECT g.*, g::text FROM {} g").format(sql.Identifier(got))
    want_rows = sql.SQL("SELECT w.*, w::text FROM {} w").format(sql.Identifier(want))
    query = sql.SQL(
        "SELECT (SELECT count(*) FROM ({got_rows} EXCEPT ALL {want_rows}) a),"
        " (SELECT count(*) FROM ({want_rows} EXCEPT ALL {got_rows}) b), (SELECT count(*) FROM {got})"
    ).format(got_rows=got_rows, want_rows=want_rows, got=sql.Identifier(got))
    return conn.execute(query).fetchone()


def test_extremes_and_a_decimal_arrow_cannot_read_exactly(tables):
    """Both ends of each range; a numeric text with more digits after the point than the column
    keeps takes the value-by-value path and is rounded by PostgreSQL as its text would be."""
    row_low = (
        -(2**63),
        -(2**31),
        -1.7976931348623157e308,
        False,
        datetime(1, 1, 1, tzinfo=UTC),
        date(1, 1, 1),
        "",
        "[]",
        b"",
        "-9999999999.99",
        "-0.9999",
        "-999999999999999999",
        "-99999999999999.99",
        "-999999999999999.99",
        "-" + "9" * 30 + "." + "9" * 10,
    )
    row_high = (
        2**63 - 1,
        2**31 - 1,
        5e-324,
        True,
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) - timedelta(days=1),
        date(9999, 12, 31),
        "\u00e9\U0001f600",
        '{"k": "v"}',
        b"\x00\xff",
        "0.005",  # rounds to 0.01
        "0",
        "0",
        "-0.0",
        "1.234",  # rounds to 1.23
        "0.00000000005",  # rounds to 0.0000000001
    )
    _lands_as_its_text(tables, [row_low, row_high], 1)


def test_a_type_without_an_encoding_is_refused_unless_all_null():
    assert copy_rows(pa.table({"h": pa.nulls(2, pa.string())}), ["bytea[]"]).size == 2 * 6  # count and -1
    with pytest.raises(ValueError, match="bytea\\[\\]"):
        copy_rows(pa.table({"h": pa.array(["{}", None])}), ["bytea[]"])


@pytest.mark.parametrize(
    ("kind", "texts"),
    [
        ("numeric(12,2)", ["12.5" + "0" * 40, "1." + "0" * 5000, "1.50E+3", "150E-2", "-0", "-0.000", "0.005"]),
        ("numeric(18,2)", ["9999999999999999.99", "-0.01", "12.5" + "0" * 40, "1E+15", "0"]),
        ("numeric(18,8)", ["9999999999.99999999", "-0.00000001", "1." + "0" * 60]),
        ("numeric(1,0)", ["9", "-9", "0.4", "-0", "9." + "0" * 50]),
        ("numeric(18,16)", ["99.9999999999999999", "-0.0000000000000001", "0"]),  # the last in bulk
        ("numeric(18,17)", ["9.99999999999999999", "-0.00000000000000001"]),  # value by value
        ("numeric(18,18)", ["0.999999999999999999", "-0.000000000000000001"]),
        ("numeric(1000,500)", ["1" * 500 + "." + "1" * 500, "-0." + "0" * 499 + "1", "1." + "0" * 5000]),
    ],
)
def test_numeric_texts_in_any_form_land_as_their_value(base_settings, kind, texts):
    """Whatever form a numeric's text takes (long runs of zeros after the point, exponents, a
    negative zero, more digits than Arrow reads exactly), it lands as PostgreSQL reads the text."""
    with psycopg.connect(base_settings.database_url) as conn:
        for table in ("numeric_got", "numeric_want"):
            conn.execute(sql.SQL("CREATE TEMP TABLE {} (n {})").format(sql.Identifier(table), sql.SQL(kind)))
        _copy_in(conn, "numeric_got", pa.table({"n": pa.array(texts, pa.string())}), [kind])
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO numeric_want VALUES (%s::{})").format(sql.SQL(kind)), [(t,) for t in texts]
            )
        assert _differ(conn, "numeric_got", "numeric_want") == (0, 0, len(texts))


def test_rows_postgresql_cannot_read_stop_the_write_instead_of_going_to_quarantine(base_settings):
    """Binary rows PostgreSQL cannot read at all are kafka2pg's defect: the staging write stops
    rather than isolating them as refused records."""
    from kafka2pg.chunk_writer import StagingCopy, copy_isolating

    with psycopg.connect(base_settings.database_url) as conn:
        conn.execute("CREATE TEMP TABLE unreadable (n integer)")
        wrong = StagingCopy(sql.SQL("COPY unreadable (n) FROM STDIN WITH (FORMAT binary)").format(), ("bigint",))
        with pytest.raises(RuntimeError, match="defect in kafka2pg"):
            copy_isolating(conn, wrong, pa.table({"n": pa.array([1, 2], pa.int64())}), into="unreadable")


def test_a_megabyte_of_zeros_after_the_point_lands_as_the_number(base_settings):
    """Zeros after the point change nothing: admission accepts any number of them, and the
    number lands as its value (PostgreSQL's text input would refuse more than 16,383 digits
    after the point)."""
    texts = ["1." + "0" * 1_000_000, "-7.25" + "0" * 100_000, None]
    with psycopg.connect(base_settings.database_url) as conn:
        conn.execute("CREATE TEMP TABLE zeros (n numeric(12,2))")
        _copy_in(conn, "zeros", pa.table({"n": pa.array(texts, pa.string())}), ["numeric(12,2)"])
        assert [r[0] for r in conn.execute("SELECT n::text FROM zeros ORDER BY ctid")] == ["1.00", "-7.25", None]
