"""Black, journal: the durable per-channel state (bundle seq, hash chain, pending bundle).

The state is the single source of truth for bundle numbering. It is replaced atomically
(temp, fsync, rename) at two points per bundle:

1. *intent*: before a bundle is sealed, its manifest and plaintext digest are recorded as
   ``pending``; a crash after this point re-creates the very same plaintext on restart;
2. *shipped*: once the sealed file is durably in the outbox and archive, the counters advance
   and ``pending`` is cleared.

Spark's checkpoint holds the spool positions; this journal makes a replayed micro-batch skip
what was already shipped and finish what was in flight. ``last_seq`` is also what lets the
tap release spool segments.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bridge.errors import StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir

__all__ = ["LOCK_FILE", "ChannelState", "StateStore"]

LOCK_FILE = "black.lock"
"""``state_dir/black.lock``: held by the black job for its whole run, and by ``diode black
heartbeat`` for each channel's beat between runs (`diode resend` and `diode mirror` coordinate
with the job through the drop lock and the catalog lock instead)."""


@dataclass
class ChannelState:
    """What black must remember about one channel across restarts."""

    channel: str
    last_bundle_seq: int = 0
    """Last bundle seq shipped (0: none yet; the first bundle is 1)."""
    last_seq: int = -1
    """Last message seq covered by a shipped bundle (rows or gaps); -1: none yet."""
    last_sha256: str | None = None
    """SHA-256 of the last shipped bundle's plaintext: the next bundle's prev_sha256."""
    pending: dict[str, Any] | None = None
    """Manifest (as JSON) + plaintext sha of a bundle sealed but not yet shipped, and the rows
    of it whose property bytes do not decode (``undecodable_rows``, ``undecodable_seqs``: the
    first few), counted when it ships."""
    counters: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: Path) -> ChannelState:
        try:
            d = json.loads(data)
            return cls(**d)
        except (ValueError, TypeError) as e:
            raise StateError(
                f"black state {where} is unreadable ({e}); restore it from backup — do not "
                "delete it, or bundle seqs would restart and red would reject them"
            ) from None


class StateStore:
    """Loads and atomically saves ChannelState files under ``state_dir``; one lock per channel."""

    def __init__(self, state_dir: Path, *, create: bool = True) -> None:
        self.dir = Path(state_dir)
        if create:  # readers (reports) leave a missing state dir missing
            durable_mkdir(self.dir)  # restrictive mode, fsynced in its parent
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()

    def path(self, channel: str) -> Path:
        return self.dir / f"channel-{channel}.json"

    def channels(self) -> list[str]:
        """Every channel with a journal here (also channels no longer configured), sorted."""
        if not self.dir.is_dir():
            return []
        return sorted(
            p.name[len("channel-") : -len(".json")] for p in self.dir.glob("channel-*.json")
        )

    def lock(self, channel: str) -> threading.RLock:
        with self._guard:
            return self._locks.setdefault(channel, threading.RLock())

    def load(self, channel: str) -> ChannelState:
        p = self.path(channel)
        if not p.exists():
            return ChannelState(channel=channel)
        st = ChannelState.from_json(p.read_bytes(), where=p)
        if st.channel != channel:
            raise StateError(f"black state {p} belongs to channel {st.channel!r}, not {channel!r}")
        return st

    def save(self, st: ChannelState) -> None:
        atomic_write_bytes(self.path(st.channel), st.to_json())
