"""Command line: the local stack, migrations, sample events, each pipeline step, status, demo.

Run through ./kafka2pg (which prepares the venv and environment) or `python -m kafka2pg`. The dev
commands (stack start/stop/status/reset, produce, demo) import kafka2pg.devtools inside their
functions, so the product's commands never load it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import secrets
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from kafka2pg.config import (
    DEFAULT_POSTGRES_CONN_ID,
    Pipeline,
    Settings,
    get_pipeline,
    load_pipelines,
    pipelines_file_from_env,
    read_pipelines,
    topic_name,
)
from kafka2pg.exceptions import BatchStateError, ConfigError, Kafka2PgError, SchemaNotReadyError
from kafka2pg.locations import COMMAND, preview_first, state_dir
from kafka2pg.task_log import printable

log = logging.getLogger("kafka2pg")
T = TypeVar("T")


def _pipeline(args: argparse.Namespace) -> tuple[Settings, Pipeline]:
    """The pipeline named by --pipeline and its services (its Airflow Connections, or the environment)."""
    from kafka2pg.connections import settings_for

    pipeline = get_pipeline(args.pipeline, pipelines_file_from_env())
    return settings_for(pipeline), pipeline


def _selected_pipelines(args: argparse.Namespace) -> list[tuple[Settings, Pipeline]]:
    """The pipeline named by --pipeline, or every pipeline of the file, each with its services."""
    from kafka2pg.connections import settings_for

    return [(settings_for(p), p) for p in _selected(args)]


def _selected(args: argparse.Namespace) -> list[Pipeline]:
    """The pipeline named by --pipeline, or every pipeline of the file (`ConfigError`: the first
    entry in error)."""
    pipelines, broken = _each_selected(args)
    if broken:
        raise next(iter(broken.values()))
    return pipelines


def _each_selected(args: argparse.Namespace) -> tuple[list[Pipeline], dict[str, ConfigError]]:
    """The pipeline named by --pipeline, or every pipeline of the file, and the file's entries in
    error (by name, or by position when the name is unusable) when no pipeline is named."""
    path = pipelines_file_from_env()
    if args.pipeline is not None:  # '' too: an unknown pipeline, not every one
        return [get_pipeline(args.pipeline, path)], {}
    pipelines, broken = read_pipelines(path)
    if not pipelines and not broken:
        print(f"{path}: its 'pipelines:' list is empty: no pipeline to show", file=sys.stderr)
    return list(pipelines.values()), broken


# Each `stack` flag and the one action it changes: given to another, it would do nothing.
_STACK_FLAGS = {"confirm": "reset", "bench": "install", "secured": "start"}


def cmd_stack(args: argparse.Namespace) -> int:
    for flag, action in _STACK_FLAGS.items():
        if getattr(args, flag) and args.action != action:
            raise ConfigError(f"stack {args.action}: --{flag} is for `{COMMAND} stack {action}` only; nothing was done")
    cache = state_dir()
    if args.action == "install":
        from kafka2pg import class_archive
        from kafka2pg.jars import SET_UP, resolve_jars

        for name, path in resolve_jars(cache, SET_UP + (("connect",) if args.bench else ())).items():
            print(f"{name} jars: {path}")
        if not class_archive.class_archive_path(cache).is_file():
            print("making the Spark class-data archive (once; about a minute)", file=sys.stderr)
        print(f"Spark class-data archive: {class_archive.ensure(cache) or 'none (stage jobs start without it)'}")
        return 0
    if args.action == "reset":
        return _reset_stack(cache, confirm=args.confirm)
    from kafka2pg.devtools import local_stack

    current = local_stack.load_stack(cache)
    if args.action == "status":
        if current is None:
            print(f"no local stack recorded (start one with {COMMAND} stack start)")
            return 1
        status = local_stack.stack_status(current)
        for name, line in status.items():
            print(f"{name}: {line}")
        if any(line.startswith("stopped") for line in status.values()):
            print(f"`{COMMAND} stack start` restarts what is stopped, on its ports and with its data")
        return 0
    if args.action == "stop":
        if current is None:
            print("no local stack recorded: nothing to stop")
            return 0
        local_stack.stop_stack(current)
        data = ", ".join(str(p) for p in local_stack.stack_data(current))
        print(
            f"local stack stopped; its data stays in {data}: `{COMMAND} stack start` brings it back, "
            f"{preview_first('stack reset')} deletes it"
        )
        return 0
    _, done = local_stack.start_or_resume(cache, secured=args.secured)
    for line in done:
        print(line)
    print(f"environment: source {local_stack.stack_dir(cache) / 'stack.env'}")
    return 0


def _reset_stack(cache: Path, *, confirm: bool) -> int:
    """`stack reset`: without --confirm, say what would be deleted and change nothing."""
    from kafka2pg.devtools import local_stack

    targets = local_stack.reset_targets(cache)
    if not targets:
        print(f"no local stack in {local_stack.stack_dir(cache)}: nothing to delete")
        return 0
    listing = "".join(f"\n  {path}  ({what})" for path, what in targets)
    if not confirm:
        print(
            f"would stop the local stack and delete:{listing}\n"
            f"nothing changed: re-run with --confirm to delete (`{COMMAND} stack stop` stops it and keeps the data)"
        )
        return 1
    local_stack.reset_stack(cache)
    print(f"local stack stopped and deleted:{listing}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from kafka2pg.connections import database_url
    from kafka2pg.database import describe
    from kafka2pg.migrations import migrate

    pipelines = list(load_pipelines(pipelines_file_from_env()).values())
    databases = {p.postgres_conn_id for p in pipelines} or {DEFAULT_POSTGRES_CONN_ID}
    for conn_id in sorted(databases):  # each database its pipelines' tables
        url = database_url(conn_id, who=f"migrate ({conn_id})")
        applied = migrate(url, [p for p in pipelines if p.postgres_conn_id == conn_id])
        print(
            f"{conn_id} ({describe(url)}): migrations applied: {', '.join(applied) or 'none pending'}; "
            "pipeline tables ensured"
        )
    print(
        f"If the DAGs connect as another role, run `{COMMAND} grant --role THAT_ROLE` now for the tables this created."
    )
    return 0


def cmd_grant(args: argparse.Namespace) -> int:
    from kafka2pg.connections import database_url
    from kafka2pg.database import describe
    from kafka2pg.grants import apply_grants, print_grants

    pipelines = list(load_pipelines(pipelines_file_from_env()).values())
    databases = {p.postgres_conn_id for p in pipelines} or {DEFAULT_POSTGRES_CONN_ID}
    for conn_id in sorted(databases):
        url = database_url(conn_id, who=f"grant ({conn_id})")
        mine = [p for p in pipelines if p.postgres_conn_id == conn_id]
        if args.print_only:
            print(f"-- {conn_id} ({describe(url)})\n{print_grants(url, mine, args.role)}")
            continue
        apply_grants(url, mine, args.role)
        names = ", ".join(p.name for p in mine) or "none"
        print(
            f"{conn_id} ({describe(url)}): granted role {args.role!r} kafka2pg's run-time privileges on its own "
            f"tables and those of pipelines {names}; run this again after adding a pipeline or applying a migration "
            "that adds a table"
        )
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    from kafka2pg.connections import services
    from kafka2pg.devtools.producer import produce_sample
    from kafka2pg.kafka_offsets import ensure_topic

    settings = services(who="produce")
    if ensure_topic(settings.kafka, args.topic, args.partitions, settings.kafka_timeout_s):
        print(f"created topic {args.topic} with {args.partitions} partitions")
    seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    count = produce_sample(settings.kafka, args.topic, args.count, seed=seed)
    print(f"produced {count} events to {args.topic} (--seed {seed} produces the same events again)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kafka2pg.migrations import require_ready
    from kafka2pg.opening import open_batch

    settings, pipeline = _pipeline(args)
    require_ready(settings, pipeline)
    opened = open_batch(settings, pipeline, dry_run=args.dry_run)
    print(opened.message)
    return 0


def _stage_locally(settings: Settings, pipeline: Pipeline, batch_id: int) -> None:
    """Stage one batch with a Spark session of this process (KAFKA2PG_SPARK_MASTER), then stop it.
    Spark's Kafka source comes as for the DAG's spark-submit (`spark_kafka_source`), and only for
    a pipeline that reads with it."""
    from kafka2pg.jars import spark_kafka_source
    from kafka2pg.scratch import job_scratch
    from kafka2pg.staging import package_zip, spark_session, stage_batch, stop_session

    jars, conf = spark_kafka_source() if pipeline.kafka_reader == "spark" else (None, {})
    if jars:
        conf = {**conf, "spark.jars": jars}
    with job_scratch(settings.state_dir / "spark") as scratch:
        spark = spark_session(
            settings.spark_master,
            app_name=f"kafka2pg-stage-{pipeline.name}",
            conf=conf,
            kafka_reader=pipeline.kafka_reader,
            scratch=scratch,
        )
        try:
            spark.sparkContext.addPyFile(str(package_zip(scratch)))
            print(stage_batch(spark, settings, pipeline, batch_id).message)
        finally:
            stop_session(spark)


def cmd_stage(args: argparse.Namespace) -> int:
    from kafka2pg.batch_store import load_claimed
    from kafka2pg.database import session
    from kafka2pg.lifecycle import FINAL
    from kafka2pg.staging import nothing_to_stage

    settings, pipeline = _pipeline(args)
    # A batch not there, another pipeline's, or a finished one: said before Spark starts. A staged
    # or validated one goes to stage_batch, which looks at its staging rows under the batch's lock.
    with session(settings.database_url) as conn:
        batch = load_claimed(conn, pipeline, args.batch_id, None, lock=False)
        done = nothing_to_stage(conn, pipeline, batch) if batch.state in FINAL else None
    if done is not None:
        print(done.message)
        return 0
    _stage_locally(settings, pipeline, args.batch_id)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from kafka2pg.quality import validate_batch

    settings, pipeline = _pipeline(args)
    print(validate_batch(settings, pipeline, args.batch_id).message)
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from kafka2pg.steps import promote_batch

    settings, pipeline = _pipeline(args)
    print(promote_batch(settings, pipeline, args.batch_id).message)
    return 0


def _each_pipeline(
    args: argparse.Namespace, did: str | None, work: Callable[[Settings, Pipeline], T]
) -> dict[str, T | Exception]:
    """`work` for each selected pipeline with its settings: one pipeline's trouble (its entry in
    the pipelines file, its connections) hides none of the others; printed to stderr as
    "pipeline P: `did`: error" (None: not printed)."""
    from kafka2pg.connections import settings_for

    selected, broken = _each_selected(args)
    results: dict[str, T | Exception] = {}
    for pipeline in selected:
        try:
            results[pipeline.name] = work(settings_for(pipeline), pipeline)
        except Kafka2PgError as exc:
            results[pipeline.name] = exc
            _say_failed(pipeline.name, did, exc)
    for name, error in broken.items():
        results[name] = error
        _say_failed(name, did, error)
    return results


def _say_failed(name: str, did: str | None, error: Exception) -> None:
    if did is not None:
        print(f"pipeline {name}: {did}: {type(error).__name__}: {error}", file=sys.stderr)


def _failed(results: Mapping[str, object]) -> list[str]:
    return [name for name, result in results.items() if isinstance(result, Exception)]


def _answered_no(results: Mapping[str, object]) -> bool:
    """Whether a pipeline's work ran and returned False (an error is `_failed`'s)."""
    return any(result is False for result in results.values())


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 2 when a pipeline's status could not be read, or only what PostgreSQL holds (Kafka
    not answering, or its topic missing)."""
    from kafka2pg.report import status_report

    if args.json:
        return _status_json(args)

    def show(settings: Settings, pipeline: Pipeline) -> bool:
        text, status = status_report(settings, pipeline)
        print(text)
        if status.kafka_error:
            print(f"pipeline {pipeline.name}: Kafka's offsets unknown: {status.kafka_error}", file=sys.stderr)
        return status.kafka_error is None

    results = _each_pipeline(args, "error", show)
    return 2 if _failed(results) or _answered_no(results) else 0


