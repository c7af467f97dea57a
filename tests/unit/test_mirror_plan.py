"""Black, mirror: plan_channel over every exchange type, pattern and deny rule (pure, no broker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.black import mirror
from bridge.black.catalog import load_catalog, merge_catalog, save_catalog
from bridge.black.plan import (
    HEADERS_CATCH_ALL,
    Binding,
    dead_queue_name,
    denied,
    mirror_queue_name,
    plan_channel,
)
from bridge.config import BlackConfig, ChannelConfig
from bridge.errors import StateError
from bridge.protocol.exchange import ExchangeDecl

FPR = "A" * 40


def chan(**kw: object) -> ChannelConfig:
    return ChannelConfig(name="c1", recipients=[FPR], **kw)  # type: ignore[arg-type]


def ex(name: str, type_: str, **kw: object) -> ExchangeDecl:
    return ExchangeDecl(name, type_, **kw)  # type: ignore[arg-type]


BROKER_DEFAULTS = [
    ex("", "direct"),
    ex("amq.direct", "direct"),
    ex("amq.fanout", "fanout"),
    ex("amq.headers", "headers"),
    ex("amq.match", "headers"),
    ex("amq.rabbitmq.trace", "topic", internal=True),
    ex("amq.topic", "topic"),
]


def test_catch_all_binding_per_type() -> None:
    plan = plan_channel(
        chan(direct_routing_keys={"d": ["k1", "k2", "k1"]}),
        [ex("f", "fanout"), ex("t", "topic"), ex("h", "headers"), ex("d", "direct")],
    )
    assert plan.bindings == [
        Binding("d", "k1"),
        Binding("d", "k2"),
        Binding("f", ""),
        Binding("h", "", {"x-match": "all"}),
        Binding("t", "#"),
    ]
    assert HEADERS_CATCH_ALL == {"x-match": "all"}
    assert plan.unbound_direct == [] and plan.skipped == []
    assert plan.exchanges == ["d", "f", "h", "t"]


def test_builtin_exchanges_are_never_mirrored_and_not_noisy() -> None:
    plan = plan_channel(chan(), [*BROKER_DEFAULTS, ex("orders", "fanout")])
    assert [b.exchange for b in plan.bindings] == ["orders"]
    assert plan.skipped == [] and plan.unbound_direct == []


def test_an_amq_exchange_named_exactly_is_mirrored_the_internal_ones_never() -> None:
    """amq.topic carries what the MQTT and STOMP plugins publish: a channel that names it gets
    it; a pattern never selects amq.*; amq.rabbitmq.* and the default exchange stay refused,
    and saying so."""
    named = chan(
        exchanges=["amq.topic", "amq.rabbitmq.trace", "*"],
        direct_routing_keys={"amq.direct": ["k"]},
    )
    plan = plan_channel(named, BROKER_DEFAULTS)
    assert plan.bindings == [Binding("amq.direct", "k"), Binding("amq.topic", "#")]
    assert plan.skipped == [
        "'amq.rabbitmq.trace': built-in deny (the default exchange, amq.rabbitmq.*)"
    ]
    assert not denied(named, "amq.topic") and denied(named, "amq.fanout") and denied(named, "")
    assert denied(chan(exchanges=["amq.*"]), "amq.topic")  # a pattern is not a name


def test_direct_without_keys_is_reported_not_ignored() -> None:
    plan = plan_channel(chan(direct_routing_keys={"other": []}), [ex("d", "direct")])
    assert plan.bindings == []
    assert plan.unbound_direct == ["d"]


def test_direct_with_empty_key_list_is_unbound() -> None:
    plan = plan_channel(chan(direct_routing_keys={"d": []}), [ex("d", "direct")])
    assert plan.unbound_direct == ["d"] and plan.bindings == []


def test_patterns_and_deny() -> None:
    exchanges = [
        ex("orders.eu", "topic"),
        ex("orders.us", "topic"),
        ex("orders.test", "fanout"),
        ex("billing", "fanout"),
        ex("Orders.caps", "fanout"),
    ]
    plan = plan_channel(chan(exchanges=["orders.*"], deny=["*.test"]), exchanges)
    assert plan.exchanges == ["orders.eu", "orders.us"]  # case-sensitive, billing not matched
    assert plan.skipped == ["'orders.test': denied by channels[c1].deny pattern '*.test'"]


def test_character_class_and_question_mark() -> None:
    names = [ex(n, "fanout") for n in ("a1", "a2", "ab", "a10")]
    assert plan_channel(chan(exchanges=["a[0-9]"]), names).exchanges == ["a1", "a2"]
    assert plan_channel(chan(exchanges=["a?"]), names).exchanges == ["a1", "a2", "ab"]


def test_unknown_types_are_skipped_with_reason() -> None:
    plan = plan_channel(
        chan(),
        [
            ex("delayed", "x-delayed-message", arguments={"x-delayed-type": "direct"}),
            ex("hash", "x-consistent-hash"),
        ],
    )
    assert plan.bindings == []
    assert len(plan.skipped) == 2
    assert "'delayed': exchange type 'x-delayed-message'" in plan.skipped[0]
    assert "'hash': exchange type 'x-consistent-hash'" in plan.skipped[1]


def test_unknown_type_marker_explains_the_fix() -> None:
    plan = plan_channel(chan(exchanges=["x"]), [ex("x", "")])
    assert "type unknown" in plan.skipped[0] and "management API" in plan.skipped[0]


def test_direct_routing_keys_bypass_patterns_but_not_deny() -> None:
    exchanges = [ex("rpc", "direct"), ex("audit", "direct"), ex("orders", "topic")]
    plan = plan_channel(
        chan(
            exchanges=["orders"], direct_routing_keys={"rpc": ["a"], "audit": ["b"]}, deny=["audit"]
        ),
        exchanges,
    )
    assert plan.bindings == [Binding("orders", "#"), Binding("rpc", "a")]
    assert plan.skipped == ["'audit': denied by channels[c1].deny pattern 'audit'"]


def test_named_but_missing_exchanges_are_reported() -> None:
    plan = plan_channel(
        chan(exchanges=["gone", "orders.*"], direct_routing_keys={"rpc": ["a"]}), []
    )
    assert plan.bindings == []
    assert plan.skipped == [
        "'gone': named in channels[c1] but not found in the vhost: declare it or fix the name",
        "'rpc': named in channels[c1] but not found in the vhost: declare it or fix the name",
    ]


def test_direct_keys_on_non_direct_exchange_use_catch_all() -> None:
    plan = plan_channel(chan(direct_routing_keys={"t": ["a"]}), [ex("t", "topic")])
    assert plan.bindings == [Binding("t", "#")]


def test_internal_and_argument_exchanges_are_mirrored() -> None:
    plan = plan_channel(
        chan(),
        [
            ex("int", "fanout", internal=True),
            ex("ae", "topic", arguments={"alternate-exchange": "x"}),
        ],
    )
    assert plan.exchanges == ["ae", "int"]


def test_binding_key_is_argument_order_independent() -> None:
    a = Binding("h", "", {"x-match": "all", "b": 1})
    b = Binding("h", "", {"b": 1, "x-match": "all"})
    assert a.key() == b.key()


def test_mirror_queue_names() -> None:
    assert mirror_queue_name(BlackConfig(), "c1") == "diode.mirror.c1"
    assert mirror_queue_name(BlackConfig(mirror_prefix="x."), "ops") == "x.ops"
    assert dead_queue_name(BlackConfig(mirror_prefix="x."), "ops") == "x.ops.dead"


def test_public_surface() -> None:
    for name in mirror.__all__:
        assert hasattr(mirror, name), name


# -- catalog ---------------------------------------------------------------------------------


def test_catalog_merge_replaces_and_keeps(tmp_path: Path) -> None:
    p = tmp_path / "state" / "exchanges.json"
    assert load_catalog(p) == {}
    first, changed = merge_catalog({}, [ex("a", "fanout"), ex("b", "topic")])
    assert changed == ["a", "b"]
    save_catalog(p, first)
    again, changed = merge_catalog(load_catalog(p), [ex("a", "fanout"), ex("b", "topic")])
    assert changed == []
    # b re-declared as headers, a deleted: b replaced, a kept
    merged, changed = merge_catalog(again, [ex("b", "headers", arguments={"k": [1, "x"]})])
    assert changed == ["b"]
    save_catalog(p, merged)
    back = load_catalog(p)
    assert back == {"a": ex("a", "fanout"), "b": ex("b", "headers", arguments={"k": [1, "x"]})}
    assert [f.name for f in p.parent.iterdir()] == ["exchanges.json"]  # no temp files left


@pytest.mark.parametrize("content", [b"{not json", b'{"format": 99, "exchanges": {}}', b"[]"])
def test_damaged_catalog_is_a_state_error(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "exchanges.json"
    p.write_bytes(content)
    with pytest.raises(StateError, match="exchanges.json"):
        load_catalog(p)
