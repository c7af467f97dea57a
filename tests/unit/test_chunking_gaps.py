"""Unit: black chunk planning counts the manifest's gaps against a bundle's bytes.

Lost seqs whose reasons alternate do not merge: each is a gap of its own in the manifest. The
plan must count them (``gap_size_estimate``, never under their JSON), keep every chunk's rows
plus gaps within ``max_bytes`` and its gaps within ``max_gap_bytes``, spread more gaps than fit
over zero-row chunks ahead of the row they precede, and still cover every seq once, in order.
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.black.chunking import Chunk, gap_size_estimate, plan_chunks
from bridge.protocol.manifest import Gap
from tests.unit.test_chunking import _coverage


def _json_bytes(gaps: list[Gap]) -> int:
    """What the gaps add to a canonical manifest (``"gaps":[]`` holds them, commas between)."""
    if not gaps:
        return 0
    doc = [g.to_dict() for g in gaps]
    return len(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())


def _check(
    chunks: list[Chunk], seqs: np.ndarray, sizes: np.ndarray, max_bytes: int, max_gap: int
) -> None:
    for c in chunks:
        assert c.rows or c.gaps, "no empty chunk"
        gap_json = _json_bytes(c.gaps)
        assert gap_json <= c.gap_bytes
        assert int(sizes[c.start : c.stop].sum()) + c.gap_bytes == c.est_bytes
        if len(c.gaps) > 1:
            assert c.gap_bytes <= max_gap
        if len(c.gaps) + c.rows > 1:
            assert c.est_bytes <= max_bytes
        if c.rows:  # gaps precede or sit among the rows, never after the last one
            assert all(g.last_seq < int(seqs[c.stop - 1]) for g in c.gaps)
        for a, b in zip(c.gaps, c.gaps[1:], strict=False):
            assert a.last_seq < b.first_seq
            assert not (a.reason == b.reason and a.last_seq + 1 == b.first_seq), "unmerged"


def test_gap_size_estimate_is_never_under_the_json() -> None:
    for g in [
        Gap(0, 0, "x"),
        Gap(7, 123_456_789_012, "maxlen"),
        Gap(2**62, 2**63 - 1, 'é\u2028\U0001f600"\\\n' * 50),
    ]:
        assert gap_size_estimate(g) >= _json_bytes([g]) + 1  # and the comma
        assert gap_size_estimate(g) <= _json_bytes([g]) + 1 + 5 * len(g.reason) + 3


def test_interleaved_gaps_before_a_small_row_go_ahead_in_zero_row_chunks() -> None:
    """The reviewer's case: 18k single-seq gaps with alternating reasons, then one small row
    (10 bytes): the row is neither dropped nor packed with more gaps than fit."""
    n_gaps = 20_000  # ~57 bytes each: over 1 MiB
    reasons = {s: ("maxlen" if s % 2 else "expired") for s in range(n_gaps)}
    seqs = np.array([n_gaps], dtype=np.int64)
    sizes = np.array([10], dtype=np.int64)
    max_bytes, max_gap = 1 << 20, (1 << 20) - 8192
    chunks, dropped = plan_chunks(
        seqs, sizes, last_seq=-1, max_rows=100, max_bytes=max_bytes, max_row_bytes=max_bytes,
        gap_reasons=reasons, max_gap_bytes=max_gap,
    )  # fmt: skip
    assert dropped == []
    assert _coverage(chunks, seqs) == list(range(n_gaps + 1))
    _check(chunks, seqs, sizes, max_bytes, max_gap)
    assert [c.rows for c in chunks] == [0] * (len(chunks) - 1) + [1]
    assert len(chunks) >= 2
    assert not [g for c in chunks for g in c.gaps if g.reason == "oversize"]


def test_gaps_among_rows_and_after_the_last_row_are_split() -> None:
    rows = list(range(0, 3000, 3))  # a row, then two lost seqs of different reasons
    seqs = np.array(rows, dtype=np.int64)
    sizes = np.full(len(rows), 300, dtype=np.int64)
    reasons = {s: ("maxlen" if s % 3 == 1 else "expired") for s in range(4000) if s % 3}
    max_bytes, max_gap = 40_000, 30_000
    chunks, dropped = plan_chunks(
        seqs, sizes, last_seq=-1, max_rows=10_000, max_bytes=max_bytes, max_row_bytes=max_bytes,
        gap_reasons=reasons, through_seq=3999, max_gap_bytes=max_gap,
    )  # fmt: skip
    assert dropped == []
    assert _coverage(chunks, seqs) == list(range(4000))
    _check(chunks, seqs, sizes, max_bytes, max_gap)
    assert chunks[-1].rows == 0 and chunks[-2].rows == 0  # ~670 trailing gaps: two chunks
    assert sum(c.rows for c in chunks) == len(rows)


@settings(max_examples=200, deadline=None)
@given(
    last_seq=st.integers(-1, 50),
    steps=st.lists(st.integers(1, 6), min_size=0, max_size=150),
    sizes=st.lists(st.integers(1, 3000), min_size=150, max_size=150),
    lost=st.lists(
        st.sampled_from(["maxlen", "expired", "rejected", None]), min_size=300, max_size=300
    ),
    tail=st.integers(0, 40),
    max_rows=st.integers(1, 40),
    max_bytes=st.integers(500, 8000),
    max_gap=st.integers(100, 8000),
    max_row_bytes=st.integers(200, 4000),
)
def test_plan_with_gaps_covers_every_seq_once_within_limits(
    last_seq: int,
    steps: list[int],
    sizes: list[int],
    lost: list[str | None],
    tail: int,
    max_rows: int,
    max_bytes: int,
    max_gap: int,
    max_row_bytes: int,
) -> None:
    seqs = np.cumsum(np.array(steps, dtype=np.int64)) + last_seq
    sz = np.array(sizes[: len(seqs)], dtype=np.int64)
    end = (int(seqs[-1]) if len(seqs) else last_seq) + tail
    reasons = {
        s: r for s, r in zip(range(last_seq + 1, end + 1), lost, strict=False) if r is not None
    }
    chunks, dropped = plan_chunks(
        seqs, sz, last_seq=last_seq, max_rows=max_rows, max_bytes=max_bytes,
        max_row_bytes=max_row_bytes, gap_reasons=reasons, through_seq=end,
        max_gap_bytes=max_gap,
    )  # fmt: skip
    assert _coverage(chunks, seqs) == list(range(last_seq + 1, end + 1))
    _check(chunks, seqs, sz, max_bytes, min(max_gap, max_bytes))
    assert set(dropped) == {i for i in range(len(seqs)) if sz[i] > max_row_bytes}
    assert all(c.rows <= max_rows for c in chunks)
    oversize = {
        s for c in chunks for g in c.gaps if g.reason == "oversize"
        for s in range(g.first_seq, g.last_seq + 1)
    }  # fmt: skip
    assert oversize == {int(seqs[i]) for i in dropped}
