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
