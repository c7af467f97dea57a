"""Both sides, operator: `diode status` and `diode gaps` reports rendered as terminal tables.

The reports themselves are plain dicts (``bridge.black.report``, ``bridge.red.report``), which
``--json`` prints unchanged; this module only lays them out for a person at a terminal.

Names, reasons and notes come from the wire, the broker or an operator: every string put in a
table (cells and titles) becomes a ``rich.text.Text``, shown as it is on any console — never
read as rich markup (``[/x]`` would raise, ``[bold]`` would hide text) or emoji codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = [
    "black_gaps_view",
    "black_status_view",
    "make_console",
    "print_views",
    "red_gaps_view",
    "red_status_view",
]

_NONE = "-"


def _v(x: Any) -> str:
    return _NONE if x is None or x == "" else str(x)


def _counts(d: Mapping[str, Any] | None) -> str:
    """``{"maxlen": 3, "expired": 1}`` -> ``"maxlen 3, expired 1"``; nothing -> ``-``."""
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items()) if v) or _NONE


def _ranges(items: Iterable[Mapping[str, Any]], lo: str, hi: str) -> str:
    parts = [
        str(g[lo]) if g[lo] == g[hi] else f"{g[lo]}-{g[hi]}" for g in items if g.get(lo) is not None
    ]
    return ", ".join(parts) or _NONE


class _Table(Table):
    """A table whose string cells are literal text (``Text``), never markup."""

    def add_row(self, *renderables: RenderableType | None, **kwargs: Any) -> None:
        super().add_row(*(Text(r) if isinstance(r, str) else r for r in renderables), **kwargs)


def _table(title: str, *columns: str) -> Table:
    t = _Table(title=Text(title), title_justify="left", header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def _warn(text: str) -> Text:
    return Text(text, style="bold red")


# ---------------------------------------------------------------------------- black


def black_status_view(st: Mapping[str, Any]) -> RenderableType:
    """``bridge.black.report.channel_status`` (+ ``link``) as tables."""
    head = f"black bridge {st.get('bridge_id')}: {st.get('outbox_files', 0)} file(s) in the outbox"
    if "udp_outbox_files" in st:
        head += f", {st['udp_outbox_files']} in the UDP outbox"
    t = _table(head, "channel", "bundles", "last seq", "spool end", "acked", "tap", "pending",
               "heartbeat", "lost", "inexact", "waiting")  # fmt: skip
    for name, c in st.get("channels", {}).items():
        sp = c.get("spool") or {}
        if "tap" in sp:
            tap = sp["tap"]
        elif sp.get("tap_running") is False:  # its status is what it last wrote
            tap = _warn(f"stopped (pid {sp.get('tap_pid')}, {sp.get('status_age_s')} s ago)")
        else:
            tap = "paused" if sp.get("paused") else f"pid {sp.get('tap_pid')}"
            tap += f", {sp.get('status_age_s')} s ago"
        t.add_row(
            name,
            _v(c.get("last_bundle_seq")),
            _v(c.get("last_seq")),
            _v(sp.get("durable_end")),
            _v(sp.get("acked_through")),
            tap,
            _pending(c.get("pending"), bool(st.get("job_running"))),
            _v(c.get("heartbeat_seq")),
            _warn(_counts(c.get("lost"))) if c.get("lost") else _NONE,
            _counts({**(c.get("inexact") or {}), "undecodable": c.get("undecodable", 0)}),
            _v(c.get("outbox_bundles")),
        )
    parts: list[RenderableType] = [t]
    link = st.get("link")
    if isinstance(link, Mapping) and link.get("transport") == "udp":
        parts.append(_link_view(link))
    return Group(*parts)


def _pending(pending: Any, running: bool) -> RenderableType:
    """A pending bundle is being sealed while the job runs; without a job, a crash left it."""
    if not pending:
        return "no"
    return "sealing" if running else _warn("interrupted")


def _link_view(link: Mapping[str, Any]) -> RenderableType:
    """The UDP link as this host's sender and/or receiver last wrote it (status files)."""
    gaps, lost = link.get("gaps_total", 0), link.get("gap_objects_total")
    objects = f"{lost} object(s) lost in {gaps} gap record(s)" if lost else f"{gaps} gap record(s)"
    title = f"UDP link ({objects}: diode red gaps)" if gaps else "UDP link (no gap)"
    t = _table(title, "end", "running", "epoch", "status age s", "heartbeat age s", "counters")
    for end in ("sender", "receiver"):
        doc = link.get(end)
        if not isinstance(doc, Mapping):
            t.add_row(end, _NONE, "no status file", _NONE, _NONE, _NONE)
            continue
        running: Text | str = "yes" if doc.get("running") else _warn("stopped")
        if "running" not in doc:  # a report from before the lock was looked at
            running = _NONE
        if doc.get("damaged"):
            why = _warn(f"status file damaged: {doc['damaged']}")
            t.add_row(end, running, why, _NONE, _NONE, _v(doc.get("path")))
            continue
        counters = {k: v for k, v in doc.items() if isinstance(v, int) and not isinstance(v, bool)}
        counters.pop("epoch", None)
        counters.pop("pid", None)
        dropped = doc.get("dropped")
        if isinstance(dropped, Mapping):  # by reason: `tag` is a wrong key or a foreign sender
            counters |= {f"dropped {k}": v for k, v in dropped.items() if isinstance(v, int) and v}
        heard: Text | str = _NONE
        if end == "receiver":
            age = doc.get("heartbeat_age_seconds")
            heard = _warn("never heard") if age is None else _v(age)
        t.add_row(end, running, _v(doc.get("epoch")), _v(doc.get("age_seconds")), heard,
                  _counts(counters))  # fmt: skip
    return t


