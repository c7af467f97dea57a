"""UDP receiver's unseen-object bookkeeping (``udp_unseen``), pure: id ranges against a set,
an epoch's ledger against its promises (never early, never a seen id, each id once, every
claimed id settled), the state file across a restart, and a start without any state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.diode import udp_unseen
from bridge.diode.udp_unseen import EpochLedger, IdRanges, UnseenTracker

IDS = st.integers(0, 60)


def _covered(r: IdRanges) -> set[int]:
    return {i for lo, hi in r.ranges() for i in range(lo, hi)}


def _well_formed(r: IdRanges) -> None:
    """Sorted, non-empty, disjoint and non-touching (so each set has one form)."""
    rs = r.ranges()
    assert all(lo < hi for lo, hi in rs)
    assert all(a[1] < b[0] for a, b in zip(rs, rs[1:], strict=False)), rs


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), IDS, st.integers(0, 8)),
            st.tuples(st.just("drop_below"), IDS, st.just(0)),
        ),
        max_size=40,
    ),
    IDS,
    IDS,
)
def test_id_ranges_behave_as_the_set_of_their_ids(
    ops: list[tuple[str, int, int]], lo: int, span: int
) -> None:
    r, model = IdRanges(), set()
    for op, a, n in ops:
        if op == "add":
            r.add(a, a + n)
            model |= set(range(a, a + n))
        else:
            r.drop_below(a)
            model = {i for i in model if i >= a}
        _well_formed(r)
        assert _covered(r) == model
    assert all((i in r) == (i in model) for i in range(-1, 80))
    hi = lo + span
    holes = r.holes(lo, hi)
    _well_formed(IdRanges(holes))
    assert {i for a, b in holes for i in range(a, b)} == set(range(lo, hi)) - model
    assert len(holes) <= len(r) + 1


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("mark"), IDS),
        st.tuples(st.just("announce"), IDS),
        st.tuples(st.just("due"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(EVENTS, st.lists(st.floats(0, 3), min_size=60, max_size=60), st.sampled_from([0.0, 2.5]))
def test_an_epoch_ledger_reports_each_unseen_claimed_id_once_and_never_early(
    events: list[tuple[str, int]], steps: list[float], grace: float
) -> None:
    """Random marks (ids seen), heartbeats (announce ``objects_started``) and checks, at
    increasing times: a reported id was claimed at least ``grace`` s before (by a later id
    seen, or a heartbeat), was never seen before it was reported, is reported once; at the
    end every id below the settled point was seen or reported."""
    led = EpochLedger()
    now = 0.0
    evidence: dict[int, float] = {}  # id -> first time something claimed it
    seen: set[int] = set()
    reported: list[int] = []
    announced = False

    def evident(bound: int) -> None:
        for i in range(bound):
            evidence.setdefault(i, now)

    def check(t: float) -> None:
        for lo, hi in led.due(t, grace):
            for i in range(lo, hi):
                assert i in evidence and evidence[i] + grace <= t, (i, evidence.get(i), t)
                assert i not in seen, f"id {i} was seen, then reported"
                reported.append(i)

    for (kind, x), step in zip(events, steps, strict=False):
        now += step
        if kind == "mark":
            assert led.mark(x, now) == (x in reported)  # True: it arrives after all
            seen.add(x)
            if not announced:
                evident(x + 1)
        elif kind == "announce":
            led.announce(x, {"u1": {}}, now)
            announced = True
            evident(x)
        else:
            check(now)
    check(now + grace + 2)  # every claim is due by now
    assert len(reported) == len(set(reported)), "an id was reported twice"
    assert not led.claims
    base = led.base or 0
    assert set(range(base)) <= seen | set(reported)
    assert not set(reported) - set(range(base))
    if announced:
        assert led.channel == "u1"


def test_claims_are_coalesced_per_second_and_a_huge_hole_is_one_range() -> None:
    led = EpochLedger()
    for i in range(10_000):
        led.mark(2 * i, 100.5 + i / 100_000)  # holes at every odd id, within one second
    assert len(led.claims) == 1 and len(led.marked) == 10_000
    led.announce(1 << 62, {"u1": {}, "u2": {}}, 200.5)
    assert led.claims == [(1 << 62, 201.0)] and led.channel is None
    assert led.due(201.9, 1.0) == [] and led.due(202.0, 1.0)[-1] == (19_999, 1 << 62)
    assert led.base == 1 << 62 and len(led.marked) == 0


def test_seen_ranges_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(udp_unseen, "MAX_RANGES", 5)
    led = EpochLedger()
    for i in range(10):
        led.mark(10 * i, 1.0)
    assert [lo for lo, _ in led.marked.ranges()] == [0, 10, 20, 30, 40]


def test_the_state_file_brings_a_tracker_back_as_it_was(tmp_path: Path) -> None:
    t = UnseenTracker(tmp_path)
    assert t.adopting
    t.seen(7, 0, 10.0)  # the first evidence: checked from id 0 on
    t.heard(7, 4, {"u1": {}}, 10.0)
    for oid in (1, 3, 5):
        t.seen(7, oid, 10.0)
    assert [r["object_id"] for r in t.due(12.0, 1.0)] == [2]
    assert t.save_due(12.0) and t.save(12.0, 321) and not t.save_due(13.0)
    doc = json.loads((tmp_path / udp_unseen.STATE).read_text())
    assert doc["gaps_offset"] == 321 and doc["current"] == 7
    again = UnseenTracker(tmp_path)
    assert not again.adopting and again.gaps_offset == 321
    assert again.ledgers[7].to_json() == t.ledgers[7].to_json()
    assert again.seen(7, 2, 20.0)  # recorded unseen before the restart: it arrived after all
    again.heard(7, 6, {"u1": {}}, 20.0)
    assert again.due(30.0, 1.0) == [
        {"epoch": 7, "object_id": 4, "object_id_last": 4, "objects": 1,
         "evidence": "heartbeat", "channel": "u1"}
    ]  # fmt: skip


def test_without_a_state_only_the_newest_epoch_is_checked_from_its_lowest_id(
    tmp_path: Path,
) -> None:
    """After an upgrade (or with a new spool) the journals tell which ids were seen, not
    which were lost long ago: the newest epoch is checked from its lowest id on."""
    (tmp_path / udp_unseen.STATE).write_text("{not json")
    t = UnseenTracker(tmp_path)
    assert t.adopting
    t.recovered([(5, 40), (5, 41), (9, 120), (9, 122)], [(9, 123, 125)], 50.0)
    assert set(t.ledgers) == {9} and t.ledgers[9].base == 120
    t.heard(9, 130, {"u1": {}}, 50.0)
    assert [(r["object_id"], r["object_id_last"]) for r in t.due(60.0, 1.0)] == [
        (121, 121),
        (126, 129),
    ]
    assert t.seen(9, 124, 60.0) and not t.seen(5, 39, 60.0)  # an untracked older epoch
    t.seen(10, 3, 61.0)  # a new epoch: checked from id 0
    assert t.ledgers[10].base == 0 and t.current == 10


def test_a_new_epoch_retires_the_old_one_once_nothing_is_pending(tmp_path: Path) -> None:
    t = UnseenTracker(tmp_path)
    t.seen(1, 0, 10.0)
    t.heard(1, 3, {"u1": {}}, 10.0)
    t.heard(2, 0, {"u1": {}}, 10.5)  # the sender restarted: epoch 1's claim is still pending
    assert set(t.ledgers) == {1, 2}
    assert [(r["epoch"], r["object_id"], r["objects"]) for r in t.due(13.0, 1.0)] == [(1, 1, 2)]
    assert set(t.ledgers) == {1, 2}  # kept while it has records to recognise a late arrival
    for e in range(3, 3 + udp_unseen.MAX_EPOCHS + 1):
        t.seen(e, 0, 20.0)
    assert len(t.ledgers) <= udp_unseen.MAX_EPOCHS and 1 not in t.ledgers
