"""Red, replay hold-back (pure): holes from the landing's state, the release cut, publish order."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.red import sequence as sq
from bridge.red.holdback import (
    GapView,
    HoldSince,
    Hole,
    out_of_order,
    plan_release,
    publish_order,
)

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def facts(n: int, first: int, last: int, channel: str = "c1") -> sq.BundleFacts:
    return sq.BundleFacts(channel, n, f"id{n}", f"{n:064x}", None, last - first + 1, first, last)


def state_with(*bundles: tuple[int, int, int], channel: str = "c1") -> sq.SequenceState:
    st_ = sq.SequenceState()
    for n, a, b in bundles:
        sq.admit(st_, facts(n, a, b, channel), T0)
    return st_


# -- holes -----------------------------------------------------------------------------------


def test_holes_come_from_the_runs_above_the_contiguous_frontier() -> None:
    s = state_with((1, 0, 9), (2, 10, 19), (4, 30, 39), (5, 40, 49), (8, 70, 79))
    view = GapView.from_state(7, s)
    assert view.land_seq == 7
    assert view.holes == {"c1": (Hole(3, 3, 30), Hole(6, 7, 70))}
    assert view.blocking("c1", 25, -1) is None  # below every hole
    assert view.blocking("c1", 30, -1) == Hole(3, 3, 30)
    assert view.blocking("c1", 75, -1) == Hole(3, 3, 30)  # the lowest hole not passed
    assert view.blocking("c1", 75, 30) == Hole(6, 7, 70)
    assert view.blocking("c1", 45, 30) is None
    assert view.blocking("c2", 75, -1) is None
    assert view.highest_under("c1", 75) == 70 and view.highest_under("c1", 5) == -1


def test_a_missing_first_bundle_is_a_hole_and_filled_holes_vanish() -> None:
    s = state_with((2, 10, 19))
    assert GapView.from_state(1, s).holes == {"c1": (Hole(1, 1, 10),)}
    sq.admit(s, facts(1, 0, 9), T0)
    assert GapView.from_state(2, s).holes == {}


# -- the release cut -------------------------------------------------------------------------

VIEW = GapView(9, {"c1": (Hole(3, 3, 30),)})


def test_rows_above_a_young_hole_wait_and_rows_of_other_channels_before_them_go() -> None:
    passed: dict[str, int] = {}
    chans = ["c2", "c1", "c1", "c2"]
    seqs = [5, 31, 32, 6]
    landed = [0, 1_000, 1_000, 1_000]
    rel = plan_release(chans, seqs, landed, VIEW, passed, now_us=1_500, hold_us=1_000)
    assert rel.count == 1 and rel.passed == ()
    assert rel.held is not None and rel.held[:3] == (1, "c1", 31) and rel.held[4] == 2_000
    assert passed == {}


def test_an_expired_hold_passes_the_hole_once_and_later_rows_above_it_flow() -> None:
    passed: dict[str, int] = {}
    chans = ["c1", "c1", "c1"]
    seqs = [31, 32, 40]
    landed = [1_000, 5_000, 9_000]  # later rows landed later: they do not start a new wait
    rel = plan_release(chans, seqs, landed, VIEW, passed, now_us=2_100, hold_us=1_000)
    assert rel.count == 3 and rel.held is None
    assert [(p.index, p.seq, p.held_us) for p in rel.passed] == [(0, 31, 1_100)]
    assert passed == {"c1": 30}
    again = plan_release(["c1"], [50], [9_000], VIEW, passed, now_us=9_001, hold_us=1_000)
    assert again.count == 1 and again.passed == () and again.held is None


def test_hold_zero_never_waits() -> None:
    rel = plan_release(["c1"], [31], [10], VIEW, {}, now_us=10, hold_us=0)
    assert rel.count == 1 and len(rel.passed) == 1


S = 1_000_000  # µs
NOW = 1_800_000_000 * S  # wall clock, µs since the epoch
MONO = 5_000 * S  # monotonic clock, µs


def test_a_landed_at_in_the_future_is_held_from_now_not_from_then() -> None:
    """The wall clock stepped back an hour after the row landed: without the replay's
    monotonic state, the hold ends ``hold`` after now (it ended an hour and ``hold`` later)."""
    rel = plan_release(["c1"], [31], [NOW + 3600 * S], VIEW, {}, NOW, 30 * S)
    assert rel.held is not None and rel.held[4] == NOW + 30 * S


def test_a_clock_stepped_back_holds_no_longer_than_the_hold_by_the_monotonic_clock() -> None:
    since: HoldSince = {}
    landed = [NOW + 3600 * S]  # landed "an hour from now": the clock was stepped back
    rel = plan_release(["c1"], [31], landed, VIEW, {}, NOW, 30 * S, since=since, mono_us=MONO)
    assert rel.held is not None and rel.held[4] == NOW + 30 * S
    assert since == {("c1", 30): MONO}
    passed: dict[str, int] = {}
    rel = plan_release(["c1"], [31], landed, VIEW, passed, NOW + 29 * S, 30 * S, since=since,
                       mono_us=MONO + 29 * S)  # fmt: skip
    assert rel.count == 0
    rel = plan_release(["c1"], [31], landed, VIEW, passed, NOW + 30 * S, 30 * S, since=since,
                       mono_us=MONO + 30 * S)  # fmt: skip
    assert rel.count == 1 and [(p.seq, p.held_us) for p in rel.passed] == [(31, 30 * S)]
    assert passed == {"c1": 30} and since == {}  # a hole passed is forgotten


def test_a_clock_stepped_forward_does_not_cut_the_hold_short() -> None:
    since: HoldSince = {}
    landed = [NOW - 10 * S]  # landed 10 s ago: 20 s left
    rel = plan_release(["c1"], [31], landed, VIEW, {}, NOW, 30 * S, since=since, mono_us=MONO)
    assert rel.held is not None and rel.held[4] == NOW + 20 * S
    step = 3600 * S  # the wall clock jumps an hour ahead one second later
    rel = plan_release(["c1"], [31], landed, VIEW, {}, NOW + step + S, 30 * S, since=since,
                       mono_us=MONO + S)  # fmt: skip
    assert rel.count == 0 and rel.held is not None and rel.held[4] == NOW + step + 20 * S
    rel = plan_release(["c1"], [31], landed, VIEW, {}, NOW + step + 20 * S, 30 * S,
                       since=since, mono_us=MONO + 20 * S)  # fmt: skip
    assert rel.count == 1 and rel.passed[0].held_us == 30 * S


def test_holds_of_holes_that_vanished_are_forgotten() -> None:
    since: HoldSince = {("c1", 30): MONO, ("c2", 7): MONO}
    plan_release(["c1"], [31], [NOW], VIEW, {}, NOW, 30 * S, since=since, mono_us=MONO + S)
    assert since == {("c1", 30): MONO}  # c2's hole filled; c1's still counts from MONO


# -- publish order ---------------------------------------------------------------------------

rows_st = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 60)), max_size=40, unique=True
)


@settings(max_examples=300, deadline=None)
@given(rows_st, st.data())
def test_publish_order_sorts_each_channel_and_marks_a_true_prefix(
    rows: list[tuple[str, int]], data: st.DataObject
) -> None:
    keyed = data.draw(st.integers(0, len(rows)))
    chans = [c for c, _ in rows]
    seqs = [s for _, s in rows]
    order, marks = publish_order(chans, seqs, keyed)
    assert sorted(order) == list(range(len(rows)))  # a permutation
    for ch in set(chans):  # each channel by seq, in the positions it had
        pos = [i for i, c in enumerate(chans) if c == ch]
        assert [order[i] for i in pos] == sorted(pos, key=lambda i: seqs[i])
    published: set[int] = set()
    for k, row in enumerate(order):
        published.add(row)
        m = marks[k]
        assert set(range(m)) <= published  # the first m keyed rows are all out
        assert m == keyed or m not in published  # and m is the longest such prefix
    assert marks == sorted(marks)
    if rows:
        assert marks[-1] == keyed


def test_publish_order_is_the_identity_when_nothing_is_out_of_order() -> None:
    assert publish_order(["a", "b", "a"], [1, 1, 2], 3) == ([0, 1, 2], [1, 2, 3])


def test_a_filler_goes_first_and_the_progress_waits_for_it() -> None:
    # keyed rows: seqs 20, 21 of c1 (landed first); filler: seq 10 (landed later)
    order, marks = publish_order(["c1", "c1", "c1"], [20, 21, 10], 2)
    assert order == [2, 0, 1]
    assert marks == [0, 1, 2]


# -- out of order ----------------------------------------------------------------------------


def test_out_of_order_reports_rows_below_the_highest_published() -> None:
    high = {"c1": 29}
    found = out_of_order(["c1", "c1", "c2", "c1"], [10, 19, 3, 30], high)
    assert set(found) == {"c1"}
    o = found["c1"]
    assert (o.first, o.last, o.rows, o.behind) == (10, 19, 2, 29)
    assert high == {"c1": 30, "c2": 3}
