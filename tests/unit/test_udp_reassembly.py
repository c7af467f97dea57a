"""UDP receiver's reassembly (``udp_spool``) without sockets: crafted symbols in, spool files,
gap records and inbox files out — order, duplicates, loss within and beyond the repair budget,
supersede, bad names, digest mismatch, name clashes, rebuild after kill -9, memory caps, the
folders of objects that ended removed off the receive loop."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.diode import udp_spool
from bridge.diode.link_status import read_gap_records, read_new_gap_records
from bridge.diode.udp_fec import block_count, block_plan, encode_block
from bridge.diode.udp_sender import envelope_prefix
from bridge.diode.udp_spool import (
    DONE,
    Delivery,
    Reassembler,
    deliver,
    delivery_tmp_dir,
    discard_spooled,
    verify_and_read_name,
)
from bridge.errors import ConfigError
from bridge.protocol.datagram import ObjectHeader, ObjectKind, Symbol
from tests.support import small_tmpfs

T = 64
K = 8
NAME = "u1.000000000001.0123456789abcdef0123456789abcdef.dbundle"


def header(oid: int, env: bytes, *, digest: bytes | None = None, t: int = T) -> ObjectHeader:
    return ObjectHeader(
        oid, ObjectKind.BUNDLE, "u1", oid + 1, len(env), digest or hashlib.sha256(env).digest(),
        t, K,
    )  # fmt: skip


def symbols(
    epoch: int, h: ObjectHeader, env: bytes, *, repair: int = 2, first_repair: int = 0
) -> list[Symbol]:
    """Every symbol of every block of ``env``, block after block (source, then repair)."""
    out: list[Symbol] = []
    for b in range(block_count(h.length, h.symbol_size, h.block_symbols)):
        p = block_plan(h.length, h.symbol_size, h.block_symbols, b)
        for esi, payload in encode_block(
            env[p.offset : p.offset + p.length], h.symbol_size, repair, first_repair
        ):
            out.append(Symbol(epoch, len(out), h, b, esi, payload))
    return out


def envelope(body: bytes, name: str = NAME) -> bytes:
    return envelope_prefix(name) + body


def reassembler(root: Path, **kw: int) -> Reassembler:
    args = {"max_object_bytes": 1 << 30, "max_open_objects": 16, **kw}
    return Reassembler(root, **args)


def feed(ra: Reassembler, syms: list[Symbol], now: float = 1.0) -> None:
    for s in syms:
        ra.add(s, now)


def feed_settled(ra: Reassembler, syms: list[Symbol], now: float = 1.0) -> None:
    """As ``feed``, each compaction taken in before the next symbol (a disk fast next to the
    link: no record appended while one is in flight)."""
    for s in syms:
        ra.add(s, now)
        ra.wait_compactions()


def held_by(ra: Reassembler) -> int:
    """The memory ``held`` is to count: each open object's decoders with their symbols (each
    with its overhead beyond its T bytes), and its rebuilt blocks' indices."""
    return sum(
        d.received * (o.h.symbol_size + udp_spool._SYMBOL_OVERHEAD) + udp_spool._DECODER_OVERHEAD
        for o in ra.open.values()
        for d in o.decoders.values()
    ) + sum(len(o.done) * udp_spool._BLOCK_OVERHEAD for o in ra.open.values())


def delivered(ra: Reassembler) -> list[bytes]:
    return [(d.path / "data").read_bytes() for d in ra.ready]


# -- order, duplicates, loss ---------------------------------------------------------------


def test_in_order_symbols_rebuild_the_envelope_and_surplus_repairs_are_counted(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(3 * T * K + 100))  # 4 blocks, the last one short
    h = header(1, env)
    syms = symbols(5, h, env, repair=3)
    ra = reassembler(tmp_path)
    feed(ra, syms)
    assert delivered(ra) == [env]
    (d,) = ra.ready
    assert (d.epoch, d.header, d.repairs_used) == (5, h, 0)
    # each block's 3 repair symbols arrive after its sources rebuilt it: surplus, never used;
    # the last block's come after the whole object was rebuilt: late
    assert ra.dropped == {"surplus": 3 * 3, "late": 3}
    assert not ra.open and ra.held == 0


def scrambled(seed: int, size: int, dup_fraction: float, lost_per_block: int) -> list[Symbol]:
    """An object's symbols shuffled, some lost (never beyond k + 2 per block), some doubled."""
    rnd = random.Random(seed)
    env = envelope(rnd.randbytes(size))
    h = header(2, env)
    syms = symbols(9, h, env, repair=6)  # RaptorQ: k + 2 symbols decode with p > 1 - 1e-6
    kept = []
    for b in range(h.block_count):
        block = [s for s in syms if s.block == b]
        n_lost = min(lost_per_block, len(block) - block_plan(h.length, T, K, b).k - 2)
        lost = rnd.sample(block, n_lost)
        kept += [s for s in block if s not in lost]
    kept += [s for s in kept if rnd.random() < dup_fraction]  # duplicates, anywhere
    rnd.shuffle(kept)
    return kept


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    size=st.integers(1, 5 * T * K),
    seed=st.integers(0, 2**32 - 1),
    dup_fraction=st.floats(0, 1),
    lost_per_block=st.integers(0, 3),
)
def test_any_order_with_duplicates_and_loss_within_budget_rebuilds_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    size: int,
    seed: int,
    dup_fraction: float,
    lost_per_block: int,
) -> None:
    kept = scrambled(seed, size, dup_fraction, lost_per_block)
    env = envelope(random.Random(seed).randbytes(size))
    ra = reassembler(tmp_path_factory.mktemp("spool"))
    feed(ra, kept)
    assert delivered(ra) == [env]
    assert not ra.open
    assert ra.symbols_total + sum(ra.dropped.values()) == len(kept)
    assert set(ra.dropped) <= {"duplicate", "surplus", "late"}


def test_bytes_held_return_to_zero_when_raptorq_needs_more_than_k_symbols(
    tmp_path: Path,
) -> None:
    kept = scrambled(2799, 2557, 0.5625, 0)  # found by hypothesis: one block needs k + 1
    ra = reassembler(tmp_path)
    feed(ra, kept)
    assert len(ra.ready) == 1 and not ra.open
    assert ra.held == 0


def test_duplicates_are_counted_and_change_nothing(tmp_path: Path) -> None:
    env = envelope(os.urandom(2 * T * K))
    h = header(3, env)
    syms = symbols(1, h, env, repair=0)
    ra = reassembler(tmp_path)
    feed(ra, syms[:3] * 4)
    assert ra.dropped == {"duplicate": 9} and ra.symbols_total == 3
    assert (
        ra.held
        == held_by(ra)
        == 3 * (T + udp_spool._SYMBOL_OVERHEAD) + (udp_spool._DECODER_OVERHEAD)
    )
    feed(ra, syms[3:])
    assert delivered(ra) == [env]
    feed(ra, syms[:2])  # after completion: late, not duplicate
    assert ra.dropped == {"duplicate": 9, "late": 2}


def test_lost_source_symbols_are_repaired_and_the_repairs_used_counted(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K * 2))
    h = header(4, env)
    syms = symbols(1, h, env, repair=5)
    lost = {(0, 1), (0, 6), (1, 0)}  # (block, esi): three source symbols
    ra = reassembler(tmp_path)
    feed(ra, [s for s in syms if (s.block, s.esi) not in lost])
    assert delivered(ra) == [env]
    assert ra.ready[0].repairs_used == 3


def test_loss_beyond_budget_expires_with_a_gap_record_and_no_spool_left(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K * 3))
    h = header(5, env)
    syms = symbols(7, h, env, repair=1)
    block1 = [s for s in syms if s.block == 1]
    gone = set(map(id, block1[:3]))  # 3 lost, 1 repair: block 1 cannot be rebuilt
    ra = reassembler(tmp_path)
    feed(ra, [s for s in syms if id(s) not in gone], now=10.0)
    assert not ra.ready and list(ra.open) == [(7, 5)]
    assert ra.expire_idle(10.0 + 29.0, 30.0) == 0  # not idle long enough yet
    assert ra.expire_idle(10.0 + 30.0, 30.0) == 1
    (gap,) = read_gap_records(tmp_path)
    assert gap["reason"] == "timeout"
    assert (gap["epoch"], gap["object_id"], gap["channel"], gap["seq"]) == (7, 5, "u1", 6)
    assert (gap["blocks_total"], gap["blocks_done"]) == (4, 3)  # 3 full blocks + the name's
    assert gap["symbols_received"] == len(syms) - 3 - 3  # 3 lost, 3 surplus repairs
    assert gap["kind"] == "bundle" and gap["length"] == len(env) and "time" in gap
    assert not ra.open and ra.held == 0 and ra.expired == 1
    assert list((tmp_path / "objects").iterdir()) == []


