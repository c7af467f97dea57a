"""Red, sequence write-off (pure): an operator declares missing bundles lost for good."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from bridge.errors import StateError
from bridge.red import sequence as sq
from bridge.red.holdback import GapView, Hole

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
T1 = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)


def facts(n: int, first: int, last: int) -> sq.BundleFacts:
    return sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", None, last - first + 1, first, last)


def with_gap() -> sq.SequenceState:
    """Bundles 1 and 6 landed: 2..5 open."""
    s = sq.SequenceState()
    sq.admit(s, facts(1, 0, 9), T0)
    sq.admit(s, facts(6, 50, 59), T0)
    return s


def test_writing_off_part_of_a_gap_leaves_the_rest_open_and_round_trips() -> None:
    s = with_gap()
    events = sq.write_off(s, "c1", 3, 4, "INC-1 black pruned", T1)
    assert [(e.kind, e.reason, e.detail["first_bundle_seq"], e.detail["last_bundle_seq"])
            for e in events] == [("gap_written_off", "operator", 3, 4)]  # fmt: skip
    assert events[0].detail["note"] == "INC-1 black pruned"
    assert [(g["first_bundle_seq"], g["last_bundle_seq"]) for g in sq.open_gaps(s)] == [
        (2, 2), (5, 5)]  # fmt: skip
    back = sq.SequenceState.from_json(s.to_json())
    assert back == s
    assert sq.summary(back)["c1"]["written_off"] == [
        {"first_bundle_seq": 3, "last_bundle_seq": 4, "at": "2026-11-23T10:00:00.000000Z",
         "note": "INC-1 black pruned"}]  # fmt: skip


def test_a_state_saved_before_write_offs_existed_still_loads() -> None:
    doc = with_gap().to_json()
    del doc["channels"]["c1"]["written_off"]
    assert sq.SequenceState.from_json(doc).channels["c1"].written_off == []


@pytest.mark.parametrize(
    ("channel", "first", "last", "match"),
    [
        ("c1", 1, 2, r"not all in an open transit gap \(open gaps of 'c1': 2\.\.5\)"),
        ("c1", 5, 6, "not all in an open transit gap"),
        ("c2", 2, 2, "open gaps of 'c2': none"),
        ("c1", 4, 3, "not a range"),
        ("c1", 0, 2, "not a range"),
    ],
)
def test_only_open_gaps_can_be_written_off(channel: str, first: int, last: int, match: str) -> None:
    s = with_gap()
    before = s.to_json()
    with pytest.raises(StateError, match=match):
        sq.write_off(s, channel, first, last, "x", T1)
    assert s.to_json() == before  # a refusal changes nothing


def test_a_written_off_bundle_that_arrives_after_all_lands_and_says_so() -> None:
    s = with_gap()
    sq.write_off(s, "c1", 2, 5, "gone", T1)
    adm = sq.admit(s, facts(3, 20, 29), T1)
    closed = [e for e in adm.events if e.kind == "gap_closed"]
    assert [(e.bundle_seq, e.reason, e.detail["written_off_at"]) for e in closed] == [
        (3, "written_off", "2026-11-23T10:00:00.000000Z")]  # fmt: skip
    assert [(w.first, w.last) for w in s.channels["c1"].written_off] == [(2, 2), (4, 5)]
    assert sq.open_gaps(s) == []


def test_the_replay_hold_back_ignores_a_written_off_hole() -> None:
    s = with_gap()
    assert GapView.from_state(2, s).holes == {"c1": (Hole(2, 5, 50),)}
    sq.write_off(s, "c1", 2, 4, "part", T1)
    assert GapView.from_state(2, s).holes == {"c1": (Hole(2, 5, 50),)}  # 5 may still come
    sq.write_off(s, "c1", 5, 5, "rest", T1)
    assert GapView.from_state(2, s).holes == {}


def chained(n: int) -> sq.BundleFacts:
    """Bundle ``n`` of ten rows, linked to bundle n-1."""
    prev = None if n == 1 else f"{n - 1:064x}"
    return sq.BundleFacts("c1", n, f"id{n}", f"{n:064x}", prev, 10, 10 * n - 10, 10 * n - 1)


def test_a_write_off_is_accounted_and_the_link_after_it_is_unverifiable_not_pending() -> None:
    """Bundles written off are accounted for: the frontier reports carry past them (it stayed
    at the bundle below the hole for the channel's life, so 'does not move' alerts fired for
    good), and the link into the bundle after them is unverifiable, not waiting."""
    s = sq.SequenceState()
    sq.admit(s, chained(1), T0)
    sq.admit(s, chained(3), T0)  # 2 is missing
    cs = s.channels["c1"]
    assert (cs.contig, sq.accounted(cs)) == (1, 1)
    events = sq.write_off(s, "c1", 2, 2, "INC-2", T1)
    assert [(e.kind, e.bundle_seq, e.reason) for e in events] == [
        ("gap_written_off", None, "operator"),
        ("chain_unverifiable", 3, "written_off"),
    ]
    assert sq.accounted(cs) == 3
    for n in (4, 5):
        kinds = [e.kind for e in sq.admit(s, chained(n), T1).events]
        assert kinds == ["chain_verified"], kinds
    assert (cs.contig, sq.accounted(cs)) == (1, 5)  # 1..n all landed is still 1
    assert sq.summary(s)["c1"]["accounted"] == 5
    # a bundle landing right after a written-off one is unverifiable at once
    sq.admit(s, chained(8), T1)  # 6, 7 open
    sq.write_off(s, "c1", 6, 7, "INC-3", T1)
    assert sq.accounted(cs) == 8
    adm = sq.admit(s, chained(10), T1)  # 9 missing: opened, not written off
    assert [e.kind for e in adm.events] == ["gap_opened"]
    assert sq.accounted(cs) == 8
    # the written-off bundle comes after all: the link is checked after all
    adm = sq.admit(s, chained(2), T1)
    assert ("chain_verified", 3) in [(e.kind, e.bundle_seq) for e in adm.events]
    assert sq.accounted(cs) == 8 and cs.contig == 5
    assert cs.counters["chain_unverifiable"] == 2


def test_a_bundle_landing_after_a_written_off_one_is_unverifiable() -> None:
    """Black's heartbeat says bundle 3 exists: 2..3 open. 2 is written off; when 3 lands, the
    link into it is unverifiable at once (not pending for good)."""
    s = sq.SequenceState()
    sq.admit(s, chained(1), T0)
    hb = sq.HeartbeatFacts("c1", 1, 3, 29, "2026-11-23T09:00:00.000000Z", 10.0)
    assert "missing_last_bundle" in [e.kind for e in sq.heartbeat(s, hb, T0)]
    assert sq.write_off(s, "c1", 2, 2, "gone", T1)[-1].kind == "gap_written_off"
    s = sq.SequenceState.from_json(s.to_json())  # across a restart
    adm = sq.admit(s, chained(3), T1)
    assert [(e.kind, e.bundle_seq) for e in adm.events] == [
        ("gap_closed", 3), ("chain_unverifiable", 3)]  # fmt: skip
    assert sq.accounted(s.channels["c1"]) == 3 and sq.open_gaps(s) == []
