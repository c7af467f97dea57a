"""Black, spool: per channel, append-only Arrow segments of deliveries, read back by position.

One directory per channel::

    <root>/<channel>/seg-<first position, 16 digits>.arrow   Arrow IPC stream, one batch per sync
    <root>/<channel>/LOCK    flock held by the one writer (readers never lock)
    <root>/<channel>/TAIL    next position after the last fsynced record

Positions are gapless and never reused: a record's position is its message ``seq``.

* The writer (the tap) buffers records, then ``sync`` writes them as one record batch (split
  only past ``MAX_BATCH_BYTES``), fsyncs, and only then rewrites TAIL in place (ASCII, fixed
  width). TAIL is not fsynced: any value it ever holds is durable, so readers trust
  ``min(TAIL, what parses)`` and never touch bytes past it (a concurrent writer may still be
  appending there, or cutting a failed write away). After a power loss TAIL may say less than
  the segments durably hold (or more, if the disk lost fsynced data) until ``open`` rewrites
  it: a reader that cannot wait for the tap (black's start-up recovery) runs that same repair
  with ``SpoolWriter.repair`` when no writer holds the LOCK.
* Each batch carries ``acked_through`` (custom metadata): the last position whose broker ack
  the tap had confirmed. Records after it are the only ones the broker can redeliver; they are
  never released, so a restarted tap can always recognise them (``records_after``).
* A new segment gets its header under a temporary name, fsync, rename, fsync of the directory:
  a segment file always has a valid header, and the last one always exists, so its name and
  batches carry the next position even after every shipped segment was released.
* ``open`` repairs the last segment: a partial trailing batch left by a crash is cut away.
  If TAIL says more was durable than the segment holds (the disk lost fsynced data), the
  missing positions are recorded as *lost* (reason ``spool_damaged``): reported as a gap,
  never reused. TAIL keeps its value until those records are durable, so an ``open`` that
  fails on the way (a full disk) leaves the damage for the next one to find.
* Out of room (quota, ``min_free_bytes``, ENOSPC / EDQUOT): the segment is cut back to its last
  complete batch, ``SpoolFull`` is raised and the records stay buffered for the next ``sync``.
  ``make_releasable`` (also tried before each quota SpoolFull) records the newest
  ``acked_through`` and closes the current segment, so release can make room; a tap waiting
  for room calls it again until it succeeds (a full disk may refuse it the first time).
* A file or folder the file system refuses (EACCES, EPERM, EROFS: another owner, an immutable
  attribute, a read-only mount) is a ConfigError naming the file, the channel, the key and the
  fix (``spool_file_refused``), at ``open`` or on a later write; black's start-up check finds
  the files it would refuse first (``unwritable_spool_file``). Any other write error is a
  StateError naming the file and errno. Nothing that is not durable has been acked then.
* A segment still to be read (holding a position not shipped yet) that cannot be read — not
  readable by black's user (ConfigError), an I/O error, a damaged header (StateError), another
  format (SchemaVersionError) — is refused at ``open`` and by black's start-up check
  (``unreadable_spool_segment``: its header only), naming the file, the positions it holds
  and the fix, before the tap drains more of the broker into a spool that cannot be shipped.
* A shipped segment that cannot be deleted (an immutable attribute, an I/O error) raises the
  error naming it or the folder that refuses, its positions and the fix (``release_refused``):
  the data is shipped, so the tap logs it and goes on; the spool grows until the tap pauses
  at its quota or ``min_free_bytes`` (the backlog then waits in the broker).
* A lost record for a dead letter keeps the dead letter's ``fingerprint`` (16 bytes) in its
  ``properties_raw``, so that a redelivery of the dead letter after a crash is recognised like
  a redelivered message; a lost record's properties are never shipped (``spool_rows``).

Crash points (bridge.faults) inside ``sync``: ``spool.mid_write`` (half a batch written),
``spool.before_fsync``, ``spool.before_tail`` (durable, TAIL not yet moved).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from bridge.black.spool_read import (
    ACKED_KEY,
    FINGERPRINT_BYTES,
    FORMAT,
    FORMAT_KEY,
    KIND_LOST,
    KIND_MESSAGE,
    REASON_DAMAGED,
    SPOOL_SCHEMA,
    TAIL_FILE,
    SpoolReader,
    check_segment_header,
    fingerprint,
    list_segments,
    read_tail,
    scan_segment,
    segment_name,
)
from bridge.diode.file_drop import LEFT_BEHIND
from bridge.errors import (
    ConfigError,
    DiodeError,
    SchemaVersionError,
    SpoolFull,
    StateError,
)
from bridge.faults import crash_point
from bridge.fsutil import fsync_dir, pwritev_all, write_refusal
from bridge.fsutil import os_error_text as _why
from bridge.logs import get_logger, log_event

if TYPE_CHECKING:
    from bridge.config import SpoolConfig

__all__ = [
    "SPOOL_DIR_MODE",
    "SpoolLocked",
    "release_refused",
    "spool_files",
    "unwritable_spool_file",
    "unreadable_spool_segment",
    "spool_file_refused",
    "writer_settings",
    "SPOOL_SCHEMA",
    "KIND_MESSAGE",
    "KIND_LOST",
    "REASON_DAMAGED",
    "MAX_BATCH_BYTES",
    "DEAD_LETTER_BYTES",
    "SpoolWriter",
    "SpoolReader",
    "fingerprint",
    "segment_name",
]

log = get_logger("bridge.black.spool")

MAX_BATCH_BYTES = 64 * 1024 * 1024
"""A sync larger than this is written as several batches (bounds the extra copy in memory)."""
DEAD_LETTER_BYTES = FINGERPRINT_BYTES
"""Size of the dead letter ``fingerprint`` a lost record may carry in ``properties_raw``."""
MAX_DAMAGED = 10_000_000
"""More positions than this missing behind TAIL means TAIL itself is damaged, not the data."""
LOCK_FILE = "LOCK"
_SCHEMA_MESSAGE_LEN = SPOOL_SCHEMA.serialize().size
_RECORD_OVERHEAD = 32  # fixed bytes per record besides its strings and binaries
_BATCH_OVERHEAD = 1024  # IPC framing and metadata of one batch, rounded up
_MiB = 1024 * 1024


def writer_settings(sp: SpoolConfig) -> dict[str, Any]:
    """``SpoolWriter.open``'s settings from ``black.spool``: the tap's, and its repair's."""
    return {
        "segment_bytes": sp.segment_bytes,
        "segment_max_age_s": sp.segment_max_age_seconds,
        "max_bytes": sp.max_bytes,
        "min_free_bytes": sp.min_free_bytes,
    }


