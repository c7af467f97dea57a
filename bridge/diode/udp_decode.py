"""Diode, UDP (red): RaptorQ decoding of blocks that lost a source symbol, in worker processes.

The raptorq binding holds the GIL while it decodes (~0.4 ms for a block of 128 symbols of
1360 bytes, ~3 µs per datagram of the whole stream at 1% loss), so the receiver hands such a
block to a worker process (``udp_workers``: memfd slots, a request pipe) and goes on reading
the socket. The receiver writes the block's symbols into a free slot (their ids as u32, then
the symbols); the worker writes the rebuilt block back at the slot's start.

Results come back in any order, each with the tag it was submitted with. A block submitted
while every slot is taken waits in a bounded queue; the blocks a lost worker held go back to
its head. Once no worker is left, the queue is decoded in the receiver's process, a few
blocks per call, and new blocks are the caller's to decode, as is a block too large for a slot
or one the full queue cannot take. The files delivered are the same either way.

    python -m bridge.diode.udp_decode MEMFD REQUEST_FD REPLY_FD SLOT_BYTES SLOTS   (a worker)
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from bridge.diode.udp_fec import MAX_BLOCK_BYTES, decode_symbols
from bridge.diode.udp_workers import PoolUser, serve

__all__ = ["DecoderPool", "SLOT_BYTES"]

T = TypeVar("T")

_REQ = struct.Struct("<IIII")
"""A request (after its slot): symbols n, symbol size T, source symbols k, block length."""
_DONE, _REFUSED, _NOT_YET = 0, 1, 2
_INLINE_PER_CALL = 2
"""Queued blocks ``results`` decodes in this process per call once no worker is left."""
SLOT_BYTES = MAX_BLOCK_BYTES + MAX_BLOCK_BYTES // 4
"""One slot: the largest block RaptorQ keeps whole, with a quarter more for repair symbols
and the ids (a larger submission is decoded by the caller)."""


@dataclass
class _Job(Generic[T]):
    tag: T
    symbols: list[tuple[int, bytes]]
    k: int
    t: int
    length: int


class DecoderPool(PoolUser, Generic[T]):
    """Blocks being decoded by ``workers`` processes (``slots`` blocks each)."""

    module, what = "bridge.diode.udp_decode", "decoder"

    def __init__(
        self,
        workers: int,
        slots: int = 4,
        on_lost: Callable[[int, int | None, str, int, int], None] | None = None,
        answer_seconds: float = 30.0,
        start_seconds: float = 30.0,
        slot_bytes: int = SLOT_BYTES,
        max_queued: int = 256,
    ) -> None:
        super().__init__(workers, slot_bytes, slots, on_lost, answer_seconds, start_seconds)
        self.worker_blocks = 0
        """Blocks the workers decoded."""
        self.max_queued = max_queued
        self._queue: deque[_Job[T]] = deque()

    def pending(self) -> int:
        """Blocks submitted and not yet returned by ``results``."""
        return self._pool.in_flight() + len(self._queue)

    def submit(self, tag: T, symbols: list[tuple[int, bytes]], k: int, t: int, length: int) -> bool:
        """Hand a block's ``(esi, symbol)`` pairs to a worker, or queue them until a slot is
        free; False when they do not fit a slot, no worker is left or ``max_queued`` blocks
        already wait: the caller decodes the block itself."""
        n = len(symbols)
        if not n or n * (t + 4) > self.slot_bytes or not self.workers:
            return False
        job = _Job(tag, symbols, k, t, length)
        if not self._send(job):
            if len(self._queue) >= self.max_queued:
                return False
            self._queue.append(job)
        return True

    def _send(self, job: _Job[T]) -> bool:
        free = self._pool.free_worker()
        if free is None:
            return False
        i, mem, off = free
        n, t = len(job.symbols), job.t
        mem[off : off + 4 * n] = struct.pack(f"<{n}I", *(esi for esi, _ in job.symbols))
        mem[off + 4 * n : off + n * (t + 4)] = b"".join(sym for _, sym in job.symbols)
        # a worker found gone keeps the job as an orphan: ``results`` queues it again
        self._pool.send(i, _REQ.pack(n, t, job.k, job.length), job)
        return True

    def results(self, timeout: float = 0.0) -> list[tuple[T, bytes | None, bool]]:
        """Blocks decoded since the last call (waiting up to ``timeout`` for the first):
        ``(tag, the block's bytes or None when its symbols did not rebuild it, whether a
        worker rebuilt it)``."""
        out: list[tuple[T, bytes | None, bool]] = []
        for mem, off, status, job in self._pool.answers(timeout):
            if status == _DONE:
                self.worker_blocks += 1
                out.append((job.tag, bytes(mem[off : off + job.length]), True))
            elif status == _NOT_YET:
                out.append((job.tag, None, False))
            else:  # the worker's decoder refused or raised: this process says why
                out.append((job.tag, self._inline(job), False))
        self._queue.extendleft(reversed(self._pool.take_orphans()))  # a lost worker's first
        while self._queue and self._send(self._queue[0]):
            self._queue.popleft()
        if not self.workers:  # the last worker is gone: decode the rest here, a few a call,
            for _ in range(min(len(self._queue), _INLINE_PER_CALL)):  # so that the receive
                job = self._queue.popleft()  # loop that calls this keeps reading the socket
                out.append((job.tag, self._inline(job), False))
        return out

    def discard(self, gone: Callable[[T], bool]) -> int:
        """Drop the queued blocks whose tag ``gone`` says no longer matters (their object was
        completed or given up); returns how many. Blocks already in a worker's hands still
        come back from ``results``."""
        keep = deque(job for job in self._queue if not gone(job.tag))
        dropped = len(self._queue) - len(keep)
        self._queue = keep
        return dropped

    def _inline(self, job: _Job[T]) -> bytes | None:
        self.inline_blocks += 1
        return decode_symbols(job.symbols, job.k, job.t, job.length)

    def close(self) -> None:
        """Stop the workers (they exit on the closed pipe); blocks in flight are dropped (their
        symbols are still the caller's)."""
        self._pool.close()


# -- the worker process ---------------------------------------------------------------------
def _decode(slot: memoryview, fields: tuple[Any, ...]) -> int:
    n, t, k, length = fields
    if not t or not k or n < k or n * (t + 4) > len(slot) or length > k * t:
        return _REFUSED
    ids = struct.unpack_from(f"<{n}I", slot, 0)
    base = 4 * n
    symbols = [(ids[j], bytes(slot[base + j * t : base + (j + 1) * t])) for j in range(n)]
    data = decode_symbols(symbols, k, t, length)  # copies made: the slot may be overwritten
    if data is None:
        return _NOT_YET
    slot[:length] = data
    return _DONE


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], _REQ, _decode))
