"""Black, spool: the segment format and ``SpoolReader`` (by position, never locking; the
Spark source reads through it). The writer and the format's description are in ``spool``."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from bridge.errors import SchemaVersionError, SpoolGapError, StateError

__all__ = [
    "SPOOL_SCHEMA",
    "KIND_MESSAGE",
    "KIND_LOST",
    "REASON_DAMAGED",
    "FORMAT",
    "FORMAT_KEY",
    "ACKED_KEY",
    "TAIL_FILE",
    "SpoolReader",
    "fingerprint",
    "segment_name",
    "list_segments",
    "read_tail",
    "open_segment",
    "check_segment_header",
    "segment_batches",
    "scan_segment",
]

SPOOL_SCHEMA = pa.schema(
    [
        pa.field("pos", pa.int64(), nullable=False),
        pa.field("kind", pa.int8(), nullable=False),
        pa.field("exchange", pa.string(), nullable=False),
        pa.field("routing_key", pa.string(), nullable=False),
        pa.field("redelivered", pa.bool_(), nullable=False),
        pa.field("properties_raw", pa.binary(), nullable=False),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("reason", pa.string(), nullable=True),
    ]
)
"""One spool record: a delivery (kind 0) or a message the broker dropped (kind 1, lost)."""

KIND_MESSAGE = 0
KIND_LOST = 1
REASON_DAMAGED = "spool_damaged"
"""Reason of the lost records ``open`` writes for positions the disk lost after their fsync."""


FORMAT_KEY = b"diode_spool"
FORMAT = b"1"
ACKED_KEY = b"acked_through"
TAIL_FILE = "TAIL"
FINGERPRINT_BYTES = 16
"""Size of a ``fingerprint``."""
HEADER_PROBE_BYTES = 4096
"""Bytes ``check_segment_header`` reads: a segment's header (schema, metadata) takes ~600."""
_SEGMENT_RE = re.compile(r"seg-(\d{16})\.arrow")


def segment_name(first: int) -> str:
    """File name of the segment whose first record has position ``first``."""
    return f"seg-{first:016d}.arrow"


def fingerprint(exchange: str, routing_key: str, properties_raw: bytes, body: bytes) -> bytes:
    """16-byte BLAKE2b of a delivery's identity (recognises redeliveries of spooled messages).
    Names are taken as the spool stores them (the tap makes them UTF-8 text first); a lone
    surrogate left in one is hashed as it is, never an error."""
    ex = exchange.encode("utf-8", "surrogatepass")
    rk = routing_key.encode("utf-8", "surrogatepass")
    h = hashlib.blake2b(
        struct.pack("<IIII", len(ex), len(rk), len(properties_raw), len(body)),
        digest_size=FINGERPRINT_BYTES,
    )
    h.update(ex)
    h.update(rk)
    h.update(properties_raw)
    h.update(body)
    return h.digest()


