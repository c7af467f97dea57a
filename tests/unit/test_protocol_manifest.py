"""Manifest and heartbeat JSON: canonical round trips, strict validation of hostile input."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.errors import ManifestError, ProtocolError, SchemaVersionError
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import (
    MANIFEST_KEY,
    Gap,
    Manifest,
    format_utc,
    new_bundle_id,
    parse_utc,
)

channels = st.from_regex(r"\A[a-z0-9][a-z0-9_-]{0,62}\Z")
times = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)
).map(format_utc)
hexes = st.binary(min_size=32, max_size=32).map(bytes.hex)
seqs = st.integers(0, 2**63 - 1)


def sample_manifest(**over: Any) -> Manifest:
    fields: dict[str, Any] = {
        "channel": "orders",
        "bundle_seq": 2,
        "bundle_id": "0123456789abcdef0123456789abcdef",
        "first_seq": 10,
        "last_seq": 14,
        "rows": 5,
        "exchanges": {"ex-a": 3, "": 2},
        "created_at": "2026-01-02T03:04:05.000006Z",
        "bridge_id": "black-1",
        "prev_sha256": "ab" * 32,
        "gaps": (Gap(0, 9, "maxlen"),),
    }
    fields.update(over)
    return Manifest(**fields)


def sample_heartbeat(**over: Any) -> Heartbeat:
    fields: dict[str, Any] = {
        "channel": "orders",
        "bridge_id": "black-1",
        "heartbeat_seq": 17,
        "last_bundle_seq": 4,
        "last_seq": 99,
        "black_time": "2026-01-02T03:04:05.123456Z",
        "interval_seconds": 10.0,
        "counters": {"messages": 100, "bundles": 4, "gaps": 0},
    }
    fields.update(over)
    return Heartbeat(**fields)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    rows = draw(st.integers(0, 1000))
    bundle_seq = draw(st.integers(1, 10**12 - 1))
    first: int | None
    last: int | None
    if rows:
        first = draw(st.integers(0, 2**62))
        last = first + rows - 1 + draw(st.integers(0, 100))
        names = draw(st.lists(st.text(max_size=10), min_size=1, max_size=4, unique=True))
        split = [1] * len(names)
        split[0] += rows - len(names) if rows >= len(names) else 0
        exchanges = dict(zip(names, split, strict=True)) if rows >= len(names) else {names[0]: rows}
    else:
        first = last = None
        exchanges = {}
    starts = sorted(draw(st.lists(st.integers(0, 2**40), max_size=4, unique=True)))
    gaps = tuple(Gap(s * 2, s * 2, draw(st.text(min_size=1, max_size=20))) for s in starts)
    inexact: tuple[Gap, ...] = ()
    if first is not None and last is not None and draw(st.booleans()):
        lo = draw(st.integers(first, last))
        inexact = (Gap(lo, draw(st.integers(lo, last)), "quorum-reencoded"),)
    return Manifest(
        channel=draw(channels),
        bundle_seq=bundle_seq,
        bundle_id=draw(hexes.map(lambda h: h[:32])),
        first_seq=first,
        last_seq=last,
        rows=rows,
        exchanges=exchanges,
        created_at=draw(times),
        bridge_id=draw(channels),
        prev_sha256=None if bundle_seq == 1 else draw(hexes),
        gaps=gaps,
        inexact=inexact,
    )


def is_canonical(data: bytes) -> bool:
    doc = json.loads(data)
    again = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return data == again.encode()


@given(manifests())
def test_manifest_round_trip_is_canonical(m: Manifest) -> None:
    data = m.to_json()
    assert is_canonical(data)
    back = Manifest.from_json(data)
    assert back == m
    assert back.to_json() == data
    assert set(json.loads(data)) == {
        "format",
        "channel",
        "bundle_seq",
        "bundle_id",
        "first_seq",
        "last_seq",
        "rows",
        "exchanges",
        "created_at",
        "bridge_id",
        "schema_version",
        "prev_sha256",
        "gaps",
    } | ({"inexact"} if m.inexact else set())


def test_manifest_wire_form() -> None:
    m = sample_manifest()
    doc = json.loads(m.to_json())
    assert doc["gaps"] == [{"first_seq": 0, "last_seq": 9, "reason": "maxlen"}]
    assert doc["format"] == 1 and doc["schema_version"] == 2
    assert MANIFEST_KEY == b"diode.manifest"
    assert m.created_datetime == datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)


def test_zero_row_manifest_carries_only_gaps() -> None:
    m = sample_manifest(first_seq=None, last_seq=None, rows=0, exchanges={})
    assert Manifest.from_json(m.to_json()) == m


def _mutated(**over: Any) -> bytes:
    doc = json.loads(sample_manifest().to_json())
    for k, v in over.items():
        if v is _DROP:
            del doc[k]
        else:
            doc[k] = v
    return json.dumps(doc).encode()


_DROP = object()


@pytest.mark.parametrize(
    "over",
    [
        {"channel": "Orders"},
        {"channel": "../x"},
        {"channel": ""},
        {"channel": 5},
        {"bundle_seq": 0},
        {"bundle_seq": 10**12},
        {"bundle_seq": True},
        {"bundle_seq": "2"},
        {"bundle_id": "0123456789ABCDEF0123456789ABCDEF"},
        {"bundle_id": "abc"},
        {"first_seq": -1},
        {"first_seq": 15},
        {"last_seq": None},
        {"last_seq": 2**63},
        {"rows": 6},
        {"rows": -1},
        {"exchanges": {"ex-a": 3, "": 1}},
        {"exchanges": {"ex-a": 5, "": 0}},
        {"exchanges": []},
        {"created_at": "2026-01-02T03:04:05Z"},
        {"created_at": "2026-01-02 03:04:05.000006Z"},
        {"created_at": "2026-13-02T03:04:05.000006Z"},
        {"created_at": "2026-01-02T03:04:05.000006+00:00"},
        {"bridge_id": "Black"},
        {"prev_sha256": None},
        {"prev_sha256": "AB" * 32},
        {"prev_sha256": "ab" * 31},
        {"gaps": {}},
        {"gaps": [{"first_seq": 5, "last_seq": 4, "reason": "x"}]},
        {"gaps": [{"first_seq": 1, "last_seq": 1, "reason": ""}]},
        {"gaps": [{"first_seq": 1, "last_seq": 1}]},
        {
            "gaps": [
                {"first_seq": 3, "last_seq": 4, "reason": "a"},
                {"first_seq": 4, "last_seq": 5, "reason": "b"},
            ]
        },
        {"gaps": ["x"]},
        {"channel": _DROP},
        {"gaps": _DROP},
        {"prev_sha256": _DROP},
        {"format": _DROP},
    ],
)
def test_invalid_manifests_raise_manifest_error(over: dict[str, Any]) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(_mutated(**over))


def test_first_bundle_has_no_previous_hash() -> None:
    with pytest.raises(ManifestError, match="first bundle"):
        sample_manifest(bundle_seq=1)
    assert sample_manifest(bundle_seq=1, prev_sha256=None).prev_sha256 is None


@pytest.mark.parametrize(
    "over",
    [
        {"format": 2},
        {"format": "1"},
        {"format": None},
        {"schema_version": 1},
        {"schema_version": 3},
        {"schema_version": "2"},
    ],
)
def test_unknown_versions_raise_schema_version_error(over: dict[str, Any]) -> None:
    with pytest.raises(SchemaVersionError):
        Manifest.from_json(_mutated(**over))


def test_unknown_keys_are_tolerated() -> None:
    doc = json.loads(sample_manifest().to_json())
    doc["added_in_a_later_minor"] = {"x": 1}
    doc["gaps"][0]["detail"] = "more"
    assert Manifest.from_json(json.dumps(doc)) == sample_manifest()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b"null",
        b"\xff\xfe{}",
        b'{"format":1,"format":1}',
        b'{"format":1.0}',
        b'{"format":NaN}',
        b"{" * 100_000,
        b'{"format":1, "rows": 1e3}',
    ],
)
def test_malformed_json_raises_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Manifest.from_json(data)
    with pytest.raises(ProtocolError):
        Heartbeat.from_json(data)


def test_duplicate_key_is_rejected() -> None:
    data = sample_manifest().to_json()
    with pytest.raises(ManifestError, match="duplicate"):
        Manifest.from_json(data[:-1] + b',"rows":5}')


@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_protocol_errors(blob: bytes) -> None:
    for parse in (Manifest.from_json, Heartbeat.from_json):
        try:
            parse(blob)
        except ProtocolError:
            pass


def test_utc_helpers() -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert format_utc(t) == "2026-01-02T03:04:05.000006Z"
    assert parse_utc(format_utc(t)) == t
    with pytest.raises(ValueError):
        format_utc(datetime(2026, 1, 1))
    assert len(new_bundle_id()) == 32 and new_bundle_id() != new_bundle_id()


# ---------------------------------------------------------------------------- heartbeat


@st.composite
def heartbeats(draw: st.DrawFn) -> Heartbeat:
    return Heartbeat(
        channel=draw(channels),
        bridge_id=draw(channels),
        heartbeat_seq=draw(st.integers(1, 10**12 - 1)),
        last_bundle_seq=draw(st.none() | st.integers(1, 10**12 - 1)),
        last_seq=draw(st.none() | seqs),
        black_time=draw(times),
        interval_seconds=draw(st.floats(min_value=0.001, max_value=86400) | st.integers(1, 86400)),
        counters=draw(st.dictionaries(st.text(min_size=1, max_size=20), seqs, max_size=5)),
    )


@given(heartbeats())
def test_heartbeat_round_trip_is_canonical(hb: Heartbeat) -> None:
    data = hb.to_json()
    assert is_canonical(data)
    back = Heartbeat.from_json(data)
    assert back == hb and back.to_json() == data
    assert isinstance(back.interval_seconds, float)


@pytest.mark.parametrize(
    "over",
    [
        {"heartbeat_seq": 0},
        {"last_bundle_seq": 0},
        {"last_seq": -1},
        {"interval_seconds": 0},
        {"interval_seconds": -1.0},
        {"interval_seconds": "10"},
        {"interval_seconds": True},
        {"black_time": "yesterday"},
        {"counters": {"x": -1}},
        {"counters": {"x": 1.5}},
        {"counters": {"": 1}},
        {"counters": []},
        {"channel": "A"},
        {"bridge_id": None},
    ],
)
def test_invalid_heartbeats_raise_manifest_error(over: dict[str, Any]) -> None:
    doc = json.loads(sample_heartbeat().to_json())
    doc.update(over)
    with pytest.raises(ManifestError):
        Heartbeat.from_json(json.dumps(doc))


def test_heartbeat_versions_and_missing_fields() -> None:
    doc = json.loads(sample_heartbeat().to_json())
    with pytest.raises(SchemaVersionError):
        Heartbeat.from_json(json.dumps({**doc, "format": 2}))
    del doc["counters"]
    with pytest.raises(ManifestError, match="counters"):
        Heartbeat.from_json(json.dumps(doc))


def test_heartbeat_before_any_bundle() -> None:
    hb = sample_heartbeat(last_bundle_seq=None, last_seq=None, interval_seconds=5)
    assert Heartbeat.from_json(hb.to_json()) == hb
    assert json.loads(hb.to_json())["interval_seconds"] == 5.0
