"""Red, replay planning (pure): a batch's last landing commit from Delta file statistics."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FileStat", "plan_upper", "rows_upto"]

FileStat = tuple[int, int, int]
"""``(min land_seq, max land_seq, rows)`` of one data file (or one land_seq value)."""


def rows_upto(files: Iterable[FileStat], lo: int, hi: int) -> float:
    """Estimated rows of landing commits ``[lo, hi]``: a file's rows are taken as spread evenly
    over its ``[min, max]`` land_seq span (a compacted file holds many commits)."""
    total = 0.0
    for mn, mx, n in files:
        first = max(mn, lo)
        if n <= 0 or mx < lo or hi < first:
            continue
        total += n * (min(hi, mx) - first + 1) / (mx - mn + 1)
    return total


def plan_upper(files: Iterable[FileStat], lo: int, batch_rows: int) -> int | None:
    """The last landing commit of the next batch: the smallest ``hi >= lo`` whose commits
    ``[lo, hi]`` hold about ``batch_rows`` rows (:func:`rows_upto`; the last commit with rows
    when fewer are left). None: no row at or after ``lo``. Rows of commits ``[lo, hi]`` are
    then read whole: one commit holding more than ``batch_rows`` rows is one batch, but a file
    that compacts many commits (``diode red maintain``) is read a few commits at a time."""
    live = [(mn, mx, n) for mn, mx, n in files if mx >= lo and n > 0]
    if not live:
        return None
    top = max(mx for _, mx, _ in live)
    if rows_upto(live, lo, top) < batch_rows:
        return top
    low, high = lo, top  # rows_upto grows with hi: the smallest hi that makes the batch
    while low < high:
        mid = (low + high) // 2
        if rows_upto(live, lo, mid) >= batch_rows - 1e-9:
            high = mid
        else:
            low = mid + 1
    return low
