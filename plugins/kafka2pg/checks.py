"""The quality gate's SQL checks on a staged batch (DESIGN step 3), run in the gate's
transaction: completeness, explained offset gaps, provenance, required columns, column rules
and business-key duplicates, which are flagged to quarantine (or fail the batch). Stored in
kafka2pg.batch_checks. The gate itself (`kafka2pg.quality`) adds Great Expectations and decides."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from psycopg import Connection, sql

from kafka2pg.batch_store import Batch, key_probe_deferred, load_batch
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import INDEX_PROBES, NO_NESTED_LOOPS, planner, transaction
from kafka2pg.exceptions import RetentionLossError, WitnessMismatchError
from kafka2pg.kafka_offsets import TopicAdmin
from kafka2pg.kafka_reader import count_range
from kafka2pg.ledger import reset_floors
from kafka2pg.lifecycle import BatchState
from kafka2pg.locations import COMMAND
from kafka2pg.migrations import has_index, table_indexes
from kafka2pg.planner import account_gap
from kafka2pg.rows import WITHIN_BATCH_DUPLICATE, literal, range_predicate, rule_violations

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Check:
    """One check's outcome; `flagged` rows were moved to quarantine instead of failing."""

    name: str
    success: bool
    unexpected: int
    details: str
    flagged: int = 0
    # Left to promotion (the target's unique index), which runs it on a collision; or to run again
    # after a collision at promotion (`probe_keys_again`), until it has.
    deferred: bool = False


def store_checks(conn: Connection, batch_id: int, checks: list[Check]) -> None:
    conn.execute("DELETE FROM kafka2pg.batch_checks WHERE batch_id = %s", (batch_id,))
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO kafka2pg.batch_checks (batch_id, check_name, success, unexpected_count, details, deferred)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [(batch_id, c.name, c.success, c.unexpected, c.details, c.deferred) for c in checks],
        )


def _staging(pipeline: Pipeline) -> sql.Identifier:
    return sql.Identifier("kafka2pg", pipeline.staging_table)


def _target(pipeline: Pipeline) -> sql.Identifier:
    return sql.Identifier(pipeline.target_schema, pipeline.target_table)


def quarantined_rows(conn: Connection, pipeline: Pipeline, batch_id: int) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE batch_id = %s AND quarantine_reason IS NOT NULL")
    return conn.execute(query.format(_staging(pipeline)), (batch_id,)).fetchone()[0]


class ProbeAwaitsPrevious(Exception):
    """The gate of a batch validated while the batch before it is still being promoted would
    have to probe the target for promoted business keys, which must see that batch's rows: the
    caller rolls back and validates again once it is promoted."""


def run_checks(
    conn: Connection,
    pipeline: Pipeline,
    batch: Batch,
    probe_promoted_keys: bool,
    staged: dict[int, int],
    witnesses: GapWitnesses | None,
    previous_pending: bool = False,
) -> list[Check]:
    checks = [
        _completeness(conn, batch, staged),
        _offset_gaps_explained(conn, batch, witnesses),
        _provenance_unique(conn, pipeline, batch),
        _replay_scope(conn, pipeline, batch)
        if batch.kind == "replay"
        else _not_already_promoted(conn, pipeline, batch),
        _required_not_null(conn, pipeline, batch),
    ]
    checks += [_quarantine_rule_violations(conn, pipeline, batch, c) for c in pipeline.columns if _quarantines(c)]
    if pipeline.business_key:
        checks.append(_business_key_unique_in_batch(conn, pipeline, batch))
        if not probe_promoted_keys and _may_defer_key_probe(conn, pipeline, batch):
            checks.append(Check(KEY_PROMOTED_CHECK, True, 0, DEFERRED_KEY_PROBE, deferred=True))
        elif previous_pending:
            raise ProbeAwaitsPrevious(batch.batch_id)
        else:
            checks.append(_business_key_not_promoted(conn, pipeline, batch))
    # After every row flagged to quarantine: the rows left are those promoted.
    checks += [_range_kept(conn, pipeline, batch, c) for c in pipeline.columns if c.ranged and not _quarantines(c)]
    return checks


