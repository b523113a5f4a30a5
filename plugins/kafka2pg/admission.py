"""Record admission: one Kafka record's value bytes -> the row's typed values, or the reason it
goes to quarantine. Pure rules, per column type, for everything PostgreSQL would refuse or alter.

Decided before any write (the stage step runs it inside each Spark task), so no record, whatever
its bytes, reaches PostgreSQL in a form the database refuses or silently changes. The rules are
listed, per column type, in docs/design.md ("What lands and what goes to quarantine").
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from operator import attrgetter
from typing import Annotated, Any, NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

# A btree index entry holds at most 2704 bytes (a third of an 8 kB page); a business key over
# that makes promotion fail ("index row requires N bytes").
KEY_INDEX_LIMIT = 2704
# Per-column overhead counted on top of the key's bytes: a varlena header and alignment padding,
# plus the index tuple's own header. Conservative, so a key admitted here always fits.
_KEY_COLUMN_OVERHEAD = 8
_KEY_TUPLE_OVERHEAD = 16
_SHORT_KEY_CHARS = KEY_INDEX_LIMIT - _KEY_COLUMN_OVERHEAD - _KEY_TUPLE_OVERHEAD

INT_RANGES = {"bigint": (-(2**63), 2**63 - 1), "integer": (-(2**31), 2**31 - 1)}
# Years every client reads back (Python's datetime, Spark, JDBC): PostgreSQL's own range is wider,
# but a value outside 1-9999 would land and then fail whoever reads it.
MIN_YEAR, MAX_YEAR = 1, 9999
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EPOCH_UNITS = {"seconds": 1_000_000, "milliseconds": 1_000, "microseconds": 1}

_SHOWN = 40  # characters of an offending value quoted in a reason

_TIMESTAMP = re.compile(
    r"(?P<year>[+-]?\d+)-(?P<month>\d{2})-(?P<day>\d{2})"
    r"(?:[Tt ](?P<hour>\d{2}):(?P<minute>\d{2})(?::(?P<second>\d{2})(?:[.,](?P<fraction>\d+))?)?)?"
    r"(?P<zone>Z|z|[+-]\d{2}(?::?\d{2})?)?",
    re.ASCII,
)
_DATE = re.compile(r"(?P<year>[+-]?\d+)-(?P<month>\d{2})-(?P<day>\d{2})", re.ASCII)
_INTEGER_TOKEN = re.compile(rb"-?(?:0|[1-9][0-9]*)")
# A JSON number token (RFC 8259's grammar): what a string must hold for a `quoted_numbers` column.
_NUMBER_TOKEN = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


_NUMERIC_TYPE = re.compile(r"numeric\(\s*([0-9]+)\s*,\s*([0-9]+)\s*\)", re.ASCII)


def numeric_precision_scale(pg_type: str) -> tuple[int, int]:
    """Precision and scale of a `numeric(p,s)` column type (as `kafka2pg.config` writes it)."""
    match = _NUMERIC_TYPE.fullmatch(pg_type)
    if match is None:
        raise ValueError(f"not a numeric(p,s) column type: {pg_type!r}")
    return int(match[1]), int(match[2])


class Refused(ValueError):
    """A record (or one field of it) that must go to quarantine; the message is the reason."""


class _NoObject(Refused):
    """The value_root's object (or the fallback's) is null or missing: `shown` names the field
    on the way that is, `state` says which."""

    def __init__(self, shown: str, key: str, state: str) -> None:
        super().__init__(f"field {shown!r} (the pipeline's {key}): {state}")
        self.shown, self.state = shown, state


@dataclass(frozen=True)
class FieldRule:
    """How one target column is filled from one field of the JSON value's object (the record's own,
    the one at the pipeline's value_root, or its fallback where that is null), or from the field at
    `path` from the record's own object, whatever the root (a Debezium event's `op` or
    `source.ts_ms` beside its `after`)."""

    name: str
    field: str
    type: str
    required: bool = False
    epoch: str | None = None  # timestamptz (a unit) or date (days): how a JSON number is read; None refuses numbers
    quoted_numbers: bool = False  # number kinds: a JSON string holding a number is read as that number
    path: tuple[str, ...] = ()  # the field's names from the record's own object; () for `field` in the root

    @property
    def kind(self) -> str:
        return "numeric" if self.type.startswith("numeric") else self.type

    @property
    def precision_scale(self) -> tuple[int, int]:
        return numeric_precision_scale(self.type)


class Admitted(NamedTuple):
    """The outcome for one record: `values` (one per rule, in order) or a quarantine `reason`."""

    values: tuple | None
    reason: str | None = None


# The Arrow type of each kind of rule's values.
ARROW_TYPES = {
    "text": pa.string(),
    "bigint": pa.int64(),
    "integer": pa.int32(),
    "double precision": pa.float64(),
    "boolean": pa.bool_(),
    "timestamptz": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "jsonb": pa.string(),
    "numeric": pa.string(),  # the decimal's exact text (kafka2pg.copy_binary encodes it)
}


class AdmittedBatch(NamedTuple):
    """The outcomes of a list of records, by column: each rule's values as an Arrow array of its
    ARROW_TYPES type (NULL for a refused record, and for a field null or missing), and each
    record's quarantine reason (None for an admitted record)."""

    columns: tuple[pa.Array, ...]
    reasons: list[str | None]

    def outcome(self, index: int) -> Admitted:
        reason = self.reasons[index]
        if reason is not None:
            return Admitted(None, reason)
        return Admitted(tuple(column[index].as_py() for column in self.columns))

    def refusing(self, refused: dict[int, str]) -> AdmittedBatch:
        """These outcomes with the records at `refused`'s indices refused, for its reasons."""
        reasons = list(self.reasons)
        for index, reason in refused.items():
            reasons[index] = reason
        mask = index_mask(refused, len(reasons))
        columns = tuple(pc.if_else(mask, pa.scalar(None, column.type), column) for column in self.columns)
        return AdmittedBatch(columns, reasons)