def test_an_object_announcing_too_many_bytes_is_refused_once_and_never_spooled(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(5000))
    syms = symbols(1, header(6, env), env)
    ra = reassembler(tmp_path, max_object_bytes=4096)
    feed(ra, syms)
    assert ra.dropped == {"too_large": len(syms)}
    assert [g["reason"] for g in read_gap_records(tmp_path)] == ["too_large"]
    assert list((tmp_path / "objects").iterdir()) == [] and not ra.open


def test_an_object_whose_blocks_this_receiver_cannot_decode_whole_is_refused(
    tmp_path: Path,
) -> None:
    """An authenticated header may announce K x T beyond what RaptorQ keeps as one block (a
    misconfigured sender): refused as too_large before anything is spooled, not left to the
    digest check; a large K on an object smaller than one block is fine."""
    t = 8192
    big = ObjectHeader(3, ObjectKind.BUNDLE, "u1", 4, 20 << 20, bytes(32), t, 2048)
    ra = reassembler(tmp_path)
    ra.add(Symbol(1, 0, big, 0, 0, bytes(t)), 1.0)
    assert ra.dropped == {"too_large": 1} and not ra.open
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == [(3, "too_large")]
    env = envelope(os.urandom(5000))
    small = ObjectHeader(
        7, ObjectKind.BUNDLE, "u1", 8, len(env), hashlib.sha256(env).digest(), T, 60000
    )
    feed(ra, symbols(1, small, env))
    assert len(ra.ready) == 1 and ra.dropped == {"too_large": 1, "late": 2}  # its 2 repairs


def test_a_gap_record_after_a_torn_one_starts_its_own_line(tmp_path: Path) -> None:
    """A receiver killed mid-write leaves a torn last line; the next record must not be glued
    to it (red reads gaps.jsonl line by line and skips what is not JSON)."""
    (tmp_path / "gaps.jsonl").write_text('{"epoch": 1, "object_id": 4, "chan')
    env = envelope(os.urandom(5000))
    ra = reassembler(tmp_path, max_object_bytes=4096)
    feed(ra, symbols(1, header(6, env), env))
    assert [g["object_id"] for g in read_gap_records(tmp_path)] == [6]
    records, offset, restarted = read_new_gap_records(tmp_path, 0)
    assert [g["object_id"] for g in records] == [6] and not restarted
    assert offset == (tmp_path / "gaps.jsonl").stat().st_size
    # a line longer than any record is skipped, not waited on; a line still being written is
    with open(tmp_path / "gaps.jsonl", "ab") as f:
        f.write(b"x" * 200_000 + b"\n" + b'{"object_id": 7}\n' + b'{"object_id": 8')
    more, offset2, _ = read_new_gap_records(tmp_path, offset)
    assert [g["object_id"] for g in more] == [7]
    assert offset2 == (tmp_path / "gaps.jsonl").stat().st_size - len(b'{"object_id": 8')


def test_a_replaced_gap_file_that_grew_past_the_offset_is_read_from_its_start(
    tmp_path: Path,
) -> None:
    """Red saved an offset into the old receiver spool's gaps.jsonl; a new spool's file that has
    already grown past it is no longer cut at a record there: it is read from the start, not
    from mid-line with its first records skipped. A long line still being written at the end
    of the file is not consumed, so it cannot look like a replaced file next time."""
    path = tmp_path / "gaps.jsonl"
    path.write_bytes(b'{"object_id": 1}\n{"object_id": 2}\n')
    _, offset, _ = read_new_gap_records(tmp_path, 0)
    path.write_bytes(b'{"object_id": 10, "reason": "timeout"}\n{"object_id": 11}\n')  # new
    records, offset2, restarted = read_new_gap_records(tmp_path, offset)
    assert restarted and [r["object_id"] for r in records] == [10, 11]
    assert offset2 == path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"y" * 150_000)  # an over-long line, no newline yet
    more, offset3, restarted = read_new_gap_records(tmp_path, offset2)
    assert (more, offset3, restarted) == ([], offset2, False)
    with open(path, "ab") as f:
        f.write(b'\n{"object_id": 12}\n')
    more, _, restarted = read_new_gap_records(tmp_path, offset3)
    assert [r["object_id"] for r in more] == [12] and not restarted


def test_a_symbol_whose_header_contradicts_its_open_object_is_malformed(tmp_path: Path) -> None:
    env = envelope(os.urandom(2 * T * K))
    h = header(7, env)
    syms = symbols(1, h, env)
    liar = header(7, envelope(os.urandom(2 * T * K)))  # same epoch and id, other digest
    ra = reassembler(tmp_path)
    feed(ra, syms[:2])
    feed(ra, [Symbol(1, 99, liar, 0, 5, syms[5].payload)])
    assert ra.dropped == {"malformed": 1}
    feed(ra, syms[2:])
    assert delivered(ra) == [env]


# -- epochs ---------------------------------------------------------------------------------


def test_a_resend_under_a_new_epoch_supersedes_the_partial_object_not_a_gap(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K * 2))
    ra = reassembler(tmp_path)
    feed(ra, symbols(1, header(40, env), env)[:5], now=1.0)
    feed(ra, symbols(2, header(0, env), env), now=2.0)  # the restarted sender: new ids
    assert not ra.open and [(d.epoch, d.header.object_id) for d in ra.ready] == [(2, 0)]
    assert read_gap_records(tmp_path) == []


def test_an_old_epoch_object_expiring_after_its_copy_was_delivered_is_superseded(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K * 2))
    other = envelope(os.urandom(T * K), "u1.000000000009.x.dbundle")
    ra = reassembler(tmp_path)
    feed(ra, symbols(3, header(1, env), env), now=1.0)  # delivered in epoch 3
    ra.mark_delivered(ra.ready.popleft(), NAME)
    late = ra.dropped["late"]
    feed(ra, symbols(3, header(1, env), env)[:2], now=2.0)  # stragglers: late
    assert ra.dropped["late"] == late + 2
    # an older epoch's partial copy of the same bytes, then something that never completes
    feed(ra, symbols(2, header(8, env), env)[:3], now=3.0)
    feed(ra, symbols(3, header(2, other), other)[:2], now=3.0)
    ra.expire_idle(100.0, 30.0)
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == [(2, "timeout")]
    assert ra.expired == 1  # only the other one is a gap
    assert not ra.open and list((tmp_path / "objects").iterdir()) == []


def test_expire_idle_counts_gaps_not_superseded_objects(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K))
    ra = reassembler(tmp_path)
    feed(ra, symbols(3, header(1, env), env))
    ra.mark_delivered(ra.ready.popleft(), NAME)
    feed(ra, symbols(2, header(8, env), env)[:3])  # an older copy of the delivered bytes
    assert ra.expire_idle(100.0, 30.0) == 0


def test_datagrams_of_an_older_epoch_still_complete_their_object(tmp_path: Path) -> None:
    old = envelope(os.urandom(T * K))
    new = envelope(os.urandom(T * K), "u1.000000000002.y.dbundle")
    old_syms, new_syms = symbols(4, header(1, old), old), symbols(5, header(1, new), new)
    ra = reassembler(tmp_path)
    mixed = [s for pair in zip(old_syms, new_syms, strict=False) for s in pair]
    feed(ra, mixed + old_syms[len(new_syms) :] + new_syms[len(old_syms) :])
    assert sorted(delivered(ra)) == sorted([old, new])


# -- delivery: digest, name, inbox ------------------------------------------------------------


def checked(d: Delivery) -> tuple[str, int]:
    got = verify_and_read_name(d)
    assert not isinstance(got, str), got
    return got


def _complete(
    tmp_path: Path, env: bytes, digest: bytes | None = None
) -> tuple[Reassembler, Delivery]:
    ra = reassembler(tmp_path / "spool")
    feed(ra, symbols(6, header(3, env, digest=digest), env))
    return ra, ra.ready.popleft()


def test_a_digest_that_does_not_match_is_refused_and_recorded_as_a_gap(tmp_path: Path) -> None:
    env = envelope(b"the real bytes")
    ra, d = _complete(tmp_path, env, digest=hashlib.sha256(b"other bytes").digest())
    assert verify_and_read_name(d) == "digest_mismatch"
    ra.fail(d, "digest_mismatch")
    (gap,) = read_gap_records(tmp_path / "spool")
    assert (gap["reason"], gap["object_id"], gap["epoch"]) == ("digest_mismatch", 3, 6)
    assert d.path.exists()  # removed by the delivery thread, outside the loop's lock
    discard_spooled(d)
    assert not d.path.exists()