class SpoolLocked(StateError):
    """Another process holds the channel's spool LOCK: its one writer (a running tap)."""


class _Collect:
    """Arrow output sink that keeps references to what it is given (no copy, no I/O)."""

    closed = False

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.size = 0
        self.skip = _SCHEMA_MESSAGE_LEN  # the stream writer starts with the schema: drop it

    def write(self, data: Any) -> int:
        n = len(data)
        self.size += n
        if self.skip >= n:
            self.skip -= n
        else:
            view = memoryview(data)
            self.chunks.append(view[self.skip :] if self.skip else view)
            self.skip = 0
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def take(self) -> list[Any]:
        out, self.chunks = self.chunks, []
        return out


SPOOL_DIR_MODE = 0o700
"""Mode of the spool's directories: message bodies, black's user only."""
SPOOL_FILE_MODE = 0o600
"""Mode of the spool's files (LOCK, TAIL, segments)."""
REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)
"""errnos of a file system that refuses the tap's writes: only the operator can fix them."""
_LEFT_BEHIND = LEFT_BEHIND["spool_dir"]


def spool_files(directory: Path) -> list[Path]:
    """Black, spool: the files of a channel's spool folder that its tap opens for writing
    (LOCK, TAIL, the last segment), those that exist."""
    segs = list_segments(directory)
    names = [LOCK_FILE, TAIL_FILE] + ([segment_name(segs[-1])] if segs else [])
    return [directory / n for n in names if os.path.lexists(directory / n)]


def unwritable_spool_file(root: Path, channel: str, *, shipped: int | None = None) -> str | None:
    """Black, start: why the user running black cannot use one of ``channel``'s spool files,
    naming the file, the channel, the key and the fix; None if it can. Each file the tap
    writes (:func:`spool_files`) is opened read-write and closed, then each segment still to
    be read has its header read (:func:`unreadable_spool_segment`, ``shipped`` as there):
    nothing is created or changed."""
    refused = _unwritable(Path(root) / channel, channel)
    if refused is not None:
        return refused
    problem = unreadable_spool_segment(root, channel, shipped=shipped)
    return None if problem is None else str(problem)


def _unwritable(directory: Path, channel: str) -> str | None:
    """Why one of the files the tap writes in ``directory`` cannot be opened for writing."""
    for path in spool_files(directory):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            continue  # released meanwhile (a segment), or made by the tap (LOCK, TAIL)
        except OSError as e:
            return spool_file_refused(channel, path, e)
        os.close(fd)
    return None


def unreadable_spool_segment(
    root: Path, channel: str, *, shipped: int | None = None
) -> DiodeError | None:
    """Black, start: why a segment of ``channel``'s spool holding positions after ``shipped``
    (the last one black shipped, -1 for none; None: unknown, every segment) cannot be read,
    as the error to raise, naming the file, the positions it holds, the reason and the fix;
    None if each can. Its header only is read (:func:`check_segment_header`): cheap, and what
    a damaged file shows first. Otherwise a closed segment is first read when the sealer
    reaches it, after the tap has drained more of the broker into a spool it cannot ship.

    A file the user may not read is a ConfigError; a damaged header a StateError and another
    format a SchemaVersionError, as when the sealer reads it (the fix: docs/runbook.md §7.1);
    any other read error a StateError naming the errno."""
    d = Path(root) / channel
    segs = list_segments(d)
    for i, first in enumerate(segs):
        nxt = segs[i + 1] if i + 1 < len(segs) else None
        if nxt is not None and shipped is not None and nxt - 1 <= shipped:
            continue  # shipped: the tap releases it unread
        path = d / segment_name(first)
        try:
            check_segment_header(path)
        except FileNotFoundError:
            continue  # released meanwhile
        except OSError as e:
            return _segment_unreadable(channel, path, e, _held(channel, first, nxt, shipped))
        except (StateError, SchemaVersionError) as e:
            return type(e)(f"{str(e).rstrip('.')}. {_held(channel, first, nxt, shipped)}")
    return None


