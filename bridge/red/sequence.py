"""Red, sequence checks (pure): duplicates, hash chain, coverage, transit gaps, heartbeats.

Nothing here does I/O or reads a clock: the landing passes ``now`` in and saves the state.
Docs: protocol.md §6 (seqs, gaps, coverage rule, hash chain), §8 (duplicates), §9 (heartbeats).

Per channel the state is a *frontier* that stays small however long the link runs:

- ``contig``: the highest bundle seq n with 1..n all landed, with the plaintext SHA-256 and the
  coverage end ("accounted up to seq") of bundle n (``accounted``: carried across bundles an
  operator wrote off, for reports; the links into the bundles after them are
  ``chain_unverifiable``);
- ``runs``: landed bundles above ``contig`` (only while a hole is open), as runs of
  consecutive bundle seqs keeping just what the links at their two edges still need, so a hole
  that never fills costs one run, not one record per bundle behind it;
- ``gaps``: bundle-seq ranges known to exist but not arrived (lost in transit, so far);
- ``landed``: merged message-seq intervals accounted for (rows and declared gaps), so no seq
  lands twice; normally a single interval ``[0, end]``;
- the last heartbeat and whether the link is silent.

Every link ``(n-1, n)`` is checked exactly once, when its second end lands (two runs join):
``prev_sha256`` of n against the SHA-256 of n-1 (``chain_verified`` / ``chain_broken``, reported
on n) and the coverage of n against the coverage end of n-1 (``coverage_mismatch``). A bundle
without any coverage (no rows, no gaps) passes its predecessor's end on; a coverage check
waiting on such a bundle's end runs when that end becomes known.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from bridge.errors import StateError
from bridge.protocol.manifest import format_utc, parse_utc
from bridge.red.sequence_state import (
    STATE_FORMAT,
    Admission,
    BundleFacts,
    ChannelState,
    Event,
    HeartbeatFacts,
    HeartbeatSeen,
    Interval,
    Retirement,
    Run,
    SequenceState,
    TransitGap,
    Verdict,
    WrittenOff,
)

__all__ = [
    "STATE_FORMAT",
    "Verdict",
    "Lookup",
    "BundleFacts",
    "HeartbeatFacts",
    "Event",
    "Admission",
    "Run",
    "TransitGap",
    "WrittenOff",
    "Retirement",
    "HeartbeatSeen",
    "ChannelState",
    "SequenceState",
    "classify",
    "judge",
    "admit",
    "heartbeat",
    "tick",
    "open_gaps",
    "write_off",
    "retire",
    "seqs_within",
    "accounted",
    "summary",
    "silence_margin",
    "SILENCE_PERIODS",
]

UNSAVED_CAP = 65_536
"""At most this many (channel, bundle_seq) -> sha256 of the current, unsaved landing kept."""

Lookup = Callable[[str, int], str | None]
"""``lookup(channel, bundle_seq)``: the plaintext SHA-256 the ledger holds for a landed bundle."""


# ------------------------------------------------------------------------- intervals


def _add_interval(ivs: list[Interval], lo: int, hi: int) -> list[Interval]:
    """``ivs`` (sorted, disjoint, non-adjacent) with ``[lo, hi]`` merged in."""
    i = bisect.bisect_left(ivs, (lo, lo))
    if i > 0 and ivs[i - 1][1] >= lo - 1:
        i -= 1
    j = i
    while j < len(ivs) and ivs[j][0] <= hi + 1:
        lo, hi = min(lo, ivs[j][0]), max(hi, ivs[j][1])
        j += 1
    return [*ivs[:i], (lo, hi), *ivs[j:]]


def _intersect(ivs: list[Interval], lo: int, hi: int) -> list[Interval]:
    """The parts of ``[lo, hi]`` inside ``ivs``."""
    i = bisect.bisect_left(ivs, (lo, lo))
    if i > 0 and ivs[i - 1][1] >= lo:
        i -= 1
    out: list[Interval] = []
    while i < len(ivs) and ivs[i][0] <= hi:
        a, b = max(lo, ivs[i][0]), min(hi, ivs[i][1])
        if a <= b:
            out.append((a, b))
        i += 1
    return out


# ---------------------------------------------------------------------- classify


def _landed_sha(
    state: SequenceState, channel: str, n: int, lookup: Lookup
) -> tuple[bool, str | None]:
    """(landed?, its plaintext sha256 if known) of bundle ``channel``/``n``."""
    cs = state.channels.get(channel)
    if cs is None:
        return False, None
    if n == cs.contig:
        return True, cs.contig_sha256
    if n > cs.contig:
        run = _run_holding(cs, n)
        if run is None:
            return False, None
        if n == run.hi:
            return True, run.sha256
    sha = state.unsaved.get((channel, n))
    return True, sha if sha is not None else lookup(channel, n)


def judge(state: SequenceState, facts: BundleFacts, lookup: Lookup) -> tuple[Verdict, list[Event]]:
    """``classify`` with the duplicate / conflict event. Does not change ``state``.

    A bundle seq the state says landed, whose SHA-256 neither the state nor ``lookup`` knows,
    is a conflict: it cannot be shown to be the same bundle (fail safe: quarantined).
    """
    landed, sha = _landed_sha(state, facts.channel, facts.bundle_seq, lookup)
    if not landed:
        return "new", []
    kind: Verdict = "duplicate" if sha == facts.sha256 else "conflict"
    ev = Event(
        kind,
        facts.channel,
        facts.bundle_seq,
        reason=None if kind == "duplicate" else "conflict",
        detail={"sha256": facts.sha256, "landed_sha256": sha, "bundle_id": facts.bundle_id},
    )
    return kind, [ev]


def classify(state: SequenceState, facts: BundleFacts, lookup: Lookup) -> Verdict:
    """new / duplicate (same bundle seq, same plaintext) / conflict (another plaintext)."""
    return judge(state, facts, lookup)[0]


# ------------------------------------------------------------------------- admit


def _run_holding(cs: ChannelState, n: int) -> Run | None:
    """The run of landed bundles above ``contig`` that holds bundle seq ``n``, if any."""
    i = bisect.bisect_right([r.lo for r in cs.runs], n) - 1
    return cs.runs[i] if i >= 0 and cs.runs[i].hi >= n else None


def _contig_run(cs: ChannelState) -> Run:
    """``contig`` as a run from the virtual bundle 0 (no plaintext, coverage ends at -1)."""
    return Run(0, cs.contig, None, cs.contig_sha256 or "", cs.contig_end, None)


def _end_of(cs: ChannelState, n: int) -> int | None:
    """Coverage end after bundle ``n`` (the top of what is landed), None when unknown."""
    if n == cs.contig:
        return cs.contig_end
    run = _run_holding(cs, n)
    return run.end if run is not None and run.hi == n else None


def _chain_event(channel: str, n: int, prev: str | None, pred_sha: str | None) -> list[Event]:
    if n == 1 and prev is None:
        return []  # the start of the chain: no link to check
    if prev == pred_sha:
        return [Event("chain_verified", channel, n, detail={"prev_bundle_seq": n - 1})]
    detail = {"prev_bundle_seq": n - 1, "expected_prev_sha256": pred_sha, "prev_sha256": prev}
    return [Event("chain_broken", channel, n, reason="prev_sha256", detail=detail)]


def _coverage_event(channel: str, n: int, first: int, pred_end: int) -> list[Event]:
    want = pred_end + 1
    if first == want:
        return []
    hole = first > want
    return [
        Event(
            "coverage_mismatch",
            channel,
            n,
            seq_first=want if hole else first,
            seq_last=first - 1 if hole else pred_end,
            reason="hole" if hole else "overlap",
            detail={"prev_bundle_seq": n - 1, "expected_first_seq": want, "coverage_first": first},
        )
    ]


def _join(channel: str, left: Run, right: Run) -> tuple[Run, list[Event]]:
    """Join two adjacent runs (``left.hi + 1 == right.lo``): the link between them is complete,
    and so is the coverage check ``right`` waits for if ``left`` knows its end."""
    pred_sha = None if left.hi == 0 else left.sha256
    events = _chain_event(channel, right.lo, right.prev_sha256, pred_sha)
    wait = left.wait
    if right.wait is not None:
        if left.end is not None:
            events += _coverage_event(channel, right.wait[0], right.wait[1], left.end)
        else:  # nothing in ``left`` has coverage: ``right`` keeps waiting, for what is below
            wait = right.wait
    end = right.end if right.end is not None else left.end
    return Run(left.lo, right.hi, left.prev_sha256, right.sha256, end, wait), events


def _place(cs: ChannelState, f: BundleFacts) -> list[Event]:
    """Put bundle n in: join it to the landed run ending at n-1 and the one starting at n+1
    (checking both links), and fold what reaches ``contig`` into the frontier."""
    n, cov = f.bundle_seq, f.coverage
    i = bisect.bisect_right([r.lo for r in cs.runs], n)
    run = Run(n, n, f.prev_sha256, f.sha256, None if cov is None else cov[1],
              None if cov is None else (n, cov[0]))  # fmt: skip
    events: list[Event] = []
    below = cs.runs[i - 1] if i > 0 and cs.runs[i - 1].hi == n - 1 else None
    if below is None and n - 1 == cs.contig:
        below = _contig_run(cs)
    if below is not None:
        run, events = _join(f.channel, below, run)
    above = cs.runs[i] if i < len(cs.runs) and cs.runs[i].lo == n + 1 else None
    if above is not None:
        run, more = _join(f.channel, run, above)
        events += more
    start = i - 1 if below is not None and below.lo > 0 else i
    stop = i + 1 if above is not None else i
    if run.lo == 0:
        if run.end is None:  # cannot happen: the contig run always knows its end
            raise StateError(f"{f.where}: coverage end after bundle {run.hi} is unknown")
        cs.contig, cs.contig_sha256, cs.contig_end = run.hi, run.sha256, run.end
        cs.runs[start:stop] = []
    else:
        cs.runs[start:stop] = [run]
    return events


def _seq_bounds(lo: int | None, hi: int | None) -> tuple[int | None, int | None]:
    if lo is not None and hi is not None and hi < lo:
        return None, None
    return lo, hi


def _open_gap(
    cs: ChannelState, channel: str, first: int, last: int, since: str | None, seq_last: int | None
) -> Event:
    """Open the transit gap ``first..last`` (bundle seqs above ``cs.known``)."""
    below = _end_of(cs, first - 1)
    lo, hi = _seq_bounds(None if below is None else below + 1, seq_last)
    cs.gaps.append(TransitGap(first, last, since))
    cs.known = last
    detail = {"first_bundle_seq": first, "last_bundle_seq": last}
    return Event("gap_opened", channel, None, lo, hi, "transit", detail)


_R = TypeVar("_R", TransitGap, WrittenOff)


def _take(ranges: list[_R], n: int) -> _R | None:
    """Take bundle seq ``n`` out of the range of ``ranges`` holding it (split around ``n``);
    returns that range as it was, or None."""
    for i, r in enumerate(ranges):
        if r.first <= n <= r.last:
            parts = [replace(r, first=a, last=b) for a, b in ((r.first, n - 1), (n + 1, r.last))]
            ranges[i : i + 1] = [x for x in parts if x.first <= x.last]
            return r
    return None


def _close_gap(cs: ChannelState, channel: str, n: int, cov: Interval | None) -> list[Event]:
    lo, hi = cov if cov is not None else (None, None)
    detail: dict[str, Any] = {"first_bundle_seq": n, "last_bundle_seq": n}
    w = _take(cs.written_off, n)  # written off, yet it came
    if w is not None:
        detail |= {"gap_first_bundle_seq": w.first, "gap_last_bundle_seq": w.last,
                   "written_off_at": w.at}  # fmt: skip
        return [Event("gap_closed", channel, n, lo, hi, "written_off", detail)]
    g = _take(cs.gaps, n)
    if g is None:
        return []
    detail |= {"gap_first_bundle_seq": g.first, "gap_last_bundle_seq": g.last, "opened": g.since}
    return [Event("gap_closed", channel, n, lo, hi, "transit", detail)]


def _transit(cs: ChannelState, f: BundleFacts, since: str | None) -> list[Event]:
    n, cov = f.bundle_seq, f.coverage
    if n > cs.known:
        evs = []
        if n > cs.known + 1:
            seq_last = None if cov is None else cov[0] - 1
            evs.append(_open_gap(cs, f.channel, cs.known + 1, n - 1, since, seq_last))
        cs.known = n
        return evs
    return _close_gap(cs, f.channel, n, cov)


def _declared(f: BundleFacts) -> list[Event]:
    evs = [
        Event("gap_declared", f.channel, f.bundle_seq, a, b, reason, {"count": b - a + 1})
        for a, b, reason in f.gaps
    ]
    if f.unaccounted:
        cov = f.coverage
        assert cov is not None
        detail = {"unaccounted": f.unaccounted, "rows": f.rows, "bundle_id": f.bundle_id}
        evs.append(Event("coverage_mismatch", f.channel, f.bundle_seq, cov[0], cov[1],
                         "unaccounted", detail))  # fmt: skip
    return evs


def _overlap(cs: ChannelState, f: BundleFacts) -> tuple[list[Interval], list[Event]]:
    if f.rows == 0 or f.first_seq is None or f.last_seq is None:
        return [], []
    skip = _intersect(cs.landed, f.first_seq, f.last_seq)
    detail = {"bundle_id": f.bundle_id}
    evs = [Event("overlap_skipped", f.channel, f.bundle_seq, a, b, "already_landed", detail)
           for a, b in skip]  # fmt: skip
    return skip, evs


def _count(cs: ChannelState, key: str, k: int = 1) -> None:
    cs.counters[key] = cs.counters.get(key, 0) + k


def _remember(state: SequenceState, f: BundleFacts) -> None:
    state.unsaved[(f.channel, f.bundle_seq)] = f.sha256
    while len(state.unsaved) > UNSAVED_CAP:
        del state.unsaved[next(iter(state.unsaved))]


def admit(state: SequenceState, facts: BundleFacts, now: datetime | None = None) -> Admission:
    """Record a new bundle (``classify`` said "new") as landed; return events and skip ranges.

    ``now`` dates a transit gap this bundle reveals (default: the bundle's ``created_at``).
    """
    if facts.bundle_seq < 1:
        raise StateError(f"{facts.where}: bundle seqs start at 1")
    cs = state.channel(facts.channel)
    n = facts.bundle_seq
    if n <= cs.contig or _run_holding(cs, n) is not None:
        raise StateError(f"{facts.where}: already landed; classify it before admitting it")
    since = format_utc(now) if now is not None else facts.created_at
    events = _transit(cs, facts, since)
    events += _declared(facts)
    skip, overlap_events = _overlap(cs, facts)
    events += overlap_events
    events += _place(cs, facts)
    if _written_off(cs, n - 1):  # its predecessor will never come: the link cannot be checked
        events.append(_unverifiable(cs, facts.channel, n))
    cov = facts.coverage
    if cov is not None:
        cs.landed = _add_interval(cs.landed, *cov)
    cs.highest = max(cs.highest, n)
    _remember(state, facts)
    _count(cs, "bundles")
    _count(cs, "rows", facts.rows)
    _count(cs, "declared_lost", sum(b - a + 1 for a, b, _ in facts.gaps))
    _count(cs, "overlap_seqs", sum(b - a + 1 for a, b in skip))
    for ev in events:
        if ev.kind in ("chain_broken", "coverage_mismatch"):
            _count(cs, ev.kind)
    return Admission(events, skip)


# ---------------------------------------------------------------- heartbeats, silence


def heartbeat(state: SequenceState, hb: HeartbeatFacts, now: datetime) -> list[Event]:
    """Take a verified heartbeat: replay check, link resumed, missing last bundle(s)."""
    cs = state.channel(hb.channel)
    last = cs.heartbeat
    if last is not None and hb.heartbeat_seq <= last.heartbeat_seq:
        detail: dict[str, Any] = {
            "heartbeat_seq": hb.heartbeat_seq,
            "last_heartbeat_seq": last.heartbeat_seq,
        }
        return [Event("heartbeat_replayed", hb.channel, reason="stale", detail=detail)]
    at = format_utc(now)
    events: list[Event] = []
    if cs.silent:
        quiet_since = last.received_at if last is not None else cs.watch_since
        resumed = {"heartbeat_seq": hb.heartbeat_seq, "last_heard_at": quiet_since}
        events.append(Event("link_resumed", hb.channel, detail=resumed))
        cs.silent = False
    cs.heartbeat = HeartbeatSeen(
        hb.heartbeat_seq, hb.last_bundle_seq, hb.last_seq, hb.black_time, at, hb.interval_seconds
    )
    _count(cs, "heartbeats")
    top = hb.last_bundle_seq
    if top is not None and top > cs.known:
        gap = _open_gap(cs, hb.channel, cs.known + 1, top, at, hb.last_seq)
        detail = {**gap.detail, "heartbeat_seq": hb.heartbeat_seq}
        missing = replace(gap, kind="missing_last_bundle", detail=detail)
        events += [gap, missing]
    return events


def tick(
    state: SequenceState, now: datetime, silent_seconds: float, channels: Iterable[str] = ()
) -> list[Event]:
    """``link_silent`` (once per silence) for every channel not heard from for too long.

    Channels named in ``channels`` are watched from the first tick even before any heartbeat.
    A retired channel is not watched; named in ``channels`` again (configured again), it is
    reinstated (``channel_reinstated``) and watched from ``now``.
    """
    events: list[Event] = []
    configured = set(channels)
    for name in sorted(set(state.channels) | configured):
        cs = state.channel(name)
        if cs.retired is not None:
            if name not in configured:
                continue
            was = {"retired_at": cs.retired.at, "retired_note": cs.retired.note}
            events.append(Event("channel_reinstated", name, reason="configured", detail=was))
            cs.retired, cs.silent, cs.watch_since = None, False, format_utc(now)
            continue
        heard = cs.heartbeat.received_at if cs.heartbeat is not None else None
        ref = max(
            (t for t in (heard, cs.watch_since) if t is not None), key=parse_utc, default=None
        )
        if ref is None:
            cs.watch_since = format_utc(now)
            continue
        quiet = (now - parse_utc(ref)).total_seconds()
        if cs.silent or quiet <= silent_seconds:
            continue
        cs.silent = True
        seq = None if cs.heartbeat is None else cs.heartbeat.heartbeat_seq
        detail: dict[str, Any] = {
            "last_heard_at": ref, "quiet_seconds": quiet, "last_heartbeat_seq": seq
        }  # fmt: skip
        if cs.heartbeat is not None and cs.heartbeat.interval_seconds > 0:
            period = cs.heartbeat.interval_seconds  # black's own word on its period
            detail["heartbeat_interval_seconds"] = period
            detail["missed_heartbeats"] = int(quiet // period)
        events.append(Event("link_silent", name, reason="no_heartbeat", detail=detail))
    return events


SILENCE_PERIODS = 2.0
"""``red.link_silent_seconds`` below this many of black's heartbeat periods calls a link
silent after one late or lost heartbeat: :func:`silence_margin` says so."""


def silence_margin(channel: str, interval_seconds: float, silent_seconds: float) -> str | None:
    """Why ``red.link_silent_seconds`` is too short for the heartbeat period a channel's
    heartbeats declare (``interval_seconds``), with the fix; None when it leaves room."""
    if interval_seconds <= 0 or silent_seconds >= SILENCE_PERIODS * interval_seconds:
        return None
    advice = max(3 * interval_seconds, silent_seconds)
    return (
        f"channel {channel}: black sends a heartbeat every {interval_seconds:g} s (its "
        "heartbeats say so: black.heartbeat_seconds, or `diode black heartbeat --every`) but "
        f"red.link_silent_seconds is {silent_seconds:g} s, "
        f"under {SILENCE_PERIODS:g} periods: one late or lost heartbeat raises link_silent; "
        f"set red.link_silent_seconds to {advice:g} or more (a few periods)"
    )


# ------------------------------------------------------------------------- write-off


def seqs_within(ranges: Iterable[TransitGap | WrittenOff], first: int, last: int) -> int:
    """How many bundle seqs of ``first..last`` the (disjoint) ``ranges`` hold."""
    return sum(max(0, min(r.last, last) - max(r.first, first) + 1) for r in ranges)


def write_off(
    state: SequenceState, channel: str, first: int, last: int, note: str, now: datetime
) -> list[Event]:
    """Declare the open transit gap bundles ``first..last`` of ``channel`` lost for good (black
    no longer has them): they leave the open gaps, one ``gap_written_off`` event per open gap
    they cut. StateError, naming the open gaps, when the range is not entirely open."""
    cs = state.channels.get(channel)
    where = f"channel {channel!r} bundle seqs {first}..{last}"
    if first < 1 or last < first:
        raise StateError(f"{where}: not a range of bundle seqs (1 <= first <= last)")
    gaps = cs.gaps if cs is not None else []
    if cs is None or seqs_within(gaps, first, last) != last - first + 1:
        listed = ", ".join(f"{g.first}..{g.last}" for g in gaps) or "none"
        raise StateError(
            f"{where}: not all in an open transit gap (open gaps of {channel!r}: {listed}); "
            "only bundles red is still waiting for can be written off"
        )
    at = format_utc(now)
    events: list[Event] = []
    kept: list[TransitGap] = []
    for g in gaps:
        a, b = max(g.first, first), min(g.last, last)
        if a > b:
            kept.append(g)
            continue
        kept += [
            TransitGap(x, y, g.since) for x, y in ((g.first, a - 1), (b + 1, g.last)) if x <= y
        ]
        detail = {"first_bundle_seq": a, "last_bundle_seq": b, "opened": g.since, "note": note}
        events.append(Event("gap_written_off", channel, None, None, None, "operator", detail))
    cs.gaps = kept
    cs.written_off.append(WrittenOff(first, last, at, note))
    cs.written_off.sort(key=lambda w: w.first)
    above = _run_holding(cs, last + 1)
    if above is not None and above.lo == last + 1:  # landed, waiting for a link now lost
        events.append(_unverifiable(cs, channel, last + 1))
    return events


def _written_off(cs: ChannelState, n: int) -> bool:
    """Bundle ``n`` is written off (and has not arrived since)."""
    return any(w.first <= n <= w.last for w in cs.written_off)


def _unverifiable(cs: ChannelState, channel: str, n: int) -> Event:
    """The link into bundle ``n`` can never be checked: bundle n-1 was written off."""
    _count(cs, "chain_unverifiable")
    detail = {"prev_bundle_seq": n - 1}
    return Event("chain_unverifiable", channel, n, reason="written_off", detail=detail)


def accounted(cs: ChannelState) -> int:
    """The highest bundle seq n with each of 1..n landed or written off: ``contig`` carried
    across written-off ranges and the landed runs right above them."""
    n = cs.contig
    starts = {r.lo: r.hi for r in cs.runs}
    offs = {w.first: w.last for w in cs.written_off}
    while True:
        if n + 1 in offs:
            n = offs[n + 1]
        elif n + 1 in starts:
            n = starts[n + 1]
        else:
            return n


def retire(
    state: SequenceState, channel: str, note: str, now: datetime, configured: Iterable[str]
) -> list[Event]:
    """Retire ``channel`` (no longer configured on red): its open gaps are written off with
    ``note`` (``gap_written_off`` each), then ``channel_retired``; silence is no longer
    watched. StateError when red never saw the channel, it is still in ``configured`` (red's
    channels) or it is retired already."""
    cs = state.channels.get(channel)
    if cs is None:
        known = sorted(state.channels) or "none"
        raise StateError(f"channel {channel!r} is unknown to red's state (channels: {known})")
    if channel in set(configured):
        raise StateError(
            f"channel {channel!r} is still in red's [[channels]]: remove it from the config "
            "first (its files are then quarantined as unknown_channel), then retire it"
        )
    if cs.retired is not None:
        raise StateError(f"channel {channel!r} was retired already at {cs.retired.at}")
    events: list[Event] = []
    gaps = [(g.first, g.last) for g in cs.gaps]
    for first, last in gaps:
        events += write_off(state, channel, first, last, note, now)
    detail = {
        "note": note,
        "gaps_written_off": [list(g) for g in gaps],
        "contig": cs.contig,
        "highest": cs.highest,
        "known": cs.known,
        "was_silent": cs.silent,
    }
    events.append(Event("channel_retired", channel, None, None, None, "operator", detail))
    cs.retired, cs.silent = Retirement(format_utc(now), note), False
    return events


# ------------------------------------------------------------------------- reports


def open_gaps(state: SequenceState) -> list[dict[str, Any]]:
    """Every open transit gap: bundle seqs known to exist that have not arrived."""
    return [
        {"channel": name, "first_bundle_seq": g.first, "last_bundle_seq": g.last, "since": g.since}
        for name, cs in sorted(state.channels.items())
        for g in cs.gaps
    ]


def summary(state: SequenceState) -> dict[str, dict[str, Any]]:
    """Per channel: frontier, open gaps, accounted message seqs, heartbeat, counters."""
    out: dict[str, dict[str, Any]] = {}
    for name, cs in sorted(state.channels.items()):
        hb = cs.heartbeat
        out[name] = {
            "contig": cs.contig,
            "accounted": accounted(cs),
            "highest": cs.highest,
            "known": cs.known,
            "landed_above": [[r.lo, r.hi] for r in cs.runs],
            "open_gaps": [
                {"first_bundle_seq": g.first, "last_bundle_seq": g.last, "since": g.since}
                for g in cs.gaps
            ],
            "written_off": [
                {"first_bundle_seq": w.first, "last_bundle_seq": w.last, "at": w.at, "note": w.note}
                for w in cs.written_off
            ],
            "accounted_seqs": sum(b - a + 1 for a, b in cs.landed),
            "seq_range": [cs.landed[0][0], cs.landed[-1][1]] if cs.landed else None,
            "seq_holes": max(len(cs.landed) - 1, 0),
            "last_heartbeat": None if hb is None else hb.brief(),
            "silent": cs.silent,
            "retired": None
            if cs.retired is None
            else {"at": cs.retired.at, "note": cs.retired.note},
            "counters": dict(cs.counters),
        }
    return out