class RecordDecoder:
    """Decodes record values for one pipeline's columns; build once, call per list of records.

    Two paths, one rule set: `decode_strictly` is the definition (every rule in plain Python,
    field by field, naming the first field that breaks one); `admit` first takes a fast path
    (one typed msgspec parse in C per record, then the checks C does not make, column by column
    over the whole list, in Arrow where they can be) and hands every record the fast path has
    any doubt about to the strict path, so both always give the same outcome (property tests
    hold them to it).
    """

    def __init__(
        self,
        rules: Sequence[FieldRule],
        business_key: Sequence[str] = (),
        root: Sequence[str] = (),
        fallback: Sequence[str] = (),
        value_format: str = "json",
    ) -> None:
        """`root`: the path of fields from the record's JSON object to the object the rules' fields
        are in (a pipeline's `value_root`; empty: the record's object itself). `fallback`: the
        object they are read from instead where the root's is null or missing (a pipeline's
        `value_root_fallback`: a Debezium delete's `before`); empty: none, such a record is refused.
        `value_format`: `json`, or `schema_registry_json` (each value's JSON after the Schema
        Registry header, `registry_payloads`)."""
        self.registry_header = value_format == SCHEMA_REGISTRY_JSON
        self.rules = tuple(rules)
        self.root = tuple(root)
        self.fallback = tuple(fallback)
        self._converters = tuple(_converter(rule) for rule in self.rules)
        # Each rule's field as its names from the record's own object; named so in reasons.
        self._locations = tuple(rule.path or (*self.root, rule.field) for rule in self.rules)
        self._shown = tuple(".".join(location) for location in self._locations)
        self._shown_in_fallback = tuple(".".join(rule.path or (*self.fallback, rule.field)) for rule in self.rules)
        names = [r.name for r in self.rules]
        self._key_positions = tuple(names.index(k) for k in business_key)
        self._decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
        # Every field inside the root: one struct at the root's depth. A field outside it: a tree
        # of structs from the record's own object, each rule's value found by its attributes.
        if any(rule.path for rule in self.rules):
            self._fast_decoder, self._getters, self._unparsed = _fast_tree(self.rules, self._locations, self.root)
            self._depth = 0
        else:
            self._fast_decoder, record = _fast_decoder(self.rules, self.root)
            self._getters = tuple(attrgetter(f"f{index}") for index in range(len(self.rules)))
            self._unparsed = record and record()  # a record with every field absent
            self._depth = len(self.root)
        self._columns = tuple(_fast_column(rule) for rule in self.rules)

    @property
    def strict_only(self) -> bool:
        """Whether every record takes the strict path: msgspec cannot name one of the fields."""
        return self._fast_decoder is None

    def decode(self, value: bytes | None) -> Admitted:
        """The row's values, or the reason the record is quarantined. Never raises on data."""
        return self.admit([value]).outcome(0)

    def admit(self, values: Sequence[bytes | None]) -> AdmittedBatch:
        """`decode` of every record in `values`, by column. Never raises on data."""
        if not self.registry_header:
            return self._admit(values)
        payloads, refused = registry_payloads(values)
        admitted = self._admit(payloads)
        return admitted.refusing(refused) if refused else admitted

    def _admit(self, values: Sequence[bytes | None]) -> AdmittedBatch:
        if self._fast_decoder is None:  # every record takes the strict path
            columns = [pa.nulls(len(values), ARROW_TYPES[rule.kind]) for rule in self.rules]
            doubts = set(range(len(values)))
        else:
            records, doubts = self._parse(values)
            columns = [
                column(list(map(get, records)), doubts)
                for get, column in zip(self._getters, self._columns, strict=True)
            ]
            for rule, column in zip(self.rules, columns, strict=True):
                if rule.required and column.null_count:
                    doubts.update(_indices(pc.is_null(column)))
            self._check_key_sizes(columns, doubts)
        reasons: list[str | None] = [None] * len(values)
        if doubts:
            columns = self._decide_strictly(values, sorted(doubts), columns, reasons)
        return AdmittedBatch(tuple(columns), reasons)

    def _parse(self, values: Sequence[bytes | None]) -> tuple[list, set[int]]:
        """Each record as the fast path's parse reads it (the struct of the root's object, or of
        the record's own with `_fast_tree`), and the records it cannot parse (in `records` with
        every field absent)."""
        parse, unparsed, depth = self._fast_decoder.decode, self._unparsed, self._depth
        records: list = []
        doubts: set[int] = set()
        for index, value in enumerate(values):
            # A NUL can hide in a string only as an escape; msgspec leaves strings it skips or keeps raw unchecked.
            if value and b"\\u0000" not in value and not _may_nest_too_deeply(value):
                try:
                    if not value.isascii():
                        value.decode("utf-8")
                    record = parse(value)
                    if depth:  # down the value_root's objects to the record's fields
                        for _ in range(depth):
                            record = record.inner
                    records.append(record)
                    continue
                except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                    pass
            records.append(unparsed)
            doubts.add(index)
        return records, doubts

    def _check_key_sizes(self, columns: list[pa.Array], doubts: set[int]) -> None:
        """Records whose business key may be over the index limit (`_check_key_size`'s count:
        a text, numeric or jsonb value its UTF-8 bytes, any other value or a NULL 8): to the
        strict path."""
        if not self._key_positions:
            return
        fixed, sizes = _KEY_TUPLE_OVERHEAD, pa.repeat(pa.scalar(0, pa.int64()), len(columns[0]))
        for position in self._key_positions:
            column = columns[position]
            fixed += _KEY_COLUMN_OVERHEAD
            if pa.types.is_string(column.type):
                length = pc.fill_null(pc.binary_length(column).cast(pa.int64()), pa.scalar(8, pa.int64()))
                sizes = pc.add(sizes, length)
            else:
                fixed += 8
        doubts.update(_indices(pc.greater(sizes, pa.scalar(KEY_INDEX_LIMIT - fixed, pa.int64()))))

    def _decide_strictly(
        self, values: Sequence[bytes | None], doubts: list[int], columns: list[pa.Array], reasons: list
    ) -> list[pa.Array]:
        decided = [self._decide(values[index]) for index in doubts]
        for index, admitted in zip(doubts, decided, strict=True):
            reasons[index] = admitted.reason
        mask = index_mask(doubts, len(values))
        return [
            pc.replace_with_mask(
                column, mask, pa.array([None if a.values is None else a.values[position] for a in decided], column.type)
            )
            for position, column in enumerate(columns)
        ]

    def decode_strictly(self, value: bytes | None) -> Admitted:
        """`decode` without the fast path: the rules, field by field."""
        if self.registry_header:
            (payload,), refused = registry_payloads([value])
            return Admitted(None, refused[0]) if refused else self._decide(payload)
        return self._decide(value)

    def _decide(self, value: bytes | None) -> Admitted:
        """The rules, field by field, on a JSON value (after its Schema Registry header, if any)."""
        try:
            return Admitted(self._values(value))
        except Refused as refused:
            return Admitted(None, str(refused))

    def _values(self, value: bytes | None) -> tuple:
        if value is None:
            raise Refused("value is null (a tombstone)")
        if not value:
            raise Refused("value is empty (0 bytes)")
        if not self.registry_header and _looks_registry_framed(value):
            raise Refused(
                f"value starts with a Schema Registry header (magic byte 0, schema id {_schema_id(value)}) before "
                f"its JSON: set the pipeline's value_format: {SCHEMA_REGISTRY_JSON}"
            )
        _check_utf8(value, "value")
        _check_depth(value)
        try:
            fields = self._decoder.decode(value)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise Refused(_malformed(value, exc)) from None
        record = fields
        fields, root, names = self._root_object(record)
        objects: dict[tuple[str, ...], dict | None] = {(): record, root: fields}
        values = []
        for rule, convert, shown, location in zip(self.rules, self._converters, names, self._locations, strict=True):
            if rule.path:
                token = _object_at(objects, location[:-1], self._decoder).get(location[-1])
            else:
                token = fields.get(rule.field)
            raw = None if token is None else bytes(token)
            if raw is None or raw == b"null":
                if rule.required:
                    raise Refused(f"field {shown!r}: required but {'missing' if raw is None else 'null'}")
                values.append(None)
                continue
            try:
                values.append(convert(raw))
            except Refused as refused:
                raise Refused(f"field {shown!r}: {refused}") from None
            except (ArithmeticError, ValueError, RecursionError, msgspec.DecodeError) as exc:
                # A rule that did not foresee this value: still a reason, never a stopped task.
                raise Refused(f"field {shown!r}: cannot be decoded ({type(exc).__name__}: {exc})"[:300]) from None
        self._check_key_size(values)
        return tuple(values)

    def _root_object(self, record: dict) -> tuple[dict, tuple[str, ...], tuple[str, ...]]:
        """The fields of the object the rules' fields are in (the root's, or the fallback's where
        the root's is null or missing), its path, and the rules' fields named from there."""
        try:
            return self._descend(record, self.root, "value_root"), self.root, self._shown
        except _NoObject as absent:
            if not self.fallback:
                raise Refused(str(absent)) from None
            try:
                return (
                    self._descend(record, self.fallback, "value_root_fallback"),
                    self.fallback,
                    self._shown_in_fallback,
                )
            except Refused as neither:  # both named; once where they share the field that is not there
                if isinstance(neither, _NoObject) and neither.shown == absent.shown:
                    raise Refused(
                        f"field {absent.shown!r} (the pipeline's value_root and value_root_fallback): {absent.state}"
                    ) from None
                raise Refused(f"{absent}, and {neither}") from None

    def _descend(self, fields: dict, path: tuple[str, ...], key: str) -> dict:
        """The fields of the object at `path` from `fields` (the record's own object)."""
        for depth, name in enumerate(path):
            shown = ".".join(path[: depth + 1])
            token = fields.get(name)
            raw = None if token is None else bytes(token)
            if raw is None or raw == b"null":
                raise _NoObject(shown, key, "missing" if raw is None else "null")
            if raw[:1] != b"{":
                raise Refused(
                    f"field {shown!r} (the pipeline's {key}): expected a JSON object, got {_describe_token(raw)}"
                )
            fields = self._decoder.decode(raw)
        return fields

    def _check_key_size(self, values: list) -> None:
        if not self._key_positions:
            return
        # A character is at most 4 bytes in UTF-8: most keys are settled without encoding them.
        if len(self._key_positions) == 1:
            key = values[self._key_positions[0]]
            if not isinstance(key, str) or 4 * len(key) <= _SHORT_KEY_CHARS:
                return
        size = _KEY_TUPLE_OVERHEAD
        for position in self._key_positions:
            size += _datum_size(values[position]) + _KEY_COLUMN_OVERHEAD
        if size > KEY_INDEX_LIMIT:
            raise Refused(f"business key is {size} bytes, over the {KEY_INDEX_LIMIT}-byte index limit")


