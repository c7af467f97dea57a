"""Red, operator: what red quarantined — `diode quarantine list` and `show`, from the evidence.

    quarantine_dir/<YYYY-MM-DD>/<stored name>  +  <stored name>.reason.json

Read-only and without Spark: the reason files say why; ``show`` also checks that the file is
still the one quarantined (its SHA-256 against the recorded one) and gathers its ``audit`` rows.
A quarantined file without a readable reason file (a crash between the move and the reason's
write, or a damaged reason file) is listed with the reason ``no_reason_file`` or
``unreadable_reason_file``: never left out. A reason file whose file is gone (re-injected into
the inbox, runbook §12.2, or a move a crash interrupted before its rename) is listed too, with
``file_gone``; the summary counts it apart. For the latter ``pending_move`` says whether the
move is still pending: true (``pending_at``: the inbox or intake still holds that very entry,
same device, inode and ctime, and the next red run finishes the move), false (no entry there
is it any more: removed, moved or changed, so nothing will finish it), null (the inbox or
intake could not be listed to tell).

``stored_as`` is the name in the quarantine folder (what ``show`` takes); ``original_name`` the
name the file arrived under, printable (``evidence.shown_name``: the intake stores a name that
is not a wire name under a safe one). A reason file written before the intake recorded it
(``original_name`` was the safe name) is shown with the name its ``detail.raw_hex`` gives.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads

from bridge.config import Config
from bridge.errors import DiodeError
from bridge.red.evidence import (
    DAY_RE,
    PENDING_KEY,
    REASON_SUFFIX,
    day_folders,
    safe_name,
    sha256_regular,
    shown_name,
    unmoved_entries,
)
from bridge.red.layout import INTAKE_DIR

__all__ = ["QuarantineError", "list_quarantined", "quarantine_summary", "show_quarantined"]


class QuarantineError(DiodeError):
    """The file asked for is not in the quarantine, or the name is ambiguous."""


def _entry(day: Path, stored: Path) -> dict[str, Any]:
    return _read_entry(day, stored)[0]


def _read_entry(day: Path, stored: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The listing entry of one quarantined file, and its reason record (None if unreadable)."""
    reason_file = stored.with_name(stored.name + REASON_SUFFIX)
    entry: dict[str, Any] = {"day": day.name, "stored_as": stored.name, "path": str(stored)}
    try:
        rec = json.loads(reason_file.read_text())
        if not isinstance(rec, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return {**entry, "reason": "no_reason_file"}, None
    except (OSError, ValueError) as e:
        return {**entry, "reason": "unreadable_reason_file", "error": str(e)}, None
    detail = rec.get("detail")
    why = detail.get("why") if isinstance(detail, dict) else None
    return {
        **entry,
        "reason": str(rec.get("reason", "")),
        "original_name": _original_name(rec),
        "at": rec.get("at"),
        "file_type": rec.get("file_type"),
        "size": rec.get("size"),
        "sha256": rec.get("sha256"),
        "why": why,
    }, rec


def _original_name(rec: dict[str, Any]) -> Any:
    """The name a file arrived under: the record's ``original_name``, unless that is only the
    safe name of ``detail.raw_hex`` (an intake record written before the raw name was kept
    there); then the raw name, printable."""
    name = rec.get("original_name")
    detail = rec.get("detail")
    raw_hex = detail.get("raw_hex") if isinstance(detail, dict) else None
    if not isinstance(raw_hex, str):
        return name
    try:
        raw = bytes.fromhex(raw_hex)
    except ValueError:
        return name
    return shown_name(raw) if name == safe_name(raw) else name


class _Unmoved:
    """Red, operator: the inbox and intake entries a pending move could still take
    (``evidence.unmoved_entries``), listed once, when the first pending reason file needs it."""

    def __init__(self, cfg: Config) -> None:
        self.places = (Path(cfg.red.inbox), Path(cfg.red.work_dir) / INTAKE_DIR)
        self._found: dict[str, Path] | None = None
        self._error: str | None = None

    def find(self, mark: str) -> Path | str | None:
        """Where the entry reserved by ``mark`` still waits; None if nowhere (the move can no
        longer happen); a string saying why that cannot be told (a place not readable)."""
        if self._found is None and self._error is None:
            try:
                self._found = unmoved_entries(self.places)
            except OSError as e:
                where = os.fsdecode(e.filename) if e.filename is not None else "inbox or intake"
                self._error = f"{where}: {e.strerror or e}"
        if self._found is None:
            return self._error
        return self._found.get(mark)


def _gone_text(rec: dict[str, Any] | None, unmoved: _Unmoved) -> tuple[str, dict[str, Any]]:
    """Why a reason file is without its file, and the entry fields that say it: a move still
    pending only while the inbox or intake holds that very entry unmoved (device, inode,
    ctime: ``pending_move`` true, ``pending_at`` where); a mark no entry matches can never be
    honoured (``pending_move`` false); null when the places cannot be read."""
    mark = rec.get(PENDING_KEY) if rec is not None else None
    if mark is None:
        return "file gone (re-injected or removed; this reason file is kept as evidence)", {}
    where = unmoved.find(str(mark))
    if isinstance(where, Path):
        return (
            f"move pending: a crash came before the rename; the file waits at {where}, the "
            "next red run moves it here",
            {"pending_move": True, "pending_at": str(where)},
        )
    if where is None:
        return (
            "file gone, move abandoned: a crash came before the rename, and the inbox and "
            "intake no longer hold the file as it was (removed, moved or changed)",
            {"pending_move": False},
        )
    return (
        f"move pending or abandoned: a crash came before the rename; cannot tell which: {where}",
        {"pending_move": None},
    )


def _gone_entry(day: Path, stored: Path, unmoved: _Unmoved) -> dict[str, Any]:
    """The entry of a reason file whose file is no longer beside it: what it recorded, marked
    ``file_gone``; ``why`` says so first (the CLI prints it)."""
    entry, rec = _read_entry(day, stored)
    gone, fields = _gone_text(rec, unmoved)
    why = entry.get("why") or entry.get("error")
    entry.update(file_gone=True, why=f"[{gone}] {why}" if why else f"[{gone}]", **fields)
    return entry


def _day_entries(day: Path, unmoved: _Unmoved) -> list[dict[str, Any]]:
    """Every quarantined file of ``day``, and every reason file whose file is gone."""
    names = {p.name for p in day.iterdir() if not p.name.startswith(".")}
    out = [_entry(day, day / n) for n in names if not n.endswith(REASON_SUFFIX)]
    for n in names:
        stored = n[: -len(REASON_SUFFIX)]
        if n.endswith(REASON_SUFFIX) and stored and stored not in names:
            out.append(_gone_entry(day, day / stored, unmoved))
    return out


def _days(root: Path, since: date | None) -> list[Path]:
    days = day_folders(root)
    return days if since is None else [d for d in days if d.name >= since.isoformat()]


def list_quarantined(
    cfg: Config, *, reason: str | None = None, since: date | None = None
) -> list[dict[str, Any]]:
    """Every quarantined file (oldest day first, then by time), optionally of one reason and
    from one day on; the reason files themselves are not entries, except one whose file is
    gone (an entry with ``file_gone``: a re-injected file's first verdict)."""
    out: list[dict[str, Any]] = []
    unmoved = _Unmoved(cfg)
    for day in _days(Path(cfg.red.quarantine_dir), since):
        entries = _day_entries(day, unmoved)
        entries.sort(key=lambda e: (str(e.get("at") or ""), e["stored_as"]))
        out.extend(e for e in entries if reason is None or e["reason"] == reason)
    return out


def quarantine_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Total and count per reason of :func:`list_quarantined`'s entries whose file is there;
    ``file_gone`` (only when there are any): reason files listed without their file."""
    here = [e for e in entries if not e.get("file_gone")]
    by = Counter(str(e["reason"]) for e in here)
    out: dict[str, Any] = {"total": len(here), "by_reason": dict(sorted(by.items()))}
    if len(entries) > len(here):
        out["file_gone"] = len(entries) - len(here)
    return out


def _audit_rows(cfg: Config, names: list[str]) -> list[dict[str, Any]] | dict[str, str]:
    from bridge.red.job import open_tables

    try:
        rows = open_tables(cfg).read(
            "audit",
            columns=["at", "event", "channel", "bundle_seq", "file_name", "reason", "detail"],
            filter=pads.field("file_name").isin(names),
        )
    except Exception as e:  # noqa: BLE001 - the reason file is the evidence; audit is extra
        return {"error": f"audit table not readable: {type(e).__name__}: {e}"}
    found = sorted(rows.to_pylist(), key=lambda r: (r["at"], r["event"]))
    for r in found:
        r["at"] = r["at"].isoformat() if r["at"] is not None else None
    return found


def show_quarantined(cfg: Config, name: str, *, audit: bool = True) -> dict[str, Any]:
    """One quarantined file by its stored name (``NAME`` or ``DAY/NAME``): its reason record
    in full, whether it is still the file quarantined, and its ``audit`` rows."""
    day_part, _, stored = name.rpartition("/")
    if (
        stored in ("", ".", "..")
        or stored.endswith(REASON_SUFFIX)
        or (day_part and not DAY_RE.fullmatch(day_part))
    ):
        raise QuarantineError(f"{name!r}: give a stored name, or DAY/NAME as listed")
    root = Path(cfg.red.quarantine_dir)
    days = [d for d in _days(root, None) if not day_part or d.name == day_part]
    hits = [d for d in days if os.path.lexists(d / stored)]
    if not hits:  # a reason file kept after its file went (re-injected)
        hits = [d for d in days if (d / (stored + REASON_SUFFIX)).is_file()]
        if len(hits) == 1:
            return _show_gone(cfg, hits[0], stored, audit=audit)
    if not hits:
        raise QuarantineError(
            f"{name!r} is not in the quarantine {root}: `diode quarantine list` shows the names"
        )
    if len(hits) > 1:
        raise QuarantineError(
            f"{name!r} is in the quarantine on {len(hits)} days "
            f"({', '.join(d.name for d in hits)}): give DAY/NAME"
        )
    path = hits[0] / stored
    entry, record = _read_entry(hits[0], path)
    out: dict[str, Any] = {**entry, "record": record}
    try:
        now = sha256_regular(path)
    except OSError as e:  # the file is there but cannot be read: say so, never "unchanged"
        now = None
        out["sha256_error"] = f"{path}: {e.strerror or e}"
    out["sha256_now"] = now
    out["unchanged"] = None if now is None or not out.get("sha256") else now == out["sha256"]
    return _with_audit(cfg, out, stored, audit=audit)


def _show_gone(cfg: Config, day: Path, stored: str, *, audit: bool) -> dict[str, Any]:
    """``show`` of a reason file whose file is gone: its record, nothing to hash."""
    entry = _gone_entry(day, day / stored, _Unmoved(cfg))
    out: dict[str, Any] = {**entry, "record": _read_entry(day, day / stored)[1]}
    out.update(sha256_now=None, unchanged=None)
    return _with_audit(cfg, out, stored, audit=audit)


def _with_audit(cfg: Config, out: dict[str, Any], stored: str, *, audit: bool) -> dict[str, Any]:
    if audit:
        names = sorted({n for n in (stored, out.get("original_name")) if isinstance(n, str)})
        out["audit"] = _audit_rows(cfg, names)
    return out
