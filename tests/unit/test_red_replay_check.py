"""Red, replay: the pure pieces of the review fixes (row checks, rows confirmed ahead, returns)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bridge.protocol.properties import Properties, encode_properties, field_table
from bridge.red.replay_check import name_problem, row_problem
from bridge.red.replay_state import Progress, compress_keys, expand_ranges
from bridge.red.replay_window import ConfirmWindow

PLAIN = encode_properties(Properties(delivery_mode=1))


def test_rows_the_broker_cannot_take_are_named() -> None:
    assert row_problem("rk", PLAIN, 131072) is None
    assert row_problem("k" * 255, PLAIN, 131072) is None
    assert "300 bytes" in (row_problem("\ufffd" * 100, PLAIN, 131072) or "")
    assert "do not parse" in (row_problem("rk", b"\x80\x00\x10abc", 131072) or "")
    assert "continuation" in (row_problem("rk", b"\x00\x01\x00\x00", 131072) or "")
    assert "do not parse" in (row_problem("rk", b"\x20\x00\x00\x00\x00\x03\x01kS", 131072) or "")
    big = encode_properties(Properties(headers=field_table({"b": "x" * 5000})))
    assert row_problem("rk", big, 131072) is None
    assert "frame_max 4096" in (row_problem("rk", big, 4096) or "")
    assert name_problem("x" * 255) is None and "256 bytes" in (name_problem("x" * 256) or "")


def test_header_tables_are_decoded_once_per_lane() -> None:
    ok: dict[bytes, None] = {}
    rich = encode_properties(Properties(headers=field_table({"a": 1})))
    assert row_problem("rk", rich, 131072, ok) is None and len(ok) == 1


keys = st.sets(st.tuples(st.integers(0, 5), st.sampled_from(["c1", "c2"]), st.integers(0, 40)))


@given(keys)
def test_rows_confirmed_ahead_survive_the_saved_progress(ahead: set[tuple[int, str, int]]) -> None:
    assert expand_ranges(compress_keys(ahead)) == ahead
    p = Progress(land_seq=1, channel="c1", seq=3, ahead=ahead)
    assert Progress.from_json(p.to_json()).ahead == ahead


def test_a_return_is_matched_to_its_publish_in_order() -> None:
    w = ConfirmWindow()
    ks = [(1, "c1", i) for i in range(5)]
    w.sent_many(1, ks, None, [("a", b"x"), ("b", b"y"), ("b", b"y"), ("a", b"z"), ("b", b"y")])
    assert w.returned("b", b"y") == ks[1]
    assert w.returned("b", b"y") == ks[2]  # the same message again: the next publish of it
    assert w.returned("a", b"q") is None
    assert w.returned("b", b"y") == ks[4]
    assert w.keys() == ks
