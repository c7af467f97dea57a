"""Black, tap and mirror: the pure rules behind redelivery fingerprints of names that are not
UTF-8, quorum re-encoding marks, deny checks and dead queue limits (no broker)."""

from __future__ import annotations

from bridge.black.mirror import dead_queue_limits
from bridge.black.plan import HEADERS_CATCH_ALL, Binding, catch_all_bindings, denied, wanted
from bridge.black.spool_read import fingerprint
from bridge.black.tap_delivery import reordered, strip_delivery_count, text_names
from bridge.config import ChannelConfig
from bridge.protocol.properties import Properties, encode_properties, field_table


def test_a_name_that_is_not_utf8_fingerprints_as_the_spool_stores_it() -> None:
    raw = "k\udcff"  # wire bytes b"k\xff", as the client hands them over
    ex, rk, renamed = text_names("ev", raw)
    assert (ex, rk, renamed) == ("ev", "k\ufffd", True)
    assert fingerprint(ex, rk, b"p", b"b") == fingerprint("ev", "k\ufffd", b"p", b"b")
    # a surrogate left in a name is hashed, never an error
    assert len(fingerprint("e\udcff", "\ud800", b"", b"")) == 16


def _props(headers: dict[str, object] | None) -> bytes:
    return encode_properties(
        Properties(delivery_mode=2, headers=field_table(headers) if headers else None)
    )


def test_a_quorum_redelivery_is_reordered_only_with_two_headers_or_more() -> None:
    count = {"x-delivery-count": 1}
    assert not reordered(strip_delivery_count(_props(count)))
    assert strip_delivery_count(_props(count)) == _props(None)
    assert not reordered(strip_delivery_count(_props({"z": 1, **count})))
    assert strip_delivery_count(_props({"x-delivery-count": 1, "z": 1})) == _props({"z": 1})
    assert reordered(strip_delivery_count(_props({"a": 2, **count, "z": 1})))
    assert not reordered(b"\x00")  # undecodable: nothing to say


def test_denied_and_wanted_follow_the_plan() -> None:
    ch = ChannelConfig(name="c", recipients=["A" * 40], exchanges=["ev*"], deny=["ev.secret*"])
    assert denied(ch, "") and denied(ch, "amq.topic") and denied(ch, "ev.secret.x")
    assert not denied(ch, "ev.open") and not denied(ch, "other")
    assert wanted(ch, "ev.open") and not wanted(ch, "ev.secret") and not wanted(ch, "other")


def test_catch_all_bindings_cover_every_type_and_the_routing_keys() -> None:
    ch = ChannelConfig(name="c", recipients=["A" * 40], direct_routing_keys={"d": ["k", "", "k2"]})
    assert catch_all_bindings(ch, "d") == [
        Binding("d", ""),
        Binding("d", "#"),
        Binding("d", "", dict(HEADERS_CATCH_ALL)),
        Binding("d", "k"),
        Binding("d", "k2"),
    ]


def test_dead_queue_limits_read_policy_operator_policy_and_arguments() -> None:
    assert dead_queue_limits({"effective_policy_definition": {"ha-mode": "all"}}) == []
    assert dead_queue_limits({"effective_policy_definition": {"overflow": "drop-head"}}) == []
    info = {
        "effective_policy_definition": {"max-length": 10, "overflow": "reject-publish"},
        "arguments": {"x-message-ttl": 5, "x-queue-type": "classic"},
    }
    assert dead_queue_limits(info) == ["max-length=10", "message-ttl=5", "overflow=reject-publish"]
    assert dead_queue_limits({"effective_policy_definition": [], "arguments": None}) == []
