"""UDP receiver (red), fuzz: a real `diode udp receive` process on a loopback socket takes at
least 100k random and mutated datagrams (``DIODE_FUZZ_DATAGRAMS`` for more) mixed with a real
file transfer: it keeps running, counts every datagram it read as taken or dropped by reason,
delivers the real files byte-identical and nothing else, and its memory stays bounded."""

from __future__ import annotations

import os
import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from bridge.demo.udp_link import free_udp_port
from bridge.diode.link_status import read_gap_records, read_json
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.protocol.datagram import MAGIC, TAG_LEN, VERSION, DatagramCodec, derive_key
from tests.integration.test_udp_receive import RxProc, datagrams, receiver_config

N = int(os.environ.get("DIODE_FUZZ_DATAGRAMS", "100000"))
EPOCH = 1 << 40
"""The real transfer's sender epoch."""
MAX_RSS_GROWTH = 64 << 20
"""The receiver's RSS may grow this much over the run (allocator arenas, caches): a receiver
that kept anything per hostile datagram would grow by far more (100k x ~1.4 KB = 140 MB)."""


def _socket_queue(port: int) -> tuple[int, int]:
    """Bytes waiting in the receive queue of the UDP socket bound to 127.0.0.1:``port``, and
    the datagrams the kernel dropped on it (``/proc/net/udp``)."""
    local = f"0100007F:{port:04X}"
    for line in Path("/proc/net/udp").read_text().splitlines()[1:]:
        f = line.split()
        if f[1] == local:
            return int(f[4].split(":")[1], 16), int(f[-1])
    raise AssertionError(f"no UDP socket on 127.0.0.1:{port}")


def _retag(aead: AESGCM, body: bytes) -> bytes:
    """Seal ``body`` (header and payload, no tag) with the link's key, whatever it says: what an
    insider holding the key could send."""
    return body + aead.encrypt(body[4:20], b"", body)


def _mutators(
    rng: random.Random, valid: list[bytes], aead: AESGCM
) -> dict[str, Callable[[], bytes]]:
    def pick() -> bytes:
        return valid[rng.randrange(len(valid))]

    def random_bytes() -> bytes:
        return rng.randbytes(rng.randrange(0, 1500))

    def our_magic() -> bytes:  # passes the magic and version checks, not the tag
        return MAGIC + bytes([VERSION, rng.choice((1, 2, 3))]) + rng.randbytes(rng.randrange(1400))

    def bit_flip() -> bytes:
        d = bytearray(pick())
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(d))
            d[i] ^= 1 << rng.randrange(8)
        return bytes(d)

    def truncated() -> bytes:
        d = pick()
        return d[: rng.randrange(len(d))]

    def extended() -> bytes:
        return pick() + rng.randbytes(rng.randrange(1, 64))

    def spliced() -> bytes:  # one datagram's header on another's payload and tag
        a, b = pick(), pick()
        cut = rng.randrange(20, 120)
        return a[:cut] + b[cut:]

    def authenticated_lie() -> bytes:  # a valid tag over header fields that are garbage
        # under an older epoch than the real transfer's: the key holder who sends a lie under
        # a live object's own id takes that object (first header wins; covered elsewhere)
        d = bytearray(pick()[:-TAG_LEN])
        d[4:12] = rng.randrange(1, EPOCH).to_bytes(8, "big")
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(20, len(d))
            d[i] = rng.randrange(256)
        return _retag(aead, bytes(d))

    def authenticated_heartbeat() -> bytes:
        epoch = rng.randrange(1, EPOCH)
        head = MAGIC + bytes([VERSION, 2]) + epoch.to_bytes(8, "big")
        head += rng.randrange(1 << 64).to_bytes(8, "big")
        junk = rng.choice((b"{}", b"[1,2]", b'{"channels": 5}', rng.randbytes(rng.randrange(600))))
        return _retag(aead, head + junk)

    def replayed() -> bytes:
        return pick()

    return {
        "random": random_bytes,
        "magic": our_magic,
        "bit_flip": bit_flip,
        "truncated": truncated,
        "extended": extended,
        "spliced": spliced,
        "authenticated_lie": authenticated_lie,
        "authenticated_heartbeat": authenticated_heartbeat,
        "replayed": replayed,
    }


