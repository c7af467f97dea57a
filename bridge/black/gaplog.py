"""Black, journal: the per-channel log of message seq ranges known lost (``diode gaps``).

One JSON line per range, appended and fsynced when the bundle that declares it is committed:
``{"kind", "bundle_seq", "first_seq", "last_seq", "reason", "at"}``; ``kind`` is ``lost`` (a
gap: the messages are not in any bundle) or ``inexact`` (carried, but not byte-exact as
published). A crash between the append and the journal commit can repeat a line; readers
de-duplicate on ``(kind, bundle_seq, first_seq)``. A power loss mid-append can leave a torn
last line: the next append starts on a line of its own, so only the torn line is lost (and
the bundle's commit, repeated at the restart, appends it again). An append that fails is cut
back off: each append is all or nothing. A reader skips and counts every line that is not a
whole record (torn, damaged, edited by hand): nothing is coerced.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.fsutil import write_all
from bridge.logs import get_logger, log_event
from bridge.protocol.manifest import Gap

__all__ = ["GapLog", "append_gaps", "gap_log_path", "read_gap_log", "read_gaps"]

log = get_logger("bridge.black.gaplog")


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


@dataclass(frozen=True)
class GapLog:
    """What :func:`read_gap_log` found: the ranges, and the lines it had to skip."""

    ranges: list[dict[str, Any]]
    """Every range in seq order, de-duplicated."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Line number (1-based) -> why it was skipped (torn, not an object, a bad field)."""


_SEQS = ("bundle_seq", "first_seq", "last_seq")
_JSON_TYPES = {type(None): "null", list: "array", str: "string", int: "number",
               float: "number", bool: "boolean"}  # fmt: skip


def _record(line: str) -> dict[str, Any] | str:
    """One gap-log line as a record, or why it is not one (nothing is coerced)."""
    try:
        d = json.loads(line)
    except ValueError:
        return "not JSON (torn by a power loss?)"
    if not isinstance(d, dict):
        return f"not a JSON object (a JSON {_JSON_TYPES.get(type(d), type(d).__name__)})"
    d.setdefault("kind", "lost")  # lines written before kinds existed
    if not isinstance(d["kind"], str):
        return "kind is not a string"
    bad = [k for k in _SEQS if type(d.get(k)) is not int or d[k] < 0]
    if bad:
        return f"{', '.join(bad)} not an integer >= 0"
    if d["first_seq"] > d["last_seq"]:
        return "first_seq above last_seq"
    return d


def read_gap_log(state_dir: Path, channel: str) -> GapLog:
    """Every gap of ``channel`` in seq order; a line that is not a whole record (torn by a
    power loss, damaged, edited) is skipped and reported in ``skipped``."""
    p = gap_log_path(state_dir, channel)
    if not p.exists():
        return GapLog([])
    seen: dict[tuple[str, int, int], dict[str, Any]] = {}
    skipped: dict[int, str] = {}
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        d = _record(line)
        if isinstance(d, str):
            skipped[n] = d
            continue
        seen.setdefault((d["kind"], d["bundle_seq"], d["first_seq"]), d)
    ranges = sorted(seen.values(), key=lambda d: (d["first_seq"], d["bundle_seq"]))
    return GapLog(ranges, skipped)


def read_gaps(state_dir: Path, channel: str) -> list[dict[str, Any]]:
    """:func:`read_gap_log`'s ranges; skipped lines are counted in a warning naming the file
    and the lines."""
    got = read_gap_log(state_dir, channel)
    if got.skipped:
        shown = "; ".join(f"line {n}: {why}" for n, why in list(got.skipped.items())[:5])
        more = f"; and {len(got.skipped) - 5} more" if len(got.skipped) > 5 else ""
        log_event(
            log, logging.WARNING,
            f"gap log {gap_log_path(state_dir, channel)}: {len(got.skipped)} line(s) are not "
            f"gap records and were skipped ({shown}{more}); the ranges they held are not shown "
            "(the journal's lost_* counters still count them)",
            channel=channel, skipped=len(got.skipped),
        )  # fmt: skip
    return got.ranges
