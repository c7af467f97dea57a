"""Black, seal: cut one channel's sorted rows into bundle-sized chunks and find the gaps.

Pure logic (no I/O). A chunk closes at ``max_rows`` or before its estimated bytes — its rows
and the gaps its manifest lists (~54 bytes of JSON each) — would pass ``max_bytes``. Message
seqs that are missing between the last shipped seq and the rows (the broker dropped them from
the mirror queue: their spool records are *lost* markers) become gaps with the reason given for
each seq (``gap_reasons``; ``missing`` if none); a single message too large for the configured
file ceiling becomes a gap of reason ``oversize``. Gaps ride in the manifest of the chunk that
follows them (more than fit one bundle go first, in zero-row chunks of their own), so the
coverage of consecutive bundles — ``[min(first_seq, gap firsts), max(last_seq, gap lasts)]``
— is contiguous on the wire."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bridge.protocol.manifest import Gap

__all__ = [
    "Chunk",
    "plan_chunks",
    "row_size_estimate",
    "gap_size_estimate",
    "ROW_OVERHEAD_BYTES",
    "GAP_OVERHEAD_BYTES",
    "BUNDLE_BASE_BYTES",
]

ROW_OVERHEAD_BYTES = 256
"""Estimated bytes per row besides body and typed headers (properties, exchange, key)."""

GAP_OVERHEAD_BYTES = 40
"""Bytes of a manifest gap besides its two seqs and its reason (``{"first_seq":…}`` and a comma:
37)."""

BUNDLE_BASE_BYTES = 8192
"""Bytes of a bundle's plaintext besides its rows and gaps, rounded up: an empty Parquet file
of the row schema (~4.6 KB) and the manifest's other fields (~450 bytes)."""


@dataclass
class Chunk:
    """Rows ``[start, stop)`` of the sorted table, plus the gaps that precede or sit inside them."""

    start: int
    stop: int
    gaps: list[Gap] = field(default_factory=list)
    est_bytes: int = 0
    """Estimated bytes of the rows and of the gaps (``gap_size_estimate``)."""
    gap_bytes: int = 0
    """The gaps' share of ``est_bytes``."""

    @property
    def rows(self) -> int:
        return self.stop - self.start


_SIZED_COLUMNS = (
    "body",
    "headers_typed",
    "routing_key",
    "exchange_arguments",
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)


def row_size_estimate(table: pa.Table) -> np.ndarray:
    """Estimated uncompressed bytes of every row: every variable-length column + overhead.

    Typed headers count twice: they are stored typed and rendered (the ``headers`` map).
    """
    total = np.full(len(table), ROW_OVERHEAD_BYTES, dtype=np.int64)
    for name in _SIZED_COLUMNS:
        if name not in table.column_names:
            continue
        n = pc.fill_null(pc.binary_length(table.column(name)), 0).to_numpy(zero_copy_only=False)
        total += n.astype(np.int64) * (2 if name == "headers_typed" else 1)
    return total


def gap_size_estimate(gap: Gap) -> int:
    """Upper bound of the bytes ``gap`` adds to a manifest: its canonical JSON and a comma."""
    return (
        GAP_OVERHEAD_BYTES
        + len(str(gap.first_seq))
        + len(str(gap.last_seq))
        + _reason_bytes(gap.reason)
    )


@lru_cache(maxsize=256)
def _reason_bytes(reason: str) -> int:
    # ASCII-escaped JSON is at least as long as the UTF-8 JSON the manifest is written in
    return len(json.dumps(reason, ensure_ascii=True))


class _Gaps:
    """Gaps in seq order, adjacent ones of the same reason merged as they come, and their
    estimated manifest bytes."""

    def __init__(self) -> None:
        self.items: list[Gap] = []
        self.bytes = 0

    def add(self, g: Gap) -> None:
        items = self.items
        if items and items[-1].reason == g.reason and items[-1].last_seq + 1 == g.first_seq:
            old = items[-1]
            items[-1] = Gap(old.first_seq, g.last_seq, g.reason)
            self.bytes += gap_size_estimate(items[-1]) - gap_size_estimate(old)
        else:
            items.append(g)
            self.bytes += gap_size_estimate(g)

    def take(self) -> tuple[list[Gap], int]:
        out = self.items, self.bytes
        self.items, self.bytes = [], 0
        return out


