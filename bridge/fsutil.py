"""Both sides: durable file writes (temp name, fsync, rename) and conservative names."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["atomic_write_bytes", "fsync_dir", "durable_rename", "tmp_path_for"]


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
