"""Red, operator: write off gaps whose bundles will never come, retire a removed channel.

``diode red write-off`` and ``diode red retire`` check the request against the saved state,
queue it in ``work_dir/requests/`` and apply it at once through the landing's tick once they
hold the state lock (waiting up to :data:`LOCK_WAIT_SECONDS` for another command to let go of
it); a running red job, which holds that lock for its whole run, applies it at its next tick
(about a second; later while a landing is being applied). The landing audits ``gap_written_off`` /
``channel_retired``; the replay hold-back stops waiting for the bundles written off, and a
retired channel is no longer watched for silence.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.errors import ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock, lock_held
from bridge.logs import operator_name
from bridge.red import sequence as sq
from bridge.red.landing import LOCK_FILE, REQUESTS_DIR
from bridge.red.report import load_sequence

__all__ = ["LOCK_WAIT_SECONDS", "retire_channel", "write_off_gap"]

LOCK_WAIT_SECONDS = 3.0
"""How long a request waits for ``red.lock`` before leaving itself queued: long enough for a
command that holds it briefly (``diode red status``'s probe, another request being applied)."""


def _queue(cfg: Config, doc: dict[str, Any]) -> Path:
    d = durable_mkdir(Path(cfg.red.work_dir) / REQUESTS_DIR)
    path = d / f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
    atomic_write_bytes(path, json.dumps(doc, sort_keys=True).encode())
    return path


def _checked_note(note: str) -> str:
    if not note.strip():
        raise ConfigError("--note is required: say why (a ticket, who decided); the audit keeps it")
    return f"{note} (by {operator_name()})"


def _trial(cfg: Config) -> tuple[sq.SequenceState, datetime]:
    """A copy of the saved sequence state to check a request on, and the request's time."""
    _, state, _ = load_sequence(cfg)
    return sq.SequenceState.from_json(state.to_json()), datetime.now(UTC)


def _queued_note(lock: Path, what: str, wait: float) -> str:
    """Why the request was only queued: a red job holds its lock (it applies the request at
    its next tick), or, with no job holding it, the lock stayed busy for ``wait`` seconds."""
    check = "Check `diode red status` and `diode red gaps`"
    if lock_held(lock):
        return (
            f"a red job holds {lock}: it applies the {what} at its next tick (about a second), "
            "checked against the config it was started with (restart it after editing the "
            "config); a refusal is audited as request_refused. (If no red job runs, `diode red "
            "maintain` holds the lock: the next job start or write-off applies it.) " + check
        )
    return (
        f"no red job holds {lock}, but other commands kept it busy for {wait:g}s: the {what} "
        "stays queued and is applied when a red job next starts, or by the next "
        f"`diode red write-off` / `retire` that gets the lock. {check}"
    )


def _submit(
    cfg: Config,
    doc: dict[str, Any],
    what: str,
    done: Callable[[sq.SequenceState], bool],
    wait: float,
) -> dict[str, Any]:
    """Queue ``doc`` and apply it now once the state lock is ours (waiting up to ``wait``
    seconds); a red job holding the lock applies it at its next tick. StateError when the
    state after applying it is not ``done``."""
    path = _queue(cfg, doc)
    lock = Path(cfg.red.state_dir) / LOCK_FILE
    stack = contextlib.ExitStack()
    what_lock = f"red {doc['kind'].replace('_', '-')}"
    if lock_held(lock):  # a red job runs (the usual case): it applies the request, no wait
        wait = 0.0
    try:
        stack.enter_context(exclusive_lock(lock, what=what_lock, timeout=wait))
    except StateError:
        return {"queued": str(path), "applied": False, "note": _queued_note(lock, what, wait)}
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


def _already_written_off(
    state: sq.SequenceState, channel: str, first: int, last: int
) -> str | None:
    """What of ``first..last`` was written off before (range, when, note), or None."""
    cs = state.channels.get(channel)
    done = [
        w for w in (cs.written_off if cs is not None else []) if w.first <= last and w.last >= first
    ]
    if not done:
        return None
    listed = "; ".join(f"{w.first}..{w.last} at {w.at} (note: {w.note!r})" for w in done)
    return f"channel {channel!r} bundle seqs {first}..{last}: already written off: {listed}"


def write_off_gap(
    cfg: Config,
    channel: str,
    first: int,
    last: int,
    note: str,
    *,
    lock_wait: float = LOCK_WAIT_SECONDS,
) -> dict[str, Any]:
    """Write off bundles ``first..last`` of ``channel`` (all in open transit gaps). StateError
    names the open gaps when they are not, and says when and with which note any of them
    was written off already."""
    signed = _checked_note(note)
    trial, now = _trial(cfg)
    try:
        sq.write_off(trial, channel, first, last, note, now)
    except StateError as e:
        already = _already_written_off(trial, channel, first, last)
        if already is None:
            raise
        covered = sq.seqs_within(trial.channels[channel].written_off, first, last)
        rest = "nothing to do" if covered == last - first + 1 else str(e)
        raise StateError(f"{already}; {rest}") from None
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

    return _submit(cfg, doc, f"write-off of {channel!r} {first}..{last}", done, lock_wait)


def retire_channel(
    cfg: Config, channel: str, note: str, *, lock_wait: float = LOCK_WAIT_SECONDS
) -> dict[str, Any]:
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

    out = _submit(cfg, doc, f"retirement of {channel!r}", done, lock_wait)
    out["gaps_written_off"] = [
        [e.detail["first_bundle_seq"], e.detail["last_bundle_seq"]]
        for e in events
        if e.kind == "gap_written_off"
    ]
    return out
