"""Diode, UDP (both sides): the link as the sender and the receiver last reported it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

from bridge.config import Config

__all__ = ["gap_objects", "link_status", "read_json", "read_gap_records", "read_new_gap_records"]


def read_json(path: Path) -> dict[str, Any] | None:
    """A status file written atomically by a sender or receiver; None when absent or torn."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


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
    """What this host knows of the link: the sender's (black) and/or receiver's (red) view."""
    if cfg.udp is None:
        return {"transport": "file", "udp": None}
    now = time.time()
    send = read_json(Path(cfg.udp.send.state_dir) / "status.json")
    recv = read_json(Path(cfg.udp.receive.spool_dir) / "status.json")
    for doc in (send, recv):
        if doc is not None and isinstance(doc.get("written_at"), int | float):
            doc["age_seconds"] = round(now - doc["written_at"], 1)
    heard = recv.get("heartbeat_age_seconds") if recv is not None else None
    if recv is not None and isinstance(heard, int | float) and "age_seconds" in recv:
        # as of now, not of the receiver's last status write (a dead receiver writes none)
        recv["heartbeat_age_seconds"] = round(heard + max(recv["age_seconds"], 0.0), 1)
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