KEY_PROMOTED_CHECK = "business_key_not_already_promoted"
# The start of the key check's reason for a row whose business key is in the target already.
KEY_PROMOTED_REASON = "business key already promoted by batch "


DEFERRED = "deferred to promotion"


DEFERRED_KEY_PROBE = f"{DEFERRED}: the target's unique business-key index refuses a promoted key, which runs this check"


def _may_defer_key_probe(conn: Connection, pipeline: Pipeline, batch: Batch) -> bool:
    """Whether the check that no staged business key is in the target yet may be left to the
    target's unique index at promotion (`promote_batch` validates again with the probe when
    that index refuses a key). Only for live batches (a replay's keys are in the target by
    design), only with a valid unique index on exactly the business key, and only while the
    pipeline's previous batch found none: a stream that repeats keys across batches is probed
    up front, so a collision costs one failed insert when such keys start, not one per batch
    (the probe's cost: bench/README.md)."""
    if batch.kind != "live":
        return False
    previous = conn.execute(
        "SELECT c.unexpected_count FROM kafka2pg.batches b JOIN kafka2pg.batch_checks c"
        " ON c.batch_id = b.batch_id AND c.check_name = %s"
        " WHERE b.pipeline = %s AND b.batch_id < %s ORDER BY b.batch_id DESC LIMIT 1",
        (KEY_PROMOTED_CHECK, pipeline.name, batch.batch_id),
    ).fetchone()
    if previous is not None and previous[0] > 0:
        return False
    return _unique_key_index(conn, pipeline)


def _unique_key_index(conn: Connection, pipeline: Pipeline) -> bool:
    """Whether the target has a valid, whole-table unique index on exactly the business key's
    columns (in any order, no expressions, no included columns), checked at each insert (not
    DEFERRABLE: a violation at COMMIT would escape the promotion's collision handling)."""
    return has_index(conn, _target(pipeline), pipeline.business_key, unique=True)


def _with_stored_checks(conn: Connection, batch_id: int, fresh: list[Check]) -> list[Check]:
    """`fresh` and the batch's other stored SQL check results (not GX's), in the gate's order."""
    rows = conn.execute(
        "SELECT check_name, success, unexpected_count, details, deferred FROM kafka2pg.batch_checks"
        " WHERE batch_id = %s AND check_name NOT LIKE 'gx:%%' AND check_name <> ALL(%s)",
        (batch_id, [c.name for c in fresh]),
    ).fetchall()
    flagging = ("rule_", "business_key_")  # the checks that flag rows to quarantine instead of failing
    checks = [
        Check(n, ok, count, details, count if ok and n.startswith(flagging) else 0, deferred)
        for n, ok, count, details, deferred in rows
    ]
    return sorted(
        [*checks, *fresh], key=lambda c: (_CHECK_ORDER.index(c.name) if c.name in _CHECK_ORDER else 4.5, c.name)
    )


_CHECK_ORDER = (
    "staged_rows_equal_records_read",
    "offset_gaps_explained",
    "provenance_unique",
    "provenance_not_already_promoted",
    "required_columns_not_null",
    "business_key_unique_in_batch",  # after the rule_<column> checks (4.5)
)


def _quarantines(column) -> bool:
    declared = column.ranged or column.allowed is not None
    return declared and column.on_violation == "quarantine"


def _quarantine_rule_violations(conn: Connection, pipeline: Pipeline, batch: Batch, column) -> Check:
    """`on_violation: quarantine`: rows outside a column's declared range/values go to quarantine
    with the value (quoted, shortened to 40 characters as admission's reasons show values) and the
    rule; the GX expectation then checks what is left."""
    col = sql.Identifier(column.name)
    rules = rule_violations(column)
    flagged = 0
    for violated, rule in rules:
        flagged += conn.execute(
            sql.SQL(
                "UPDATE {staging} SET quarantine_reason = {prefix} || {value} || {suffix}"
                " WHERE batch_id = %s AND quarantine_reason IS NULL AND ({violated})"
            ).format(
                staging=_staging(pipeline),
                prefix=sql.Literal(f"{column.name} = "),
                value=_shown(col),
                suffix=literal(f" violates the declared {rule}"),
                violated=violated,
            ),
            (batch.batch_id,),
        ).rowcount
    described = " and ".join(rule for _, rule in rules)
    return Check(
        f"rule_{column.name}", True, flagged, f"{flagged} row(s) violating {described} flagged to quarantine", flagged
    )


