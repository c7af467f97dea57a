"""UDP decoder workers (real processes, real shared memory): the blocks they rebuild are the
blocks that were sent, whatever symbols were lost; blocks beyond the free slots wait in a
bounded queue; a worker lost mid-stream is replaced by the receiver's process without losing
a block; the receiver uses them on a real socket and says so in its summary."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from bridge.demo.udp_link import free_udp_port
from bridge.diode.udp_decode import DecoderPool
from bridge.diode.udp_fec import decode_symbols, encode_block, repair_count
from bridge.diode.udp_sender import envelope_prefix
from bridge.protocol.datagram import DatagramCodec
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
