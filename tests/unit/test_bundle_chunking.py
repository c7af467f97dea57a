"""Bundles: the packed bytes depend on the rows, never on how the Arrow table is chunked."""

from __future__ import annotations

import functools
import random

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.protocol.bundle import manifest_for, pack_bundle_buffer, sha256_hex
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.manifest import Manifest
from bridge.protocol.properties import Properties, encode_properties, field_table
from bridge.protocol.rows import RowBuilder

ROWS = 3000


@functools.cache
def rows() -> pa.Table:
    """One chunk of rows big enough that every kind of column crosses the writer's page and
    dictionary limits (1 MiB): random bodies (~2 MB), header maps of varying entry counts
    (~2 MB of values), unique routing keys (a dictionary column falling back to plain)."""
    r = random.Random(7)
    b = RowBuilder("orders")
    for i in range(ROWS):
        k = r.randrange(5)
        headers = (
            field_table({f"h{j}-{r.randrange(10**6)}": "v" * r.randrange(1200) for j in range(k)})
            if k
            else None
        )
        ex = "ex-a" if i % 4 else "ex-b"
        b.append(
            10_000 + i,
            ExchangeDecl(ex, "topic"),
            ex,
            f"rk.{'x' * r.randrange(700)}.{i}",
            i % 9 == 0,
            encode_properties(Properties(message_id=f"m{i}", headers=headers)),
            r.randbytes(r.randrange(1500)),
        )
    return b.to_table().combine_chunks()


@functools.cache
def manifest() -> Manifest:
    return manifest_for(
        rows(),
        channel="orders",
        bundle_seq=2,
        bundle_id="0123456789abcdef0123456789abcdef",
        created_at="2026-01-02T03:04:05.000006Z",
        bridge_id="black-1",
        prev_sha256="ab" * 32,
    )


@functools.cache
def one_chunk_sha() -> str:
    table = rows()
    assert all(c.num_chunks == 1 for c in table.columns)
    return sha256_hex(pack_bundle_buffer(table, manifest()))


def chunked(table: pa.Table, cuts: list[int]) -> pa.Table:
    """``table`` as record batches ending at ``cuts`` (repeats: empty batches)."""
    bounds = [0, *sorted(cuts), len(table)]
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    batches = [b for a, z in pairs for b in table.slice(a, z - a).to_batches()]
    if len(cuts) % 2:  # and an empty batch in the middle
        empty = pa.RecordBatch.from_pylist([], schema=table.schema)
        batches.insert(len(batches) // 2, empty)
    return pa.Table.from_batches(batches, schema=table.schema)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=0, max_value=ROWS), max_size=12))
def test_any_chunking_packs_the_bytes_of_one_chunk(cuts: list[int]) -> None:
    table = chunked(rows(), cuts)
    assert table.equals(rows())
    assert sha256_hex(pack_bundle_buffer(table, manifest())) == one_chunk_sha()


def test_sink_and_rebuild_layouts_pack_the_same_bytes() -> None:
    """The layouts of the reviewer's case: the sink's bundle cut from 8192-row read slices of
    one large spool batch, the rebuild reading the bundle from its first row in one slice."""
    table = rows()
    sink = pa.Table.from_batches(
        [*table.slice(0, 1192).to_batches(), *table.slice(1192).to_batches()]
    )
    assert sink.column("body").num_chunks == 2
    assert sha256_hex(pack_bundle_buffer(sink, manifest())) == one_chunk_sha()


def test_tap_group_layout_packs_the_same_bytes() -> None:
    """Many small chunks (the tap's groups of 500, with one odd group): bytes as one chunk."""
    table = rows()
    cuts = [*range(500, 1500, 500), 1733, *range(2000, ROWS, 500)]
    assert sha256_hex(pack_bundle_buffer(chunked(table, cuts), manifest())) == one_chunk_sha()