def _status_json(args: argparse.Namespace) -> int:
    """`status --json`: what the Airflow overview page shows, one object per pipeline (for one
    whose status cannot be read: its name and the error; with Kafka's offsets unknown: no
    partitions and `kafka_error`; the exit code is then 2)."""
    import json

    from kafka2pg.database import session
    from kafka2pg.status import pipeline_status

    def status(settings: Settings, pipeline: Pipeline) -> dict:
        with session(settings.database_url) as conn:
            return pipeline_status(settings, pipeline, conn).to_json()

    results = _each_pipeline(args, None, status)  # each error is in the JSON, stdout alone
    shown = [
        {"pipeline": name, "error": f"{type(result).__name__}: {result}"} if isinstance(result, Exception) else result
        for name, result in results.items()
    ]
    print(json.dumps(shown, indent=2))
    return 2 if _failed(results) or any(s.get("kafka_error") for s in shown) else 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit 1 when an audit found a discrepancy (or a STUCK batch, the database NOT READY for a
    run, or the ledger BLOCKED: no longer fitting the topic), else 2 when a pipeline could not be
    audited (its error on stderr; the others are audited all the same), else 0. When both, a last
    line on stderr names those not audited."""
    from kafka2pg.audit import audit_pipeline, format_audit
    from kafka2pg.database import session
    from kafka2pg.migrations import readiness_error
    from kafka2pg.opening import blocked_words
    from kafka2pg.status import BLOCKED_LINE, KAFKA_TROUBLE
    from kafka2pg.stuck import open_batches

    def audit(settings: Settings, pipeline: Pipeline) -> bool:
        try:
            audits = audit_pipeline(settings, pipeline)
        except SchemaNotReadyError as exc:  # not audited: said as `status` says it, all that is missing
            with contextlib.suppress(Kafka2PgError, *_postgresql_errors()), session(settings.database_url) as conn:
                exc = readiness_error(settings, pipeline, conn) or exc
            raise exc from None
        blocked = unchecked = None
        with session(settings.database_url) as conn:
            batches = open_batches(conn, pipeline.name)
            not_ready = readiness_error(settings, pipeline, conn)
            if not_ready is None:  # a run stops at NOT READY first
                try:
                    blocked = blocked_words(settings, pipeline, conn)
                except KAFKA_TROUBLE as exc:  # the audit stands; only this one check is unknown
                    print(
                        f"pipeline {pipeline.name}: whether the ledger still fits the topic is unknown: "
                        f"{type(exc).__name__}: {exc}",
                        file=sys.stderr,
                    )
                except (Kafka2PgError, *_postgresql_errors()) as exc:  # said after the audit, below
                    unchecked = exc
        stuck = [b.stuck for b in batches if b.stuck is not None]
        replays = [b for b in batches if b.kind != "live" and b.stuck is None]
        print(format_audit(pipeline, audits, stuck, None if not_ready is None else str(not_ready), replays))
        if blocked is not None:
            print(BLOCKED_LINE + blocked)
        found = all(a.clean for a in audits) and not stuck and not_ready is None and blocked is None
        if unchecked is not None:
            why = (
                f"whether the ledger still fits the topic could not be checked: {type(unchecked).__name__}: {unchecked}"
            )
            if not found:  # exit 1 for what the audit found; the check's error said beside it
                print(f"pipeline {pipeline.name}: {why}", file=sys.stderr)
                return False
            raise Kafka2PgError(f"the audit above found nothing, but {why}") from unchecked
        return found

    results = _each_pipeline(args, "not audited", audit)
    failed = _failed(results)
    if _answered_no(results):
        if failed:
            print(
                "verify: exit 1 for the discrepancy, STUCK batch, NOT READY or BLOCKED above; also not audited: "
                + ", ".join(failed),
                file=sys.stderr,
            )
        return 1
    return 2 if failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    from kafka2pg.report import quality_summary

    if args.out is not None and not args.html:
        raise ConfigError("report --out FILE writes the HTML report: give --html too")
    if args.html:
        return _export_report(args)
    selected = _selected_pipelines(args)
    if args.batch_id is None:
        print("\n".join(quality_summary(settings, pipeline) for settings, pipeline in selected))
        return 0
    if not selected:
        return 1
    # Without --pipeline, the batch is one pipeline's, in that pipeline's database: the others
    # (another pipeline's batch, or none of that id in their database) say nothing.
    summaries, refusals = [], []
    for settings, pipeline in selected:
        try:
            summaries.append(quality_summary(settings, pipeline, args.batch_id))
        except BatchStateError as exc:
            if args.pipeline:
                raise
            refusals.append(exc)
    if not summaries:  # "batch N belongs to pipeline X" (one not in the file) says more than "does not exist"
        raise ([e for e in refusals if "does not exist" not in str(e)] or refusals)[0]
    print("\n".join(summaries))
    return 1 if all(": no quality report yet" in s for s in summaries) else 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    from kafka2pg.report import quarantine_listing

    settings, pipeline = _pipeline(args)
    print(quarantine_listing(settings, pipeline, args.batch_id, args.limit))
    return 0


def _export_report(args: argparse.Namespace) -> int:
    """`report --html`: the batch's report rendered from its stored result, to --out or stdout."""
    from kafka2pg.batch_store import load_claimed
    from kafka2pg.data_docs import render_html
    from kafka2pg.database import session
    from kafka2pg.quality_results import latest_result_batch, load_result

    if not args.pipeline:
        raise ConfigError("report --html: give --pipeline P (and --batch-id N; default: its latest validated batch)")
    settings, pipeline = _pipeline(args)
    with session(settings.database_url) as conn:
        if args.batch_id is None:
            args.batch_id = latest_result_batch(conn, pipeline.name)
            if args.batch_id is None:
                print(f"pipeline {pipeline.name}: no quality report yet", file=sys.stderr)
                return 1
        result = load_result(conn, pipeline.name, args.batch_id)
        if result is None:  # BatchStateError: no such batch, or another pipeline's
            load_claimed(conn, pipeline, args.batch_id, None, lock=False)
    if result is None:
        print(
            f"pipeline {pipeline.name} batch {args.batch_id}: no stored quality result (not validated yet, or "
            "validated before kafka2pg.quality_results existed)",
            file=sys.stderr,
        )
        return 1
    page = render_html(result)
    if args.out is None:
        # the page declares UTF-8; a C locale's stdout would refuse a non-ASCII key or value
        sys.stdout.flush()
        sys.stdout.buffer.write(page.encode("utf-8"))
        sys.stdout.buffer.flush()
        return 0
    _write_report(args, page)
    print(f"pipeline {pipeline.name} batch {args.batch_id}: quality report written to {args.out}")
    return 0


