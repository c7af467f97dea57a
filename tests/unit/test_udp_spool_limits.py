"""UDP receiver's reassembly spool (``udp_spool``), its limits: a restart holds no more open
objects nor memory than the caps (the oldest beyond them evicted as gaps, as at run time); gap
records the disk refuses take bounded memory however long it refuses them, each object still
counted; a stalled copy of an object delivered long ago (a replay, a resend) is no gap."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from bridge.diode import udp_spool
from bridge.diode.link_status import gap_objects, read_gap_records
from bridge.protocol.datagram import Symbol
from tests.unit.test_udp_reassembly import (
    NAME,
    K,
    T,
    _close_files,
    _refusing,
    envelope,
    feed,
    header,
    held_by,
    reassembler,
    symbols,
)

# -- 1. a restart keeps within max_open_objects and the held-bytes cap ------------------------


def _spooled(root: Path, n: int) -> list[list[Symbol]]:
    """``n`` objects (epoch 1, ids 0..n-1) with 3 symbols of their first block spooled, then a
    kill; object ``i`` last took a symbol ``100 + 10 * (n - i)`` s ago (0 the oldest). Returns
    each object's symbols."""
    ra = reassembler(root)
    out = []
    for i in range(n):
        env = envelope(os.urandom(T * K * 2), f"u1.{i:012d}.r.dbundle")
        syms = symbols(1, header(i, env), env, repair=2)
        feed(ra, syms[:3], now=float(i))
        out.append(syms)
    ra.flush_all()
    _close_files(ra)
    for i in range(n):
        when = time.time() - 100 - 10 * (n - i)
        for f in (root / "objects" / f"{1:020d}-{i:020d}").iterdir():
            os.utime(f, (when, when))
    return out


def test_a_restart_with_more_spooled_objects_than_max_open_evicts_the_oldest_as_gaps(
    tmp_path: Path,
) -> None:
    """Restarted after ``max_open_objects`` was lowered (or with a spool full of open objects),
    the receiver reopened every one: 5 open under a cap of 2. The oldest beyond the cap are
    evicted as at run time: an ``evicted`` gap record each, folder removed, later symbols
    dropped; the newest go on and complete."""
    syms = _spooled(tmp_path, 5)
    ra = reassembler(tmp_path, max_open_objects=2)
    assert ra.recover(5000.0) == 2
    assert sorted(ra.open) == [(1, 3), (1, 4)]
    gaps = read_gap_records(tmp_path)
    assert [(g["object_id"], g["reason"]) for g in gaps] == [(i, "evicted") for i in range(3)]
    assert all(g["symbols_received"] == 3 for g in gaps)  # what the spool held of each
    assert ra.held == held_by(ra)
    assert ra.wait_trash(10) and len(list((tmp_path / "objects").iterdir())) == 2
    feed(ra, syms[0][3:], now=5001.0)  # an evicted object's later symbols: dropped
    assert ra.dropped == {"expired": len(syms[0]) - 3} and len(ra.open) == 2
    feed(ra, syms[4][3:], now=5001.0)
    assert [d.header.object_id for d in ra.ready] == [4]


def test_a_restart_holding_more_than_the_held_bytes_cap_evicts_the_oldest(tmp_path: Path) -> None:
    _spooled(tmp_path, 5)
    one = 3 * (T + udp_spool._SYMBOL_OVERHEAD) + udp_spool._DECODER_OVERHEAD  # each object's
    ra = reassembler(tmp_path, max_held_bytes=2 * one + one // 2)
    assert ra.recover(5000.0) == 2
    assert sorted(ra.open) == [(1, 3), (1, 4)] and ra.held == held_by(ra) == 2 * one
    reasons = [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)]
    assert reasons == [(i, "evicted") for i in range(3)]