def _range_kept(conn: Connection, pipeline: Pipeline, batch: Batch, column) -> Check:
    """`on_violation: fail`: no accepted row outside the column's declared range, compared exactly
    by PostgreSQL (GX compares floats, to which distinct values beyond 15-17 digits round alike)."""
    ((violated, rule),) = [(v, r) for v, r in rule_violations(column) if r == column.range_words]
    where = sql.SQL("FROM {} WHERE batch_id = %s AND quarantine_reason IS NULL AND ({})").format(
        _staging(pipeline), violated
    )
    (count,) = conn.execute(sql.SQL("SELECT count(*) {}").format(where), (batch.batch_id,)).fetchone()
    details = f"{count} row(s) violating the declared {rule}"
    if count:
        first = conn.execute(
            sql.SQL("SELECT kafka_partition, kafka_offset {} ORDER BY 1, 2 LIMIT 5").format(where), (batch.batch_id,)
        ).fetchall()
        details += " (e.g. " + ", ".join(f"p{p}@{o}" for p, o in first) + ")"
    return Check(f"rule_{column.name}", not count, count, details)


def _completeness(conn: Connection, batch: Batch, staged: dict[int, int]) -> Check:
    """Every planned partition's records read (by Spark) equal its staged rows (`staged_counts`,
    counted in this transaction)."""
    reads = conn.execute(
        "SELECT kafka_partition, records_read FROM kafka2pg.batch_partitions WHERE batch_id = %s ORDER BY 1",
        (batch.batch_id,),
    ).fetchall()
    rows = [(p, read, staged.get(p, 0)) for p, read in reads]
    bad = [(p, read, count) for p, read, count in rows if read is None or read != count]
    details = "; ".join(f"p{p}: read {read}, staged {count}" for p, read, count in bad)
    return Check("staged_rows_equal_records_read", not bad, len(bad), details or "every record read is staged")


@dataclass(frozen=True)
class GapWitnesses:
    """What a consumer outside Spark found in the ranges where the batch read fewer records than
    offsets, asked before the gate's lock, and the batch they were asked about: its `state` and
    claim `epoch` then and `reads`, its records read per partition as staged then."""

    state: BatchState
    epoch: int
    reads: dict[int, int]
    compacted: bool
    found: dict  # OffsetRange -> the witness's count

    def describe(self) -> str:
        return f"asked while it was {self.state} at claim epoch {self.epoch} with records read {self.reads}"

    def unwitnessed(self, batch: Batch, reads: dict[int, int]) -> list[int] | None:
        """The partitions of `batch` (locked, read `reads`) whose gap no witness counted, or None
        when the witnesses were asked about another staging of it: a different state, claim or
        reads, which a batch staged again with the same counts would hide."""
        if (self.state, self.epoch, self.reads) != (BatchState.STAGED, batch.epoch, reads):
            return None
        return [r.partition for r in batch.plan.ranges if reads.get(r.partition, 0) != r.size and r not in self.found]


