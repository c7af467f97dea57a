"""Black, seal: a manifest's gap list counts against the file ceiling (real spool, gpg, Parquet).

Lost markers whose reasons alternate do not merge, so every lost seq is a gap of its own
(~54 bytes of manifest JSON). Enough of them fill a bundle on their own: the sealer must
spread them over several bundles (zero-row ones where they precede a row or end the batch),
never call a small message ``oversize`` because its gaps made its bundle too big, never
journal a bundle over the ceiling, and a crash at an intent must still finish at restart.
The rig and the outbox checks are those of ``test_seal_resume.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from bridge.black.seal import _Chain, seal_overhead_bytes
from bridge.crypto.keys import KeyInventory
from bridge.protocol.manifest import Gap, Manifest
from tests.integration.test_seal_resume import (
    Opened,
    Rig,
    all_rows,
    check_chain,
    crash_on_bundle,
    make_rig,
    messages_logged,
    open_outbox,
    read_spool,
    recovered,
    seal_log,
    spool_append,
)
from tests.support import key_inventory

pytestmark = pytest.mark.gpg

CEILING = 65536  # the smallest max_file_bytes the config allows: ~1000 gaps fill a bundle


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    # two red recipients, as make_rig expects
    with key_inventory("seal-test", red_names=("red", "red-audit")) as inv:
        yield inv


def _alternating(n: int) -> list[str | None]:
    """``n`` lost markers whose reasons alternate: no two adjacent gaps merge."""
    return ["maxlen" if k % 2 else "expired" for k in range(n)]


def _layout() -> list[str | None]:
    # None: a (10-byte-ish) message; a string: a lost marker with that reason
    return (
        [None] * 2
        + _alternating(2500)  # before a row: more than two bundles' worth of gaps
        + [None]
        + ["maxlen", None] * 300  # between rows: one gap per row
        + _alternating(2500)  # after the last row: zero-row bundles only
    )


def _check_outbox(rig: Rig, layout: list[str | None]) -> list[Opened]:
    bundles = open_outbox(rig)
    check_chain(bundles)  # bundle seqs 1..N, hash chain, coverage contiguous from seq 0
    for b in bundles:
        assert b.sealed_bytes <= CEILING, f"{b.name} is {b.sealed_bytes} bytes"
    for p in rig.outbox_dir.iterdir():
        assert p.stat().st_size <= CEILING, p.name
    gaps = [g for b in bundles for g in b.manifest.gaps]
    assert not [g for g in gaps if g.reason == "oversize"], "no message here is oversize"
    # every lost seq is a gap with its own reason, every message a row: nothing else
    lost = {s: g.reason for g in gaps for s in range(g.first_seq, g.last_seq + 1)}
    assert lost == {s: r for s, r in enumerate(layout) if r is not None}
    seqs = all_rows(bundles).column("seq").to_pylist()
    assert seqs == [s for s, r in enumerate(layout) if r is None]
    st = rig.state()
    assert st["pending"] is None
    assert (st["last_bundle_seq"], st["last_seq"]) == (len(bundles), len(layout) - 1)
    assert st["counters"]["messages"] == len(seqs)
    assert st["counters"].get("lost_oversize", 0) == 0
    assert st["counters"]["lost_maxlen"] + st["counters"]["lost_expired"] == len(lost)
    return bundles


def test_interleaved_gaps_are_spread_over_bundles_within_the_ceiling(
    keys: KeyInventory, short_tmp: Path
) -> None:
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=CEILING)
    layout = _layout()
    r = spool_append(rig, layout)
    with seal_log() as log:
        shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, r.start, r.stop))
    assert not messages_logged(log, "larger than the file ceiling"), "nothing is oversize"
    bundles = _check_outbox(rig, layout)
    assert [s.name for s in shipped] == [b.name for b in bundles]
    # the gaps before row 2502 and after the last row needed bundles of their own
    assert sum(1 for b in bundles if b.manifest.rows == 0) >= 4
    assert len(bundles) >= 6


def test_a_crash_at_an_intent_among_gap_bundles_finishes_at_restart(
    keys: KeyInventory, short_tmp: Path
) -> None:
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=CEILING)
    layout = _layout()
    r = spool_append(rig, layout)
    # crash after the intent of bundle 2 (a zero-row bundle of gaps), before its delivery
    pending = crash_on_bundle(rig, read_spool(rig, r.start, r.stop), 2)
    intent = Manifest.from_json(pending["manifest"].encode())
    assert pending["plaintext_bytes"] <= CEILING
    assert intent.gaps and all(g.reason != "oversize" for g in intent.gaps)

    before = recovered("rebuilt")
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, r.start, r.stop))
    assert recovered("rebuilt") - before == 1, "the interrupted bundle must be rebuilt"
    assert shipped[0].bundle_seq == 2 and shipped[0].sha256 == pending["sha256"]
    bundles = _check_outbox(rig, layout)
    assert bundles[1].manifest.to_json() == intent.to_json()
    # a replay ships nothing more
    assert rig.sealer().seal_rows(rig.channel, read_spool(rig, r.start, r.stop)) == []


def test_a_lone_row_behind_a_full_bundle_of_gaps_is_not_oversize(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """The reviewer's case: one small message preceded by more gaps than a bundle holds."""
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=CEILING)
    layout = _alternating(1500) + [None]
    r = spool_append(rig, layout)
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, r.start, r.stop))
    bundles = _check_outbox(rig, layout)
    assert len(shipped) == len(bundles) >= 2
    assert bundles[-1].manifest.rows == 1 and bundles[-1].manifest.last_seq == 1500
    assert not any(g.reason == "oversize" for b in bundles for g in b.manifest.gaps)
    assert Gap(1499, 1499, "maxlen") in [g for b in bundles for g in b.manifest.gaps]


def test_a_chunk_packed_over_the_ceiling_by_its_gaps_is_split_not_dropped(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """The sealer's own check, behind the plan: a one-row chunk whose gaps push it over the
    ceiling once packed (as a plan that did not count them made) is split before gpg and the
    journal — gaps first, in zero-row bundles, then the row alone — not dropped as oversize."""
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=CEILING)
    r = spool_append(rig, [None])
    sealer = rig.sealer()
    rows = read_spool(rig, r.start, r.stop).select(sealer.schema.names).cast(sealer.schema)
    gaps = [Gap(s, s, "maxlen" if s % 2 else "expired") for s in range(2400)]
    i = rows.schema.get_field_index("seq")  # the row follows the gaps
    rows = rows.set_column(i, rows.schema.field(i), pa.array([2400], pa.int64()))
    max_plain = CEILING - seal_overhead_bytes(len(rig.channel.recipients), CEILING)
    chain = _Chain(1, None)
    with seal_log() as log:
        packed = sealer._pack_chunk(rig.channel, chain, rows, gaps, max_plain)
    assert not messages_logged(log, "larger than the file ceiling")
    assert all(len(p.plain) <= max_plain for p in packed)
    assert [p.manifest.rows for p in packed] == [0] * (len(packed) - 1) + [1]
    assert [g for p in packed for g in p.manifest.gaps] == gaps
    assert [p.manifest.bundle_seq for p in packed] == list(range(1, len(packed) + 1))
    assert chain.bundle_seq == len(packed) + 1 and chain.prev_sha256 == packed[-1].sha
