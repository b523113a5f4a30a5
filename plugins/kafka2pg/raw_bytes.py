"""The raw key, value and headers of quarantined records, read again from Kafka by offset.

A record refused at admission is staged with its raw key and value, not its headers (the
Spark task does not carry them); a row the quality gate flags, or PostgreSQL refuses at
promotion, was staged typed, without any raw bytes. These read the records again by offset
(`kafka_reader.raw_records_at`) and fill what the rows lack, in the staging table while the
batch is not promoted, in `kafka2pg.quarantine` after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psycopg import Connection, sql

from kafka2pg.batch_store import load_batch
from kafka2pg.config import Pipeline, Settings
from kafka2pg.database import NO_NESTED_LOOPS, planner, transaction
from kafka2pg.kafka_offsets import topic_id
from kafka2pg.kafka_reader import RawRecord, raw_records_at

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Place:
    """Where quarantined rows wait: a table and its column holding the reason."""

    table: sql.Identifier
    reason: sql.Identifier


def staging_place(pipeline: Pipeline) -> Place:
    return Place(sql.Identifier("kafka2pg", pipeline.staging_table), sql.Identifier("quarantine_reason"))


# Every quarantined row still without raw bytes: the rows PostgreSQL refused at promotion, and
# any the gate flagged whose validation stopped before reading them. A record without key, value
# or headers (a keyless tombstone refused at admission) is read again and stays so.
QUARANTINE = Place(sql.Identifier("kafka2pg", "quarantine"), sql.Identifier("reason"))


def headers_literal(headers: list[tuple[bytes, bytes | None]]) -> str | None:
    """Kafka headers as a bytea[][] literal: one {key, value} pair per header, in order."""
    if not headers:
        return None
    pairs = []
    for key, value in headers:
        shown = "NULL" if value is None else '"\\\\x' + value.hex() + '"'
        pairs.append(f'{{"\\\\x{key.hex()}",{shown}}}')
    return "{" + ",".join(pairs) + "}"


def fill_raw_bytes(conn: Connection, place: Place, batch_id: int, found: dict[tuple[int, int], RawRecord]) -> int:
    """Give the batch's quarantined rows at `found`'s (partition, offset) the raw key, value and
    headers Kafka holds where they have none, in the caller's transaction; returns the rows updated."""
    if not found:
        return 0
    (partitions, offsets), records = zip(*found, strict=True), list(found.values())
    with planner(conn, **NO_NESTED_LOOPS):
        return conn.execute(
            sql.SQL(
                "UPDATE {table} s SET raw_key = coalesce(s.raw_key, r.k), raw_value = coalesce(s.raw_value, r.v),"
                " raw_headers = coalesce(s.raw_headers, r.h::bytea[])"
                " FROM unnest(%s::int[], %s::bigint[], %s::bytea[], %s::bytea[], %s::text[]) r(p, o, k, v, h)"
                " WHERE s.batch_id = %s AND s.kafka_partition = r.p AND s.kafka_offset = r.o AND s.{reason} IS NOT NULL"
            ).format(table=place.table, reason=place.reason),
            (
                list(partitions),
                list(offsets),
                [r.key for r in records],
                [r.value for r in records],
                [headers_literal(r.headers) for r in records],
                batch_id,
            ),
        ).rowcount


def keep_raw_bytes(settings: Settings, pipeline: Pipeline, batch_id: int, place: Place) -> int:
    """Fill the raw key, value and headers of the batch's quarantined rows in `place` that have
    none (the quality gate's flagged rows, the rows refused at promotion), read again from Kafka
    by offset; returns the rows filled. Best effort, after the gate's or the promotion's
    transaction: with Kafka or PostgreSQL unreachable or the records gone, the rows keep their
    typed values (`record`) and provenance, and the batch goes on."""
    try:
        return _keep_raw_bytes(settings, pipeline, batch_id, place)
    except Exception as exc:  # noqa: BLE001 - best effort: the verdict or the promotion is committed already
        log.warning(
            "pipeline=%s batch_id=%s the raw bytes of rows quarantined without them were not kept (%s: %s); "
            "they keep their typed values and provenance",
            pipeline.name,
            batch_id,
            type(exc).__name__,
            exc,
        )
        return 0


def _keep_raw_bytes(settings: Settings, pipeline: Pipeline, batch_id: int, place: Place) -> int:
    with transaction(settings.database_url) as conn:
        lacking = conn.execute(
            sql.SQL(
                "SELECT kafka_partition, kafka_offset FROM {table} WHERE batch_id = %s AND {reason} IS NOT NULL"
                " AND raw_key IS NULL AND raw_value IS NULL AND raw_headers IS NULL"
            ).format(table=place.table, reason=place.reason),
            (batch_id,),
        ).fetchall()
    if not lacking:
        return 0
    by_partition: dict[int, list[int]] = {}
    for partition, offset in lacking:
        by_partition.setdefault(partition, []).append(offset)
    found = raw_records_at(settings.kafka, pipeline.topic, by_partition, settings.kafka_timeout_s)
    if found:
        with transaction(settings.database_url) as conn:
            plan = load_batch(conn, batch_id).plan
        now = topic_id(settings.kafka, pipeline.topic, settings.kafka_timeout_s)  # after the read: what it read
        if plan.in_another_topic(now):
            log.warning(
                "pipeline=%s batch_id=%s the raw bytes of rows quarantined without them were not kept: the topic "
                "was deleted and recreated since the batch was read (topic ID %s, now %s), and its offsets now "
                "hold other records; the rows keep their typed values and provenance",
                pipeline.name,
                batch_id,
                plan.topic_id,
                now,
            )
            return 0
    with transaction(settings.database_url) as conn:
        return fill_raw_bytes(conn, place, batch_id, found)
