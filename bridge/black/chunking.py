"""Black, seal: cut one channel's sorted rows into bundle-sized chunks and find the gaps.

Pure logic (no I/O). A chunk closes at ``max_rows`` or before its estimated bytes would pass
``max_bytes``. Message seqs that are missing between the last shipped seq and the rows (the
broker dropped them from the mirror queue: their spool records are *lost* markers) become
gaps with the reason given for each seq (``gap_reasons``; ``missing`` if none); a single
message too large for the configured file ceiling becomes a gap of reason ``oversize``.
Gaps ride in the manifest of the chunk that follows them, so the coverage of consecutive
bundles — ``[min(first_seq, gap firsts), max(last_seq, gap lasts)]`` — is
contiguous on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bridge.protocol.manifest import Gap

__all__ = ["Chunk", "plan_chunks", "row_size_estimate", "ROW_OVERHEAD_BYTES"]

ROW_OVERHEAD_BYTES = 256
"""Estimated bytes per row besides body and typed headers (properties, exchange, key)."""


@dataclass
class Chunk:
    """Rows ``[start, stop)`` of the sorted table, plus the gaps that precede or sit inside them."""

    start: int
    stop: int
    gaps: list[Gap] = field(default_factory=list)
    est_bytes: int = 0

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
) -> tuple[list[Chunk], list[int]]:
    """Plan chunks over rows sorted by strictly increasing ``seqs``.

    Returns the chunks and the indexes of rows dropped as ``oversize`` (already listed as gaps
    in the chunks). ``last_seq`` is the last seq already covered by shipped bundles;
    ``through_seq`` the last seq these rows account for (seqs after the last row up to it are
    gaps too); ``gap_reasons`` the reason of each missing seq.
    """
    reasons = gap_reasons or {}

    def missing(first: int, last: int) -> list[Gap]:
        return (
            [Gap(s, s, reasons.get(s, "missing")) for s in range(first, last + 1)]
            if (reasons)
            else [Gap(first, last, "missing")]
        )

    chunks: list[Chunk] = []
    dropped: list[int] = []
    cur: Chunk | None = None
    pending_gaps: list[Gap] = []
    expected = last_seq + 1
    n = len(seqs)
    for i in range(n):
        s = int(seqs[i])
        if s < expected:
            raise ValueError(f"seq {s} not after {expected - 1}: rows must be sorted and new")
        if s > expected:
            pending_gaps.extend(missing(expected, s - 1))
        expected = s + 1
        size = int(sizes[i])
        if size > max_row_bytes:
            pending_gaps.append(Gap(s, s, "oversize"))
            dropped.append(i)
            if cur is not None:
                # close the chunk so the dropped row's gap lands in the next one, in order
                chunks.append(cur)
                cur = None
            continue
        if cur is not None and (cur.rows >= max_rows or cur.est_bytes + size > max_bytes):
            chunks.append(cur)
            cur = None
        if cur is None:
            cur = Chunk(start=i, stop=i, gaps=pending_gaps)
            pending_gaps = []
        elif pending_gaps:
            cur.gaps.extend(pending_gaps)
            pending_gaps = []
        cur.stop = i + 1
        cur.est_bytes += size
    if cur is not None:
        chunks.append(cur)
    if through_seq is not None and through_seq >= expected:
        pending_gaps.extend(missing(expected, through_seq))
    if pending_gaps:
        # gaps after the last row (or no rows at all): a zero-row bundle carries them
        chunks.append(Chunk(start=n, stop=n, gaps=pending_gaps))
    return _merge_adjacent(chunks), dropped


def _merge_adjacent(chunks: list[Chunk]) -> list[Chunk]:
    for c in chunks:
        merged: list[Gap] = []
        for g in c.gaps:
            if merged and merged[-1].reason == g.reason and merged[-1].last_seq + 1 == g.first_seq:
                merged[-1] = Gap(merged[-1].first_seq, g.last_seq, g.reason)
            else:
                merged.append(g)
        c.gaps = merged
    return chunks
