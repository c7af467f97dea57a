"""UDP receiver on a real socket: ``udp.receive.max_held_bytes`` caps what the decoders hold, at
run time and when a restart reopens the spool (the objects idle longest are evicted as gaps);
a cap below the floor is refused at load; a cap below what the configured sender's
interleaving keeps in flight is warned about at start."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bridge.config import UDP_MIN_HELD_BYTES, Config, config_from_dict
from bridge.demo.udp_link import free_udp_port
from bridge.diode import udp_receiver
from bridge.diode.link_status import read_gap_records
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.diode.udp_receiver import ReceiveSummary, run_receiver
from bridge.diode.udp_sender import envelope_prefix
from bridge.errors import ConfigError
from bridge.protocol.datagram import DatagramCodec
from tests.integration.test_udp_receive import datagrams

T, K, BLOCKS = 32 * 1024, 16, 8
"""Objects of 8 blocks of 16 symbols of 32 KiB (512 KiB a block, 4 MiB an object)."""
EPOCH = 77
HELD_PER_OBJECT = BLOCKS * ((K - 1) * (T + 128) + 512)
"""What the receiver counts held for an object of which every block lacks one source symbol
(udp_spool's ``held``: each symbol's payload and ~128 bytes of bookkeeping, each decoder's
512): ~3.9 MB."""


def _config(tmp: Path, port: int, *, mtu: int = 1500, **receive: Any) -> Config:
    data = {
        "channels": [{"name": "u1", "encrypt": False, "transport": "udp"}],
        "red": {"inbox": "red/inbox"},
        "udp": {
            "key_file": "udp.key",
            "mtu": mtu,
            "receive": {"bind": f"127.0.0.1:{port}", "expire_seconds": 600.0, **receive},
        },
    }
    return config_from_dict(data, base=tmp, environ={})


@contextmanager
def _receiver(cfg: Config) -> Iterator[Callable[[], ReceiveSummary]]:
    """A receiver in a thread until the block ends; yields what stops it and returns its
    summary."""
    stop, ready, result = threading.Event(), threading.Event(), []
    th = threading.Thread(
        target=lambda: result.append(run_receiver(cfg, stop=stop, ready=lambda _: ready.set())),
        daemon=True,
    )
    th.start()

    def finish() -> ReceiveSummary:
        stop.set()
        th.join(timeout=60)
        assert not th.is_alive(), "the receiver did not stop"
        return result[0]

    try:
        assert ready.wait(30), "the receiver did not start"
        yield finish
    finally:
        stop.set()
        th.join(timeout=60)


def _partial_objects(codec: DatagramCodec, oids: range) -> list[list[bytes]]:
    """Per object: the source symbols of every block but its first one, no repair symbol:
    never complete, each holds ``HELD_PER_OBJECT`` in the decoders."""
    out = []
    for oid in oids:
        name = f"u1.{oid + 1:012d}.0123456789abcdef0123456789abcdef.dbundle"
        body = os.urandom(BLOCKS * K * T - len(envelope_prefix(name)))
        dg = datagrams(codec, EPOCH, oid, name, body, repair=0, t=T, k=K)
        n = len(dg) // BLOCKS  # K source symbols, then the (at least 2) repair symbols
        assert n * BLOCKS == len(dg) and n > K
        out.append([d for i, d in enumerate(dg) if 0 < i % n < K])  # no esi 0, no repair
    return out


def _send(sock: socket.socket, port: int, items: list[bytes]) -> None:
    for i, d in enumerate(items):
        sock.sendto(d, ("127.0.0.1", port))
        if not i % 8:
            time.sleep(0.002)  # ~128 MB/s at most: well below what the receiver takes


def _wait_spooled(spool: Path, oid: int, gone_ok: bool = False) -> None:
    """Until every symbol sent of object ``oid`` is in its ``symbols.log`` (flushed every 0.2 s),
    or, with ``gone_ok``, the object has a gap record."""
    log = spool / "objects" / f"{EPOCH:020d}-{oid:020d}" / "symbols.log"
    want = BLOCKS * (K - 1) * (8 + T)
    deadline = time.monotonic() + 30
    while not (log.exists() and log.stat().st_size == want):
        if gone_ok and any(r.get("object_id") == oid for r in read_gap_records(spool)):
            return
        assert time.monotonic() < deadline, f"object {oid} not spooled: {log}"
        time.sleep(0.05)


def _status(spool: Path, datagrams: int) -> dict[str, Any]:
    """The receiver's status file once it counts ``datagrams`` (written every second)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            doc: dict[str, Any] = json.loads((spool / "status.json").read_text())
        except (OSError, ValueError):
            doc = {}
        if doc.get("datagrams", 0) >= datagrams:
            return doc
        assert time.monotonic() < deadline, f"status never counted {datagrams}: {doc}"
        time.sleep(0.1)


