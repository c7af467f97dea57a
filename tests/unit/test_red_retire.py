"""Red, sequence retirement (pure): a channel removed from red's config stops being watched."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bridge.errors import StateError
from bridge.red import sequence as sq

T0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)


def _state() -> sq.SequenceState:
    """Channel old: bundles 1 and 6 landed (2..5 open) and silent; channel new: bundle 1."""
    s = sq.SequenceState()
    for ch, n, a, b in (("old", 1, 0, 9), ("old", 6, 50, 59), ("new", 1, 0, 4)):
        sq.admit(s, sq.BundleFacts(ch, n, f"id{n}", f"{n:064x}", None, b - a + 1, a, b), T0)
    sq.tick(s, T0, 60, ["old", "new"])  # starts watching both
    assert [e.channel for e in sq.tick(s, T1, 60, ["old", "new"])] == ["new", "old"]  # silent
    return s


def test_retiring_writes_off_open_gaps_and_stops_the_watch() -> None:
    s = _state()
    events = sq.retire(s, "old", "CHG-42 decommissioned", T1, configured=["new"])
    assert [(e.kind, e.reason) for e in events] == [
        ("gap_written_off", "operator"), ("chain_unverifiable", "written_off"),
        ("channel_retired", "operator")]  # fmt: skip
    assert (events[0].detail["first_bundle_seq"], events[0].detail["last_bundle_seq"]) == (2, 5)
    assert events[1].bundle_seq == 6  # landed above the written-off range
    d = events[2].detail
    assert d["gaps_written_off"] == [[2, 5]] and d["was_silent"] is True
    assert (d["contig"], d["highest"], d["known"], d["note"]) == (1, 6, 6, "CHG-42 decommissioned")
    assert sq.open_gaps(s) == []
    info = sq.summary(s)["old"]
    assert info["retired"] == {"at": "2026-11-23T10:00:00.000000Z", "note": "CHG-42 decommissioned"}
    assert info["silent"] is False
    assert sq.SequenceState.from_json(s.to_json()) == s
    # a day later, not configured: no silence is reported for it (new is silent already: once)
    assert sq.tick(s, T1 + timedelta(days=1), 60, ["new"]) == []


def test_a_retired_channel_configured_again_is_reinstated_and_watched_from_then() -> None:
    s = _state()
    sq.retire(s, "old", "x", T1, configured=["new"])
    t2 = T1 + timedelta(days=1)
    (ev,) = sq.tick(s, t2, 60, ["old", "new"])
    assert (ev.kind, ev.channel, ev.reason) == ("channel_reinstated", "old", "configured")
    assert ev.detail == {"retired_at": "2026-11-23T10:00:00.000000Z", "retired_note": "x"}
    cs = s.channels["old"]
    assert cs.retired is None and cs.silent is False
    assert sq.tick(s, t2 + timedelta(seconds=30), 60, ["old", "new"]) == []  # within 60 s
    (late,) = sq.tick(s, t2 + timedelta(seconds=61), 60, ["old", "new"])
    assert (late.kind, late.channel) == ("link_silent", "old")


@pytest.mark.parametrize(
    ("channel", "configured", "match"),
    [
        ("old", ["old", "new"], r"still in red's \[\[channels\]\]: remove it"),
        ("gone", ["new"], r"unknown to red's state \(channels: \['new', 'old'\]\)"),
    ],
)
def test_retirement_is_refused_with_the_reason(
    channel: str, configured: list[str], match: str
) -> None:
    s = _state()
    before = s.to_json()
    with pytest.raises(StateError, match=match):
        sq.retire(s, channel, "x", T1, configured)
    assert s.to_json() == before


def test_a_reinstated_channel_that_had_heartbeats_is_watched_from_reinstatement() -> None:
    s = _state()
    hb = sq.HeartbeatFacts("old", 1, 6, 59, "2026-11-23T09:00:00.000000Z", 30.0)
    sq.heartbeat(s, hb, T0)  # heard on the morning of day 0
    sq.retire(s, "old", "x", T1, configured=["new"])
    t10 = T0 + timedelta(days=10)
    assert [e.kind for e in sq.tick(s, t10, 60, ["old", "new"])] == ["channel_reinstated"]
    assert sq.tick(s, t10 + timedelta(seconds=1), 60, ["old", "new"]) == []  # not 10 days quiet
    (late,) = sq.tick(s, t10 + timedelta(seconds=61), 60, ["old", "new"])
    assert (late.kind, late.detail["quiet_seconds"]) == ("link_silent", 61.0)


def test_retiring_twice_is_refused_and_old_states_load() -> None:
    s = _state()
    sq.retire(s, "old", "x", T1, configured=[])
    with pytest.raises(StateError, match="retired already at 2026-11-23T10:00:00"):
        sq.retire(s, "old", "y", T1, configured=[])
    doc = _state().to_json()
    del doc["channels"]["old"]["retired"]  # a state saved before retirements existed
    assert sq.SequenceState.from_json(doc).channels["old"].retired is None
