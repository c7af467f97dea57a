"""Red, replay hold-back (pure): which landed rows wait for an open gap; the publish order.

The landing's sequence state knows, per channel, the runs of bundles landed above a hole (a
transit gap: bundle seqs known to exist that have not arrived). Rows of a run sit *above* that
hole: publishing them first would put later messages before earlier ones on red. The replay
publisher therefore holds an exchange at the first such row until the hole fills or the row
has been landed for ``red.replay.gap_hold_seconds``; then it goes past the hole (an audited
``replay_gap_passed``), and rows that fill the hole later are published when they land
(audited ``replayed_out_of_order``). A hole an operator wrote off (``diode red write-off``)
holds nothing. Runbook §15.1, docs/red-tables.md §3.

Nothing here reads a clock or a file: the replay passes ``now`` (wall and monotonic) and the
state in, including :data:`HoldSince`, the monotonic start of each hold, which lives as long as
the replay process (see :func:`plan_release` for how the two clocks combine).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bridge.red.sequence import SequenceState, seqs_within

__all__ = [
    "Hole",
    "GapView",
    "HoldSince",
    "Release",
    "Passed",
    "plan_release",
    "publish_order",
    "OutOfOrder",
    "out_of_order",
]


HoldSince = dict[tuple[str, int], int]
"""Per ``(channel, hole resume)``: the monotonic µs the running replay counts that hole's hold
from. Kept by the replay for its process's life (not saved: after a restart the wall clock
gives the start again); :func:`plan_release` fills and prunes it."""


@dataclass(frozen=True)
class Hole:
    """Bundles ``first_bundle_seq..last_bundle_seq`` of a channel missing below a landed run;
    rows with ``seq >= resume`` (the first message seq of that run) sit above it."""

    first_bundle_seq: int
    last_bundle_seq: int
    resume: int


@dataclass(frozen=True)
class GapView:
    """The holes of every channel as of landing ``land_seq`` (rows of later landings are not
    judged yet: the replay reads no further than ``land_seq``)."""

    land_seq: int
    holes: Mapping[str, tuple[Hole, ...]]
    """Per channel, ascending by ``resume``."""

    @classmethod
    def from_state(cls, land_seq: int, state: SequenceState) -> GapView:
        holes: dict[str, tuple[Hole, ...]] = {}
        for name, cs in state.channels.items():
            found: list[Hole] = []
            below = cs.contig
            for run in cs.runs:
                first, last = below + 1, run.lo - 1
                # a hole an operator wrote off entirely has nothing to wait for
                lost = seqs_within(cs.written_off, first, last)
                if run.wait is not None and lost < last - first + 1:  # rows above the hole
                    found.append(Hole(first, last, run.wait[1]))
                below = run.hi
            if found:
                holes[name] = tuple(sorted(found, key=lambda h: h.resume))
        return cls(land_seq, holes)

    def blocking(self, channel: str, seq: int, passed: int) -> Hole | None:
        """The lowest hole of ``channel`` under ``seq`` not yet passed (``resume > passed``)."""
        holes = self.holes.get(channel)
        if not holes:
            return None
        resumes = [h.resume for h in holes]
        i = bisect.bisect_right(resumes, seq)  # holes[:i] lie under seq
        if i == 0 or resumes[i - 1] <= passed:
            return None
        return holes[bisect.bisect_right(resumes, passed)]

    def highest_under(self, channel: str, seq: int) -> int:
        """The highest ``resume`` of ``channel``'s holes at or under ``seq`` (passing them)."""
        holes = self.holes.get(channel, ())
        resumes = [h.resume for h in holes]
        i = bisect.bisect_right(resumes, seq)
        return resumes[i - 1] if i else -1


@dataclass(frozen=True)
class Passed:
    """The exchange went past ``hole`` at row ``index`` (``channel``, ``seq``) after holding it
    ``held_us`` microseconds (counted as :func:`plan_release` says)."""

    index: int
    channel: str
    seq: int
    hole: Hole
    held_us: int


@dataclass(frozen=True)
class Release:
    """``count``: rows (in the order given) that may be published now; ``held``: the row that
    waits (index, channel, seq, hole, when its wait ends in µs since the epoch) or None."""

    count: int
    passed: tuple[Passed, ...]
    held: tuple[int, str, int, Hole, int] | None


