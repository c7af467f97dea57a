"""Unit: black's spool — round trips by position, crash repair (also run without the tap, by
``SpoolWriter.repair``), a concurrent reader process, release and restart, the writer lock,
and SpoolFull by quota and by min_free_bytes.

Real files only (a temp dir per case); the concurrent reader and the lock holder are real
processes.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.black import spool as spool_mod
from bridge.black.spool import (
    KIND_LOST,
    KIND_MESSAGE,
    REASON_DAMAGED,
    SPOOL_SCHEMA,
    SpoolLocked,
    SpoolReader,
    SpoolWriter,
    fingerprint,
    segment_name,
)
from bridge.errors import SchemaVersionError, SpoolFull, SpoolGapError, StateError

CH = "orders"
Record = dict[str, Any]


def message(ex: str, rk: str, redelivered: bool, props: bytes, body: bytes) -> Record:
    return {
        "kind": KIND_MESSAGE,
        "exchange": ex,
        "routing_key": rk,
        "redelivered": redelivered,
        "properties_raw": props,
        "body": body,
        "reason": None,
    }


def lost(ex: str, rk: str, reason: str) -> Record:
    return {
        "kind": KIND_LOST,
        "exchange": ex,
        "routing_key": rk,
        "redelivered": False,
        "properties_raw": b"",
        "body": b"",
        "reason": reason,
    }


def body_of(pos: int) -> bytes:
    """Deterministic bodies of varying size, so any reader can check what it got."""
    return pos.to_bytes(8, "big") * (1 + pos % 23)


def numbered(pos: int) -> Record:
    return message(
        f"x{pos % 3}", f"rk.{pos}", pos % 5 == 0, b"\x80\x00" + bytes([pos % 7]), body_of(pos)
    )


def append_all(w: SpoolWriter, recs: list[Record]) -> None:
    """Messages in one bulk append, lost records one call each (the two ways the tap appends)."""
    msgs = [r for r in recs if r["kind"] == KIND_MESSAGE]
    if len(msgs) == len(recs):
        w.append(
            [r["exchange"] for r in recs],
            [r["routing_key"] for r in recs],
            [r["redelivered"] for r in recs],
            [r["properties_raw"] for r in recs],
            [r["body"] for r in recs],
        )
        return
    for r in recs:
        if r["kind"] == KIND_LOST:
            w.append_lost(r["exchange"], r["routing_key"], r["reason"])
        else:
            w.append(
                [r["exchange"]], [r["routing_key"]], [r["redelivered"]],
                [r["properties_raw"]], [r["body"]],
            )  # fmt: skip


def read_records(reader: SpoolReader, start: int, end: int, batch_rows: int = 8192) -> list[Record]:
    out: list[Record] = []
    for b in reader.read(start, end, batch_rows=batch_rows):
        assert b.schema.equals(SPOOL_SCHEMA, check_metadata=True)
        assert b.num_rows <= batch_rows
        out.extend(b.to_pylist())
    return out


def with_pos(recs: list[Record], first: int) -> list[Record]:
    return [{"pos": first + i, **r} for i, r in enumerate(recs)]


def opened(root: Path, **kw: Any) -> SpoolWriter:
    kw.setdefault("min_free_bytes", 0)
    return SpoolWriter.open(root, CH, **kw)


def segment_files(root: Path) -> list[Path]:
    return sorted((root / CH).glob("seg-*.arrow"))


def batch_count(path: Path) -> int:
    with pa.memory_map(str(path)) as m:
        return sum(1 for _ in pa.ipc.open_stream(m))


@pytest.fixture
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="spool") as d:
        yield Path(d)


# -- round trips ----------------------------------------------------------------------------------
records = st.one_of(
    st.builds(
        message,
        st.text(max_size=6),
        st.text(max_size=6),
        st.booleans(),
        st.binary(max_size=12),
        st.binary(max_size=48),
    ),
    st.builds(
        lost, st.text(max_size=4), st.text(max_size=4), st.sampled_from(["maxlen", "expired"])
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.lists(records, max_size=12), min_size=1, max_size=8),
    segment_bytes=st.sampled_from([1, 700, 1 << 30]),
    reopen_after=st.sets(st.integers(0, 7)),
    split_bytes=st.sampled_from([40, spool_mod.MAX_BATCH_BYTES]),
    data=st.data(),
)
def test_any_range_reads_back_exactly_what_was_appended(
    groups: list[list[Record]],
    segment_bytes: int,
    reopen_after: set[int],
    split_bytes: int,
    data: st.DataObject,
) -> None:
    expected: list[Record] = []
    with (
        tempfile.TemporaryDirectory(prefix="spool") as d,
        mock.patch.object(spool_mod, "MAX_BATCH_BYTES", split_bytes),
    ):
        root = Path(d)
        w = opened(root, segment_bytes=segment_bytes)
        try:
            for k, g in enumerate(groups):
                assert w.next_pos == len(expected)
                append_all(w, g)
                assert w.pending == len(g) and w.next_pos == len(expected) + len(g)
                assert w.sync(len(expected) - 1) == len(expected) + len(g)
                assert w.pending == 0 and w.pending_bytes == 0
                expected.extend(g)
                if k in reopen_after:
                    w.close()
                    w = opened(root, segment_bytes=segment_bytes)
                    assert w.repaired_bytes == 0 and w.durable_end == len(expected)
        finally:
            w.close()
        reader = SpoolReader(root, CH)
        n = len(expected)
        assert reader.durable_end() == n and reader.first_pos() == 0
        assert read_records(reader, 0, n) == with_pos(expected, 0)
        for _ in range(4):
            start = data.draw(st.integers(0, n))
            end = data.draw(st.integers(start, n))
            rows = data.draw(st.integers(1, 5))
            assert read_records(reader, start, end, rows) == with_pos(expected[start:end], start)


def test_positions_are_the_segment_names_and_batches_carry_acked_through(root: Path) -> None:
    with opened(root, segment_bytes=1) as w:  # every sync rolls to a new segment
        for k in range(3):
            append_all(w, [numbered(w.next_pos + i) for i in range(k + 1)])
            w.sync(w.durable_end - 1)
        assert w.acked_through == 2  # recorded by the last batch
    assert [p.name for p in segment_files(root)] == [segment_name(n) for n in (0, 1, 3)]
    with pa.memory_map(str(segment_files(root)[1])) as m:
        r = pa.ipc.open_stream(m)
        b, md = r.read_next_batch_with_custom_metadata()
        assert b.column("pos").to_pylist() == [1, 2] and md[b"acked_through"] == b"0"
    with opened(root) as w:
        assert (w.next_pos, w.acked_through) == (6, 2)


def test_a_large_sync_is_split_into_several_batches_of_one_segment(root: Path) -> None:
    recs = [numbered(i) for i in range(50)]
    with mock.patch.object(spool_mod, "MAX_BATCH_BYTES", 1000), opened(root) as w:
        append_all(w, recs)
        w.sync(-1)
    assert batch_count(segment_files(root)[0]) > 3
    assert read_records(SpoolReader(root, CH), 0, 50) == with_pos(recs, 0)


def test_an_old_segment_rolls_over(root: Path) -> None:
    with opened(root, segment_max_age_s=1e-9) as w:
        for _ in range(3):
            append_all(w, [numbered(w.next_pos)])
            w.sync(-1)
    assert len(segment_files(root)) == 3


# -- crash repair ---------------------------------------------------------------------------------
def write_groups(root: Path, sizes: list[int]) -> tuple[list[Record], int, int]:
    """Sync one group per size into one segment; returns records, the segment's size before and
    after the last sync."""
    recs: list[Record] = []
    before = 0
    with opened(root) as w:
        for s in sizes:
            before = segment_files(root)[-1].stat().st_size
            g = [numbered(len(recs) + i) for i in range(s)]
            append_all(w, g)
            w.sync(len(recs) - 1)
            recs.extend(g)
    return recs, before, segment_files(root)[-1].stat().st_size


def set_tail(root: Path, value: int | None) -> None:
    p = root / CH / "TAIL"
    if value is None:
        p.unlink()
    else:
        p.write_bytes(b"%020d\n" % value)


def continue_and_check(root: Path, kept: list[Record]) -> None:
    """Reopen found ``kept``: append more, and every position is there once, in order."""
    with opened(root) as w:
        assert w.durable_end == len(kept)
        more = [numbered(len(kept) + i) for i in range(3)]
        append_all(w, more)
        w.sync(-1)
    reader = SpoolReader(root, CH)
    assert reader.durable_end() == len(kept) + 3
    got = read_records(reader, 0, len(kept) + 3)
    assert [r["pos"] for r in got] == list(range(len(kept) + 3))
    assert got == with_pos(kept + more, 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5), cut=st.floats(0, 1))
def test_a_batch_cut_by_a_crash_before_its_fsync_is_cut_away(sizes: list[int], cut: float) -> None:
    with tempfile.TemporaryDirectory(prefix="spool") as d:
        root = Path(d)
        recs, before, after = write_groups(root, sizes)
        at = before + int(cut * (after - before - 1))  # anywhere inside the last batch
        os.truncate(segment_files(root)[-1], at)
        set_tail(root, len(recs) - sizes[-1])  # the crash came before the fsync and TAIL
        kept = recs[: len(recs) - sizes[-1]]
        with opened(root) as w:
            assert w.repaired_bytes == at - before
            assert (root / CH / segment_name(0)).stat().st_size == before
            assert (w.next_pos, w.damaged) == (len(kept), 0)
        continue_and_check(root, kept)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    garbage=st.one_of(
        st.binary(min_size=1, max_size=300),
        st.binary(max_size=40).map(lambda b: b"\xff\xff\xff\xff" + b),
    ),
    tail_known=st.booleans(),
)
def test_garbage_after_the_last_batch_is_cut_away(
    sizes: list[int], garbage: bytes, tail_known: bool
) -> None:
    with tempfile.TemporaryDirectory(prefix="spool") as d:
        root = Path(d)
        recs, _, after = write_groups(root, sizes)
        with open(segment_files(root)[-1], "ab") as f:
            f.write(garbage)
        if not tail_known:
            set_tail(root, None)
        reader = SpoolReader(root, CH)
        assert reader.durable_end() == len(recs)  # readers stop at what parses, too
        with opened(root) as w:
            assert w.repaired_bytes == len(garbage) and w.next_pos == len(recs)
        assert (root / CH / segment_name(0)).stat().st_size == after
        continue_and_check(root, recs)


def test_a_complete_batch_a_crash_left_unconfirmed_is_kept(root: Path) -> None:
    recs, _, _ = write_groups(root, [4, 3])
    set_tail(root, 4)  # the crash came after the write, before TAIL: the batch is whole
    assert SpoolReader(root, CH).durable_end() == 4  # readers trust TAIL until it moves
    with opened(root) as w:
        assert w.repaired_bytes == 0 and w.next_pos == 7 and w.acked_through == 3
        assert w.records_after(w.acked_through).column("pos").to_pylist() == [4, 5, 6]
    continue_and_check(root, recs)


def test_records_the_disk_lost_after_their_fsync_become_lost_positions(root: Path) -> None:
    recs, before, _ = write_groups(root, [4, 3])
    os.truncate(segment_files(root)[-1], before + 10)  # TAIL still says 7 were durable
    with opened(root) as w:
        assert (w.damaged, w.repaired_bytes > 0, w.durable_end) == (3, True, 7)
    got = read_records(SpoolReader(root, CH), 0, 7)
    assert got[:4] == with_pos(recs[:4], 0)
    assert [(r["pos"], r["kind"], r["reason"]) for r in got[4:]] == [
        (p, KIND_LOST, REASON_DAMAGED) for p in (4, 5, 6)
    ]


def test_damage_an_open_could_not_record_is_found_by_the_next_open(root: Path) -> None:
    """TAIL keeps saying what was durable until the lost records are: an open that a full
    disk stops while it records them does not make the next one forget the loss."""
    recs, before, _ = write_groups(root, [4, 3])
    os.truncate(segment_files(root)[-1], before + 10)  # TAIL still says 7 were durable
    with pytest.raises(SpoolFull, match="min_free_bytes"):
        opened(root, min_free_bytes=1 << 62)  # no room to write the lost records
    assert (root / CH / "TAIL").read_bytes() == b"%020d\n" % 7
    with opened(root) as w:
        assert (w.damaged, w.durable_end) == (3, 7)
    got = read_records(SpoolReader(root, CH), 0, 7)
    assert [(r["kind"], r["reason"]) for r in got[4:]] == [(KIND_LOST, REASON_DAMAGED)] * 3


def test_repair_without_the_tap_rewrites_a_tail_a_power_loss_left_behind(root: Path) -> None:
    assert SpoolWriter.repair(root, CH, min_free_bytes=0) is None  # no segment: nothing to do
    assert not (root / CH).exists()
    recs, _, _ = write_groups(root, [4, 3])
    set_tail(root, 4)  # the segment was fsynced, the in-place rewrite of TAIL was not
    assert SpoolReader(root, CH).durable_end() == 4
    w = SpoolWriter.repair(root, CH, min_free_bytes=0)
    assert w is not None and (w.durable_end, w.damaged, w.repaired_bytes) == (7, 0, 0)
    assert SpoolReader(root, CH).durable_end() == 7
    assert read_records(SpoolReader(root, CH), 0, 7) == with_pos(recs, 0)
    continue_and_check(root, recs)  # the lock was let go: the tap opens the spool


def test_repair_leaves_a_spool_whose_writer_holds_the_lock_alone(root: Path) -> None:
    write_groups(root, [4, 3])
    with held_by_another_process(root):
        files = sorted((f.name, f.stat().st_size) for f in (root / CH).iterdir())
        assert SpoolWriter.repair(root, CH, min_free_bytes=0) is None
        assert sorted((f.name, f.stat().st_size) for f in (root / CH).iterdir()) == files
        with pytest.raises(SpoolLocked):
            opened(root)


# -- readers --------------------------------------------------------------------------------------
def test_readers_never_read_past_tail_and_stop_at_an_incomplete_batch(root: Path) -> None:
    recs, before, after = write_groups(root, [5, 5])
    reader = SpoolReader(root, CH)
    set_tail(root, 5)  # the second batch is written but (as far as TAIL knows) not fsynced
    assert reader.durable_end() == 5
    assert read_records(reader, 0, 5) == with_pos(recs[:5], 0)
    with pytest.raises(SpoolGapError, match=r"\[3, 6\).*only before position 5"):
        list(reader.read(3, 6))
    set_tail(root, None)  # no TAIL: scan; a batch being appended (half written) ends it
    os.truncate(segment_files(root)[-1], before + (after - before) // 2)
    assert reader.durable_end() == 5
    with pytest.raises(SpoolGapError):
        list(reader.read(0, 6))


def test_reader_of_a_spool_never_written(root: Path) -> None:
    reader = SpoolReader(root, "nothing")
    assert (reader.durable_end(), reader.first_pos(), reader.used_bytes()) == (0, 0, 0)
    assert list(reader.read(0, 0)) == []
    with pytest.raises(SpoolGapError, match="'nothing'"):
        list(reader.read(0, 1))


def test_a_segment_missing_between_others_is_a_gap(root: Path) -> None:
    with opened(root, segment_bytes=1) as w:
        for _ in range(3):
            append_all(w, [numbered(w.next_pos + i) for i in range(2)])
            w.sync(-1)
    (root / CH / segment_name(2)).unlink()
    reader = SpoolReader(root, CH)
    assert read_records(reader, 0, 2) == with_pos([numbered(0), numbered(1)], 0)
    with pytest.raises(SpoolGapError, match=r"\[2, 4\) are missing"):
        list(reader.read(1, 6))


def test_a_segment_of_another_format_is_refused(root: Path) -> None:
    (root / CH).mkdir()
    other = pa.schema([("pos", pa.int64())])
    with pa.OSFile(str(root / CH / segment_name(0)), "wb") as f, pa.ipc.new_stream(f, other) as s:
        s.write_batch(pa.record_batch([pa.array([0])], schema=other))
    with pytest.raises(SchemaVersionError, match="seg-0000000000000000.arrow"):
        SpoolReader(root, CH).durable_end()
    with pytest.raises(SchemaVersionError):
        opened(root)


READER = r"""
import sys
import time
from pathlib import Path
from bridge.black.spool import SpoolReader
from bridge.errors import SpoolGapError

