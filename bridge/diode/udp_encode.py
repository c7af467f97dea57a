"""Diode, UDP (black): RaptorQ repair symbols made in worker processes, off the send loop.

The raptorq binding holds the GIL while it encodes (about half of the sender's CPU per
datagram), so the sender hands each block to a worker process (``udp_workers``: memfd slots,
a request pipe) and seals and sends the blocks already encoded meanwhile. The sender writes
the padded block into a free slot; the worker writes only the repair symbols back behind it.
The sender copies them out and keeps the source symbols from its own copy of the block.

Blocks come out in the order they went in. The blocks a lost worker held are encoded in the
sender's process, and so is everything after that if no worker is left: the datagrams on the
wire are the same either way.

    python -m bridge.diode.udp_encode MEMFD REQUEST_FD REPLY_FD SLOT_BYTES SLOTS   (a worker)
"""

from __future__ import annotations

import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from bridge.diode.udp_fec import repair_symbols
from bridge.diode.udp_workers import PoolUser, page_round, serve

__all__ = ["EncoderPool", "slot_bytes_for"]

T = TypeVar("T")

_REQ = struct.Struct("<IIII")
"""A request (after its slot): block length (whole symbols), symbol size, repair count, first
repair index."""


def slot_bytes_for(max_symbols: int, max_repair: int, max_symbol_size: int) -> int:
    """Bytes of one slot: the largest padded block and its repair symbols, page-aligned."""
    return page_round((max_symbols + max_repair) * max_symbol_size)


@dataclass
class _Job(Generic[T]):
    tag: T
    padded: bytes
    symbol_size: int
    n_repair: int
    first_repair: int
    repairs: list[bytes] | None = None
    submitted: float = field(default_factory=time.monotonic)


class EncoderPool(PoolUser, Generic[T]):
    """FIFO of blocks being encoded by ``workers`` processes (``slots`` blocks each).

    ``submit`` when ``room()``; ``next_done`` gives the oldest block's repair symbols once
    they are there. With ``workers`` = 0, or once every worker is gone, ``submit`` encodes in
    this process.
    """

    module, what = "bridge.diode.udp_encode", "encoder"

    def __init__(
        self,
        workers: int,
        slot_bytes: int,
        slots: int = 2,
        on_lost: Callable[[int, int | None, str, int, int], None] | None = None,
        answer_seconds: float = 30.0,
        start_seconds: float = 30.0,
    ) -> None:
        super().__init__(workers, slot_bytes, slots, on_lost, answer_seconds, start_seconds)
        self._fifo: deque[_Job[T]] = deque()

    # -- the sender's side ----------------------------------------------------------------
    def room(self) -> bool:
        """True when another block can be submitted now."""
        if not self.workers:
            return not self._fifo
        return self._pool.has_room()

    def pending(self) -> int:
        """Blocks submitted and not yet taken with ``next_done``."""
        return len(self._fifo)

    def submit(
        self, tag: T, padded: bytes, symbol_size: int, n_repair: int, first_repair: int
    ) -> None:
        """Queue a padded block (``udp_fec.padded_block``) for its repair symbols."""
        job = _Job(tag, padded, symbol_size, n_repair, first_repair)
        need = len(padded) + n_repair * symbol_size
        free = self._pool.free_worker() if need <= self.slot_bytes else None
        if free is None:
            self._inline(job)
        else:
            i, mem, off = free
            mem[off : off + len(padded)] = padded
            request = _REQ.pack(len(padded), symbol_size, n_repair, first_repair)
            if not self._pool.send(i, request, job):
                self._inline_orphans()
        self._fifo.append(job)

    def next_done(self, timeout: float = 0.0) -> tuple[T, bytes, list[bytes]] | None:
        """``(tag, padded, repair symbols)`` of the oldest block once encoded; None when the
        oldest is still being encoded after ``timeout`` seconds (or nothing is pending)."""
        if not self._fifo:
            return None
        deadline = time.monotonic() + timeout
        while self._fifo[0].repairs is None:
            left = deadline - time.monotonic()
            # wake at least every answer period: a silent worker is killed and its blocks
            # encoded here, never waited on for ever
            got = self._collect(max(0.0, min(left, self.answer_seconds / 2)))
            if self._fifo[0].repairs is None and not got and left <= 0:
                return None
        job = self._fifo.popleft()
        assert job.repairs is not None
        return job.tag, job.padded, job.repairs

    # -- inside ---------------------------------------------------------------------------
    def _inline(self, job: _Job[T]) -> None:
        self.inline_blocks += 1
        job.repairs = repair_symbols(job.padded, job.symbol_size, job.n_repair, job.first_repair)

    def _inline_orphans(self) -> None:
        for job in self._pool.take_orphans():
            self._inline(job)

    def _collect(self, timeout: float) -> bool:
        """Take the workers' answers (waiting up to ``timeout``); True if any came."""
        answers = self._pool.answers(timeout)
        for mem, off, status, job in answers:
            if status == 0:
                t, base = job.symbol_size, off + len(job.padded)
                job.repairs = [
                    bytes(mem[base + j * t : base + (j + 1) * t]) for j in range(job.n_repair)
                ]
            else:  # the worker's encoder refused: this process says why (it raises the same)
                self._inline(job)
        self._inline_orphans()
        return bool(answers)

    def close(self) -> None:
        """Stop the workers (they exit on the closed pipe); blocks still pending are dropped."""
        self._pool.close()
        self._fifo.clear()


# -- the worker process ---------------------------------------------------------------------
def _encode(slot: memoryview, fields: tuple[Any, ...]) -> int:
    length, t, n_repair, first = fields
    if not t or length % t or length + n_repair * t > len(slot):
        return 1  # the sender encodes it and says what is wrong
    repairs = repair_symbols(bytes(slot[:length]), t, n_repair, first)
    for j, sym in enumerate(repairs):
        slot[length + j * t : length + (j + 1) * t] = sym
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], _REQ, _encode))