@pytest.mark.parametrize(
    "name",
    ["", ".hidden", "..", "a/b", "../etc/passwd", "nul\0byte", "tab\tname", "new\nline",
     "sp ace", "é.dbundle", "x" * 161, "x" * 256],
)  # fmt: skip
def test_names_that_are_not_plain_file_names_are_refused(tmp_path: Path, name: str) -> None:
    raw = name.encode("utf-8")
    env = len(raw).to_bytes(2, "big") + raw + b"body"
    _, d = _complete(tmp_path, env)
    assert verify_and_read_name(d) == "bad_name"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=0, max_size=300))
def test_any_envelope_either_names_a_plain_file_or_is_bad_name(
    tmp_path_factory: pytest.TempPathFactory, env: bytes
) -> None:
    env = env or b"\x00"
    _, d = _complete(tmp_path_factory.mktemp("n"), env)
    got = verify_and_read_name(d)
    if isinstance(got, str):
        assert got == "bad_name"
        return
    name, offset = got
    assert offset == 2 + len(name) and env[2:offset] == name.encode("ascii")
    assert name.isascii() and name.isprintable() and "/" not in name
    assert not name.startswith(".") and 0 < len(name) <= 160


def test_the_longest_name_of_the_protocol_takes_its_clash_suffix_within_255(
    tmp_path: Path,
) -> None:
    """160 characters (docs/protocol.md §1: longer than any valid name) are accepted, and
    the delivery's temp and clash names built on them stay within a file name's 255 bytes;
    161 are refused above."""
    name = "n" * 160
    inbox, tmp = tmp_path / "inbox", tmp_path / "spool" / "tmp"
    inbox.mkdir()
    (inbox / name).write_bytes(b"other bytes already there")
    _, d = _complete(tmp_path, envelope(b"body", name))
    got, offset = checked(d)
    final, outcome = deliver(d, got, offset, tmp, inbox)
    assert outcome == "renamed" and final == f"{name}~6.3" and len(final) <= 255
    assert (inbox / final).read_bytes() == b"body"


def test_an_inbox_that_is_a_mount_of_its_own_is_refused_at_start(tmp_path: Path) -> None:
    """Neither the spool nor the folder beside the inbox shares the inbox's filesystem: no
    file could be renamed into it whole, and every delivery would fail for ever. The
    receiver refuses to start, saying how to fix it."""
    with small_tmpfs("1m", "udpinbox") as inbox:
        with pytest.raises(ConfigError, match="mount point of its own.*spool on the inbox"):
            delivery_tmp_dir(tmp_path / "spool", inbox)
        sub = inbox / "inbox"  # the fix it names: the inbox a folder in the mount
        sub.mkdir()
        assert delivery_tmp_dir(tmp_path / "spool", sub) == inbox / ".inbox.udp-tmp"


def test_a_name_shorter_than_its_envelope_claims_is_bad_name(tmp_path: Path) -> None:
    _, d = _complete(tmp_path, b"\x00\x40abc")  # says 64 bytes of name, holds 3
    assert verify_and_read_name(d) == "bad_name"


def test_delivery_renames_the_body_into_the_inbox_then_clashes_never_overwrite(
    tmp_path: Path,
) -> None:
    inbox, tmp = tmp_path / "inbox", tmp_path / "spool" / "tmp"
    inbox.mkdir()
    body = os.urandom(10_000)
    ra, d = _complete(tmp_path, envelope(body))
    name, offset = checked(d)
    assert deliver(d, name, offset, tmp, inbox) == (NAME, "delivered")
    assert (inbox / NAME).read_bytes() == body and list(tmp.iterdir()) == []
    ra.mark_delivered(d, NAME)
    assert not d.path.exists()

    # the same bytes again (another object id): a duplicate, nothing delivered
    ra2, d2 = _complete(tmp_path / "again", envelope(body))
    assert deliver(d2, name, offset, tmp, inbox) == (NAME, "duplicate")
    # other bytes under that name: delivered beside it as evidence, the first kept
    other = body[:-1] + bytes([body[-1] ^ 1])
    _, d3 = _complete(tmp_path / "other", envelope(other))
    assert deliver(d3, name, offset, tmp, inbox) == (f"{NAME}~6.3", "renamed")
    assert (inbox / NAME).read_bytes() == body
    assert (inbox / f"{NAME}~6.3").read_bytes() == other
    assert sorted(p.name for p in inbox.iterdir()) == [NAME, f"{NAME}~6.3"]


def test_an_empty_file_is_delivered_empty(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    _, d = _complete(tmp_path, envelope(b""))
    name, offset = checked(d)
    deliver(d, name, offset, tmp_path / "spool" / "tmp", inbox)
    assert (inbox / NAME).read_bytes() == b""


# -- restart: the spool is the state --------------------------------------------------------


def test_rebuild_from_the_spool_after_the_process_is_gone_then_complete(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K * 4 + 7))
    h = header(11, env)
    syms = symbols(3, h, env, repair=2)
    rnd = random.Random(4)
    rnd.shuffle(syms)
    first, rest = syms[: len(syms) // 2], syms[len(syms) // 2 :]
    ra = reassembler(tmp_path)
    feed(ra, first)
    done_before = set(ra.open[(3, 11)].done)
    assert done_before != set(range(h.block_count))
    ra.flush_all()  # what the receive loop does every 0.2 s; then kill -9
    log = tmp_path / "objects" / f"{3:020d}-{11:020d}" / "symbols.log"
    assert log.stat().st_size > 0
    del ra

    ra2 = reassembler(tmp_path)
    assert ra2.recover(50.0) == 1
    obj = ra2.open[(3, 11)]
    assert obj.done == done_before and obj.h == h and 45.0 < obj.last_seen <= 50.0
    assert ra2.held == held_by(ra2) > 0
    feed(ra2, rest)
    assert delivered(ra2) == [env]
    assert ra2.held == 0


def test_an_object_idle_before_a_restart_expires_on_its_own_clock_not_the_restarts(
    tmp_path: Path,
) -> None:
    """An object that got its last symbol 100 s before the restart (its files say when) expires
    60 s idle at the first check, not 60 s after the restart: a receiver restarted more often
    than expire_seconds would otherwise never expire it (and red never hear of the gap)."""
    env = envelope(os.urandom(T * K * 3))
    h = header(13, env)
    ra = reassembler(tmp_path)
    feed(ra, symbols(5, h, env)[:4])
    ra.flush_all()
    del ra  # killed
    folder = tmp_path / "objects" / f"{5:020d}-{13:020d}"
    before = time.time() - 100
    for f in folder.iterdir():
        os.utime(f, (before, before))
    ra2 = reassembler(tmp_path)
    assert ra2.recover(1000.0) == 1
    assert ra2.expire_idle(1001.0, 60) == 1
    (gap,) = read_gap_records(tmp_path)
    assert (gap["object_id"], gap["reason"]) == (13, "timeout")
    # one that got a symbol just before the restart keeps its full expire_seconds
    env2 = envelope(os.urandom(T * K * 3))
    ra2.add(symbols(6, header(14, env2), env2)[0], 1001.0)
    ra2.flush_all()
    del ra2
    ra3 = reassembler(tmp_path)
    assert ra3.recover(2000.0) == 1
    assert ra3.expire_idle(2001.0, 60) == 0


def test_symbols_not_flushed_before_a_kill_are_lost_but_repair_covers_them(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K))
    syms = symbols(1, header(12, env), env, repair=4)
    ra = reassembler(tmp_path)
    feed(ra, syms[:3])
    ra.flush_all()
    feed(ra, syms[3:5])  # buffered, never written: killed here
    del ra
    ra2 = reassembler(tmp_path)
    ra2.recover(1.0)
    assert ra2.open[(1, 12)].symbols == 3
    feed(ra2, syms[5:])  # 3 + 7 symbols remain of k = 8: enough
    assert delivered(ra2) == [env]


def test_an_object_complete_but_not_delivered_is_delivered_after_a_restart(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K * 2))
    ra = reassembler(tmp_path)
    feed(ra, symbols(2, header(13, env), env))
    assert len(ra.ready) == 1  # killed before the delivery thread took it
    (tmp_path / "tmp" / "half-written.tmp").write_bytes(b"x")
    del ra
    ra2 = reassembler(tmp_path)
    ra2.recover(1.0)
    assert delivered(ra2) == [env] and not ra2.open
    assert list((tmp_path / "tmp").iterdir()) == []  # interrupted deliveries swept