def _held(channel: str, first: int, nxt: int | None, shipped: int | None) -> str:
    """What a segment holding positions ``first`` to ``nxt`` (exclusive; None: the last
    segment) holds: messages not shipped yet, unless ``shipped`` is unknown (None) and they
    may have been shipped already (then nothing needs the file)."""
    held = f"[{first}, {nxt})" if nxt is not None else f"{first} onwards"
    said = f"It holds positions {held} of channel {channel!r}"
    if nxt is None or shipped is not None:
        return f"{said}, not shipped yet"
    return (
        f"{said}: if `diode status` shows last_seq {nxt - 1} or more for the channel, they "
        "were shipped and nothing needs the file: delete it"
    )


def _segment_unreadable(channel: str, path: Path, e: OSError, held: str) -> DiodeError:
    """Segment ``path`` of ``channel``'s spool, holding ``held`` (:func:`_held`), cannot be
    read (``e``): the file, the reason, what it holds, the fix."""
    if e.errno == errno.EACCES:
        msg = _not_granted("readable", channel, path, e, _chown_fix(path.parent))
        return ConfigError(f"{msg}. {held}")
    return StateError(
        f"black.spool_dir: {_where(channel, path)} cannot be read ({_why(e)}). {held}. Check "
        "that disk (dmesg), and move a file that is not the spool's aside; a segment the disk "
        "damaged: restore it from a backup or start a new spool (docs/runbook.md §7.1, 'spool "
        "lost': its positions not shipped become a spool_lost gap)"
    )


def _where(channel: str, path: Path) -> str:
    """``path`` as the spool's refusals name it: the channel's folder, or a file in it."""
    if path.name == channel and os.path.isdir(path):
        return f"{path}, the spool folder of channel {channel!r},"
    return f"{path}, in the spool of channel {channel!r},"


def _not_granted(what: str, channel: str, path: Path, e: OSError, fix: str) -> str:
    """``path`` is not ``what`` (readable, writable) by the user running black: ``fix``."""
    return (
        f"black.spool_dir: {_where(channel, path)} is not {what} by the user running black "
        f"(uid {os.getuid()}; {_why(e)}): {fix}, or point black.spool_dir elsewhere "
        f"({_LEFT_BEHIND})"
    )


def _chown_fix(folder: Path) -> str:
    """The fix of a spool folder or file another user owns (a restore under another owner)."""
    return (
        "give that user its spool folder and the files in it (e.g. "
        f"`chown -R {os.getuid()} {folder}`, mode {SPOOL_DIR_MODE:04o} for the folder, "
        f"{SPOOL_FILE_MODE:04o} for its files)"
    )


def spool_file_refused(channel: str, path: Path, e: OSError) -> str:
    """Black, spool: what to tell when ``path`` in ``channel``'s spool refused the tap's write
    (``e``, at start or while it runs): the file, the channel, the key, the reason, the fix."""
    is_folder = path.name == channel and os.path.isdir(path)  # creating or removing files
    folder = path if is_folder else path.parent
    if e.errno == errno.EROFS:
        return (
            f"black.spool_dir: {_where(channel, path)} is on a read-only file system "
            f"({_why(e)}): the tap writes there. Mount it read-write, or point black.spool_dir "
            f"to a writable directory ({_LEFT_BEHIND})"
        )
    if e.errno == errno.EPERM:
        target = path if os.path.lexists(path) else folder
        fix = (
            "an immutable or append-only attribute refuses even root: clear it "
            f"(`lsattr -d {target}`, then `chattr -i -a {target}`)"
        )
        return _not_granted("writable", channel, path, e, fix)
    if e.errno == errno.EACCES:
        return _not_granted("writable", channel, path, e, _chown_fix(folder))
    return (
        f"black.spool_dir: {_where(channel, path)} cannot be opened for writing ({_why(e)}): "
        "the tap needs it as a regular file it can read and write. Check that disk (dmesg), or "
        "move a file that is not the spool's aside, and start black again"
    )