def plan_release(
    channels: Sequence[str],
    seqs: Sequence[int],
    landed_at_us: Sequence[int],
    view: GapView,
    passed: dict[str, int],
    now_us: int,
    hold_us: int,
    *,
    since: HoldSince | None = None,
    mono_us: int | None = None,
) -> Release:
    """Walk rows in replay order; stop at the first row above a hole of its channel that is
    still within its hold. Rows above holes whose hold ran out pass them: ``passed[channel]``
    is raised to the highest ``resume`` passed (so later rows above the same hole flow).

    How long a hole has been held, so that a step of the wall clock can neither stretch the
    hold without bound nor cut it short:

    - the first time the running replay finds a hole holding (no entry in ``since``), the wall
      clock says how long its first row has waited already: ``now_us - landed_at``, counted
      as 0 for a ``landed_at`` in the future (a clock stepped back) and as at most ``hold_us``;
      the hold's start is recorded in ``since`` on the monotonic clock (``mono_us`` minus that);
    - from then on only the monotonic clock counts: the hole is passed once ``mono_us`` is
      ``hold_us`` past that start. A wall clock stepped back or forward while the replay runs
      changes nothing; after a restart (``since`` empty) the wall clock is read once again.

    So a hole is held at most ``hold_us`` of this process's time after it was first seen, and
    at least what the wall clock said was left then. Without ``since`` (or ``mono_us``) the
    wall clock alone decides, row by row, as of ``now_us``. ``since`` forgets holes that are
    passed or no longer in ``view``."""
    if since is not None:
        _forget(since, view, passed)
    if not view.holes or not any(c in view.holes for c in set(channels)):
        return Release(len(channels), (), None)
    went: list[Passed] = []
    for i, (ch, seq) in enumerate(zip(channels, seqs, strict=True)):
        hole = view.blocking(ch, seq, passed.get(ch, -1))
        if hole is None:
            continue
        waited = max(now_us - landed_at_us[i], 0)  # by the wall clock, now
        if since is not None and mono_us is not None:
            key = (ch, hole.resume)
            if key in since:
                waited = mono_us - since[key]
            else:  # first seen holding: the wall clock, read once, gives the start
                since[key] = mono_us - min(waited, hold_us)
        if waited < hold_us:
            return Release(i, tuple(went), (i, ch, seq, hole, now_us + hold_us - waited))
        went.append(Passed(i, ch, seq, hole, waited))
        passed[ch] = max(passed.get(ch, -1), view.highest_under(ch, seq))
        if since is not None:
            _forget(since, view, passed)
    return Release(len(channels), tuple(went), None)


def _forget(since: HoldSince, view: GapView, passed: Mapping[str, int]) -> None:
    """Drop from ``since`` the holes passed already or gone from ``view`` (filled, written off)."""
    for ch, resume in list(since):
        live = any(h.resume == resume for h in view.holes.get(ch, ()))
        if not live or resume <= passed.get(ch, -1):
            del since[(ch, resume)]


def publish_order(
    channels: Sequence[str], seqs: Sequence[int], keyed: int
) -> tuple[list[int], list[int]]:
    """The order to publish rows so each channel's rows go out by seq, and the progress after each.

    Rows ``0..keyed-1`` are in replay-key order; rows from ``keyed`` on are *fillers*, read
    ahead of their key because they hold lower seqs. Each channel keeps the positions its rows
    have, filled with its rows sorted by seq, so channels interleave as before.

    Returns ``order`` (row indices in publish order) and ``marks``: after publishing
    ``order[:k+1]``, the first ``marks[k]`` keyed rows are all published (the confirmed prefix
    the progress may advance to once they are confirmed)."""
    n = len(channels)
    by: dict[str, list[int]] = {}
    for i, ch in enumerate(channels):
        by.setdefault(ch, []).append(i)
    order = list(range(n))
    for idx in by.values():
        ranked = sorted(idx, key=lambda i: (seqs[i], i))
        for pos, row in zip(idx, ranked, strict=True):
            order[pos] = row
    if keyed == n and order == list(range(n)):
        return order, list(range(1, n + 1))
    done = [False] * keyed
    marks: list[int] = []
    ptr = 0
    for row in order:
        if row < keyed:
            done[row] = True
            while ptr < keyed and done[ptr]:
                ptr += 1
        marks.append(ptr)
    return order, marks


@dataclass
class OutOfOrder:
    """Rows of one channel published below a seq already published to the exchange."""

    first: int
    last: int
    rows: int
    behind: int
    """The highest seq of the channel published before the first of them."""


def out_of_order(
    channels: Sequence[str], seqs: Sequence[int], high: dict[str, int]
) -> dict[str, OutOfOrder]:
    """Rows (in publish order) whose seq is below their channel's highest published seq;
    ``high`` is raised as rows go."""
    found: dict[str, OutOfOrder] = {}
    for ch, seq in zip(channels, seqs, strict=True):
        top = high.get(ch, -1)
        if seq < top:
            o = found.get(ch)
            if o is None:
                found[ch] = OutOfOrder(seq, seq, 1, top)
            else:
                o.first, o.last, o.rows = min(o.first, seq), max(o.last, seq), o.rows + 1
        else:
            high[ch] = seq
    return found
