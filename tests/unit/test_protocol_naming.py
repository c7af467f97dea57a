"""Wire names: round trips, and hostile names from the wire are refused."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.errors import BundleNameError
from bridge.protocol.naming import (
    BundleName,
    HeartbeatName,
    bundle_name,
    heartbeat_name,
    parse_bundle_name,
    parse_heartbeat_name,
)

ID = "0123456789abcdef0123456789abcdef"
GOOD = f"orders.000000000042.{ID}.dbundle"
channels = st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,62}\Z")
seqs = st.integers(1, 10**12 - 1)
ids = st.binary(min_size=16, max_size=16).map(bytes.hex)


@given(channels, seqs, ids)
def test_bundle_name_round_trip(channel: str, seq: int, bundle_id: str) -> None:
    name = bundle_name(channel, seq, bundle_id)
    assert len(name.split(".")[1]) == 12
    assert parse_bundle_name(name) == BundleName(channel, seq, bundle_id)
    assert str(parse_bundle_name(name)) == name
    with pytest.raises(BundleNameError):
        parse_heartbeat_name(name)


@given(channels, seqs)
def test_heartbeat_name_round_trip(channel: str, seq: int) -> None:
    name = heartbeat_name(channel, seq)
    assert name.endswith(".dheartbeat")
    assert parse_heartbeat_name(name) == HeartbeatName(channel, seq)
    assert str(parse_heartbeat_name(name)) == name
    with pytest.raises(BundleNameError):
        parse_bundle_name(name)


def test_examples() -> None:
    assert bundle_name("orders", 42, ID) == GOOD
    assert parse_bundle_name(GOOD) == BundleName("orders", 42, ID)
    assert heartbeat_name("a", 1) == "a.000000000001.dheartbeat"


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".dbundle",
        f"../orders.000000000042.{ID}.dbundle",
        f"/etc/orders.000000000042.{ID}.dbundle",
        f"a/orders.000000000042.{ID}.dbundle",
        f"a\\orders.000000000042.{ID}.dbundle",
        f"..\\orders.000000000042.{ID}.dbundle",
        f".orders.000000000042.{ID}.dbundle",
        f"{GOOD}.tmp",
        f"{GOOD}.part",
        f".{GOOD}.tmp",
        f"{GOOD}~",
        f"{GOOD}\n",
        f"{GOOD}\x00",
        f"\x00{GOOD}",
        f" {GOOD}",
        f"{GOOD} ",
        f"Orders.000000000042.{ID}.dbundle",
        f"or ders.000000000042.{ID}.dbundle",
        f"-orders.000000000042.{ID}.dbundle",
        f"_orders.000000000042.{ID}.dbundle",
        f"{'a' * 64}.000000000042.{ID}.dbundle",
        f"orders.00000000042.{ID}.dbundle",
        f"orders.0000000000042.{ID}.dbundle",
        f"orders.000000000000.{ID}.dbundle",
        f"orders.-00000000042.{ID}.dbundle",
        f"orders.+00000000042.{ID}.dbundle",
        f"orders.00000000004２.{ID}.dbundle",  # fullwidth digit
        f"orders.00000000004٢.{ID}.dbundle",  # Arabic-Indic digit
        f"orders.000000000042.{ID.upper()}.dbundle",
        f"orders.000000000042.{ID[:-1]}.dbundle",
        f"orders.000000000042.{ID}g.dbundle",
        f"orders.000000000042.{ID}.DBUNDLE",
        f"orders.000000000042.{ID}.dbundlE",
        f"orders.000000000042.{ID}.dheartbeat",
        f"orders.000000000042..{ID}.dbundle",
        f"ordérs.000000000042.{ID}.dbundle",
        f"orders\u2024000000000042.{ID}.dbundle",  # one dot leader
        "orders.000000000042.dheartbeat",
        "x" * 10_000 + f".000000000042.{ID}.dbundle",
        f"orders.{'0' * 10_000}42.{ID}.dbundle",
    ],
)
def test_hostile_bundle_names_are_refused(name: str) -> None:
    with pytest.raises(BundleNameError) as info:
        parse_bundle_name(name)
    assert len(str(info.value)) < 300  # errors never echo a huge hostile name


@pytest.mark.parametrize(
    "name",
    [
        "orders.000000000001.dheartbeat.tmp",
        "../orders.000000000001.dheartbeat",
        ".orders.000000000001.dheartbeat",
        "orders.000000000000.dheartbeat",
        "orders.1.dheartbeat",
        "Orders.000000000001.dheartbeat",
        "orders.000000000001.dheartbeat\n",
        f"orders.000000000001.{ID}.dheartbeat",
    ],
)
def test_hostile_heartbeat_names_are_refused(name: str) -> None:
    with pytest.raises(BundleNameError):
        parse_heartbeat_name(name)


@pytest.mark.parametrize("value", [None, b"orders.000000000042.x.dbundle", 42, ["a"]])
def test_non_strings_are_refused(value: Any) -> None:
    with pytest.raises(BundleNameError):
        parse_bundle_name(value)
    with pytest.raises(BundleNameError):
        parse_heartbeat_name(value)


@pytest.mark.parametrize(
    "args",
    [
        ("Orders", 1, ID),
        ("a/b", 1, ID),
        ("", 1, ID),
        ("orders", 0, ID),
        ("orders", 10**12, ID),
        ("orders", True, ID),
        ("orders", "1", ID),
        ("orders", 1, ID.upper()),
        ("orders", 1, "x"),
    ],
)
def test_bad_parts_are_refused_when_naming(args: tuple[Any, Any, Any]) -> None:
    with pytest.raises(BundleNameError):
        bundle_name(*args)


@given(st.text(max_size=200))
def test_arbitrary_text_parses_or_raises_bundle_name_error(text: str) -> None:
    for parse in (parse_bundle_name, parse_heartbeat_name):
        try:
            parsed = parse(text)
        except BundleNameError:
            continue
        assert str(parsed) == text
