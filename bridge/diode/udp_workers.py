"""Diode, UDP (both sides): FEC worker processes fed through memfd slots, off the socket loops.

The raptorq binding holds the GIL while it encodes or decodes, so the sender and the receiver
hand whole blocks to worker processes. Each worker shares one anonymous memory file (memfd)
with its owner, cut into ``slots`` slots of ``slot_bytes``: the owner writes a job into a free
slot and sends a fixed-size request over a pipe; the worker writes its result into the same
slot and answers with 8 bytes (slot, status). What a request and a slot hold is the job's
(``udp_encode``, ``udp_decode``); the plumbing here is the same for both.

A worker that exits (killed, crashed) or does not answer within ``answer_seconds`` is lost:
``lose`` hands its jobs back to the owner, which does them itself. Workers ignore SIGINT and
SIGTERM and exit when the owner closes their pipe, or dies (kill -9 included): nothing of
them outlives it, and the memfd has no name to leak. Workers run in a session of their own (a
terminal's Ctrl-C is the owner's) with ``-P``: nothing is imported from the working
directory. Each worker says it is ready once its imports are done; one that exits or stays
silent for ``start_seconds`` before that fails the pool's start (OSError naming it), so a
broken install is found at start, not at the first block.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerPool", "PoolUser", "Answer", "page_round", "serve"]

_REP = struct.Struct("<Ii")
"""slot, status (its meaning is the job's; 0 is done)."""
_READY = 0xFFFF_FFFF
"""The slot of a worker's first answer: its imports are done, it takes requests."""
_PAGE = mmap.PAGESIZE

Answer = tuple[mmap.mmap, int, int, Any]
"""``(the worker's memory, the slot's offset in it, status, the job sent with that slot)``."""


def page_round(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    mem: mmap.mmap
    req: int
    rep: int
    free: list[int]
    jobs: dict[int, Any] = field(default_factory=dict)
    sent: dict[int, float] = field(default_factory=dict)
    buf: bytes = b""


class WorkerPool:
    """``workers`` processes running ``python -m <module>`` (``what`` names them in errors),
    ``slots`` jobs in flight each.

    ``on_lost(pid, exit code, why, jobs it held, workers left)`` is called when one exits or
    is killed for not answering; OSError when a worker cannot start or is not ready within
    ``start_seconds``.
    """

    def __init__(
        self,
        module: str,
        what: str,
        workers: int,
        slot_bytes: int,
        slots: int,
        *,
        on_lost: Callable[[int, int | None, str, int, int], None] | None = None,
        answer_seconds: float = 30.0,
        start_seconds: float = 30.0,
    ) -> None:
        self.module = module
        self.what = what
        """Names the workers in errors: "encoder", "decoder"."""
        self.slot_bytes = page_round(slot_bytes)
        self.slots = max(1, slots)
        self.answer_seconds = answer_seconds
        self.lost_workers = 0
        self._on_lost = on_lost
        self._workers: list[_Worker | None] = []
        self._orphans: list[Any] = []
        try:
            for _ in range(workers):
                self._workers.append(self._spawn())
            self._await_ready(start_seconds)
        except BaseException:
            self.close()
            raise

    # -- set-up -----------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        size = self.slot_bytes * self.slots
        memfd = os.memfd_create(
            "diode-" + self.module.rpartition(".")[2].replace("_", "-"), os.MFD_CLOEXEC
        )
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        mem: mmap.mmap | None = None
        try:
            os.ftruncate(memfd, size)
            mem = mmap.mmap(memfd, size)
            proc = subprocess.Popen(  # noqa: S603 - our own module, by the running interpreter
                [sys.executable, "-P", "-m", self.module,
                 str(memfd), str(req_r), str(rep_w), str(self.slot_bytes), str(self.slots)],
                pass_fds=(memfd, req_r, rep_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the owner's to handle
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
        silent (killed) — its stderr, e.g. an import's traceback, is the owner's."""
        deadline = time.monotonic() + seconds
        waiting = {w.rep: w for w in self._workers if w is not None}
        while waiting:
            left = deadline - time.monotonic()
            ready = select.select(list(waiting), [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                w = next(iter(waiting.values()))
                w.proc.kill()
                raise OSError(
                    f"{self.what} worker pid {w.proc.pid} was not ready within {seconds:g} s"
                )
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
                        f"{self.what} worker pid {w.proc.pid} {what} while starting (its error "
                        "output, e.g. an import's traceback, is above)"
                    )
                del waiting[fd]

    # -- the owner's side -------------------------------------------------------------------
    @property
    def workers(self) -> int:
        """Workers still alive."""
        return sum(1 for w in self._workers if w is not None)

    def has_room(self) -> bool:
        return any(w is not None and w.free for w in self._workers)

    def in_flight(self) -> int:
        """Jobs sent and not answered yet, a lost worker's included until ``take_orphans``."""
        return sum(len(w.jobs) for w in self._workers if w is not None) + len(self._orphans)

    def free_worker(self) -> tuple[int, mmap.mmap, int] | None:
        """``(worker index, its memory, the offset of a free slot)`` of the least busy live
        worker with a free slot; None when every slot is taken."""
        best: tuple[int, _Worker] | None = None
        for i, w in enumerate(self._workers):
            if w is not None and w.free and (best is None or len(w.free) > len(best[1].free)):
                best = (i, w)
        if best is None:
            return None
        i, w = best
        return i, w.mem, w.free[-1] * self.slot_bytes

    def send(self, i: int, request: bytes, job: Any) -> bool:
        """Hand ``job`` to worker ``i`` in the slot ``free_worker`` named (its bytes already
        written); ``request``: the job's fields (the slot is put in front). False when the
        worker was found gone: the job then waits in ``take_orphans`` with the others it held."""
        w = self._workers[i]
        assert w is not None
        slot = w.free.pop()
        w.jobs[slot] = job
        w.sent[slot] = time.monotonic()
        try:
            os.write(w.req, struct.pack("<I", slot) + request)
        except OSError:
            self.lose(i, "its request pipe is closed")
            return False
        return True

    def answers(self, timeout: float) -> list[Answer]:
        """The workers' answers (waiting up to ``timeout`` for the first). Each slot is free
        again once answered: copy its result out before the next ``free_worker``. A worker
        with a job older than ``answer_seconds`` and no answer waiting is killed and lost."""
        out: list[Answer] = []
        answered: set[int] = set()
        self._read_answers(0.0, out, answered)  # what is there already, however late it is
        if not out:
            self._read_answers(timeout, out, answered)
        self._kill_silent(answered)
        return out

    def _read_answers(self, timeout: float, out: list[Answer], answered: set[int]) -> None:
        live = {w.rep: i for i, w in enumerate(self._workers) if w is not None and w.jobs}
        if not live:
            return
        for fd in select.select(list(live), [], [], timeout)[0]:
            i = live[fd]
            w = self._workers[i]
            if w is None:
                continue
            try:
                data = os.read(fd, _REP.size * 64)
            except BlockingIOError:
                continue
            except OSError as e:
                self.lose(i, f"its reply pipe failed ({e})")
                continue
            if not data:
                self.lose(i, "it exited")
                continue
            answered.add(i)
            w.buf += data
            while len(w.buf) >= _REP.size:
                slot, status = _REP.unpack_from(w.buf)
                w.buf = w.buf[_REP.size :]
                job = w.jobs.pop(slot, None)
                if job is None:  # not a slot in use: never free one twice
                    continue
                w.sent.pop(slot, None)
                w.free.append(slot)
                out.append((w.mem, slot * self.slot_bytes, status, job))

    def _kill_silent(self, answered: set[int]) -> None:
        """Lose the workers (but those that just answered: their memory holds results not yet
        copied) whose oldest job has waited past ``answer_seconds``: stopped or hung, never
        waited on for ever."""
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w is None or i in answered or not w.sent:
                continue
            if now - min(w.sent.values()) > self.answer_seconds:
                w.proc.kill()
                self.lose(i, f"no answer for {self.answer_seconds:g} s")

    def lose(self, i: int, why: str) -> None:
        """Give worker ``i`` up: its jobs go to ``take_orphans``."""
        w = self._workers[i]
        if w is None:
            return
        self._workers[i] = None
        self.lost_workers += 1
        self._release(w)  # reaps it: its exit code is known
        held = list(w.jobs.values())
        self._orphans.extend(held)
        if self._on_lost is not None:
            self._on_lost(w.proc.pid, w.proc.returncode, why, len(held), self.workers)

    def take_orphans(self) -> list[Any]:
        """Jobs of workers lost since the last call: the owner does them itself."""
        out, self._orphans = self._orphans, []
        return out

    def _release(self, w: _Worker) -> None:
        """Close its request pipe (it exits at the end of its current job), reap it, then
        close the reply pipe, so its last answer never meets a closed pipe."""
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
        """Stop the workers (they exit on the closed pipe); jobs in flight are dropped."""
        workers, self._workers = self._workers, []
        for w in workers:
            if w is not None:
                self._release(w)
        self._orphans = []


class PoolUser:
    """Base of a pool of FEC workers (encoder, decoder): the workers' module and name, the
    blocks done in the owner's own process, and the counts of live and lost workers."""

    module = ""
    what = ""

    def __init__(
        self,
        workers: int,
        slot_bytes: int,
        slots: int,
        on_lost: Callable[[int, int | None, str, int, int], None] | None = None,
        answer_seconds: float = 30.0,
        start_seconds: float = 30.0,
    ) -> None:
        """``on_lost(pid, exit code, why, blocks it held, workers left)`` when one exits or is
        killed for not answering within ``answer_seconds``. OSError when a worker cannot start
        or is not ready within ``start_seconds``."""
        self._pool = WorkerPool(
            self.module, self.what, workers, slot_bytes, slots, on_lost=on_lost,
            answer_seconds=answer_seconds, start_seconds=start_seconds,
        )  # fmt: skip
        self.slot_bytes = self._pool.slot_bytes
        self.answer_seconds = answer_seconds
        self.inline_blocks = 0
        """Blocks done in this process (no worker could take them, or a lost one held them)."""

    @property
    def workers(self) -> int:
        """Workers still alive."""
        return self._pool.workers

    @property
    def lost_workers(self) -> int:
        return self._pool.lost_workers

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return self._pool.pids()


# -- the worker process ---------------------------------------------------------------------
def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def _answer(rep: int, slot: int, status: int) -> bool:
    """Send one answer; False when the owner is gone (its end of the pipe is closed)."""
    try:
        os.write(rep, _REP.pack(slot, status))
    except OSError:
        return False
    return True


def serve(
    argv: list[str], fields: struct.Struct, handle: Callable[[memoryview, tuple[Any, ...]], int]
) -> int:
    """A worker's main: ``argv`` is MEMFD REQUEST_FD REPLY_FD SLOT_BYTES SLOTS. Each request
    (its slot as u32, then ``fields``) is answered with ``handle(the slot's memory, fields)``
    until the owner closes the pipe (its only way to stop us); a slot out of range, or a job
    ``handle`` raises on, is answered 1 (refused)."""
    memfd, req, rep, slot_bytes, slots = (int(a) for a in argv[:5])
    request = struct.Struct("<I" + fields.format.lstrip("<"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mem = mmap.mmap(memfd, slot_bytes * slots)
    view = memoryview(mem)
    if not _answer(rep, _READY, 0):
        return 0
    while msg := _read_exact(req, request.size):
        slot, *values = request.unpack(msg)
        if slot >= slots:
            status = 1
        else:
            try:
                status = handle(view[slot * slot_bytes : (slot + 1) * slot_bytes], tuple(values))
            except Exception:  # noqa: BLE001 - the owner does the job itself and says why
                status = 1
        if not _answer(rep, slot, status):
            return 0
    return 0
