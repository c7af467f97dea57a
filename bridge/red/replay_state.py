"""Red, replay state: saved progress per exchange and the live file other processes read."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.errors import StateError
from bridge.fsutil import atomic_write_bytes

__all__ = [
    "AHEAD_MAX",
    "FORMAT",
    "LIVE_EVERY",
    "LIVE_FILE",
    "PROGRESS_FILE",
    "START",
    "Key",
    "Progress",
    "compress_keys",
    "expand_ranges",
    "load_progress",
    "now_text",
    "read_live",
    "save_progress",
]

PROGRESS_FILE = "replay-progress.json"
LIVE_FILE = "replay-live.json"
"""What the running replay is doing per exchange (held, stopped, in flight), for `diode red
status` in another process: rewritten when it changes and every LIVE_EVERY seconds."""
LIVE_EVERY = 5.0
FORMAT = 1

Key = tuple[int, str, int]
"""``(land_seq, channel, seq)``: where a row sorts in an exchange's replay order."""
START: Key = (-1, "", -1)
AHEAD_MAX = 100_000
"""At most this many rows confirmed ahead of an exchange's progress are remembered (more are
republished after a restart: duplicates, never a loss)."""


def now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class Progress:
    """The confirmed prefix of one exchange: its last row and how many rows were confirmed;
    per channel, the highest seq confirmed and the highest hole the exchange went past."""

    land_seq: int = -1
    channel: str = ""
    seq: int = -1
    confirmed_rows: int = 0
    updated_at: str | None = None
    high: dict[str, int] = field(default_factory=dict)
    """Per channel, the highest seq confirmed (rows published below it are out of order)."""
    passed: dict[str, int] = field(default_factory=dict)
    """Per channel, the highest hole (its ``resume`` seq) the hold-back went past."""
    unaudited: dict[str, list[int]] = field(default_factory=dict)
    """Per channel, confirmed rows no ``replayed`` audit event holds yet: ``[seq_first,
    seq_last, rows, land_seq_first, land_seq_last]``. Saved with the progress, so a publisher
    killed before its event reached the audit table emits it after the restart."""
    ahead: set[Key] = field(default_factory=set)
    """Rows confirmed ahead of the key (a late bundle's rows read ahead to fill a gap, published
    in seq order before the rows that sort before them): not published again when the replay
    reaches them, after a restart too. Forgotten once the key passes them."""
    unaudited_events: list[dict[str, Any]] = field(default_factory=list)
    """This exchange's audit events other than ``replayed`` (``replay_failed``,
    ``replay_gap_passed``, ``replayed_out_of_order``: dicts keyed by audit column) the audit
    sink had not taken when the progress was saved, which may be past their rows: the replay
    writes them first at its next start. Empty in a running replay's memory (it keeps them
    with its events not yet written); absent from files saved before it existed."""

    @property
    def key(self) -> Key:
        return (self.land_seq, self.channel, self.seq)

    def to_json(self) -> dict[str, Any]:
        return {
            "land_seq": self.land_seq,
            "channel": self.channel,
            "seq": self.seq,
            "confirmed_rows": self.confirmed_rows,
            "updated_at": self.updated_at,
            "high": dict(sorted(self.high.items())),
            "passed": dict(sorted(self.passed.items())),
            **({"unaudited": dict(sorted(self.unaudited.items()))} if self.unaudited else {}),
            **({"ahead": compress_keys(self.ahead)} if self.ahead else {}),
            **({"unaudited_events": self.unaudited_events} if self.unaudited_events else {}),
        }

    @classmethod
    def from_json(cls, d: Any) -> Progress:
        return cls(
            land_seq=int(d["land_seq"]),
            channel=str(d["channel"]),
            seq=int(d["seq"]),
            confirmed_rows=int(d.get("confirmed_rows", 0)),
            updated_at=d.get("updated_at"),
            high={str(k): int(v) for k, v in d.get("high", {}).items()},
            passed={str(k): int(v) for k, v in d.get("passed", {}).items()},
            unaudited={
                str(k): [int(x) for x in v]
                for k, v in d.get("unaudited", {}).items()
                if isinstance(v, list) and len(v) == 5
            },
            ahead=expand_ranges(d.get("ahead", [])),
            unaudited_events=_audit_events(d.get("unaudited_events", [])),
        )


