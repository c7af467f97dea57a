"""Black, seal: a re-sealed bundle's inexact ranges keep exactly the seqs that are still rows."""

from __future__ import annotations

import pyarrow as pa

from bridge.black.seal import BundleSealer
from bridge.protocol.manifest import Gap, Manifest

PD, QR = "possible-duplicate", "quorum-reencoded"


def reseal(old: Manifest, rows: pa.Table) -> Manifest:
    """The sealer's re-seal manifest (pure: it reads its arguments only, no config)."""
    return BundleSealer.__new__(BundleSealer)._reseal_manifest(old, rows)


def interrupted(inexact: tuple[Gap, ...], gaps: tuple[Gap, ...] = ()) -> Manifest:
    """The journal's intent of bundle 4: rows 10..19 but the seqs of ``gaps``."""
    rows = 10 - sum(g.last_seq - g.first_seq + 1 for g in gaps)
    return Manifest(
        channel="c1",
        bundle_seq=4,
        bundle_id="0123456789abcdef0123456789abcdef",
        first_seq=10,
        last_seq=19,
        rows=rows,
        exchanges={"ex": rows},
        created_at="2026-01-02T03:04:05.000006Z",
        bridge_id="black-1",
        prev_sha256="ab" * 32,
        gaps=gaps,
        inexact=inexact,
    )


def spool_rows(seqs: list[int]) -> pa.Table:
    """What the spool still gives of the bundle (only the columns the manifest is built from)."""
    return pa.table({"seq": pa.array(seqs, pa.int64()), "exchange": ["ex"] * len(seqs)})


def test_an_inexact_range_whose_endpoint_is_lost_keeps_its_surviving_seqs() -> None:
    old = interrupted((Gap(10, 12, PD), Gap(15, 17, QR)))
    m = reseal(old, spool_rows([11, 12, 13, 14, 15, 17, 18, 19]))
    assert m.gaps == (Gap(10, 10, "unrecoverable"), Gap(16, 16, "unrecoverable"))
    # 11..12 stay inexact though 10 is gone; 16 (now a gap) is no longer listed as inexact
    assert m.inexact == (Gap(11, 12, PD), Gap(15, 15, QR), Gap(17, 17, QR))
    assert (m.first_seq, m.last_seq, m.rows, m.bundle_seq) == (11, 19, 8, 4)
    assert m.bundle_id != old.bundle_id and m.prev_sha256 == old.prev_sha256


def test_inexact_ranges_unchanged_when_every_row_is_back() -> None:
    old = interrupted((Gap(10, 10, QR), Gap(12, 19, PD)), gaps=(Gap(11, 11, "maxlen"),))
    m = reseal(old, spool_rows([10, *range(12, 20)]))
    assert m.inexact == old.inexact and m.gaps == old.gaps


def test_inexact_ranges_all_lost() -> None:
    old = interrupted((Gap(18, 19, PD),))
    m = reseal(old, spool_rows(list(range(10, 18))))
    assert m.inexact == () and m.gaps == (Gap(18, 19, "unrecoverable"),)
    assert m.last_seq == 17
