"""A connector's plugin archive, resolved by Maven, lands unpacked in Kafka Connect's plugin.path."""

import io
import tarfile

import pytest

from kafka2pg.exceptions import StackError
from kafka2pg.jars import _unpack_plugins, connect_plugin_path


def _archive(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_plugin_archive_is_unpacked_into_the_plugin_path_and_removed(tmp_path):
    (tmp_path / "connect-runtime-4.1.1.jar").write_bytes(b"worker")
    _archive(tmp_path / "sink-1.0-plugin.tar.gz", {"sink/sink-1.0.jar": b"jar", "sink/postgresql.jar": b"driver"})

    _unpack_plugins(tmp_path)

    plugin = connect_plugin_path(tmp_path) / "sink"
    assert sorted(p.name for p in plugin.iterdir()) == ["postgresql.jar", "sink-1.0.jar"]
    assert (plugin / "sink-1.0.jar").read_bytes() == b"jar"
    assert sorted(p.name for p in tmp_path.glob("*.jar")) == ["connect-runtime-4.1.1.jar"]  # the worker's, left
    assert not list(tmp_path.glob("*.tar.gz"))


def test_an_archive_member_outside_the_plugin_path_is_refused(tmp_path):
    _archive(tmp_path / "evil-plugin.tar.gz", {"../../escaped.jar": b"x"})

    with pytest.raises(tarfile.OutsideDestinationError):
        _unpack_plugins(tmp_path)

    assert not (tmp_path.parent / "escaped.jar").exists()


@pytest.mark.parametrize(("argv", "expected"), [([], ("kafka", "spark")), (["--bench"], ("kafka", "spark", "connect"))])
def test_stack_install_resolves_connect_only_for_the_benchmark(argv, expected, tmp_path, monkeypatch, capsys):
    """`./kafka2pg setup` and `./kafka2pg test` install with --bench: the Connect contender's jars
    come with set-up there, not with every command (the demo does not need 75 MB more)."""
    from kafka2pg import class_archive, cli, jars

    asked = []

    def resolve(cache, names=jars.SET_UP):
        asked.append(tuple(names))
        return {name: cache / "jars" / name for name in names}

    monkeypatch.setattr(jars, "resolve_jars", resolve)
    monkeypatch.setattr(class_archive, "ensure", lambda cache: None)
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))

    assert cli.main(["stack", "install", *argv]) == 0
    assert asked == [expected]
    assert f"connect jars: {tmp_path / 'jars' / 'connect'}" in capsys.readouterr().out or "--bench" not in argv


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("reader", "environ", "expected"),
    [
        ("librdkafka", {"KAFKA2PG_SPARK_JARS": "/opt/jars/*.jar"}, {}),
        ("spark", {"KAFKA2PG_SPARK_JARS": "/opt/jars/*.jar"}, {"spark.jars": "/opt/jars/*.jar"}),
        ("spark", {}, {"spark.jars.packages": "org.apache.spark:spark-sql-kafka-0-10_2.13:"}),
        ("spark", {"resolved": "1"}, {"spark.jars": "{state}/jars/spark/*.jar"}),
    ],
    ids=["librdkafka-needs-none", "given-jars", "packages", "resolved-jars"],
)
def test_the_cli_stages_with_the_kafka_source_the_dag_would_use(reader, environ, expected, tmp_path, monkeypatch):
    """`kafka2pg stage` and `replay` stage in a Spark session of their own: Spark's Kafka source comes
    as for the DAG's spark-submit, only for a pipeline reading with it; kafka2pg resolves no jars
    with Maven for it (the `spark.jars.packages` fallback is Spark's own)."""
    from types import SimpleNamespace

    from kafka2pg import cli, jars, staging

    monkeypatch.setattr(jars, "resolve_jars", lambda *a, **k: pytest.fail("Maven asked for a stage's jars"))
    monkeypatch.delenv("KAFKA2PG_SPARK_JARS", raising=False)
    monkeypatch.setenv("KAFKA2PG_STATE_DIR", str(tmp_path))
    environ = dict(environ)  # the parameter's own dict stays as it is for a rerun
    if environ.pop("resolved", None):
        (tmp_path / "jars" / "spark").mkdir(parents=True)
        (tmp_path / "jars" / "spark" / "spark-sql-kafka.jar").write_bytes(b"jar")
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    seen = {}

    def session(master, **kwargs):
        seen.update(kwargs.get("conf") or {}, jars=kwargs.get("jars"))
        raise _Stop

    monkeypatch.setattr(staging, "spark_session", session)
    settings = SimpleNamespace(state_dir=tmp_path, spark_master="local[1]")
    with pytest.raises(_Stop):
        cli._stage_locally(settings, SimpleNamespace(name="orders", kafka_reader=reader), 1)

    assert seen.pop("jars") is None
    expected = {key: value.format(state=tmp_path) for key, value in expected.items()}
    if "spark.jars.packages" in expected:
        assert seen.pop("spark.jars.packages").startswith(expected.pop("spark.jars.packages"))
    assert seen == expected