def test_a_fuzz_run_leaves_the_receiver_running_counting_and_bounded(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("DIODE_FUZZ_SEED", "20261125")))
    port = free_udp_port()
    generate_key_file(tmp_path / "udp.key")
    key = load_key(tmp_path / "udp.key")
    codec, aead = DatagramCodec(key), AESGCM(derive_key(key))
    files = {
        f"u1.{i:012d}.0123456789abcdef0123456789abcdef.dbundle": rng.randbytes(size)
        for i, size in enumerate((0, 1, 5_000, 120_000, 400_000), start=1)
    }
    real: list[bytes] = []
    for oid, (name, body) in enumerate(files.items(), start=1):
        real += datagrams(codec, EPOCH, oid, name, body, repair=0.5, t=1024, k=32)
    mutate = _mutators(rng, real, aead)
    kinds = list(mutate)

    inbox, spool = tmp_path / "red" / "inbox", tmp_path / "red" / "udp-spool"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    cfg = receiver_config(tmp_path, port, expire_seconds=5.0, max_open_objects=64,
                          max_object_bytes=4_194_304)  # fmt: skip
    rx = RxProc(cfg, tmp_path / "rx.log")
    proc = psutil.Process(rx.proc.pid)
    try:
        rss0 = proc.memory_info().rss
        sent: Counter[str] = Counter()
        peak = rss0
        # first the fuzz alone (authenticated lies included: they open and expire objects of
        # their own), then the real transfer mixed with as much unauthenticated garbage
        fuzz = [rng.choice(kinds) for _ in range(N)]
        garbage = [k for k in kinds if not k.startswith("authenticated")]
        mixed = [("real", d) for d in real] + [(rng.choice(garbage), b"") for _ in real]
        rng.shuffle(mixed)
        order = [(k, b"") for k in fuzz] + mixed
        for i, (kind, d) in enumerate(order):
            sock.sendto(d if kind == "real" else mutate[kind](), ("127.0.0.1", port))
            sent[kind] += 1
            if i % 250 == 249:
                while _socket_queue(port)[0] > 2 << 20:  # let the receiver catch up
                    time.sleep(0.002)
            if i % 20_000 == 19_999:
                assert rx.proc.poll() is None, rx.log.read_text()[-3000:]
                peak = max(peak, proc.memory_info().rss)
        deadline = time.monotonic() + 60
        while sorted(p.name for p in inbox.glob("*")) != sorted(files):
            assert rx.proc.poll() is None, rx.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the real files did not all arrive"
            time.sleep(0.1)
        status = spool / "status.json"
        deadline = time.monotonic() + 30
        while (read_json(status) or {}).get("datagrams", 0) < len(order):
            assert time.monotonic() < deadline, (read_json(status), len(order))
            time.sleep(0.2)
        peak = max(peak, proc.memory_info().rss)
        kernel_drops = _socket_queue(port)[1]
        summary = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()

    assert sum(sent.values()) == len(order) >= N
    assert kernel_drops == 0 and summary["datagrams"] == len(order)  # each one was read
    dropped = summary["dropped"]
    # nothing unauthenticated gets past the tag; every kind of fault was sent and counted
    unauthenticated = ("short", "magic", "version", "type", "tag")
    assert sum(dropped.get(r, 0) for r in unauthenticated) >= (
        sent["random"] + sent["magic"] + sent["bit_flip"] + sent["truncated"]
        + sent["extended"] + sent["spliced"]
    ) * 0.99  # fmt: skip
    assert dropped["malformed"] > 0 and min(sent.values()) > 0
    # the real files, byte-identical, and nothing else; lies became gaps, never files
    assert {p.name: p.read_bytes() for p in inbox.iterdir()} == files
    assert all(g["reason"] for g in read_gap_records(spool))
    assert peak - rss0 < MAX_RSS_GROWTH, (rss0, peak)
