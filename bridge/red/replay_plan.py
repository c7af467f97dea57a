"""Red, replay planning (pure): a batch's last landing commit from Delta file statistics."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FileStat", "plan_upper"]

FileStat = tuple[int, int, int]
"""``(min land_seq, max land_seq, rows)`` of one data file (or one land_seq value)."""


def plan_upper(files: Iterable[FileStat], lo: int, batch_rows: int) -> int | None:
    """The last landing commit of the next batch: the smallest ``max land_seq`` of a file
    such that the files ending at or before it hold about ``batch_rows`` rows at or after
    ``lo`` (a file that straddles ``lo`` counts in proportion). None: no row at or after
    ``lo``. Rows of commits ``[lo, result]`` are then read whole."""
    ends: list[tuple[int, float]] = []
    for mn, mx, n in files:
        if mx < lo or n <= 0:
            continue
        share = n if mn >= lo else n * (mx - lo + 1) / (mx - mn + 1)
        ends.append((mx, share))
    if not ends:
        return None
    ends.sort()
    total = 0.0
    for mx, share in ends:
        total += share
        if total >= batch_rows:
            return mx
    return ends[-1][0]
