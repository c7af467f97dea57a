"""Both sides: durable files and directories (temp name, fsync, rename), modes, and file locks."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge.errors import StateError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "WRITE_PROBE",
    "append_only_refusal",
    "atomic_write_bytes",
    "durable_mkdir",
    "durable_rename",
    "exclusive_lock",
    "fsync_dir",
    "lock_held",
    "os_error_text",
    "pwritev_all",
    "shared_lock",
    "tmp_path_for",
    "write_all",
    "write_new_file",
    "write_refusal",
]

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Buffers one pwritev call takes at most."""

DIR_MODE = 0o750
"""Directories the bridge creates: the owner writes, its group (e.g. the mover's) reads."""
FILE_MODE = 0o640
"""Files the bridge writes: the owner writes, its group reads, others nothing."""


def os_error_text(e: OSError) -> str:
    """``e``'s reason with its errno's name, e.g. ``Permission denied (EACCES)``."""
    code = e.errno if e.errno is not None else 0
    return f"{e.strerror or e} ({errno.errorcode.get(code, code)})"


WRITE_PROBE = "write-probe"
"""Base name of the file a create-and-unlink write check makes (:func:`write_refusal`)."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})
"""O_TMPFILE unsupported (a file system without it; EISDIR: a kernel without it)."""
_FS_IOC_GETFLAGS = (2 << 30) | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
"""``_IOR('f', 1, long)``: read an inode's attribute flags (lsattr). Where the number differs
(ppc, mips, sparc) the kernel answers ENOTTY: the attribute is not known, not assumed."""
_FS_APPEND_FL = 0x20

_RUN_HINT = (
    "two black jobs must never share a state_dir (they would fork the bundle chain). "
    "Stop the other job first"
)
_POLL_FIRST, _POLL_MAX = 0.001, 0.05  # seconds between tries while waiting for a lock
LOCK_POLL_MAX_S = _POLL_MAX
"""The longest a process waiting for a lock (``timeout`` > 0) sleeps between two tries: a holder
that lets go for longer than this lets the waiter in."""


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_mkdir(path: Path, *, mode: int = DIR_MODE) -> Path:
    """Create ``path`` and its missing parents with exactly ``mode``; each new one is fsynced in
    its parent, so a crash cannot lose a directory that files were durably written into.

    An existing directory is left as it is (mode included); returns ``path``.
    """
    path = Path(path)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a directory") from None
        return path
    except FileNotFoundError:
        durable_mkdir(path.parent, mode=mode)
        try:
            os.mkdir(path, mode)
        except FileExistsError:  # created meanwhile by another process
            if not path.is_dir():
                raise NotADirectoryError(f"{path} exists and is not a directory") from None
            fsync_dir(path.parent)
            return path
    os.chmod(path, mode)  # mkdir's mode is masked by the umask
    fsync_dir(path.parent)
    return path


def tmp_path_for(final: Path) -> Path:
    """A hidden, unique temporary name beside ``final``: ``.<name>.<12 hex>.tmp``."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")


def durable_rename(src: Path, dst: Path) -> None:
    """fsync ``src``, rename it to ``dst`` atomically, fsync the folder."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    fsync_dir(dst.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than it is given)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # never loop on a descriptor that takes nothing
            raise OSError(errno.ENOSPC, f"write of {len(view)} bytes took none")
        view = view[n:]


def pwritev_all(fd: int, chunks: list[Any], offset: int) -> int:
    """Write every chunk at ``offset`` (looping over short writes); returns the end offset.
    OSError, never a loop, when the descriptor takes nothing."""
    i = 0
    while i < len(chunks):
        n = os.pwritev(fd, chunks[i : i + _IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while n:
            size = len(chunks[i])
            if n >= size:
                n -= size
                i += 1
            else:
                chunks[i] = chunks[i][n:]
                n = 0
        while i < len(chunks) and len(chunks[i]) == 0:
            i += 1
    return offset


def write_new_file(path: Path, data: bytes, *, mode: int = FILE_MODE) -> None:
    """Create ``path`` (it must not exist) with exactly ``mode``, write ``data``, fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not decide
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(final: Path, data: bytes, *, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``final`` (file mode ``mode``) so readers see the whole file or nothing.

    The folder is created durably if missing; the temp file is removed if anything fails.
    """
    final = Path(final)
    durable_mkdir(final.parent)
    tmp = tmp_path_for(final)
    try:
        write_new_file(tmp, data, mode=mode)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def _try_lock(fd: int, op: int, timeout: float) -> bool:
    """flock ``fd`` with ``op``, retrying with a growing pause for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pause = _POLL_FIRST
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)


