"""What `kafka2pg quarantine` prints of a reason: a record's bytes quoted in it cannot move the
terminal's cursor or colour it."""

from kafka2pg.report import _printable


def test_control_characters_in_a_reason_are_escaped_and_the_rest_kept():
    reason = "field 'note': 'a\nb\x1b[31mred\x00' é 😀\t"
    assert _printable(reason) == "field 'note': 'a\\nb\\x1b[31mred\\x00' é 😀\\t"
