"""Both sides: durable file writes (temp name, fsync, rename) and conservative names."""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from bridge.errors import StateError

__all__ = [
    "atomic_write_bytes",
    "durable_rename",
    "exclusive_lock",
    "fsync_dir",
    "tmp_path_for",
]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path_for(final: Path) -> Path:
    """A hidden temporary name beside ``final`` that no mover or watcher picks up."""
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


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` so readers see the whole file or nothing."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(final)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def exclusive_lock(path: Path, *, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing); StateError if taken.

    The kernel drops the lock when the process dies, so a kill -9 never leaves it stale.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateError(
                f"{what}: another process holds {path}; two black jobs must never share a "
                "state_dir (they would fork the bundle chain). Stop the other job first"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
