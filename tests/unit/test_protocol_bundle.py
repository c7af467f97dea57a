"""Bundles: deterministic Parquet + manifest; tampered, truncated, garbage input: ProtocolError."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.errors import ManifestError, ProtocolError, SchemaVersionError
from bridge.protocol.bundle import (
    check_rows,
    manifest_for,
    pack_bundle,
    read_manifest,
    sha256_hex,
    unpack_bundle,
)
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.manifest import MANIFEST_KEY, Gap, Manifest
from bridge.protocol.properties import NO_PROPERTIES, Properties, encode_properties, field_table
from bridge.protocol.rows import RowBuilder
from bridge.protocol.schema import row_schema

NOW = "2026-01-02T03:04:05.000006Z"


def build(n: int = 50, *, first: int = 100, channel: str = "orders") -> pa.Table:
    b = RowBuilder(channel)
    for i in range(n):
        ex = ExchangeDecl("ex-a", "topic") if i % 3 else None
        b.append(
            first + i,
            ex,
            "ex-a" if i % 3 else "ex-b",
            f"rk.{i}",
            i % 7 == 0,
            encode_properties(
                Properties(message_id=f"m{i}", headers=field_table({"i": i, "s": "x" * (i % 5)}))
            ),
            os.urandom(64) + bytes(i),
        )
    return b.to_table()


def manifest(table: pa.Table, **over: Any) -> Manifest:
    fields: dict[str, Any] = {
        "channel": "orders",
        "bundle_seq": 3,
        "bundle_id": "fedcba9876543210fedcba9876543210",
        "created_at": NOW,
        "bridge_id": "black-1",
        "prev_sha256": "cd" * 32,
    }
    fields.update(over)
    return manifest_for(table, **fields)


@pytest.fixture(scope="module")
def table() -> pa.Table:
    return build()


@pytest.fixture(scope="module")
def bundle(table: pa.Table) -> bytes:
    return pack_bundle(table, manifest(table))


def test_round_trip(table: pa.Table, bundle: bytes) -> None:
    m, t = unpack_bundle(bundle)
    assert m == manifest(table)
    assert m.exchanges == {"ex-a": 33, "ex-b": 17} and (m.first_seq, m.last_seq) == (100, 149)
    assert t.equals(table)
    assert t.schema.equals(row_schema(), check_metadata=True)
    assert read_manifest(bundle) == m
    assert read_manifest(memoryview(bundle)) == m
    assert unpack_bundle(pa.py_buffer(bundle))[0] == m


def test_manifest_is_plain_json_in_parquet_metadata(bundle: bytes) -> None:
    kv = pq.read_metadata(pa.BufferReader(bundle)).metadata
    doc = json.loads(kv[MANIFEST_KEY].decode("utf-8"))
    assert doc["channel"] == "orders" and doc["rows"] == 50
    assert pq.read_metadata(pa.BufferReader(bundle)).row_group(0).column(0).compression == "ZSTD"


def test_packing_is_deterministic(table: pa.Table, bundle: bytes) -> None:
    m = manifest(table)
    assert pack_bundle(table, m) == bundle
    copy = pa.Table.from_pylist(table.to_pylist(), schema=row_schema())
    assert pack_bundle(copy, m) == bundle
    assert pack_bundle(pa.concat_tables([table.slice(0, 10), table.slice(10)]), m) == bundle
    assert pack_bundle(table.to_batches()[0], m) == bundle
    assert pack_bundle(table, m, zstd_level=9) != bundle
    assert sha256_hex(bundle) == sha256_hex(pack_bundle(table, m))


def test_zero_row_bundle_with_gaps() -> None:
    empty = RowBuilder("orders").to_table()
    m = manifest(empty, gaps=[Gap(5, 9, "maxlen")])
    assert (m.rows, m.first_seq, m.exchanges) == (0, None, {})
    got, t = unpack_bundle(pack_bundle(empty, m))
    assert got == m and t.num_rows == 0


def test_sha256_hex() -> None:
    assert sha256_hex(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize(
    "over",
    [
        {"rows": 49, "exchanges": {"ex-a": 32, "ex-b": 17}},
        {"first_seq": 99},
        {"last_seq": 150},
        {"exchanges": {"ex-a": 34, "ex-b": 16}},
        {"exchanges": {"ex-a": 33, "ex-c": 17}},
        {"channel": "other"},
        {"gaps": (Gap(120, 120, "said lost, but present"),)},
    ],
)
def test_pack_refuses_a_manifest_that_disagrees(table: pa.Table, over: dict[str, Any]) -> None:
    with pytest.raises(ManifestError, match="bundle_seq=3"):
        pack_bundle(table, replace(manifest(table), **over))


def test_pack_refuses_bad_rows(table: pa.Table) -> None:
    m = manifest(table)
    shuffled = table.take(pa.array([0, 2, 1, *range(3, 50)]))
    with pytest.raises(ManifestError, match="strictly increasing"):
        pack_bundle(shuffled, m)
    with pytest.raises(ManifestError, match="schema"):
        pack_bundle(table.drop_columns(["body"]), m)
    with pytest.raises(ManifestError, match="schema"):
        pack_bundle(table.cast(pa.schema([f.with_nullable(True) for f in row_schema()])), m)
    other = build(channel="other")
    with pytest.raises(ManifestError, match="another channel"):
        pack_bundle(other, m)
    with pytest.raises(ValueError):
        pack_bundle(table, m, zstd_level=0)


def forge(table: pa.Table, manifest_json: bytes | None, schema_version: bytes = b"2") -> bytes:
    """A Parquet file built by hand, as a forger would (bypasses pack_bundle's checks)."""
    schema = row_schema().with_metadata({b"diode.schema_version": schema_version})
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema) as w:
        w.write_table(table.replace_schema_metadata(schema.metadata))
        if manifest_json is not None:
            w.add_key_value_metadata({MANIFEST_KEY: manifest_json})
    return sink.getvalue().to_pybytes()