root, channel, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
r = SpoolReader(root, channel)
done = reads = gaps = 0
while done < n:
    de = r.durable_end()
    assert de <= n, de
    if de == done:
        time.sleep(0.001)
        continue
    try:
        got = [b for b in r.read(done, de, batch_rows=7)]
        # re-read the tail of the segment being written: repeated reads see the same records
        tail = [b for b in r.read(max(r.first_pos(), de - 20), de)]
    except SpoolGapError:
        gaps += 1
        continue
    reads += 1
    pos = done
    for b in got:
        for p, body in zip(b.column("pos").to_pylist(), b.column("body").to_pylist()):
            assert p == pos and body == p.to_bytes(8, "big") * (1 + p % 23), (p, pos)
            pos += 1
    assert pos == de, (pos, de)
    assert tail[-1].column("pos")[-1].as_py() == de - 1
    done = de
    print("seen", de, flush=True)
print("done", reads, gaps, flush=True)
"""


def test_a_reader_process_follows_a_writer_that_appends_rolls_and_releases(root: Path) -> None:
    n = 3000
    p = subprocess.Popen(
        [sys.executable, "-c", READER, str(root), CH, str(n)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    seen = 0
    handshakes = released = 0
    names: set[str] = set()
    try:
        assert p.stdout is not None
        with opened(root, segment_bytes=16 * 1024) as w:
            k = 0
            while w.next_pos < n:
                size = min(1 + (k * 37) % 60, n - w.next_pos)
                append_all(w, [numbered(w.next_pos + i) for i in range(size)])
                w.sync(w.durable_end - 1)
                names.update(f.name for f in segment_files(root))
                k += 1
                if k % 4 == 0 and w.durable_end < n:  # let the reader catch up mid-way
                    while seen < w.durable_end:
                        line = p.stdout.readline().split()
                        assert line and line[0] == "seen", line
                        seen = int(line[1])
                    handshakes += 1
                    released += w.release_through(seen - 1)  # what the reader verified may go
        tail = p.stdout.read().split("\n")
        assert p.wait(timeout=120) == 0
    finally:
        p.kill()
        p.wait()
    done = [ln for ln in tail if ln.startswith("done")]
    assert done, tail
    reads = int(done[0].split()[1])
    assert handshakes >= 10 and reads >= handshakes  # it read while the writer was mid-way
    assert len(names) > 10 and released > 0  # across segments the writer rolled and released


WRITER = r"""
import sys
from pathlib import Path
from bridge.black.spool import SpoolWriter
from tests.unit.test_spool import body_of

