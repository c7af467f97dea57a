"""Diode, UDP (red): reassembly of objects from symbols in a durable spool, then into the inbox.

    <spool>/objects/<epoch>-<object id>/
        meta.json     the object's header, written once when its first symbol arrives
        data          the envelope; each block is written at its offset once rebuilt
        blocks.done   u32 indices of rebuilt blocks (appended after the block's data)
        symbols.log   symbols of blocks not yet rebuilt: u32 block, u32 esi, T bytes; rewritten
                      without the rebuilt blocks' records once those are most of it
    <spool>/tmp/      a delivered file is written here, fsynced, renamed into the inbox (when the
                      inbox is on another filesystem: ``.<inbox name>.udp-tmp`` beside it)
    <spool>/trash/    folders of objects that ended, moved out of objects/ to be removed
    <spool>/done.jsonl  objects delivered (epoch, object id, digest): later symbols are late;
                        cut back to its newer half past 16 MiB
    <spool>/gaps.jsonl  objects given up, with the reason (red's `diode red gaps` lists them),
                        and object ids no datagram ever came for (``unseen``, ``udp_unseen``)
    <spool>/unseen.json what the receiver knows of each tracked epoch's object ids

Writes are buffered and not fsynced until delivery: the page cache survives kill -9, so a
restarted receiver rebuilds its decoders from the spool and an object whose symbols keep
arriving still completes. After a power loss a half-written spool can at worst fail the
object's SHA-256 check: the object is then expired as a gap, never delivered corrupt.

An open object takes about its size plus its unfinished blocks' symbols on disk, not twice its
size: once the records of rebuilt blocks are most of ``symbols.log`` (and at least
``compact_log_bytes``), the log is compacted. The receive loop only takes a snapshot of the
unfinished blocks' symbols (held in their decoders) and opens ``symbols.log.tmp``; a background
thread fsyncs ``data`` and ``blocks.done`` (the rebuilt blocks' symbols are never dropped
before), writes the snapshot to the temp file and fsyncs it, while the loop goes on appending to
the old log (an fsync there would stall it long enough for the socket buffer to overflow). Then
the loop copies over what it appended to the old log meanwhile and renames the temp file over
the log. A crash at any point leaves the old log or the new one, each enough to go on with; a
``symbols.log.tmp`` left behind is removed at the next start.

An object that ends (delivered, expired, evicted, superseded, given up) leaves ``objects/`` by
one rename of its folder into ``trash/`` (the same filesystem: atomic, a fraction of a ms),
which is all the receive loop does; a background thread then removes it (freeing the blocks of
a data file of 100s of MB takes tens of ms: the socket buffer would overflow meanwhile; a large
file is cut down a slice at a time, so that the loop's fsyncs never wait long behind it).
``objects/`` thus only ever holds whole folders: a removal a crash cut short is in ``trash/``,
never taken for an object to rebuild or deliver, and whatever is in ``trash/`` at start is
removed (in the background too). An object's gap record is written (fsynced) before the
rename; a kill between leaves the folder, which the restart removes, reading the record in
``gaps.jsonl``. A record the disk refuses (full, I/O error) keeps its folder in ``objects/``,
emptied in place to give back its room, until the record is written: a kill or a stop
meanwhile leaves the folder for the restart, which records the object again (as ``timeout``,
once nothing more of it arrives) — never a gap without a record. While the disk refuses them,
a new record waits for the receive loop's next try (once a second) instead of trying every
record waiting in memory again. Memory stays bounded however long the disk refuses them: the
first ``_GAPS_HELD`` (1000) wait whole; each later one is counted in a summary record, one a
reason, channel and epoch (``summary``: true, ``objects``: how many, ``object_id`` to
``object_id_last``: the lowest and highest id), written after them, so that the journal still
counts every object given up; the folders of the objects counted are kept too (emptied, in no
list: once the records are written, every emptied folder of no open or delivered object goes),
and a restart meanwhile records each by name. ``gaps.jsonl`` and ``done.jsonl`` are appended
whole or not at all (a full disk that takes part of a line has it cut back off), their names
fsynced in ``<spool>/`` when they are created.

A restart reopens what ``objects/`` holds within the receive loop's caps: beyond
``max_open_objects`` or the memory cap (lowered since, or a spool full of open objects), the
objects idle longest are evicted as the loop evicts them at run time (an ``evicted`` gap record
each, the folder removed, later symbols dropped). A copy of bytes delivered before that stalls
(datagrams replayed, a resend under a new object id) is superseded, not a gap: memory holds
the digest of every delivery ``done.jsonl`` names (read whole at the start; ~10 MB for its
``_DONE_JOURNALED`` records at most), so the check reads no file; older than what the journal
keeps (cut back to its newer half past ``_DONE_JOURNALED`` records or
``_DONE_COMPACT_BYTES``: ~50k to 100k deliveries), it is recorded as a gap. A copy that
completes is delivered again (red takes it as a duplicate).

A folder a kill cut short at its creation (no ``meta.json`` yet: nothing of the object was
written) is removed at the restart, not recorded: the object's next symbol opens it again.
Anything in ``objects/`` or ``trash/`` that is not a real folder (a link put there by hand) is
unlinked itself, never followed. An object's clock (``last_seen``, for expiry and eviction) runs
on new symbols only: copies (duplicates, surplus repairs, a replay on the wire) are no news;
at a restart it goes on from when the object's files last changed (wall clock).
``held`` counts what the decoders take in memory, not only the payload bytes: each symbol's and
decoder's overhead, and each rebuilt block's index, so that tiny symbols cannot hold many times
the cap.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import stat
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.diode.link_status import read_new_gap_records
from bridge.diode.udp_decode import DecoderPool
from bridge.diode.udp_fec import (
    BlockDecoder,
    FecError,
    block_plan,
    decode_symbols,
    fits_one_block,
)
from bridge.diode.udp_unseen import UnseenTracker
from bridge.errors import ConfigError
from bridge.faults import crash_point, slow_point
from bridge.fsutil import atomic_write_bytes, durable_mkdir, fsync_dir, pwritev_all, write_all
from bridge.logs import get_logger, log_event
from bridge.metrics import UDP
from bridge.protocol.datagram import ObjectHeader, ObjectKind, Symbol
from bridge.protocol.naming import MAX_NAME

__all__ = [
    "Reassembler",
    "Delivery",
    "GAPS",
    "DONE",
    "deliver",
    "delivery_tmp_dir",
    "discard_spooled",
    "verify_and_read_name",
]

log = get_logger("bridge.diode.udp_spool")

GAPS = "gaps.jsonl"
DONE = "done.jsonl"
_REC = struct.Struct(">II")
_U32 = struct.Struct(">I")
_FLUSH_BYTES = 256 * 1024
_DONE_REMEMBERED = 20_000
"""Deliveries whose object ids are remembered (their later symbols are dropped as ``late``)."""
_DONE_JOURNALED = 100_000
"""``done.jsonl`` past this many records is cut back to the newer half; memory remembers the
digests of as many deliveries (one more), so it holds every digest the journal names: a
stalled copy of bytes delivered before is recognised without reading the journal (the receive
loop evicts per datagram under memory pressure; a scan of the journal took ~10 ms)."""
_DONE_COMPACT_BYTES = 16 << 20
"""``done.jsonl`` beyond this size is cut back to its newer half too (long records)."""
_FAILED_REMEMBERED = 10_000
"""Objects given up, superseded or refused that are remembered (their later symbols dropped)."""
_GAPS_TAIL_BYTES = 8 << 20
"""How much of the end of ``gaps.jsonl`` a restart reads (the file is never cut back)."""
_COMPACT_LOG_BYTES = 16 << 20
"""An open object's ``symbols.log`` is compacted once its rebuilt blocks' records reach this
many bytes and outweigh the unfinished blocks' (each compaction fsyncs about this much, on a
background thread)."""
_LOG = "symbols.log"
_LOG_TMP = "symbols.log.tmp"
_SYMBOL_OVERHEAD = 128
"""Memory a held symbol takes beyond its ``T`` payload bytes (measured, CPython 3.11: the bytes
object's header, its id's int, its decoder's dict entry ~ 100): counted in ``held``, so that
small symbols (T = 16 is valid on the wire) cannot hold ~30 times the cap."""
_DECODER_OVERHEAD = 512
"""Memory of a block's decoder before its symbols (measured ~450: the decoder, its plan, its
dict, its entry in the object's): counted in ``held`` while the block is not rebuilt."""
_BLOCK_OVERHEAD = 80
"""Memory of a rebuilt block's index in its open object's ``done`` set (measured ~70)."""


def _header_record(epoch: int, h: ObjectHeader) -> dict[str, Any]:
    """What a gap record says about an object (before anything of it was spooled)."""
    return {
        "epoch": epoch,
        "object_id": h.object_id,
        "channel": h.channel,
        "kind": h.kind.name.lower(),
        "seq": h.seq,
        "length": h.length,
        "digest": h.digest.hex(),
        "blocks_total": h.block_count,
        "blocks_done": 0,
        "symbols_received": 0,
    }


def _decodable(h: ObjectHeader) -> bool:
    """Whether this receiver's RaptorQ can rebuild the object's largest block whole (an
    authenticated sender never announces more: its config is checked against the same)."""
    return fits_one_block(min(h.length, h.block_symbols * h.symbol_size), h.symbol_size)


_DIGEST_FIELD = re.compile(rb'"digest": "([0-9a-f]{64})"')


def _done_kept(path: Path) -> list[bytes]:
    """What a compaction keeps of ``done.jsonl``: its last ``_DONE_JOURNALED // 2`` lines, or
    fewer when they outweigh half of ``_DONE_COMPACT_BYTES`` (long records), never fewer than
    ``_DONE_REMEMBERED`` (whose object ids a restart remembers)."""
    with open(path, "rb") as f:
        lines = deque(f, maxlen=_DONE_JOURNALED // 2)
    size = sum(map(len, lines))
    while len(lines) > _DONE_REMEMBERED and size > _DONE_COMPACT_BYTES // 2:
        size -= len(lines.popleft())
    return list(lines)


def _gap_tail(path: Path, limit: int) -> list[bytes]:
    """The last ``limit`` complete lines within the last ``_GAPS_TAIL_BYTES`` of a file."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - _GAPS_TAIL_BYTES)
        f.seek(start)
        lines = f.read().split(b"\n")
    if start > 0:
        lines = lines[1:]  # cut by the window
    return lines[-limit:]


def _empty_in_place(path: Path) -> int:
    """Give back an ended object's room without removing its folder: ``blocks.done`` first
    (no rebuilt block is claimed over data that is gone), then ``symbols.log`` and ``data``;
    ``meta.json`` stays, so a restart still finds the object. Anything but a real folder (a
    link put in ``objects/`` by hand) is left alone: what it points to is not the spool's.
    Returns the bytes given back."""
    freed = 0
    if not path.is_dir() or path.is_symlink():
        return freed
    for name in ("blocks.done", _LOG_TMP, _LOG, "data"):
        with contextlib.suppress(OSError):
            size = os.stat(path / name).st_blocks * 512
            os.truncate(path / name, 0)
            freed += size
    return freed


def _append_whole(path: Path, text: str) -> int:
    """Append lines to a journal (``gaps.jsonl``, ``done.jsonl``), fsynced, all or nothing: a
    write or fsync that fails part way (a full disk) is cut back off, so no torn line is left
    for the next append to be glued to; a torn last line a crash left ends its own line. A new
    journal's name is fsynced in its folder too. Returns the journal's size."""
    created = not os.path.lexists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end > 0 and os.pread(fd, 1, end - 1) != b"\n":
            text = "\n" + text  # a torn last record (a crash mid-write) ends its own line
        data = text.encode()
        try:
            write_all(fd, data)
            os.fsync(fd)
            if created:  # the file's name too, or a power loss could lose every record
                fsync_dir(path.parent)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise
        return end + len(data)
    finally:
        os.close(fd)


def _never_spooled(path: Path) -> bool:
    """Whether an object's folder is one a kill cut short while it was being created: no
    ``meta.json`` yet (at most its temp file), hence no symbol written (its files are opened
    only after ``meta.json`` is in place). Such a folder holds nothing of the object: it is not
    a gap, and the object's next symbol opens it again."""
    return not os.path.lexists(path / "meta.json") and _emptied(path)


def _emptied(path: Path) -> bool:
    """Whether an object's folder holds no rebuilt block and no symbol: never written, or
    emptied in place (``_empty_in_place``). One that cannot be told is not."""
    for name in ("data", "blocks.done", _LOG, _LOG_TMP):
        try:
            if os.lstat(path / name).st_size:
                return False
        except FileNotFoundError:
            continue
        except OSError:
            return False
    return True


def _idle_on_disk(path: Path) -> float:
    """Seconds since a spooled object last took a new symbol, by the wall clock: since its
    newest file last changed (symbols are flushed every 0.2 s). 0 when unknown or in the future
    (a clock stepped back); wall time, as nothing else survives a restart."""
    newest = None
    for name in (_LOG, "data", "blocks.done", "meta.json"):
        with contextlib.suppress(OSError):
            mtime = os.lstat(path / name).st_mtime
            newest = mtime if newest is None else max(newest, mtime)
    return 0.0 if newest is None else max(0.0, time.time() - newest)


def _os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{name}: {e.strerror or e}" if name else str(e)


def _obj_dir_name(epoch: int, oid: int) -> str:
    return f"{epoch:020d}-{oid:020d}"


def _folder_key(path: Path) -> tuple[int, int] | None:
    """The ``(epoch, object id)`` an object's folder is named by (``_obj_dir_name``), if any."""
    try:
        epoch_s, oid_s = path.name.split("-")
        return int(epoch_s), int(oid_s)
    except ValueError:
        return None


def _remember_bounded(seen: dict[tuple[int, int], None], key: tuple[int, int], cap: int) -> None:
    """Add ``key`` to an insertion-ordered set, forgetting the oldest beyond ``cap``."""
    seen[key] = None
    while len(seen) > cap:
        del seen[next(iter(seen))]


def _log_records(snapshot: list[tuple[int, dict[int, bytes]]]) -> list[bytes]:
    """The ``symbols.log`` records of the symbols in a snapshot of unfinished blocks."""
    out: list[bytes] = []
    for b, syms in snapshot:
        for esi, payload in syms.items():
            out += (_REC.pack(b, esi), payload)
    return out


@dataclass(eq=False)
class _Compaction:
    """A rewrite of an object's ``symbols.log`` in flight. Until ``finished`` the background
    thread owns ``data_fd`` and ``done_fd`` (duplicates: closing the object does not pull them
    away), writes ``fd`` (``symbols.log.tmp``) and reads ``src`` (the old log) up to
    ``readable``, which the receive loop moves on after each flush to the old log; then the
    loop copies the little that is left and renames."""

    obj: _Open
    fd: int
    src: int
    data_fd: int
    done_fd: int
    snapshot: list[tuple[int, dict[int, bytes]]]
    """Every symbol of the unfinished blocks when it began (payloads are immutable bytes)."""
    start: int
    """Bytes of the old log when it began: the snapshot replaces them."""
    began: float
    readable: int = 0
    """Bytes of the old log written whole (set by the receive loop)."""
    copied: int = 0
    """Bytes of the old log in the new one: ``start``, then what the thread carried over."""
    end: int = 0
    """Bytes of the new log: the snapshot's records, then those carried over."""
    error: Exception | None = None
    finished: bool = False
    thread: threading.Thread | None = None

    def run(self) -> None:
        """The background thread: fsyncs, writes the snapshot and fsyncs it, then carries over
        what the loop appended to the old log meanwhile (not fsynced, as any append) until
        what is left is small; touches only this job."""
        try:
            slow_point("udp.compaction")
            os.fdatasync(self.data_fd)  # the rebuilt blocks, before their symbols go
            os.fdatasync(self.done_fd)
            self.end = pwritev_all(self.fd, _log_records(self.snapshot), 0)
            self.snapshot = []
            os.fsync(self.fd)
            os.lseek(self.fd, self.end, os.SEEK_SET)
            while (upto := self.readable) - self.copied >= _FLUSH_BYTES:
                _copy_range(self.src, self.fd, self.copied, upto - self.copied, self.obj.path)
                self.end += upto - self.copied
                self.copied = upto
        except Exception as e:  # reported by the receive loop, which keeps the old log
            self.error = e
        finally:
            _close_all(self.data_fd, self.done_fd)
            self.snapshot = []
            self.finished = True


def _close_all(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_in_background(*fds: int) -> None:
    """Close descriptors on a short-lived thread: the last close of a file renamed over or
    unlinked frees its blocks, milliseconds for a large log (not in the receive loop)."""
    try:
        threading.Thread(target=_close_all, args=fds, name="udp-close", daemon=True).start()
    except RuntimeError:  # no thread to be had: close them here
        _close_all(*fds)


_TRASH_SEQ = itertools.count()
"""Tells apart the names in ``trash/`` of one process (their pid, those of others)."""
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_ROOM_WAIT = 60.0
"""Longest a gap record the full disk refused waits for the trash to be emptied."""
_GAPS_RETRY = 1.0
"""After the disk refused the gap records, a new one waits this long before they are all tried
again (each try writes every record in memory: one a new object on a full disk would cost the
receive loop time in proportion to the records waiting, ~17 ms at ``_GAPS_HELD``). The receive
loop tries once a second anyway; a folder that gives back room is tried in at once."""
_GAPS_HELD = 1000
"""Gap records the disk refused that wait in memory whole (~3 KB each, with their log and
metric); beyond, each is counted in a summary record (``_summarize``): memory stays bounded
however long the disk refuses them."""
_GAP_SUMMARIES = 64
"""Summary records (one a reason, channel and epoch) beyond which they are one a reason."""
_SLICE = 4 << 20
"""A large file in the trash is cut down this much at a time before it is unlinked: each cut
is a short journal transaction, so an fsync of the receive loop's (a gap record) waits for one
cut, not for all the blocks of a data file of 100s of MB (ext4: at most ~4 ms, not ~30)."""


def _remove_folder(path: Path) -> None:
    """Remove an object's folder: ``meta.json`` first (what is left of a removal a crash cut
    short could not pass for an object, even outside the trash), ``data`` next (most of its
    room), each large file a slice at a time (``_SLICE``). Anything but a real folder (a
    symbolic link put there by hand, a file) is unlinked itself: what a link points to is never
    touched."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        names = sorted(os.listdir(path), key=lambda n: (n != "meta.json", n != "data", n))
    except FileNotFoundError:
        return
    except NotADirectoryError:  # replaced by a file since the lstat
        os.unlink(path)
        return
    for name in names:
        try:
            _unlink_sliced(path / name)
        except FileNotFoundError:
            pass
        crash_point("udp.object_half_removed")  # some of its files gone, not all
    os.rmdir(path)


def _remove_trashed(path: Path) -> None:
    """Remove a folder in the trash; one an I/O error leaves is removed at the next start."""
    try:
        _remove_folder(path)
    except Exception as e:
        error = _os_error(e) if isinstance(e, OSError) else str(e)
        log_event(log, 30, "spool trash not removed: tried again at the next start",
                  path=str(path), error=error)  # fmt: skip


def _unlink_sliced(path: Path) -> None:
    """Unlink a file, a large one cut down ``_SLICE`` at a time first."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):  # nothing the receiver makes: removed all the same
        shutil.rmtree(path)
        return
    if stat.S_ISREG(st.st_mode) and st.st_size > _SLICE:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = st.st_size
            while size > _SLICE:
                size -= _SLICE
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
    os.unlink(path)


def _to_trash(path: Path, trash: Path) -> Path | None:
    """Move an object's folder out of ``objects/`` into ``trash`` (one rename); its new path,
    or None: nothing to move, or it could not be moved (then it is removed where it is)."""
    dest = trash / f"{path.name}.{os.getpid()}-{next(_TRASH_SEQ)}"
    try:
        os.rename(path, dest)
        return dest
    except OSError as e:
        if not os.path.lexists(path):
            return None  # never created, or gone already
        log_event(log, 30, "spooled object not moved to the trash: removed in place",
                  path=str(path), error=_os_error(e))  # fmt: skip
    try:
        _remove_folder(path)
    except OSError as e:
        log_event(log, 30, "spooled object not removed", path=str(path), error=_os_error(e))
    return None


class _Trash:
    """Folders of objects that ended, in ``<spool>/trash/``: the receive loop moves a folder
    there (one rename), a background thread removes it (started when there is work, ended when
    there is none left)."""

    def __init__(self, root: Path) -> None:
        self.dir = durable_mkdir(root / "trash")
        self._todo: deque[Path] = deque()
        self._held: list[Path] = []
        """Moved, their removal not begun yet (see ``put``)."""
        self._cond = threading.Condition()
        self._running = False

    def put(self, path: Path, *, hold: bool = False) -> None:
        """Move an object's folder out of ``objects/`` and have it removed (the receive loop
        waits for the rename only). ``hold``: not before ``release`` (or the next ``put`` or
        ``wait``), so that a gap record fsynced meanwhile does not wait behind the removal."""
        dest = _to_trash(path, self.dir)
        if dest is not None:
            crash_point("udp.after_object_trashed")  # out of objects/, nothing removed yet
            self._held.append(dest)
        if not hold:
            self.release()

    def release(self) -> None:
        """Begin removing the folders held."""
        held, self._held = self._held, []
        for path in held:
            self._queue(path)

    def sweep(self) -> int:
        """Have what a crash left in the trash removed (at start); returns how many."""
        left = sorted(self.dir.iterdir())
        for path in left:
            self._queue(path)
        return len(left)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the trash is emptied; False if ``timeout`` passed first."""
        self.release()
        with self._cond:
            return self._cond.wait_for(lambda: not self._todo, timeout)

    def _queue(self, path: Path) -> None:
        with self._cond:
            self._todo.append(path)
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name="udp-trash", daemon=True).start()
        except RuntimeError:  # no thread to be had: removed here
            self._run()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._todo:
                    self._running = False
                    self._cond.notify_all()
                    return
                path = self._todo[0]
            slow_point("udp.trash")
            _remove_trashed(path)
            with self._cond:
                self._todo.popleft()
                self._cond.notify_all()


@dataclass
class _Open:
    """An object being reassembled."""

    epoch: int
    h: ObjectHeader
    path: Path
    n_blocks: int
    data_fd: int
    done_fd: int
    log_fd: int
    first_seen: float
    last_seen: float
    done: set[int] = field(default_factory=set)
    decoders: dict[int, BlockDecoder] = field(default_factory=dict)
    pending: bytearray = field(default_factory=bytearray)
    logged: int = 0
    """Bytes of ``symbols.log``, with those still in ``pending``."""
    symbols: int = 0
    repairs_used: int = 0
    compaction: _Compaction | None = None
    """Its ``symbols.log`` compaction in flight, if one is."""

    def record(self) -> dict[str, Any]:
        return {
            **_header_record(self.epoch, self.h),
            "blocks_total": self.n_blocks,
            "blocks_done": len(self.done),
            "symbols_received": self.symbols,
        }


def _memory_of(obj: _Open) -> int:
    """What an open object holds in memory, as ``held`` counts it: its decoders with their
    symbols, and its rebuilt blocks' indices."""
    t = obj.h.symbol_size + _SYMBOL_OVERHEAD
    held = sum(d.received * t + _DECODER_OVERHEAD for d in obj.decoders.values())
    return held + len(obj.done) * _BLOCK_OVERHEAD


@dataclass(frozen=True)
class Delivery:
    """An object whose blocks are all rebuilt, ready for the digest check and the inbox."""

    epoch: int
    header: ObjectHeader
    path: Path
    repairs_used: int


class Reassembler:
    """Every open object, its decoders and its spool files; single-threaded (the receive loop)."""

    def __init__(
        self,
        spool_dir: Path,
        *,
        max_object_bytes: int,
        max_open_objects: int,
        max_held_bytes: int = 512 << 20,
        compact_log_bytes: int = _COMPACT_LOG_BYTES,
        decoder: DecoderPool[tuple[tuple[int, int], int, BlockDecoder]] | None = None,
    ) -> None:
        self.root = Path(spool_dir)
        self.decoder = decoder
        """Worker processes for blocks that lost a source symbol (None: decoded here)."""
        self.objects_dir = durable_mkdir(self.root / "objects")
        durable_mkdir(self.root / "tmp")
        self._trash = _Trash(self.root)
        """Folders of objects that ended, removed on a background thread."""
        self.max_object_bytes = max_object_bytes
        self.max_open = max_open_objects
        self.max_held = max_held_bytes
        self.compact_log_bytes = compact_log_bytes
        self.remembered = _FAILED_REMEMBERED
        """Objects given up, superseded or refused whose keys are kept (each set apart)."""
        self.compacted = 0
        """Compactions of a ``symbols.log`` (completed: the new log renamed into place)."""
        self._compactions: list[_Compaction] = []
        """Compactions in flight (or finished, not yet taken in), of open objects or not."""
        self.open: dict[tuple[int, int], _Open] = {}
        self.held = 0
        self.done: dict[tuple[int, int], str] = {}  # (epoch, oid) -> digest hex
        self.done_digests: dict[bytes, None] = {}
        """Digests delivered, oldest first: at least every one ``done.jsonl`` names."""
        self._journal_records = 0
        """Records in ``done.jsonl`` (counted by whoever appends to it: the delivery thread)."""
        self._done_order: deque[tuple[int, int]] = deque()
        self.ready: deque[Delivery] = deque()
        self.dropped: dict[str, int] = {}
        self.expired = 0
        self.symbols_total = 0
        self.rebuilt = 0
        """Blocks RaptorQ rebuilt (they had lost a source symbol), here or in a worker."""
        self.rebuilt_by_workers = 0
        self._refused: dict[tuple[int, int], None] = {}
        """Objects refused as too large: one gap record each, not one a symbol."""
        self._failed: dict[tuple[int, int], None] = {}
        """Objects given up because the spool could not be written: their symbols are dropped."""
        self._gone: dict[tuple[int, int], None] = {}
        """Objects given up (timeout, eviction) or superseded: their later symbols are dropped
        as ``expired`` instead of opening them again (one gap record each, not one a retry)."""
        self._unwritten_gaps: list[dict[str, Any]] = []
        """Gap records the disk refused (full, I/O error): written first at the next chance;
        at most ``_GAPS_HELD``, the others counted in ``_gap_summaries``."""
        self._gap_summaries: dict[tuple[str, Any, Any], dict[str, Any]] = {}
        """Summary records of the gap records beyond ``_GAPS_HELD`` the disk refused, by
        reason, channel and epoch: written after them."""
        self._counted_kept = False
        """A folder kept for an object only counted in a summary (not in ``_awaiting``): once
        the records are written, the folders of objects given up are swept to the trash."""
        self._recovering: list[Path] | None = None
        """During ``recover``: folders of objects superseded meanwhile, removed once the
        unseen-object state that tells they were seen is merged and saved."""
        self._gaps_refused: tuple[float, int | None] | None = None
        """When (monotonic) and why (errno) the disk last refused them; None since written."""
        self._awaiting: list[Path] = []
        """Folders of objects whose gap record the disk refused (held whole): emptied in place,
        moved to the trash once their records are written (kept for the restart if they never
        are)."""
        self._load_done()
        self._load_given_up()
        self.unseen = UnseenTracker(self.root)
        """Object ids no datagram came for (touched by the receive loop only)."""
        self.unseen_recorded = 0
        """Object ids recorded as ``unseen`` gaps by this receiver run."""
        self.unseen_arrived = 0
        """Objects whose first datagram came after they were recorded ``unseen``."""

    # -- bookkeeping --------------------------------------------------------------------
    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _load_done(self) -> None:
        path = self.root / DONE
        if not path.exists():
            return
        tail: deque[bytes] = deque(maxlen=_DONE_REMEMBERED)
        with open(path, "rb") as f:  # streamed: the file may be long
            for line in f:
                self._journal_records += 1
                if len(tail) == _DONE_REMEMBERED and (m := _DIGEST_FIELD.search(tail[0])):
                    self._remember_digest(bytes.fromhex(m[1].decode()))  # older: digest only
                tail.append(line)
        for line in tail:
            try:
                rec = json.loads(line)
                self._remember((int(rec["epoch"]), int(rec["object_id"])), str(rec["digest"]))
            except (ValueError, KeyError, TypeError):
                continue

    def _load_given_up(self) -> None:
        """The objects the last ``remembered`` gap records name (``gaps.jsonl`` is the journal
        of what was given up): after a restart their later symbols are dropped as before it,
        and a folder a kill (or a power loss undoing its rename) left behind its record is
        removed, never rebuilt into a second record or a delivery. ``unseen`` records are not
        objects given up: one that arrives late is still taken."""
        path = self.root / GAPS
        if not path.exists():
            return
        into = {"spool_error": self._failed, "too_large": self._refused}
        for line in _gap_tail(path, self.remembered):
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a record torn by a crash
            if not isinstance(rec, dict) or rec.get("reason") == "unseen":
                continue
            epoch, oid = rec.get("epoch"), rec.get("object_id")
            if type(epoch) is int and type(oid) is int:
                seen = into.get(str(rec.get("reason")), self._gone)
                _remember_bounded(seen, (epoch, oid), self.remembered)

    def _given_up(self, key: tuple[int, int]) -> bool:
        return key in self._gone or key in self._failed or key in self._refused

    def _remember(self, key: tuple[int, int], digest: str) -> None:
        self.done[key] = digest
        self._done_order.append(key)
        while len(self._done_order) > _DONE_REMEMBERED:
            old = self._done_order.popleft()
            self.done.pop(old, None)
        self._remember_digest(bytes.fromhex(digest))

    def _remember_digest(self, digest: bytes) -> None:
        self.done_digests.pop(digest, None)  # re-inserted last: the dict stays oldest first
        self.done_digests[digest] = None
        while len(self.done_digests) > _DONE_JOURNALED + 1:  # what the journal can hold
            del self.done_digests[next(iter(self.done_digests))]

    def _delivered_before(self, digest: str) -> bool:
        """Red, UDP receive: whether bytes of this digest (hex) were delivered (as far as
        ``done.jsonl`` reaches, by memory): a stalled copy (datagrams replayed, a resend) is
        then superseded, not a gap."""
        return bytes.fromhex(digest) in self.done_digests

    def _forget_later(self, key: tuple[int, int]) -> None:
        """Drop the later symbols of an object given up or superseded (bounded memory)."""
        _remember_bounded(self._gone, key, self.remembered)

    def mark_delivered(self, d: Delivery, name: str) -> None:
        """Journal, remember and remove a delivered object (one thread: tests, recovery)."""
        self.journal_delivered(d, name)
        self.remember_delivered(d)
        discard_spooled(d)

    def journal_delivered(self, d: Delivery, name: str) -> None:
        """Append the delivery to ``done.jsonl``, fsynced. Disk work only, no shared state:
        the delivery thread calls it without the receive loop's lock (an fsync under that
        lock would stall every datagram behind it)."""
        rec = {
            "epoch": d.epoch,
            "object_id": d.header.object_id,
            "digest": d.header.digest.hex(),
            "name": name,
            "time": round(time.time(), 3),
        }
        size = _append_whole(self.root / DONE, json.dumps(rec, sort_keys=True) + "\n")
        self._journal_records += 1
        if size > _DONE_COMPACT_BYTES or self._journal_records > _DONE_JOURNALED:
            self._compact_done()

    def _compact_done(self) -> None:
        """Cut the journal back to its newer half (atomically): it must not grow with every
        object ever delivered, yet reach as far back as memory remembers digests (a restart
        reads it whole). Delivery thread only, like every write to it."""
        path = self.root / DONE
        try:
            kept = _done_kept(path)
            atomic_write_bytes(path, b"".join(kept), mode=0o600)
        except OSError as e:  # a full disk: the journal stays whole, tried again next time
            log_event(log, 30, "delivery journal not compacted", path=str(path),
                      error=_os_error(e))  # fmt: skip
            return
        self._journal_records = len(kept)
        log_event(log, 20, "delivery journal compacted", path=str(path), kept_records=len(kept))

    def remember_delivered(self, d: Delivery) -> None:
        """In memory: the object's digest is delivered (under the receive loop's lock)."""
        self._remember((d.epoch, d.header.object_id), d.header.digest.hex())

    def gap(
        self,
        rec: dict[str, Any],
        reason: str,
        *,
        count: int = 1,
        msg: str = "udp object given up: recorded as a gap",
        write: bool = True,
    ) -> dict[str, Any]:
        """Append a gap record (fsynced) and log it; ``count`` objects go to the metric (a
        range of unseen ids is one record). A disk that refuses the write (full, I/O error)
        keeps the record in memory until a later write succeeds: never lost silently, never a
        crash; beyond ``_GAPS_HELD`` records waiting, it is counted in a summary record instead
        (bounded memory). ``write`` False: in memory only, the caller writes it. Returns the
        record."""
        rec = {**rec, "reason": reason, "time": round(time.time(), 3)}
        UDP.objects_expired.labels(str(rec.get("channel", "?")), reason).inc(count)
        log_event(log, 30, msg, **rec)
        if len(self._unwritten_gaps) < _GAPS_HELD:
            self._unwritten_gaps.append(rec)
        else:
            self._summarize(rec, count)
        if write and not self._refused_lately():
            self.write_gaps()
        return rec

    def _summarize(self, rec: dict[str, Any], count: int) -> None:
        """Red, UDP receive: count a gap record the disk refused beyond ``_GAPS_HELD`` in its
        summary record (one a reason, channel and epoch; one a reason beyond
        ``_GAP_SUMMARIES``): its ``count`` objects, the lowest and highest object id, the
        first and last time. Written after the records held whole."""
        reason = str(rec["reason"])
        key = (reason, rec.get("channel"), rec.get("epoch"))
        if key not in self._gap_summaries and len(self._gap_summaries) >= _GAP_SUMMARIES:
            key = (reason, None, None)
        s = self._gap_summaries.get(key)
        if s is None:
            s = self._gap_summaries[key] = {
                "epoch": key[2], "channel": key[1], "reason": reason, "summary": True,
                "objects": 0, "object_id": None, "object_id_last": None, "time": rec["time"],
                "note": f"gap records the disk refused beyond the {_GAPS_HELD} held whole: "
                "counted (objects), not each listed; their object ids lie between object_id "
                "and object_id_last",
            }  # fmt: skip
            if "error" in rec:
                s["error"] = rec["error"]
        s["objects"] += count
        s["time_last"] = rec["time"]
        lo, hi = rec.get("object_id"), rec.get("object_id_last", rec.get("object_id"))
        if key[2] is not None and type(lo) is int and type(hi) is int:
            s["object_id"] = lo if s["object_id"] is None else min(s["object_id"], lo)
            s["object_id_last"] = (
                hi if s["object_id_last"] is None else max(s["object_id_last"], hi)
            )

    def _refused_lately(self, *, room_freed: bool = False) -> bool:
        """Whether the disk refused the gap records less than ``_GAPS_RETRY`` ago (a new record
        then waits for the next try), unless ``room_freed`` for a refusal for lack of room."""
        if self._gaps_refused is None:
            return False
        when, why = self._gaps_refused
        if room_freed and why in _NO_ROOM:
            return False
        return time.monotonic() - when < _GAPS_RETRY

    def _kept_until_recorded(self, path: Path, rec: dict[str, Any]) -> bool:
        """True if the gap record ``rec`` is not written yet (the disk refused it): the
        object's folder is then emptied in place, its room given back at once, and kept in
        ``objects/`` until the record is written (then moved to the trash: named in
        ``_awaiting`` if held whole, swept if counted in a summary); the record is tried again
        in that room. False: the record is durable, the caller removes the folder."""
        whole = any(r is rec for r in self._unwritten_gaps)
        if not whole and not self._gap_summaries:  # written: all or nothing, with the others
            return False
        freed = _empty_in_place(path)
        if whole:
            self._awaiting.append(path)
        else:
            self._counted_kept = True
        log_event(log, 30, "gap record not written yet: the object's folder is kept, emptied, "
                  "until it is (a restart meanwhile records the object again)", path=str(path),
                  epoch=rec.get("epoch"), object_id=rec.get("object_id"))  # fmt: skip
        if not self._refused_lately(room_freed=freed > 0):
            self.write_gaps()
        return True

    def write_gaps(self) -> int:
        """Write the gap records still in memory (the summaries after); returns how many are
        left unwritten."""
        if not self.pending_gaps():
            return 0
        try:
            try:
                self._append_gaps()
            except OSError as e:
                if e.errno not in _NO_ROOM:
                    raise
                # a full disk, its room perhaps being freed (the folder of an object given up,
                # in the trash): the record waits for that, as it waited for the removal before
                self._trash.wait(_ROOM_WAIT)
                self._append_gaps()
        except OSError as e:
            self._gaps_refused = (time.monotonic(), e.errno)
            log_event(log, 40, "gap records not written yet: kept in memory, retried",
                      pending=len(self._unwritten_gaps), error=_os_error(e),
                      summarized=sum(s["objects"] for s in self._gap_summaries.values()),
                      path=str(self.root / GAPS))  # fmt: skip
            return self.pending_gaps()
        self._gaps_refused = None
        self._unwritten_gaps.clear()
        self._gap_summaries.clear()
        awaiting, self._awaiting = self._awaiting, []
        for path in awaiting:  # their records are durable now: the folders may go
            self._trash.put(path)
        self._sweep_counted_folders()
        return 0

    def _sweep_given_up(self) -> None:
        """Red, UDP receive: once the summary records are written, move to the trash the
        folders kept for the objects they count (named nowhere in memory): each folder in
        ``objects/`` of no open or delivered object, emptied in place (a rebuilt object waiting
        for its delivery holds its blocks). A link or file put there by hand is left to the
        next start."""
        live = {o.path for o in self.open.values()}
        for path in sorted(self.objects_dir.iterdir()):
            if path in live or path.is_symlink() or not path.is_dir():
                continue
            if _folder_key(path) in self.done or not _emptied(path):
                continue
            self._trash.put(path, hold=True)
        self._trash.release()

    def _append_gaps(self) -> None:
        """Append the records in memory, fsynced, all or nothing: a write or fsync that fails
        part way is cut back off (else the records, still in memory, would be written twice
        at the next try)."""
        recs = itertools.chain(self._unwritten_gaps, self._gap_summaries.values())
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs)
        _append_whole(self.root / GAPS, text)

    def give_up(self, epoch: int, h: ObjectHeader, err: OSError) -> None:
        """A spool write for this object failed (disk full, quota, I/O error): the object
        becomes a ``spool_error`` gap, recorded before its files are removed to free the space
        (moved to the trash here, removed on its thread; a record the full disk refuses is
        written once that freed room: a kill in between, and only then, loses the record), and
        its later symbols are dropped. The receiver goes on; the next objects are spooled
        again as soon as the disk has room (a sender restart resends the object under a new
        epoch)."""
        self._drop("spool_error")
        key = (epoch, h.object_id)
        obj = self.open.pop(key, None)
        if obj is not None:
            self._close(obj)
            rec, path = obj.record(), obj.path
        else:
            rec, path = _header_record(epoch, h), self.objects_dir / _obj_dir_name(epoch, key[1])
        _remember_bounded(self._failed, key, self.remembered)
        self.held = sum(_memory_of(o) for o in self.open.values())
        self.expired += 1
        self._spool_error(rec, _os_error(err), path)

    def _spool_error(self, rec: dict[str, Any], error: str, path: Path) -> None:
        """The ``spool_error`` gap record of an object, then its folder into the trash: the
        record first, so that a kill between leaves the folder (removed at the restart, which
        reads the record: never a second record, never none). A record the full disk refuses
        is tried again in the room the folder gives back, emptied in place (see
        ``_kept_until_recorded``)."""
        written = self.gap({**rec, "error": error}, "spool_error")
        if not self._kept_until_recorded(path, written):
            self._trash.put(path)

    # -- the hot path -------------------------------------------------------------------
    def add(self, sym: Symbol, now: float) -> None:
        """Place one authenticated symbol."""
        h = sym.obj
        key = (sym.epoch, h.object_id)
        obj = self.open.get(key)
        if obj is None:
            if key in self.done:
                self._drop("late")
                return
            if key in self._failed:
                self._drop("spool_error")
                return
            if key in self._gone:
                self._drop("expired")
                return
            if key in self._refused:  # recorded once; refused still if the limit was raised
                self._drop("too_large")  # since (a restart removes what it had spooled)
                return
            self._first_seen(sym.epoch, h)  # once an object: not a cost of every datagram
            if h.length > self.max_object_bytes or not _decodable(h):
                self._drop("too_large")
                _remember_bounded(self._refused, key, self.remembered)
                self.gap(_header_record(sym.epoch, h), "too_large")
                return
            obj = self._create(sym.epoch, h, now)
        elif obj.h is not h and obj.h != h:
            self._drop("malformed")  # same object id, another header: not ours to guess
            return
        b = sym.block
        if b in obj.done:
            self._drop("surplus")  # a repair symbol the rebuilt block no longer needs
            return
        dec = obj.decoders.get(b)
        if dec is None:
            dec = obj.decoders[b] = BlockDecoder(
                block_plan(h.length, h.symbol_size, h.block_symbols, b), h.symbol_size
            )
            self.held += _DECODER_OVERHEAD
        before = dec.received
        completed = dec.add(sym.esi, sym.payload, decode=self.decoder is None)
        if dec.received == before and not completed:
            self._drop("duplicate")  # a copy (or a replay) is no news: the object's clock
            return  # runs on, else a replayed datagram would keep it from ever expiring
        obj.last_seen = now  # a new symbol of a block not yet rebuilt
        obj.symbols += 1
        self.symbols_total += 1
        if completed:
            self._release_block(before, h.symbol_size)  # what this decoder held
            self._block_done(obj, b, dec)
            self._compact_if_due(obj)
            if self.held > self.max_held:  # rebuilt blocks' indices take room too
                self._evict_oldest("evicted")
        else:
            self.held += h.symbol_size + _SYMBOL_OVERHEAD
            obj.pending += _REC.pack(b, sym.esi)
            obj.pending += sym.payload
            obj.logged += _REC.size + h.symbol_size
            if len(obj.pending) >= _FLUSH_BYTES:
                self._flush(obj)
                if obj.compaction is not None:
                    self._compact_if_due(obj)  # its compaction may be done: take it in
            if self.decoder is not None and dec.needs_decode():  # else add() decoded it
                self._decode_elsewhere(obj, b, dec)
            if self.held > self.max_held:
                self._evict_oldest("evicted")

    def _release_block(self, received: int, t: int) -> None:
        """A block rebuilt: its decoder's ``received`` symbols of ``t`` bytes are released, its
        index in the object's ``done`` set is held instead."""
        self.held -= received * (t + _SYMBOL_OVERHEAD) + _DECODER_OVERHEAD - _BLOCK_OVERHEAD

    def _first_seen(self, epoch: int, h: ObjectHeader) -> None:
        """The first datagram of an object (since this receiver started): its id is seen."""
        if self.unseen.seen(epoch, h.object_id, time.time()):
            self.unseen_arrived += 1
            log_event(log, 30, "udp object arrived after it was recorded unseen: taken, the gap "
                      "record stands", epoch=epoch, object_id=h.object_id, channel=h.channel,
                      kind=h.kind.name.lower(), seq=h.seq, length=h.length)  # fmt: skip

    def heard(self, epoch: int, started: int | None, channels: dict[str, Any]) -> None:
        """A link heartbeat taken: ``started`` is its ``objects_started`` counter, if any."""
        self.unseen.heard(epoch, started, channels, time.time())

    def report_unseen(self, now: float, grace: float) -> int:
        """Record as ``unseen`` gaps the object ids claimed at least ``grace`` seconds ago
        that no datagram came for (one record a range); returns how many ids."""
        n = 0
        for rec in self.unseen.due(now, grace):
            self.gap(rec, "unseen", count=rec["objects"],
                     msg="udp objects never seen: recorded as a gap")  # fmt: skip
            n += rec["objects"]
        self.unseen_recorded += n
        return n

    def save_unseen(self, now: float, *, force: bool = False) -> None:
        """Save the unseen-object state when due (at once after ``unseen`` records): with the
        size of ``gaps.jsonl`` it accounts for, so a restart reads only the records after."""
        if self.pending_gaps() or not self.unseen.save_due(now, force=force):
            return  # a state that settles ids whose records the disk refused would lose them
        if self.unseen.urgent:
            crash_point("udp.before_unseen_saved")  # records written, the state not yet saved
        try:
            offset = (self.root / GAPS).stat().st_size
        except FileNotFoundError:
            offset = 0
        self.unseen.save(now, offset)

    def _save_seen_before_files_go(self) -> None:
        """A superseded object's id was seen, and no journal will tell it (neither done.jsonl
        nor gaps.jsonl): the unseen-object state must, saved before the spooled files that
        told it go (else a restart in between could record it ``unseen``)."""
        self.unseen.urgent = True
        self.save_unseen(time.time())

    def _recover_unseen(self, reopened: list[tuple[int, int]]) -> None:
        """Tell the unseen-object tracker what the journals and the spool hold: every object
        delivered, ``reopened`` from the spool (open, ready, or evicted since) or given up
        since its state was saved was seen (superseded ones too, if the state was saved
        since), and ``unseen`` records written after it was saved are not written again. A
        summary record names its lowest and highest ids only (as seen, or as one range of
        ``unseen`` ids: each id in it was settled when it was written)."""
        seen = [*self.done, *reopened]
        reported: list[tuple[int, int, int]] = []
        offset = self.unseen.gaps_offset
        while True:
            recs, offset, _ = read_new_gap_records(self.root, offset)
            if not recs:
                break
            for r in recs:
                e, first, last = r.get("epoch"), r.get("object_id"), r.get("object_id_last")
                if type(e) is not int or type(first) is not int:
                    continue
                if r.get("reason") == "unseen" and type(last) is int and last >= first:
                    reported.append((e, first, last))
                else:
                    seen.append((e, first))
                    if r.get("summary") is True and type(last) is int:
                        seen.append((e, last))
        self.unseen.recovered(seen, reported, time.time())

    # -- decoding in workers ------------------------------------------------------------
    def _decode_elsewhere(self, obj: _Open, b: int, dec: BlockDecoder) -> None:
        """Hand a block RaptorQ must rebuild to a decoder worker (or its queue); decode it
        here when the queue is full or no worker is left (the loop slows down rather than
        hold symbols unbounded)."""
        assert self.decoder is not None
        held = dec.held()
        key = (obj.epoch, obj.h.object_id)
        if self.decoder.submit((key, b, dec), held, dec.plan.k, dec.t, dec.plan.length):
            dec.busy = True
            return
        data = decode_symbols(held, dec.plan.k, dec.t, dec.plan.length)
        if data is not None:
            self._finish_block(obj, b, dec, data)

    def _finish_block(self, obj: _Open, b: int, dec: BlockDecoder, data: bytes) -> None:
        self._release_block(dec.received, dec.t)
        dec.finish(data)
        self._block_done(obj, b, dec)
        self._compact_if_due(obj)

    def decoding(self) -> int:
        """Blocks in a decoder worker's hands."""
        return self.decoder.pending() if self.decoder is not None else 0

    def take_decoded(self, timeout: float = 0.0) -> int:
        """Place the blocks the workers rebuilt (waiting up to ``timeout`` for the first);
        returns how many. A block whose object was given up or completed meanwhile is
        dropped; one its symbols did not rebuild goes back once more symbols came."""
        if self.decoder is None:
            return 0
        n = 0
        for (key, b, dec), data, by_worker in self.decoder.results(timeout):
            dec.busy = False
            obj = self.open.get(key)
            if obj is None or obj.decoders.get(b) is not dec:
                continue
            try:
                if data is None:
                    if dec.needs_decode():
                        self._decode_elsewhere(obj, b, dec)
                    continue
                self._finish_block(obj, b, dec, data)
                self.rebuilt_by_workers += by_worker
                n += 1
            except OSError as e:  # the spool's disk: that object is a gap
                self.give_up(obj.epoch, obj.h, e)
        return n

    def _block_done(self, obj: _Open, b: int, dec: BlockDecoder) -> None:
        h = obj.h
        pwritev_all(obj.data_fd, [memoryview(dec.data())], dec.plan.offset)  # full disk: OSError
        write_all(obj.done_fd, _U32.pack(b))
        obj.done.add(b)
        obj.repairs_used += dec.repairs_used
        self.rebuilt += dec.repairs_used > 0
        del obj.decoders[b]
        if len(obj.done) == obj.n_blocks:
            self._close(obj)
            key = (obj.epoch, h.object_id)
            del self.open[key]
            self.done[key] = h.digest.hex()  # later symbols are late from now on
            self.ready.append(Delivery(obj.epoch, h, obj.path, obj.repairs_used))

    # -- compaction of symbols.log ------------------------------------------------------
    def _compact_if_due(self, obj: _Open) -> None:
        """Start compacting the object's ``symbols.log`` once the rebuilt blocks' records in it
        reach ``compact_log_bytes`` and outweigh the unfinished blocks' (amortized: each byte
        logged is copied at most about once more); take in its compaction once finished."""
        if obj.compaction is not None:
            if obj.compaction.finished:
                self._finish_compaction(obj.compaction)
            return  # one at a time; the next is judged at the next rebuilt block
        if obj.logged < self.compact_log_bytes:
            return  # the cheap test first: most objects never log this much
        if self.open.get((obj.epoch, obj.h.object_id)) is not obj:
            return  # complete (its files closed) or given up
        live = sum(d.received for d in obj.decoders.values()) * (_REC.size + obj.h.symbol_size)
        if obj.logged - live >= max(live, self.compact_log_bytes):
            self._start_compaction(obj)

    def _start_compaction(self, obj: _Open) -> None:
        """Snapshot the unfinished blocks' symbols (all in their decoders once ``pending`` is
        flushed: the old log is then exactly ``obj.logged`` bytes) and hand the fsyncs and the
        writing of ``symbols.log.tmp`` to a background thread. A flush the disk refuses raises
        (the caller gives the object up, as for any flush); any other failure keeps the old
        log: compaction only saves space."""
        self._flush(obj)
        tmp = obj.path / _LOG_TMP
        fds: list[int] = []
        try:
            fds.append(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
            fds.append(os.open(obj.path / _LOG, os.O_RDONLY | os.O_CLOEXEC))
            fds += (os.dup(obj.data_fd), os.dup(obj.done_fd))
            job = _Compaction(
                obj, fd=fds[0], src=fds[1], data_fd=fds[2], done_fd=fds[3],
                snapshot=[(b, d.symbols()) for b, d in obj.decoders.items()],
                start=obj.logged, began=time.monotonic(), readable=obj.logged, copied=obj.logged,
            )  # fmt: skip
            job.thread = threading.Thread(target=job.run, name="udp-compaction", daemon=True)
            job.thread.start()
        except (OSError, RuntimeError) as e:  # EMFILE, ENOSPC, no thread: keep the old log
            for fd in fds:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            log_event(log, 30, "symbols.log compaction failed: the log is kept whole",
                      path=str(obj.path), error=str(e))  # fmt: skip
            return
        obj.compaction = job
        self._compactions.append(job)

    def _finish_compaction(self, job: _Compaction) -> None:
        """Take in a finished compaction (receive loop): copy what was appended to the old log
        since it began (whole records: pending symbols stay pending, for the new log) after
        the snapshot, rename the temp file over the log, append to it from now on. Its object
        closed meanwhile (complete or given up): the temp file is removed. An OSError (a full
        disk) keeps the old log in use: compaction only saves space."""
        self._compactions.remove(job)
        obj, tmp = job.obj, job.obj.path / _LOG_TMP
        if obj.compaction is job:
            obj.compaction = None
        error: Exception | None = job.error
        if error is None and self.open.get((obj.epoch, obj.h.object_id)) is obj:
            rest = obj.logged - len(obj.pending) - job.copied  # appended since the thread's copy
            try:
                os.lseek(job.fd, job.end, os.SEEK_SET)  # later records are appended after
                _copy_range(job.src, job.fd, job.copied, rest, obj.path / _LOG)
                os.replace(tmp, obj.path / _LOG)
            except OSError as e:
                error = e
            else:
                old, obj.log_fd = obj.log_fd, job.fd
                obj.logged = job.end + rest + len(obj.pending)
                self.compacted += 1
                _close_in_background(old, job.src)  # the old log's blocks are freed there
                carried = job.copied - job.start + rest
                log_event(log, 20, "symbols.log compacted", path=str(obj.path),
                          kept_bytes=job.end + rest - carried, carried_bytes=carried,
                          seconds=round(time.monotonic() - job.began, 3))  # fmt: skip
                crash_point("udp.after_symbols_log_compacted")  # the new log in use
                return
        tmp.unlink(missing_ok=True)  # its object's folder may be gone already: nothing to do
        _close_in_background(job.fd, job.src)
        if error is not None:
            log_event(log, 30, "symbols.log compaction failed: the log is kept whole",
                      path=str(obj.path), error=str(error))  # fmt: skip

    def _take_compactions(self, *, wait: bool = False) -> None:
        """Take in every finished compaction (waiting for those in flight if ``wait``)."""
        for job in list(self._compactions):
            if wait and job.thread is not None:
                job.thread.join()
            if job.finished:
                self._finish_compaction(job)

    def wait_compactions(self) -> None:
        """Wait for the compactions in flight and take them in (recovery, tests, a stop)."""
        self._take_compactions(wait=True)

    def _create(self, epoch: int, h: ObjectHeader, now: float) -> _Open:
        for key, o in list(self.open.items()):  # a restarted sender resends what was in flight
            if o.epoch < epoch and o.h.digest == h.digest:
                self._supersede(key, epoch)
        if len(self.open) >= self.max_open:
            self._evict_oldest("evicted")
        path = self.objects_dir / _obj_dir_name(epoch, h.object_id)
        path.mkdir(exist_ok=True)
        meta = {
            "epoch": epoch,
            "object_id": h.object_id,
            "kind": int(h.kind),
            "channel": h.channel,
            "seq": h.seq,
            "length": h.length,
            "digest": h.digest.hex(),
            "symbol_size": h.symbol_size,
            "block_symbols": h.block_symbols,
            "first_seen": time.time(),
        }
        tmp = path / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, sort_keys=True))
        os.replace(tmp, path / "meta.json")
        obj = self._open_files(epoch, h, path, now)
        self.open[(epoch, h.object_id)] = obj
        return obj

    def _open_files(self, epoch: int, h: ObjectHeader, path: Path, now: float) -> _Open:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        fds: list[int] = []
        try:  # all three or none (a failure, e.g. EMFILE, must not leak the first ones)
            for name, how in (("data", os.O_RDWR | os.O_CREAT), ("blocks.done", flags),
                              (_LOG, flags)):  # fmt: skip
                fds.append(os.open(path / name, how | os.O_CLOEXEC, 0o600))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return _Open(
            epoch=epoch,
            h=h,
            path=path,
            n_blocks=h.block_count,
            data_fd=fds[0],
            done_fd=fds[1],
            log_fd=fds[2],
            first_seen=now,
            last_seen=now,
        )

    def _flush(self, obj: _Open) -> None:
        if obj.pending:
            write_all(obj.log_fd, obj.pending)  # a full disk raises: the object is given up
            obj.pending = bytearray()
            if obj.compaction is not None:
                obj.compaction.readable = obj.logged  # whole records: the thread may copy them

    def flush_all(self) -> None:
        """Write every object's pending symbols; take in the compactions that finished."""
        for obj in list(self.open.values()):
            try:
                self._flush(obj)
            except OSError as e:
                self.give_up(obj.epoch, obj.h, e)
        self._take_compactions()

    def _close(self, obj: _Open) -> None:
        """Close the object's files; symbols not yet flushed are dropped: a closed object is
        complete (its blocks are in ``data``) or given up."""
        obj.pending = bytearray()
        for fd in (obj.data_fd, obj.done_fd, obj.log_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.held = max(self.held - _memory_of(obj), 0)
        if self.decoder is not None and any(d.busy for d in obj.decoders.values()):
            key = (obj.epoch, obj.h.object_id)  # its queued blocks hold symbols: drop them
            self.decoder.discard(lambda tag: tag[0] == key)
        obj.decoders.clear()

    # -- expiry -------------------------------------------------------------------------
    def _evict_oldest(self, reason: str) -> None:
        if not self.open:
            return
        key = min(self.open, key=lambda k: self.open[k].last_seen)
        self._expire(key, reason)

    def _expire(
        self,
        key: tuple[int, int],
        reason: str,
        *,
        hold: bool = False,
    ) -> None:
        """Give up an open object: a gap record, unless its bytes were delivered before, its
        folder into the trash (``hold``: not removed before ``release``)."""
        obj = self.open.pop(key)
        self._close(obj)
        self._forget_later(key)
        rec = obj.record()
        if self._delivered_before(rec["digest"]):
            # the same bytes were delivered: under another object id (a resend), or under this
            # one before memory forgot it (datagrams replayed); no loss to report
            log_event(log, 20, "udp object superseded by an identical delivered one", **rec)
            if self._recovering is not None:  # the unseen state is not merged yet: not saved
                self._recovering.append(obj.path)  # before it is; the folder waits till then
                return
            self._save_seen_before_files_go()
        else:
            written = self.gap(rec, reason)
            self.expired += 1
            if self._kept_until_recorded(obj.path, written):
                return
        self._trash.put(obj.path, hold=hold)  # after its gap record (or the unseen state)

    def _supersede(self, key: tuple[int, int], epoch: int) -> None:
        obj = self.open.pop(key)
        self._close(obj)
        self._forget_later(key)
        self._save_seen_before_files_go()
        log_event(log, 20, "udp object superseded: the sender resent it under a new epoch",
                  new_epoch=epoch, **obj.record())  # fmt: skip
        self._trash.put(obj.path)

    def expire_idle(self, now: float, expire_seconds: float) -> int:
        """Give up objects that got no new symbol for ``expire_seconds``."""
        stale = [k for k, o in self.open.items() if now - o.last_seen >= expire_seconds]
        gaps = self.expired
        for key in stale:  # each gap record fsynced before removals
            self._expire(key, "timeout", hold=True)
        self._trash.release()
        return self.expired - gaps

    def fail(self, d: Delivery, reason: str, error: str | None = None) -> bool:
        """A rebuilt object that must not or cannot be delivered (digest mismatch, bad name;
        ``spool_error`` with ``error`` when its spooled data is gone): a gap. Its later
        symbols are dropped as ``expired`` (bounded, like every object given up).
        Returns True if the caller is to remove its spooled files (:func:`discard_spooled`,
        outside the receive loop's lock), False if they are kept until the gap record the
        disk refused is written."""
        key = (d.epoch, d.header.object_id)
        self.done.pop(key, None)
        self._forget_later(key)
        n = d.header.block_count
        rec = {**_header_record(d.epoch, d.header), "blocks_done": n}
        rec = self.gap(rec if error is None else {**rec, "error": error}, reason)
        self.expired += 1
        return not self._kept_until_recorded(d.path, rec)

    def pending_gaps(self) -> int:
        """Gap records the disk refused, still in memory, summaries included (a stop logs
        them: their objects' folders are kept, and the next start records those objects
        again)."""
        return len(self._unwritten_gaps) + len(self._gap_summaries)

    # -- restart ------------------------------------------------------------------------
    def recover(self, now: float, tmp_dir: Path | None = None) -> int:
        """Rebuild every open object from the spool (after a crash or a restart); what the
        trash holds (folders a crash left half removed, or not yet) is removed meanwhile.
        Beyond ``max_open_objects`` or the held-bytes cap (lowered since, or a spool full of
        open objects), the objects idle longest are evicted as the receive loop evicts them:
        an ``evicted`` gap record each. Returns how many objects were rebuilt and kept (open,
        or complete and ready for delivery)."""
        for d in {self.root / "tmp", tmp_dir or self.root / "tmp"}:
            for tmp in d.iterdir():
                if tmp.name.endswith(".tmp"):
                    tmp.unlink(missing_ok=True)  # a delivery interrupted before its rename
        if left := self._trash.sweep():
            log_event(log, 20, "spool trash left by the last run: removed in the background",
                      folders=left, path=str(self._trash.dir))  # fmt: skip
        reopened: list[tuple[int, int]] = []
        superseded: list[Path] = []
        self._recovering = superseded
        try:
            evicted = self._reopen_all(now, reopened)
        finally:
            self._recovering = None
        self.wait_compactions()  # started while reopening: settled before the loop begins
        if evicted:
            log_event(log, 30, "spooled objects beyond udp.receive.max_open_objects or the "
                      "memory cap at the restart: those idle longest evicted as gaps",
                      evicted=evicted, kept_open=len(self.open),
                      max_open_objects=self.max_open, max_held_bytes=self.max_held)  # fmt: skip
        self._recover_unseen(reopened)
        if superseded:  # seen, which only the unseen state can tell once their folders go
            self._save_seen_before_files_go()
            for path in superseded:
                self._trash.put(path)
        self._sweep_counted_folders()
        return len(reopened) - evicted

    def _sweep_counted_folders(self) -> None:
        """Once every gap record is written, and not while recovering (the folders not reopened
        yet are not told from those of objects given up), sweep the folders kept for objects
        only counted in a summary record."""
        if self._counted_kept and self._recovering is None and not self.pending_gaps():
            self._counted_kept = False
            self._sweep_given_up()

    def _reopen_all(self, now: float, reopened: list[tuple[int, int]]) -> int:
        """Red, UDP receive (restart): reopen each object ``objects/`` holds (appended to
        ``reopened``), within the caps; returns how many were evicted for them."""
        evicted = 0
        for path in sorted(self.objects_dir.iterdir()):
            if path.is_symlink() or not path.is_dir():  # put there by hand: never followed
                self._unreadable(path, NotADirectoryError(errno.ENOTDIR, "not a folder"))
                continue
            if _never_spooled(path):
                log_event(log, 20, "spooled object cut short at its creation (nothing of it "
                          "spooled): removed, its next symbol opens it again",
                          path=str(path))  # fmt: skip
                self._trash.put(path)
                continue
            try:
                meta = json.loads((path / "meta.json").read_text())
                h = ObjectHeader(
                    meta["object_id"], ObjectKind(meta["kind"]), meta["channel"], meta["seq"],
                    meta["length"], bytes.fromhex(meta["digest"]), meta["symbol_size"],
                    meta["block_symbols"],
                )  # fmt: skip
                epoch = int(meta["epoch"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._unreadable(path, e)
                continue
            key = (epoch, h.object_id)
            if key in self.done:
                self._trash.put(path)
                continue
            if self._given_up(key):
                log_event(log, 20, "spooled object already recorded as a gap: removed",
                          epoch=epoch, object_id=h.object_id, path=str(path))  # fmt: skip
                self._trash.put(path)
                continue
            try:
                obj = self._reopen(epoch, h, path, now)
            except (OSError, ValueError) as e:  # the spool's disk, or damage beyond a record
                half = self.open.pop(key, None)
                if half is not None:
                    self._close(half)
                self.expired += 1
                self._forget_later(key)
                self._spool_error(_header_record(epoch, h), str(e), path)
                continue
            if len(obj.done) == obj.n_blocks and key in self.open:
                self._close(obj)
                del self.open[key]
                self.done[key] = h.digest.hex()  # later symbols are late, as in _block_done
                self.ready.append(Delivery(epoch, h, path, obj.repairs_used))
            reopened.append(key)
            evicted += self._evict_over_caps()  # as each is reopened: memory never far beyond
        return evicted

    def _evict_over_caps(self) -> int:
        """Red, UDP receive (restart): evict the open objects idle longest while more are open
        than ``max_open_objects`` or they hold more than ``max_held_bytes`` (as ``add`` and
        ``_create`` do at run time); returns how many."""
        evicted = 0
        while self.open and (len(self.open) > self.max_open or self.held > self.max_held):
            self._evict_oldest("evicted")
            evicted += 1
        return evicted

    def _unreadable(self, path: Path, e: Exception) -> None:
        """A spooled folder whose ``meta.json`` cannot be read (a power loss before its
        unsynced write reached the disk): its name still says which object it was, which is
        recorded as a ``spool_error`` gap (unless delivered or recorded already), then the
        folder is removed."""
        error = _os_error(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        key = _folder_key(path)
        log_event(log, 30, "unreadable spooled object removed", path=str(path), error=error)
        if key is None or key in self.done or self._given_up(key):
            self._trash.put(path)
            return
        _remember_bounded(self._failed, key, self.remembered)
        self.expired += 1
        rec = {"epoch": key[0], "object_id": key[1], "kind": None, "channel": None, "seq": None}
        self._spool_error(rec, f"meta.json unreadable: {error}", path)

    def wait_trash(self, timeout: float | None = None) -> bool:
        """Wait until the folders of objects that ended are removed (tests); False if
        ``timeout`` passed first."""
        return self._trash.wait(timeout)

    def _reopen(self, epoch: int, h: ObjectHeader, path: Path, now: float) -> _Open:
        """One spooled object, its decoders rebuilt. A record torn by a crash (or a full disk)
        at the end of ``symbols.log`` or ``blocks.done`` is cut off, so what is appended next
        stays aligned; a record that cannot belong to the object is skipped. Its clock goes on
        from when its files last changed (``_idle_on_disk``): a receiver restarted more often
        than ``expire_seconds`` still expires what stopped arriving."""
        idle = _idle_on_disk(path)  # before a torn record's cut changes the files' times
        rec_len = _REC.size + h.symbol_size
        (path / _LOG_TMP).unlink(missing_ok=True)  # a compaction the crash cut short
        for name, size in (("blocks.done", _U32.size), (_LOG, rec_len)):
            p = path / name
            if p.exists() and (torn := p.stat().st_size % size):
                log_event(log, 30, "torn record cut off a spooled object", path=str(p),
                          bytes=torn)  # fmt: skip
                os.truncate(p, p.stat().st_size - torn)
        obj = self._open_files(epoch, h, path, now)
        obj.last_seen = now - idle
        self.open[(epoch, h.object_id)] = obj
        raw = (path / "blocks.done").read_bytes()
        done = (_U32.unpack_from(raw, i)[0] for i in range(0, len(raw), _U32.size))
        obj.done = {b for b in done if b < obj.n_blocks}
        self.held += len(obj.done) * _BLOCK_OVERHEAD
        skipped = 0
        obj.logged = (path / _LOG).stat().st_size
        with open(path / _LOG, "rb") as f:
            while len(chunk := f.read(rec_len)) == rec_len:
                b, esi = _REC.unpack_from(chunk)
                if b >= obj.n_blocks or b in obj.done:
                    continue
                try:
                    self._replay(obj, Symbol(epoch, 0, h, b, esi, chunk[_REC.size :]))
                except FecError:
                    skipped += 1
        if skipped:
            log_event(log, 30, "spooled symbols that cannot belong to their object skipped",
                      path=str(path), records=skipped)  # fmt: skip
        self._compact_if_due(obj)  # not while replaying: the log is still being read
        return obj

    def _replay(self, obj: _Open, sym: Symbol) -> None:
        h = obj.h
        dec = obj.decoders.get(sym.block)
        if dec is None:
            dec = obj.decoders[sym.block] = BlockDecoder(
                block_plan(h.length, h.symbol_size, h.block_symbols, sym.block), h.symbol_size
            )
            self.held += _DECODER_OVERHEAD
        before = dec.received
        if dec.add(sym.esi, sym.payload):
            self._release_block(before, h.symbol_size)
            self._block_done(obj, sym.block, dec)
        elif dec.received > before:
            self.held += h.symbol_size + _SYMBOL_OVERHEAD
        obj.symbols += 1


def discard_spooled(d: Delivery) -> None:
    """Remove a delivered or failed object's spool directory (its ``data`` may be 100s of MB:
    the delivery thread does it outside the receive loop's lock), moved into the trash first,
    so that a removal a crash cut short is never taken for an object. A crash before the move
    leaves the directory behind: recovery removes it (a delivered one is in ``done.jsonl``, a
    failed one in ``gaps.jsonl``), never delivering or recording it again."""
    dest = _to_trash(d.path, d.path.parent.parent / "trash")
    if dest is not None:
        _remove_trashed(dest)


def verify_and_read_name(d: Delivery) -> tuple[str, int] | str:
    """Check the rebuilt envelope: ``(name, body offset)``, or the reason to refuse it."""
    digest = hashlib.sha256()
    with open(d.path / "data", "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = 0
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
        if size != d.header.length or digest.digest() != d.header.digest:
            return "digest_mismatch"
        f.seek(0)
        head = f.read(2 + MAX_NAME)
    n = int.from_bytes(head[:2], "big")
    raw = head[2 : 2 + n]
    if not 0 < n <= MAX_NAME or len(raw) != n:  # the protocol's names are shorter: a longer
        return "bad_name"  # one could not take the suffixes of its temp or clash name
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return "bad_name"
    if (
        name.startswith(".")
        or "/" in name
        or not name.isprintable()
        or name in (".", "..")
        or any(c.isspace() for c in name)
    ):
        return "bad_name"
    return name, 2 + n


def deliver(d: Delivery, name: str, offset: int, tmp_dir: Path, inbox: Path) -> tuple[str, str]:
    """Copy the body into ``tmp_dir``, fsync, rename into ``inbox``; never overwrite.

    Returns ``(final name, outcome)``: outcome ``delivered``, ``duplicate`` (the inbox already
    had these bytes under this name) or ``renamed`` (it had other bytes: this copy was
    delivered as ``<name>~<epoch>.<object id>``, which red quarantines as evidence).
    """
    src = d.path / "data"
    length = d.header.length - offset
    final = inbox / name
    outcome = "delivered"
    if os.path.lexists(final):  # a link that leads nowhere is taken too (link() would refuse)
        try:
            st = os.lstat(final)
            same = (
                stat.S_ISREG(st.st_mode)
                and st.st_size == length
                and _same_bytes(src, offset, final)
            )
        except OSError:
            same = False
        if same:
            fsync_dir(inbox)  # linked by a run a crash cut short before its fsync, perhaps
            return name, "duplicate"
        name = f"{name}~{d.epoch}.{d.header.object_id}"
        final = inbox / name
        outcome = "renamed"
    tmp = tmp_dir / f"{name}.{os.getpid()}.tmp"
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            _copy_range(fi.fileno(), fo.fileno(), offset, length, src)
            fo.flush()
            os.fsync(fo.fileno())
        try:
            os.link(tmp, final)  # unlike rename, never replaces a file that appeared meanwhile
        except FileExistsError:
            return deliver(d, name, offset, tmp_dir, inbox)  # judged again: duplicate/renamed
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(inbox)
    return name, outcome


def _copy_range(fi: int, fo: int, offset: int, length: int, src: Path) -> None:
    """``length`` bytes of ``fi`` from ``offset`` to ``fo`` at its position: in the kernel
    when it can (the same filesystem), else read/write (copy_file_range refuses some
    cross-filesystem pairs). ``fo`` must end where it is written from."""
    left, pos = length, offset
    base = os.lseek(fo, 0, os.SEEK_CUR)  # fo is written from its position on
    while left > 0:
        try:
            sent = os.copy_file_range(fi, fo, min(left, 1 << 26), pos)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            break
        if sent <= 0:
            raise OSError(f"short copy of {src} at {pos}")
        pos += sent
        left -= sent
    while left > 0:
        chunk = os.pread(fi, min(left, 1 << 20), pos)
        if not chunk:
            raise OSError(f"short read of {src} at {pos}")
        write_all(fo, chunk)  # a short write (a full disk) never passes unnoticed
        pos += len(chunk)
        left -= len(chunk)
    if (got := os.fstat(fo).st_size - base) != length:  # what is linked into the inbox is whole
        raise OSError(f"copy of {src} is {got} bytes, not {length}")


def delivery_tmp_dir(spool: Path, inbox: Path) -> Path:
    """Where a delivered file is written before it is linked into the inbox: the spool's
    ``tmp/`` when it shares the inbox's filesystem, else ``.<inbox name>.udp-tmp`` beside the
    inbox (a rename cannot cross filesystems, and the inbox only ever sees complete files)."""
    tmp = durable_mkdir(spool / "tmp")
    if os.stat(tmp).st_dev == os.stat(inbox).st_dev:
        return tmp
    beside = durable_mkdir(inbox.parent / f".{inbox.name}.udp-tmp")
    if os.stat(beside).st_dev != os.stat(inbox).st_dev:
        raise ConfigError(
            f"the red inbox {inbox} is a mount point of its own: neither udp.receive.spool_dir "
            f"({spool}) nor {beside} is on its filesystem, so no file could be renamed into it "
            "whole; put the spool on the inbox's filesystem, or mount the filesystem one level "
            "up and make the inbox a folder in it"
        )
    return beside


def _same_bytes(src: Path, offset: int, other: Path) -> bool:
    with open(src, "rb") as a, open(other, "rb") as b:
        a.seek(offset)
        while True:
            x, y = a.read(1 << 20), b.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True
