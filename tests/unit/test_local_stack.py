"""The local stack's pure helpers (the broker and PostgreSQL themselves are exercised by every
integration test)."""

from __future__ import annotations

import uuid

import pytest

from kafka2pg.devtools import broker, local_stack
from kafka2pg.devtools.broker import KafkaProcess
from kafka2pg.devtools.postgres import PostgresProcess
from kafka2pg.devtools.secured_listeners import SaslUser, SecuredListener


def test_a_kraft_cluster_id_never_starts_with_a_dash(monkeypatch):
    """One random id in 64 starts with "-" (URL-safe base64 of a first byte 0xf8-0xfb); StorageTool
    then took `-t -…` for a missing id and failed to format the broker's storage."""
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" + bytes(15))])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(draws))
    cluster_id = broker.new_cluster_id()
    assert cluster_id == "AQAAAAAAAAAAAAAAAAAAAA"
    assert next(draws, None) is None, "the dash-led id must have been drawn and refused"
    monkeypatch.undo()
    ids = {broker.new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_the_storage_formats_arguments_reach_java_as_written_through_an_argfile(tmp_path):
    """The SCRAM credential (its salted password logs a client in) goes to StorageTool in a java
    @argfile, not on the command line: each argument arrives whole, double quotes, spaces,
    backslashes and single quotes kept."""
    import shutil
    import subprocess

    from kafka2pg.devtools.secured_listeners import SaslUser, scram_credential

    (tmp_path / "Echo.java").write_text(
        "public class Echo { public static void main(String[] a) { for (String s : a) System.out.println(s); } }"
    )
    subprocess.run([shutil.which("javac") or "javac", "-d", str(tmp_path), str(tmp_path / "Echo.java")], check=True)
    arguments = ["format", "-c", "/a dir/with 'quotes' and \\back\\slashes", "--add-scram"]
    arguments.append(scram_credential(SaslUser("kafka2pg_scram", "S3cr3t-PW")))
    (tmp_path / "args").write_text(broker._argfile(["Echo", *arguments]))
    echoed = subprocess.run(
        [shutil.which("java") or "java", "-cp", str(tmp_path), f"@{tmp_path / 'args'}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert echoed.stdout.splitlines() == arguments


def test_stack_reset_without_confirm_deletes_nothing(tmp_path, monkeypatch, capsys):
    """`stack reset` lists what it would delete and exits 1; only --confirm deletes. The recorded
    PIDs belong to no running broker or cluster, so nothing is stopped either."""
    from kafka2pg import cli

    work = local_stack.stack_dir(tmp_path)
    kafka_dir, cluster = work / "kafka", tmp_path / "elsewhere" / "kafka2pg-pg-x"
    for folder in (kafka_dir / "logs", cluster / "data"):
        folder.mkdir(parents=True)
        (folder / "kept").write_text("data")
    stack = local_stack.Stack(
        KafkaProcess(1, 9, 10, str(kafka_dir), str(kafka_dir / "kafka.log")),
        PostgresProcess(1, 11, str(cluster / "data"), str(cluster / "postgres.log"), "/nonexistent"),
    )
    local_stack.save_stack(stack, tmp_path)
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))

    assert cli.main(["stack", "reset"]) == 1
    output = capsys.readouterr().out
    assert "would stop the local stack and delete" in output and "nothing changed" in output
    assert all(str(path) in output for path in (kafka_dir, cluster, work))
    assert (kafka_dir / "logs" / "kept").exists() and (cluster / "data" / "kept").exists()
    assert local_stack.load_stack(tmp_path) == stack

    assert cli.main(["stack", "reset", "--confirm"]) == 0
    assert not kafka_dir.exists() and not cluster.exists() and not work.exists()
    assert cli.main(["stack", "reset"]) == 0, "nothing left to delete"


def test_stack_start_secured_refuses_a_recorded_stack_without_secured_listeners(tmp_path, monkeypatch, capsys):
    """A recorded stack keeps the listeners it started with: `stack start --secured` on one without
    them starts nothing, changes nothing and says how to get a secured stack."""
    from kafka2pg import cli

    kafka_dir = local_stack.stack_dir(tmp_path) / "kafka"
    stack = local_stack.Stack(
        KafkaProcess(1, 9, 10, str(kafka_dir), str(kafka_dir / "kafka.log")),
        PostgresProcess(1, 11, str(tmp_path / "pg" / "data"), str(tmp_path / "pg.log"), "/nonexistent"),
    )
    local_stack.save_stack(stack, tmp_path)
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))

    assert cli.main(["stack", "start", "--secured"]) == 2
    error = capsys.readouterr().err
    assert "started without secured listeners" in error and "nothing was started or changed" in error
    assert "`./kafka2pg stack start --secured`" in error
    assert local_stack.load_stack(tmp_path) == stack and not kafka_dir.exists()


def test_secured_client_configs_and_a_password_kept_out_of_repr(tmp_path):
    scram, plain = SaslUser("s", "scram-secret"), SaslUser("p", "plain-secret")
    listener = SecuredListener(
        sasl_ssl_bootstrap_servers="127.0.0.1:1",
        ssl_bootstrap_servers="127.0.0.1:2",
        ca_pem=tmp_path / "ca.pem",
        client_cert=tmp_path / "c.pem",
        client_key=tmp_path / "c.key",
        client_keystore_pem=tmp_path / "k.pem",
        scram=scram,
        plain=plain,
    )
    assert "secret" not in repr(listener)
    assert listener.client_config("scram") == {
        "bootstrap.servers": "127.0.0.1:1",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "s",
        "sasl.password": "scram-secret",
        "ssl.ca.location": str(tmp_path / "ca.pem"),
    }
    assert listener.client_config("plain")["sasl.mechanism"] == "PLAIN"
    assert listener.client_config("plain")["sasl.password"] == "plain-secret"
    assert listener.client_config("mtls") == {
        "bootstrap.servers": "127.0.0.1:2",
        "security.protocol": "SSL",
        "ssl.ca.location": str(tmp_path / "ca.pem"),
        "ssl.certificate.location": str(tmp_path / "c.pem"),
        "ssl.key.location": str(tmp_path / "c.key"),
    }


def test_the_stacks_ports_are_free_and_outside_the_range_the_kernel_gives_outgoing_connections():
    import socket

    from kafka2pg.devtools.processes import ephemeral_range, free_ports

    low, high = ephemeral_range()
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert not [p for p in ports if low <= p <= high or p < 1024], (ports, low, high)
    with socket.socket() as s:  # free once chosen
        s.bind(("127.0.0.1", ports[0]))


@pytest.mark.parametrize(
    ("argv", "owner"),
    [(["stop", "--confirm"], "reset"), (["status", "--bench"], "install"), (["reset", "--secured"], "start")],
)
def test_a_stack_flag_given_to_an_action_it_does_not_change_is_refused(tmp_path, monkeypatch, capsys, argv, owner):
    """`stack stop --confirm` read as "stop and delete" would otherwise stop and keep the data, silently."""
    from kafka2pg import cli

    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))
    assert cli.main(["stack", *argv]) == 2
    error = capsys.readouterr().err
    assert f"{argv[1]} is for `./kafka2pg stack {owner}` only" in error and "nothing was done" in error
    assert not any(tmp_path.iterdir())