w = SpoolWriter.open(Path(sys.argv[1]), sys.argv[2], min_free_bytes=0, segment_bytes=64 << 10)
k = 0
while True:
    for i in range(1 + k % 50):
        p = w.next_pos
        w.append_one(f"x{p % 3}", f"rk.{p}", False, b"\x80\x00", body_of(p))
    print("appended", w.next_pos, flush=True)
    print("synced", w.sync(w.durable_end - 1), flush=True)
    k += 1
"""


def run_writer_until_killed(
    root: Path, env: dict[str, str], lines: int | None = None
) -> tuple[int, int]:
    """Run WRITER until it dies (a crash point) or ``lines`` syncs, then SIGKILL it.

    Returns (durable_end it last reported, records it had appended in all)."""
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), CH],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, **env},
    )
    synced = appended = 0
    try:
        assert p.stdout is not None
        for line in p.stdout:
            word, value = line.split()
            if word == "appended":
                appended = int(value)
            else:
                synced = int(value)
                if lines is not None and (lines := lines - 1) <= 0:
                    break
    finally:
        p.kill()
        p.wait()
    return synced, appended


def check_gapless(root: Path, n: int) -> None:
    got = read_records(SpoolReader(root, CH), 0, n)
    assert [r["pos"] for r in got] == list(range(n))
    assert all(r["body"] == body_of(r["pos"]) and r["routing_key"] == f"rk.{r['pos']}" for r in got)


@pytest.mark.parametrize("point", ["spool.mid_write", "spool.before_fsync", "spool.before_tail"])
def test_a_crash_inside_sync_keeps_what_is_whole_and_cuts_the_rest(root: Path, point: str) -> None:
    mark = root / "crash-mark"
    nth = 3 + sum(map(ord, point)) % 40
    synced, appended = run_writer_until_killed(
        root, {"DIODE_CRASH_AT": f"{point}:{nth}", "DIODE_CRASH_MARK": str(mark)}
    )
    assert mark.read_text().split() == [point]  # the crash hit that very window
    assert SpoolReader(root, CH).durable_end() == synced  # readers trust TAIL
    with opened(root) as w:
        n = w.durable_end
        if point == "spool.mid_write":  # the half batch is cut, nothing of it kept
            assert w.repaired_bytes > 0 and n == synced
        else:  # the whole batch stays: its records are the ones the broker will redeliver
            assert w.repaired_bytes == 0 and n == appended > synced
            assert w.records_after(w.acked_through).num_rows >= appended - synced
    check_gapless(root, n)


@pytest.mark.parametrize("seed", range(2))
def test_kill_9_of_a_writer_at_a_random_moment_loses_nothing_it_synced(
    root: Path, seed: int
) -> None:
    synced, _ = run_writer_until_killed(root, {}, lines=random.Random(seed).randint(5, 200))
    with opened(root) as w:
        n = w.durable_end
        assert n >= synced  # every sync it reported is there (and maybe one more)
    check_gapless(root, n)


# -- records_after, release and restart -----------------------------------------------------------
def test_records_after(root: Path) -> None:
    with opened(root, segment_bytes=1) as w:
        recs = [numbered(i) for i in range(10)]
        append_all(w, recs[:6])
        w.sync(-1)
        append_all(w, recs[6:])
        w.sync(5)
        assert w.records_after(7).to_pylist() == with_pos(recs[8:], 8)
        assert w.records_after(9).num_rows == 0
        assert w.records_after(-1).num_rows == 10
        assert w.records_after(-1).schema.equals(SPOOL_SCHEMA)
        assert w.release_through(5) > 0  # the first segment [0, 6) goes
        assert w.records_after(-1).column("pos").to_pylist() == list(range(6, 10))


def test_positions_survive_releasing_every_segment_and_restarts(root: Path) -> None:
    with opened(root) as w:
        append_all(w, [numbered(i) for i in range(5)])
        w.sync(4)
        assert w.release_through(100) == 0  # the segment being written is never released
    with opened(root) as w:
        assert w.release_through(100) > 0  # now closed: shipped and acked, so it goes
        assert [p.name for p in segment_files(root)] == [segment_name(5)]  # carries position 5
        reader = SpoolReader(root, CH)
        assert (reader.first_pos(), reader.durable_end()) == (5, 5)
        with pytest.raises(SpoolGapError, match=r"\[2, 5\).*released"):
            list(reader.read(2, 5))
    for _ in range(2):  # restarts of an empty spool keep the position
        with opened(root) as w:
            assert (w.next_pos, w.acked_through) == (5, 4)
    with opened(root) as w:
        append_all(w, [numbered(5)])
        assert w.sync(5) == 6
    assert read_records(SpoolReader(root, CH), 5, 6) == with_pos([numbered(5)], 5)


def test_records_the_broker_may_redeliver_are_never_released(root: Path) -> None:
    with opened(root, segment_bytes=1) as w:
        for _ in range(3):
            append_all(w, [numbered(w.next_pos + i) for i in range(4)])
            w.sync(3)  # the tap confirmed acks through position 3 only
        assert w.release_through(11) > 0  # shipped through 11, but only [0, 4) may go
        assert SpoolReader(root, CH).first_pos() == 4
        assert w.records_after(w.acked_through).column("pos").to_pylist() == list(range(4, 12))
        assert w.sync(11) == 12  # nothing pending: records the newer acked_through alone
        assert w.release_through(11) > 0
        assert SpoolReader(root, CH).first_pos() == 8  # [8, 12) is the segment being written


def test_a_new_spool_can_start_after_the_shipped_seq(root: Path) -> None:
    with opened(root, first_pos=42) as w:
        assert w.next_pos == 42
        append_all(w, [numbered(42)])
        w.sync(-1)
    with opened(root, first_pos=0) as w:  # ignored once the spool exists
        assert w.next_pos == 43


HOLDER = """
import sys, time
from pathlib import Path
from bridge.black.spool import SpoolWriter
w = SpoolWriter.open(Path(sys.argv[1]), sys.argv[2], min_free_bytes=0)
print("held", flush=True)
time.sleep(120)
"""


@contextmanager
def held_by_another_process(root: Path) -> Iterator[None]:
    """The channel's spool opened by a writer in another process until the block ends (then
    SIGKILLed: the kernel drops its flock with it)."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), CH],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        yield
    finally:
        p.kill()
        p.wait()


