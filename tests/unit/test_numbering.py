"""Unit: black seq numbering over stream offsets with holes and retention losses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.black.numbering import assign_seqs


def _never() -> int:
    raise AssertionError("first_retained must not be asked when offsets are contiguous")


def test_contiguous_offsets_number_from_the_journal() -> None:
    seqs, lost = assign_seqs(np.arange(10, 15), last_offset=9, last_seq=99, first_retained=_never)
    assert seqs.tolist() == [100, 101, 102, 103, 104] and lost.sum() == 0


def test_segment_holes_are_not_losses() -> None:
    # offsets 5 and 9 are segment tracking chunks; the stream still retains from offset 0
    offs = np.array([3, 4, 6, 7, 8, 10])
    seqs, lost = assign_seqs(offs, last_offset=2, last_seq=2, first_retained=lambda: 0)
    assert seqs.tolist() == [3, 4, 5, 6, 7, 8] and lost.sum() == 0


def test_retention_loss_gets_seqs() -> None:
    # black shipped up to offset 9; retention dropped everything before segment start 40,
    # whose first message is 41 (offset 40 is the segment's tracking chunk)
    offs = np.array([41, 42])
    seqs, lost = assign_seqs(offs, last_offset=9, last_seq=9, first_retained=lambda: 41)
    assert lost.tolist() == [30, 0]  # offsets 10..39 lost, 40 is a hole
    assert seqs.tolist() == [40, 41]


def test_caught_up_reader_sees_no_false_loss_when_its_segment_is_truncated() -> None:
    seqs, lost = assign_seqs(np.array([21]), last_offset=19, last_seq=7, first_retained=lambda: 21)
    assert lost.tolist() == [0] and seqs.tolist() == [8]


def test_rejects_replayed_offsets() -> None:
    with pytest.raises(ValueError):
        assign_seqs(np.array([5, 6]), last_offset=5, last_seq=0, first_retained=_never)


@given(
    steps=st.lists(st.integers(1, 3), max_size=50),
    last_offset=st.integers(-1, 100),
    last_seq=st.integers(-1, 100),
)
def test_seqs_are_gapless_when_nothing_is_lost(
    steps: list[int], last_offset: int, last_seq: int
) -> None:
    offs = last_offset + np.cumsum(np.array(steps, dtype=np.int64))
    seqs, lost = assign_seqs(
        offs, last_offset=last_offset, last_seq=last_seq, first_retained=lambda: 0
    )
    assert seqs.tolist() == list(range(last_seq + 1, last_seq + 1 + len(offs)))
    assert lost.sum() == 0


def test_retention_advancing_after_the_read_makes_no_false_gap() -> None:
    # rows 1000..2999 read with segment holes at 1500 and 2500; by the time the batch is
    # sealed, retention has moved the stream's start to 2501: the holes are still holes
    offs = np.array([o for o in range(1000, 3000) if o not in (1500, 2500)])
    seqs, lost = assign_seqs(offs, last_offset=999, last_seq=99, first_retained=lambda: 2501)
    assert lost.sum() == 0 and seqs.tolist() == list(range(100, 100 + len(offs)))
