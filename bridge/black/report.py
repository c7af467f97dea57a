"""Black, report: what black has shipped and what waits in the outbox (for CLI and notebooks).

A damaged file of one channel (its journal, heartbeat seq file or tap status) shows as
``"unreadable: <reason>"`` in that channel's entry; every other channel is still reported.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from bridge.black.gaplog import read_gaps
from bridge.black.heartbeat import read_heartbeat_seq
from bridge.black.state import LOCK_FILE, ChannelState, StateStore
from bridge.config import Config
from bridge.errors import BundleNameError, StateError
from bridge.fsutil import lock_held
from bridge.protocol.naming import parse_bundle_name, parse_heartbeat_name

__all__ = ["channel_status", "files_table", "gap_ranges"]


def _waiting(outbox: Path) -> list[str]:
    """Names of the files in an outbox (not yet taken by the mover or the UDP sender)."""
    if not outbox.is_dir():
        return []
    return [p.name for p in outbox.iterdir() if not p.name.startswith(".")]


def channel_status(cfg: Config) -> dict[str, Any]:
    """Per channel: journal position, counters (incl. losses, inexact and undecodable
    messages), outbox backlog."""
    store = StateStore(Path(cfg.black.state_dir), create=False)
    waiting = _waiting(Path(cfg.black.outbox))
    out: dict[str, Any] = {
        "bridge_id": cfg.link.bridge_id,
        # a bundle is pending for a moment while a running job seals it; with no holder of
        # the lock, a pending bundle is one a crash interrupted (finished at the next start)
        "job_running": lock_held(Path(cfg.black.state_dir) / LOCK_FILE),
        "outbox_files": len(waiting),
        "channels": {},
    }
    if cfg.black.udp_outbox is not None:
        udp_waiting = _waiting(Path(cfg.black.udp_outbox))
        out["udp_outbox_files"] = len(udp_waiting)
        waiting += udp_waiting
    for ch in cfg.channels:
        out["channels"][ch.name] = {
            **_journal_status(store, ch.name),
            "spool": _spool_status(cfg, ch.name),
            "heartbeat_seq": _heartbeat_seq(cfg, ch.name),
            "encrypt": ch.encrypt,
            "recipients": len(ch.recipients),
            "outbox_bundles": sum(1 for n in waiting if _bundle_channel(n) == ch.name),
        }
    return out


def _journal_status(store: StateStore, channel: str) -> dict[str, Any]:
    """The journal's part of a channel's status. An unreadable journal: ``journal_error`` and
    ``last_bundle_seq`` (the column a table shows first) say ``unreadable: <reason>``; what only
    the journal knows is None (unknown, not zero)."""
    try:
        st: ChannelState = store.load(channel)
    except (StateError, OSError) as e:
        why = f"unreadable: {e}"
        return {"journal_error": why, "last_bundle_seq": why, "last_seq": None, "pending": None,
                "counters": None, "lost": None, "inexact": None, "undecodable": None}  # fmt: skip
    return {
        "journal_error": None,
        "last_bundle_seq": st.last_bundle_seq,
        "last_seq": st.last_seq,
        "pending": bool(st.pending),
        "counters": st.counters,
        "lost": {k[len("lost_") :]: v for k, v in st.counters.items() if k.startswith("lost_")},
        "inexact": {
            k[len("inexact_") :]: v for k, v in st.counters.items() if k.startswith("inexact_")
        },
        # carried exact, but their property bytes do not decode (protocol §5)
        "undecodable": st.counters.get("undecodable", 0),
    }


def _spool_status(cfg: Config, channel: str) -> dict[str, Any]:
    """The channel's spool and tap, as the tap last reported them."""
    from bridge.black.tap import read_tap_status

    try:
        st = read_tap_status(cfg, channel)
    except StateError as e:
        return {"tap": f"unreadable: {e}"}
    if st is None:
        return {"tap": "never ran"}
    from bridge.black.spool import LOCK_FILE
    from bridge.fsutil import lock_held

    return {
        "durable_end": st.durable_end,
        "acked_through": st.acked_through,
        "paused": st.paused,
        "tap_pid": st.pid,
        # the tap holds its spool's LOCK while it runs: the kernel drops it however it ends
        "tap_running": lock_held(Path(cfg.black.spool_dir) / channel / LOCK_FILE),
        "status_age_s": round(max(0.0, time.time() - st.updated), 1),
        "counters": st.counters,
    }


def _heartbeat_seq(cfg: Config, channel: str) -> int | str | None:
    """The last heartbeat seq written (None: none yet; ``unreadable: <reason>``: its file is
    damaged, and the next heartbeat continues from the time)."""
    try:
        return read_heartbeat_seq(Path(cfg.black.state_dir), channel)
    except StateError as e:
        return f"unreadable: {e}"


def gap_ranges(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """Per channel, every message seq range known lost on black, with its reason and bundle."""
    return {ch.name: read_gaps(Path(cfg.black.state_dir), ch.name) for ch in cfg.channels}


def _bundle_channel(name: str) -> str | None:
    try:
        return parse_bundle_name(name).channel
    except BundleNameError:
        return None


def files_table(cfg: Config, *, where: str = "archive") -> pa.Table:
    """One row per bundle or heartbeat file in the archive or the outbox (names parsed strictly)."""
    if where == "archive":
        roots = [Path(cfg.black.archive)]
    else:
        roots = [Path(cfg.black.outbox)]
        if cfg.black.udp_outbox is not None:
            roots.append(Path(cfg.black.udp_outbox))
    paths = [
        p for root in roots for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
    ]
    rows: dict[str, list[Any]] = {
        k: [] for k in ("name", "kind", "channel", "seq", "bytes", "mtime")
    }
    for p in sorted(paths):
        try:
            b = parse_bundle_name(p.name)
            kind, channel, seq = "bundle", b.channel, b.bundle_seq
        except BundleNameError:
            try:
                h = parse_heartbeat_name(p.name)
            except BundleNameError:
                continue
            kind, channel, seq = "heartbeat", h.channel, h.heartbeat_seq
        try:
            st = p.stat()
        except FileNotFoundError:
            continue  # a mover took it meanwhile
        for k, v in zip(rows, (p.name, kind, channel, seq, st.st_size, st.st_mtime), strict=True):
            rows[k].append(v)
    return pa.table(
        {
            "name": pa.array(rows["name"], pa.string()),
            "kind": pa.array(rows["kind"], pa.string()),
            "channel": pa.array(rows["channel"], pa.string()),
            "seq": pa.array(rows["seq"], pa.int64()),
            "bytes": pa.array(rows["bytes"], pa.int64()),
            "mtime": pa.array(rows["mtime"], pa.float64()),
        }
    )
