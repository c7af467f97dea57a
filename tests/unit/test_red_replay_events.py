"""Red, replay: events a failing audit sink has not taken stay bounded and keep every row."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.red.replay_results import bound_unsunk


def _replayed(x: str, ch: str, first: int, last: int, land: int, no_id: int) -> dict[str, Any]:
    detail: dict[str, Any] = {"rows": last - first + 1, "land_seq_first": land}
    detail["land_seq_last"] = land
    if no_id:
        detail["without_id_header"] = no_id
    return {"event": "replayed", "exchange": x, "channel": ch, "seq_first": first,
            "seq_last": last, "reason": None, "detail": json.dumps(detail)}  # fmt: skip


def _failed(x: str, n: int) -> dict[str, Any]:
    return {"event": "replay_failed", "exchange": x, "channel": None, "seq_first": None,
            "seq_last": None, "reason": f"refused {n}", "detail": None}  # fmt: skip


_EVENT = st.one_of(
    st.builds(
        lambda x, ch, first, n, land, no_id: _replayed(x, ch, first, first + n, land, no_id),
        st.sampled_from("ab"), st.sampled_from(["c0", "c1"]), st.integers(0, 10**6),
        st.integers(0, 500), st.integers(1, 50), st.integers(0, 3),
    ),
    st.builds(_failed, st.sampled_from("ab"), st.integers(0, 10**6)),
)  # fmt: skip


def _totals(events: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    out: dict[tuple[str, str], tuple[int, int, int, int]] = {}
    for e in events:
        if e["event"] != "replayed":
            continue
        d = json.loads(e["detail"])
        key = (e["exchange"], e["channel"])
        lo, hi, rows, no_id = out.get(key, (e["seq_first"], e["seq_last"], 0, 0))
        out[key] = (
            min(lo, e["seq_first"]),
            max(hi, e["seq_last"]),
            rows + d["rows"],
            no_id + d.get("without_id_header", 0),
        )
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENT, max_size=60), st.integers(1, 20))
def test_bounded_events_keep_every_replayed_row_and_the_newest_others(
    events: list[dict[str, Any]], cap: int
) -> None:
    kept, dropped = bound_unsunk([dict(e) for e in events], cap)
    others = [e for e in events if e["event"] != "replayed"]
    assert _totals(kept) == _totals(events)  # every published row still in some event
    if len(events) <= cap:
        assert kept == events and dropped == 0
        return
    assert [e for e in kept if e["event"] != "replayed"] == others[
        len(others) - min(cap, len(others)) :
    ]
    assert dropped == len(others) - min(cap, len(others))
    assert len(kept) <= cap + len(_totals(events))
    assert all(set(e) == set(events[0]) for e in kept)  # the audit keys, nothing added


def test_a_long_outage_folds_ranges_instead_of_dropping_them() -> None:
    events = [_replayed("a", "c1", i * 10, i * 10 + 9, 1 + i // 100, 0) for i in range(25_000)]
    events.insert(5, _failed("b", 1))
    kept, dropped = bound_unsunk(events, 10_000)
    assert dropped == 0 and len(kept) == 2
    (folded,) = [e for e in kept if e["event"] == "replayed"]
    d = json.loads(folded["detail"])
    assert (folded["seq_first"], folded["seq_last"]) == (0, 249_999)
    assert (d["rows"], d["land_seq_first"], d["land_seq_last"]) == (250_000, 1, 250)