def gap_witnesses(settings: Settings, pipeline: Pipeline, batch_id: int) -> GapWitnesses | None:
    """Ask Kafka how many committed and data records lie in the batch's gappy ranges. None for a
    batch sent back by a key collision (`key_probe_deferred`): `recheck_after_collision` does not
    look at gaps, and Kafka need not be up nor hold the offsets any more to recheck it."""
    with transaction(settings.database_url) as conn:
        batch = load_batch(conn, batch_id)  # no lock: the gate checks what they were asked about under it
        reads = _reads(conn, batch_id)
        if key_probe_deferred(conn, batch_id):
            return None
    witnesses = GapWitnesses(batch.state, batch.epoch, reads, False, {})
    gappy = [r for r in batch.plan.ranges if reads.get(r.partition, 0) != r.size]
    if batch.state is not BatchState.STAGED or not gappy:
        return witnesses
    kafka, timeout = settings.kafka, settings.kafka_timeout_s
    topic = TopicAdmin(kafka, pipeline.topic, timeout)
    compacted = topic.retention().compacted
    lows = {o.partition: o.low for o in topic.offsets()}
    for r in gappy:
        if r.start < lows.get(r.partition, r.start):
            gap = r.size - reads.get(r.partition, 0)
            raise RetentionLossError.unwitnessed(
                pipeline.name,
                batch_id,
                batch.kind,
                pipeline.topic,
                (r.partition, r.start, r.end),
                lows[r.partition],
                gap,
            )
    found = {r: count_range(kafka, pipeline.topic, r.partition, r.start, r.end, timeout) for r in gappy}
    return replace(witnesses, compacted=compacted, found=found)


def _reads(conn: Connection, batch_id: int) -> dict[int, int]:
    return dict(
        conn.execute(
            "SELECT kafka_partition, coalesce(records_read, 0) FROM kafka2pg.batch_partitions WHERE batch_id = %s",
            (batch_id,),
        ).fetchall()
    )


def _offset_gaps_explained(conn: Connection, batch: Batch, witnesses: GapWitnesses | None) -> Check:
    """Every offset of the batch without a staged record is explained (aborted, marker, compacted),
    witnessed by a consumer outside Spark (`gap_witnesses`); otherwise the batch is held
    (rejected), not promoted."""
    reads = _reads(conn, batch.batch_id)
    unwitnessed = None if witnesses is None else witnesses.unwitnessed(batch, reads)
    if unwitnessed is None or unwitnessed:  # staged (again) since the witnesses were asked: ask again
        witnessed = (
            "none: Kafka was not asked, the gate only had to recheck a key collision"
            if witnesses is None
            else witnesses.describe()
        )
        raise WitnessMismatchError.restaged(
            batch.pipeline, batch.batch_id, batch.state, batch.epoch, reads, witnessed, unwitnessed or []
        )
    accounts = []
    for rng in batch.plan.ranges:
        witness = witnesses.found.get(rng)
        committed, data = (None, None) if witness is None else (witness.committed, witness.data_records)
        accounts.append(
            account_gap(rng, reads.get(rng.partition, 0), committed, data, compacted_topic=witnesses.compacted)
        )
    with conn.cursor() as cur:
        cur.executemany(
            "UPDATE kafka2pg.batch_partitions SET committed_records = %s, aborted_records = %s, marker_offsets = %s,"
            " compacted_offsets = %s WHERE batch_id = %s AND kafka_partition = %s",
            [(a.committed, a.aborted, a.markers, a.compacted, batch.batch_id, a.partition) for a in accounts],
        )
    problems = [a.problem for a in accounts if a.problem]
    if problems:
        return Check("offset_gaps_explained", False, len(problems), "; ".join(problems))
    explained = [
        f"p{a.partition}: {a.gap} offsets without a record ({a.aborted} aborted, {a.markers} transaction markers, "
        f"{a.compacted} compacted)"
        for a in accounts
        if a.gap
    ]
    return Check("offset_gaps_explained", True, 0, "; ".join(explained) or "every offset holds a record")


