"""UDP encoder workers (real processes, real shared memory): the repair symbols they make are
the sender's own, in submission order; a worker lost mid-stream is replaced by the sender's
process without losing a block; nothing of them outlives the sender, kill -9 included."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bridge.diode.udp_encode import EncoderPool, slot_bytes_for
from bridge.diode.udp_fec import padded_block, repair_symbols

ROOT = Path(__file__).resolve().parents[2]


def shapes(n: int, seed: int) -> list[tuple[bytes, int, int, int]]:
    """``n`` blocks ``(padded, T, repairs, first repair)`` of mixed sizes and symbol sizes."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        t = rnd.choice([8, 64, 1360, 8960])
        k = rnd.choice([1, 2, 17, 64])
        raw = rnd.randbytes(rnd.randint(1, k * t))
        out.append((padded_block(raw, t), t, rnd.randint(0, 20), rnd.choice([0, 0, 3, 40])))
    return out


def drain(pool: EncoderPool[int]) -> list[tuple[int, list[bytes]]]:
    got = []
    while pool.pending():
        done = pool.next_done(5.0)
        assert done is not None, "an encoder worker did not answer within 5 s"
        got.append((done[0], done[2]))
    return got


def pump(
    pool: EncoderPool[int], blocks: list[tuple[bytes, int, int, int]], kill_at: int = -1
) -> None:
    """Submit every block as the sender does (waiting for room), killing the first worker
    with SIGKILL before block ``kill_at``; every block must come back, in order, exact."""
    victim = pool.pids()[0]
    got: list[tuple[int, list[bytes]]] = []
    for i, (padded, t, n, first) in enumerate(blocks):
        if i == kill_at:
            os.kill(victim, signal.SIGKILL)
        while not pool.room():
            done = pool.next_done(5.0)
            assert done is not None
            got.append((done[0], done[2]))
        pool.submit(i, padded, t, n, first)
    got += drain(pool)
    assert [i for i, _ in got] == list(range(len(blocks)))
    for i, reps in got:
        padded, t, n, first = blocks[i]
        assert reps == repair_symbols(padded, t, n, first), f"block {i}"


def test_workers_give_the_sender_s_own_repair_symbols_in_submission_order() -> None:
    pool: EncoderPool[int] = EncoderPool(2, slot_bytes_for(64, 20, 8960), slots=2)
    try:
        assert pool.workers == 2
        pump(pool, shapes(60, seed=1))
        assert pool.inline_blocks == 0 and pool.lost_workers == 0
    finally:
        pool.close()


def test_a_block_larger_than_a_slot_is_encoded_here() -> None:
    pool: EncoderPool[int] = EncoderPool(1, slot_bytes_for(2, 1, 64), slots=1)
    try:
        big = padded_block(os.urandom(1360 * 8), 1360)
        pool.submit(7, big, 1360, 3, 0)
        assert drain(pool) == [(7, repair_symbols(big, 1360, 3, 0))]
        assert pool.inline_blocks == 1
    finally:
        pool.close()


def test_a_worker_killed_mid_stream_loses_no_block_and_is_reported() -> None:
    lost: list[tuple[int, int | None, str, int, int]] = []
    blocks = shapes(40, seed=2)
    pool: EncoderPool[int] = EncoderPool(
        2, slot_bytes_for(64, 20, 8960), slots=2, on_lost=lambda *a: lost.append(a)
    )
    try:
        victim = pool.pids()[0]
        pump(pool, blocks, kill_at=10)
        assert len(lost) == 1 and lost[0][0] == victim and lost[0][1] == -signal.SIGKILL
        assert lost[0][4] == 1 and pool.workers == 1 and pool.lost_workers == 1
        # the last worker gone too: the sender's process encodes from then on
        os.kill(pool.pids()[0], signal.SIGKILL)
        padded, t, n, first = blocks[0]
        for _ in range(3):
            pool.submit(0, padded, t, n, first)
            assert drain(pool) == [(0, repair_symbols(padded, t, n, first))]
        assert pool.workers == 0 and pool.lost_workers == 2
    finally:
        pool.close()


