"""Scenario: black's spool on a real file system that fills up (a 2 MiB tmpfs mounted for the test).

The file system itself refuses the write (ENOSPC) — no mock: ``SpoolFull`` names the errno, the
segment is cut back to its last complete batch, the group stays buffered; once space is freed
the retry lands every record exactly once, gapless. The ``min_free_bytes`` reserve is checked
against the same real file system.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from bridge.black.spool import SpoolReader, SpoolWriter, segment_name
from bridge.errors import SpoolFull
from tests.support import small_tmpfs

CH = "orders"
BODY = 4096


def body_of(pos: int) -> bytes:
    return pos.to_bytes(8, "big") * (BODY // 8)


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A fresh 2 MiB tmpfs."""
    with small_tmpfs("2m", "spoolfs") as d:
        yield d


def append_group(w: SpoolWriter, n: int) -> list[int]:
    first = w.next_pos
    for p in range(first, first + n):
        w.append_one("ex", f"rk.{p}", False, b"\x00\x00", body_of(p))
    return list(range(first, first + n))


def check_all_once(root: Path, n: int) -> None:
    reader = SpoolReader(root, CH)
    assert (reader.first_pos(), reader.durable_end()) == (0, n)
    pos = 0
    for b in reader.read(0, n):
        for p, rk, body in zip(
            b.column("pos").to_pylist(),
            b.column("routing_key").to_pylist(),
            b.column("body").to_pylist(),
            strict=True,
        ):
            assert (p, rk, body) == (pos, f"rk.{pos}", body_of(pos))
            pos += 1
    assert pos == n


@pytest.mark.parametrize("segment_bytes", [64 << 20, 1], ids=["one-segment", "roll-every-sync"])
def test_enospc_pauses_and_the_retry_lands_everything_once(
    small_fs: Path, segment_bytes: int
) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1200 << 10))  # someone else's data on the same file system
    fulls: list[SpoolFull] = []
    with SpoolWriter.open(small_fs, CH, min_free_bytes=0, segment_bytes=segment_bytes) as w:
        while True:
            group = append_group(w, 20)
            sizes = {p.name: p.stat().st_size for p in (small_fs / CH).glob("seg-*.arrow")}
            try:
                w.sync(w.durable_end - 1)
            except SpoolFull as e:
                fulls.append(e)
                break
        full = fulls[0]
        assert full.errno == errno.ENOSPC and full.free_bytes is not None, full
        assert "No space left on device" in str(full) and str(small_fs / CH) in str(full)
        # nothing half-written stays: every segment is back at its last complete batch
        after = {p.name: p.stat().st_size for p in (small_fs / CH).glob("seg-*.arrow")}
        durable = w.durable_end
        assert {k: v for k, v in after.items() if k in sizes} == sizes
        for name in set(after) - set(sizes):  # a segment rolled to just before: header only
            assert name == segment_name(durable)
            with pa.memory_map(str(small_fs / CH / name)) as m:
                assert list(pa.ipc.open_stream(m)) == []
        assert not [p for p in (small_fs / CH).iterdir() if p.name.endswith(".tmp")]
        assert w.pending == len(group) and w.next_pos == durable + len(group)
        assert SpoolReader(small_fs, CH).durable_end() == durable
        with pytest.raises(SpoolFull):  # still full: the retry fails the same clean way
            w.sync(durable - 1)
        assert w.durable_end == durable and w.pending == len(group)

        filler.unlink()  # space is back
        assert w.sync(durable - 1) == durable + len(group)
        append_group(w, 20)
        n = w.sync(w.durable_end - 1)
    check_all_once(small_fs, n)
    with SpoolWriter.open(small_fs, CH, min_free_bytes=0) as w:  # nothing for a restart to cut
        assert (w.repaired_bytes, w.next_pos) == (0, n)


def test_min_free_bytes_is_checked_against_the_real_file_system(small_fs: Path) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (600 << 10))
    with SpoolWriter.open(small_fs, CH, min_free_bytes=1 << 20) as w:
        fulls: list[SpoolFull] = []
        while True:
            group = append_group(w, 10)
            try:
                w.sync(w.durable_end - 1)
            except SpoolFull as e:
                fulls.append(e)
                break
        full = fulls[0]
        assert full.errno is None and full.free_bytes is not None
        assert "min_free_bytes" in str(full)
        st = os.statvfs(small_fs)
        assert st.f_bavail * st.f_frsize >= 1 << 20  # paused before the reserve was touched
        durable = w.durable_end
        assert w.pending == len(group)
        assert (small_fs / CH / segment_name(0)).exists()
        filler.unlink()
        n = w.sync(durable - 1)
        assert n == durable + len(group)
    check_all_once(small_fs, n)
