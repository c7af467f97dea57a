"""Diode, UDP (black): RaptorQ repair symbols made in worker processes, off the send loop.

The raptorq binding holds the GIL while it encodes (about half of the sender's CPU per
datagram), so the sender hands each block to a worker process and seals and sends the blocks
already encoded meanwhile. A worker shares one anonymous memory file (memfd) with the sender,
cut into slots: the sender writes the padded block into a free slot and sends a 20-byte
request over a pipe; the worker encodes and writes only the repair symbols back into the slot
behind the block and answers with 8 bytes. The sender copies the repair symbols out, frees the
slot and keeps the source symbols from its own copy of the block.

Blocks come out in the order they went in. A worker that exits (killed, crashed) is logged;
the blocks it held are encoded in the sender's process and so is everything after that if no
worker is left: the datagrams on the wire are the same either way. Workers ignore SIGINT and
SIGTERM and exit when the sender closes their pipe, or dies (kill -9 included): nothing of
them outlives it, and the memfd has no name to leak. A worker that does not answer within
``answer_seconds`` (stopped, hung) is killed and handled as lost. Workers run in a session of
their own (a terminal's Ctrl-C is the sender's) with ``-P``: nothing is imported from the
working directory. Each worker says it is ready once its imports are done; one that exits or
stays silent for ``start_seconds`` before that fails the pool's start (OSError naming it), so
a broken install is found at start, not at the first block.

    python -m bridge.diode.udp_encode MEMFD REQUEST_FD REPLY_FD SLOT_BYTES SLOTS   (a worker)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from bridge.diode.udp_fec import repair_symbols

__all__ = ["EncoderPool", "slot_bytes_for"]

T = TypeVar("T")

_REQ = struct.Struct("<IIIII")
"""slot, block length (whole symbols), symbol size, repair count, first repair index."""
_REP = struct.Struct("<Ii")
"""slot, status: 0 done, 1 the encoder refused the block."""
_READY = 0xFFFF_FFFF
"""The slot of a worker's first answer: its imports are done, it takes requests."""
_PAGE = mmap.PAGESIZE


