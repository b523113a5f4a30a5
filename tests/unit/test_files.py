"""A report or the stack's state is replaced whole: a write that fails halfway (a kill, a full
disk, a value that cannot be encoded) leaves the previous file as it was and no partial file."""

import pytest

from kafka2pg.files import write_whole


def test_a_write_that_fails_halfway_leaves_the_previous_file_whole(tmp_path):
    report = tmp_path / "batch-7.html"
    write_whole(report, "<p>verdict: promotable</p>")
    assert report.read_text(encoding="utf-8") == "<p>verdict: promotable</p>"

    with pytest.raises(UnicodeEncodeError):
        write_whole(report, "<p>verdict: rejected " + "x" * 100_000 + "\udc80</p>")  # fails after 100 kB

    assert report.read_text(encoding="utf-8") == "<p>verdict: promotable</p>"
    assert [p.name for p in tmp_path.iterdir()] == ["batch-7.html"]
    write_whole(report, "<p>verdict: rejected, 3 duplicates ✓</p>")
    assert report.read_text(encoding="utf-8") == "<p>verdict: rejected, 3 duplicates ✓</p>"


def test_a_file_keeps_its_permissions_and_a_symlink_its_link_and_writers_at_once_never_collide(tmp_path):
    import os
    import stat
    import threading

    env = tmp_path / "stack.env"
    write_whole(env, "export A=1\n")
    env.chmod(0o600)
    write_whole(env, "export A=2\n")
    assert (stat.S_IMODE(env.stat().st_mode), env.read_text()) == (0o600, "export A=2\n")

    real = tmp_path / "reports" / "batch-1.html"
    real.parent.mkdir()
    write_whole(real, "old")
    link = tmp_path / "latest.html"
    link.symlink_to(real)
    write_whole(link, "new")
    assert link.is_symlink() and real.read_text() == "new"

    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(100):
                write_whole(real, f"writer {n} round {i}")
        except BaseException as exc:  # noqa: BLE001 - the test reads what a thread met
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert real.read_text().startswith("writer ")
    assert sorted(os.listdir(real.parent)) == ["batch-1.html"]