def _provenance_unique(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    # Rows beyond the first of each provenance: a hashed GROUP BY (count(DISTINCT row) sorts instead).
    dupes = conn.execute(
        sql.SQL(
            "SELECT coalesce(sum(n - 1), 0)::bigint FROM (SELECT count(*) AS n FROM {} WHERE batch_id = %s"
            " GROUP BY kafka_topic, kafka_partition, kafka_offset HAVING count(*) > 1) d"
        ).format(_staging(pipeline)),
        (batch.batch_id,),
    ).fetchone()[0]
    return Check("provenance_unique", dupes == 0, dupes, f"{dupes} provenance duplicates in staging")


def _replaced_rows(conn: Connection, pipeline: Pipeline, batch: Batch) -> tuple[sql.Composable, sql.Composable] | None:
    """For a replay (None for live batches): a join giving each target row `t` its re-read row
    `r` of this replay's staging (NULL where there is none), and the predicate of the target rows
    its finish replaces: those in its ranges whose record it re-read, as `delete_rows` deletes
    them. A row whose record was compacted away since stays, and a staged row with its key is a
    duplicate. Joined, not searched row by row: run under NO_NESTED_LOOPS (a hash of the batch's
    staged provenance; the staging table has no index on it)."""
    if batch.kind != "replay":
        return None
    reread = sql.SQL(
        " LEFT JOIN (SELECT DISTINCT kafka_partition, kafka_offset FROM {} WHERE batch_id = %(batch)s) r"
        " ON r.kafka_partition = t.kafka_partition AND r.kafka_offset = t.kafka_offset"
    ).format(_staging(pipeline))
    in_range = range_predicate(batch.plan.ranges, reset_floors(conn, pipeline.name), alias="t")
    replaced = sql.SQL("t.kafka_topic = {} AND {} AND r.kafka_offset IS NOT NULL").format(
        sql.Literal(pipeline.topic), in_range
    )
    return reread, replaced


def _replay_scope(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    """A replay's staged offsets are meant to be in the target already: count what it replaces."""
    reread, replaced = _replaced_rows(conn, pipeline, batch)
    with planner(conn, **NO_NESTED_LOOPS):
        count = conn.execute(
            sql.SQL("SELECT count(*) FROM {} t{} WHERE {}").format(_target(pipeline), reread, replaced),
            {"batch": batch.batch_id},
        ).fetchone()[0]
    return Check(
        "replay_replaces_range",
        True,
        0,
        f"replay: {count} target rows of the range (and its quarantine rows) are replaced when it is finished",
    )


def _not_already_promoted(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    overlap = _offsets_already_landed(conn, pipeline, batch) if _ranges_touched(conn, pipeline, batch) else 0
    details = f"{overlap} staged offsets already in the target or the quarantine"
    if overlap:
        details += (
            f" (a recreated topic reuses offsets: `{COMMAND} reset --archive-old-rows` moves the old topic's rows away)"
        )
    return Check("provenance_not_already_promoted", overlap == 0, overlap, details)


def _ranges_touched(conn: Connection, pipeline: Pipeline, batch: Batch) -> bool:
    """Whether the target or the quarantine holds any offset of the batch's planned ranges: one
    primary-key range probe per partition and table, where a probe per staged row costs 100k
    lookups per batch. Staged offsets lie inside the planned ranges (stage_batch checks it), so
    False means none of them landed; True is answered exactly by `_offsets_already_landed`.
    One EXISTS per range, not one join against a VALUES list of them: the planner answers the
    join with a hash join over the whole target (its cost grows with the target) and each EXISTS
    with an index probe (under a millisecond)."""
    probes = []
    for r in batch.plan.ranges:
        in_range = sql.SQL("kafka_partition = {} AND kafka_offset >= {} AND kafka_offset < {}").format(
            sql.Literal(r.partition), sql.Literal(r.start), sql.Literal(r.end)
        )
        probes.append(
            sql.SQL("EXISTS (SELECT 1 FROM {target} WHERE kafka_topic = %(topic)s AND {in_range})").format(
                target=_target(pipeline), in_range=in_range
            )
        )
        probes.append(
            sql.SQL(
                "EXISTS (SELECT 1 FROM kafka2pg.quarantine WHERE pipeline = %(pipeline)s"
                " AND kafka_topic = %(topic)s AND {in_range})"
            ).format(in_range=in_range)
        )
    if not probes:
        return False
    touched = sql.SQL("SELECT {}").format(sql.SQL(" OR ").join(probes))
    return conn.execute(touched, {"topic": batch.plan.topic, "pipeline": pipeline.name}).fetchone()[0]


def _offsets_already_landed(conn: Connection, pipeline: Pipeline, batch: Batch) -> int:
    return conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {staging} s"
            "  JOIN {target} t USING (kafka_topic, kafka_partition, kafka_offset) WHERE s.batch_id = %(batch)s)"
            " + (SELECT count(*) FROM {staging} s JOIN kafka2pg.quarantine q"
            "  ON q.pipeline = %(pipeline)s AND q.kafka_topic = s.kafka_topic"
            "  AND q.kafka_partition = s.kafka_partition AND q.kafka_offset = s.kafka_offset"
            "  WHERE s.batch_id = %(batch)s)"
        ).format(staging=_staging(pipeline), target=_target(pipeline)),
        {"batch": batch.batch_id, "pipeline": pipeline.name},
    ).fetchone()[0]


def _required_not_null(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    required = [*pipeline.required_columns, *(k for k in pipeline.business_key if k not in pipeline.required_columns)]
    if not required:
        return Check("required_columns_not_null", True, 0, "no required columns")
    any_null = sql.SQL(" OR ").join(sql.SQL("{} IS NULL").format(sql.Identifier(c)) for c in required)
    nulls = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE batch_id = %s AND quarantine_reason IS NULL AND ({})").format(
            _staging(pipeline), any_null
        ),
        (batch.batch_id,),
    ).fetchone()[0]
    return Check("required_columns_not_null", nulls == 0, nulls, f"{nulls} accepted rows with a null in {required}")


