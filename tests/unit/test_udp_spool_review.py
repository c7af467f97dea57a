"""UDP receiver's reassembly spool (``udp_spool``), review findings: replayed datagrams do not
keep an object from expiring, memory held stays near its cap whatever the symbol size, links
put in the spool by hand are never followed, a folder a kill cut short at its creation is not
a gap, a dangling link in the inbox is not a loop, the journals' names are made durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.diode import udp_spool
from bridge.diode.link_status import read_gap_records
from bridge.protocol.datagram import ObjectHeader, ObjectKind, Symbol
from tests.support import small_tmpfs
from tests.unit.test_udp_reassembly import (
    NAME,
    K,
    T,
    checked,
    envelope,
    header,
    reassembler,
    symbols,
)

# -- the clock of an object runs on news, not on copies --------------------------------------


@pytest.mark.parametrize("copy", ["duplicate", "surplus"])
def test_replayed_datagrams_of_a_stalled_object_do_not_keep_it_from_expiring(
    tmp_path: Path, copy: str
) -> None:
    """A datagram replayed on the wire still authenticates: if copies counted as news, an
    object that can never complete would never expire, never be a gap."""
    env = envelope(os.urandom(2 * T * K))
    syms = symbols(7, header(1, env), env, repair=2)
    first_block, second_block = syms[: K + 2], syms[K + 2 :]
    ra = reassembler(tmp_path)
    for s in first_block[:K] + second_block[:3]:  # block 0 rebuilt, block 1 stalled
        ra.add(s, 0.0)
    again = second_block[0] if copy == "duplicate" else first_block[K]  # old news either way
    for t in range(10, 500, 10):
        ra.add(again, float(t))
    assert ra.dropped == {copy: 49}  # the copies arrived, and were counted
    assert ra.expire_idle(500.0, 120.0) == 1
    (gap,) = read_gap_records(tmp_path)
    assert (gap["object_id"], gap["reason"], gap["blocks_done"]) == (1, "timeout", 1)


def test_a_new_symbol_still_keeps_its_object_open(tmp_path: Path) -> None:
    env = envelope(os.urandom(2 * T * K))
    syms = symbols(7, header(2, env), env, repair=2)
    ra = reassembler(tmp_path)
    ra.add(syms[0], 0.0)
    ra.add(syms[1], 450.0)
    assert ra.expire_idle(500.0, 120.0) == 0 and (7, 2) in ra.open


# -- memory: what is held is counted whatever the symbol size -------------------------------


def _hostile(k: int, blocks: int) -> Iterator[Symbol]:
    """An authenticated sender that lies: an object of 1 GiB in blocks of ``k`` symbols of the
    smallest size (16 bytes), one symbol of each block."""
    h = ObjectHeader(1, ObjectKind.BUNDLE, "u1", 1, 1 << 30, bytes(32), 16, k)
    for b in range(blocks):
        yield Symbol(5, b, h, b, 0, os.urandom(16))


@pytest.mark.parametrize("k", [1, 2], ids=["rebuilt-blocks", "open-blocks"])
def test_tiny_symbols_cannot_hold_memory_far_beyond_the_cap(tmp_path: Path, k: int) -> None:
    """``held`` counted 16 bytes for a 16-byte symbol that takes ~150 in memory, and nothing
    for a block's decoder (~500) or a rebuilt block's index (~70): 30 times the cap was held
    before anything was evicted (512 MiB configured: ~16 GB)."""
    cap = 1 << 20
    ra = reassembler(tmp_path, max_held_bytes=cap)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for s in _hostile(k, 100_000):
            ra.add(s, 1.0)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert [g["reason"] for g in read_gap_records(tmp_path)] == ["evicted"]  # the cap fired
    assert ra.dropped.get("expired", 0) > 0  # its later symbols dropped, not opened again
    assert not ra.open and ra.held == 0
    # within twice the cap at the worst moment (a set's table is copied as it grows); the old
    # count let 100k blocks take ~7 MB (K = 1) and ~50 MB (K = 2) with nothing evicted
    assert peak < 2 * cap, f"peak {peak} bytes for a cap of {cap}"


# -- links put in the spool by hand ----------------------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside the spool, with a file and a folder, that a link points to."""
    d = tmp_path / "elsewhere"
    (d / "sub").mkdir(parents=True)
    (d / "precious").write_text("keep me")
    (d / "data").write_bytes(b"x" * 100)
    (d / "sub" / "more").write_text("keep me too")
    return d


def _intact(victim: Path) -> bool:
    return (
        (victim / "precious").read_text() == "keep me"
        and (victim / "data").read_bytes() == b"x" * 100
        and (victim / "sub" / "more").read_text() == "keep me too"
    )