def test_a_second_writer_is_refused_while_another_process_holds_the_lock(root: Path) -> None:
    with held_by_another_process(root):
        with pytest.raises(StateError, match=f"channel '{CH}'.*another process holds .*LOCK"):
            opened(root)
    with opened(root) as w:
        assert w.next_pos == 0


def test_bad_settings_fail_fast(root: Path) -> None:
    from bridge.errors import ConfigError

    with pytest.raises(ConfigError, match="segment_bytes"):
        opened(root, segment_bytes=0)
    with pytest.raises(ConfigError, match="directory name"):
        SpoolWriter.open(root, "../x")


# -- full ---------------------------------------------------------------------------------------
def test_quota_pauses_then_release_makes_room_and_nothing_is_lost_or_doubled(root: Path) -> None:
    expected: list[Record] = []
    fulls: list[SpoolFull] = []
    with opened(root, max_bytes=20_000) as w:
        # an empty spool takes one group past the quota: waiting could not make room
        big = [numbered(i) for i in range(200)]
        append_all(w, big)
        w.sync(-1)
        expected.extend(big)
        assert w.used_bytes() > 20_000
        confirmed = w.durable_end - 1  # the tap confirmed its ack
        for _ in range(6):
            g = [numbered(w.next_pos + i) for i in range(30)]
            append_all(w, g)
            while True:
                try:
                    w.sync(confirmed)
                    break
                except SpoolFull as e:
                    fulls.append(e)
                    assert e.errno is None and "quota" in str(e) and "max_bytes" in str(e)
                    assert w.pending == len(g)  # still buffered for the retry
                    freed = w.release_through(w.durable_end - 1)  # black shipped it all
                    assert freed > 0, "the pause must end once shipped segments go"
            expected.extend(g)
            confirmed = w.durable_end - 1
        n = w.durable_end
    assert fulls, "the quota was never reached"
    reader = SpoolReader(root, CH)
    first = reader.first_pos()
    assert n == len(expected) and first > 0
    assert read_records(reader, first, n) == with_pos(expected[first:], first)