def test_a_symbol_after_a_restart_of_an_object_awaiting_delivery_is_late(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K * 2))
    syms = symbols(2, header(14, env), env)
    ra = reassembler(tmp_path)
    feed(ra, syms)
    del ra
    ra2 = reassembler(tmp_path)
    ra2.recover(1.0)
    feed(ra2, syms[:1])
    assert not ra2.open and ra2.dropped == {"late": 1}


def test_objects_delivered_before_a_restart_stay_delivered(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K))
    syms = symbols(8, header(15, env), env)
    ra = reassembler(tmp_path)
    feed(ra, syms)
    ra.mark_delivered(ra.ready.popleft(), NAME)
    del ra
    assert '"object_id": 15' in (tmp_path / DONE).read_text()
    ra2 = reassembler(tmp_path)
    assert ra2.recover(1.0) == 0
    feed(ra2, syms)  # a second copy from the sender: dropped cheaply
    assert ra2.dropped == {"late": len(syms)} and not ra2.open and not ra2.ready


def test_a_torn_spooled_object_is_removed_at_restart(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K))
    ra = reassembler(tmp_path)
    feed(ra, symbols(1, header(16, env), env)[:2])
    ra.flush_all()
    del ra
    (path,) = (tmp_path / "objects").iterdir()
    (path / "meta.json").write_text("{not json")
    ra2 = reassembler(tmp_path)
    assert ra2.recover(1.0) == 0 and not path.exists()


# -- memory and open objects are bounded --------------------------------------------------------


def test_more_open_objects_than_allowed_evicts_the_oldest_as_a_gap(tmp_path: Path) -> None:
    ra = reassembler(tmp_path, max_open_objects=3)
    envs = [envelope(os.urandom(T * K), f"u1.{i:012d}.e.dbundle") for i in range(5)]
    for i, env in enumerate(envs):
        feed(ra, symbols(1, header(i, env), env)[:2], now=float(i))
    assert sorted(ra.open) == [(1, 2), (1, 3), (1, 4)]
    gaps = read_gap_records(tmp_path)
    assert [(g["object_id"], g["reason"]) for g in gaps] == [(0, "evicted"), (1, "evicted")]
    assert len(list((tmp_path / "objects").iterdir())) == 3


def test_bytes_held_in_decoders_are_capped_by_evicting_the_oldest(tmp_path: Path) -> None:
    cap = 20 * (T + udp_spool._SYMBOL_OVERHEAD) + 4 * udp_spool._DECODER_OVERHEAD
    ra = reassembler(tmp_path, max_open_objects=100)
    ra.max_held = cap
    rnd = random.Random(1)
    for i in range(30):  # 30 objects, 5 symbols each, never enough for a block
        env = envelope(rnd.randbytes(T * K), f"u1.{i:012d}.m.dbundle")
        feed(ra, symbols(1, header(i, env), env, repair=0)[:5], now=float(i))
        assert ra.held <= cap
    assert ra.held == held_by(ra)
    reasons = {g["reason"] for g in read_gap_records(tmp_path)}
    assert reasons == {"evicted"} and len(ra.open) <= 4
    assert max(o.h.object_id for o in ra.open.values()) == 29  # the newest kept


# -- spool damage, full disks, given-up objects (review findings) ---------------------------


def _close_files(ra: Reassembler) -> None:
    """What a kill -9 does to the open files (the page cache keeps what was written). A
    compaction in flight never gets its rename: its thread is let finish (nothing of it is
    taken in), its ``symbols.log.tmp`` left behind."""
    for job in ra._compactions:
        assert job.thread is not None
        job.thread.join()
        os.close(job.fd)
        os.close(job.src)
    for o in ra.open.values():
        for fd in (o.data_fd, o.done_fd, o.log_fd):
            os.close(fd)


def test_a_record_torn_by_a_crash_is_cut_off_so_later_symbols_stay_aligned(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K * 3))
    h = header(1, env)
    syms = symbols(7, h, env, repair=4)
    first = [s for s in syms if s.block == 0][:4] + [s for s in syms if s.block == 1][:4]
    ra = reassembler(tmp_path)
    feed(ra, first)
    ra.flush_all()
    (obj_dir,) = (tmp_path / "objects").iterdir()
    log = obj_dir / "symbols.log"
    os.truncate(log, log.stat().st_size - 10)  # the crash tore the last record (block 1)
    _close_files(ra)
    ra = reassembler(tmp_path)
    ra.recover(1.0)
    assert log.stat().st_size % (8 + T) == 0  # the fault fired, and was cut off
    second = [s for s in syms if s.block == 1][4:6] + [s for s in syms if s.block == 2][:4]
    feed(ra, second)
    ra.flush_all()
    _close_files(ra)
    ra = reassembler(tmp_path)
    ra.recover(1.0)
    (obj,) = ra.open.values()
    assert {b: d.received for b, d in obj.decoders.items()} == {0: 4, 1: 5, 2: 4}
    feed(ra, [s for s in syms if s not in first and s not in second])
    assert delivered(ra) == [env] and isinstance(verify_and_read_name(ra.ready[0]), tuple)


def test_a_spooled_record_that_cannot_belong_to_its_object_is_skipped_not_fatal(
    tmp_path: Path,
) -> None:
    env = envelope(os.urandom(T * K))
    h = header(1, env)
    syms = symbols(7, h, env, repair=2)
    ra = reassembler(tmp_path)
    feed(ra, syms[:3])
    ra.flush_all()
    _close_files(ra)
    (obj_dir,) = (tmp_path / "objects").iterdir()
    with open(obj_dir / "symbols.log", "ab") as f:  # damage: symbol id 2^32 - 1 of block 0
        f.write((0).to_bytes(4, "big") + (2**32 - 1).to_bytes(4, "big") + bytes(T))
    ra = reassembler(tmp_path)
    assert ra.recover(1.0) == 1
    feed(ra, syms[3:])
    assert delivered(ra) == [env]


def test_an_object_whose_files_cannot_all_be_opened_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open, opened = os.open, []

    def third_fails(path: object, flags: int, mode: int = 0o777) -> int:
        if str(path).endswith("symbols.log"):
            raise OSError(24, "Too many open files")  # EMFILE, after data and blocks.done
        fd = real_open(path, flags, mode)  # type: ignore[arg-type]
        opened.append(fd)
        return fd

    env = envelope(os.urandom(T * K))
    ra = reassembler(tmp_path)
    monkeypatch.setattr(os, "open", third_fails)
    with pytest.raises(OSError, match="Too many open files"):
        ra.add(symbols(7, header(1, env), env)[0], 1.0)
    monkeypatch.undo()
    assert len(opened) == 2  # the fault fired after two opens...
    for fd in opened:  # ...and both were closed again
        with pytest.raises(OSError):
            os.fstat(fd)


def test_an_object_given_up_is_not_reopened_by_its_later_symbols(tmp_path: Path) -> None:
    env = envelope(os.urandom(T * K * 4))
    h = header(1, env)
    syms = symbols(7, h, env, repair=2)
    ra = reassembler(tmp_path)
    feed(ra, syms[:20], now=1.0)
    assert ra.expire_idle(200.0, 120.0) == 1  # the sender paused too long: one gap
    feed(ra, syms[20:], now=201.0)  # ...then went on
    assert not ra.open and ra.dropped["expired"] == len(syms) - 20
    assert ra.expire_idle(400.0, 120.0) == 0
    assert [g["reason"] for g in read_gap_records(tmp_path)] == ["timeout"]


def _given_up(kind: str, root: Path, env: bytes, syms: list[Symbol]) -> Reassembler:
    """A receiver that gave up object (7, 1) the way ``kind`` says, its gap record written."""
    if kind == "too_large":
        ra = reassembler(root, max_object_bytes=len(env) - 1)
        feed(ra, syms[:3])
        return ra
    ra = reassembler(root)
    feed(ra, syms[:20], now=1.0)
    if kind == "timeout":
        assert ra.expire_idle(200.0, 120.0) == 1
    else:
        ra.give_up(7, syms[0].obj, OSError(28, "No space left on device"))
    assert ra.wait_trash(10)
    return ra