def test_objects_a_restart_finds_complete_are_delivered_not_evicted(tmp_path: Path) -> None:
    """A rebuilt object waiting for its delivery holds no decoder: it is not counted against
    the caps, and never evicted for them."""
    _spooled(tmp_path, 3)
    ra = reassembler(tmp_path)
    env = envelope(os.urandom(T * K), "u1.000000000009.c.dbundle")
    feed(ra, symbols(1, header(9, env), env))  # complete; killed before its delivery
    assert len(ra.ready) == 1
    ra2 = reassembler(tmp_path, max_open_objects=1)
    assert ra2.recover(5000.0) == 2
    assert list(ra2.open) == [(1, 2)] and [d.header.object_id for d in ra2.ready] == [9]
    assert [g["object_id"] for g in read_gap_records(tmp_path)] == [0, 1]


# -- 2. gap records the disk refuses take bounded memory ------------------------------------


def test_gap_records_the_disk_refuses_for_long_take_bounded_memory_and_each_loss_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every record the disk refused stayed in memory, one a failed object (~1 KB each: a
    day's refusal at a few objects a second is GBs). Beyond ``_GAPS_HELD`` whole records they
    are counted in one summary record per reason, channel and epoch; once the disk takes them,
    the journal counts every object given up."""
    caplog.set_level(logging.ERROR, "bridge.diode.udp_spool")  # pytest keeps what it logs
    ra = reassembler(tmp_path)
    refused = _refusing(ra, errno.EIO)
    env = envelope(b"x" * 100)

    def give_up(oid: int) -> None:
        ra.gap(udp_spool._header_record(3, header(oid, env)), "too_large")

    for oid in range(200):  # warm up: whatever is allocated once
        give_up(oid)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for oid in range(200, 20_000):
            give_up(oid)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert refused and read_gap_records(tmp_path) == []
    assert grown < 1 << 20, f"{grown} bytes held for the records refused"
    assert ra.pending_gaps() <= udp_spool._GAPS_HELD + 1
    del ra._append_gaps  # the disk is back
    assert ra.write_gaps() == 0 and ra.pending_gaps() == 0
    gaps = read_gap_records(tmp_path)
    assert gap_objects(gaps) == 20_000  # not one loss missing from the journal
    assert len(gaps) == udp_spool._GAPS_HELD + 1
    assert [g["object_id"] for g in gaps[:-1]] == list(range(udp_spool._GAPS_HELD))
    last = gaps[-1]
    assert (last["reason"], last["channel"], last["epoch"], last["summary"]) == (
        "too_large", "u1", 3, True,
    )  # fmt: skip
    assert (last["object_id"], last["object_id_last"]) == (udp_spool._GAPS_HELD, 19_999)
    assert last["objects"] == 20_000 - udp_spool._GAPS_HELD


@pytest.mark.parametrize("then", ["disk_back", "restart"])
def test_folders_of_objects_counted_in_a_summary_are_kept_until_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """An object whose record is only counted keeps its folder (emptied) as one held whole:
    killed before the disk takes the records, the restart records each object again; once
    they are written, its folder goes. An object still open and one rebuilt, waiting for its
    delivery, keep theirs."""
    monkeypatch.setattr(udp_spool, "_GAPS_HELD", 3, raising=False)
    ra = reassembler(tmp_path)
    for i in range(8):
        env = envelope(os.urandom(T * K * 2), f"u1.{i:012d}.f.dbundle")
        feed(ra, symbols(1, header(i, env), env)[:3], now=1.0)
    live_env = envelope(os.urandom(T * K * 2), "u1.000000000020.l.dbundle")
    feed(ra, symbols(1, header(20, live_env), live_env)[:3], now=150.0)
    ready_env = envelope(os.urandom(T * K), "u1.000000000021.d.dbundle")
    feed(ra, symbols(1, header(21, ready_env), ready_env), now=150.0)
    ra.flush_all()
    refused = _refusing(ra, errno.EIO)
    assert ra.expire_idle(200.0, 120.0) == 8
    assert refused and read_gap_records(tmp_path) == []
    assert ra.pending_gaps() == 3 + 1  # 3 whole, the other 5 counted in one
    folders = {p.name: p for p in (tmp_path / "objects").iterdir()}
    assert len(folders) == 10  # 8 kept, emptied, for the restart; the live one; the rebuilt one
    for i in range(8):
        f = folders[f"{1:020d}-{i:020d}"]
        assert (f / "meta.json").exists() and (f / "data").stat().st_size == 0
    if then == "restart":
        _close_files(ra)
        ra2 = reassembler(tmp_path)
        assert ra2.recover(300.0) == 10 and len(ra2.ready) == 1  # the rebuilt one: delivered
        assert ra2.expire_idle(300.0 + 120.0, 120.0) == 9
        gaps = read_gap_records(tmp_path)
        assert sorted(g["object_id"] for g in gaps) == [*range(8), 20]  # each one, by name
        assert {g["reason"] for g in gaps} == {"timeout"}
        return
    del ra._append_gaps  # the disk is back
    assert ra.write_gaps() == 0
    gaps = read_gap_records(tmp_path)
    assert [g["object_id"] for g in gaps[:3]] == [0, 1, 2]
    assert (gaps[3]["object_id"], gaps[3]["object_id_last"], gaps[3]["objects"]) == (3, 7, 5)
    assert gap_objects(gaps) == 8
    assert ra.wait_trash(10)
    left = sorted(p.name for p in (tmp_path / "objects").iterdir())
    assert left == [f"{1:020d}-{20:020d}", f"{1:020d}-{21:020d}"]
    (d,) = ra.ready
    assert (d.path / "data").read_bytes() == ready_env
    feed(ra, symbols(1, header(20, live_env), live_env)[3:], now=201.0)
    assert [d.header.object_id for d in ra.ready] == [21, 20]


# -- 3. a stalled copy of an object delivered long ago is no gap -----------------------------


def _delivered_then_forgotten(ra: udp_spool.Reassembler, env: bytes, others: int) -> None:
    """Deliver object (4, 1) with the bytes ``env``, then ``others`` objects after it."""
    feed(ra, symbols(4, header(1, env), env))
    ra.mark_delivered(ra.ready.popleft(), NAME)
    for oid in range(2, 2 + others):
        other = envelope(os.urandom(T * K), f"u1.{oid:012d}.o.dbundle")
        feed(ra, symbols(4, header(oid, other), other))
        ra.mark_delivered(ra.ready.popleft(), f"u1.{oid:012d}.o.dbundle")


def _digest(env: bytes) -> bytes:
    return hashlib.sha256(env).digest()


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
@pytest.mark.parametrize("copy", ["replay", "resend"])
def test_a_stalled_copy_of_an_object_delivered_long_ago_is_not_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy: str, restart: bool
) -> None:
    """Once an object delivered has left the bounded memory of delivered object ids, part of
    it arriving again (datagrams replayed; a resend under a new object id that stalls) opened
    it anew, and it expired as a ``timeout`` gap: a loss report for bytes red has. Its digest
    is still remembered (as far as ``done.jsonl`` reaches): the copy is superseded, no gap."""
    monkeypatch.setattr(udp_spool, "_DONE_REMEMBERED", 3)
    monkeypatch.setattr(udp_spool, "_DONE_JOURNALED", 10)
    ra = reassembler(tmp_path)
    env = envelope(os.urandom(T * K * 2))
    _delivered_then_forgotten(ra, env, 5)
    assert (4, 1) not in ra.done and _digest(env) in ra.done_digests  # the case
    if restart:
        ra = reassembler(tmp_path)
        assert ra.recover(1.0) == 0 and (4, 1) not in ra.done
    oid = 1 if copy == "replay" else 50
    copy_syms = symbols(4, header(oid, env), env)
    feed(ra, copy_syms[:3], now=10.0)
    assert (4, oid) in ra.open  # opened again: nothing in memory says otherwise
    assert ra.expire_idle(200.0, 120.0) == 0
    assert read_gap_records(tmp_path) == []
    assert ra.wait_trash(10) and not list((tmp_path / "objects").iterdir())
    feed(ra, copy_syms[3:], now=201.0)  # the rest of the copy: dropped, not opened again
    assert not ra.open and not ra.ready


def test_an_object_never_delivered_still_expires_as_a_gap_once_memory_forgot_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(udp_spool, "_DONE_REMEMBERED", 3)
    monkeypatch.setattr(udp_spool, "_DONE_JOURNALED", 4)
    ra = reassembler(tmp_path)
    _delivered_then_forgotten(ra, envelope(os.urandom(T * K)), 5)
    lost = envelope(os.urandom(T * K * 2), "u1.000000000030.x.dbundle")
    feed(ra, symbols(4, header(30, lost), lost)[:3], now=10.0)
    assert ra.expire_idle(200.0, 120.0) == 1
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == [(30, "timeout")]


def _deliver(ra: udp_spool.Reassembler, oid: int, env: bytes | None = None) -> bytes:
    """Deliver object (4, ``oid``) (random bytes unless ``env``); returns its envelope."""
    env = env or envelope(os.urandom(T * K), f"u1.{oid:012d}.o.dbundle")
    feed(ra, symbols(4, header(oid, env), env))
    ra.mark_delivered(ra.ready.popleft(), f"u1.{oid:012d}.o.dbundle")
    return env


def _journal_digests(path: Path) -> set[bytes]:
    return {bytes.fromhex(json.loads(line)["digest"]) for line in path.read_text().splitlines()}


@pytest.mark.parametrize("cut_by", ["records", "bytes"])
def test_memory_holds_every_digest_the_delivery_journal_names_and_reads_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_by: str
) -> None:
    """Whether a stalled object's bytes were delivered before was looked up in ``done.jsonl``
    once memory had forgotten some deliveries: a scan of up to 16 MiB (~10 ms) for every
    eviction, and the receive loop evicts per datagram under memory pressure. Memory holds the
    digest of every delivery the journal names, through its compactions (by record count or
    size) and a restart; a stalled copy is recognised with no file read (the journal gone
    here)."""
    monkeypatch.setattr(udp_spool, "_DONE_REMEMBERED", 3)
    if cut_by == "records":
        monkeypatch.setattr(udp_spool, "_DONE_JOURNALED", 8)
    else:
        monkeypatch.setattr(udp_spool, "_DONE_COMPACT_BYTES", 2000)  # ~11 records
    ra = reassembler(tmp_path)
    done = tmp_path / udp_spool.DONE
    sizes = []
    for oid in range(100, 140):
        _deliver(ra, oid)
        assert _journal_digests(done) <= ra.done_digests.keys()
        sizes.append(len(done.read_text().splitlines()))
    assert max(sizes) > min(sizes[5:]) >= 3  # the case: cut back, and more than once
    assert sizes.count(max(sizes)) > 1
    env = _deliver(ra, 1, envelope(os.urandom(T * K * 2)))
    _deliver(ra, 141)
    _deliver(ra, 142)
    ra = reassembler(tmp_path)  # a restart: memory as far as the journal reaches
    assert _journal_digests(done) <= ra.done_digests.keys() and (4, 1) in ra.done
    _deliver(ra, 143)
    assert (4, 1) not in ra.done  # the object id forgotten: its copy opens again
    done.unlink()  # no file to read: memory alone tells
    feed(ra, symbols(4, header(1, env), env)[:3], now=10.0)
    assert (4, 1) in ra.open
    assert ra.expire_idle(200.0, 120.0) == 0 and read_gap_records(tmp_path) == []


def test_an_object_a_restart_evicts_whose_bytes_were_delivered_is_superseded_not_a_gap(
    tmp_path: Path,
) -> None:
    """A copy (a resend) spooled when the original was delivered, evicted for the caps at the
    restart: superseded, as at run time; its folder goes once the unseen-object state, the
    only record that its id was seen, is saved."""
    env = envelope(os.urandom(T * K * 2))
    ra = reassembler(tmp_path)
    feed(ra, symbols(4, header(1, env), env))
    ra.mark_delivered(ra.ready.popleft(), NAME)
    feed(ra, symbols(4, header(7, env), env)[:3], now=1.0)  # the resend, stalled
    other = envelope(os.urandom(T * K * 2), "u1.000000000008.o.dbundle")
    feed(ra, symbols(4, header(8, other), other)[:3], now=1.0)
    ra.flush_all()
    _close_files(ra)
    old = time.time() - 500
    for f in (tmp_path / "objects" / f"{4:020d}-{7:020d}").iterdir():
        os.utime(f, (old, old))
    ra2 = reassembler(tmp_path, max_open_objects=1)
    order: list[str] = []
    for name in ("save", "recovered"):  # spied on, not replaced
        real = getattr(ra2.unseen, name)
        setattr(ra2.unseen, name, lambda *a, _r=real, _n=name, **k: order.append(_n) or _r(*a, **k))
    assert ra2.recover(1000.0) == 1 and list(ra2.open) == [(4, 8)]
    assert read_gap_records(tmp_path) == []
    # saved before the journals since the last save were merged, the state would skip them
    assert order == ["recovered", "save"]
    assert ra2.wait_trash(10) and [p.name for p in (tmp_path / "objects").iterdir()] == [
        f"{4:020d}-{8:020d}"
    ]
    assert (tmp_path / "unseen.json").exists()


def test_folders_not_reopened_yet_are_never_swept_with_those_counted_at_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folders a killed run kept for records the disk refused are emptied like those of the
    objects a summary counts: swept while the restart had not reopened them yet, they went
    as unreadable (``spool_error``, meta.json gone). The sweep waits for the end of the
    restart; each object is reopened and recorded for what happened to it."""
    ra = reassembler(tmp_path)
    for i in (10, 11):  # given up, their records refused, then a kill
        env = envelope(os.urandom(T * K * 2), f"u1.{i:012d}.k.dbundle")
        feed(ra, symbols(1, header(i, env), env)[:3], now=1.0)
    for i in range(4):  # open
        env = envelope(os.urandom(T * K * 2), f"u1.{i:012d}.o.dbundle")
        feed(ra, symbols(1, header(i, env), env)[:3], now=150.0)
    ra.flush_all()
    _refusing(ra, errno.EIO)
    assert ra.expire_idle(200.0, 120.0) == 2 and ra.pending_gaps() == 2
    _close_files(ra)
    objects = tmp_path / "objects"
    for i, age in ((0, 400), (1, 300), (2, 200), (3, 100), (10, 1000), (11, 1000)):
        for f in (objects / f"{1:020d}-{i:020d}").iterdir():
            os.utime(f, (time.time() - age,) * 2)

    monkeypatch.setattr(udp_spool, "_GAPS_HELD", 1, raising=False)
    ra2 = reassembler(tmp_path, max_open_objects=1)
    calls: list[int] = []
    real = ra2._append_gaps

    def full_four_times() -> None:
        calls.append(1)
        if len(calls) <= 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real()

    ra2._append_gaps = full_four_times  # type: ignore[method-assign]
    ra2.recover(1000.0)
    assert len(calls) > 4  # refused, then taken in the middle of the restart
    assert list(ra2.open) == [(1, 3)]
    gaps = read_gap_records(tmp_path)
    assert any(g.get("summary") for g in gaps)  # the case: a summary written meanwhile
    assert gap_objects(gaps) == 5  # 0, 1, 2 evicted; 10 and 11 recorded again
    assert {g["object_id"]: g["reason"] for g in gaps if g["object_id"] in (10, 11)} == {
        10: "evicted", 11: "evicted",
    }  # fmt: skip
    assert ra2.wait_trash(10) and [p.name for p in objects.iterdir()] == [f"{1:020d}-{3:020d}"]