@contextlib.contextmanager
def _flock(path: Path, op: int, what: str, timeout: float, hint: str) -> Iterator[None]:
    path = Path(path)
    durable_mkdir(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        if not _try_lock(fd, op, timeout):
            kind = "an exclusive" if op == fcntl.LOCK_EX else "a shared"
            waited = f"waited {timeout:g}s for {kind} lock on {path}, " if timeout > 0 else ""
            raise StateError(
                f"{what}: {waited}another process holds {path}; {hint} "
                f"(`fuser -v {path}` shows who holds it)"
            )
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def exclusive_lock(
    path: Path, *, what: str, timeout: float = 0.0, hint: str = _RUN_HINT
) -> contextlib.AbstractContextManager[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing).

    ``timeout`` 0 (the default) refuses at once if the lock is taken; otherwise waits up to
    ``timeout`` seconds. Either way a StateError names the lock, says what waited and adds
    ``hint`` (how to fix). The kernel drops the lock when the holder dies, so a kill -9 never
    leaves it stale. Locks are per open: two holders in one process exclude each other too.
    """
    return _flock(path, fcntl.LOCK_EX, what, timeout, hint)


def shared_lock(
    path: Path, *, what: str, timeout: float = 0.0, hint: str = "retry once it is free"
) -> contextlib.AbstractContextManager[None]:
    """Like :func:`exclusive_lock`, shared: any number of shared holders, no exclusive one."""
    return _flock(path, fcntl.LOCK_SH, what, timeout, hint)


def lock_held(path: Path) -> bool:
    """Whether another open holds an exclusive ``flock`` on ``path`` now (a running job).
    Creates nothing: a missing file is a lock nobody holds. Reports use it; never decide to
    write on it (the answer can change the next moment — take the lock instead)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock taken just now
    return False


def write_refusal(d: Path, *, visible: bool = False) -> OSError | None:
    """Why this process cannot create, rename away and remove files in directory ``d``, or None.

    ``visible=False`` (drop dirs and inboxes, where a mover or the intake takes any file,
    dot-files included): nothing appears in ``d``: an unnamed ``O_TMPFILE`` file, freed on
    close, which the kernel refuses as it would a new file (EACCES, EPERM for an immutable
    directory even for root, EROFS); where the file system has no ``O_TMPFILE``, access(2)
    answers. Then the append-only attribute (:func:`append_only_refusal`), which lets files in
    but never out. ``visible=True`` (the bridge's own dirs: no mover looks there): also a temp
    name ``.write-probe.<12 hex>.tmp`` created and unlinked, which sees what the others cannot
    (a server squashing root, a full inode table).
    """
    refused = _unnamed_refusal(d) or append_only_refusal(d)
    if refused is not None or not visible:
        return refused
    probe = tmp_path_for(Path(d) / WRITE_PROBE)
    try:
        os.close(os.open(probe, _CREATE, FILE_MODE))
        os.unlink(probe)
    except OSError as e:
        return e
    return None


def _unnamed_refusal(d: Path) -> OSError | None:
    try:
        fd = os.open(d, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno not in _NO_TMPFILE:
            return e
    else:
        os.close(fd)
        return None
    if os.access(d, os.W_OK | os.X_OK):
        return None
    code = errno.EROFS if _read_only(d) else errno.EACCES
    return OSError(code, os.strerror(code), os.fspath(d))


def _read_only(d: Path) -> bool:
    try:
        return bool(os.statvfs(d).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def append_only_refusal(d: Path) -> OSError | None:
    """EPERM if directory ``d`` has the append-only attribute (``chattr +a``): files can be
    created there but never renamed away or removed, which the bridge does in every dir it
    writes. Read from the attribute, so no probe file is stranded there; None if not, or where
    the file system does not say."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # the write probe answers for a directory that cannot even be opened
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
    except OSError:
        return None
    finally:
        os.close(fd)
    if int.from_bytes(buf[:4], sys.byteorder) & _FS_APPEND_FL:
        why = "append-only attribute: files come in, none can leave"
        return OSError(errno.EPERM, why, os.fspath(d))
    return None