@pytest.mark.parametrize("kind", ["timeout", "spool_error", "too_large"])
def test_an_object_given_up_stays_given_up_across_a_restart(tmp_path: Path, kind: str) -> None:
    """Its later symbols (the sender went on) are dropped by the restarted receiver as by the
    one that gave it up: no object reopened, no second gap record for it."""
    env = envelope(os.urandom(T * K * 4))
    syms = symbols(7, header(1, env), env, repair=2)
    ra = _given_up(kind, tmp_path, env, syms)
    del ra  # restarted
    ra2 = reassembler(tmp_path, max_object_bytes=len(env) - 1 if kind == "too_large" else 1 << 30)
    assert ra2.recover(300.0) == 0
    feed(ra2, syms[20:], now=301.0)
    assert not ra2.open and not ra2.ready
    dropped = {"timeout": "expired"}.get(kind, kind)
    assert ra2.dropped == {dropped: len(syms) - 20}
    assert ra2.expire_idle(900.0, 120.0) == 0
    assert [g["reason"] for g in read_gap_records(tmp_path)] == [kind]


@pytest.mark.parametrize("kind", ["timeout", "spool_error", "digest_mismatch"])
def test_a_folder_left_behind_its_gap_record_is_removed_at_restart_not_recorded_again(
    tmp_path: Path, kind: str
) -> None:
    """A kill after an object's gap record but before its folder left ``objects/`` (or a power
    loss that undid that unsynced rename): the restarted receiver removes the folder, neither
    rebuilding, delivering nor recording the object again; another object goes on."""
    env = envelope(os.urandom(T * K * 4))
    wrong = hashlib.sha256(b"other").digest() if kind == "digest_mismatch" else None
    syms = symbols(7, header(1, env, digest=wrong), env, repair=2)
    ra = reassembler(tmp_path)
    live = envelope(os.urandom(T * K * 2), "u1.000000000005.l.dbundle")
    live_syms = symbols(7, header(5, live), live)
    feed(ra, live_syms[:5])
    if kind == "digest_mismatch":
        feed(ra, syms)
        (d,) = ra.ready
        ra.fail(d, verify_and_read_name(d))  # recorded; the kill comes before discard_spooled
        folder = d.path
    else:
        feed(ra, syms[:20])
        folder = ra.open[(7, 1)].path
    ra.flush_all()
    kept = tmp_path / "kept"
    shutil.copytree(folder, kept)
    if kind == "timeout":
        ra._expire((7, 1), "timeout")
    elif kind == "spool_error":
        ra.give_up(7, syms[0].obj, OSError(5, "Input/output error"))
    assert ra.wait_trash(10)
    _close_files(ra)
    if not folder.exists():
        kept.rename(folder)  # the folder as the kill (or the power loss) left it
    gaps = read_gap_records(tmp_path)
    assert [g["reason"] for g in gaps] == [kind]

    ra2 = reassembler(tmp_path)
    assert ra2.recover(300.0) == 1 and list(ra2.open) == [(7, 5)] and not ra2.ready
    assert ra2.wait_trash(10) and not folder.exists()
    assert read_gap_records(tmp_path) == gaps
    feed(ra2, live_syms[5:])
    assert delivered(ra2) == [live]


def _refusing(ra: Reassembler, errno_: int) -> list[int]:
    """Make the disk refuse every gap record (a fault injected at the one write of the
    journal); returns the list the refusals are counted in."""
    refused: list[int] = []

    def refuse() -> None:
        refused.append(errno_)
        raise OSError(errno_, os.strerror(errno_))

    ra._append_gaps = refuse  # type: ignore[method-assign]
    return refused


@pytest.mark.parametrize("kind", ["timeout", "spool_error", "digest_mismatch"])
def test_a_gap_record_the_disk_refuses_keeps_its_folder_until_written_or_the_restart(
    tmp_path: Path, kind: str
) -> None:
    """An I/O error on gaps.jsonl when an object is given up: the folder stays in objects/
    (emptied: its room given back) while the record waits in memory. Killed then, the
    restart finds the object and records it (as ``timeout``: nothing of it is left); had the
    disk come back first, the record is written and the folder goes."""
    env = envelope(os.urandom(T * K * 4))
    wrong = hashlib.sha256(b"other").digest() if kind == "digest_mismatch" else None
    syms = symbols(7, header(1, env, digest=wrong), env, repair=2)
    for restart in (True, False):
        root = tmp_path / f"restart-{restart}"
        ra = reassembler(root)
        refused = _refusing(ra, errno.EIO)
        if kind == "digest_mismatch":
            feed(ra, syms)
            (d,) = ra.ready
            assert ra.fail(d, verify_and_read_name(d)) is False  # not to be discarded
            folder = d.path
        else:
            feed(ra, syms[:20], now=1.0)
            ra.flush_all()
            folder = ra.open[(7, 1)].path
            if kind == "timeout":
                assert ra.expire_idle(200.0, 120.0) == 1
            else:
                ra.give_up(7, syms[0].obj, OSError(errno.EIO, "Input/output error"))
        assert refused and ra.pending_gaps() == 1 and read_gap_records(root) == []
        assert (folder / "meta.json").exists() and (folder / "data").stat().st_size == 0
        assert (folder / "blocks.done").stat().st_size == 0
        if restart:
            _close_files(ra)
            ra2 = reassembler(root)
            assert ra2.recover(300.0) == 1 and list(ra2.open) == [(7, 1)]
            assert ra2.expire_idle(300.0 + 120.0, 120.0) == 1
            assert [g["reason"] for g in read_gap_records(root)] == ["timeout"]
            assert ra2.wait_trash(10) and not folder.exists()
        else:
            del ra._append_gaps  # the disk is back
            assert ra.write_gaps() == 0
            assert [g["reason"] for g in read_gap_records(root)] == [kind]
            assert ra.wait_trash(10) and not folder.exists()


def test_an_append_of_gap_records_cut_short_by_a_full_disk_leaves_none_of_them() -> None:
    """A real full disk that takes part of an append: the records (still in memory, retried)
    are cut back off, so once there is room each is written once, whole."""
    with small_tmpfs("1m", "udpgaps") as disk:
        root = disk / "spool"
        ra = reassembler(root)
        recs = [{"epoch": 1, "object_id": i, "pad": "x" * 300} for i in range(40)]
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space"):
            while True:
                os.write(fd, bytes(4096))
        os.ftruncate(fd, os.fstat(fd).st_size - 4096)  # one page left: ~12 records of 40
        for r in recs:
            ra.gap(r, "timeout", write=False)
        assert ra.write_gaps() == 40
        assert (root / "gaps.jsonl").stat().st_size == 0  # what went in was cut back off
        os.ftruncate(fd, 0)
        os.close(fd)
        assert ra.write_gaps() == 0
        got = [g["object_id"] for g in read_gap_records(root)]
        assert got == list(range(40))


def test_a_spooled_object_whose_meta_was_lost_is_recorded_by_its_folder_name(
    tmp_path: Path,
) -> None:
    """A power loss before meta.json (written once, never fsynced) reached the disk: the
    restart cannot rebuild the object, and records it as a ``spool_error`` gap under the
    epoch and id its folder is named by (no silent loss), then drops its later symbols."""
    env = envelope(os.urandom(T * K * 4))
    syms = symbols(7, header(3, env), env, repair=2)
    ra = reassembler(tmp_path)
    feed(ra, syms[:20])
    ra.flush_all()
    folder = ra.open[(7, 3)].path
    _close_files(ra)
    (folder / "meta.json").write_bytes(b"")
    ra2 = reassembler(tmp_path)
    assert ra2.recover(5.0) == 0
    (gap,) = read_gap_records(tmp_path)
    assert (gap["reason"], gap["epoch"], gap["object_id"]) == ("spool_error", 7, 3)
    assert "meta.json unreadable" in gap["error"]
    assert ra2.wait_trash(10) and not folder.exists()
    feed(ra2, syms[20:])
    assert not ra2.open and ra2.dropped == {"spool_error": len(syms) - 20}
    ra3 = reassembler(tmp_path)  # recorded once, never again
    assert ra3.recover(9.0) == 0 and len(read_gap_records(tmp_path)) == 1


def test_a_failed_object_is_forgotten_like_any_given_up_not_kept_as_done(tmp_path: Path) -> None:
    """Objects failed at delivery (digest mismatch, bad name) move from ``done`` to the bounded
    set of objects given up: their later symbols are still dropped, memory stays bounded."""
    ra = reassembler(tmp_path)
    ra.remembered = 5
    for oid in range(12):
        env = envelope(os.urandom(T * 2))
        h = header(oid, env, digest=hashlib.sha256(b"not it").digest())
        feed(ra, symbols(2, h, env))
        d = ra.ready.popleft()
        assert ra.fail(d, "digest_mismatch") is True
        discard_spooled(d)
    assert not ra.done and len(ra._gone) == 5
    late = symbols(2, h, env)[:1]
    feed(ra, late)
    assert ra.dropped.get("expired") == 1