def _object_at(objects: dict[tuple[str, ...], dict | None], path: tuple[str, ...], decoder) -> dict:
    """The fields of the object at `path` from the record's own object (`objects` holds those
    decoded so far, by path, and takes the ones decoded here); an empty mapping where a field on
    the way is missing or null (the field read there is then missing). A field on the way that is
    not an object refuses the record."""
    known = objects.get(path, False)
    if known is not False:
        return known or {}
    above = _object_at(objects, path[:-1], decoder)
    token = above.get(path[-1])
    raw = None if token is None else bytes(token)
    found = None
    if raw is not None and raw != b"null":
        if raw[:1] != b"{":
            raise Refused(f"field {'.'.join(path)!r}: expected a JSON object, got {_describe_token(raw)}")
        found = decoder.decode(raw)
    objects[path] = found
    return found or {}


# ---------------------------------------------------------------- the fast path

_DOUBT = object()
_ABSENT = msgspec.Raw(b"")


def _fast_decoder(rules: Sequence[FieldRule], root: Sequence[str]) -> tuple[msgspec.json.Decoder | None, type | None]:
    """The fast path's parser of a whole value, and the record it finds (the `_fast_struct`)
    nested in an object per field of `root` (each an `inner` attribute); (None, None) when
    msgspec cannot name a field (a quote, a backslash or a control character in its name): such
    a pipeline's records all take the strict path."""
    if _unnameable((*root, *(rule.field for rule in rules))):
        return None, None
    record = parsed = _fast_struct(rules)
    for name in reversed(root):  # required and not null: a record without it is doubted
        parsed = msgspec.defstruct("FastRoot", [("inner", parsed)], rename={"inner": name})
    return msgspec.json.Decoder(parsed), record


def _unnameable(names: Iterable[str]) -> bool:
    """Whether msgspec cannot name one of these fields (a quote, a backslash or a control character)."""
    return any(re.search(r'["\\\x00-\x1f]', name) for name in names)


def _fast_struct(rules: Sequence[FieldRule]) -> type:
    """A msgspec Struct reading every rule's field with the strictest type msgspec checks in C;
    kinds whose rules need the token's text (numbers, jsonb, epoch timestamps) stay raw."""
    fields = [(f"f{index}", *_fast_field(rule)) for index, rule in enumerate(rules)]
    rename = {f"f{index}": rule.field for index, rule in enumerate(rules)}
    return msgspec.defstruct("FastRecord", fields, rename=rename)