# -- reading segments (the reader, and the writer's repair at open) --------------------------
def list_segments(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    firsts = [int(m.group(1)) for n in names if (m := _SEGMENT_RE.fullmatch(n))]
    firsts.sort()
    return firsts


def read_tail(directory: Path) -> int | None:
    """TAIL's value; None if missing or unreadable.

    The writer rewrites TAIL in place while readers read it: two reads that agree cannot be a
    torn mix of an old and a new value.
    """
    try:
        fd = os.open(directory / TAIL_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        a = os.pread(fd, 64, 0)
        for _ in range(1000):
            b = os.pread(fd, 64, 0)
            if a == b:
                break
            a = b
        return int(a)
    except ValueError:
        return None
    finally:
        os.close(fd)


def _header(path: Path, source: Any) -> tuple[Any, int]:
    """(stream reader, ``acked_through`` recorded at its creation) of segment ``path`` read
    from ``source``; StateError (damaged) or SchemaVersionError naming ``path`` if its header
    is not a spool segment's of this version."""
    try:
        r = pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as e:
        raise StateError(
            f"spool segment {path} has no valid Arrow header ({e}); segments are created "
            "complete under a temporary name, so the disk damaged it: restore it from a backup "
            "or move the channel's spool aside (docs/runbook.md, 'spool lost')"
        ) from None
    md = r.schema.metadata or {}
    if md.get(FORMAT_KEY) != FORMAT or not r.schema.equals(SPOOL_SCHEMA):
        raise SchemaVersionError(
            f"spool segment {path} has format {md.get(FORMAT_KEY)!r} / schema {r.schema}; this "
            f"black reads spool format {FORMAT!r} only: drain it with the black version that "
            "wrote it"
        )
    return r, int(md.get(ACKED_KEY, b"-1"))


def open_segment(path: Path) -> tuple[Any, Any, int]:
    """Memory-map a segment: (map, stream reader, ``acked_through`` recorded at its creation)."""
    m = pa.memory_map(str(path))
    try:
        r, acked = _header(path, m)
    except BaseException:
        m.close()
        raise
    return m, r, acked


def check_segment_header(path: Path) -> None:
    """Black, spool: read segment ``path``'s header as ``open_segment`` does, and only that
    (its first ``HEADER_PROBE_BYTES``, plain reads: an I/O error is an OSError here, where a
    memory map would fault). OSError as the file system raised it; StateError or
    SchemaVersionError as ``open_segment``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        head = os.pread(fd, HEADER_PROBE_BYTES, 0)
    finally:
        os.close(fd)
    _header(path, pa.BufferReader(head))


def segment_batches(
    path: Path, first: int, limit: int | None
) -> Iterator[tuple[pa.RecordBatch, int, int, int]]:
    """``(batch, its first position, byte offset after it, acked_through)`` per complete batch.

    Stops before a batch that starts at or after ``limit`` (so bytes past a durable end are
    never touched) and at the first incomplete or unreadable batch (crash, or being appended).
    """
    m, r, acked = open_segment(path)
    pos = first
    try:
        while limit is None or pos < limit:
            try:
                batch, md = r.read_next_batch_with_custom_metadata()
                acked = int(md[ACKED_KEY]) if md is not None else acked
            except StopIteration:
                return
            except (pa.ArrowException, OSError, ValueError, KeyError):
                return
            n = batch.num_rows
            if n and batch.column(0)[0].as_py() != pos:
                raise StateError(
                    f"spool segment {path}: a batch at byte {m.tell()} starts at position "
                    f"{batch.column(0)[0].as_py()}, expected {pos}: the segment is damaged or "
                    "was written by something else; move it aside (docs/runbook.md, 'spool lost')"
                )
            yield batch, pos, m.tell(), acked
            pos += n
    finally:
        m.close()


def scan_segment(path: Path, first: int, limit: int | None) -> tuple[int, int, int]:
    """(end position, byte offset after the last complete batch, last ``acked_through``)."""
    end, offset, acked = first, -1, -1
    for batch, start, off, batch_acked in segment_batches(path, first, limit):
        end, offset, acked = start + batch.num_rows, off, batch_acked
    if offset < 0:  # header only: its acked_through, and the offset right after it
        m, _, acked = open_segment(path)
        offset = m.tell()
        m.close()
    return end, offset, acked


# -- reader --------------------------------------------------------------------------------------
class SpoolReader:
    """Reads one channel's spool by position; never locks, safe beside a writing tap."""

    def __init__(self, root: Path, channel: str) -> None:
        self.channel = channel
        self.directory = Path(root) / channel

    def durable_end(self) -> int:
        """The next position after the last durable record (0 for a spool never written)."""
        tail = read_tail(self.directory)
        segs = list_segments(self.directory)
        if not segs:
            return tail or 0
        end, _, _ = scan_segment(self.directory / segment_name(segs[-1]), segs[-1], tail)
        return end if tail is None else min(end, tail)

    def first_pos(self) -> int:
        """First position still on disk; equal to ``durable_end()`` when the spool is empty."""
        segs = list_segments(self.directory)
        return min(segs[0], self.durable_end()) if segs else self.durable_end()

    def used_bytes(self) -> int:
        """Bytes of all segment files of the channel."""
        total = 0
        for first in list_segments(self.directory):
            try:
                total += (self.directory / segment_name(first)).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def read(self, start: int, end: int, *, batch_rows: int = 8192) -> Iterator[pa.RecordBatch]:
        """Exactly positions ``[start, end)`` in order, zero-copy from memory-mapped segments.

        SpoolGapError if any of them is not durably on disk (released, or not written yet).
        """
        if start > end or batch_rows < 1:
            raise ValueError(f"bad spool range [{start}, {end}) / batch_rows {batch_rows}")
        if start == end:
            return
        tail = read_tail(self.directory)
        if tail is None or end > tail:
            durable = self.durable_end()
            if end > durable:
                raise SpoolGapError(
                    f"channel {self.channel!r}: spool positions [{start}, {end}) asked for, but "
                    f"{self.directory} holds durable records only before position {durable}"
                )
        segs = list_segments(self.directory)
        i = bisect_right(segs, start) - 1
        if i < 0:
            first = segs[0] if segs else end
            raise SpoolGapError(
                f"channel {self.channel!r}: spool positions [{start}, {min(first, end)}) are no "
                f"longer in {self.directory} (released after shipping; first on disk: {first})"
            )
        pos = start
        for first in segs[i:]:
            if pos >= end:
                break
            if first > pos:
                raise SpoolGapError(
                    f"channel {self.channel!r}: spool positions [{pos}, {min(first, end)}) are "
                    f"missing in {self.directory}: a segment before {segment_name(first)} is "
                    "gone, yet later ones are there (deleted by hand?). Start a new spool: "
                    "docs/runbook.md §7.1 ('spool lost'); the lost seqs become a gap"
                )
            path = self.directory / segment_name(first)
            try:
                for batch, b_start, _off, _acked in segment_batches(path, first, end):
                    b_end = b_start + batch.num_rows
                    if b_end <= pos:
                        continue
                    batch = batch.replace_schema_metadata(None)
                    stop = min(b_end, end)
                    while pos < stop:
                        n = min(batch_rows, stop - pos)
                        yield batch.slice(pos - b_start, n)
                        pos += n
            except FileNotFoundError:
                raise SpoolGapError(
                    f"channel {self.channel!r}: spool segment {path} was released while "
                    f"positions [{pos}, {end}) were being read from it"
                ) from None
        if pos < end:
            raise SpoolGapError(
                f"channel {self.channel!r}: spool positions [{pos}, {end}) are missing in "
                f"{self.directory} although TAIL says they are durable: the spool is damaged. "
                "Start a new spool: docs/runbook.md §7.1 ('spool lost')"
            )


# -- writer --------------------------------------------------------------------------------------