def black_gaps_view(gaps: Mapping[str, Any]) -> RenderableType:
    """``diode gaps`` on black: totals per channel, then every lost or inexact seq range."""
    totals = _table("messages black lost or carried inexactly, per channel", "channel", "lost",
                    "inexact")  # fmt: skip
    ranges = _table("seq ranges", "channel", "seqs", "count", "kind", "reason", "bundle")
    for name, c in gaps.items():
        totals.add_row(name, _counts(c.get("lost")), _counts(c.get("inexact")))
        for r in c.get("ranges", []):
            first, last = r.get("first_seq"), r.get("last_seq")
            n = last - first + 1 if isinstance(first, int) and isinstance(last, int) else None
            seqs = _ranges([r], "first_seq", "last_seq")
            why = (_v(r.get("kind")), _v(r.get("reason")), _v(r.get("bundle_seq")))
            ranges.add_row(name, seqs, _v(n), *why)
    return Group(totals, ranges) if ranges.row_count else totals


# ---------------------------------------------------------------------------- red


def red_status_view(st: Mapping[str, Any]) -> RenderableType:
    """``bridge.red.report.red_status`` as tables: channels, files, quarantine, replay."""
    silent_after = st.get("link_silent_seconds")
    t = _table(f"red: landing {st.get('land_seq')} saved {_v(st.get('state_saved_at'))}",
               "channel", "in order to", "missing", "highest", "open gaps", "chain", "heartbeat",
               "link", "rows", "declared lost")  # fmt: skip
    for name, c in st.get("channels", {}).items():
        if "contig" not in c:
            t.add_row(name, _v(c.get("note")), *[_NONE] * 8)
            continue
        counters = c.get("counters") or {}
        link = _link_cell(c, silent_after)
        age = c.get("heartbeat_age_s")
        chain: str = _v(c.get("chain"))
        gaps = _ranges(c.get("open_gaps", []), "first_bundle_seq", "last_bundle_seq")
        t.add_row(
            name,
            _v(c.get("accounted", c.get("contig"))),
            _v(c.get("lag_bundles")),
            _v(c.get("highest")),
            _warn(gaps) if gaps != _NONE else gaps,
            _warn(chain) if chain.startswith("broken") else chain,
            _NONE if age is None else f"{age} s ago",
            link,
            _v(counters.get("rows")),
            _v(counters.get("declared_lost")),
        )
    files = st.get("files", {})
    q = st.get("quarantine") or {}
    f = _table("files", "inbox", "intake", "processed", "quarantine", "quarantined by reason")
    by_reason = _warn(str(q["error"])) if q.get("error") else _counts(q.get("by_reason"))
    f.add_row(*(_v(files.get(k)) for k in ("inbox", "intake", "processed", "quarantine")),
              by_reason)  # fmt: skip
    parts: list[RenderableType] = [t, f]
    if st.get("interrupted_landing"):
        parts.append(_warn("an interrupted landing waits: the next red run applies it first"))
    elif st.get("landing_running"):
        parts.append(Text("a red job (or an operator command) is landing now"))
    if not st.get("landing_running"):
        parts.append(_unwatched(st.get("channels", {})))
    parts.append(_replay_view(st.get("replay")))
    udp = st.get("link")
    if isinstance(udp, Mapping) and udp.get("transport") == "udp":
        parts.append(_link_view(udp))
    return Group(*parts)


def _link_cell(c: Mapping[str, Any], silent_after: Any) -> RenderableType:
    """SILENT when the job flagged it or the last heartbeat is older than allowed, else ok."""
    if c.get("retired"):
        return "retired"
    if c.get("silent") or c.get("silent_now"):
        return _warn(f"SILENT (> {silent_after} s)")
    return "ok"


SILENT_NAMES_SHOWN = 5
"""At most this many silent channels are named in the no-job warning; the rest as ``+N more``
(each is SILENT in the link column, and ``--json`` has ``channels.<name>.silent_now``)."""


def _unwatched(channels: Mapping[str, Any]) -> RenderableType:
    """Red, status: without a red job nobody checks for silence: say so, louder when a link is
    silent (a handful of names, then how many more: one short line however many channels)."""
    silent = sorted(n for n, c in channels.items() if c.get("silent_now") and not c.get("retired"))
    text = ("no red job is running: silence is not being watched (no link_silent event, no "
            "alarm); the link column is judged from the last heartbeat's age")  # fmt: skip
    if not silent:
        return Text(text)
    names = ", ".join(silent[:SILENT_NAMES_SHOWN])
    more = len(silent) - SILENT_NAMES_SHOWN
    if more > 0:
        names += f" +{more} more ({len(silent)} in all: --json, channels.*.silent_now)"
    return _warn(f"{text}; silent now: {names}")