def _fast_tree(
    rules: Sequence[FieldRule], locations: Sequence[tuple[str, ...]], root: Sequence[str]
) -> tuple[msgspec.json.Decoder | None, tuple | None, Any]:
    """The fast path's parser where some rule reads a field outside the root: a struct per
    object on the rules' paths, from the record's own object, the root's objects required (a
    record without one is doubted), the others None when missing or null (their fields then
    missing; a non-object there is doubted); with each rule's getter from the record's struct,
    and a record with every field absent. (None, None, None) when msgspec cannot name a field (a
    quote, a backslash or a control character in a name) or one rule's field is an object another
    reads inside (the config refuses this one): the strict path only."""
    if _unnameable(name for location in (root, *locations) for name in location):
        return None, None, None
    tree: dict = {}  # a field's name -> its rule's index, or the fields of the object it names
    for index, location in enumerate(locations):
        node = tree
        for name in location[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                return None, None, None
        if location[-1] in node:
            return None, None, None
        node[location[-1]] = index
    node = tree
    for name in root:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            return None, None, None
    getters: list = [None] * len(rules)
    numbers = itertools.count()

    def struct(node: dict, steps: tuple[tuple[str, bool], ...], root_below: tuple[str, ...] | None):
        """The struct of one object's fields, `steps` the (attribute, may be None) to it."""
        fields: list = []
        required: dict[str, Any] = {}  # the root's objects: attribute -> a record of them absent
        rename = {}
        for name, child in node.items():
            if isinstance(child, int):
                attribute = f"f{child}"
                spec, default = _fast_field(rules[child])
                fields.append((attribute, spec, default))
                getters[child] = _fast_getter(steps, attribute, default)
            else:
                attribute = f"n{next(numbers)}"
                on_root = root_below is not None and root_below[:1] == (name,)
                below = root_below[1:] if on_root else None
                inner, absent = struct(child, (*steps, (attribute, not on_root)), below)
                if on_root:
                    fields.append((attribute, inner))
                    required[attribute] = absent
                else:
                    fields.append((attribute, inner | None, None))
            rename[attribute] = name
        made = msgspec.defstruct("FastObject", fields, rename=rename, kw_only=True)
        return made, lambda: made(**{attribute: absent() for attribute, absent in required.items()})

    record, absent = struct(tree, (), tuple(root))
    return msgspec.json.Decoder(record), tuple(getters), absent()


def _fast_getter(steps: tuple[tuple[str, bool], ...], attribute: str, absent: Any):
    """A function of a record's struct: its field `attribute` in the object `steps` lead to, or
    `absent` where an object on the way is None (missing or null)."""
    if not any(may_be_none for _, may_be_none in steps):
        return attrgetter(".".join((*(step for step, _ in steps), attribute)))

    def get(record):
        for step, _ in steps:
            record = getattr(record, step)
            if record is None:
                return absent
        return getattr(record, attribute)

    return get


def _fast_field(rule: FieldRule) -> tuple[Any, Any]:
    """The msgspec type and default (when absent) the fast path reads one rule's field with."""
    kind = rule.kind
    if not _typed(rule):  # the rule's converter reads the raw token
        return msgspec.Raw, _ABSENT
    if kind == "text":
        return str | None, None
    if kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        return Annotated[int, msgspec.Meta(ge=low, le=high)] | None, None
    if kind == "boolean":
        return bool | None, None
    if kind == "date":
        return date | None, None
    return msgspec.Raw, _ABSENT


# Kinds msgspec parses and checks in C (`_fast_struct`); the others' tokens stay raw.
_TYPED_KINDS = ("text", "bigint", "integer", "boolean", "date")


def _typed(rule: FieldRule) -> bool:
    """Whether msgspec's typed parse reads the rule's field: its kind's plain JSON form only (a
    number as a string, a date as a day count: the converter reads the raw token)."""
    return rule.kind in _TYPED_KINDS and not rule.quoted_numbers and rule.epoch is None


# Whatever a fast check raises is a doubt, never a reason: the strict path finds the reason.
_FAST_DOUBTS = (Refused, ArithmeticError, ValueError, RecursionError, msgspec.DecodeError)


# Scalars passed to compute functions are Arrow scalars of the column's type: a Python value would
# be converted by pyarrow, which then imports pandas (kafka2pg.chunk_writer.arrow_without_pandas).


def unreadable_instants(stamps: pa.Array) -> list[int]:
    """The indices of the instants (timestamp[us, UTC]) outside years 1-9999 in UTC: PostgreSQL
    stores a timestamptz up to year 294276, but client libraries cannot read one past 9999."""
    micros = stamps.cast(pa.int64())
    low, high = (pa.scalar(bound, pa.int64()) for bound in (_EPOCH_LOW, _EPOCH_HIGH))
    return _indices(pc.or_(pc.less(micros, low), pc.greater(micros, high)))


def _indices(mask: pa.Array) -> list[int]:
    return pc.indices_nonzero(mask).to_pylist()


def index_mask(indices: Iterable[int], length: int) -> pa.Array:
    """A boolean array of `length`, true at `indices`."""
    chosen = [False] * length
    for index in indices:
        chosen[index] = True
    return pa.array(chosen, pa.bool_())


def _fast_column(rule: FieldRule):
    """The fast path for one rule's column: a function of the fields the parse gave (msgspec's
    values, or raw tokens) and the set of doubted records, returning the column's Arrow array
    (NULL for a JSON null, a missing field or a doubted value) and adding to the set."""
    arrow = ARROW_TYPES[rule.kind]
    if _typed(rule):
        return lambda items, doubts: pa.array(items, arrow)
    if rule.kind == "jsonb":
        return lambda items, doubts: _fast_jsonb(_tokens(items), doubts)
    if rule.kind == "numeric":
        plain = "^(?:" + _plain_decimal(*rule.precision_scale).pattern.decode() + ")$"
        convert = _converter(rule)
        return lambda items, doubts: _fast_numeric(_tokens(items), plain, convert, doubts)
    if rule.kind == "timestamptz" and rule.epoch is None:
        return lambda items, doubts: _fast_timestamps(_tokens(items), doubts)
    convert = _converter(rule)
    return lambda items, doubts: pa.array(_each(_tokens(items), convert, doubts), arrow)


def _tokens(items: Sequence[msgspec.Raw]) -> list[bytes | None]:
    """Raw tokens as bytes, None for a JSON null or a missing field (an empty token)."""
    return [None if token in _NO_TOKEN else token for token in map(bytes, items)]


_NO_TOKEN = (b"", b"null")


def _each(tokens: list[bytes | None], check, doubts: set[int]) -> list:
    """`check` of each token; a token it doubts or raises on is doubted (its value None)."""
    values = []
    for index, token in enumerate(tokens):
        value = None
        if token is not None:
            try:
                value = check(token)
            except _FAST_DOUBTS:
                value = _DOUBT
            if value is _DOUBT:
                doubts.add(index)
                value = None
        values.append(value)
    return values


def _each_of(tokens: list[bytes | None], indices: list[int], check, doubts: set[int]) -> list:
    """`_each` of the tokens at `indices` only (doubts added by their index in `tokens`)."""
    doubted: set[int] = set()
    values = _each([tokens[index] for index in indices], check, doubted)
    doubts.update(indices[index] for index in doubted)
    return values


def _fast_numeric(tokens: list[bytes | None], plain: str, convert, doubts: set[int]) -> pa.Array:
    """Plain decimals numeric(p,s) surely holds are kept as written (one regex over the column);
    the rest go through the rule's converter."""
    binary = pa.array(tokens, pa.binary())
    odd = _indices(pc.invert(pc.match_substring_regex(binary, plain)))
    texts = binary.cast(pa.string())  # the record is valid UTF-8
    if not odd:
        return texts
    converted = _each_of(tokens, odd, convert, doubts)
    return pc.replace_with_mask(texts, index_mask(odd, len(tokens)), pa.array(converted, pa.string()))


def _fast_jsonb(tokens: list[bytes | None], doubts: set[int]) -> pa.Array:
    """`_to_jsonb` by column, for records already searched for NUL escapes: the tokens that may
    hold a number numeric cannot (a long exponent or digit run) are parsed, one by one."""
    binary = pa.array(tokens, pa.binary())
    suspects = pc.or_(
        pc.match_substring_regex(binary, _BIG_EXPONENT.pattern.decode()),
        pc.greater_equal(pc.binary_length(binary), pa.scalar(_LONG_DIGITS_RUN, pa.int32())),
    )
    for index in _indices(suspects):
        token = tokens[index]
        if _BIG_EXPONENT.search(token) or _LONG_DIGITS.search(token) or _may_print_long(token):
            try:
                _check_json_numbers(token)
            except _FAST_DOUBTS:
                doubts.add(index)
    return binary.cast(pa.string())  # the record is valid UTF-8


# ISO 8601 timestamp strings as most producers write them (a `T` or a space between date and
# time), with an offset (RFC 3339) or without one (UTC), in a form Arrow's cast reads exactly as
# `parse_timestamp` does: every field in range, a year 0001-9999, at most six digits after the
# point. Arrow's cast checks the day of the month and refuses the whole column for one day a
# month does not have: the column is then read token by token.
_ISO_TIME = (
    '"(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])'
    "[T ](?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]{1,6})?"
)
_ISO_TIMESTAMP = f'^{_ISO_TIME}(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"$'
_TIMESTAMP_ARROW = ARROW_TYPES["timestamptz"]


def _fast_timestamps(tokens: list[bytes | None], doubts: set[int]) -> pa.Array:
    """Timestamp strings by column: those of `_ISO_TIMESTAMP` cast by Arrow (and doubted where
    the instant in UTC leaves years 1-9999), the others parsed one by one (`_fast_timestamp`)."""
    binary = pa.array(tokens, pa.binary())
    iso = pc.match_substring_regex(binary, _ISO_TIMESTAMP)
    # Which of them have an offset, without a second regex over the column: a `Z` before the
    # closing quote, or a sign 7 bytes from the end (`+05:00"`), where a time without an offset
    # has a digit, `:` or `.`.
    zulu = pc.equal(pc.binary_slice(binary, -2, -1), pa.scalar(b"Z", pa.binary()))
    signed = pc.is_in(pc.binary_slice(binary, -7, -6), pa.array([b"+", b"-"], pa.binary()))
    offset = pc.and_(iso, pc.or_(zulu, signed))
    local = pc.and_not(iso, offset)
    others = _indices(pc.and_not(pc.is_valid(binary), pc.or_(offset, local)))
    texts, none = pc.binary_slice(binary, 1, -1).cast(pa.string()), pa.scalar(None, pa.string())
    try:
        stamps = pc.coalesce(
            pc.if_else(offset, texts, none).cast(_TIMESTAMP_ARROW),
            pc.if_else(local, texts, none).cast(pa.timestamp("us")).cast(_TIMESTAMP_ARROW),  # as UTC
        )
    except pa.ArrowInvalid:  # a day the month does not have
        return pa.array(_each(tokens, _fast_timestamp, doubts), _TIMESTAMP_ARROW)
    doubts.update(unreadable_instants(stamps))
    if not others:
        return stamps
    parsed = _each_of(tokens, others, _fast_timestamp, doubts)
    return pc.replace_with_mask(stamps, index_mask(others, len(tokens)), pa.array(parsed, _TIMESTAMP_ARROW))


_TIMESTAMP_TYPE = msgspec.json.Decoder(datetime)


def _fast_timestamp(token: bytes) -> datetime | object:
    """msgspec's RFC 3339 parser, which rounds sub-microsecond digits: a 7th digit after the
    point is left to the strict path (which refuses it)."""
    dot = token.find(b".")
    if b"\\" in token or dot > 0 and token[dot + 7 : dot + 8].isdigit():  # an escape can hide a digit
        return _DOUBT
    value = _TIMESTAMP_TYPE.decode(token)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)  # OverflowError beyond year 1-9999: the strict path refuses it