def _key_columns(pipeline: Pipeline, alias: str) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(alias, k) for k in pipeline.business_key)


def _shown(value: sql.Composable) -> sql.Composed:
    """SQL: a value as a reason quotes it, as SQL text shortened to 40 characters and marked so
    (`'abc…'`), as admission's reasons show values; NULL as `NULL`."""
    return sql.SQL(
        "quote_nullable(left({v}::text, 40) || CASE WHEN length({v}::text) > 40 THEN '…' ELSE '' END)"
    ).format(v=value)


def _key_shown(pipeline: Pipeline) -> sql.Composed:
    """SQL text naming the flagged staging row's (`s`) business key columns and values, each
    value shown by `_shown`: ` (event_id = 'a-1')`."""
    pairs = [
        sql.SQL("{} || {}").format(sql.Literal(f"{k} = "), _shown(sql.Identifier("s", k)))
        for k in pipeline.business_key
    ]
    return sql.SQL("' (' || concat_ws(', ', {}) || ')'").format(sql.SQL(", ").join(pairs))


def _business_key_unique_in_batch(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    """Producer retries: keep the first occurrence (by timestamp, partition, offset), flag the rest."""
    ranked = sql.SQL(
        "SELECT s.kafka_partition, s.kafka_offset,"
        " first_value(s.kafka_partition) OVER w AS kept_partition,"
        " first_value(s.kafka_offset) OVER w AS kept_offset,"
        " row_number() OVER w AS n"
        " FROM {staging} s WHERE s.batch_id = %(batch)s AND s.quarantine_reason IS NULL"
        " WINDOW w AS (PARTITION BY {keys} ORDER BY s.kafka_timestamp NULLS FIRST, s.kafka_partition, s.kafka_offset)"
    ).format(staging=_staging(pipeline), keys=_key_columns(pipeline, "s"))
    # The count, with a hashed GROUP BY: the window above sorts the batch by its key (0.24 s per
    # 100k rows here, 0.09 s hashed) and is only needed to flag duplicates once there are some.
    counted = sql.SQL(
        "SELECT coalesce(sum(n - 1), 0)::bigint FROM (SELECT count(*) AS n FROM {staging} s"
        " WHERE s.batch_id = %(batch)s AND s.quarantine_reason IS NULL GROUP BY {keys} HAVING count(*) > 1) d"
    ).format(staging=_staging(pipeline), keys=_key_columns(pipeline, "s"))
    flag = sql.SQL(
        "UPDATE {staging} s SET quarantine_reason = {duplicate} || %(batch)s || ': kept partition '"
        " || d.kept_partition || ' offset ' || d.kept_offset || {key} FROM ({ranked}) d"
        " WHERE d.n > 1 AND s.batch_id = %(batch)s"
        " AND s.kafka_partition = d.kafka_partition AND s.kafka_offset = d.kafka_offset"
    ).format(
        staging=_staging(pipeline),
        duplicate=sql.Literal(WITHIN_BATCH_DUPLICATE),
        key=_key_shown(pipeline),
        ranked=ranked,
    )
    return _flag_duplicates(conn, pipeline, batch, "business_key_unique_in_batch", counted, flag, {}, NO_NESTED_LOOPS)


def _business_key_not_promoted(conn: Connection, pipeline: Pipeline, batch: Batch) -> Check:
    join = sql.SQL(" AND ").join(sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k)) for k in pipeline.business_key)
    # Without an index that leads with a key column, probing key by key would be a nested loop
    # over the whole target: hash joins then, for the count and the flagging alike.
    plan = INDEX_PROBES if _key_indexed(conn, pipeline) else NO_NESTED_LOOPS
    reread, where = sql.SQL(""), sql.SQL("")
    replay = _replaced_rows(conn, pipeline, batch)
    if replay is not None:  # a replay replaces these rows: they are not duplicates of its own
        reread, replaced = replay
        where = sql.SQL(" AND NOT ({})").format(replaced)
        plan = NO_NESTED_LOOPS  # the re-read rows hashed once; a replay reads the target once
    # The count probes the target's unique business-key index once per staged key, in key order,
    # so consecutive probes share the index's pages. The planner's own choice, a hash join, reads
    # the whole target for every batch: several times slower against a large target.
    counted = sql.SQL(
        "SELECT count(*) FROM (SELECT {keys} FROM {staging} s WHERE s.batch_id = %(batch)s"
        " AND s.quarantine_reason IS NULL ORDER BY {keys} OFFSET 0) s JOIN {target} t ON {join}{reread}"
        " WHERE TRUE{where}"
    ).format(
        keys=_key_columns(pipeline, "s"),
        staging=_staging(pipeline),
        target=_target(pipeline),
        join=join,
        reread=reread,
        where=where,
    )
    # Flagging joins the staged rows with the target directly, as the count does: never the
    # staged rows with themselves.
    flag = sql.SQL(
        "UPDATE {staging} s SET quarantine_reason = {promoted} || t.batch_id"
        " || ' at partition ' || t.kafka_partition || ' offset ' || t.kafka_offset || {key}"
        " FROM {target} t{reread} WHERE s.batch_id = %(batch)s AND s.quarantine_reason IS NULL AND {join}{where}"
    ).format(
        staging=_staging(pipeline),
        promoted=sql.Literal(KEY_PROMOTED_REASON),
        key=_key_shown(pipeline),
        target=_target(pipeline),
        reread=reread,
        join=join,
        where=where,
    )
    check = _flag_duplicates(conn, pipeline, batch, KEY_PROMOTED_CHECK, counted, flag, plan, plan)
    if check.flagged:
        _copies_follow_the_promoted_key(conn, pipeline, batch)
    return check


