"""PostgreSQL's binary COPY format, built from Arrow columns in bulk (no Python call per value).

The staging COPY sends its rows this way: PostgreSQL then reads integers, timestamps and
numerics as they are stored instead of parsing their text (about a third of its CPU for that COPY,
bench/README.md). Each column is encoded by the PostgreSQL type it goes to, as that type's
binary input function reads it (the `*_recv` functions): big-endian fixed-width integers and
floats, timestamps as microseconds and dates as days since 2000-01-01, text and bytea as their
bytes, jsonb as a version byte and its text, numeric as base-10000 digits. PostgreSQL still
checks everything it checks for text: encoding, NUL bytes, typmods, constraints.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kafka2pg.admission import numeric_precision_scale

HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header extension length
TRAILER = b"\xff\xff"

_NULL = b"\xff\xff\xff\xff"  # a field of length -1
_US_2000 = 946_684_800_000_000  # 2000-01-01 (PostgreSQL's epoch) in microseconds since 1970
_DAYS_2000 = 10_957
# A numeric(p,s) column is encoded in bulk when its unscaled values (p digits) and its fractions
# aligned to whole base-10000 digits fit 18 decimal digits (an int64), and each text is at most
# 38 characters: Arrow reads a decimal text of more than 38 digits wrongly without an error
# (apache/arrow#49817), and refuses the shorter ones numeric(p,s) does not hold as they are.
# Other columns and texts are encoded value by value.
_BULK_NUMERIC_DIGITS = 18
_ARROW_EXACT = 38
# Fixed-width types: the Arrow type a column is cast to first (a safe cast: a value that does not
# fit raises), its NumPy type, and the value's big-endian layout.
_FIXED = {
    "bigint": (pa.int64(), "<i8", ">i8", 8),
    "integer": (pa.int32(), "<i4", ">i4", 4),
    "double precision": (pa.float64(), "<f8", ">f8", 8),
    "boolean": (pa.uint8(), "u1", "u1", 1),
}


def copy_rows(table: pa.Table, types: Sequence[str]) -> pa.Buffer:
    """The binary COPY rows of `table` (HEADER and TRAILER not included), each column encoded
    as the PostgreSQL type named in `types` (one per column, in order)."""
    if len(types) != table.num_columns:
        raise ValueError(f"{table.num_columns} columns but {len(types)} types")
    rows = table.num_rows
    if not rows:
        return pa.py_buffer(b"")
    fields = [_fields(table.column(i).combine_chunks(), kind) for i, kind in enumerate(types)]
    count = pa.repeat(_bytes(struct.pack(">h", len(fields))), rows)
    joined = pc.binary_join_element_wise(count, *fields, _bytes(b""))
    offsets = np.frombuffer(joined.buffers()[1], np.int64, rows + 1, joined.offset * 8)
    return joined.buffers()[2][int(offsets[0]) : int(offsets[-1])]


def _fields(array: pa.Array, kind: str) -> pa.Array:
    """One column's COPY fields (length word and bytes, or -1 for NULL), a large_binary array."""
    rows = len(array)
    if array.null_count == rows:
        return pa.repeat(_bytes(_NULL), rows)
    if kind in _FIXED:
        arrow_type, dtype, wire, width = _FIXED[kind]
        fields = _fixed_width(_values(array.cast(arrow_type), dtype), wire, width)
    elif kind == "timestamptz":
        micros = _values(array.cast(pa.timestamp("us", array.type.tz)).cast(pa.int64()), "<i8")
        fields = _fixed_width(micros - _US_2000, ">i8", 8)
    elif kind == "date":
        fields = _fixed_width(_values(array.cast(pa.int32()), "<i4") - _DAYS_2000, ">i4", 4)
    elif kind.startswith("numeric"):
        fields = _numeric(array, kind)
    elif kind in ("text", "jsonb", "bytea"):
        data = array.cast(pa.large_binary())
        if kind == "jsonb":  # jsonb's binary input: format version 1, then the JSON text
            data = pc.binary_join_element_wise(pa.repeat(_bytes(b"\x01"), rows), data, _bytes(b""))
        lengths = _values(pc.binary_length(data), "<i8").astype(">i4")
        fields = pc.binary_join_element_wise(_fixed_width_array(lengths.tobytes(), rows, 4), data, _bytes(b""))
    else:
        raise ValueError(f"no binary COPY encoding for {kind!r} values (only NULLs)")
    return fields if array.null_count == 0 else pc.if_else(pc.is_valid(array), fields, _bytes(_NULL))


def _values(array: pa.Array, dtype: str) -> np.ndarray:
    """A fixed-width array's values as NumPy sees its buffer (a NULL's slot holds any value: its
    field is replaced). Not `to_numpy`, which imports pandas."""
    return np.frombuffer(array.buffers()[1], dtype, len(array), array.offset * np.dtype(dtype).itemsize)


def _bytes(value: bytes) -> pa.Scalar:
    # Made when used, not at import: pyarrow's first conversion of a Python value imports pandas
    # unless the Spark task said first that it has none (chunk_writer.arrow_without_pandas).
    return pa.scalar(value, pa.large_binary())


