"""Red, sequence invariants (mutation review): a broken hash chain is counted, so the
operator's status says "broken", not "intact"."""

from __future__ import annotations

from datetime import UTC, datetime

from bridge.red.report import _operator_view
from bridge.red.sequence import BundleFacts, SequenceState, admit, classify, summary

CH = "orders"
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _facts(n: int, prev: str | None, first: int) -> BundleFacts:
    return BundleFacts(
        channel=CH,
        bundle_seq=n,
        bundle_id=f"{n:032x}",
        sha256=f"{n:x}".rjust(64, "a"),
        prev_sha256=prev,
        rows=5,
        first_seq=first,
        last_seq=first + 4,
        gaps=(),
    )


def _land(state: SequenceState, f: BundleFacts) -> list[str]:
    assert classify(state, f, lambda _c, _n: None) == "new"
    return [e.kind for e in admit(state, f, T0).events]


def test_a_broken_link_is_counted_and_shown_to_the_operator() -> None:
    state = SequenceState()
    b1 = _facts(1, None, 0)
    assert _land(state, b1) == []
    b2 = _facts(2, "f" * 64, 5)  # not b1's sha256: the chain was forked or tampered with
    assert "chain_broken" in _land(state, b2)
    b3 = _facts(3, b2.sha256, 10)
    assert "chain_verified" in _land(state, b3)
    ch = summary(state)[CH]
    assert ch["counters"].get("chain_broken") == 1, ch["counters"]
    assert _operator_view(ch, T0)["chain"].startswith("broken (1)")


def test_an_intact_chain_is_shown_intact() -> None:
    state = SequenceState()
    b1 = _facts(1, None, 0)
    _land(state, b1)
    _land(state, _facts(2, b1.sha256, 5))
    ch = summary(state)[CH]
    assert not ch["counters"].get("chain_broken")
    assert _operator_view(ch, T0)["chain"] == "intact"
