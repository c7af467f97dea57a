"""Unit: values carried but not byte-exact are declared — manifest ``inexact`` ranges (optional
on the wire), spool notes -> ``inexact_reason`` rows, and the gap log's ``inexact`` kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.black.gaplog import append_gaps, read_gaps
from bridge.black.spool import SpoolWriter
from bridge.black.spool_rows import INEXACT_REASON, LOST_REASON, read_rows
from bridge.errors import ManifestError
from bridge.protocol.manifest import Gap, Manifest
from bridge.protocol.properties import NO_PROPERTIES


def _manifest(**kw: object) -> Manifest:
    base: dict[str, object] = dict(
        channel="c", bundle_seq=1, bundle_id="a" * 32, first_seq=0, last_seq=9, rows=10,
        exchanges={"x": 10}, created_at="2026-01-01T00:00:00.000000Z", bridge_id="b",
        prev_sha256=None,
    )  # fmt: skip
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def test_inexact_round_trips_and_is_omitted_when_empty() -> None:
    m = _manifest(inexact=(Gap(3, 4, "quorum-reencoded"),))
    assert Manifest.from_json(m.to_json()) == m
    assert b"inexact" not in _manifest().to_json()  # old readers see the same bytes as before


@pytest.mark.parametrize(
    "ranges",
    [(Gap(8, 12, "r"),), (Gap(3, 4, "r"), Gap(4, 5, "r")), (Gap(5, 5, "r"), Gap(1, 1, "r"))],
)
def test_inexact_ranges_must_sit_inside_the_rows_in_order(ranges: tuple[Gap, ...]) -> None:
    with pytest.raises(ManifestError, match="inexact"):
        _manifest(inexact=ranges)


def test_spool_notes_become_inexact_rows(tmp_path: Path) -> None:
    with SpoolWriter.open(tmp_path, "c", min_free_bytes=0) as w:
        w.append_one("ex", "rk", False, NO_PROPERTIES, b"a")
        w.append_one("ex", "rk", True, NO_PROPERTIES, b"b", "quorum-reencoded")
        w.append_lost("ex", "rk", "maxlen")
        w.sync(-1)
    rows = [r for b in read_rows(tmp_path, "c", 0, 3, {}) for r in b.to_pylist()]
    assert [r[INEXACT_REASON] for r in rows] == [None, "quorum-reencoded", None]
    assert [r[LOST_REASON] for r in rows] == [None, None, "maxlen"]


def test_gap_log_keeps_kinds_apart(tmp_path: Path) -> None:
    append_gaps(tmp_path, "c", 2, (Gap(5, 6, "maxlen"),))
    append_gaps(tmp_path, "c", 2, (Gap(5, 5, "quorum-reencoded"),), kind="inexact")
    append_gaps(tmp_path, "c", 2, (Gap(5, 6, "maxlen"),))  # a crash repeated the line
    got = [(g["kind"], g["first_seq"], g["reason"]) for g in read_gaps(tmp_path, "c")]
    assert sorted(got) == [("inexact", 5, "quorum-reencoded"), ("lost", 5, "maxlen")]
