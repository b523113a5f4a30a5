"""The demo's sample of what landed: the target's rows as PostgreSQL's text shows them."""

from kafka2pg.devtools.demo import _sample


def test_a_null_is_shown_as_null_not_as_the_text_none_and_escapes_and_long_values_are_made_safe():
    columns = ["event_id", "note", "text_none", "payload"]
    rows = [("e1", None, "None", '{"k": "' + "x" * 100 + '"}'), ("e2", "red \x1b[31m\nline", "", "{}")]
    shown = _sample("public.orders", 10, columns, rows)
    lines = shown.splitlines()
    assert lines[0] == "the first 2 of the 10 rows in public.orders (by partition and offset):"
    assert "note: NULL, text_none: None, payload: " + '{"k": "' + "x" * 50 + "..." in lines[1]
    assert lines[2] == r"  event_id: e2, note: red \x1b[31m\nline, text_none: , payload: {}"


def test_an_empty_target_says_so():
    assert _sample("public.orders", 0, ["event_id"], []) == "no rows in public.orders"