def release_refused(channel: str, segment: Path, held: str, e: OSError) -> DiodeError:
    """Black, spool: the error when ``segment`` of ``channel``'s spool, holding ``held``
    (positions black shipped), could not be deleted (``e``): the file or folder that refuses
    and the fix (ConfigError: :func:`spool_file_refused`), or the disk's error (StateError);
    with what it costs until then. The tap logs it and goes on (housekeeping)."""
    cost = (
        f"It holds {held}, shipped already: the tap goes on and tries again; until then the "
        "spool keeps it and everything after it, and the tap pauses once the spool reaches "
        "[black.spool] max_bytes or min_free_bytes (the backlog then waits in the broker; "
        "nothing is lost)"
    )
    if e.errno in REFUSED:  # the folder's attribute, owner or mount; else the segment's own
        culprit = segment.parent if write_refusal(segment.parent) is not None else segment
        return ConfigError(f"{spool_file_refused(channel, culprit, e)}. {cost}")
    return StateError(
        f"spool of channel {channel!r}: deleting {segment} failed ({_why(e)}): check that disk "
        f"(dmesg). {cost}"
    )


def _make_dir(path: Path) -> None:
    """mkdir -p (mode ``SPOOL_DIR_MODE``), fsyncing each new directory's parent."""
    if path.is_dir():
        return
    _make_dir(path.parent)
    try:
        path.mkdir(mode=SPOOL_DIR_MODE)
    except FileExistsError:
        return
    fsync_dir(path.parent)