def test_min_free_bytes_pauses_until_there_is_room(root: Path) -> None:
    with opened(root, min_free_bytes=1 << 62) as w:
        recs = [numbered(i) for i in range(3)]
        append_all(w, recs)
        with pytest.raises(SpoolFull, match="bytes free.*min_free_bytes") as e:
            w.sync(-1)
        assert e.value.errno is None and e.value.free_bytes is not None
        assert (w.pending, w.durable_end) == (3, 0)
        w.min_free_bytes = 0  # (space came back)
        assert w.sync(-1) == 3
    assert read_records(SpoolReader(root, CH), 0, 3) == with_pos(recs, 0)


def test_a_roll_a_full_disk_refused_is_retried_until_release_can_make_room(root: Path) -> None:
    """Paused on a full spool, only closed segments can be released: if the disk refused to
    close the current one (its new segment's header: ENOSPC), ``make_releasable`` says so and
    succeeds once there is room, and then release frees what was shipped and acked."""
    enospc = OSError(errno.ENOSPC, "No space left on device")
    with opened(root, segment_bytes=1 << 30) as w:
        append_all(w, [numbered(i) for i in range(8)])
        w.sync(3)
        with mock.patch.object(spool_mod, "pwritev_all", side_effect=enospc):
            assert w.make_releasable(7) is False  # neither acked_through nor the roll fit
        assert (w.acked_through, w.release_through(7)) == (3, 0)
        assert [p.name for p in segment_files(root)] == [segment_name(0)]
        assert w.make_releasable(7) is True  # room again
        assert w.acked_through == 7 and w.release_through(7) > 0
        assert [p.name for p in segment_files(root)] == [segment_name(8)]
        assert w.make_releasable(7) is True  # nothing more to do: no new segment
        assert [p.name for p in segment_files(root)] == [segment_name(8)]
    assert SpoolReader(root, CH).durable_end() == 8


