"""UDP decoder workers (real processes, real shared memory): the blocks they rebuild are the
blocks that were sent, whatever symbols were lost; blocks beyond the free slots wait in a
bounded queue; a worker lost mid-stream is replaced by the receiver's process without losing
a block; the receiver uses them on a real socket and says so in its summary."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bridge.demo.udp_link import free_udp_port
from bridge.diode.udp_decode import DecoderPool
from bridge.diode.udp_fec import decode_symbols, encode_block, repair_count
from bridge.diode.udp_sender import envelope_prefix
from bridge.diode.udp_spool import Reassembler
from bridge.protocol.datagram import DatagramCodec, ObjectHeader, ObjectKind, Symbol
from tests.integration.test_udp_encode import shadow_bridge
from tests.integration.test_udp_receive import K, T, _cfg, datagrams, receiving

Block = tuple[bytes, int, int, list[tuple[int, bytes]]]
"""(the block's bytes, T, k, the symbols that arrived)"""


def lossy_blocks(n: int, seed: int) -> list[Block]:
    """``n`` blocks of mixed sizes, each missing at least one source symbol (so RaptorQ has
    to rebuild it) and holding a few more symbols than k."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        t = rnd.choice([8, 64, 1360, 8960])
        k = rnd.choice([2, 17, 64, 128])
        data = rnd.randbytes(rnd.randint((k - 1) * t + 1, k * t))
        syms = [(esi, bytes(s)) for esi, s in encode_block(data, t, k // 4 + 4)]
        lost = set(rnd.sample(range(k), rnd.randint(1, max(1, k // 8))))
        kept = [x for x in syms if x[0] not in lost]
        rnd.shuffle(kept)
        out.append((data, t, k, kept[: k + 3]))
    return out


def collect(pool: DecoderPool[int], want: int, timeout: float = 20.0) -> dict[int, bytes | None]:
    got: dict[int, bytes | None] = {}
    deadline = time.monotonic() + timeout
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {len(got)} of {want} blocks came back"
        for tag, data, _by_worker in pool.results(0.5):
            assert tag not in got, f"block {tag} came back twice"
            got[tag] = data
    return got


def test_workers_rebuild_the_blocks_that_were_sent_and_a_full_pool_queues() -> None:
    blocks = lossy_blocks(40, seed=7)
    pool: DecoderPool[int] = DecoderPool(2, slots=2)  # 4 slots for 40 blocks: most wait
    try:
        for i, (data, t, k, syms) in enumerate(blocks):
            assert pool.submit(i, syms, k, t, len(data))
        assert pool.pending() == 40
        got = collect(pool, 40)
        assert pool.pending() == 0
        assert pool.worker_blocks == 40 and pool.inline_blocks == 0  # all by the workers
    finally:
        pool.close()
    for i, (data, *_rest) in enumerate(blocks):
        assert got[i] == data, f"block {i}"


def test_too_few_symbols_give_none_and_a_full_queue_or_a_huge_block_is_the_caller_s() -> None:
    (data, t, k, syms), *_ = lossy_blocks(1, seed=3)
    pool: DecoderPool[str] = DecoderPool(1, slots=1, max_queued=1, slot_bytes=64 * 1024)
    try:
        assert pool.submit("short", syms[: k - 1], k, t, len(data))  # the worker refuses it
        assert pool.submit("queued", syms, k, t, len(data))
        assert not pool.submit("no room", syms, k, t, len(data))  # slot busy, queue full
        big = [(i, bytes(70_000)) for i in range(2)]
        assert not pool.submit("huge", big, 2, 70_000, 140_000)  # larger than a slot
        got = collect(pool, 2)
    finally:
        pool.close()
    assert got == {"short": None, "queued": data}
    assert decode_symbols(syms[: k - 1], k, t, len(data)) is None


def test_a_worker_killed_mid_stream_loses_no_block() -> None:
    blocks = lossy_blocks(30, seed=11)
    lost: list[tuple[int, int | None, str, int, int]] = []
    pool: DecoderPool[int] = DecoderPool(
        2, slots=3, on_lost=lambda *a: lost.append(a), slot_bytes=2 << 20
    )
    try:
        victim = pool.pids()[0]
        for i, (data, t, k, syms) in enumerate(blocks):
            if i == 10:
                os.kill(victim, signal.SIGKILL)
            assert pool.submit(i, syms, k, t, len(data))
        got = collect(pool, 30)
        assert len(lost) == 1 and lost[0][0] == victim and lost[0][1] == -signal.SIGKILL
        assert pool.workers == 1 and pool.lost_workers == 1
        assert pool.worker_blocks + pool.inline_blocks == 30
    finally:
        pool.close()
    assert all(got[i] == data for i, (data, *_r) in enumerate(blocks))


def test_no_decoder_worker_outlives_close() -> None:
    pool: DecoderPool[int] = DecoderPool(2)
    procs = [psutil.Process(p) for p in pool.pids()]
    pool.close()
    for p in procs:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def _lossy_object(
    codec: DatagramCodec, oid: int, name: str, seed: int
) -> tuple[bytes, list[bytes]]:
    """A body whose envelope is exactly 6 blocks of k = 16 symbols of T = 256, and its
    datagrams but one source symbol of each block: every block needs RaptorQ."""
    body = os.urandom(6 * K * T - len(envelope_prefix(name)))
    dgs = datagrams(codec, 21, oid, name, body)
    per_block = K + repair_count(K, 0.25, 2)
    assert len(dgs) == 6 * per_block
    rnd = random.Random(seed)
    out = []
    for start in range(0, len(dgs), per_block):
        drop = rnd.randrange(K)  # datagrams() sends a block's sources first, by id
        out += [d for j, d in enumerate(dgs[start : start + per_block]) if j != drop]
    return body, out


@pytest.mark.parametrize("workers", [0, 1])
def test_the_receiver_rebuilds_lossy_blocks_in_its_workers_or_itself(
    tmp_path: Path, workers: int
) -> None:
    names = [f"u1.{i:012d}.dec.dbundle" for i in range(1, 4)]
    bodies = {}
    with receiving(tmp_path, decode_workers=workers) as rx:
        for oid, name in enumerate(names, start=1):
            bodies[name], dgs = _lossy_object(rx.codec, oid, name, seed=oid)
            rx.send(dgs)
        rx.wait(lambda: all((rx.inbox / n).exists() for n in names), "the three files")
        s = rx.finish()
    assert {n: (rx.inbox / n).read_bytes() for n in names} == bodies
    assert s.blocks_decoded_by_workers + s.blocks_decoded_here == 3 * 6  # every block
    assert s.repair_symbols_used == 3 * 6 and s.decode_workers_lost == 0
    if workers:
        assert s.blocks_decoded_by_workers > 0
    else:
        assert s.blocks_decoded_by_workers == 0


@pytest.mark.parametrize(
    ("body", "match"),
    [("raise ImportError('a broken install')", r"decoder worker pid \d+ exited")],
)
def test_a_decoder_worker_that_cannot_start_fails_the_receiver_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, match: str
) -> None:
    from bridge.diode.udp_receiver import run_receiver
    from bridge.errors import ConfigError

    monkeypatch.setenv("PYTHONPATH", shadow_bridge(tmp_path, body))
    cfg = _cfg(tmp_path, free_udp_port(), decode_workers=1)
    with pytest.raises(ConfigError, match=match + r".*set decode_workers = 0"):
        run_receiver(cfg, timeout=5)


# -- the reassembler with a real pool: results that come back too late, or undecodable ----------
def _object(oid: int, blocks: int = 1) -> tuple[ObjectHeader, bytes, list[list[tuple[int, bytes]]]]:
    body = random.Random(oid).randbytes(blocks * K * T)
    h = ObjectHeader(
        oid, ObjectKind.BUNDLE, "u1", oid, len(body), hashlib.sha256(body).digest(), T, K
    )
    syms = []
    for b in range(blocks):
        chunk = body[b * K * T : (b + 1) * K * T]
        syms.append([(esi, bytes(s)) for esi, s in encode_block(chunk, T, 40)])
    return h, body, syms


def _settle(ra: Reassembler) -> None:
    deadline = time.monotonic() + 20
    while ra.decoding():
        assert time.monotonic() < deadline, "decoder results never came back"
        ra.take_decoded(0.1)


@pytest.fixture
def pool() -> Iterator[DecoderPool[Any]]:
    p: DecoderPool[Any] = DecoderPool(1, slots=1, max_queued=8)
    yield p
    p.close()


def test_a_block_the_fast_path_completes_while_a_worker_decodes_it_lands_once(
    tmp_path: Path, pool: DecoderPool[Any]
) -> None:
    ra = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8, decoder=pool)
    h, body, (syms,) = _object(1)
    for esi, s in syms[1 : K + 2]:  # source 0 lost: RaptorQ must rebuild the block
        ra.add(Symbol(1, 0, h, 0, esi, s), 0.0)
    dec = ra.open[(1, 1)].decoders[0]
    assert dec.busy and ra.decoding() == 1, "the block went to the worker"
    ra.add(Symbol(1, 0, h, 0, 0, syms[0][1]), 0.0)  # a resend brings source 0: fast path
    assert len(ra.ready) == 1 and (1, 1) not in ra.open
    _settle(ra)  # the worker's result for a block no longer open is dropped
    assert len(ra.ready) == 1 and (ra.ready[0].path / "data").read_bytes() == body
    assert ra.held == 0 and ra.rebuilt == 0 and ra.rebuilt_by_workers == 0


def test_symbols_raptorq_cannot_decode_yet_go_back_with_the_next_symbol(
    tmp_path: Path, pool: DecoderPool[Any]
) -> None:
    h, body, (syms,) = _object(2)
    by_id = dict(syms)
    bad = [3, 8, 11, 12, 13, 14, 22, 24, 27, 28, 31, 37, 49, 50, 52, 54]  # k ids, no decode
    assert decode_symbols([(e, by_id[e]) for e in bad], K, T, len(body)) is None
    ra = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8, decoder=pool)
    for e in bad:
        ra.add(Symbol(1, 0, h, 0, e, by_id[e]), 0.0)
    _settle(ra)
    assert not ra.ready and ra.open[(1, 2)].decoders[0].tried == K  # tried, not rebuilt
    ra.add(Symbol(1, 0, h, 0, 41, by_id[41]), 0.0)  # one more: tried again, in the worker
    _settle(ra)
    assert len(ra.ready) == 1 and (ra.ready[0].path / "data").read_bytes() == body
    assert ra.rebuilt == ra.rebuilt_by_workers == 1 and ra.held == 0


def test_an_object_given_up_while_its_blocks_wait_for_a_worker_frees_them(
    tmp_path: Path, pool: DecoderPool[Any]
) -> None:
    ra = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8, decoder=pool)
    objects = [_object(10 + i) for i in range(4)]
    for h, _body, (syms,) in objects:
        for esi, s in syms[1 : K + 1]:
            ra.add(Symbol(1, 0, h, 0, esi, s), 0.0)
    assert ra.decoding() == 4  # one in the worker's only slot, three queued
    ra.expire_idle(100.0, 1.0)  # every object times out
    assert ra.decoding() <= 1, "the queued blocks of expired objects were kept"
    _settle(ra)
    assert not ra.ready and not ra.open and ra.held == 0 and ra.expired == 4


def test_answers_that_wait_in_the_pipe_while_the_owner_stalls_keep_their_worker() -> None:
    blocks = lossy_blocks(4, seed=5)
    p: DecoderPool[int] = DecoderPool(2, slots=2, answer_seconds=1.0)
    try:
        for i, (data, t, k, syms) in enumerate(blocks):
            assert p.submit(i, syms, k, t, len(data))
        time.sleep(1.5)  # the owner does not look for longer than answer_seconds
        got = collect(p, 4)
        assert p.lost_workers == 0 and p.workers == 2, "a worker that had answered was killed"
        assert p.worker_blocks == 4
    finally:
        p.close()
    assert all(got[i] == data for i, (data, *_r) in enumerate(blocks))


def test_with_no_worker_left_the_queue_is_decoded_a_few_blocks_a_call() -> None:
    blocks = lossy_blocks(10, seed=9)
    p: DecoderPool[int] = DecoderPool(1, slots=1, slot_bytes=2 << 20)
    try:
        for i, (data, t, k, syms) in enumerate(blocks):
            assert p.submit(i, syms, k, t, len(data))
        os.kill(p.pids()[0], signal.SIGKILL)
        got: dict[int, bytes | None] = {}
        calls = 0
        while len(got) < 10:
            calls += 1
            assert calls < 100
            out = p.results(0.2)
            assert len(out) <= 3, "the whole queue was decoded in one call"
            got.update((tag, data) for tag, data, _w in out)
        assert p.workers == 0 and not p.submit(99, blocks[0][3], blocks[0][2], blocks[0][1], 1)
    finally:
        p.close()
    assert all(got[i] == data for i, (data, *_r) in enumerate(blocks))
