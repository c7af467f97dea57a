"""Demo, diode: a stand-in for a vendor's hot-folder mover (black outbox/ -> red inbox/).

A real installation has a hardware diode and its vendor's software here. This mover does what
the greedy ones do: it takes every complete file that appears in the outbox (black only ever
renames complete files into it) and writes it into the inbox *in place* (no temp name), so red
must wait for the file to settle, as it would in the field.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from bridge.fsutil import durable_mkdir, fsync_dir

__all__ = ["MoveReport", "move_outbox"]


@dataclass
class MoveReport:
    files: int = 0
    bytes: int = 0


def move_outbox(outbox: Path, inbox: Path) -> MoveReport:
    """Move every file of ``outbox`` into ``inbox`` (bundles first, in name order)."""
    durable_mkdir(inbox)
    rep = MoveReport()
    names = sorted(
        (p for p in outbox.iterdir() if p.is_file() and not p.name.startswith(".")),
        key=lambda p: (p.suffix != ".dbundle", p.name),
    )
    for src in names:
        dst = inbox / src.name
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        rep.files += 1
        rep.bytes += dst.stat().st_size
        src.unlink()
    fsync_dir(inbox)
    return rep
