"""Red, evidence: move inbox files into processed/ or quarantine/ by day, never overwriting.

    processed_dir/<YYYY-MM-DD>/<name>[.<n>]
    quarantine_dir/<YYYY-MM-DD>/<name>[.<n>]  +  <that name>.reason.json

A file is hard-linked to the first free name (``link`` fails if the name exists, so nothing
is ever replaced), then unlinked from where it was; both folders are fsynced. A call
repeated after a crash between the two steps finds its own link (same inode) and finishes
without a second copy. Entries that cannot be hard-linked (directories, files of another
owner under ``fs.protected_hardlinks``) are renamed with ``RENAME_NOREPLACE`` instead.
Symlinks are moved as links: their targets are never opened.

Only day folders (``YYYY-MM-DD``: :data:`DAY_RE`) are looked into for an earlier move: any
other entry (the file system's ``lost+found`` when the folder is a mount point) is left alone;
a day folder red may not search is skipped with one warning. A name is free only when the
OS says it is absent: an error that hides the answer is never taken for "free". An entry the
OS refuses to move (EPERM, EACCES, EBUSY: immutable, a folder of another owner, a mount
point) is :class:`Unmovable`: nothing of the move is left behind (its reservation and what
``placed`` recorded are undone) and it stays where it was.

A reason file is created only where none exists (written to a temp name, then renamed with
``RENAME_NOREPLACE``): another entry's reason file is never replaced, and a name whose reason
file is there without its entry (a file re-injected from the quarantine, its reason file kept
as evidence) is never taken again. Before a rename the reason file reserves the name: it
carries ``pending_move`` (device, inode and ctime of the entry, which any rename changes), and
only a later call for that same, unmoved entry honours it; once the rename is done the reason
file is rewritten without it.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import json
import os
import re
import stat
import unicodedata
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.errors import StateError
from bridge.faults import crash_point
from bridge.fsutil import (
    append_only_refusal,
    atomic_write_bytes,
    durable_mkdir,
    fsync_dir,
    tmp_path_for,
    write_new_file,
)
from bridge.logs import get_logger, log_event

__all__ = [
    "Evidence",
    "Unmovable",
    "move_error",
    "DAY_RE",
    "day_folders",
    "safe_name",
    "shown_name",
    "SAFE_NAME_RE",
    "REASON_SUFFIX",
    "PENDING_KEY",
    "rename_noreplace",
    "file_kind",
    "sha256_regular",
    "unmoved_entries",
    "move_id",
]

log = get_logger("bridge.red.evidence")

DAY_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
"""The name of a day folder of ``processed_dir`` / ``quarantine_dir``; nothing else there is
evidence (``lost+found`` of a mount point, an operator's files)."""
SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
"""Every name :func:`safe_name` returns matches this (ASCII, no leading dot, <= 100 chars)."""
REASON_SUFFIX = ".reason.json"
PENDING_KEY = "pending_move"
"""In a reason file written before its entry's rename: the move it reserves the name for."""
_MAX_SAFE = 100
_HASH_HEX = 16
_KEEP_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_UNSAFE_BYTES = re.compile(rb"[^A-Za-z0-9._-]")
_CHUNK = 1 << 20
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_REFUSED = frozenset({errno.EPERM, errno.EACCES, errno.EBUSY})
"""What a rename answers for an entry the OS will not let red move (immutable or append-only,
a directory of another owner, a mount point): that entry's trouble, not red's."""


class Unmovable(StateError):
    """The OS refused to move ``path`` (``errno``: EPERM, EACCES, EBUSY): nothing was changed,
    it stays where it was."""

    def __init__(self, message: str, path: Path, errno_: int) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno_


def safe_name(raw: bytes) -> str:
    """A file name for ``raw`` made only of ``[A-Za-z0-9._-]``, without a leading dot, at most
    100 characters, ending in ``-`` + the first 16 hex digits of ``sha256(raw)``: distinct raw
    names get distinct safe names, and a safe name is never a valid wire name."""
    digest = hashlib.sha256(raw).hexdigest()[:_HASH_HEX]
    readable = _UNSAFE_BYTES.sub(b"_", raw).decode("ascii").lstrip(".-")
    readable = readable[: _MAX_SAFE - _HASH_HEX - 1] or "file"
    return f"{readable}-{digest}"


_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Unicode categories :func:`shown_name` escapes: controls, format (bidi overrides, zero
width), surrogates, private use, unassigned, line and paragraph separators."""


def _shown_char(ch: str) -> str:
    """``ch`` itself if printable, else its escape (``\\xNN`` only below 0x80, so that it
    never reads as a byte that is not UTF-8, which is always 0x80 or above)."""
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if ch == " " or (unicodedata.category(ch) not in _HIDDEN_CATEGORIES and not ch.isspace()):
        return ch
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown_name(raw: bytes) -> str:
    """``raw`` (a file name as it arrived, any bytes) as printable text for records and
    listings: decoded as UTF-8; each byte that is not UTF-8 as ``\\xNN`` (80-ff); controls,
    format characters (bidi overrides, zero width), separators and whitespace other than a
    space as ``\\xNN`` (below 80), ``\\uNNNN`` or ``\\UNNNNNNNN``; a backslash as ``\\\\``.
    It reads back to the very bytes, which are also ``raw.hex()``."""
    text = raw.decode("utf-8", "surrogateescape")
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        else:
            out.append(_shown_char(ch))
    return "".join(out)


def _stored_name(name: str) -> str:
    """``name`` itself when it is a plain file name, else its :func:`safe_name`."""
    if _KEEP_NAME.fullmatch(name) and not name.endswith(REASON_SUFFIX):
        return name
    return safe_name(os.fsencode(name))


def file_kind(mode: int) -> str:
    """A word for the file type in ``mode`` (for reason files and logs)."""
    for test, word in (
        (stat.S_ISREG, "regular"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "char_device"),
        (stat.S_ISBLK, "block_device"),
    ):
        if test(mode):
            return word
    return "unknown"


_libc: Any = None


def _renameat2() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return getattr(_libc, "renameat2", None)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically; FileExistsError if ``dst`` exists (never replaced).

    Uses ``renameat2(RENAME_NOREPLACE)``; where the kernel or file system lacks it, checks
    first and renames (a race only with another writer of the same folder)."""
    fn = _renameat2()
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), os.fsdecode(src), None, os.fsdecode(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(dst))
    os.rename(src, dst)