def test_a_short_copy_into_the_inbox_fails_the_delivery_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from bridge.diode import udp_spool

    env = envelope(os.urandom(5000))
    ra = reassembler(tmp_path / "spool")
    feed(ra, symbols(7, header(1, env), env))
    d = ra.ready[0]
    name, offset = checked(d)
    inbox, tmp = tmp_path / "inbox", tmp_path / "tmp"
    inbox.mkdir()
    tmp.mkdir()

    def cross_device(*a: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    real_write, writes = os.write, []

    def full_disk(fd: int, data: bytes) -> int:  # takes 100 bytes, then the disk is full
        writes.append(fd)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, memoryview(data)[:100])

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    monkeypatch.setattr(udp_spool.os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        deliver(d, name, offset, tmp, inbox)
    monkeypatch.undo()
    assert len(writes) == 2  # the fault fired mid-copy
    assert not list(inbox.iterdir()) and not list(tmp.iterdir())  # nothing delivered, no temp


# -- disk footprint: symbols.log is compacted once rebuilt blocks dominate -------------------

BIG_T, BIG_K = 1024, 64  # 64 KiB blocks
BIG_REC = 8 + BIG_T


def interleaved(epoch: int, h: ObjectHeader, env: bytes, window: int = 8) -> list[Symbol]:
    """Every symbol, esi by esi across windows of ``window`` consecutive blocks (as the sender
    interleaves them); two source symbols of every third block lost (RaptorQ rebuilds it)."""
    out: list[Symbol] = []
    n = block_count(h.length, h.symbol_size, h.block_symbols)
    for first in range(0, n, window):
        per_block = []
        for b in range(first, min(first + window, n)):
            p = block_plan(h.length, h.symbol_size, h.block_symbols, b)
            syms = encode_block(env[p.offset : p.offset + p.length], h.symbol_size, 6)
            per_block.append([(b, esi, s) for esi, s in syms if b % 3 or esi not in (3, 9)])
        for i in range(max(map(len, per_block))):
            out += [Symbol(epoch, len(out), h, *x[i]) for x in per_block if i < len(x)]
    return out


def disk_usage(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (what a full disk refuses)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def _big_object(seed: int) -> tuple[bytes, ObjectHeader, list[Symbol]]:
    env = envelope(random.Random(seed).randbytes(6 << 20))  # 97 blocks
    h = header(21, env, t=BIG_T)
    h = ObjectHeader(h.object_id, h.kind, h.channel, h.seq, h.length, h.digest, BIG_T, BIG_K)
    return env, h, interleaved(4, h, env)


def _footprint_bound(ra: Reassembler) -> int:
    """Rebuilt blocks' bytes + unfinished blocks' symbols, twice (at most that much of dead
    records before a compaction) + the compaction threshold + a little for the small files."""
    (obj,) = ra.open.values()
    rebuilt = sum(block_plan(obj.h.length, BIG_T, BIG_K, b).length for b in obj.done)
    live = sum(d.received for d in obj.decoders.values()) * BIG_REC
    return rebuilt + 2 * live + ra.compact_log_bytes + (64 << 10)


def test_an_open_object_takes_about_its_rebuilt_bytes_on_disk_not_twice(tmp_path: Path) -> None:
    env, h, syms = _big_object(1)
    ra = reassembler(tmp_path, compact_log_bytes=256 << 10)
    cut = len(syms) * 9 // 10  # most blocks rebuilt, the last window half received
    feed_settled(ra, syms[:cut])
    ra.flush_all()  # the worst case: every symbol received so far is on disk
    (obj,) = ra.open.values()
    assert 0.8 * h.block_count < len(obj.done) < h.block_count
    assert ra.compacted > 0  # the mend fired (no compaction: about 1.9 x the rebuilt bytes)
    used = disk_usage(tmp_path)
    assert used <= _footprint_bound(ra), (used, _footprint_bound(ra))
    assert used < 1.2 * len(env) * len(obj.done) / h.block_count
    log = tmp_path / "objects" / f"{4:020d}-{21:020d}" / "symbols.log"
    assert log.stat().st_size < 2 * sum(d.received for d in obj.decoders.values()) * BIG_REC + (
        ra.compact_log_bytes
    )
    feed(ra, syms[cut:])
    assert delivered(ra) == [env] and ra.held == 0
    lost = [b for b in range(0, h.block_count, 3) if block_plan(h.length, BIG_T, BIG_K, b).k > 9]
    assert ra.ready[0].repairs_used == 2 * len(lost)


def test_a_compacted_object_is_rebuilt_after_a_kill_and_completes(tmp_path: Path) -> None:
    env, h, syms = _big_object(2)
    ra = reassembler(tmp_path, compact_log_bytes=256 << 10)
    cut = len(syms) * 2 // 3
    feed_settled(ra, syms[:cut])
    ra.flush_all()
    assert ra.compacted > 0
    (obj,) = ra.open.values()
    done, received = set(obj.done), {b: d.received for b, d in obj.decoders.items()}
    _close_files(ra)  # kill -9
    del ra, obj
    ra2 = reassembler(tmp_path, compact_log_bytes=256 << 10)
    assert ra2.recover(1.0) == 1
    (obj2,) = ra2.open.values()
    assert obj2.done == done  # every rebuilt block's data kept, none rebuilt again
    assert {b: d.received for b, d in obj2.decoders.items()} == received  # no symbol lost
    feed(ra2, syms[cut:])
    (d,) = ra2.ready
    assert delivered(ra2) == [env] and verify_and_read_name(d) == (NAME, 2 + len(NAME))


@pytest.mark.parametrize("compactions", [3, 4])
def test_a_kill_right_after_a_compaction_loses_no_symbol_it_kept(
    tmp_path: Path, compactions: int
) -> None:
    """Blocks sent in halves, each block's first half before the previous one's second: at
    every compaction a half-received block lives on only in the new log."""
    env, h, _ = _big_object(5)
    syms = symbols(4, h, env, repair=0)
    halves = [[s for s in syms if s.block == b] for b in range(h.block_count)]
    order = halves[0][:32]
    for b in range(1, h.block_count):
        order += halves[b][:32] + halves[b - 1][32:]
    order += halves[-1][32:]
    ra = reassembler(tmp_path, compact_log_bytes=256 << 10)
    i = 0
    while ra.compacted < compactions:
        feed_settled(ra, [order[i]])
        i += 1
    ra.flush_all()
    before = _state(ra)
    (obj,) = ra.open.values()
    assert sum(d.received for d in obj.decoders.values()) > 0  # a half block, in the log only
    _close_files(ra)
    ra2 = reassembler(tmp_path, compact_log_bytes=256 << 10)
    ra2.recover(1.0)
    assert _state(ra2) == before
    feed(ra2, order[i:])  # no surplus: a symbol the compaction dropped would stall a block
    assert delivered(ra2) == [env]


def test_a_compaction_cut_short_by_a_kill_leaves_the_old_log_to_go_on_with(
    tmp_path: Path,
) -> None:
    env, h, syms = _big_object(3)
    ra = reassembler(tmp_path)  # the default threshold: no compaction in 6 MiB
    cut = len(syms) // 2
    feed(ra, syms[:cut])
    ra.flush_all()
    assert ra.compacted == 0
    (obj,) = ra.open.values()
    received = {b: d.received for b, d in obj.decoders.items()}
    _close_files(ra)
    (obj_dir,) = (tmp_path / "objects").iterdir()
    (obj_dir / "symbols.log.tmp").write_bytes(os.urandom(3 * BIG_REC + 5))  # killed mid-write
    ra2 = reassembler(tmp_path, compact_log_bytes=256 << 10)
    assert ra2.recover(1.0) == 1
    assert not (obj_dir / "symbols.log.tmp").exists()
    assert ra2.compacted == 1  # the log was mostly rebuilt blocks' records: compacted now
    (obj2,) = ra2.open.values()
    assert {b: d.received for b, d in obj2.decoders.items()} == received
    assert (obj_dir / "symbols.log").stat().st_size == sum(received.values()) * BIG_REC
    feed(ra2, syms[cut:])
    assert delivered(ra2) == [env]


def _held_at(monkeypatch: pytest.MonkeyPatch, point: str) -> Iterator[threading.Event]:
    """Slow point ``point`` of udp_spool waits (as on a slow disk) until the event is set."""
    release = threading.Event()
    real = udp_spool.slow_point

    def slow(name: str) -> None:
        if name == point:
            release.wait(30)
        real(name)

    monkeypatch.setattr(udp_spool, "slow_point", slow)
    yield release
    release.set()


@pytest.fixture
def held_compaction(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Compactions stay in flight (their thread waits before its first fsync, as on a slow
    disk) until the event is set."""
    yield from _held_at(monkeypatch, "udp.compaction")


def _until_compacting(ra: Reassembler, syms: list[Symbol]) -> int:
    """Feed until a compaction is in flight; returns how many symbols that took."""
    i = 0
    while not ra._compactions:
        ra.add(syms[i], 1.0)
        i += 1
    return i


@pytest.mark.parametrize("kill", ["before_its_rename", "after_it"])
def test_symbols_taken_while_a_compaction_is_in_flight_survive_a_kill(
    tmp_path: Path, held_compaction: threading.Event, kill: str
) -> None:
    """The receive loop does not wait for a compaction: it goes on rebuilding blocks and
    appending to the old log, and what it appended is carried into the new log (part by the
    compaction's thread, the rest when the loop takes it in). Killed before the rename (the
    old log holds everything) or after it (the new one does), nothing is lost."""
    env, h, syms = _big_object(6)
    ra = reassembler(tmp_path, compact_log_bytes=256 << 10)
    i = _until_compacting(ra, syms)
    (job,) = ra._compactions
    (obj,) = ra.open.values()
    log, tmp = obj.path / "symbols.log", obj.path / "symbols.log.tmp"
    done_then = len(obj.done)
    few: list[Symbol] = []
    j = i + len(syms) // 4
    feed(ra, syms[i:j])
    ra.flush_all()  # as the loop does every 0.2 s; the compaction is still in flight
    assert not job.finished and ra.compacted == 0 and tmp.exists()
    assert len(obj.done) > done_then + 8  # blocks rebuilt meanwhile
    assert log.stat().st_size == obj.logged > 2 * job.start  # every record in the old log
    if kill == "after_it":
        held_compaction.set()
        assert job.thread is not None
        job.thread.join()  # it carried what was flushed; what comes next, the loop carries
        assert job.finished and job.error is None and job.copied == obj.logged > job.start
        started = set(obj.done) | set(obj.decoders)
        few = [s for s in syms[j:] if s.block not in started][:5]  # logged, none completes
        feed(ra, few)  # pending, then flushed to the old log: the loop carries them over
        ra.flush_all()
        assert ra.compacted == 1 and job not in ra._compactions
        assert log.stat().st_size == job.end + 5 * BIG_REC
        ra.wait_compactions()  # the carried records are mostly dead: the next may be due
        assert log.stat().st_size == obj.logged and not tmp.exists()
    before = _state(ra)
    held_compaction.set()  # before_its_rename: its thread finishes, its rename never comes
    _close_files(ra)
    if kill == "before_its_rename":
        assert tmp.exists()
    ra2 = reassembler(tmp_path, compact_log_bytes=256 << 10)
    assert ra2.recover(1.0) == 1
    assert _state(ra2) == before and not tmp.exists()
    feed(ra2, [s for s in syms[j:] if s not in few])  # one lost in the swap stalls its block
    assert delivered(ra2) == [env]


@pytest.mark.parametrize("end", ["completed", "expired"])
def test_an_object_that_ends_while_its_log_is_compacted_leaves_no_temp_file(
    tmp_path: Path, held_compaction: threading.Event, end: str
) -> None:
    env, h, syms = _big_object(7)
    ra = reassembler(tmp_path, compact_log_bytes=256 << 10)
    i = _until_compacting(ra, syms)
    (obj,) = ra.open.values()
    if end == "completed":
        feed(ra, syms[i:])
        assert delivered(ra) == [env]
    else:
        assert ra.expire_idle(100.0, 60.0) == 1
        assert not obj.path.exists()
    assert not ra.open and ra._compactions
    held_compaction.set()
    ra.wait_compactions()
    assert not ra._compactions and ra.compacted == 0
    if end == "completed":
        assert sorted(p.name for p in obj.path.iterdir()) == [
            "blocks.done",
            "data",
            "meta.json",
            "symbols.log",
        ]
        (d,) = ra.ready
        assert verify_and_read_name(d) == (NAME, 2 + len(NAME))
    else:
        assert not obj.path.exists()  # nothing written back into the removed folder
        assert [g["reason"] for g in read_gap_records(tmp_path)] == ["timeout"]


def test_a_compaction_the_disk_refuses_keeps_the_old_log_and_the_object_goes_on(
    held_compaction: threading.Event,
) -> None:
    """On a real small disk filled up while the compaction is in flight, its temp file cannot
    be written: the old log stays in use, the object completes once there is room again."""
    env = envelope(random.Random(8).randbytes(1536 << 10))  # 24 blocks of 64 KiB
    h = header(31, env, t=BIG_T)
    h = ObjectHeader(h.object_id, h.kind, h.channel, h.seq, h.length, h.digest, BIG_T, BIG_K)
    syms = interleaved(9, h, env)
    with small_tmpfs("4m", "udpspool") as disk:
        ra = reassembler(disk / "spool", compact_log_bytes=128 << 10)
        i = _until_compacting(ra, syms)
        (job,) = ra._compactions
        (obj,) = ra.open.values()
        live = sum(d.received for d in obj.decoders.values()) * BIG_REC
        st = os.statvfs(disk)
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - live // 2))
        held_compaction.set()
        ra.wait_compactions()
        assert isinstance(job.error, OSError) and "No space left" in str(job.error)
        assert ra.compacted == 0 and not (obj.path / "symbols.log.tmp").exists()
        assert (obj.path / "symbols.log").stat().st_size == obj.logged  # the old log, whole
        filler.unlink()
        feed_settled(ra, syms[i:])
        assert delivered(ra) == [env] and ra.compacted > 0  # compacted once there was room
        assert read_gap_records(disk / "spool") == []


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    size=st.integers(1, 5 * T * K),
    seed=st.integers(0, 2**32 - 1),
    cut=st.floats(0, 1),
)
def test_compacting_at_every_chance_then_a_kill_anywhere_still_rebuilds_exactly(
    tmp_path_factory: pytest.TempPathFactory, size: int, seed: int, cut: float
) -> None:
    """Any order, duplicates, loss within budget; the log compacted whenever rebuilt blocks'
    records outweigh the rest; killed after any symbol (what was received is flushed)."""
    kept = scrambled(seed, size, 0.3, 2)
    env = envelope(random.Random(seed).randbytes(size))
    root = tmp_path_factory.mktemp("spool")
    ra = reassembler(root, compact_log_bytes=0)
    n = int(len(kept) * cut)
    feed(ra, kept[:n])
    ra.flush_all()
    before = _state(ra)
    _close_files(ra)
    ra2 = reassembler(root, compact_log_bytes=0)
    ra2.recover(1.0)
    assert not list(root.glob("objects/*/symbols.log.tmp"))
    assert _state(ra2) == before  # nothing received was lost, nothing rebuilt was forgotten
    feed(ra2, kept[n:])
    assert delivered(ra2) == [env] and not ra2.open and ra2.held == 0


def _state(ra: Reassembler) -> dict[tuple[int, int], tuple[set[int], dict[int, int]]]:
    """Per open object: its rebuilt blocks and the symbols held for each other block."""
    return {
        key: (set(o.done), {b: d.received for b, d in o.decoders.items()})
        for key, o in ra.open.items()
    }


def test_objects_refused_as_too_large_are_remembered_up_to_a_cap(tmp_path: Path) -> None:
    """Each refused object is one gap record however many symbols it sends; the set of them
    is bounded (the oldest forgotten: a forgotten one seen again is recorded again)."""
    ra = reassembler(tmp_path, max_object_bytes=1024)
    ra.remembered = 50
    env = envelope(os.urandom(2000))
    for oid in range(120):
        feed(ra, symbols(1, header(oid, env), env)[:3])
    assert len(ra._refused) == 50
    assert len(read_gap_records(tmp_path)) == 120
    feed(ra, symbols(1, header(119, env), env)[:3])  # remembered: no new record
    assert len(read_gap_records(tmp_path)) == 120
    feed(ra, symbols(1, header(0, env), env)[:3])  # forgotten long ago
    assert len(read_gap_records(tmp_path)) == 121 and len(ra._refused) == 50
    assert ra.dropped == {"too_large": 122 * 3}


# -- objects that end: out of objects/ by a rename, removed off the receive loop ------------


@pytest.fixture
def held_trash(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The trash's thread waits before each removal (a slow disk) until the event is set."""
    yield from _held_at(monkeypatch, "udp.trash")


def _trashed(root: Path) -> dict[str, list[str]]:
    """What the trash holds: each folder's files (a folder its thread removes meanwhile is
    left out: it is gone)."""
    out: dict[str, list[str]] = {}
    for p in (root / "trash").iterdir():
        try:
            out[p.name] = sorted(os.listdir(p))
        except FileNotFoundError:
            continue
    return out


@pytest.mark.parametrize("end", ["timeout", "evicted", "superseded", "spool_error"])
def test_an_object_that_ends_is_renamed_out_of_objects_and_removed_off_the_loop(
    tmp_path: Path, held_trash: threading.Event, end: str
) -> None:
    """The call that ends an object only renames its folder into trash/ (its gap record is
    written all the same: never silent); the slow removal runs on another thread, here held
    as if on a slow disk, and the call has returned meanwhile."""
    env = envelope(os.urandom(T * K * 4))
    h = header(1, env)
    syms = symbols(3, h, env, repair=0)
    ra = reassembler(tmp_path, max_open_objects=1)
    feed(ra, syms[: 2 * K + 3], now=1.0)  # two blocks rebuilt: data written
    ra.flush_all()
    (obj,) = ra.open.values()
    name = obj.path.name
    if end == "timeout":
        assert ra.expire_idle(100.0, 30.0) == 1
    elif end == "evicted":
        other = envelope(os.urandom(T * K), "u1.000000000009.x.dbundle")
        feed(ra, symbols(3, header(2, other), other)[:1], now=2.0)  # one open object at most
    elif end == "superseded":
        feed(ra, symbols(4, header(0, env), env)[:1], now=2.0)  # the restarted sender's copy
    else:
        ra.give_up(3, h, OSError(5, "Input/output error"))
    assert not (tmp_path / "objects" / name).exists() and (3, 1) not in ra.open
    (folder,) = _trashed(tmp_path).items()
    assert folder[0].startswith(name + ".")
    assert folder[1] == ["blocks.done", "data", "meta.json", "symbols.log"]  # not removed yet
    gaps = [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)]
    assert gaps == ([] if end == "superseded" else [(1, end)])
    assert not ra.wait_trash(0.2)  # the removal really is held
    feed(ra, syms[2 * K + 3 :], now=3.0)  # the loop goes on meanwhile (later symbols dropped)
    held_trash.set()
    deadline = time.monotonic() + 10
    while _trashed(tmp_path):  # removed by itself: nothing left held until a later call
        assert time.monotonic() < deadline, f"{end}: the folder stayed in the trash"
        time.sleep(0.02)
    assert ra.wait_trash(10)
    assert _trashed(tmp_path) == {} and not ra.ready
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == gaps


def _records_when_trashed(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[list[str]]:
    """The gap records' reasons on disk each time a folder is moved into the trash (at the
    crash point there: what a kill at that moment would leave)."""
    seen: list[list[str]] = []
    real = udp_spool.crash_point

    def spy(name: str) -> None:
        if name == "udp.after_object_trashed":
            seen.append([g["reason"] for g in read_gap_records(root)])
        real(name)

    monkeypatch.setattr(udp_spool, "crash_point", spy)
    return seen


def test_a_spool_error_is_recorded_before_its_folder_leaves_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spool write that fails (give_up) and a spooled object that cannot be reopened at a
    restart (here its blocks.done is a directory) are each recorded before their folder goes
    to the trash: a kill in between leaves the folder, never a folder gone without a record.
    The folder is then removed by itself (before, a give_up whose record was written at once
    left it held in the trash until another object ended)."""
    seen = _records_when_trashed(monkeypatch, tmp_path)
    env = envelope(os.urandom(T * K * 2))
    ra = reassembler(tmp_path)
    feed(ra, symbols(3, header(1, env), env)[:3])
    ra.give_up(3, header(1, env), OSError(5, "Input/output error"))
    assert seen == [["spool_error"]]
    deadline = time.monotonic() + 10
    while _trashed(tmp_path):  # removed by itself, not held until some later call
        assert time.monotonic() < deadline, "the given-up folder stayed in the trash"
        time.sleep(0.02)
    other = envelope(os.urandom(T * K * 2), "u1.000000000009.x.dbundle")
    feed(ra, symbols(3, header(2, other), other)[:3])
    ra.flush_all()
    (obj,) = ra.open.values()
    (obj.path / "blocks.done").unlink()
    (obj.path / "blocks.done").mkdir()
    ra2 = reassembler(tmp_path)
    assert ra2.recover(5.0) == 0
    assert seen == [["spool_error"], ["spool_error", "spool_error"]]
    assert [(g["object_id"], g["reason"]) for g in read_gap_records(tmp_path)] == [
        (1, "spool_error"), (2, "spool_error")
    ]  # fmt: skip
    assert list((tmp_path / "objects").iterdir()) == []
    assert ra2.wait_trash(10) and _trashed(tmp_path) == {}


def test_what_a_crash_left_in_the_trash_is_removed_at_restart_never_rebuilt_or_delivered(
    tmp_path: Path,
) -> None:
    """Killed after a folder was moved into the trash (whole, even complete and awaiting its
    delivery) or part way through its removal: the restarted receiver neither rebuilds nor
    delivers nor records it again, and removes it; the objects in objects/ go on."""
    env = envelope(os.urandom(T * K * 2))
    complete = symbols(2, header(1, env), env)
    ra = reassembler(tmp_path)
    feed(ra, complete)  # complete, awaiting delivery...
    (d,) = ra.ready
    assert udp_spool._to_trash(d.path, tmp_path / "trash") is not None  # ...killed in discard
    half = envelope(os.urandom(T * K * 2), "u1.000000000005.h.dbundle")
    feed(ra, symbols(2, header(5, half), half)[: K + 2])  # one block rebuilt
    live = envelope(os.urandom(T * K * 2), "u1.000000000007.l.dbundle")
    live_syms = symbols(2, header(7, live), live)
    feed(ra, live_syms[:5])
    ra.flush_all()
    _close_files(ra)  # killed: one object moved, its removal under way...
    gone = udp_spool._to_trash(ra.open[(2, 5)].path, tmp_path / "trash")
    assert gone is not None
    (gone / "data").unlink()  # ...its data removed, not yet its other files
    assert len(_trashed(tmp_path)) == 2
    gaps = read_gap_records(tmp_path)

    ra2 = reassembler(tmp_path)
    assert ra2.recover(1.0) == 1 and list(ra2.open) == [(2, 7)]
    assert not ra2.ready and read_gap_records(tmp_path) == gaps
    assert ra2.wait_trash(10) and _trashed(tmp_path) == {}
    feed(ra2, live_syms[5:])
    assert delivered(ra2) == [live]


def test_a_gap_record_the_full_disk_refuses_is_written_in_the_room_of_the_folder_given_up() -> None:
    """On a real full disk, the spool_error record cannot be written until the given-up
    object's folder gives back its room: tried first (a record before the files go, when it
    can), then after waiting for the trash, then once the folder is emptied in place (still
    in objects/, so a kill before the record is written leaves the object to be recorded at
    the restart), it is on disk when give_up returns, and only then does the folder go."""
    with small_tmpfs("2m", "udptrash") as disk:
        root = disk / "spool"
        env = envelope(os.urandom(T * K))
        h = header(1, env)
        ra = reassembler(root)
        feed(ra, symbols(1, h, env)[:2])
        ra.flush_all()
        (obj,) = ra.open.values()
        with open(obj.path / "data", "r+b") as f:  # rebuilt blocks: 512 KiB of the disk
            f.write(os.urandom(512 << 10))
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError, match="No space"):
            while True:
                os.write(fd, bytes(4096))  # the disk full to its last page
        os.close(fd)
        tried: list[int | None] = []
        real = ra._append_gaps

        def append() -> None:
            try:
                real()
            except OSError as e:
                tried.append(e.errno)
                raise
            tried.append(None)

        ra._append_gaps = append  # type: ignore[method-assign]
        ra.give_up(1, h, OSError(28, "No space left on device"))
        # refused for lack of room (before the folder goes, then once more in the trash),
        # then written once its room is freed
        assert tried == [28, 28, None]
        assert [g["reason"] for g in read_gap_records(root)] == ["spool_error"]
        assert not ra._unwritten_gaps and not ra._awaiting
        assert ra.wait_trash(10) and _trashed(root) == {}
        assert list((root / "objects").iterdir()) == []