def plan_chunks(
    seqs: np.ndarray,
    sizes: np.ndarray,
    *,
    last_seq: int,
    max_rows: int,
    max_bytes: int,
    max_row_bytes: int,
    gap_reasons: Mapping[int, str] | None = None,
    through_seq: int | None = None,
    max_gap_bytes: int | None = None,
) -> tuple[list[Chunk], list[int]]:
    """Plan chunks over rows sorted by strictly increasing ``seqs``.

    Returns the chunks and the indexes of rows dropped as ``oversize`` (already listed as gaps
    in the chunks). ``last_seq`` is the last seq already covered by shipped bundles;
    ``through_seq`` the last seq these rows account for (seqs after the last row up to it are
    gaps too); ``gap_reasons`` the reason of each missing seq.

    A chunk's ``est_bytes`` counts its rows and its gaps (``gap_size_estimate``) and stays
    within ``max_bytes``; its gaps alone stay within ``max_gap_bytes`` (default
    ``max_bytes``). Gaps that do not fit with the row they precede go first, in zero-row
    chunks of their own (a chunk holds at least one gap or row, whatever its size).
    """
    reasons = gap_reasons or {}
    gap_cap = max_bytes if max_gap_bytes is None else min(max_gap_bytes, max_bytes)

    chunks: list[Chunk] = []
    dropped: list[int] = []
    cur: Chunk | None = None
    pending = _Gaps()

    def missing(first: int, last: int) -> None:
        if not reasons:
            pending.add(Gap(first, last, "missing"))
            return
        for s in range(first, last + 1):
            pending.add(Gap(s, s, reasons.get(s, "missing")))

    def spill(at: int, room: int) -> tuple[list[Gap], int]:
        """Pending gaps into zero-row chunks (at row index ``at``) until the rest fits in
        ``room`` bytes; returns the rest."""
        gaps, total = pending.take()
        if total <= room or not gaps:
            return gaps, total
        group: list[Gap] = []
        group_bytes = 0
        for g in gaps:
            b = gap_size_estimate(g)
            if group and group_bytes + b > gap_cap:
                chunks.append(Chunk(at, at, group, group_bytes, group_bytes))
                group, group_bytes = [], 0
            group.append(g)
            group_bytes += b
        if group_bytes <= room:
            return group, group_bytes
        chunks.append(Chunk(at, at, group, group_bytes, group_bytes))
        return [], 0

    expected = last_seq + 1
    n = len(seqs)
    for i in range(n):
        s = int(seqs[i])
        if s < expected:
            raise ValueError(f"seq {s} not after {expected - 1}: rows must be sorted and new")
        if s > expected:
            missing(expected, s - 1)
        expected = s + 1
        size = int(sizes[i])
        if size > max_row_bytes:
            pending.add(Gap(s, s, "oversize"))
            dropped.append(i)
            if cur is not None:
                # close the chunk so the dropped row's gap lands in the next one, in order
                chunks.append(cur)
                cur = None
            continue
        if cur is not None and (
            cur.rows >= max_rows
            or cur.est_bytes + pending.bytes + size > max_bytes
            or cur.gap_bytes + pending.bytes > gap_cap
        ):
            chunks.append(cur)
            cur = None
        if cur is None:
            gaps, gap_bytes = spill(i, min(max_bytes - size, gap_cap))
            cur = Chunk(start=i, stop=i, gaps=gaps, est_bytes=gap_bytes, gap_bytes=gap_bytes)
        elif pending.items:
            gaps, gap_bytes = pending.take()
            cur.gaps.extend(gaps)
            cur.est_bytes += gap_bytes
            cur.gap_bytes += gap_bytes
        cur.stop = i + 1
        cur.est_bytes += size
    if cur is not None:
        chunks.append(cur)
    if through_seq is not None and through_seq >= expected:
        missing(expected, through_seq)
    if pending.items:
        # gaps after the last row (or no rows at all): zero-row bundles carry them
        gaps, gap_bytes = spill(n, gap_cap)
        if gaps:
            chunks.append(Chunk(n, n, gaps, gap_bytes, gap_bytes))
    return chunks, dropped