def _doc(table: pa.Table, **over: Any) -> bytes:
    doc = json.loads(manifest(table).to_json())
    doc.update(over)
    return json.dumps(doc).encode()


def test_forged_bundles(table: pa.Table) -> None:
    assert unpack_bundle(forge(table, _doc(table)))[1].equals(table)  # the forge itself is sound
    with pytest.raises(ManifestError, match="no diode.manifest"):
        unpack_bundle(forge(table, None))
    with pytest.raises(ManifestError):
        unpack_bundle(forge(table, _doc(table, rows=51, exchanges={"ex-a": 34, "ex-b": 17})))
    with pytest.raises(ManifestError):
        unpack_bundle(forge(table, _doc(table, last_seq=151)))
    with pytest.raises(ManifestError):
        unpack_bundle(forge(table, b"not json"))
    with pytest.raises(SchemaVersionError):
        unpack_bundle(forge(table, _doc(table, format=2)))
    with pytest.raises(SchemaVersionError):
        read_manifest(forge(table, _doc(table, schema_version=1)))
    with pytest.raises(ManifestError, match="schema version"):
        unpack_bundle(forge(table, _doc(table), schema_version=b"7"))
    dup = pa.concat_tables([table, table])
    with pytest.raises(ManifestError):
        unpack_bundle(forge(dup, _doc(table, rows=100, exchanges={"ex-a": 66, "ex-b": 34})))


def test_forged_rows_with_a_wrong_schema(table: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    narrow = table.drop_columns(["headers"])
    with pq.ParquetWriter(sink, narrow.schema) as w:
        w.write_table(narrow)
        w.add_key_value_metadata({MANIFEST_KEY: manifest(table).to_json()})
    with pytest.raises(ManifestError, match="schema"):
        unpack_bundle(sink.getvalue().to_pybytes())


@pytest.mark.parametrize("data", [b"", b"PAR1", b"PAR1" * 3, b"\x00" * 100, os.urandom(4096)])
def test_garbage_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack_bundle(data)
    with pytest.raises(ProtocolError):
        read_manifest(data)


def test_not_bytes_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        unpack_bundle("a string")  # type: ignore[arg-type]


def test_every_truncation_is_a_protocol_error(bundle: bytes) -> None:
    n = len(bundle)
    cuts = sorted({*range(0, n, max(1, n // 200)), *range(n - 300, n)})
    for n in cuts:
        with pytest.raises(ProtocolError):
            unpack_bundle(bundle[:n])


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_tampered_bytes_raise_only_protocol_errors(bundle: bytes, data: st.DataObject) -> None:
    blob = bytearray(bundle)
    for _ in range(data.draw(st.integers(1, 4))):
        # bias towards the footer, where the structure lives
        end = len(blob) - 1
        pos = data.draw(st.integers(0, end) | st.integers(max(0, end - 2000), end))
        blob[pos] ^= data.draw(st.integers(1, 255))
    try:
        m, t = unpack_bundle(bytes(blob))
    except ProtocolError:
        return
    check_rows(t, m)  # whatever survives is still self-consistent


def test_big_bundle_is_cheap() -> None:
    """~16 MB of 1 KB bodies packs and unpacks (smoke; timing is in the report)."""
    b = RowBuilder("orders")
    body = os.urandom(1024)
    for i in range(16_000):
        b.append(i, None, "ex", "rk", False, NO_PROPERTIES, body)
    t = b.to_table()
    m, back = unpack_bundle(pack_bundle(t, manifest(t)))
    assert m.rows == 16_000 and back.column("body")[15_999].as_py() == body