def slot_bytes_for(max_symbols: int, max_repair: int, max_symbol_size: int) -> int:
    """Bytes of one slot: the largest padded block and its repair symbols, page-aligned."""
    n = (max_symbols + max_repair) * max_symbol_size
    return -(-n // _PAGE) * _PAGE


@dataclass
class _Job(Generic[T]):
    tag: T
    padded: bytes
    symbol_size: int
    n_repair: int
    first_repair: int
    worker: int = -1
    slot: int = -1
    repairs: list[bytes] | None = None
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    mem: mmap.mmap
    req: int
    rep: int
    free: list[int]
    jobs: dict[int, _Job[Any]] = field(default_factory=dict)
    buf: bytes = b""


class EncoderPool(Generic[T]):
    """FIFO of blocks being encoded by ``workers`` processes (``slots`` blocks each).

    ``submit`` when ``room()``; ``next_done`` gives the oldest block's repair symbols once
    they are there. With ``workers`` = 0, or once every worker is gone, ``submit`` encodes in
    this process.
    """

    def __init__(
        self,
        workers: int,
        slot_bytes: int,
        slots: int = 2,
        on_lost: Callable[[int, int | None, str, int, int], None] | None = None,
        answer_seconds: float = 30.0,
        start_seconds: float = 30.0,
    ) -> None:
        """``on_lost(pid, exit code, why, blocks it held, workers left)`` when one exits or is
        killed for not answering within ``answer_seconds``. OSError when a worker cannot start
        or is not ready within ``start_seconds``."""
        self.slot_bytes = slot_bytes
        self.answer_seconds = answer_seconds
        self.slots = max(1, slots)
        self._workers: list[_Worker | None] = []
        self._fifo: deque[_Job[T]] = deque()
        self.lost_workers = 0
        self.inline_blocks = 0
        self._on_lost = on_lost
        try:
            for _ in range(workers):
                self._workers.append(self._spawn())
            self._await_ready(start_seconds)
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        size = self.slot_bytes * self.slots
        memfd = os.memfd_create("diode-udp-encode", os.MFD_CLOEXEC)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        mem: mmap.mmap | None = None
        try:
            os.ftruncate(memfd, size)
            mem = mmap.mmap(memfd, size)
            proc = subprocess.Popen(  # noqa: S603 - our own module, by the running interpreter
                [sys.executable, "-P", "-m", "bridge.diode.udp_encode",
                 str(memfd), str(req_r), str(rep_w), str(self.slot_bytes), str(self.slots)],
                pass_fds=(memfd, req_r, rep_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the sender's to handle
            )  # fmt: skip
        except BaseException:  # no worker: nothing of its pipes and slots may outlive it
            if mem is not None:
                mem.close()
            for fd in (req_w, rep_r):
                os.close(fd)
            raise
        finally:
            for fd in (memfd, req_r, rep_w):
                os.close(fd)
        os.set_blocking(rep_r, False)
        return _Worker(proc, mem, req_w, rep_r, list(range(self.slots)))

    def _await_ready(self, seconds: float) -> None:
        """Wait for every worker's ready answer; OSError naming the first that exits or stays
        silent (killed) — its stderr, e.g. an import's traceback, is the sender's."""
        deadline = time.monotonic() + seconds
        waiting = {w.rep: w for w in self._workers if w is not None}
        while waiting:
            left = deadline - time.monotonic()
            ready = select.select(list(waiting), [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                w = next(iter(waiting.values()))
                w.proc.kill()
                raise OSError(f"encoder worker pid {w.proc.pid} was not ready within {seconds:g} s")
            for fd in ready:
                w = waiting[fd]
                try:
                    got = os.read(fd, _REP.size)
                except BlockingIOError:
                    continue
                if len(got) != _REP.size or _REP.unpack(got)[0] != _READY:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        w.proc.wait(timeout=5)
                    what = f"exited (code {w.proc.returncode})" if not got else "answered oddly"
                    raise OSError(
                        f"encoder worker pid {w.proc.pid} {what} while starting (its error "
                        "output, e.g. an import's traceback, is above)"
                    )
                del waiting[fd]

    @property
    def workers(self) -> int:
        """Workers still alive."""
        return sum(1 for w in self._workers if w is not None)

    # -- the sender's side ----------------------------------------------------------------
    def room(self) -> bool:
        """True when another block can be submitted now."""
        if not self.workers:
            return not self._fifo
        return any(w is not None and w.free for w in self._workers)

    def pending(self) -> int:
        """Blocks submitted and not yet taken with ``next_done``."""
        return len(self._fifo)

    def submit(
        self, tag: T, padded: bytes, symbol_size: int, n_repair: int, first_repair: int
    ) -> None:
        """Queue a padded block (``udp_fec.padded_block``) for its repair symbols."""
        job = _Job(tag, padded, symbol_size, n_repair, first_repair)
        need = len(padded) + n_repair * symbol_size
        w = self._free_worker() if need <= self.slot_bytes else None
        if w is None:
            self._inline(job)
        else:
            i, wk = w
            slot = wk.free.pop()
            base = slot * self.slot_bytes
            wk.mem[base : base + len(padded)] = padded
            job.worker, job.slot = i, slot
            wk.jobs[slot] = job
            try:
                os.write(wk.req, _REQ.pack(slot, len(padded), symbol_size, n_repair, first_repair))
            except OSError:
                self._lose(i, "its request pipe is closed")
        self._fifo.append(job)

    def next_done(self, timeout: float = 0.0) -> tuple[T, bytes, list[bytes]] | None:
        """``(tag, padded, repair symbols)`` of the oldest block once encoded; None when the
        oldest is still being encoded after ``timeout`` seconds (or nothing is pending)."""
        if not self._fifo:
            return None
        deadline = time.monotonic() + timeout
        while self._fifo[0].repairs is None:
            head, now = self._fifo[0], time.monotonic()
            overdue = head.submitted + self.answer_seconds
            if now > overdue and head.worker >= 0:
                w = self._workers[head.worker]
                if w is not None:  # alive but silent (stopped, hung): never waited on for ever
                    w.proc.kill()
                    self._lose(head.worker, f"no answer for {self.answer_seconds:g} s")
                else:
                    self._inline(head)
                continue
            left = deadline - now
            if not self._poll(max(0.0, min(left, overdue - now + 0.01))) and left <= 0:
                return None
        job = self._fifo.popleft()
        assert job.repairs is not None
        return job.tag, job.padded, job.repairs

    # -- inside ---------------------------------------------------------------------------
    def _free_worker(self) -> tuple[int, _Worker] | None:
        best: tuple[int, _Worker] | None = None
        for i, w in enumerate(self._workers):  # the least busy live worker
            if w is not None and w.free and (best is None or len(w.free) > len(best[1].free)):
                best = (i, w)
        return best

    def _inline(self, job: _Job[T]) -> None:
        self.inline_blocks += 1
        job.repairs = repair_symbols(job.padded, job.symbol_size, job.n_repair, job.first_repair)

    def _poll(self, timeout: float) -> bool:
        """Take the workers' answers (waiting up to ``timeout``); True if any came."""
        live = {w.rep: i for i, w in enumerate(self._workers) if w is not None and w.jobs}
        if not live:
            return False
        ready, _, _ = select.select(list(live), [], [], timeout)
        for fd in ready:
            i = live[fd]
            w = self._workers[i]
            assert w is not None
            try:
                data = os.read(fd, _REP.size * 64)
            except BlockingIOError:
                continue
            except OSError as e:
                self._lose(i, f"its reply pipe failed ({e})")
                continue
            if not data:
                self._lose(i, "it exited")
                continue
            w.buf += data
            while len(w.buf) >= _REP.size:
                slot, status = _REP.unpack_from(w.buf)
                w.buf = w.buf[_REP.size :]
                self._answer(w, slot, status)
        return bool(ready)

    def _answer(self, w: _Worker, slot: int, status: int) -> None:
        job = w.jobs.pop(slot)
        if status == 0:
            t, base = job.symbol_size, slot * self.slot_bytes + len(job.padded)
            job.repairs = [
                bytes(w.mem[base + j * t : base + (j + 1) * t]) for j in range(job.n_repair)
            ]
        else:  # the worker's encoder refused: this process says why (it raises the same)
            self._inline(job)
        w.free.append(slot)

    def _lose(self, i: int, why: str) -> None:
        w = self._workers[i]
        if w is None:
            return
        self._workers[i] = None
        self.lost_workers += 1
        self._release(w)  # reaps it: its exit code is known
        held = len(w.jobs)
        for job in w.jobs.values():
            self._inline(job)
        if self._on_lost is not None:
            self._on_lost(w.proc.pid, w.proc.returncode, why, held, self.workers)

    def _release(self, w: _Worker) -> None:
        """Close its request pipe (it exits at the end of what it encodes), reap it, then close
        the reply pipe, so its last answer never meets a closed pipe."""
        with contextlib.suppress(OSError):
            os.close(w.req)
        try:
            w.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        with contextlib.suppress(OSError):
            os.close(w.rep)
        w.mem.close()

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers if w is not None]

    def close(self) -> None:
        """Stop the workers (they exit on the closed pipe); blocks still pending are dropped."""
        workers, self._workers = self._workers, []
        for w in workers:
            if w is not None:
                self._release(w)
        self._fifo.clear()


# -- the worker process ---------------------------------------------------------------------
def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def worker_main(memfd: int, req: int, rep: int, slot_bytes: int, slots: int) -> int:
    """Encode requests until the sender closes the pipe (its only way to stop us)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mem = mmap.mmap(memfd, slot_bytes * slots)
    if not _answer(rep, _READY, 0):
        return 0
    while msg := _read_exact(req, _REQ.size):
        slot, length, t, n_repair, first = _REQ.unpack(msg)
        off = slot * slot_bytes
        if slot >= slots or not t or length % t or length + n_repair * t > slot_bytes:
            if not _answer(rep, slot, 1):  # the sender encodes it and says what is wrong
                return 0
            continue
        try:
            repairs = repair_symbols(bytes(mem[off : off + length]), t, n_repair, first)
        except Exception:  # noqa: BLE001 - the sender encodes it itself and reports why
            if not _answer(rep, slot, 1):
                return 0
            continue
        out = off + length
        for j, sym in enumerate(repairs):
            mem[out + j * t : out + (j + 1) * t] = sym
        if not _answer(rep, slot, 0):
            return 0
    return 0


def _answer(rep: int, slot: int, status: int) -> bool:
    """Send one answer; False when the sender is gone (its end of the pipe is closed)."""
    try:
        os.write(rep, _REP.pack(slot, status))
    except OSError:
        return False
    return True


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:6]]
    sys.exit(worker_main(*args))
