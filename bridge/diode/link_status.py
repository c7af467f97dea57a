"""Diode, UDP (both sides): the link as the sender and the receiver last reported it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from bridge.config import Config
from bridge.fsutil import lock_held

__all__ = [
    "gap_objects",
    "link_status",
    "read_json",
    "read_gap_records",
    "read_new_gap_records",
    "read_status",
]

SENDER_LOCK = "send.lock"
RECEIVER_LOCK = "receive.lock"
"""Held (flock) by a running `diode udp send` in its state_dir / `diode udp receive` in its
spool_dir: released by the kernel when the process ends, however it ends."""


def read_json(path: Path) -> dict[str, Any] | None:
    """A status file written atomically by a sender or receiver; None when absent or torn
    (:func:`read_status` without the reason)."""
    return read_status(path)[0]


def read_status(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(doc, None)``, ``(None, None)`` when there is no file, or ``(None, why)`` when the
    file is there but unreadable or not a JSON object (a damaged file is not a missing one)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable: {e}"
    try:
        doc = json.loads(raw)
    except ValueError as e:
        return None, f"not JSON: {e}"
    if not isinstance(doc, dict):
        return None, f"not a JSON object: {type(doc).__name__}"
    return doc, None


def _end(status: Path, lock: Path, now: float) -> dict[str, Any] | None:
    """One end of the link as of ``now``: its status file, whether it runs (its lock is held),
    how old the file is (wall clock: ``written_at`` is the writer's ``time.time()``)."""
    doc, damaged = read_status(status)
    running = lock_held(lock)
    if doc is None:
        if damaged is None and not running:
            return None  # never ran here
        return {"running": running, "damaged": damaged, "path": str(status)}
    doc["running"] = running  # a stopped or killed end leaves a status file that looks fresh
    written = doc.get("written_at")
    if isinstance(written, int | float) and not isinstance(written, bool):
        doc["age_seconds"] = round(max(now - written, 0.0), 1)  # a clock set back: not < 0
    return doc


def read_gap_records(spool_dir: Path) -> list[dict[str, Any]]:
    """The receiver's gap records (``gaps.jsonl``): objects expired before they completed."""
    path = Path(spool_dir) / "gaps.jsonl"
    out: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # a torn last line after a crash: the record was not durable
        if isinstance(doc, dict):
            out.append(doc)
    return out


def gap_objects(records: list[dict[str, Any]]) -> int:
    """How many objects ``records`` give up: one a record, except an ``unseen`` range record,
    which names its count (``objects``)."""
    n = 0
    for r in records:
        count = r.get("objects")
        n += count if type(count) is int and count > 0 else 1
    return n


MAX_GAP_RECORD_BYTES = 1 << 16
"""A gap record is a few hundred bytes; a longer line is skipped, never waited on."""


def _line_ends_at(f: BinaryIO, offset: int) -> bool:
    """Whether a record ends right before ``offset`` (the start, or a newline there): what
    was consumed ends there in the file red read before. A replaced file that has already
    grown past ``offset`` almost never has its newline at that very byte."""
    if offset == 0:
        return True
    f.seek(offset - 1)
    return f.read(1) == b"\n"


def read_new_gap_records(
    spool_dir: Path, offset: int, *, limit: int = 10_000
) -> tuple[list[dict[str, Any]], int, bool]:
    """Gap records appended to ``gaps.jsonl`` since byte ``offset``: ``(records, new_offset,
    restarted)``. Only complete lines are consumed (a line being written is read next time);
    a line that is not a JSON object is skipped. A file shorter than ``offset``, or with no
    record ending there, was replaced (a new spool): it is read from the start and
    ``restarted`` says so. At most ``limit``
    records per call, so memory stays bounded whatever the file holds."""
    path = Path(spool_dir) / "gaps.jsonl"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            restarted = size < offset or not _line_ends_at(f, offset)
            if restarted:
                offset = 0
            f.seek(offset)
            out: list[dict[str, Any]] = []
            while len(out) < limit:
                line = f.readline(MAX_GAP_RECORD_BYTES)
                if not line.endswith(b"\n"):
                    if len(line) < MAX_GAP_RECORD_BYTES:
                        break  # not complete yet: read next time
                    start = offset
                    while line and not line.endswith(b"\n"):  # no record is this long: skip
                        offset += len(line)
                        line = f.readline(MAX_GAP_RECORD_BYTES)
                    if not line:
                        offset = start  # not complete yet: consumed once its newline is there
                        break
                    offset += len(line)
                    continue
                offset += len(line)
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # a torn record a crash left behind: it was never durable
                if isinstance(doc, dict):
                    out.append(doc)
    except FileNotFoundError:
        return [], offset, False
    return out, offset, restarted


def link_status(cfg: Config) -> dict[str, Any]:
    """What this host knows of the link: the sender's (black) and/or receiver's (red) view.
    Each end is None where it never ran, else its last status with ``running`` (its lock is
    held now) and ``age_seconds``; a damaged status file is ``damaged``, not absent. A file
    link when no channel uses UDP and neither end ever ran here (an example's [udp] kept)."""
    if cfg.udp is None:
        return {"transport": "file", "udp": None}
    now = time.time()
    state, spool = Path(cfg.udp.send.state_dir), Path(cfg.udp.receive.spool_dir)
    send = _end(state / "status.json", state / SENDER_LOCK, now)
    recv = _end(spool / "status.json", spool / RECEIVER_LOCK, now)
    heard = recv.get("heartbeat_age_seconds") if recv is not None else None
    if recv is not None and isinstance(heard, int | float) and "age_seconds" in recv:
        # as of now, not of the receiver's last status write (a dead receiver writes none)
        recv["heartbeat_age_seconds"] = round(heard + recv["age_seconds"], 1)
    if not cfg.udp_channels() and send is None and recv is None:
        return {"transport": "file", "udp": None}  # [udp] configured, never used here
    gaps = read_gap_records(Path(cfg.udp.receive.spool_dir))
    return {
        "transport": "udp",
        "channels": cfg.udp_channels(),
        "sender": send,
        "receiver": recv,
        "gaps": gaps[-100:],
        "gaps_total": len(gaps),
        "gap_objects_total": gap_objects(gaps),
    }