def _copies_follow_the_promoted_key(conn: Connection, pipeline: Pipeline, batch: Batch) -> None:
    """A key's later copies in the batch, flagged by the in-batch check as duplicates of the copy
    it kept, take that copy's reason once the key check flags it as already promoted: the copy
    their reason named as kept is in the quarantine too, the key's promoted row is the one to
    name. Their count stays with the in-batch check."""
    join = sql.SQL(" AND ").join(sql.SQL("d.{k} = k.{k}").format(k=sql.Identifier(k)) for k in pipeline.business_key)
    with planner(conn, **NO_NESTED_LOOPS):
        conn.execute(
            sql.SQL(
                "UPDATE {staging} d SET quarantine_reason = k.quarantine_reason FROM {staging} k"
                " WHERE d.batch_id = %(batch)s AND k.batch_id = %(batch)s AND {join}"
                " AND starts_with(d.quarantine_reason, {duplicate}) AND starts_with(k.quarantine_reason, {promoted})"
            ).format(
                staging=_staging(pipeline),
                join=join,
                duplicate=sql.Literal(WITHIN_BATCH_DUPLICATE),
                promoted=sql.Literal(KEY_PROMOTED_REASON),
            ),
            {"batch": batch.batch_id},
        )


def _key_indexed(conn: Connection, pipeline: Pipeline) -> bool:
    """Whether an index on the target leads with a business-key column. Without one (a
    business_key changed after the target was created keeps the old key's index), probing
    key by key would be a nested loop over the whole target: leave the join to the planner."""
    return any(columns and columns[0] in pipeline.business_key for _, columns in table_indexes(conn, _target(pipeline)))


