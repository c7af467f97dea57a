"""Red, report: what `diode red status` and `diode red gaps` print (state files, no Spark)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.diode.link_status import read_gap_records
from bridge.fsutil import lock_held
from bridge.protocol.manifest import parse_utc
from bridge.red import sequence as sq
from bridge.red.evidence import day_folders
from bridge.red.landing import read_saved_state
from bridge.red.layout import INTAKE_DIR, LOCK_FILE, intent_path

__all__ = ["red_status", "red_gaps", "load_sequence"]


def load_sequence(cfg: Config) -> tuple[int, sq.SequenceState, str | None]:
    """(land_seq, sequence state, saved_at) of the red state dir; empty before the first run."""
    saved = read_saved_state(Path(cfg.red.state_dir))
    if saved is None:
        return 0, sq.SequenceState(), None
    return saved.land_seq, saved.sequence, saved.saved_at


def _count(d: Path, pattern: str = "*") -> int:
    try:
        return sum(1 for p in d.rglob(pattern) if p.is_file() and not p.name.endswith(".json"))
    except FileNotFoundError:
        return 0


def replay_status(cfg: Config) -> Any:
    """Progress, lag and rows waiting per exchange (the Delta log only; no broker needed)."""
    from bridge.red.replay import Replayer

    try:
        return Replayer(cfg).status()
    except Exception as e:  # noqa: BLE001 - a status report shows what it could not read
        return {"error": f"{type(e).__name__}: {e}"}


def _age_s(at: str | None, now: datetime) -> float | None:
    """Seconds from ``at`` (red's ``format_utc`` time) to ``now``; None if absent or unreadable."""
    if not at:
        return None
    try:
        then = parse_utc(at)
    except ValueError:
        return None
    return round(max(0.0, (now - then).total_seconds()), 1)


def _operator_view(c: dict[str, Any], now: datetime) -> dict[str, Any]:
    """What an operator looks at first, derived from a channel's sequence summary: the bundles
    known sent (by later bundles or black's heartbeat) that have not landed, the chain, the
    heartbeat's age."""
    hb = c.get("last_heartbeat") or {}
    counters = c.get("counters") or {}
    broken = int(counters.get("chain_broken", 0))
    chain = f"broken ({broken})" if broken else "intact"
    accounted = c.get("accounted", c["contig"])  # carried across written-off bundles
    if c.get("written_off"):  # links into the bundles after them can never be checked
        chain += f", unverifiable across {len(c['written_off'])} written-off range(s)"
    above = [r for r in c.get("landed_above", []) if r[1] > accounted]
    if c.get("open_gaps") or above:
        chain += f", unverified above {accounted}"  # links across a hole wait for it
    return {
        "lag_bundles": sum(
            g["last_bundle_seq"] - g["first_bundle_seq"] + 1 for g in c.get("open_gaps", [])
        ),
        "chain": chain,
        "heartbeat_age_s": _age_s(hb.get("received_at"), now),
    }


def _silence(
    c: dict[str, Any], watch_since: str | None, now: datetime, silent_after: float
) -> dict[str, Any]:
    """``quiet_s`` (since the last heartbeat, else since watched) and ``silent_now`` (above
    ``silent_after``; None if retired or never watched): true without a running job too."""
    heard = (c.get("last_heartbeat") or {}).get("received_at")
    ages = [a for a in (_age_s(heard, now), _age_s(watch_since, now)) if a is not None]
    quiet = min(ages, default=None)  # the later reference is the younger one
    if quiet is None or c.get("retired"):
        return {"quiet_s": quiet, "silent_now": None}
    return {"quiet_s": quiet, "silent_now": quiet > silent_after}


def _quarantine(cfg: Config) -> dict[str, Any]:
    from bridge.red.quarantine import list_quarantined, quarantine_summary

    try:
        return quarantine_summary(list_quarantined(cfg))
    except OSError as e:  # a day folder moved away while listed: say so, show the rest
        return {"error": f"quarantine not readable: {e}"}


def red_status(cfg: Config) -> dict[str, Any]:
    """Per channel (last bundle, lag behind black's heartbeat, open gaps, chain, heartbeat
    age, silence: ``silent`` as the running job last judged it, ``silent_now`` by the clock),
    files by folder, what was quarantined by reason, and replay progress."""
    r = cfg.red
    land_seq, state, saved_at = load_sequence(cfg)
    now = datetime.now(UTC)
    channels = sq.summary(state)
    for name, c in channels.items():
        c.update(_operator_view(c, now))
        c.update(_silence(c, state.channels[name].watch_since, now, r.link_silent_seconds))
    for name in (c.name for c in cfg.channels):
        channels.setdefault(name, {"note": "nothing received yet"})
    inbox = Path(r.inbox)
    quarantine = _quarantine(cfg)
    # a running job applies each landing from its journaled intent, so an intent beside a held
    # lock is work in progress; without a holder it is a landing a crash interrupted
    running = lock_held(Path(r.state_dir) / LOCK_FILE)
    intent = intent_path(r.state_dir).exists()
    return {
        "land_seq": land_seq,
        "state_saved_at": saved_at,
        "now": now.isoformat(),
        "channels": channels,
        "link_silent_seconds": r.link_silent_seconds,
        "files": {
            "inbox": sum(1 for p in inbox.iterdir() if p.name != "lost+found")
            if inbox.exists()
            else 0,
            "intake": _count(Path(r.work_dir) / INTAKE_DIR, "0*"),
            "processed": sum(_count(d) for d in day_folders(Path(r.processed_dir))),
            "quarantine": quarantine.get("total"),  # None if it could not be read
        },
        "quarantine": quarantine,
        "landing_running": running,
        "interrupted_landing": intent and not running,
        "replay": replay_status(cfg),
    }


def _declared(cfg: Config) -> list[dict[str, Any]]:
    """Message seq ranges black declared lost (audit ``gap_declared``), per channel."""
    import pyarrow.dataset as pads

    from bridge.red.tables import RedTables

    tables = RedTables(Path(cfg.red.tables_dir), "delta-rs")
    try:
        t = tables.read(
            "audit",
            columns=["channel", "bundle_seq", "seq_first", "seq_last", "reason"],
            filter=pads.field("event") == "gap_declared",
        )
    except Exception:  # noqa: BLE001 - no audit table yet: nothing declared
        return []
    rows = sorted(t.to_pylist(), key=lambda r: (r["channel"] or "", r["seq_first"] or 0))
    return [
        {**r, "messages": (r["seq_last"] - r["seq_first"] + 1)}
        for r in rows
        if r["seq_first"] is not None and r["seq_last"] is not None
    ]


def red_gaps(cfg: Config) -> dict[str, Any]:
    _, state, _ = load_sequence(cfg)
    out: dict[str, Any] = {
        "open_transit_gaps": sq.open_gaps(state),
        "written_off": [
            {
                "channel": name,
                "first_bundle_seq": w.first,
                "last_bundle_seq": w.last,
                "at": w.at,
                "note": w.note,
            }
            for name, cs in sorted(state.channels.items())
            for w in cs.written_off
        ],
        "declared_by_black": _declared(cfg),
    }
    if cfg.udp is not None:  # why a bundle never reached the inbox: the UDP receiver's records
        out["udp_transport_gaps"] = read_gap_records(Path(cfg.udp.receive.spool_dir))
    return out
