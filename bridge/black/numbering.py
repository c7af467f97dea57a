"""Black, seal: give drained messages their gapless per-channel ``seq`` from stream offsets.

Stream offsets are not gapless: every new stream segment starts with a tracking chunk that
takes one offset. So black numbers messages itself, in offset order, continuing from its
journal. A jump in offsets is one of two things:

* a hole (a non-message offset) — the missing offsets are still at or after the stream's first
  retained offset ``F``, or sit at ``F - 1`` (the tracking chunk that opens the first segment);
* a loss — stream retention dropped the offsets before black read them: those below ``F - 1``.

Each lost offset gets a seq, so red sees exactly which seq range is missing. The count is an
upper bound (a lost range may itself have contained segment holes), never an under-count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["assign_seqs"]


def assign_seqs(
    offsets: np.ndarray,
    *,
    last_offset: int,
    last_seq: int,
    first_retained: Callable[[], int],
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(seqs, lost_before)`` for strictly increasing ``offsets`` > ``last_offset``.

    ``first_retained`` is called (once, and only when offsets jump) for the stream's first
    retained message offset.
    """
    offs = np.asarray(offsets, dtype=np.int64)
    n = len(offs)
    lost = np.zeros(n, dtype=np.int64)
    if n == 0:
        return np.zeros(0, dtype=np.int64), lost
    prev = np.empty(n, dtype=np.int64)
    prev[0] = last_offset
    prev[1:] = offs[:-1]
    if np.any(offs <= prev):
        raise ValueError(
            "stream offsets must be strictly increasing and after the last shipped one"
        )
    jumps = offs > prev + 1
    if np.any(jumps):
        # F is asked now, possibly a batch after the read; but reading the row right after a
        # jump proves that, at that moment, F <= its offset: cap F per jump by that row
        f = np.minimum(int(first_retained()), offs)
        a = prev + 1  # first missing offset
        b = offs - 1  # last missing offset
        hi = np.minimum(b, f - 2)  # offsets below F-1 were dropped by retention
        lost = np.where(jumps, np.maximum(hi - a + 1, 0), 0).astype(np.int64)
    seqs = last_seq + np.cumsum(1 + lost)
    return seqs.astype(np.int64), lost
