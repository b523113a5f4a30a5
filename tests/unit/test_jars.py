"""A connector's plugin archive, resolved by Maven, lands unpacked in Kafka Connect's plugin.path."""

import io
import tarfile

import pytest

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