def _flag_duplicates(
    conn: Connection,
    pipeline: Pipeline,
    batch: Batch,
    name: str,
    counted: sql.Composed,
    flag: sql.Composed,
    count_plan: dict[str, str],
    flag_plan: dict[str, str],
) -> Check:
    """Count the duplicates (`counted`, with the planner settings `count_plan`); flag them to
    quarantine (`flag`, an UPDATE of the batch's staged rows, with `flag_plan`), or fail under
    duplicate_policy: fail."""
    with planner(conn, **count_plan):
        count = conn.execute(counted, {"batch": batch.batch_id}).fetchone()[0]
    if count == 0:
        return Check(name, True, 0, "no duplicates")
    if pipeline.duplicate_policy == "fail":
        return Check(name, False, count, f"{count} duplicate business key(s) (duplicate_policy: fail)")
    with planner(conn, **flag_plan):
        conn.execute(flag, {"batch": batch.batch_id})
    log.warning(
        "pipeline=%s batch_id=%s %s: %s duplicates flagged to quarantine", pipeline.name, batch.batch_id, name, count
    )
    return Check(name, True, count, f"{count} duplicate(s) flagged to quarantine", flagged=count)


def recheck_after_collision(conn: Connection, pipeline: Pipeline, batch: Batch) -> list[Check]:
    """The checks of a batch sent back by a key collision at promotion (staging a batch clears
    its results, so stored results mean that): the rows the other checks judged did not change,
    and the rows they flagged are out of their reach now (run again, they would report 0). Their
    results stand; what looks into the target runs again: the key check (deferred, or run at
    validation: the rows it flagged then are counted with those it flags now), and the offsets
    one (the collision may have been on the target's primary key: offsets landed since; for a
    replay, what it replaces)."""
    earlier = conn.execute(
        "SELECT unexpected_count FROM kafka2pg.batch_checks WHERE batch_id = %s AND check_name = %s AND success",
        (batch.batch_id, KEY_PROMOTED_CHECK),
    ).fetchone()
    scope = (
        _replay_scope(conn, pipeline, batch) if batch.kind == "replay" else _not_already_promoted(conn, pipeline, batch)
    )
    key = _business_key_not_promoted(conn, pipeline, batch)
    if earlier and earlier[0] and key.success:
        total = earlier[0] + key.unexpected
        key = replace(
            key,
            unexpected=total,
            details=f"{total} duplicate(s) flagged to quarantine ({earlier[0]} when the batch was validated, "
            f"{key.unexpected} after a key collision at promotion)",
        )
    return _with_stored_checks(conn, batch.batch_id, [scope, key])


def probe_keys_again(conn: Connection, batch_id: int) -> bool:
    """After a key collision at promotion: the batch's promoted-key check is to run again
    (`recheck_after_collision`), whether its gate had deferred it or run it (a key a replay or a
    manual write promoted since); its stored count is kept. False when the batch has no such
    check (no business key: the collision was on another unique index)."""
    # Deleted and inserted again, marked: the runtime role may not UPDATE stored checks (sql/grants.sql).
    stored = conn.execute(
        "DELETE FROM kafka2pg.batch_checks WHERE batch_id = %s AND check_name = %s"
        " RETURNING success, unexpected_count, details",
        (batch_id, KEY_PROMOTED_CHECK),
    ).fetchone()
    if stored is None:
        return False
    conn.execute(
        "INSERT INTO kafka2pg.batch_checks (batch_id, check_name, success, unexpected_count, details, deferred)"
        " VALUES (%s, %s, %s, %s, %s, true)",
        (batch_id, KEY_PROMOTED_CHECK, *stored),
    )
    return True