@pytest.mark.parametrize("where", ["trash", "objects"])
def test_a_link_in_the_spool_is_removed_never_what_it_points_to(
    tmp_path: Path, victim: Path, where: str
) -> None:
    spool = tmp_path / "spool"
    reassembler(spool)  # creates objects/ and trash/
    link = spool / where / f"{9:020d}-{4:020d}"
    link.symlink_to(victim)
    ra = reassembler(spool)
    assert ra.recover(1.0) == 0
    assert ra.wait_trash(10)
    assert _intact(victim)  # the old removal listed the link's target and emptied it
    assert not os.path.lexists(link) and not list((spool / "trash").iterdir())  # it was handled
    gaps = read_gap_records(spool)
    if where == "objects":  # named like an object, which cannot be read: a gap, once
        assert [(g["epoch"], g["object_id"], g["reason"]) for g in gaps] == [(9, 4, "spool_error")]
    else:
        assert gaps == []


# -- a kill while an object's folder is being created ----------------------------------------

_KILL_AT_META = """
import os, signal, sys
from pathlib import Path
from bridge.diode import udp_spool
from tests.unit.test_udp_reassembly import envelope, header, reassembler, symbols
env = bytes.fromhex(sys.argv[2])
ra = reassembler(Path(sys.argv[1]))
real = os.replace
def kill(src, dst):
    if str(dst).endswith("meta.json"):
        os.kill(os.getpid(), signal.SIGKILL)  # between the folder and its meta.json
    real(src, dst)
udp_spool.os.replace = kill
ra.add(symbols(7, header(3, env), env, repair=3)[0], 1.0)
"""