def test_a_lost_record_keeps_the_fingerprint_of_its_dead_letter(root: Path) -> None:
    """So that a redelivered dead letter is recognised; its properties are never shipped."""
    fp = fingerprint("ev", "k1", b"\x00\x00", b"body")
    with opened(root) as w:
        w.append_lost("ev", "k1", "maxlen", dead_letter=fp)
        w.append_lost("", "", "spool_lost", 2)
        w.sync(-1)
        with pytest.raises(ValueError, match="fingerprint"):
            w.append_lost("ev", "k", "maxlen", dead_letter=b"short")
        with pytest.raises(ValueError, match="fingerprint"):
            w.append_lost("ev", "k", "maxlen", 2, dead_letter=fp)
        assert w.records_after(-1).column("properties_raw").to_pylist() == [fp, b"", b""]
    rows = read_records(SpoolReader(root, CH), 0, 3)
    assert [(r["kind"], r["routing_key"], r["reason"]) for r in rows] == [
        (KIND_LOST, "k1", "maxlen"), (KIND_LOST, "", "spool_lost"), (KIND_LOST, "", "spool_lost"),
    ]  # fmt: skip


# -- fingerprint ----------------------------------------------------------------------------------
@given(
    st.tuples(
        st.text(max_size=4), st.text(max_size=4), st.binary(max_size=4), st.binary(max_size=4)
    )
)
def test_fingerprint_tells_field_boundaries_apart(f: tuple[str, str, bytes, bytes]) -> None:
    ex, rk, props, body = f
    fp = fingerprint(ex, rk, props, body)
    assert len(fp) == 16 and fp == fingerprint(ex, rk, props, body)
    assert fp != fingerprint(ex + "a", rk, props, body)
    assert fp != fingerprint(ex, rk + "a", props, body)
    assert fp != fingerprint(ex, rk, props + b"a", body)
    assert fp != fingerprint(ex, rk, props, body + b"a")
    if rk:
        assert fp != fingerprint(ex + rk[0], rk[1:], props, body)
    if body:
        assert fp != fingerprint(ex, rk, props + body[:1], body[1:])
