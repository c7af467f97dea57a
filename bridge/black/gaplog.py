"""Black, journal: the per-channel log of message seq ranges known lost (``diode gaps``).

One JSON line per range, appended and fsynced when the bundle that declares it is committed:
``{"kind", "bundle_seq", "first_seq", "last_seq", "reason", "at"}``; ``kind`` is ``lost`` (a
gap: the messages are not in any bundle) or ``inexact`` (carried, but not byte-exact as
published). A crash between the append and the journal commit can repeat a line; readers
de-duplicate on ``(kind, bundle_seq, first_seq)``. A power loss mid-append can leave a torn
last line: the next append starts on a line of its own, so only the torn line is lost (and
the bundle's commit, repeated at the restart, appends it again). An append that fails is cut
back off: each append is all or nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bridge.fsutil import write_all
from bridge.protocol.manifest import Gap

__all__ = ["append_gaps", "read_gaps", "gap_log_path"]


def gap_log_path(state_dir: Path, channel: str) -> Path:
    return Path(state_dir) / f"gaps-{channel}.jsonl"


def append_gaps(
    state_dir: Path, channel: str, bundle_seq: int, gaps: tuple[Gap, ...], *, kind: str = "lost"
) -> None:
    """Durably append the ranges a bundle declares (no-op without any)."""
    if not gaps:
        return
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = "".join(
        json.dumps(
            {
                "kind": kind,
                "bundle_seq": bundle_seq,
                "first_seq": g.first_seq,
                "last_seq": g.last_seq,
                "reason": g.reason,
                "at": now,
            },
            sort_keys=True,
        )
        + "\n"
        for g in gaps
    ).encode()
    fd = os.open(gap_log_path(state_dir, channel), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":
            data = b"\n" + data  # a torn last line (power loss mid-append) ends before ours
        try:
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, end)  # no part of this append stays
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def read_gaps(state_dir: Path, channel: str) -> list[dict[str, Any]]:
    """Every gap of ``channel`` in seq order (a torn line, from a power loss, is skipped)."""
    p = gap_log_path(state_dir, channel)
    if not p.exists():
        return []
    seen: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in p.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
            d.setdefault("kind", "lost")
            key = (str(d["kind"]), int(d["bundle_seq"]), int(d["first_seq"]))
        except (ValueError, KeyError, TypeError):
            continue
        seen.setdefault(key, d)
    return sorted(seen.values(), key=lambda d: (d["first_seq"], d["bundle_seq"]))
