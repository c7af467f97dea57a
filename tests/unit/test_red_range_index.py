"""Red, landing: ``_range_index`` (which sorted, disjoint seq range holds each row) against a
plain scan, for the skip filter and the per-row ``inexact`` reasons."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from bridge.red.landing import _range_index


@st.composite
def _case(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int]]]:
    cuts = sorted(draw(st.sets(st.integers(0, 60), max_size=12)))
    pairs = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    ranges = [(a, b - draw(st.integers(0, 1)) if b > a else b) for a, b in pairs]
    seqs = sorted(draw(st.sets(st.integers(0, 64), max_size=40)))
    return seqs, ranges


@given(_case())
def test_range_index_matches_a_plain_scan(case: tuple[list[int], list[tuple[int, int]]]) -> None:
    seqs, ranges = case
    got = _range_index(pa.array(seqs, pa.int64()), ranges).to_pylist()
    want = [next((i for i, (a, b) in enumerate(ranges) if a <= s <= b), None) for s in seqs]
    assert got == want, (seqs, ranges)


def test_range_index_edges() -> None:
    seqs = pa.array([0, 1, 2, 3, 4, 5, 9], pa.int64())
    assert _range_index(seqs, [(0, 0), (3, 4), (9, 9)]).to_pylist() == [
        0, None, None, 1, 1, None, 2
    ]  # fmt: skip
    assert _range_index(seqs, []).null_count == 7
    assert _range_index(pa.array([], pa.int64()), [(1, 2)]).to_pylist() == []