def _audit_events(docs: Any) -> list[dict[str, Any]]:
    """Saved ``unaudited_events``; ValueError for anything but a list of objects naming their
    event (a malformed file is reported, never read as owing no audit event)."""
    if not isinstance(docs, list):
        raise ValueError(f"unaudited_events is {type(docs).__name__}, not a list")
    for d in docs:
        if not isinstance(d, dict) or not isinstance(d.get("event"), str):
            raise ValueError(f"unaudited_events holds {str(d)[:80]!r}, not an audit event")
    return [dict(d) for d in docs]


def compress_keys(keys: set[Key]) -> list[list[Any]]:
    """``keys`` as ``[land_seq, channel, seq_first, seq_last]`` runs of consecutive seqs."""
    out: list[list[Any]] = []
    for land_seq, channel, seq in sorted(keys):
        last = out[-1] if out else None
        if last is not None and last[0] == land_seq and last[1] == channel and last[3] + 1 == seq:
            last[3] = seq
        else:
            out.append([land_seq, channel, seq, seq])
    return out


def expand_ranges(runs: Any) -> set[Key]:
    """The keys of ``compress_keys`` runs (at most ``AHEAD_MAX``, the lowest kept)."""
    out: set[Key] = set()
    for land_seq, channel, first, last in runs:
        for seq in range(int(first), min(int(last), int(first) + AHEAD_MAX - len(out) - 1) + 1):
            out.add((int(land_seq), str(channel), seq))
        if len(out) >= AHEAD_MAX:
            break
    return out


def load_progress(state_dir: Path) -> dict[str, Progress]:
    """The saved replay progress per exchange (empty before the first confirm)."""
    path = Path(state_dir) / PROGRESS_FILE
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise StateError(
            f"replay progress {path} is unreadable ({e}); restore it from backup, or delete it "
            "to replay every approved exchange from the start (consumers then see duplicates)"
        ) from None
    try:
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r} is not {FORMAT}")
        return {str(k): Progress.from_json(v) for k, v in doc["exchanges"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise StateError(
            f"replay progress {path} is malformed ({e}); restore it from backup, or delete it "
            "to replay every approved exchange from the start (consumers then see duplicates)"
        ) from None


def read_live(state_dir: Path) -> dict[str, Any]:
    """The running replay's LIVE_FILE, with ``age_seconds``; ``{"running": False}`` when no
    replay ever wrote one, ``{"error": ...}`` when it cannot be read. A file that says running
    but was not rewritten for 3 x LIVE_EVERY is marked ``stale`` and its exchanges dropped."""
    path = Path(state_dir) / LIVE_FILE
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return {"running": False}
    except (OSError, ValueError) as e:
        return {"error": f"{path}: {e}"}
    try:
        doc["age_seconds"] = age = round(time.time() - os.stat(path).st_mtime, 1)
    except OSError:
        return doc
    if doc.get("running") and age > 3 * LIVE_EVERY:  # its writer died (kill -9) or hangs
        doc["stale"] = True
        doc["exchanges"] = {}  # what it said is no longer known to be true
    return doc


def save_progress(state_dir: Path, progress: dict[str, Progress]) -> None:
    doc = {
        "format": FORMAT,
        "saved_at": now_text(),
        "exchanges": {k: v.to_json() for k, v in sorted(progress.items())},
    }
    atomic_write_bytes(Path(state_dir) / PROGRESS_FILE, json.dumps(doc, indent=1).encode() + b"\n")