def test_the_receiver_holds_no_more_than_max_held_bytes_at_run_time_and_at_restart(
    tmp_path: Path,
) -> None:
    """12 objects that never complete (~3.9 MB held each) spool under the default cap; the
    receiver restarted with max_held_bytes = 32 MiB (8 of them fit) reopens the spool and evicts
    the 4 idle longest as `evicted` gaps; 2 more objects at run time evict the next 2. Before
    the key was passed through, the cap stayed 512 MiB: nothing was evicted."""
    generate_key_file(tmp_path / "udp.key")
    codec = DatagramCodec(load_key(tmp_path / "udp.key"))
    port = free_udp_port()
    spool = tmp_path / "red" / "udp-spool"
    objects = _partial_objects(codec, range(14))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with _receiver(_config(tmp_path, port)) as finish:  # the default cap: 512 MiB
            for oid in range(12):
                _send(sock, port, objects[oid])
                _wait_spooled(spool, oid)
            first = finish()
        assert first.socket_overflows == 0 and first.datagrams == 12 * len(objects[0])
        assert read_gap_records(spool) == [] and len(list((spool / "objects").iterdir())) == 12

        cap = UDP_MIN_HELD_BYTES
        assert 8 * HELD_PER_OBJECT <= cap < 9 * HELD_PER_OBJECT
        with _receiver(_config(tmp_path, port, max_held_bytes=cap)) as finish:
            evicted = [r["object_id"] for r in read_gap_records(spool)]
            assert evicted == [0, 1, 2, 3], "the restart kept more than the cap holds"
            for oid in (12, 13):
                _send(sock, port, objects[oid])
                _wait_spooled(spool, oid, gone_ok=True)
            doc = _status(spool, 2 * len(objects[0]))
            assert doc["max_held_bytes"] == cap and doc["held_bytes"] <= cap
            assert doc["open_objects"] == 8
            second = finish()
    finally:
        sock.close()
    assert second.socket_overflows == 0
    records = read_gap_records(spool)
    assert [(r["object_id"], r["reason"]) for r in records] == [
        (oid, "evicted") for oid in range(6)
    ]
    assert all(r["blocks_done"] == 0 and r["symbols_received"] == 120 for r in records)
    assert second.objects_expired == 6
    kept = sorted(int(p.name.split("-")[1]) for p in (spool / "objects").iterdir())
    assert kept == list(range(6, 14))


def test_a_cap_below_the_floor_is_refused_with_the_key_and_the_least_value(
    tmp_path: Path,
) -> None:
    generate_key_file(tmp_path / "udp.key")
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, 47999, max_held_bytes=UDP_MIN_HELD_BYTES - 1)
    msg = str(e.value)
    assert "udp.receive.max_held_bytes" in msg and str(UDP_MIN_HELD_BYTES) in msg, msg
    assert "evicts itself" in msg, msg
    cfg = _config(tmp_path, 47999, max_held_bytes=UDP_MIN_HELD_BYTES)
    assert cfg.udp is not None and cfg.udp.receive.max_held_bytes == UDP_MIN_HELD_BYTES
    default = _config(tmp_path, 47999)
    assert default.udp is not None and default.udp.receive.max_held_bytes == 512 << 20


def test_a_cap_below_the_senders_interleaving_is_warned_about_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Jumbo frames with the default interleaving keep ~76 MB in flight: a 32 MiB cap would
    evict objects still arriving. The receiver warns at start and names the fix; the default
    MTU with the same cap does not warn."""
    generate_key_file(tmp_path / "udp.key")
    jumbo = _config(tmp_path, free_udp_port(), mtu=9000, max_held_bytes=UDP_MIN_HELD_BYTES)
    plain = _config(tmp_path, free_udp_port(), max_held_bytes=UDP_MIN_HELD_BYTES)
    assert jumbo.udp is not None and plain.udp is not None
    in_flight = udp_receiver.in_flight_bytes
    assert in_flight(plain.udp) < UDP_MIN_HELD_BYTES < in_flight(jumbo.udp)
    with caplog.at_level("WARNING", logger="bridge.diode.udp_receiver"):
        run_receiver(plain, timeout=0.2)
        assert not [r for r in caplog.records if "max_held_bytes" in r.getMessage()]
        run_receiver(jumbo, timeout=0.2)
    (warned,) = [r for r in caplog.records if "max_held_bytes" in r.getMessage()]
    assert warned.__dict__["in_flight_bytes"] == in_flight(jumbo.udp)
    assert warned.__dict__["max_held_bytes"] == UDP_MIN_HELD_BYTES
    fix = warned.__dict__["fix"]
    assert f">= {in_flight(jumbo.udp)}" in fix and "interleave_datagrams" in fix, fix