def rules_for(pipeline: Any) -> tuple[FieldRule, ...]:
    """The admission rules of a pipeline's columns (a `kafka2pg.config.Pipeline`)."""
    return tuple(
        FieldRule(
            c.name, c.field, c.type, c.required or c.name in pipeline.business_key, c.epoch, c.quoted_numbers, c.path
        )
        for c in pipeline.columns
    )


def decoder_for(pipeline: Any) -> RecordDecoder:
    return RecordDecoder(
        rules_for(pipeline),
        pipeline.business_key,
        pipeline.value_root,
        pipeline.value_root_fallback,
        pipeline.value_format,
    )


# ---------------------------------------------------------------- the Schema Registry's header

SCHEMA_REGISTRY_JSON = "schema_registry_json"
# The Confluent Schema Registry wire format a JSON Schema serializer writes (Confluent's
# KafkaJsonSchemaSerializer, Kafka Connect's JsonSchemaConverter): a magic byte 0, the schema's id
# (4 bytes, big-endian), then the JSON text.
_REGISTRY_MAGIC = 0
_REGISTRY_HEADER_BYTES = 5


def _schema_id(value: bytes) -> int:
    return int.from_bytes(value[1:_REGISTRY_HEADER_BYTES], "big")


def _looks_registry_framed(value: bytes) -> bool:
    """Whether `value` is a JSON object behind a Schema Registry header (in a pipeline of plain JSON)."""
    return (
        value[0] == _REGISTRY_MAGIC
        and len(value) > _REGISTRY_HEADER_BYTES
        and _first_character(value[_REGISTRY_HEADER_BYTES:]) == b"{"
    )


def _first_character(text: bytes) -> bytes:
    """The first byte of `text` that is not JSON's whitespace (empty if none)."""
    return text.lstrip(b" \t\r\n")[:1]


def registry_payloads(values: Sequence[bytes | None]) -> tuple[list[bytes | None], dict[int, str]]:
    """Each value's JSON after its Schema Registry header, and the reasons of the values without
    one (their payload None); a null or empty value stays as it is (a tombstone, an empty value).
    The schema id is not looked up: the columns' rules decide what the JSON may hold."""
    payloads: list[bytes | None] = []
    refused: dict[int, str] = {}
    for index, value in enumerate(values):
        if not value:
            payloads.append(value)
        elif value[0] != _REGISTRY_MAGIC or len(value) < _REGISTRY_HEADER_BYTES:
            payloads.append(None)
            start = _first_character(value)
            starts = f"plain JSON? it starts with {start.decode()!r}" if start in (b"{", b"[") else _show_bytes(value)
            refused[index] = (
                f"value has no Schema Registry header (a magic byte 0 and a 4-byte schema id; {starts}), and the "
                f"pipeline's value_format is {SCHEMA_REGISTRY_JSON}"
            )
        elif len(value) == _REGISTRY_HEADER_BYTES:
            payloads.append(None)
            refused[index] = f"value is a Schema Registry header (schema id {_schema_id(value)}) without JSON after it"
        else:
            payloads.append(value[_REGISTRY_HEADER_BYTES:])
    return payloads, refused


def _show_bytes(value: bytes) -> str:
    return "it starts with " + " ".join(f"0x{b:02x}" for b in value[:_REGISTRY_HEADER_BYTES])


def strict_only_note(pipeline: Any) -> str | None:
    """What a run's log says when none of the pipeline's records can take the fast path."""
    if not decoder_for(pipeline).strict_only:
        return None
    return (
        "a field name in its columns or value_root holds a quote or a backslash, which the fast JSON parser "
        "cannot name: every record is admitted field by field "
        "in Python (the strict path), two to three times the CPU per record"
    )


