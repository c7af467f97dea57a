"""Red, sequence checks: chain, coverage, transit gaps, duplicates and heartbeats (pure logic)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.errors import StateError
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import Gap, Manifest
from bridge.red.sequence import (
    BundleFacts,
    Event,
    HeartbeatFacts,
    SequenceState,
    admit,
    classify,
    heartbeat,
    judge,
    open_gaps,
    silence_margin,
    summary,
    tick,
)

CH = "orders"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def sha(i: int, salt: str = "") -> str:
    return f"{salt}{i:x}".rjust(64, "a")[:64]


@dataclass(frozen=True)
class Built:
    """A bundle and the seqs of its rows (what the test lands)."""

    facts: BundleFacts
    row_seqs: tuple[int, ...]


Piece = tuple[bool, int]  # (is_gap, length)


def build(
    specs: list[list[Piece]], shift_at: int = 0, shift: int = 0, channel: str = CH
) -> list[Built]:
    """A valid chain (contiguous coverage, correct prev_sha256) from per-bundle pieces;
    bundle ``shift_at`` (and everything after it) moved by ``shift`` seqs."""
    out: list[Built] = []
    cursor = 0
    for n, pieces in enumerate(specs, start=1):
        if n == shift_at:
            cursor += shift
        rows: list[int] = []
        gaps: list[tuple[int, int, str]] = []
        for is_gap, length in pieces:
            if is_gap:
                gaps.append((cursor, cursor + length - 1, "maxlen"))
            else:
                rows.extend(range(cursor, cursor + length))
            cursor += length
        facts = BundleFacts(
            channel=channel,
            bundle_seq=n,
            bundle_id=f"{n:032x}",
            sha256=sha(n),
            prev_sha256=None if n == 1 else sha(n - 1),
            rows=len(rows),
            first_seq=rows[0] if rows else None,
            last_seq=rows[-1] if rows else None,
            gaps=tuple(gaps),
        )
        out.append(Built(facts, tuple(rows)))
    return out


pieces_st = st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=4)
nonempty_pieces_st = st.lists(st.tuples(st.booleans(), st.integers(1, 4)), min_size=1, max_size=4)
specs_st = st.lists(pieces_st, min_size=1, max_size=20)


class Runner:
    """Feeds bundles through classify/admit the way the landing does, against a model ledger."""

    def __init__(self, roundtrip: bool = False) -> None:
        self.state = SequenceState()
        self.ledger: dict[tuple[str, int], str] = {}
        self.events: list[Event] = []
        self.landed_rows: list[int] = []
        self.verdicts: list[str] = []
        self.roundtrip = roundtrip

    def lookup(self, channel: str, n: int) -> str | None:
        return self.ledger.get((channel, n))

    def feed(self, b: Built, now: datetime | None = None) -> str:
        if self.roundtrip:  # each landing starts from the saved state
            self.state = SequenceState.from_json(json.loads(json.dumps(self.state.to_json())))
        before = self.state.to_json()
        verdict = classify(self.state, b.facts, self.lookup)
        assert self.state.to_json() == before, "classify must not change the state"
        self.verdicts.append(verdict)
        if verdict == "new":
            adm = admit(self.state, b.facts, now)
            self.events += adm.events
            skipped = {s for a, z in adm.skip for s in range(a, z + 1)}
            self.landed_rows += [s for s in b.row_seqs if s not in skipped]
            self.ledger[(b.facts.channel, b.facts.bundle_seq)] = b.facts.sha256
        doc = self.state.to_json()
        again = SequenceState.from_json(json.loads(json.dumps(doc)))
        assert again == self.state and again.to_json() == doc
        return verdict

    def kinds(self, kind: str) -> list[int | None]:
        return sorted((e.bundle_seq for e in self.events if e.kind == kind), key=lambda x: x or 0)


def open_set(state: SequenceState, channel: str = CH) -> set[int]:
    return {
        n
        for g in open_gaps(state)
        if g["channel"] == channel
        for n in range(g["first_bundle_seq"], g["last_bundle_seq"] + 1)
    }


def hb(
    seq: int, last_bundle: int | None, last_seq: int | None = None, ch: str = CH
) -> HeartbeatFacts:
    return HeartbeatFacts(ch, seq, last_bundle, last_seq, "2026-01-02T03:04:05.000000Z", 10.0)


# ----------------------------------------------------------------- the big property


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_arrival_order_with_duplicates_and_omissions(data: st.DataObject) -> None:
    chain = build(data.draw(specs_st))
    n_max = len(chain)
    omitted = data.draw(st.sets(st.integers(1, n_max)))
    arrivals = data.draw(st.permutations([b for b in chain if b.facts.bundle_seq not in omitted]))
    feed = list(arrivals)
    if arrivals:
        for d in data.draw(st.lists(st.sampled_from(arrivals), max_size=6)):
            feed.insert(data.draw(st.integers(0, len(feed))), d)
    run = Runner(roundtrip=data.draw(st.booleans()))
    seen: set[int] = set()
    for b in feed:
        verdict = run.feed(b)
        assert verdict == ("duplicate" if b.facts.bundle_seq in seen else "new")
        seen.add(b.facts.bundle_seq)

    arrived = {b.facts.bundle_seq for b in arrivals}
    links = [k for k in range(2, n_max + 1) if k in arrived and k - 1 in arrived]
    assert run.kinds("chain_verified") == links  # each link exactly once
    assert run.kinds("chain_broken") == []
    assert run.kinds("coverage_mismatch") == []
    assert run.kinds("overlap_skipped") == []
    assert sorted(run.landed_rows) == sorted(s for b in arrivals for s in b.row_seqs)
    declared = [g for b in arrivals for g in b.facts.gaps]
    assert len(run.kinds("gap_declared")) == len(declared)

    top = max(arrived, default=0)
    assert open_set(run.state) == {k for k in omitted if k < top}
    cs = run.state.channels.get(CH)
    contig = min(omitted, default=n_max + 1) - 1
    if cs is not None:
        assert cs.contig == contig
        above = {k for r in cs.runs for k in range(r.lo, r.hi + 1)}
        assert above == {k for k in arrived if k > contig}
        # one run per stretch of arrived bundles above contig: the state is O(holes)
        starts = {k for k in arrived if k > contig and k - 1 not in arrived}
        assert [r.lo for r in cs.runs] == sorted(starts) and len(cs.runs) <= len(omitted)
        assert len(cs.landed) <= len(omitted) + 1
        if not omitted:
            assert cs.runs == [] and cs.gaps == []
            assert len(cs.landed) <= 1

    # black's heartbeat names the last bundle: the missing tail opens, once
    evs = heartbeat(run.state, hb(1, n_max), T0)
    assert open_set(run.state) == omitted
    tail = [e for e in evs if e.kind == "missing_last_bundle"]
    if n_max > top:
        assert [(e.detail["first_bundle_seq"], e.detail["last_bundle_seq"]) for e in tail] == [
            (top + 1, n_max)
        ]
    else:
        assert tail == []
    assert [e.kind for e in heartbeat(run.state, hb(2, n_max), T0)] == []
    assert SequenceState.from_json(run.state.to_json()) == run.state

    # the omitted bundles arrive late: every gap closes, every link is checked, state folds up
    for k in sorted(omitted, reverse=True):
        run.feed(chain[k - 1])
    assert run.kinds("chain_verified") == list(range(2, n_max + 1))
    assert run.kinds("chain_broken") == [] and run.kinds("coverage_mismatch") == []
    cs = run.state.channels[CH]
    assert open_gaps(run.state) == [] and cs.runs == [] and cs.contig == n_max
    assert len(cs.landed) <= 1
    assert len(run.landed_rows) == len(set(run.landed_rows))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_tampered_prev_breaks_that_link_only(data: st.DataObject) -> None:
    chain = build(data.draw(st.lists(pieces_st, min_size=2, max_size=15)))
    k = data.draw(st.integers(1, len(chain)))
    bad = chain[k - 1]
    chain[k - 1] = Built(replace(bad.facts, prev_sha256="f" * 64), bad.row_seqs)
    run = Runner(roundtrip=data.draw(st.booleans()))
    for b in data.draw(st.permutations(chain)):
        assert run.feed(b) == "new"
    assert run.kinds("chain_broken") == [k]
    assert run.kinds("chain_verified") == [n for n in range(2, len(chain) + 1) if n != k]
    broken = next(e for e in run.events if e.kind == "chain_broken")
    assert broken.detail["prev_sha256"] == "f" * 64
    assert broken.detail["expected_prev_sha256"] == (None if k == 1 else sha(k - 1))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_coverage_hole_or_overlap_is_reported_on_that_link(data: st.DataObject) -> None:
    specs = data.draw(st.lists(nonempty_pieces_st, min_size=1, max_size=12))
    k = data.draw(st.integers(1, len(specs)))
    prev_len = sum(n for _, n in specs[k - 2]) if k >= 2 else 0
    overlap = k >= 2 and data.draw(st.booleans())
    d = data.draw(st.integers(1, prev_len)) if overlap else data.draw(st.integers(1, 5))
    chain = build(specs, shift_at=k, shift=-d if overlap else d)
    run = Runner(roundtrip=data.draw(st.booleans()))
    for b in data.draw(st.permutations(chain)):
        run.feed(b)
    bad = [e for e in run.events if e.kind == "coverage_mismatch"]
    assert [(e.bundle_seq, e.reason) for e in bad] == [(k, "overlap" if overlap else "hole")]
    assert bad[0].seq_last is not None and bad[0].seq_first is not None
    assert bad[0].seq_last - bad[0].seq_first + 1 == d
    assert run.kinds("chain_broken") == []
    # whatever the arrival order, no message seq lands twice, and none is lost but the overlap
    assert len(run.landed_rows) == len(set(run.landed_rows))
    all_rows = [s for b in chain for s in b.row_seqs]
    assert len(run.landed_rows) >= len(set(all_rows)) - d


@settings(max_examples=200, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), min_size=1, max_size=15))
def test_skip_never_lets_a_seq_land_twice(ranges: list[tuple[int, int]]) -> None:
    run = Runner()
    for n, (lo, length) in enumerate(ranges, start=1):
        rows = tuple(range(lo, lo + length + 1))
        f = BundleFacts(CH, n, f"{n:032x}", sha(n), None if n == 1 else sha(n - 1), len(rows),
                        rows[0], rows[-1])  # fmt: skip
        run.feed(Built(f, rows))
    assert len(run.landed_rows) == len(set(run.landed_rows))
    assert set(run.landed_rows) == {s for lo, ln in ranges for s in range(lo, lo + ln + 1)}
    skipped = sum(
        (e.seq_last or 0) - (e.seq_first or 0) + 1
        for e in run.events
        if e.kind == "overlap_skipped"
    )
    assert skipped == sum(ln + 1 for _, ln in ranges) - len(run.landed_rows)


@pytest.mark.parametrize("order", list(itertools.permutations([1, 2, 3, 4])))
def test_empty_bundle_passes_coverage_end_on(order: tuple[int, ...]) -> None:
    # 1: rows 0..9, 2: nothing at all, 3: nothing, 4: starts at 12 -> hole 10..11 on link (3, 4)
    chain = build([[(False, 10)], [], [], [(False, 3)]], shift_at=4, shift=2)
    run = Runner()
    for n in order:
        run.feed(chain[n - 1])
    bad = [e for e in run.events if e.kind == "coverage_mismatch"]
    assert [(e.bundle_seq, e.reason, e.seq_first, e.seq_last) for e in bad] == [(4, "hole", 10, 11)]
    assert run.kinds("chain_verified") == [2, 3, 4]
    assert run.state.channels[CH].contig_end == 14


# --------------------------------------------------------------- duplicates / conflicts


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_duplicate_vs_conflict_wherever_the_sha_lives(data: st.DataObject) -> None:
    chain = build(data.draw(st.lists(pieces_st, min_size=3, max_size=12)))
    hole = data.draw(st.integers(1, len(chain)))
    run = Runner()
    for b in chain:
        if b.facts.bundle_seq != hole:
            run.feed(b)
    fresh = SequenceState.from_json(run.state.to_json())  # as the next landing sees it
    calls: list[int] = []

    def lookup(ch: str, n: int) -> str | None:
        calls.append(n)
        return run.ledger.get((ch, n))

    for b in chain:
        f = b.facts
        for state in (run.state, fresh):
            if f.bundle_seq == hole:
                assert classify(state, f, lookup) == "new"
                continue
            assert classify(state, f, lookup) == "duplicate"
            assert classify(state, replace(f, sha256="0" * 64), lookup) == "conflict"
    # the fresh state asked the ledger only for the bundles whose sha256 it no longer keeps:
    # all but the top of contig and of each run of landed bundles above the hole
    cs = fresh.channels[CH]
    kept = {cs.contig} | {r.hi for r in cs.runs}
    assert set(calls) == {n for n in range(1, len(chain) + 1) if n != hole} - kept
    assert len(cs.runs) <= 1


def test_duplicate_in_the_same_landing_before_the_ledger_has_it() -> None:
    chain = build([[(False, 2)]] * 4)
    state = SequenceState()
    for b in chain:
        admit(state, b.facts)
    assert state.channels[CH].contig == 4 and state.channels[CH].runs == []
    nobody = lambda ch, n: None  # noqa: E731  the ledger has not been written yet
    assert classify(state, chain[1].facts, nobody) == "duplicate"
    assert classify(state, replace(chain[1].facts, sha256="0" * 64), nobody) == "conflict"
    # a state read back from disk has no such memory: unknown to the ledger is a conflict
    fresh = SequenceState.from_json(state.to_json())
    assert classify(fresh, chain[1].facts, nobody) == "conflict"
    verdict, evs = judge(fresh, chain[1].facts, lambda ch, n: sha(n))
    assert verdict == "duplicate" and evs[0].kind == "duplicate"
    assert evs[0].detail["landed_sha256"] == sha(2)


def test_admit_twice_is_refused() -> None:
    b = build([[(False, 1)]])[0]
    state = SequenceState()
    admit(state, b.facts)
    with pytest.raises(StateError, match="bundle_seq=1"):
        admit(state, b.facts)


# ------------------------------------------------------------------------ transit gaps


def test_transit_gaps_open_split_and_close_with_seq_ranges() -> None:
    chain = build([[(False, 5)]] * 8)  # bundle n holds seqs 5(n-1) .. 5n-1
    run = Runner()
    run.feed(chain[0], T0)
    run.feed(chain[5], T0 + timedelta(seconds=1))  # 2..5 missing
    opened = [e for e in run.events if e.kind == "gap_opened"]
    assert [(e.detail["first_bundle_seq"], e.detail["last_bundle_seq"]) for e in opened] == [(2, 5)]
    assert (opened[0].seq_first, opened[0].seq_last) == (5, 24)
    assert open_gaps(run.state) == [
        {
            "channel": CH,
            "first_bundle_seq": 2,
            "last_bundle_seq": 5,
            "since": "2026-01-02T03:04:06.000000Z",
        }
    ]
    run.feed(chain[3], T0)  # bundle 4 splits the gap
    closed = [e for e in run.events if e.kind == "gap_closed"]
    assert [(e.bundle_seq, e.seq_first, e.seq_last) for e in closed] == [(4, 15, 19)]
    assert [(g["first_bundle_seq"], g["last_bundle_seq"]) for g in open_gaps(run.state)] == [
        (2, 3),
        (5, 5),
    ]
    for n in (2, 3, 5):
        run.feed(chain[n - 1])
    assert open_gaps(run.state) == []
    info = summary(run.state)[CH]
    assert info["contig"] == 6 and info["landed_above"] == [] and info["seq_range"] == [0, 29]
    assert info["counters"]["bundles"] == 6 and info["counters"]["rows"] == 30


def test_gap_declared_carries_black_reason() -> None:
    m = Manifest(
        channel=CH,
        bundle_seq=1,
        bundle_id="0" * 32,
        first_seq=3,
        last_seq=4,
        rows=2,
        exchanges={"ex": 2},
        created_at="2026-01-02T03:04:05.000006Z",
        bridge_id="black-1",
        prev_sha256=None,
        gaps=(Gap(0, 2, "maxlen"), Gap(5, 5, "oversize")),
    )
    f = BundleFacts.from_manifest(m, sha(1))
    assert f.coverage == (0, 5) and f.unaccounted == 0
    evs = admit(SequenceState(), f).events
    assert [(e.kind, e.seq_first, e.seq_last, e.reason) for e in evs] == [
        ("gap_declared", 0, 2, "maxlen"),
        ("gap_declared", 5, 5, "oversize"),
    ]
    assert BundleFacts(CH, 1, "0" * 32, sha(1), None, 0, None, None).coverage is None


def test_rows_that_do_not_fill_the_coverage_are_reported() -> None:
    f = BundleFacts(CH, 1, "0" * 32, sha(1), None, 2, 0, 9)  # 2 rows claim 0..9
    evs = admit(SequenceState(), f).events
    assert [(e.kind, e.reason, e.detail["unaccounted"]) for e in evs] == [
        ("coverage_mismatch", "unaccounted", 8)
    ]


# ------------------------------------------------------------------------ heartbeats


def test_heartbeat_replayed_changes_nothing() -> None:
    state = SequenceState()
    assert heartbeat(state, hb(5, None), T0) == []
    before = state.to_json()
    for seq in (5, 4):
        evs = heartbeat(state, hb(seq, 9), T0 + timedelta(seconds=1))
        assert [(e.kind, e.detail["last_heartbeat_seq"]) for e in evs] == [
            ("heartbeat_replayed", 5)
        ]
    assert state.to_json() == before and open_gaps(state) == []
    assert heartbeat(state, hb(7, None), T0) == []  # skipped heartbeat seqs are fine


def test_missing_last_bundle_once_per_range() -> None:
    chain = build([[(False, 5)]] * 6)
    run = Runner()
    run.feed(chain[0])
    run.feed(chain[1])
    evs = heartbeat(run.state, hb(1, 4, 19), T0)
    assert [(e.kind, e.seq_first, e.seq_last) for e in evs] == [
        ("gap_opened", 10, 19),
        ("missing_last_bundle", 10, 19),
    ]
    assert evs[1].detail == {"first_bundle_seq": 3, "last_bundle_seq": 4, "heartbeat_seq": 1}
    assert heartbeat(run.state, hb(2, 4, 19), T0) == []
    assert heartbeat(run.state, hb(3, 3, 14), T0) == []  # behind what red knows: nothing new
    evs = heartbeat(run.state, hb(4, 6, 29), T0)
    assert [e.detail["first_bundle_seq"] for e in evs if e.kind == "missing_last_bundle"] == [5]
    run.feed(chain[3])
    assert [(g["first_bundle_seq"], g["last_bundle_seq"]) for g in open_gaps(run.state)] == [
        (3, 3),
        (5, 6),
    ]
    for n in (3, 5, 6):
        run.feed(chain[n - 1])
    assert open_gaps(run.state) == [] and run.kinds("chain_verified") == [2, 3, 4, 5, 6]


def test_silence_is_reported_once_and_resumes() -> None:
    state = SequenceState()
    heartbeat(state, hb(1, None), T0)
    assert tick(state, T0 + timedelta(seconds=60), 60) == []
    evs = tick(state, T0 + timedelta(seconds=61), 60)
    assert [(e.kind, e.channel, e.detail["last_heartbeat_seq"]) for e in evs] == [
        ("link_silent", CH, 1)
    ]
    assert tick(state, T0 + timedelta(seconds=600), 60) == []
    assert SequenceState.from_json(state.to_json()) == state
    evs = heartbeat(state, hb(2, None), T0 + timedelta(seconds=700))
    assert [e.kind for e in evs] == ["link_resumed"]
    assert tick(state, T0 + timedelta(seconds=701), 60) == []
    assert [e.kind for e in tick(state, T0 + timedelta(seconds=800), 60)] == ["link_silent"]


def test_silence_names_blacks_heartbeat_period_and_the_missed_count() -> None:
    state = SequenceState()
    heartbeat(state, hb(1, None), T0)  # black declares a 10 s period
    evs = tick(state, T0 + timedelta(seconds=65), 60)
    assert evs[0].detail["heartbeat_interval_seconds"] == 10.0
    assert evs[0].detail["missed_heartbeats"] == 6


def test_silence_margin_shorter_than_two_periods_is_named_with_the_fix() -> None:
    assert silence_margin(CH, 10.0, 60.0) is None
    assert silence_margin(CH, 30.0, 60.0) is None  # exactly two periods: one loss tolerated
    why = silence_margin(CH, 45.0, 60.0)
    assert why is not None and f"channel {CH}" in why and "every 45 s" in why
    assert "red.link_silent_seconds to 135 or more" in why, why
    assert "diode black heartbeat --every" in why, why  # the period may be the command's
    assert silence_margin(CH, 0.0, 60.0) is None  # no period declared: nothing to judge


def test_configured_channel_never_heard_from_goes_silent() -> None:
    state = SequenceState()
    assert tick(state, T0, 30, ["quiet", CH]) == []
    assert state.channels["quiet"].watch_since == "2026-01-02T03:04:05.000000Z"
    assert {e.channel for e in tick(state, T0 + timedelta(seconds=31), 30, ["quiet", CH])} == {
        "quiet",
        CH,
    }
    evs = heartbeat(state, hb(1, None, ch="quiet"), T0 + timedelta(seconds=40))
    assert [e.kind for e in evs] == ["link_resumed"]


def test_heartbeat_facts_from_the_wire() -> None:
    wire = Heartbeat(CH, "black-1", 12, 7, 43, "2026-01-02T03:04:16.000001Z", 10, {"bundles": 7})
    f = HeartbeatFacts.from_json(wire.to_json().decode())
    assert f == HeartbeatFacts(CH, 12, 7, 43, "2026-01-02T03:04:16.000001Z", 10.0)


# ------------------------------------------------------------------------ state JSON


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_state_json_round_trips_after_anything(data: st.DataObject) -> None:
    chains = {ch: build(data.draw(specs_st), channel=ch) for ch in ("a", "b-1")}
    run = Runner()
    now = T0
    steps = data.draw(st.lists(st.sampled_from(["bundle", "hb", "tick"]), max_size=30))
    hb_seq = dict.fromkeys(chains, 0)
    for step in steps:
        ch = data.draw(st.sampled_from(sorted(chains)))
        now += timedelta(seconds=data.draw(st.integers(0, 100)))
        if step == "bundle":
            run.feed(data.draw(st.sampled_from(chains[ch])), now)
        elif step == "hb":
            hb_seq[ch] += data.draw(st.integers(-1, 2))
            last = data.draw(st.none() | st.integers(1, 30))
            heartbeat(run.state, hb(max(hb_seq[ch], 1), last, ch=ch), now)
        else:
            tick(run.state, now, 50, ["c"])
        doc = json.loads(json.dumps(run.state.to_json()))
        assert SequenceState.from_json(doc) == run.state
        assert SequenceState.from_json(doc).to_json() == doc
        assert json.loads(json.dumps(summary(run.state))) == summary(run.state)


@pytest.mark.parametrize(
    "doc",
    [
        None,
        {"format": 2, "channels": {}},
        {"format": 1},
        {"format": 1, "channels": {"x": {"contig": 0}}},
    ],
)
def test_state_from_bad_json_is_refused(doc: object) -> None:
    with pytest.raises(StateError):
        SequenceState.from_json(doc)


def test_state_from_json_names_the_bad_field() -> None:
    state = SequenceState()
    admit(state, build([[(False, 1)]] * 3)[2].facts)  # bundle 3 alone: kept above contig
    doc = json.loads(json.dumps(state.to_json()))
    doc["channels"][CH]["runs"][0]["end"] = "2"
    with pytest.raises(StateError, match=r"channel='orders' runs\[0\].*'end'"):
        SequenceState.from_json(doc)
    doc["channels"][CH]["runs"][0] = {"lo": 3, "hi": 3}
    with pytest.raises(StateError, match=r"runs\[0\].*'prev_sha256'"):
        SequenceState.from_json(doc)