def test_sparks_kafka_source_is_resolved_for_the_installed_pyspark_and_again_when_it_changes(tmp_path, monkeypatch):
    """A pip-installed kafka2pg may run beside another pyspark than the pinned one: the Kafka
    source must be that pyspark's build, and jars resolved for another pyspark are not reused;
    jars resolved for the POM's own version (and marked so before versions were set) are, offline;
    and the jars in use stay until Maven has resolved their replacement."""
    import re
    import subprocess
    from pathlib import Path

    from kafka2pg import jars

    runs = []
    fails = []

    def mvn(command, **kwargs):
        runs.append(command)
        if fails:
            return subprocess.CompletedProcess(command, 1, "", "could not reach Maven Central")
        out = next(arg.removeprefix("-DoutputDirectory=") for arg in command if arg.startswith("-DoutputDirectory="))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"spark-sql-kafka-{len(runs)}.jar").write_bytes(b"jar")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(jars.shutil, "which", lambda name: "/usr/bin/mvn")
    monkeypatch.setattr(jars.subprocess, "run", mvn)
    pom = (jars.MAVEN_DIR / jars.POMS["spark"]).read_text()
    pinned = re.search(r"<spark.version>(.+)</spark.version>", pom).group(1)
    installed = {"pyspark": "4.0.1"}
    monkeypatch.setattr(jars.metadata, "version", lambda dist: installed[dist])
    spark = tmp_path / "jars" / "spark"

    jars.resolve_jars(tmp_path, ("spark",))
    assert "-Dspark.version=4.0.1" in runs[0]
    assert any(arg.startswith("org.apache.maven.plugins:maven-dependency-plugin:") for arg in runs[0])
    jars.resolve_jars(tmp_path, ("spark",))
    assert len(runs) == 1  # resolved once for that pyspark
    installed["pyspark"] = pinned
    fails.append(True)
    with pytest.raises(StackError, match="could not reach Maven Central"):
        jars.resolve_jars(tmp_path, ("spark",))
    assert [p.name for p in spark.glob("*.jar")] == ["spark-sql-kafka-1.jar"]  # still there
    fails.clear()
    jars.resolve_jars(tmp_path, ("spark",))
    assert not any(arg.startswith("-Dspark.version") for arg in runs[2])  # the POM's own
    assert [p.name for p in spark.glob("*.jar")] == ["spark-sql-kafka-3.jar"]
    assert (spark / ".complete").read_text() == pom  # as set-up marked it before versions were set
    jars.resolve_jars(tmp_path, ("spark",))
    assert len(runs) == 3
    # Resolved, then stopped before the jars in use were replaced: taken as they are, offline.
    (spark / ".complete").write_text("another POM")
    resolving = spark.with_name(".spark.resolving")
    resolving.mkdir()
    (resolving / "spark-sql-kafka-9.jar").write_bytes(b"jar")
    (resolving / ".complete").write_text(pom)
    jars.resolve_jars(tmp_path, ("spark",))
    assert len(runs) == 3 and [p.name for p in spark.glob("*.jar")] == ["spark-sql-kafka-9.jar"]
    assert not resolving.exists()