# ---------------------------------------------------------------- whole-value checks


def _check_utf8(data: bytes, what: str) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(
            f"{what} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at position {exc.start}: {exc.reason})"
        ) from None


# How deep a value may nest, its own object counting as one level: fixed, so that no parser
# (msgspec, Python's json in a Spark task at whatever stack depth, a client reading the jsonb
# back) decides it by its recursion limit.
MAX_JSON_DEPTH = 900
# The bytes that matter to nesting: brackets, quotes, backslashes, colons (found in C, handled in Python).
_JSON_SPECIAL = re.compile(rb'[\[\]{}:"\\]')


def _may_nest_too_deeply(value: bytes) -> bool:
    """Whether `value` has enough brackets to nest beyond MAX_JSON_DEPTH (inside strings too)."""
    return len(value) > 2 * MAX_JSON_DEPTH and value.count(b"{") + value.count(b"[") > MAX_JSON_DEPTH


def _check_depth(value: bytes) -> None:
    """Refuse a value nested deeper than MAX_JSON_DEPTH, naming the field whose value is. One pass
    over the value's special bytes, however its strings are escaped or left open (a backtracking
    tokenizer took quadratic time on an open string of escaped quotes)."""
    if not _may_nest_too_deeply(value):
        return
    depth, in_string, start, skip, key, member = 0, False, 0, -1, None, None
    for found in _JSON_SPECIAL.finditer(value):
        position = found.start()
        if position == skip:  # the byte a backslash escapes
            continue
        byte = value[position]
        if in_string:
            if byte == 0x5C:  # backslash
                skip = position + 1
            elif byte == 0x22:  # the closing quote
                in_string = False
                if depth == 1:
                    key = _json_string(value[start : position + 1])
        elif byte == 0x22:
            in_string, start = True, position
        elif byte in b"{[":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                where = "value" if member is None else f"field {_show(member)}"
                raise Refused(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels (the record counts as one)")
        elif byte in b"}]":
            depth -= 1
        elif byte == 0x3A and depth == 1 and key is not None:  # a colon after a member's name
            member = key


def _json_string(token: bytes) -> str:
    try:
        return json.loads(token)
    except ValueError:  # an escape JSON does not have: the value is refused anyway, shown as written
        return token[1:-1].decode("utf-8", "replace")


def _malformed(value: bytes, error: Exception) -> str:
    """Why msgspec refused a (valid UTF-8) value, named as precisely as the standard parser can."""
    if isinstance(error, RecursionError):
        return "value is JSON nested too deeply to store"
    text = value.decode("utf-8")
    try:
        document = json.loads(text, parse_constant=_no_constant, parse_int=Decimal)
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # "Invalid control character at": the position follows
        return f"value is not valid JSON ({what} at character {exc.pos}: {_show(text[exc.pos : exc.pos + 20])})"
    except Refused as refused:
        return f"value is not valid JSON ({refused})"
    except RecursionError:
        return "value is JSON nested too deeply to store"
    if not isinstance(document, dict):
        return f"value is a JSON {_json_kind(document)}, not an object"
    for name, item in document.items():
        problem = _text_problem(name) or _deep_text_problem(item)
        if problem:
            return f"field {_show(name)}: {problem}"
    return f"value is not valid JSON ({error})"


def _no_constant(name: str) -> None:
    raise Refused(f"{name} is not a JSON number")


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if value is None:
        return "null"
    return "number"


def _deep_text_problem(value: Any) -> str | None:
    """The first string (or object key) inside a JSON value PostgreSQL cannot store, described."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            problem = _text_problem(item)
            if problem:
                return problem
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains NUL (U+0000), not storable in text or jsonb"
    for char in text:
        if "\ud800" <= char <= "\udfff":
            return f"contains a lone surrogate U+{ord(char):04X} (not valid Unicode)"
    return None


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "…")


# ---------------------------------------------------------------- per-type converters


def _converter(rule: FieldRule):
    convert = _kind_converter(rule)
    if rule.quoted_numbers:
        return lambda raw: convert(_unquoted(raw))
    return convert


def _unquoted(raw: bytes) -> bytes:
    """For a `quoted_numbers` column: the number a JSON string holds; any other token unchanged."""
    if raw[:1] != b'"':
        return raw
    number = _quoted_number(raw)
    if number is None:
        raise Refused(f"expected a number or a string holding one, got {_describe_token(raw)}")
    return number


def _quoted_number(raw: bytes) -> bytes | None:
    """The number token a JSON string token holds (`"12.50"` -> `12.50`), exactly as written
    inside the quotes; None for any other token."""
    if raw[:1] == b'"' and _NUMBER_TOKEN.fullmatch(raw, 1, len(raw) - 1):
        return raw[1:-1]
    return None


def _not_a_number(raw: bytes, expected: str) -> Refused:
    """The refusal of a token that is not a JSON number; for a string holding one, how to read it."""
    hint = (
        ""
        if _quoted_number(raw) is None
        else ": set the column's quoted_numbers: true to read numbers written as strings"
    )
    return Refused(f"expected {expected}, got {_describe_token(raw)}{hint}")


def _kind_converter(rule: FieldRule):
    kind = rule.kind
    if kind == "text":
        return _to_text
    if kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        return lambda raw: _to_int(raw, kind, low, high)
    if kind == "double precision":
        return _to_double
    if kind == "boolean":
        return _to_bool
    if kind == "numeric":
        precision, scale = rule.precision_scale
        return lambda raw: _to_numeric(raw, precision, scale)
    if kind == "timestamptz":
        return lambda raw: _to_timestamp(raw, rule.epoch)
    if kind == "date":
        return _to_date if rule.epoch is None else _to_date_or_days
    if kind == "jsonb":
        return _to_jsonb
    raise ValueError(f"no admission rule for column type {rule.type!r}")


def _describe_token(raw: bytes) -> str:
    first = raw[:1]
    kind = {b'"': "a string", b"{": "an object", b"[": "an array", b"t": "a boolean", b"f": "a boolean"}.get(
        first, "a number"
    )
    return f"{kind} ({_show(raw.decode('utf-8'))})"


def _string(raw: bytes, expected: str) -> str:
    if raw[:1] != b'"':
        raise Refused(f"expected {expected}, got {_describe_token(raw)}")
    text = msgspec.json.decode(raw, type=str)
    if "\x00" in text:
        raise Refused("contains NUL (U+0000), not storable in text")
    return text


def _to_text(raw: bytes) -> str:
    return _string(raw, "a JSON string")


def _number(raw: bytes, expected: str) -> Decimal:
    if raw[:1] not in b"-0123456789" or not raw:
        raise _not_a_number(raw, expected)
    try:
        return Decimal(raw.decode("ascii"))
    except InvalidOperation:  # an exponent beyond what any decimal holds
        raise Refused(f"{_show(raw.decode())} is out of range for any number type") from None


def _to_int(raw: bytes, kind: str, low: int, high: int) -> int:
    if _INTEGER_TOKEN.fullmatch(raw) and len(raw) <= 20:
        value = int(raw)
    else:
        number = _number(raw, f"a JSON integer for {kind}")
        if number != number.to_integral_value():
            raise Refused(f"{_show(raw.decode())} is not a whole number, {kind} would round it")
        if not low <= number <= high:  # compared as decimals: never expand a huge exponent
            raise Refused(f"{_show(raw.decode())} is out of range for {kind} [{low}, {high}]")
        value = int(number)
    if not low <= value <= high:
        raise Refused(f"{_show(raw.decode())} is out of range for {kind} [{low}, {high}]")
    return value


def _to_double(raw: bytes) -> float:
    if raw[:1] not in b"-0123456789" or not raw:
        raise _not_a_number(raw, "a JSON number for double precision")
    value = float(raw)
    if math.isinf(value):
        raise Refused(f"{_show(raw.decode())} is out of range for double precision")
    if value == 0 and re.split(rb"[eE]", raw)[0].strip(b"-0."):
        raise Refused(f"{_show(raw.decode())} underflows double precision (it would become 0)")
    return value


def _to_bool(raw: bytes) -> bool:
    if raw == b"true":
        return True
    if raw == b"false":
        return False
    raise Refused(f"expected true or false, got {_describe_token(raw)}")


def _to_numeric(raw: bytes, precision: int, scale: int) -> str:
    """The number's decimal text (PostgreSQL parses it exactly) when numeric(p,s) holds it unchanged."""
    number = _number(raw, f"a JSON number for numeric({precision},{scale})")
    _sign, digits, exponent = number.as_tuple()
    if not any(digits):  # a zero's text must not grow with its exponent
        return format(number, "f") if -scale <= exponent <= 0 else "0"
    digits = list(digits)
    while exponent < 0 and digits[-1] == 0:  # trailing fractional zeros change nothing
        digits.pop()
        exponent += 1
    if exponent < -scale:
        raise Refused(
            f"{_show(raw.decode())} has {-exponent} digits after the point; numeric({precision},{scale}) keeps "
            f"{scale} and would round it"
        )
    integer_digits = max(0, len(digits) + exponent)
    if integer_digits > precision - scale:
        raise Refused(
            f"{_show(raw.decode())} has {integer_digits} digits before the point; numeric({precision},{scale}) "
            f"allows {precision - scale}"
        )
    return format(number, "f")


def _plain_decimal(precision: int, scale: int) -> re.Pattern:
    """Plain decimal tokens numeric(p,s) surely holds: no exponent, at most p-s and s digits."""
    integer = "0" if precision == scale else f"(?:0|[1-9][0-9]{{0,{precision - scale - 1}}})"
    fraction = f"(?:\\.[0-9]{{1,{scale}}})?" if scale else ""
    return re.compile(f"-?{integer}{fraction}".encode())


def _to_timestamp(raw: bytes, epoch: str | None) -> datetime:
    if raw[:1] == b'"':
        return parse_timestamp(_string(raw, "an ISO-8601 timestamp string"))
    if raw[:1] in b"-0123456789" and raw:
        if epoch is None:
            raise Refused(
                f"a number ({_show(raw.decode())}) for a timestamp: set the column's `epoch` (seconds, "
                "milliseconds or microseconds) to read numbers"
            )
        return _from_epoch(_number(raw, "a number"), epoch, raw)
    raise Refused(f"expected an ISO-8601 timestamp string, got {_describe_token(raw)}")


def parse_timestamp(text: str) -> datetime:
    """An ISO-8601 / RFC 3339 timestamp -> an aware datetime in UTC; no offset means UTC."""
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        raise Refused(f"{_show(text)} is not an ISO-8601 timestamp (e.g. 2025-11-25T10:00:00.123456Z)")
    year = _year(match["year"], text)
    fraction = match["fraction"] or ""
    if fraction[6:].strip("0"):
        raise Refused(f"{_show(text)} has sub-microsecond digits; timestamptz keeps microseconds")
    zone = _zone(match["zone"], text)
    try:
        local = datetime(
            year,
            int(match["month"]),
            int(match["day"]),
            int(match["hour"] or 0),
            int(match["minute"] or 0),
            int(match["second"] or 0),
            int(fraction[:6].ljust(6, "0")),
            tzinfo=zone,
        )
    except ValueError as exc:  # a day the month has not, an hour 24, ...
        raise Refused(f"{_show(text)} is not a valid timestamp ({exc})") from None
    try:
        return local.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00:00+00:01: a valid local time before year 1 in UTC
        raise Refused(
            f"timestamp out of range for timestamptz (outside years {MIN_YEAR}-{MAX_YEAR} in UTC): {_show(text)}"
        ) from None


def _year(digits: str, text: str, what: str = "timestamp out of range for timestamptz") -> int:
    year = int(digits)
    if not MIN_YEAR <= year <= MAX_YEAR:
        raise Refused(f"{what} (year {year}; kafka2pg accepts {MIN_YEAR}-{MAX_YEAR}): {_show(text)}")
    if len(digits) != 4:  # ISO-8601's expanded years (a sign, more digits) for a year 1-9999
        raise Refused(f"year written {digits!r}: kafka2pg reads years as four digits without a sign: {_show(text)}")
    return year


def _zone(zone: str | None, text: str) -> timezone:
    if zone is None or zone in "Zz":
        return UTC
    sign = -1 if zone[0] == "-" else 1
    digits = zone[1:].replace(":", "")
    hours, minutes = int(digits[:2]), int(digits[2:] or 0)
    if hours > 23 or minutes > 59:
        raise Refused(f"{_show(text)} has an impossible UTC offset {zone}")
    return timezone(sign * timedelta(hours=hours, minutes=minutes))


_EPOCH_LOW = (datetime(MIN_YEAR, 1, 1, tzinfo=UTC) - EPOCH) // timedelta(microseconds=1)
_EPOCH_HIGH = (datetime(MAX_YEAR, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) - EPOCH) // timedelta(microseconds=1)


def _from_epoch(number: Decimal, unit: str, raw: bytes) -> datetime:
    """Exact: the number's digits decide, never a rounded product (decimal arithmetic rounds to
    28 digits and flushes tiny values to 0)."""
    _sign, digits, exponent = number.as_tuple()
    places = len(str(EPOCH_UNITS[unit])) - 1  # fractional digits a microsecond allows in this unit
    # Trailing zeros after the point drop out, counted in one pass (a record's "1.000…0" may be
    # a megabyte long: taking them off one at a time would copy the digits once per zero).
    zeros = 0
    limit = min(-exponent, len(digits) - 1) if exponent < 0 else 0
    while zeros < limit and digits[-1 - zeros] == 0:
        zeros += 1
    if zeros:
        digits, exponent = digits[: len(digits) - zeros], exponent + zeros
    if any(digits) and exponent < -places:
        raise Refused(f"{_show(raw.decode())} {unit} has sub-microsecond digits; timestamptz keeps microseconds")
    if any(digits) and len(digits) + exponent + places > 19:  # beyond any year 1-9999 in microseconds
        micros = None
    else:
        micros = int(number.scaleb(places)) if any(digits) else 0
    if micros is None or not _EPOCH_LOW <= micros <= _EPOCH_HIGH:
        raise Refused(
            f"{_show(raw.decode())} {unit} since 1970 is out of range for timestamptz (years {MIN_YEAR}-{MAX_YEAR})"
        )
    return EPOCH + timedelta(microseconds=micros)


def _to_date(raw: bytes) -> date:
    if raw[:1] in b"-0123456789" and raw:
        raise Refused(
            f"a number ({_show(raw.decode())}) for a date: set the column's `epoch: days` to read numbers of days "
            "since 1970-01-01"
        )
    text = _string(raw, "an ISO-8601 date string (YYYY-MM-DD)")
    match = _DATE.fullmatch(text)
    if match is None:
        raise Refused(f"{_show(text)} is not an ISO-8601 date (YYYY-MM-DD)")
    year = _year(match["year"], text, "date out of range")
    try:
        return date(year, int(match["month"]), int(match["day"]))
    except ValueError as exc:
        raise Refused(f"{_show(text)} is not a valid date ({exc})") from None


def _to_date_or_days(raw: bytes) -> date:
    """A date column with `epoch: days`: an ISO-8601 date string, or a whole number of days since
    1970-01-01 (Debezium's io.debezium.time.Date, Avro's date)."""
    if raw[:1] != b"-" and not raw[:1].isdigit():
        return _to_date(raw)
    number = _number(raw, "an ISO-8601 date string or a number of days")
    if number != number.to_integral_value():
        raise Refused(f"{_show(raw.decode())} is not a whole number of days")
    if not _DAYS_LOW <= number <= _DAYS_HIGH:  # compared as decimals: never expand a huge exponent
        raise Refused(f"{_show(raw.decode())} days since 1970 is out of range for date (years {MIN_YEAR}-{MAX_YEAR})")
    return _EPOCH_DAY + timedelta(days=int(number))


_EPOCH_DAY = date(1970, 1, 1)
_DAYS_LOW = (date(MIN_YEAR, 1, 1) - _EPOCH_DAY).days
_DAYS_HIGH = (date(MAX_YEAR, 12, 31) - _EPOCH_DAY).days


def _to_jsonb(raw: bytes) -> str:
    """The field's JSON text exactly as written (PostgreSQL normalises it as jsonb does): a string
    stays a JSON string. Refused: NUL in a string or key, numbers PostgreSQL's numeric cannot hold."""
    if b"\\u0000" in raw:
        problem = _deep_text_problem(_json_document(raw))
        if problem:
            raise Refused(problem.replace("text or jsonb", "jsonb"))
    long = len(raw) >= _LONG_DIGITS_RUN
    if _BIG_EXPONENT.search(raw) or (long and (_LONG_DIGITS.search(raw) or _may_print_long(raw))):
        _check_json_numbers(raw)
    return raw.decode("utf-8")


# PostgreSQL's numeric (jsonb's numbers) holds up to 131072 digits before the point and 16383
# after it. A number beyond that has an exponent of 5 digits or more, or a run of 6000 digits
# (with a 4-digit exponent and fewer digits it is within both). PostgreSQL prints a number in
# full (1e99999 as 100,000 characters) and cannot print a value whose text passes 1 GB: a
# value's numbers may print at most PRINTED_EXPANSION characters more than they are written. A
# number prints at most |exponent| + 2 more than written, so a value under 6000 bytes with no
# exponent of 5 digits cannot pass that (6000 bytes of "1e9999," print 10 MB), and a longer one
# is parsed only when the sum over its exponents can (`_may_print_long`). The searches find
# every such number (and a few strings that look like one), the parse decides.
_NUMERIC_INTEGER_DIGITS = 131_072
_NUMERIC_FRACTION_DIGITS = 16_383
PRINTED_EXPANSION = 64 << 20
_BIG_EXPONENT = re.compile(rb"[eE][-+]?[0-9]{5}")
_EXPONENT = re.compile(rb"[0-9][eE][-+]?([0-9]{1,4})(?![0-9])")
_LONG_DIGITS_RUN = 6000
# Tried only where a run of digits starts: a value of many runs just short of that length
# would otherwise be scanned again from each of their digits.
_LONG_DIGITS = re.compile(rb"(?<![0-9])[0-9]{%d}" % _LONG_DIGITS_RUN)


def _may_print_long(raw: bytes) -> bool:
    """Whether the numbers of a jsonb value (or strings that look like them) with exponents of up
    to 4 digits may print PRINTED_EXPANSION characters more than written: |exponent| + 2 each."""
    bound = 0
    for match in _EXPONENT.finditer(raw):
        bound += int(match.group(1)) + 2
        if bound > PRINTED_EXPANSION:
            return True
    return False


def _check_json_numbers(raw: bytes) -> None:
    """Every number inside a jsonb value, checked against numeric's range, and what they print
    beyond what is written against PRINTED_EXPANSION."""
    left = PRINTED_EXPANSION

    def number(token: str) -> Decimal:
        nonlocal left
        checked = _checked_decimal(token)
        left -= _printed_length(checked) - len(token)
        if left < 0:
            raise ValueError(
                f"its numbers print more than {PRINTED_EXPANSION:,} characters longer than they are written "
                f"(e.g. {_show(token)}): PostgreSQL would store it and could not print it back as text"
            )
        return checked

    _json_document(raw, number)


def _printed_length(number: Decimal) -> int:
    """The characters PostgreSQL's numeric prints for `number`: every digit, no exponent, the
    fraction to its scale (0e5 prints 0, 1e-3 prints 0.001, 1.50 prints 1.50)."""
    sign, digits, exponent = number.as_tuple()
    whole = len(digits) + exponent if any(digits) else 1
    return sign + max(1, whole) + (1 - exponent if exponent < 0 else 0)


def _json_document(raw: bytes, number=Decimal) -> Any:
    """A JSON value parsed with exact numbers (`number` per token: no int-digit or float limits)."""
    try:
        return json.loads(raw, parse_float=number, parse_int=number)
    except InvalidOperation:  # an exponent beyond what Python's decimals hold: far beyond numeric's
        raise Refused("a number in it is out of range for PostgreSQL numeric") from None
    except ValueError as exc:
        raise Refused(str(exc)) from None
    except RecursionError:
        raise Refused("nested too deeply to check") from None


def _checked_decimal(token: str) -> Decimal:
    try:
        number = Decimal(token)
    except InvalidOperation:  # an exponent beyond what Python's decimals hold
        raise ValueError(f"number {_show(token)} is out of range for jsonb (PostgreSQL numeric)") from None
    _sign, digits, exponent = number.as_tuple()
    if len(digits) + exponent > _NUMERIC_INTEGER_DIGITS or -exponent > _NUMERIC_FRACTION_DIGITS:
        raise ValueError(f"number {_show(token)} is out of range for jsonb (PostgreSQL numeric)")
    return number


def _datum_size(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, Decimal):
        return len(str(value))
    return 8