def _fixed_width(values: np.ndarray, dtype: str, width: int) -> pa.Array:
    """Fields of one fixed width: the length word, then each value big-endian."""
    packed = np.empty(len(values), dtype=[("length", ">i4"), ("value", dtype)])
    packed["length"] = width
    packed["value"] = values
    return _fixed_width_array(packed.tobytes(), len(values), 4 + width)


def _fixed_width_array(data: bytes, rows: int, width: int) -> pa.Array:
    offsets = np.arange(0, width * (rows + 1), width, dtype=np.int64)
    return pa.Array.from_buffers(pa.large_binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _numeric(array: pa.Array, kind: str) -> pa.Array:
    """numeric(p,s) fields from decimal texts: in bulk through Arrow's decimal type when every
    unscaled value and its aligned fraction fit an int64 and Arrow reads every text exactly,
    else value by value."""
    precision, scale = numeric_precision_scale(kind)
    pad = -scale % 4  # base-10000 digits are aligned on the decimal point
    if precision <= _BULK_NUMERIC_DIGITS and scale + pad <= _BULK_NUMERIC_DIGITS and _longest(array) <= _ARROW_EXACT:
        try:
            decimals = array.cast(pa.decimal128(precision, scale))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # a text Arrow does not read as numeric(p,s) exactly: encoded value by value below
        else:
            return _numeric_bulk(decimals, precision, scale, pad)
    fields = [None if text is None else _numeric_field(text) for text in array.to_pylist()]
    return pa.array(fields, pa.large_binary())


def _longest(texts: pa.Array) -> int:
    return pc.max(pc.utf8_length(texts)).as_py() or 0


def _numeric_bulk(decimals: pa.Array, precision: int, scale: int, pad: int) -> pa.Array:
    """Fields of values whose unscaled integers (|v| < 10**precision) and aligned fractions fit an int64."""
    rows = len(decimals)
    # A decimal128 is a 16-byte little-endian integer: for |value| < 10**18 its low half is the int64.
    unscaled = np.frombuffer(decimals.buffers()[1], "<i8", 2 * rows, decimals.offset * 16)[0::2]
    whole, fraction = np.divmod(np.abs(unscaled), 10**scale)
    fraction = fraction * 10**pad
    whole_digits, fraction_digits = (precision - scale + 3) // 4, (scale + pad) // 4
    digits = whole_digits + fraction_digits
    groups = np.empty((rows, digits), ">i2")
    for position in range(whole_digits - 1, -1, -1):
        whole, groups[:, position] = np.divmod(whole, 10_000)
    for position in range(digits - 1, whole_digits - 1, -1):
        fraction, groups[:, position] = np.divmod(fraction, 10_000)
    packed = np.empty(
        rows,
        dtype=[
            ("length", ">i4"),
            ("ndigits", ">i2"),
            ("weight", ">i2"),
            ("sign", ">u2"),
            ("dscale", ">i2"),
            ("digits", ">i2", (digits,)),
        ],
    )
    packed["length"] = 8 + 2 * digits
    packed["ndigits"] = digits
    packed["weight"] = whole_digits - 1
    packed["sign"] = np.where(unscaled < 0, 0x4000, 0)
    packed["dscale"] = scale
    packed["digits"] = groups  # leading and trailing zero digits are allowed: PostgreSQL strips them
    return _fixed_width_array(packed.tobytes(), rows, 4 + 8 + 2 * digits)


def _numeric_field(text: str) -> bytes:
    """One numeric field from a finite decimal's text, exactly (the column's typmod then applies,
    as for text input), whatever its form: exponents, leading zeros, trailing zeros after the
    point (dropped: they change nothing, and PostgreSQL refuses more than 16,383 of them)."""
    sign, digits, exponent = Decimal(text).as_tuple()
    if not isinstance(exponent, int):
        raise ValueError(f"{text!r} is not a finite decimal")
    number = "".join(map(str, digits)).lstrip("0")
    if exponent < 0:  # in one cut: a record may carry a million zeros after the point
        dropped = min(len(number) - len(number.rstrip("0")), -exponent)
        number, exponent = number[: len(number) - dropped], exponent + dropped
    if not number:
        return struct.pack(">ihhHh", 8, 0, 0, 0, 0)  # zero: no digits
    if exponent >= 0:
        whole, fraction = number + "0" * exponent, ""
    else:
        point = len(number) + exponent  # digits before the point; <= 0: zeros follow the point first
        whole, fraction = (number[:point], number[point:]) if point > 0 else ("", "0" * -point + number)
    whole = "0" * (-len(whole) % 4) + whole  # aligned on the point: whole base-10000 digits each side
    aligned = whole + fraction + "0" * (-len(fraction) % 4)
    groups = [int(aligned[i : i + 4]) for i in range(0, len(aligned), 4)]
    weight, dscale = len(whole) // 4 - 1, len(fraction)
    body = struct.pack(f">hhHh{len(groups)}h", len(groups), weight, 0x4000 if sign else 0, dscale, *groups)
    return struct.pack(">i", len(body)) + body
