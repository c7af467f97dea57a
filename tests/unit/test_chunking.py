"""Unit: black chunk planning — limits respected, every seq covered exactly once, gaps exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.black.chunking import plan_chunks


def _coverage(chunks, seqs) -> list[int]:  # type: ignore[no-untyped-def]
    covered: list[int] = []
    for c in chunks:
        items = [(int(seqs[i]), "row") for i in range(c.start, c.stop)]
        items += [(s, "gap") for g in c.gaps for s in range(g.first_seq, g.last_seq + 1)]
        covered.extend(sorted(s for s, _ in items))
    return covered


@settings(max_examples=300, deadline=None)
@given(
    last_seq=st.integers(-1, 50),
    steps=st.lists(st.integers(1, 4), min_size=0, max_size=120),
    sizes=st.lists(st.integers(1, 5000), min_size=120, max_size=120),
    max_rows=st.integers(1, 40),
    max_bytes=st.integers(1000, 20000),
    max_row_bytes=st.integers(500, 6000),
)
def test_plan_covers_every_seq_once_within_limits(
    last_seq: int,
    steps: list[int],
    sizes: list[int],
    max_rows: int,
    max_bytes: int,
    max_row_bytes: int,
) -> None:
    seqs = np.cumsum(np.array(steps, dtype=np.int64)) + last_seq
    sz = np.array(sizes[: len(seqs)], dtype=np.int64)
    chunks, dropped = plan_chunks(
        seqs,
        sz,
        last_seq=last_seq,
        max_rows=max_rows,
        max_bytes=max_bytes,
        max_row_bytes=max_row_bytes,
    )
    end = int(seqs[-1]) if len(seqs) else last_seq
    # the chunks, in order, cover last_seq+1 .. end exactly once, with nothing out of order
    assert _coverage(chunks, seqs) == list(range(last_seq + 1, end + 1))
    for c in chunks:
        assert c.rows <= max_rows
        if c.rows > 1:
            assert int(sz[c.start : c.stop].sum()) <= max_bytes
        assert all(int(sz[i]) <= max_row_bytes for i in range(c.start, c.stop))
    assert set(dropped) == {i for i in range(len(seqs)) if sz[i] > max_row_bytes}
    for c in chunks:
        for g in c.gaps:
            assert g.reason in {"missing", "oversize"}
            assert g.first_seq <= g.last_seq


def test_gap_reasons() -> None:
    seqs = np.array([5, 6, 9, 10], dtype=np.int64)
    sz = np.array([10, 10_000, 10, 10], dtype=np.int64)
    chunks, dropped = plan_chunks(
        seqs, sz, last_seq=2, max_rows=10, max_bytes=10**6, max_row_bytes=1000
    )
    assert dropped == [1]
    gaps = [(g.first_seq, g.last_seq, g.reason) for c in chunks for g in c.gaps]
    assert gaps == [(3, 4, "missing"), (6, 6, "oversize"), (7, 8, "missing")]


def test_lost_markers_carry_their_reason_and_trailing_gaps_are_kept() -> None:
    """Seqs the broker dropped (spool lost markers) become gaps with their reason, merged per
    reason; lost seqs after the last row (``through_seq``) ride in a zero-row chunk."""
    seqs = np.array([0, 4, 5], dtype=np.int64)
    sz = np.array([10, 10, 10], dtype=np.int64)
    reasons = {1: "maxlen", 2: "maxlen", 3: "expired", 6: "maxlen", 7: "maxlen"}
    chunks, dropped = plan_chunks(
        seqs, sz, last_seq=-1, max_rows=10, max_bytes=10**6, max_row_bytes=1000,
        gap_reasons=reasons, through_seq=7,
    )  # fmt: skip
    assert dropped == []
    gaps = [(g.first_seq, g.last_seq, g.reason) for c in chunks for g in c.gaps]
    assert gaps == [(1, 2, "maxlen"), (3, 3, "expired"), (6, 7, "maxlen")]
    assert chunks[-1].rows == 0 and [g.first_seq for g in chunks[-1].gaps] == [6]


def test_unsorted_rows_are_a_bug() -> None:
    with pytest.raises(ValueError):
        plan_chunks(
            np.array([3, 2]),
            np.array([1, 1]),
            last_seq=0,
            max_rows=5,
            max_bytes=99,
            max_row_bytes=99,
        )