def _candidate(folder: Path, name: str, n: int) -> Path:
    return folder / (name if n == 0 else f"{name}.{n}")


def _inode(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def move_id(st: os.stat_result) -> str:
    """What a reservation is for: the entry (device, inode) as it was, unmoved (its ctime,
    which a rename changes: ours once done, or an operator's ``mv`` back into the inbox)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"


def unmoved_entries(places: Iterable[Path]) -> dict[str, Path]:
    """Red, evidence: every entry of ``places`` (the folders moves start from: the inbox, the
    intake) by the ``pending_move`` a reservation for it would carry. A reservation whose mark
    is not here can never be honoured: its entry was renamed (re-injected, moved back),
    changed (a new ctime) or removed. OSError if a place exists but cannot be listed."""
    out: dict[str, Path] = {}
    for place in places:
        try:
            it = os.scandir(os.fsencode(place))
        except FileNotFoundError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out[move_id(st)] = Path(place) / os.fsdecode(entry.name)
    return out


def _exists(path: Path) -> bool:
    """Whether there is an entry at ``path`` (a dangling symlink is one). False only when the
    OS says it is absent: an error that hides the answer (EACCES: a folder red may not search)
    is raised, never taken for a free name (``os.path.lexists`` would say False, for every
    name, and a search for a free one would never end)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def _reserved_for(dst: Path, st: os.stat_result) -> bool | None:
    """Whether the reason file of ``dst`` (an absent entry) reserves that name for ``st``'s
    entry: True only while it is that entry's pending move (its rename never happened);
    False for any other reason file (another entry's, one whose move completed, unreadable);
    None if there is no reason file. OSError if the folder cannot be searched to tell."""
    reason = dst.with_name(dst.name + REASON_SUFFIX)
    if not _exists(reason):
        return None
    try:
        rec = json.loads(reason.read_bytes())
    except FileNotFoundError:  # removed since
        return None
    except (OSError, ValueError):  # there, but not readable as ours: the name is taken
        return False
    return isinstance(rec, dict) and rec.get(PENDING_KEY) == move_id(st)


def _earlier_in(day: Path, name: str, st: os.stat_result) -> Path | None:
    """:func:`_earlier_place` in one day folder (ends at the first name with neither an entry
    nor a reason file; each name tried is one that is there). OSError if it cannot be
    searched."""
    for n in itertools.count():
        dst = _candidate(day, name, n)
        if _exists(dst):
            if _same_entry(dst, st):
                return dst
            continue
        mine = _reserved_for(dst, st)
        if mine is None:
            return None
        if mine:
            return dst
    raise AssertionError("unreachable")  # pragma: no cover


def day_folders(root: Path) -> list[Path]:
    """The day folders of ``root`` (``processed_dir``, ``quarantine_dir``), oldest first: the
    folders named by :data:`DAY_RE`, nothing else there (``lost+found``, an operator's)."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if DAY_RE.fullmatch(d.name) and d.is_dir())


def _create_new(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` if nothing is there (temp, fsync, rename without replace,
    fsync the folder); False, and nothing changed, if ``path`` exists."""
    tmp = tmp_path_for(path)
    try:
        write_new_file(tmp, data)
        rename_noreplace(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def _same_entry(path: Path, st: os.stat_result) -> bool:
    try:
        return os.path.samestat(os.lstat(path), st)
    except FileNotFoundError:
        return False


_NOT_REGULAR = (errno.ELOOP, errno.ENXIO)
"""What opening a non-regular file answers: a symlink (O_NOFOLLOW), a socket."""


def _open_regular(path: Path) -> int | None:
    """An fd on ``path`` if it is a regular file (never following a symlink, never blocking
    on a fifo); None if it is gone or something else. OSError when it cannot be opened for
    another reason (EACCES, EIO): never a None that would pass for "not a file"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in _NOT_REGULAR:
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _hash_fd(fd: int) -> str:
    h = hashlib.sha256()
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
    return h.hexdigest()


def sha256_regular(path: Path) -> str | None:
    """The SHA-256 of ``path`` if it is a regular file, read without following a symlink or
    blocking on a fifo; None for anything else (a link, fifo or device is never read) or if
    it is gone. OSError when a regular file cannot be read (EACCES, EIO)."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        return _hash_fd(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: Path, *, want_hash: bool) -> str | None:
    """fsync a regular file (and its sha256 if asked); None for anything else, or for a file
    that cannot be opened (it is moved as it is, without a hash)."""
    try:
        fd = _open_regular(path)
    except OSError:
        return None
    if fd is None:
        return None
    try:
        digest = _hash_fd(fd) if want_hash else None
        os.fsync(fd)
        return digest
    finally:
        os.close(fd)


class _Taken(Exception):
    """The name's reason file belongs to another entry: the next name is tried."""


class _Reason:
    """The reason file of one quarantine: created beside the name the entry gets, never over
    another entry's; ``placed`` runs once it is in place, ``unplaced`` if the OS then refuses
    the rename."""

    def __init__(
        self,
        record: dict[str, Any],
        st: os.stat_result,
        placed: Callable[[Path], None] | None,
        unplaced: Callable[[Path], None] | None = None,
    ) -> None:
        self.record = record
        self.st = st
        self.placed = placed
        self.unplaced = unplaced

    @staticmethod
    def path(dst: Path) -> Path:
        return dst.with_name(dst.name + REASON_SUFFIX)

    def _data(self, dst: Path, *, pending: bool) -> bytes:
        rec = {**self.record, "stored_as": dst.name}
        if pending:
            rec[PENDING_KEY] = move_id(self.st)
        return json.dumps(rec, sort_keys=True, default=str, indent=1).encode()

    def _done(self, dst: Path) -> None:
        if self.placed is not None:
            self.placed(dst)

    def reserve(self, dst: Path) -> None:
        """Before renaming the entry to ``dst``: its reason file, marked pending (or this same
        move's pending one, left by an interrupted call), then ``placed``. _Taken if the name
        has any other reason file."""
        if not _create_new(self.path(dst), self._data(dst, pending=True)):
            if _reserved_for(dst, self.st) is not True:
                raise _Taken(str(dst))
        self._done(dst)

    def release(self, dst: Path) -> None:
        """The OS refused the rename to ``dst`` (nothing moved): what ``placed`` recorded is
        undone (``unplaced``), then the reservation, while it is still this move's. A crash
        between leaves the reservation alone, which the next call honours and releases."""
        if self.unplaced is not None:
            self.unplaced(dst)
        if _reserved_for(dst, self.st) is True:
            self.path(dst).unlink(missing_ok=True)
            fsync_dir(dst.parent)

    def renamed(self, dst: Path) -> None:
        """The rename is done: the reservation is cleared (the reason file is this move's)."""
        atomic_write_bytes(self.path(dst), self._data(dst, pending=False))

    def linked(self, dst: Path, *, fresh: bool) -> None:
        """After linking the entry to ``dst``: its reason file, then ``placed``. A reason file
        already there is kept: an interrupted call's own when the link is not ``fresh`` (it
        was found, same inode), else another entry's (_Taken: the link is undone)."""
        if not _create_new(self.path(dst), self._data(dst, pending=False)) and fresh:
            raise _Taken(str(dst))
        self._done(dst)


class Evidence:
    """Moves files that red has judged: kept (processed) or quarantined (with a reason)."""

    def __init__(self, processed_dir: Path, quarantine_dir: Path) -> None:
        self.processed_dir = Path(processed_dir)
        self.quarantine_dir = Path(quarantine_dir)
        self._unsearchable: set[Path] = set()
        """Day folders found that red may not search (warned once each)."""

    def ensure_dirs(self) -> None:
        """Create both folders (durably) if they are missing."""
        durable_mkdir(self.processed_dir)
        durable_mkdir(self.quarantine_dir)

    # -- public ---------------------------------------------------------------------------
    def processed(self, src: Path, name: str, at: datetime) -> Path | None:
        """Move ``src`` to ``processed_dir/<day of at>/<name>`` (``<name>.<n>`` if taken).

        Returns where it went; None when ``src`` is gone already (moved by an earlier call)."""
        src = Path(src)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return None
        _fsync_and_hash(src, want_hash=False)
        folder = durable_mkdir(self.processed_dir / _day(at))
        dst = self._place(src, st, folder, _stored_name(name))
        self._drop_source(src, st)
        log_event(log, 10, "file processed", file_name=name, path=str(dst))
        return dst

    def quarantine(
        self,
        src: Path,
        name: str,
        reason: str,
        detail: dict[str, Any],
        at: datetime,
        *,
        placed: Callable[[Path], None] | None = None,
        unplaced: Callable[[Path], None] | None = None,
        original_name: str | None = None,
    ) -> Path | None:
        """Move ``src`` to ``quarantine_dir/<day of at>/<name>`` (``<name>.<n>`` if taken; a
        name that is not a plain file name is stored under its :func:`safe_name`) and write
        ``<that name>.reason.json`` beside it (reason, detail, ``original_name``, at, file
        type, size, sha256 of a regular file; ``stored_as`` is the name it got). None when
        ``src`` is gone already.

        ``original_name`` is the name the file arrived under, as printable text
        (:func:`shown_name` of its bytes): ``name`` unless given (the intake stores a name
        that is not a wire name under a safe name of its own, and gives the one it arrived
        under here).

        A name whose reason file exists without its entry is not free: a file re-injected
        from the quarantine (its reason file kept) and refused again gets a name of its own,
        under the day of this ``at``, with its own reason file; the first stays as it was.

        ``placed(dst)`` runs once the reason file is in place and before ``src`` is dropped:
        what it records durably is never missing for a quarantined file. A hard link comes
        first (a crash before the drop leaves ``src``, and the next call reuses the link); an
        entry that must be renamed (a directory, a file ``protected_hardlinks`` will not link)
        gets its reason file (marked ``pending_move``) and ``placed`` before the rename, which
        reserves the name for the next call if a crash comes between; the mark is cleared
        once the rename is done.

        :class:`Unmovable` if the OS refuses the move (the entry is immutable, a folder of
        another owner, a mount point): ``unplaced(dst)`` undoes what ``placed`` recorded, the
        reason file goes, and ``src`` stays as it was."""
        src = Path(src)
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return None
        digest = _fsync_and_hash(src, want_hash=True)
        folder = durable_mkdir(self.quarantine_dir / _day(at))
        record = {
            "reason": reason,
            "detail": detail,
            "original_name": name if original_name is None else original_name,
            "at": _utc(at).isoformat(),
            "file_type": file_kind(st.st_mode),
            "size": st.st_size,
            "sha256": digest,
            "inode": _inode(st),
        }
        if stat.S_ISLNK(st.st_mode):
            record["link_target"] = ascii(os.readlink(os.fsencode(src)))
        reason_file = _Reason(record, st, placed, unplaced)
        dst = self._place(src, st, folder, _stored_name(name), reason_file)
        crash_point("red.quarantine_before_drop")
        self._drop_source(src, st)
        log_event(
            log, 30, "file quarantined", file_name=name, reason=reason, path=str(dst),
            file_type=record["file_type"],
        )  # fmt: skip
        return dst

    # -- moves ----------------------------------------------------------------------------
    def _place(
        self,
        src: Path,
        st: os.stat_result,
        folder: Path,
        name: str,
        reason: _Reason | None = None,
    ) -> Path:
        """Give ``src``'s entry the first free name ``name``, ``name.1``, ... in ``folder``: no
        entry there and no reason file (a reason file without its entry keeps its name).

        Hard link when possible (``src`` stays until :meth:`_drop_source`), else rename, with
        the reason file reserving the name first. What an interrupted earlier call left (a
        link to the same inode, or a name its pending reason file reserved) is reused,
        whichever day's folder it is in (a retry after midnight UTC must not place the file a
        second time). StateError, naming both, if a folder cannot be searched or written."""
        try:
            return self._first_free(src, st, folder, name, reason)
        except OSError as e:  # a folder red may not search: never taken for a free name
            raise move_error(src, Path(os.fsdecode(e.filename or folder / name)), e) from e

    def _first_free(
        self, src: Path, st: os.stat_result, folder: Path, name: str, reason: _Reason | None
    ) -> Path:
        """:meth:`_place`; OSError if a folder cannot be searched."""
        linkable = not stat.S_ISDIR(st.st_mode)
        if not linkable or st.st_nlink > 1:
            earlier = self._earlier_place(folder.parent, name, st)
            if earlier is not None:
                return self._resume(src, earlier, reason)
        for n in itertools.count():
            dst = _candidate(folder, name, n)
            if not _exists(dst):
                mine = _reserved_for(dst, st)
                if mine:  # this entry's own reservation, its rename interrupted
                    return self._resume(src, dst, reason)
                if mine is False:
                    continue  # another entry's reason file keeps the name
            if linkable:
                try:
                    os.link(src, dst, follow_symlinks=False)
                except FileExistsError:
                    if _same_entry(dst, st):
                        return self._resume(src, dst, reason)
                    continue
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
                        raise move_error(src, dst, e) from e
                    linkable = False  # protected_hardlinks, a foreign owner: rename instead
                    earlier = self._earlier_place(folder.parent, name, st)
                    if earlier is not None:  # a name reserved before an interrupted rename
                        return self._resume(src, earlier, reason)
                else:
                    fsync_dir(folder)
                    try:
                        if reason is not None:
                            reason.linked(dst, fresh=True)
                    except _Taken:  # a reason file appeared meanwhile: undo, next name
                        _unlink_own(dst, st)
                        continue
                    return dst
            if _exists(dst):
                continue
            try:
                return self._rename(src, dst, reason)
            except (FileExistsError, _Taken):
                continue
        raise AssertionError("unreachable")  # pragma: no cover

    def _earlier_place(self, root: Path, name: str, st: os.stat_result) -> Path | None:
        """Where an interrupted earlier move put ``st``'s entry, in any day folder under
        ``root``: its link (same inode), or a name whose reason file reserved it before a
        rename that never happened (then the entry is absent). None if there is neither; a
        reason file kept after its file was re-injected reserves nothing. Only day folders are
        looked into; one red may not search is skipped, with a warning the first time."""
        for day in reversed(day_folders(root)):
            try:
                found = _earlier_in(day, name, st)
            except PermissionError as e:
                if day not in self._unsearchable:
                    self._unsearchable.add(day)
                    log_event(
                        log, 30, "evidence day folder not searchable: skipped", path=str(day),
                        error=e.strerror, uid=os.geteuid(),
                        fix="give red's user read and search permission on it (chmod u+rx, "
                        "or the group red is in), or move it out of this folder",
                    )  # fmt: skip
                continue
            if found is not None:
                return found
        return None

    def _resume(self, src: Path, dst: Path, reason: _Reason | None) -> Path:
        """Finish what an earlier call began at ``dst``: its link is there (the reason file
        is completed if missing), or its reservation waits for the rename."""
        if os.path.lexists(dst):
            if reason is not None:
                reason.linked(dst, fresh=False)
            return dst
        return self._rename(src, dst, reason)

    @staticmethod
    def _rename(src: Path, dst: Path, reason: _Reason | None) -> Path:
        if reason is not None:
            reason.reserve(dst)
            crash_point("red.evidence_before_rename")
        try:
            rename_noreplace(src, dst)
        except FileExistsError:
            raise
        except OSError as e:
            if reason is not None and e.errno in _REFUSED:  # nothing moved: nothing reserved
                reason.release(dst)
            raise move_error(src, dst, e) from e
        fsync_dir(dst.parent)
        fsync_dir(src.parent)
        if reason is not None:
            reason.renamed(dst)
        return dst

    @staticmethod
    def _drop_source(src: Path, st: os.stat_result) -> None:
        """Unlink ``src`` if it is still the entry that was linked away (after a rename it is
        gone; if a new file took the name meanwhile, it is left alone)."""
        if not _same_entry(src, st):
            return
        if stat.S_ISDIR(st.st_mode):  # pragma: no cover - directories are renamed, not linked
            return
        os.unlink(src)
        fsync_dir(src.parent)


def _unlink_own(dst: Path, st: os.stat_result) -> None:
    """Remove the link this call just made at ``dst`` (only if it is still that entry)."""
    if _same_entry(dst, st):
        os.unlink(dst)
        fsync_dir(dst.parent)


def move_error(src: Path, dst: Path, e: OSError) -> StateError:
    """Why ``src`` could not be moved to ``dst``: :class:`Unmovable` when the OS refused it and
    both folders are ones red may write (the entry's own trouble), else a StateError with
    what to fix."""
    what = f"cannot move {ascii(str(src))} to {dst}: {e.strerror or e}"
    if e.errno == errno.EXDEV:
        return StateError(
            f"{what}; processed_dir / quarantine_dir must be on the file system of the inbox"
        )
    if e.errno in _REFUSED:
        for folder in (src.parent, dst.parent):
            if not os.access(folder, os.W_OK | os.X_OK) or append_only_refusal(folder):
                return StateError(
                    f"{what}; red's user (uid {os.geteuid()}) needs write and search "
                    f"permission on {folder}: give it (chmod, chattr -i -a), or point the red "
                    "directory elsewhere"
                )
        return Unmovable(
            f"{what}; the entry itself refuses to move (immutable or append-only: lsattr -d; "
            "a folder of another owner; a mount point): it stays where it is until fixed "
            "(chattr -i -a, chown to red's user, umount) or removed",
            src,
            e.errno or 0,
        )
    return StateError(what)


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _day(at: datetime) -> str:
    return _utc(at).strftime("%Y-%m-%d")
