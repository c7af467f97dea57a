"""Red, operator: write off transit gaps whose bundles will never come (black pruned them).

``diode red write-off`` checks the range against the saved state, queues a request in
``work_dir/requests/`` and, when no red job holds the state lock, applies it at once through
the landing's tick; a running job applies it at its next tick (about a second). The landing
audits ``gap_written_off``; the replay hold-back stops waiting for those bundles.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock
from bridge.red import sequence as sq
from bridge.red.landing import LOCK_FILE, REQUESTS_DIR
from bridge.red.report import load_sequence

__all__ = ["write_off_gap"]


def _queue(cfg: Config, doc: dict[str, Any]) -> Path:
    d = durable_mkdir(Path(cfg.red.work_dir) / REQUESTS_DIR)
    path = d / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    atomic_write_bytes(path, json.dumps(doc, sort_keys=True).encode())
    return path


def write_off_gap(cfg: Config, channel: str, first: int, last: int, note: str) -> dict[str, Any]:
    """Write off bundles ``first..last`` of ``channel`` (all in open transit gaps)."""
    if not note.strip():
        raise ConfigError("--note is required: say why (a ticket, who decided); the audit keeps it")
    _, state, _ = load_sequence(cfg)
    now = datetime.now(UTC)
    trial = sq.SequenceState.from_json(state.to_json())
    sq.write_off(trial, channel, first, last, note, now)  # StateError names the open gaps
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    doc = {
        "kind": "write_off",
        "channel": channel,
        "first_bundle_seq": first,
        "last_bundle_seq": last,
        "note": f"{note} (by {user})",
        "requested_at": now.isoformat(),
    }
    path = _queue(cfg, doc)
    lock = Path(cfg.red.state_dir) / LOCK_FILE
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(exclusive_lock(lock, what="red write-off"))
    except StateError:
        return {
            "queued": str(path),
            "applied": False,
            "note": "a red job is running: it applies the write-off at its next tick (about a "
            "second); check `diode red gaps`",
        }
    with stack:
        from bridge.red.job import open_landing

        res = open_landing(cfg).tick()
    if not res.events.get("gap_written_off"):
        raise StateError(
            f"the write-off of {channel!r} {first}..{last} was refused when applied (the state "
            "changed meanwhile?): see the log and `diode red gaps`"
        )
    return {"applied": True, "land_seq": res.land_seq, "events": res.events}
