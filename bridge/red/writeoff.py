"""Red, operator: write off gaps whose bundles will never come, retire a removed channel.

``diode red write-off`` and ``diode red retire`` check the request against the saved state,
queue it in ``work_dir/requests/`` and, when no red job holds the state lock, apply it at once
through the landing's tick; a running job applies it at its next tick (about a second; later
while a landing is being applied). The landing audits ``gap_written_off`` /
``channel_retired``; the replay hold-back stops waiting for the bundles written off, and a
retired channel is no longer watched for silence.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock
from bridge.red import sequence as sq
from bridge.red.landing import LOCK_FILE, REQUESTS_DIR
from bridge.red.report import load_sequence

__all__ = ["retire_channel", "write_off_gap"]


def _queue(cfg: Config, doc: dict[str, Any]) -> Path:
    d = durable_mkdir(Path(cfg.red.work_dir) / REQUESTS_DIR)
    path = d / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    atomic_write_bytes(path, json.dumps(doc, sort_keys=True).encode())
    return path


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _checked_note(note: str) -> str:
    if not note.strip():
        raise ConfigError("--note is required: say why (a ticket, who decided); the audit keeps it")
    return f"{note} (by {_user()})"


def _trial(cfg: Config) -> tuple[sq.SequenceState, datetime]:
    """A copy of the saved sequence state to check a request on, and the request's time."""
    _, state, _ = load_sequence(cfg)
    return sq.SequenceState.from_json(state.to_json()), datetime.now(UTC)


def _submit(
    cfg: Config, doc: dict[str, Any], what: str, done: Callable[[sq.SequenceState], bool]
) -> dict[str, Any]:
    """Queue ``doc`` and apply it now unless a red job holds the state lock (it applies it at
    its next tick); StateError when the state after applying it is not ``done``."""
    path = _queue(cfg, doc)
    lock = Path(cfg.red.state_dir) / LOCK_FILE
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(exclusive_lock(lock, what=f"red {doc['kind'].replace('_', '-')}"))
    except StateError:
        return {
            "queued": str(path),
            "applied": False,
            "note": f"a red job is running: it applies the {what} at its next tick (about a "
            "second), checked against the config it was started with (restart it after "
            "editing the config); a refusal is audited as request_refused. Check `diode red "
            "status` and `diode red gaps`",
        }
    with stack:
        from bridge.red.job import open_landing

        landing = open_landing(cfg)
        res = landing.tick()
    if not done(landing.state):
        raise StateError(
            f"the {what} was refused when applied (audited as request_refused; the state "
            "changed meanwhile?): see the log and `diode red status`"
        )
    return {"applied": True, "land_seq": res.land_seq, "events": res.events}


def write_off_gap(cfg: Config, channel: str, first: int, last: int, note: str) -> dict[str, Any]:
    """Write off bundles ``first..last`` of ``channel`` (all in open transit gaps)."""
    signed = _checked_note(note)
    trial, now = _trial(cfg)
    sq.write_off(trial, channel, first, last, note, now)  # StateError names the open gaps
    doc = {
        "kind": "write_off",
        "channel": channel,
        "first_bundle_seq": first,
        "last_bundle_seq": last,
        "note": signed,
        "requested_at": now.isoformat(),
    }

    def done(st: sq.SequenceState) -> bool:
        cs = st.channels.get(channel)
        return cs is not None and sq.seqs_within(cs.written_off, first, last) == last - first + 1

    return _submit(cfg, doc, f"write-off of {channel!r} {first}..{last}", done)


def retire_channel(cfg: Config, channel: str, note: str) -> dict[str, Any]:
    """Retire ``channel``, already removed from red's config: its open gaps are written off and
    it is no longer watched for silence (configuring it again reinstates it)."""
    signed = _checked_note(note)
    trial, now = _trial(cfg)
    configured = [c.name for c in cfg.channels]
    events = sq.retire(trial, channel, note, now, configured)  # StateError says why not
    doc = {
        "kind": "retire",
        "channel": channel,
        "note": signed,
        "requested_at": now.isoformat(),
    }

    def done(st: sq.SequenceState) -> bool:
        cs = st.channels.get(channel)
        return cs is not None and cs.retired is not None

    out = _submit(cfg, doc, f"retirement of {channel!r}", done)
    out["gaps_written_off"] = [
        [e.detail["first_bundle_seq"], e.detail["last_bundle_seq"]]
        for e in events
        if e.kind == "gap_written_off"
    ]
    return out