def _write_report(args: argparse.Namespace, page: str) -> None:
    try:
        args.out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"report --out {args.out}: cannot write it: {exc.strerror or exc}") from None


def cmd_reset(args: argparse.Namespace) -> int:
    from kafka2pg.ledger import reset_head

    settings, pipeline = _pipeline(args)
    to_offset = None if args.drop else args.to_offset  # one of the two: the parser refuses both or neither
    reset = reset_head(
        settings,
        pipeline,
        args.partition,
        to_offset,
        reason=args.reason,
        confirm=args.confirm,
        archive_old_rows=args.archive_old_rows,
    )
    if not reset.applied:
        print(
            f"would reset: {reset.message}\nnothing changed: re-run with --confirm to apply (recorded in "
            "kafka2pg.ledger_resets)"
        )
        return 1
    print(f"reset: {reset.message} (recorded in kafka2pg.ledger_resets)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Plan, read (local Spark), validate and finish one replay in this process."""
    from kafka2pg.lifecycle import CLI_RUN_ID
    from kafka2pg.migrations import require_ready
    from kafka2pg.quality import validate_batch
    from kafka2pg.replay import open_replay, split_differences
    from kafka2pg.replay_process import ReplayProcess
    from kafka2pg.replay_request import CLI_NAMES, request_from_params
    from kafka2pg.steps import promote_batch

    if not args.offsets and not (args.start or args.end):
        raise ConfigError("replay: nothing to replay: give --offsets 0:0-500,1:0-480 or --from T0 --to T1")
    params = {
        "mode": args.mode,
        "offset_ranges": args.offsets,
        "from_time": args.start,
        "to_time": args.end,
        "reason": args.reason,
    }
    # The arguments first: a mistake in them is said at once, not after the connections' look-up.
    request = request_from_params(params, run_type="manual", requested_by=args.requested_by, names=CLI_NAMES)
    assert request is not None  # a manual request without ranges or window raises instead
    settings, pipeline = _pipeline(args)
    require_ready(settings, pipeline)
    with ReplayProcess(settings.database_url) as process:  # status and abandon see this process run
        opened = open_replay(settings, pipeline, request, run_id=CLI_RUN_ID, on_planned=process.hold)
        print(opened.message)
        if opened.batch is None:
            return 0
        batch_id = opened.batch.batch_id
        try:
            _stage_locally(settings, pipeline, batch_id)
            print(validate_batch(settings, pipeline, batch_id).message)
            result = promote_batch(settings, pipeline, batch_id)
        except BaseException:
            _say_if_left_open(settings, pipeline, batch_id)
            raise
    print(result.message)
    differences, gone = split_differences(result.differences)
    for label, findings in (("", differences), ("record gone, not a difference: ", gone)):
        for kind, found in sorted(findings.items()):
            print(f"  {label}{kind}: {found['count']} (e.g. {', '.join(found['sample'][:10])})")
    return 1 if differences else 0  # verify-only's findings, as `verify` exits on its own


def _say_if_left_open(settings: Settings, pipeline: Pipeline, batch_id: int) -> None:
    """On stderr, after a CLI replay failed: its batch, if still open, waits for `abandon` (this
    process, gone, will not carry it on; a gate's rejection or a fence has ended it already)."""
    import psycopg

    from kafka2pg.database import session
    from kafka2pg.stuck import ABANDON_COMMAND, open_batches

    command = ABANDON_COMMAND.format(pipeline=pipeline.name, batch_id=batch_id)
    try:
        with session(settings.database_url) as conn:
            left = open_batches(conn, pipeline.name, batch_id)
    except (Kafka2PgError, psycopg.Error):  # the failure itself may be PostgreSQL's: say what to check
        print(
            f"replay batch {batch_id} may be left open: `{COMMAND} status` tells; {command} discards it",
            file=sys.stderr,
        )
        return
    if left:
        print(
            f"replay batch {batch_id} is left open ({left[0].state}), and this process will not carry it on: "
            f"{command} discards it (a new `{COMMAND} replay` of the range plans a batch of its own)",
            file=sys.stderr,
        )


def _confirmed_batch_change(args: argparse.Namespace, change: Callable, verb: str, done: str) -> int:
    """Run an undo or an abandon of `--batch-id`: without `--confirm` a preview (exit 1, nothing changed)."""
    settings, pipeline = _pipeline(args)
    result = change(
        settings, pipeline, args.batch_id, confirm=args.confirm, reason=args.reason, requested_by=args.requested_by
    )
    if not result.applied:
        print(f"would {verb}: {result.message}\nnothing changed: re-run with --confirm to apply")
        return 1
    print(f"{done}: {result.message}")
    return 0


def cmd_undo(args: argparse.Namespace) -> int:
    from kafka2pg import undo

    return _confirmed_batch_change(args, undo.undo_batch, "undo", "undone")


def cmd_abandon(args: argparse.Namespace) -> int:
    from kafka2pg import undo

    return _confirmed_batch_change(args, undo.abandon_replay, "abandon", "abandoned")


def cmd_offsets(args: argparse.Namespace) -> int:
    from datetime import UTC

    from kafka2pg.kafka_offsets import TopicAdmin
    from kafka2pg.replay_request import kafka_ms, parse_window

    begin, until = parse_window(args.start, args.end, ("--from", "--to"), "offsets")
    if begin >= until:
        raise ConfigError(f"time window: --from {args.start} must be before --to {args.end}")
    low, high = kafka_ms(begin), kafka_ms(until)
    settings, pipeline = _pipeline(args)
    kafka = TopicAdmin(settings.kafka, pipeline.topic, settings.kafka_timeout_s)
    start, end = kafka.offsets_for_times(low), kafka.offsets_for_times(high)
    shown = [moment.astimezone(UTC).isoformat().replace("+00:00", "Z") for moment in (begin, until)]
    print(f"topic {pipeline.topic}: records with timestamps in [{shown[0]}, {shown[1]}) (UTC)")
    for partition in sorted(start):
        print(f"  partition {partition}: offsets [{start[partition]}, {end[partition]})")
    return 0


def _not_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


# PostgreSQL's bigint: what a batch id, a count or an offset the ledger keeps can be.
BIGINT_MAX = 2**63 - 1


def _whole(low: int, high: int) -> Callable[[str], int]:
    """argparse type: a whole number from `low` to `high` (within bigint), in ASCII digits.

    Python's int() also takes "+1", "1_000", spaces and other scripts' digits; a flag does not.
    """

    def parse(text: str) -> int:
        if not re.fullmatch(r"-?[0-9]+", text):
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
        # More digits than bigint has is out of every range here (and int() refuses 4,300).
        value = int(text) if len(text.lstrip("-").lstrip("0")) <= 19 else None
        if value is None or not low <= value <= high:
            shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"
            raise argparse.ArgumentTypeError(f"out of range: {shown} (from {low} to {high})")
        return value

    return parse


_bigint = _whole(-BIGINT_MAX - 1, BIGINT_MAX)
_positive = _whole(1, BIGINT_MAX)
_offset = _whole(0, BIGINT_MAX)
_partition = _whole(0, 2**31 - 1)  # Kafka's partition numbers are int32


def _topic(text: str) -> str:
    """argparse type: a name Kafka takes for a topic."""
    try:
        return topic_name(text, "")  # argparse names the flag
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from kafka2pg.devtools import demo

    return demo.run(events=args.events, keep=args.keep)


class _Once(argparse._StoreAction):
    """An option's value, given once: argparse keeps the last of a repeated option silently
    (`replay --offsets 0:0-100 --offsets 1:0-50` would replay partition 1 only)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = namespace.__dict__.setdefault("_given_once", set())
        if option_string is not None and self.dest in given:
            parser.error(f"{'/'.join(self.option_strings)} given more than once: give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """kafka2pg's parser (and its subcommands'): an option that takes a value takes one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kafka2pg",
        description="Exactly-once Kafka -> PostgreSQL micro-batches.",
        epilog="In a checkout, the ./kafka2pg wrapper also takes: setup (only the set-up), test [pytest args] (the "
        "whole suite), airflow ARGS (Airflow's CLI with this environment), python FILE (the venv's python). "
        "Exit codes: 0 done; 1 a finding (verify, replay --mode verify-only), a preview (without --confirm), "
        "nothing to show (report --batch-id or --html, stack status); 2 a refusal or an error "
        "(one line on stderr, with -v its trace); 130 interrupted (Ctrl-C: every step is safe to run again).",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="kafka2pg's debug logging (Airflow's and py4j's at INFO)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="start the local stack, produce events, run the DAG twice, print the ledger")
    p.add_argument("--events", type=_positive, default=10_000, help="sample events to produce (default 10000)")
    p.add_argument("--keep", action="store_true", help="leave the stack running (stop it with `stack stop`)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "stack",
        help="the local Kafka + PostgreSQL stack: start (restarts only what is down, data kept), stop "
        "(data kept), status, reset (deletes its data), install",
    )
    p.add_argument("action", choices=["install", "start", "stop", "status", "reset"])
    p.add_argument("--confirm", action="store_true", help="reset: delete; without it, only say what would go")
    p.add_argument(
        "--bench",
        action="store_true",
        help="install: also the benchmark's Kafka Connect worker and Debezium JDBC sink (about 75 MB)",
    )
    p.add_argument(
        "--secured",
        action="store_true",
        help="start, for a new stack: the broker also listens with SASL_SSL (SCRAM-SHA-512, PLAIN) and with SSL "
        "requiring a client certificate, with a CA, certificates and passwords made for it (a recorded stack keeps "
        "the listeners it started with)",
    )
    p.set_defaults(func=cmd_stack)

    sub.add_parser(
        "migrate", help="apply sql/ migrations and create pipeline tables (as the role that owns them)"
    ).set_defaults(func=cmd_migrate)

    p = sub.add_parser(
        "grant",
        help="grant a runtime role what the pipelines need and no more (as the owning role; again after "
        "adding a pipeline)",
    )
    p.add_argument("--role", required=True, help="the existing LOGIN role Airflow tasks and Spark jobs connect as")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the GRANTs, change nothing")
    p.set_defaults(func=cmd_grant)

    p = sub.add_parser("produce", help="produce sample events with an idempotent producer")
    p.add_argument("--topic", type=_topic, default="orders")
    p.add_argument("--count", type=_positive, default=1000)
    p.add_argument(
        "--partitions",
        type=_positive,
        default=3,
        help="partitions if the topic is created (an existing topic keeps its own)",
    )
    p.add_argument(
        "--seed",
        type=_bigint,
        help="the same seed gives the same events (and business keys, which the pipeline flags as duplicates "
        "once promoted); default: a new one each time",
    )
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("status", help="ledger heads, watermarks and lag per partition")
    p.add_argument("--pipeline")
    p.add_argument("--json", action="store_true", help="as JSON (what the Airflow overview page shows)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("verify", help="audit: re-read Kafka for the ledgered ranges, compare with target + quarantine")
    p.add_argument("--pipeline")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "report",
        help="summary of the latest (or a given) batch's quality report; --html: the report page, rendered from "
        "the result stored in PostgreSQL",
    )
    p.add_argument("--pipeline")
    p.add_argument("--batch-id", type=_bigint)
    p.add_argument(
        "--html",
        action="store_true",
        help="export the batch's report as one HTML page (--pipeline; --batch-id, default the latest)",
    )
    p.add_argument("--out", type=Path, help="with --html: write it to this file (default: standard output)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "quarantine",
        help="the pipeline's quarantined records (the newest, or one batch's): partition, offset, raw bytes' size, "
        "reason",
    )
    p.add_argument("--pipeline", required=True)
    p.add_argument("--batch-id", type=_bigint)
    p.add_argument("--limit", type=_positive, default=50, help="rows to list at most (default 50)")
    p.set_defaults(func=cmd_quarantine)

    p = sub.add_parser("reset", help="realign a partition's ledger head after the topic was recreated/restored")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--partition", type=_partition, required=True)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--to-offset", type=_offset, help="the new head (next offset to read)")
    where.add_argument("--drop", action="store_true", help="drop the head of a partition the topic no longer has")
    p.add_argument("--reason", default="no reason given", help="why: recorded in kafka2pg.ledger_resets")
    p.add_argument(
        "--archive-old-rows",
        action="store_true",
        help="move the partition's rows of the old topic out of target/quarantine into kafka2pg.archived_rows",
    )
    p.add_argument("--confirm", action="store_true", help="apply; without it, only say what would change")
    p.set_defaults(func=cmd_reset)

    p = sub.add_parser("offsets", help="map a time window to per-partition offset ranges (offsets_for_times)")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--from", dest="start", required=True, help="ISO-8601 start (inclusive), UTC if no zone")
    p.add_argument("--to", dest="end", required=True, help="ISO-8601 end (exclusive)")
    p.set_defaults(func=cmd_offsets)

    p = sub.add_parser("replay", help="re-load (or verify) a range already loaded, with the current config")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--offsets", help="per-partition ranges, end exclusive: 0:100-200,1:0-50")
    p.add_argument(
        "--from", dest="start", help="time window start (ISO-8601, inclusive, UTC if no zone), instead of --offsets"
    )
    p.add_argument("--to", dest="end", help="time window end (exclusive)")
    p.add_argument("--mode", choices=["replace", "verify-only"], default="replace")
    p.add_argument("--reason", default="", help="recorded in kafka2pg.replays")
    p.add_argument("--requested-by", default="", help="recorded in kafka2pg.replays (default: your user name)")
    p.set_defaults(func=cmd_replay)

    for name, func, text, recorded in (
        (
            "undo",
            cmd_undo,
            "take back the newest promoted batch: delete its rows, rewind its heads",
            "kafka2pg.replays",
        ),
        (
            "abandon",
            cmd_abandon,
            "discard an open replay batch its run will not finish (a killed CLI replay, a failed run)",
            "the batch",
        ),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--pipeline", required=True)
        p.add_argument("--batch-id", type=_bigint, required=True)
        p.add_argument("--reason", default="", help=f"recorded in {recorded}")
        p.add_argument("--requested-by", default="", help=f"recorded in {recorded} (default: your user name)")
        p.add_argument("--confirm", action="store_true", help="apply; without it, only say what would change")
        p.set_defaults(func=func)

    p = sub.add_parser("plan", help="plan (or resume) the next batch of a pipeline")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_plan)
    for name, func, text in (
        ("stage", cmd_stage, "read and stage a planned batch with a local Spark session"),
        ("validate", cmd_validate, "run the quality checks of a staged batch"),
        ("promote", cmd_promote, "promote a validated batch in one transaction"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--pipeline", required=True)
        p.add_argument("--batch-id", type=_bigint, required=True)
        p.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:  # bytes that are no UTF-8 reach Python as lone surrogates, which no output takes
        if not arg.isascii() and _not_utf8(arg):
            parser.error(f"argument {arg!r} is not valid UTF-8")
    args = parser.parse_args(argv)
    line = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=line)
    own = logging.getLogger("kafka2pg")
    was = (own.level, own.propagate)
    verbose = logging.StreamHandler(sys.stderr)
    if args.verbose:
        # A handler of its own: Airflow's first import (a connection's lookup) configures the
        # root logger anew, at INFO, which would drop kafka2pg's debug lines from then on.
        verbose.setFormatter(logging.Formatter(line))
        own.setLevel(logging.DEBUG)
        own.addHandler(verbose)
        own.propagate = False
    # Airflow, imported to look connections up, tells where its config is at INFO, and at DEBUG
    # logs each provider and a trace for the absent airflow_local_settings, which reads as a failure;
    # py4j, a stage command's Spark gateway, each call at DEBUG and its closing at INFO.
    quieter = logging.INFO if args.verbose else logging.WARNING
    logging.getLogger("airflow").setLevel(quieter)
    logging.getLogger("py4j").setLevel(quieter)
    try:
        return _run(args)
    finally:  # called in process (tests, a wrapper): kafka2pg's logging as it was before
        own.removeHandler(verbose)
        own.setLevel(was[0])
        own.propagate = was[1]


def _run(args: argparse.Namespace) -> int:
    """The command, its kafka2pg errors and PostgreSQL's refusals as one line (exit 2; with -v
    their trace too), Ctrl-C as "interrupted" (exit 130)."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader gone away is caught, not at the interpreter's exit
        return code
    except Kafka2PgError as exc:
        # printable: an error may quote a record's bytes (PostgreSQL's words about a key).
        print(f"error: {type(exc).__name__}: {printable(str(exc), keep_newlines=True)}", file=sys.stderr)
        _trace_if_verbose(args)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: every step is safe to stop and to run again
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`status | head`): no trace, and none at exit's flush
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor: nothing to flush
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 1
    except _postgresql_errors() as exc:
        # PostgreSQL refused a statement kafka2pg has no words of its own for (a trigger's RAISE, a
        # constraint or permission of the DBA's): its words, not a trace.
        state = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
        print(f"error: {type(exc).__name__}{state}: {_postgresql_line(exc)}", file=sys.stderr)
        _trace_if_verbose(args)
        return 2


def _postgresql_errors() -> tuple[type[BaseException], ...]:
    """psycopg's errors, if a command imported psycopg (else none can have been raised): the CLI
    itself stays light to import. Evaluated only when an exception reaches that clause."""
    psycopg = sys.modules.get("psycopg")
    return (psycopg.Error,) if psycopg is not None else ()


def _postgresql_line(exc) -> str:
    """PostgreSQL's error on one line: its message, then its DETAIL, HINT and CONTEXT (where it was
    raised: a trigger's function, a line of it) when it gives them; a line break in any of them
    escaped (a message may quote a row's value), the statement's text psycopg adds left out."""
    diag = exc.diag
    if not diag.message_primary:  # not the server's error (the client's own): its text
        return printable(str(exc).strip())
    parts = [diag.message_primary.strip()]
    parts += [
        f"{label}: {text.strip()}"
        for label, text in (("detail", diag.message_detail), ("hint", diag.message_hint))
        if text
    ]
    if diag.context:  # one line per level of PL/pgSQL's stack, innermost first
        parts.append("where: " + " <- ".join(line.strip() for line in diag.context.strip().splitlines()))
    return printable("; ".join(parts))


def _trace_if_verbose(args: argparse.Namespace) -> None:
    if getattr(args, "verbose", False):
        traceback.print_exc(file=sys.stderr)