def test_a_worker_that_stops_answering_is_killed_and_its_blocks_encoded_here() -> None:
    lost: list[tuple[int, int | None, str, int, int]] = []
    pool: EncoderPool[int] = EncoderPool(
        1, slot_bytes_for(64, 20, 1360), slots=2, on_lost=lambda *a: lost.append(a),
        answer_seconds=0.5,
    )  # fmt: skip
    try:
        victim = pool.pids()[0]
        os.kill(victim, signal.SIGSTOP)  # alive, holding its pipe open, never answering
        padded, t, n, first = shapes(1, seed=3)[0]
        pool.submit(5, padded, t, n, first)
        t0 = time.monotonic()
        assert drain(pool) == [(5, repair_symbols(padded, t, n, first))]
        assert 0.5 <= time.monotonic() - t0 < 5
        assert len(lost) == 1 and lost[0][0] == victim and "no answer" in lost[0][2]
        assert lost[0][1] == -signal.SIGKILL and pool.workers == 0
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"
    finally:
        pool.close()


def shadow_bridge(root: Path, body: str) -> str:
    """A PYTHONPATH under which ``import bridge`` runs ``body`` (a broken or hung install)."""
    (root / "bridge").mkdir()
    (root / "bridge" / "__init__.py").write_text(body)
    return str(root)


def own_workers() -> list[psutil.Process]:
    return [c for c in psutil.Process().children() if "udp_encode" in " ".join(c.cmdline())]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("raise ImportError('a broken install')", r"exited \(code 1\) while starting"),
        ("import time; time.sleep(60)", r"was not ready within 1 s"),
    ],
)
def test_a_worker_that_cannot_start_fails_the_pool_at_once_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, match: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", shadow_bridge(tmp_path, body))
    t0 = time.monotonic()
    with pytest.raises(OSError, match=r"encoder worker pid \d+ " + match):
        EncoderPool(2, slot_bytes_for(16, 4, 1360), start_seconds=1)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while any(p.status() != psutil.STATUS_ZOMBIE for p in own_workers()):
        assert time.monotonic() < deadline, "a worker outlived the failed start"
        time.sleep(0.05)


_OWNER = """
import sys, time
from bridge.diode.udp_encode import EncoderPool, slot_bytes_for
pool = EncoderPool(2, slot_bytes_for(16, 4, 1360))
print(*pool.pids(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["close", "kill -9"])
def test_no_worker_outlives_its_sender(how: str) -> None:
    if how == "close":
        pool: EncoderPool[int] = EncoderPool(2, slot_bytes_for(16, 4, 1360))
        procs = [psutil.Process(p) for p in pool.pids()]
        pool.close()
    else:
        owner = subprocess.Popen(
            [sys.executable, "-c", _OWNER], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert owner.stdout is not None
        procs = [psutil.Process(int(p)) for p in owner.stdout.readline().split()]
        assert len(procs) == 2
        owner.kill()
        owner.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs):
        assert time.monotonic() < deadline, f"encoder workers outlived their owner ({how})"
        time.sleep(0.05)


def _own_fds_and_slots() -> tuple[int, int]:
    """Open descriptors of this process, and its mappings of encoder slot memfds."""
    maps = Path("/proc/self/maps").read_text().count("memfd:diode-udp-encode")
    return len(os.listdir("/proc/self/fd")), maps


def test_a_worker_that_cannot_be_spawned_leaves_no_pipe_or_slot_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.diode.udp_encode as encode_module

    missing = str(tmp_path / "no-such-python")
    monkeypatch.setattr(encode_module.sys, "executable", missing)
    before = _own_fds_and_slots()
    for _ in range(3):
        with pytest.raises(OSError) as err:
            EncoderPool(1, slot_bytes_for(16, 4, 1360))
        assert missing in str(err.value)  # the spawn itself failed (the fault fired)
    assert _own_fds_and_slots() == before