def _replay_view(rp: Any) -> RenderableType:
    if not isinstance(rp, Mapping):
        return Text("replay: -")
    if "error" in rp and "exchanges" not in rp:
        return _warn(f"replay: {rp['error']}")
    live = rp.get("live") or {}
    state = "running" if live.get("running") else "not running"
    if live.get("stale"):
        state = "stale status file (killed?)"
    cols = ("exchange", "approved", "position (channel:seq)", "confirmed", "lag rows",
            "in flight", "held / stopped")  # fmt: skip
    t = _table(f"replay to {_v(rp.get('target'))}: {state}", *cols)
    for name, e in rp.get("exchanges", {}).items():
        p = e.get("progress") or {}
        pos = f"{p['channel']}:{p['seq']}" if p.get("channel") is not None else _NONE
        why = e.get("held") or e.get("stopped")
        t.add_row(
            name or "(default)",
            "yes" if e.get("approved") else "no",
            pos,
            _v(p.get("confirmed_rows")),
            _v(e.get("lag_rows")),
            _v(e.get("in_flight")),
            _warn(str(why)) if why else _NONE,
        )
    parts: list[RenderableType] = [t if t.row_count else Text(f"{t.title}: no exchange landed yet")]
    if live.get("running") and not live.get("stale") and live.get("broker_blocked"):
        parts.append(_warn(f"the red broker blocks publishing ({live['broker_blocked']}): "
                           "a memory or disk alarm; replay waits until it clears"))  # fmt: skip
    if rp.get("approvals_error"):  # nothing replays while the approvals cannot be read
        parts.append(_warn(f"approvals not readable: {rp['approvals_error']}"))
    waiting = rp.get("unapproved_waiting") or {}
    if waiting:
        rows = ", ".join(f"{n or '(default)'} ({c} rows)" for n, c in sorted(waiting.items()))
        parts.append(_warn(f"landed, waiting for approval (diode approve): {rows}"))
    return parts[0] if len(parts) == 1 else Group(*parts)


def red_gaps_view(gaps: Mapping[str, Any]) -> RenderableType:
    """``diode gaps`` on red: bundles missing in transit, written off, declared lost by black,
    and the UDP receiver's gap records."""
    t = _table("bundles missing in transit (open gaps)", "channel", "bundle seqs", "since")
    for g in gaps.get("open_transit_gaps", []):
        t.add_row(g["channel"], _ranges([g], "first_bundle_seq", "last_bundle_seq"), _v(g["since"]))
    parts: list[RenderableType] = [t]
    if gaps.get("written_off"):
        w = _table("written off by an operator", "channel", "bundle seqs", "at", "note")
        for g in gaps["written_off"]:
            w.add_row(g["channel"], _ranges([g], "first_bundle_seq", "last_bundle_seq"),
                      _v(g.get("at")), _v(g.get("note")))  # fmt: skip
        parts.append(w)
    d = _table("messages black declared lost", "channel", "seqs", "count", "reason", "bundle")
    for g in gaps.get("declared_by_black", []):
        d.add_row(g["channel"], _ranges([g], "seq_first", "seq_last"), _v(g.get("messages")),
                  _v(g.get("reason")), _v(g.get("bundle_seq")))  # fmt: skip
    parts.append(d)
    udp = gaps.get("udp_transport_gaps")
    if udp:
        from bridge.diode.link_status import gap_objects  # the receiver's rule, as status counts

        u = _table(f"UDP receiver gap records (last 50 of {len(udp)})", "channel", "kind",
                   "seq", "reason", "blocks done", "epoch", "object ids", "objects")  # fmt: skip
        for r in udp[-50:]:
            total = r.get("blocks_total")
            done = _NONE if total is None else f"{r.get('blocks_done')}/{total}"
            last = r.get("object_id_last", r.get("object_id"))  # unseen, summary: lowest-highest
            ids = _ranges([{"lo": r.get("object_id"), "hi": last}], "lo", "hi")
            if r.get("summary") is True:
                ids = f"{ids} (some)"  # a summary counts objects within that range, not all
            u.add_row(_v(r.get("channel")), _v(r.get("kind")), _v(r.get("seq")),
                      _v(r.get("reason")), done, _v(r.get("epoch")), ids,
                      str(gap_objects([r])))  # fmt: skip
        parts.append(u)
    return Group(*parts)


def print_views(views: Iterable[RenderableType], *, console: Console | None = None) -> None:
    """Print the views one after the other (wide enough for the tables when piped)."""
    out = console or make_console(width=None if _is_tty() else 160)
    for v in views:
        out.print(v)


def make_console(**kwargs: Any) -> Console:
    """A console that prints text as it is: names and notes come from the wire and from
    operators, so ``[x]`` is data, never rich markup."""
    return Console(markup=False, highlight=False, **kwargs)


def _is_tty() -> bool:
    import sys

    return sys.stdout.isatty()