class SpoolWriter:
    """The one writer of a channel's spool (held by its tap). Build with ``SpoolWriter.open``."""

    def __init__(
        self,
        root: Path,
        channel: str,
        *,
        segment_bytes: int,
        segment_max_age_s: float,
        max_bytes: int | None,
        min_free_bytes: int,
    ) -> None:
        self.channel = channel
        self.root = Path(root)
        self.directory = self.root / channel
        self.segment_bytes = segment_bytes
        self.segment_max_age_s = segment_max_age_s
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.repaired_bytes = 0
        """Bytes of a partial trailing batch ``open`` cut away (a crash happened mid-write)."""
        self.damaged = 0
        """Positions ``open`` recorded as lost because the disk lost them after their fsync."""
        self._lock_fd = -1
        self._tail_fd = -1
        self._fd = -1  # current segment
        self._seg_first = 0
        self._seg_size = 0
        self._seg_t0 = 0.0
        self._roll_wanted = False
        self._closed_segs: list[tuple[int, int]] = []  # (first position, bytes), oldest first
        self._used = 0
        self._durable_end = 0
        self._acked = -1
        self._ex: list[str] = []
        self._rk: list[str] = []
        self._rd: list[bool] = []
        self._props: list[bytes] = []
        self._bodies: list[bytes] = []
        self._lost: dict[int, str] = {}  # index in the pending lists -> reason
        self._notes: dict[int, str] = {}  # index -> why a message record is not byte-exact
        self._pending_bytes = 0

    # -- open / close ----------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        root: Path,
        channel: str,
        *,
        segment_bytes: int = 64 * _MiB,
        segment_max_age_s: float = 300.0,
        max_bytes: int | None = None,
        min_free_bytes: int = 256 * _MiB,
        first_pos: int = 0,
    ) -> SpoolWriter:
        """Lock the channel's spool, repair its last segment, and get ready to append.

        ``first_pos``: the first position black has not shipped (its journal's last seq + 1):
        where a spool that has no segment yet starts (a spool moved aside restarts after the
        last shipped seq). Every segment holding a position from there on must be readable
        (``unreadable_spool_segment``, its header only); older ones are released unread.
        """
        if not channel or channel in (".", "..") or "/" in channel or channel.startswith("."):
            raise ConfigError(f"spool channel name {channel!r} cannot be a directory name")
        if segment_bytes < 1 or segment_max_age_s <= 0 or min_free_bytes < 0:
            raise ConfigError(
                f"spool of channel {channel!r}: segment_bytes ({segment_bytes}) and "
                f"segment_max_age_seconds ({segment_max_age_s}) must be > 0 and min_free_bytes "
                f"({min_free_bytes}) >= 0: fix [black.spool]"
            )
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError(f"spool of channel {channel!r}: max_bytes must be > 0 or unset")
        w = cls(
            root,
            channel,
            segment_bytes=segment_bytes,
            segment_max_age_s=segment_max_age_s,
            max_bytes=max_bytes,
            min_free_bytes=min_free_bytes,
        )
        try:
            w._open(first_pos)
        except OSError as e:  # a file or the folder refused (raised from the OS, not wrapped)
            w.close()
            path = Path(e.filename) if e.filename else w.directory
            raise w._write_error(e, path) from e
        except BaseException:
            w.close()
            raise
        return w

    def _open(self, first_pos: int) -> None:
        d = self.directory
        _make_dir(d)
        refused = _unwritable(d, self.channel)  # before anything changes
        if refused is not None:
            raise ConfigError(refused)
        self._lock_fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, SPOOL_FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpoolLocked(
                f"spool of channel {self.channel!r}: another process holds {d / LOCK_FILE} "
                "(a tap of this channel is already running; two would fork its positions). "
                "Stop the other tap first"
            ) from None
        unreadable = unreadable_spool_segment(self.root, self.channel, shipped=first_pos - 1)
        if unreadable is not None:  # found before the tap consumes, not by the sealer later
            raise unreadable
        for name in os.listdir(d):
            if name.startswith(".seg-") and name.endswith(".tmp"):
                (d / name).unlink(missing_ok=True)  # a header a crash left unrenamed
        tail = read_tail(d)
        segs = list_segments(d)
        for first in segs[:-1]:
            self._closed_segs.append((first, (d / segment_name(first)).stat().st_size))
        if not segs:
            self._durable_end = max(first_pos, tail or 0)
            self._new_segment()
        else:
            self._repair_last(segs[-1])
        self._used = sum(size for _, size in self._closed_segs) + self._seg_size
        self._tail_fd = os.open(d / TAIL_FILE, os.O_RDWR | os.O_CREAT, SPOOL_FILE_MODE)
        if tail is not None and tail > self._durable_end:
            # TAIL moves (to ``tail``) only once the lost records are durable: should this
            # fail (a full disk), the next open still finds the damage
            self._record_damage(tail)
        else:
            self._write_tail()
            fsync_dir(d)

    @classmethod
    def repair(cls, root: Path, channel: str, **settings: Any) -> SpoolWriter | None:
        """``open``'s repair of a spool no writer holds, then the lock let go: for a reader
        that cannot wait for the tap (black's start-up recovery, which runs before the taps).

        A partial last batch is cut away, positions the disk lost are recorded as lost, and
        TAIL is rewritten from the segments (after a power loss it may lag what they durably
        hold). Returns the closed writer (``durable_end``, ``damaged``, ``repaired_bytes`` say
        what it found), or None: a writer holds the LOCK (it repaired the spool at its open
        and keeps TAIL current), or the spool has no segment (nothing to repair; its tap
        creates it). ``settings``: ``open``'s, as the tap opens the spool with
        (``writer_settings``).
        """
        if not list_segments(Path(root) / channel):
            return None
        try:
            w = cls.open(root, channel, **settings)
        except SpoolLocked:
            return None
        w.close()
        return w

    def _repair_last(self, first: int) -> None:
        path = self.directory / segment_name(first)
        end, offset, acked = scan_segment(path, first, None)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size > offset:
                os.ftruncate(fd, offset)
                self.repaired_bytes = size - offset
                log_event(
                    log, 30, "spool: cut a partial batch a crash left at the end of a segment",
                    channel=self.channel, segment=str(path), bytes=size - offset, next_pos=end,
                )  # fmt: skip
            os.fsync(fd)  # batches written but not fsynced before a crash become durable here
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._seg_first, self._seg_size = fd, first, offset
        self._seg_t0 = time.monotonic()
        self._durable_end, self._acked = end, acked
        if end > first:  # new appends go to a new segment; this one can be released
            try:
                self._roll()
            except SpoolFull:
                self._roll_wanted = True  # the first sync tries again

    def _record_damage(self, tail: int) -> None:
        n = tail - self._durable_end
        if n > MAX_DAMAGED:
            raise StateError(
                f"spool of channel {self.channel!r}: {self.directory / TAIL_FILE} says "
                f"{tail} but the segments end at position {self._durable_end}: TAIL is damaged. "
                f"If the segments are intact, write {self._durable_end} into TAIL (or delete "
                "it) and start again"
            )
        log_event(
            log, 50, "spool: TAIL says positions were durable that the segment no longer holds "
            "(the disk lost fsynced data); recorded as lost, reported as a gap",
            channel=self.channel, first_pos=self._durable_end, last_pos=tail - 1, records=n,
        )  # fmt: skip
        self.append_lost("", "", REASON_DAMAGED, n)
        self.damaged = n
        self.sync(self._acked)

    def close(self) -> None:
        """Release the lock. Records not synced are dropped (the broker still holds them)."""
        for attr in ("_fd", "_tail_fd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)  # closing the lock's fd releases the flock

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------------
    @property
    def durable_end(self) -> int:
        """Positions before this are fsynced."""
        return self._durable_end

    @property
    def next_pos(self) -> int:
        """Position the next appended record gets."""
        return self._durable_end + len(self._bodies)

    @property
    def acked_through(self) -> int:
        """Last position whose broker ack was confirmed, as recorded by the last batch."""
        return self._acked

    @property
    def pending(self) -> int:
        """Records appended but not durable yet."""
        return len(self._bodies)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def used_bytes(self) -> int:
        """Bytes of all segment files of the channel."""
        return self._used

    # -- appending -------------------------------------------------------------------------------
    def append(
        self,
        exchanges: Sequence[str],
        routing_keys: Sequence[str],
        redelivered: Sequence[bool],
        properties_raw: Sequence[bytes],
        bodies: Sequence[bytes],
    ) -> int:
        """Buffer deliveries (not written yet: see ``sync``); returns the first one's position."""
        n = len(bodies)
        if not (len(exchanges) == len(routing_keys) == len(redelivered) == len(properties_raw)):
            raise ValueError(
                f"spool append: column lengths differ ({len(exchanges)}, {len(routing_keys)}, "
                f"{len(redelivered)}, {len(properties_raw)}, {n})"
            )
        first = self._durable_end + len(self._bodies)
        self._ex.extend(exchanges)
        self._rk.extend(routing_keys)
        self._rd.extend(redelivered)
        self._props.extend(properties_raw)
        self._bodies.extend(bodies)
        self._pending_bytes += (
            sum(map(len, bodies))
            + sum(map(len, properties_raw))
            + sum(map(len, exchanges))
            + sum(map(len, routing_keys))
        )
        self._pending_bytes += _RECORD_OVERHEAD * n
        return first

    def append_one(
        self,
        exchange: str,
        routing_key: str,
        redelivered: bool,
        properties_raw: bytes,
        body: bytes,
        note: str | None = None,
    ) -> int:
        """``append`` of one delivery, without building five lists (the tap's hot path).

        ``note``: why this message is not byte-exact as published (stored in ``reason``)."""
        first = self._durable_end + len(self._bodies)
        if note is not None:
            self._notes[len(self._bodies)] = note
        self._ex.append(exchange)
        self._rk.append(routing_key)
        self._rd.append(redelivered)
        self._props.append(properties_raw)
        self._bodies.append(body)
        self._pending_bytes += (
            len(body) + len(properties_raw) + len(exchange) + len(routing_key) + _RECORD_OVERHEAD
        )
        return first

    def append_lost(
        self,
        exchange: str,
        routing_key: str,
        reason: str,
        count: int = 1,
        *,
        dead_letter: bytes = b"",
    ) -> int:
        """Buffer ``count`` lost records (messages the broker dropped); their seqs become gaps.

        ``dead_letter``: the ``fingerprint`` of the dead letter that reported the loss (kept in
        the record's ``properties_raw``), so that its redelivery can be recognised."""
        if count < 1:
            raise ValueError(f"spool append_lost: count {count} < 1")
        if not reason:
            raise ValueError("spool append_lost: a lost record needs a reason")
        if dead_letter and (count != 1 or len(dead_letter) != DEAD_LETTER_BYTES):
            raise ValueError(
                f"spool append_lost: one dead letter, one {DEAD_LETTER_BYTES}-byte fingerprint"
            )
        first = self._durable_end + len(self._bodies)
        i = len(self._bodies)
        self._ex.extend([exchange] * count)
        self._rk.extend([routing_key] * count)
        self._rd.extend([False] * count)
        self._props.extend([dead_letter] * count)
        self._bodies.extend([b""] * count)
        for k in range(i, i + count):
            self._lost[k] = reason
        self._pending_bytes += (
            _RECORD_OVERHEAD + len(exchange) + len(routing_key) + len(dead_letter)
        ) * count
        return first

    def discard_pending(self) -> int:
        """Forget the records appended since the last sync (their deliveries were never acked,
        so the broker redelivers them); returns how many were dropped."""
        n = len(self._bodies)
        self._ex, self._rk, self._rd, self._props, self._bodies = [], [], [], [], []
        self._lost = {}
        self._notes = {}
        self._pending_bytes = 0
        return n

    # -- sync ------------------------------------------------------------------------------------
    def sync(self, acked_through: int) -> int:
        """Write everything pending as one batch, fsync, update TAIL; returns ``durable_end``.

        ``acked_through``: last position whose broker ack the tap has confirmed (recorded in
        the batch). With nothing pending, a batch is written only if it advances. SpoolFull
        when out of room: nothing is half-written and the records stay pending for a retry.
        """
        self._check_open()
        acked = max(acked_through, self._acked)
        if not self._bodies and acked == self._acked:
            return self._durable_end
        if self._bodies:
            need = self._pending_bytes + _BATCH_OVERHEAD * (
                1 + self._pending_bytes // MAX_BATCH_BYTES
            )
            full = self._room_problem(need)
            if full is not None:
                self.make_releasable(acked)  # so that the pause cannot last forever
                raise full
            if self._roll_due():
                self._roll()
        self._commit(acked)
        return self._durable_end

    def room_for(self, nbytes: int) -> SpoolFull | None:
        """Why ``nbytes`` more would not fit now (quota or free space), or None. The file
        system's free space counts even with no ``min_free_bytes`` reserve: a tap paused by
        ENOSPC waits for room instead of resuming into the same ENOSPC every retry."""
        need = nbytes + _BATCH_OVERHEAD
        full = self._room_problem(need)
        if full is not None or self.min_free_bytes:
            return full
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if free >= need:
            return None
        return SpoolFull(
            f"spool of channel {self.channel!r}: the file system of {self.directory} has "
            f"{free} bytes free, {need} needed. The tap pauses (the backlog waits in the "
            "broker): free space on that file system",
            path=str(self.directory),
            free_bytes=free,
        )

    def _roll_due(self) -> bool:
        if self._durable_end == self._seg_first:  # the current segment holds no record yet
            return False
        return (
            self._roll_wanted
            or self._seg_size >= self.segment_bytes
            or time.monotonic() - self._seg_t0 >= self.segment_max_age_s
        )

    def _room_problem(self, need: int) -> SpoolFull | None:
        holds_records = bool(self._closed_segs) or self._durable_end > self._seg_first
        if self.max_bytes is not None and self._used + need > self.max_bytes and holds_records:
            # an empty spool takes one group past the quota: waiting could not make room
            return SpoolFull(
                f"spool of channel {self.channel!r} in {self.directory} is at its quota: "
                f"{self._used} bytes on disk + {need} to write > max_bytes {self.max_bytes}. "
                "The tap pauses (the backlog waits in the broker) and resumes as shipped "
                "segments are released; if black ships steadily, raise [black.spool] max_bytes",
                path=str(self.directory),
            )
        if not self.min_free_bytes:  # no reserve: the file system's ENOSPC is the limit
            return None
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if free - need < self.min_free_bytes:
            return SpoolFull(
                f"spool of channel {self.channel!r}: the file system of {self.directory} has "
                f"{free} bytes free; writing {need} more would leave less than min_free_bytes "
                f"({self.min_free_bytes}). The tap pauses (the backlog waits in the broker): "
                "free space on that file system, or lower [black.spool] min_free_bytes",
                path=str(self.directory),
                free_bytes=free,
            )
        return None

    def make_releasable(self, acked_through: int) -> bool:
        """Let ``release_through`` free everything durable up to ``acked_through``: record it
        (an empty batch, if it is newer than the recorded one) and close the current segment
        (only closed segments are released). Nothing pending is written.

        Returns False if a full disk refused either step (SpoolFull is not raised: a tap
        waiting for room calls this again), True otherwise.
        """
        self._check_open()
        try:
            if acked_through > self._acked:
                self._commit(acked_through, records=False)
            if self._durable_end > self._seg_first:
                self._roll()
        except SpoolFull:
            self._roll_wanted = True  # the next sync tries again too
            return False
        return True

    def _new_segment(self) -> None:
        """Create the segment starting at ``durable_end`` (complete header, fsynced, renamed)."""
        d = self.directory
        final = d / segment_name(self._durable_end)
        tmp = d / f".{final.name}.tmp"
        header = SPOOL_SCHEMA.with_metadata(
            {FORMAT_KEY: FORMAT, ACKED_KEY: str(self._acked).encode()}
        ).serialize()
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, SPOOL_FILE_MODE)
        except OSError as e:  # the folder refuses new files (permissions, a full inode table)
            raise self._write_error(e, final) from e
        try:
            try:
                size = pwritev_all(fd, [memoryview(header)], 0)
                os.fsync(fd)
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):  # a folder that refuses it: open() cuts it
                    tmp.unlink(missing_ok=True)
                raise
            fsync_dir(d)
        except OSError as e:
            os.close(fd)
            raise self._write_error(e, final) from e
        except BaseException:
            os.close(fd)
            raise
        if self._fd >= 0:
            self._closed_segs.append((self._seg_first, self._seg_size))
            os.close(self._fd)
        self._fd, self._seg_first, self._seg_size = fd, self._durable_end, size
        self._seg_t0 = time.monotonic()
        self._used += size

    def _roll(self) -> None:
        self._new_segment()
        self._roll_wanted = False

    def _commit(self, acked: int, *, records: bool = True) -> None:
        """Append the pending records (or none) as batches at the segment's end, then fsync."""
        start = self._seg_size
        n = len(self._bodies) if records else 0
        try:
            end = start
            for chunks in self._encode(acked, n):
                half = len(chunks) // 2
                end = pwritev_all(self._fd, chunks[:half], end)
                crash_point("spool.mid_write")  # a partial batch on disk
                end = pwritev_all(self._fd, chunks[half:], end)
            crash_point("spool.before_fsync")
            os.fsync(self._fd)
            crash_point("spool.before_tail")  # durable, but TAIL still says less
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)  # back to the last complete batch
            except OSError:
                pass  # later batches overwrite it; open() would cut it
            raise self._write_error(e, self.directory / segment_name(self._seg_first)) from e
        self._seg_size = end
        self._used += end - start
        self._durable_end += n
        self._acked = acked
        if n:  # durable: never written again, even if TAIL refuses its update below
            self._ex, self._rk, self._rd, self._props, self._bodies = [], [], [], [], []
            self._lost = {}
            self._notes = {}
            self._pending_bytes = 0
        self._write_tail()

    def _encode(self, acked: int, n: int) -> Iterator[list[Any]]:
        """The IPC bytes of the pending records' batches, one batch at a time (no copy)."""
        sink = _Collect()
        writer = pa.ipc.new_stream(sink, SPOOL_SCHEMA)
        md = {ACKED_KEY: str(acked).encode()}
        if n == 0:
            writer.write_batch(
                pa.RecordBatch.from_pylist([], schema=SPOOL_SCHEMA), custom_metadata=md
            )
            yield sink.take()
            return
        for lo, hi in self._splits(n):
            writer.write_batch(self._batch(lo, hi), custom_metadata=md)
            yield sink.take()

    def _splits(self, n: int) -> Iterator[tuple[int, int]]:
        if self._pending_bytes <= MAX_BATCH_BYTES:
            yield 0, n
            return
        lo, size = 0, 0
        for i, (b, p) in enumerate(zip(self._bodies, self._props, strict=True)):
            size += len(b) + len(p) + _RECORD_OVERHEAD
            if size >= MAX_BATCH_BYTES:
                yield lo, i + 1
                lo, size = i + 1, 0
        if lo < n:
            yield lo, n

    def _batch(self, lo: int, hi: int) -> pa.RecordBatch:
        n = hi - lo
        first = self._durable_end + lo
        kind = np.zeros(n, dtype=np.int8)
        lost = [(i - lo, r) for i, r in self._lost.items() if lo <= i < hi] if self._lost else []
        notes = [(i - lo, r) for i, r in self._notes.items() if lo <= i < hi] if self._notes else []
        if lost or notes:
            reasons: list[str | None] = [None] * n
            for i, r in lost:
                kind[i] = KIND_LOST
                reasons[i] = r
            for i, r in notes:
                reasons[i] = r
            reason = pa.array(reasons, pa.string())
        else:
            reason = pa.nulls(n, pa.string())
        whole = lo == 0 and hi == len(self._bodies)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(np.arange(first, first + n, dtype=np.int64)),
                pa.array(kind),
                pa.array(self._ex if whole else self._ex[lo:hi], pa.string()),
                pa.array(self._rk if whole else self._rk[lo:hi], pa.string()),
                pa.array(self._rd if whole else self._rd[lo:hi], pa.bool_()),
                pa.array(self._props if whole else self._props[lo:hi], pa.binary()),
                pa.array(self._bodies if whole else self._bodies[lo:hi], pa.binary()),
                reason,
            ],
            schema=SPOOL_SCHEMA,
        )

    def _write_error(self, e: OSError, path: Path) -> DiodeError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                st = os.statvfs(self.directory)
                free: int | None = st.f_bavail * st.f_frsize
            except OSError:
                free = None
            return SpoolFull(
                f"spool of channel {self.channel!r}: writing {path} failed: {e.strerror} "
                f"({free} bytes free on the file system of {self.directory}). The tap pauses "
                "(the backlog waits in the broker) and retries: free space on that file system",
                errno=e.errno,
                path=str(path),
                free_bytes=free,
            )
        unacked = (
            "Nothing that is not durable was acked: the broker redelivers it, and a restarted "
            "tap recognises what the spool holds"
        )
        if e.errno in REFUSED:
            return ConfigError(f"{spool_file_refused(self.channel, path, e)}. {unacked}")
        return StateError(
            f"spool of channel {self.channel!r}: writing {path} failed: {_why(e)}. {unacked}. "
            f"Check the disk of {self.directory} (dmesg) and start black again"
        )

    def _write_tail(self) -> None:
        """Rewrite TAIL in place (the records it counts are durable already)."""
        try:
            os.pwrite(self._tail_fd, b"%020d\n" % self._durable_end, 0)
        except OSError as e:
            raise self._write_error(e, self.directory / TAIL_FILE) from e

    def _check_open(self) -> None:
        if self._fd < 0:
            raise StateError(f"spool of channel {self.channel!r} is closed")

    # -- reading back / releasing ----------------------------------------------------------------
    def records_after(self, pos: int) -> pa.Table:
        """Durable records with position > ``pos`` (those still on disk)."""
        first = self._closed_segs[0][0] if self._closed_segs else self._seg_first
        start = max(pos + 1, first)
        end = self._durable_end
        if start >= end:
            return SPOOL_SCHEMA.empty_table()
        batches = list(SpoolReader(self.root, self.channel).read(start, end, batch_rows=1 << 30))
        return pa.Table.from_batches(batches, schema=SPOOL_SCHEMA)

    def release_through(self, pos: int) -> int:
        """Delete closed segments whose records all have positions <= ``pos``; bytes freed.

        Never the current segment, and never records after ``acked_through`` (the broker may
        still redeliver them: they must stay recognisable). A segment that cannot be deleted
        raises ``release_refused``'s error; it and those after it stay listed, and the next
        call tries again.
        """
        limit = min(pos, self._acked)
        freed = released = 0
        segs = self._closed_segs
        try:
            while segs:
                first, size = segs[0]
                nxt = segs[1][0] if len(segs) > 1 else self._seg_first
                if nxt - 1 > limit:
                    break
                path = self.directory / segment_name(first)
                try:
                    path.unlink(missing_ok=True)
                except OSError as e:  # housekeeping: what it holds is shipped
                    held = f"positions [{first}, {nxt})"
                    raise release_refused(self.channel, path, held, e) from e
                del segs[0]  # accounted one by one: a refusal midway leaves the rest listed
                freed += size
                released += 1
                self._used -= size
        finally:
            if released:  # the deletions made durable
                try:
                    fsync_dir(self.directory)
                except OSError as e:  # that disk fails: so would the tap's writes
                    raise self._write_error(e, self.directory) from e
        return freed