def test_an_object_a_kill_cut_short_at_its_creation_still_completes(tmp_path: Path) -> None:
    """A kill -9 between the folder's mkdir and its ``meta.json`` left a folder the restart
    took for a damaged object: a ``spool_error`` gap, and every later symbol of an object
    that could complete was dropped."""
    env = envelope(os.urandom(2 * T * K))
    syms = symbols(7, header(3, env), env, repair=3)
    run = subprocess.run(
        [sys.executable, "-c", _KILL_AT_META, str(tmp_path), env.hex()],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        check=False,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    (folder,) = (tmp_path / "objects").iterdir()
    assert [p.name for p in folder.iterdir()] == ["meta.json.tmp"]  # killed where meant

    ra = reassembler(tmp_path)
    assert ra.recover(1.0) == 0
    for s in syms[1:]:  # the first symbol died with the process: repair covers it
        ra.add(s, 2.0)
    assert [(d.path / "data").read_bytes() for d in ra.ready] == [env]
    assert read_gap_records(tmp_path) == [] and "spool_error" not in ra.dropped


def test_a_folder_whose_meta_was_lost_but_holds_symbols_is_still_a_gap(tmp_path: Path) -> None:
    env = envelope(os.urandom(2 * T * K))
    ra = reassembler(tmp_path)
    for s in symbols(7, header(5, env), env)[:3]:
        ra.add(s, 1.0)
    ra.flush_all()
    (folder,) = (tmp_path / "objects").iterdir()
    for fd in (ra.open[(7, 5)].data_fd, ra.open[(7, 5)].done_fd, ra.open[(7, 5)].log_fd):
        os.close(fd)
    (folder / "meta.json").unlink()  # a power loss before its write reached the disk
    ra2 = reassembler(tmp_path)
    ra2.recover(1.0)
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == [
        (5, "spool_error")
    ]


# -- the inbox ---------------------------------------------------------------------------------


def _ready(root: Path) -> udp_spool.Delivery:
    env = envelope(os.urandom(T * K))
    ra = reassembler(root)
    for s in symbols(6, header(8, env), env):
        ra.add(s, 1.0)
    return ra.ready[0]


def test_a_dangling_link_under_the_name_in_the_inbox_is_never_replaced_nor_a_loop(
    tmp_path: Path,
) -> None:
    """``exists()`` follows the link (False) while ``link()`` refuses the name: the delivery
    called itself until Python's recursion limit, and the delivery thread died."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    d = _ready(tmp_path / "spool")
    name, offset = checked(d)
    (inbox / name).symlink_to(tmp_path / "nowhere")
    final, outcome = udp_spool.deliver(d, name, offset, tmp_path / "spool" / "tmp", inbox)
    assert (final, outcome) == (f"{NAME}~6.8", "renamed")
    assert os.readlink(inbox / name) == str(tmp_path / "nowhere")  # left as it was
    assert (inbox / final).read_bytes() == (d.path / "data").read_bytes()[offset:]


# -- the journals' names are durable ------------------------------------------------------------


@pytest.fixture
def dir_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders ``udp_spool`` fsyncs (each fsync really done)."""
    done: list[Path] = []
    real = udp_spool.fsync_dir

    def spy(path: Path) -> None:
        real(path)
        done.append(Path(path))

    monkeypatch.setattr(udp_spool, "fsync_dir", spy)
    return done


def test_the_journals_are_created_durably_in_their_folder(
    tmp_path: Path, dir_fsyncs: list[Path]
) -> None:
    """``gaps.jsonl`` and ``done.jsonl`` were fsynced, not their folder: a power loss after the
    first record could lose the file's name, and every record with it."""
    ra = reassembler(tmp_path)
    ra.gap({"epoch": 1, "object_id": 1}, "timeout")
    assert (tmp_path / "gaps.jsonl").exists() and dir_fsyncs == [tmp_path]
    ra.gap({"epoch": 1, "object_id": 2}, "timeout")
    assert dir_fsyncs == [tmp_path]  # once, when created
    d = _ready(tmp_path)
    ra.journal_delivered(d, NAME)
    ra.journal_delivered(d, NAME)
    assert (tmp_path / udp_spool.DONE).exists() and dir_fsyncs == [tmp_path, tmp_path]


def test_a_copy_found_in_the_inbox_is_made_durable_before_it_counts_as_delivered(
    tmp_path: Path, dir_fsyncs: list[Path]
) -> None:
    """A run killed after the link, before the inbox's fsync: the restart finds the file and
    journals it as delivered; its name must be made durable first."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    d = _ready(tmp_path / "spool")
    name, offset = checked(d)
    (inbox / name).write_bytes((d.path / "data").read_bytes()[offset:])
    assert udp_spool.deliver(d, name, offset, tmp_path / "spool" / "tmp", inbox) == (
        name,
        "duplicate",
    )
    assert dir_fsyncs == [inbox]


# -- a full disk: the records waiting are not all tried again for each new one --------------


def test_new_objects_on_a_full_disk_do_not_retry_every_waiting_record_each() -> None:
    """Each object refused on a full disk was a gap record that tried to write every record
    waiting in memory, 2 to 4 times: the receive loop's time per new object grew with them
    (measured: 118 ms at 6000). Now a new record waits for the loop's next try (once a
    second); each record is still written once, whole, when there is room."""
    with small_tmpfs("1m", "udpflood") as disk:
        root = disk / "spool"
        ra = reassembler(root)
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space"):
            while True:
                os.write(fd, bytes(4096))
        os.close(fd)
        tries: list[int] = []
        real = ra._append_gaps

        def append() -> None:
            tries.append(len(ra._unwritten_gaps))
            real()

        ra._append_gaps = append  # type: ignore[method-assign]
        n = 300
        for i in range(n):  # an object a datagram, each refused by the full disk
            h = ObjectHeader(i, ObjectKind.BUNDLE, "u1", i, 5000, os.urandom(32), 1360, 64)
            try:
                ra.add(Symbol(5, i, h, 0, 0, bytes(1360)), 1.0)
            except OSError as e:
                assert e.errno == 28  # the disk really is full
                ra.give_up(5, h, e)
        assert ra.pending_gaps() == n and ra.dropped == {"spool_error": n}
        assert 1 <= len(tries) <= 10, f"{len(tries)} tries for {n} new objects"
        (disk / "filler").unlink()  # room again: the loop's next try writes them all
        assert ra.write_gaps() == 0
        gaps = read_gap_records(root)
        assert sorted(g["object_id"] for g in gaps) == list(range(n))
        assert {g["reason"] for g in gaps} == {"spool_error"}


def test_a_delivery_journal_append_cut_short_by_a_full_disk_spoils_no_later_record() -> None:
    """``done.jsonl`` was appended through a buffered file: a full disk that took part of a
    record left it torn, and the next record, glued to it, could not be read at a restart
    (its object's later symbols opened it again, to be delivered twice)."""
    with small_tmpfs("1m", "udpdone") as disk:
        root = disk / "spool"
        ra = reassembler(root)
        first, second = _ready(root / "a"), _ready(root / "b")
        second = udp_spool.Delivery(6, header(9, b"x" * 10), second.path, 0)
        path = root / udp_spool.DONE
        path.write_bytes(b"x" * 4000 + b"\n")  # its page nearly full: a record will not fit
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space"):
            while True:
                os.write(fd, bytes(4096))
        os.close(fd)
        with pytest.raises(OSError, match="No space"):
            ra.journal_delivered(first, NAME)  # the delivery thread retries it later
        (disk / "filler").unlink()
        ra.journal_delivered(second, NAME)
        ra2 = reassembler(root)
        assert (6, 9) in ra2.done  # the record after the failed append is read back
        assert (6, 8) not in ra2.done  # the failed one left nothing
