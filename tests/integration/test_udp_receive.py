"""UDP receiver on a real socket: hostile datagrams are counted and dropped, objects that lie
about their digest or name become gaps, clashes never overwrite, the spool survives a restart
(in process, and a receiver process killed -9 mid-object), heartbeats and epochs reach the
status file."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, config_from_dict
from bridge.demo.udp_link import free_udp_port, stop_process
from bridge.diode.link_status import read_gap_records, read_json
from bridge.diode.udp_batch import DatagramBatcher
from bridge.diode.udp_fec import block_count, block_plan, encode_block, repair_count
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.diode.udp_receiver import AUTH_WARN_MIN, ReceiveSummary, run_receiver
from bridge.diode.udp_sender import envelope_prefix
from bridge.diode.udp_spool import Reassembler
from bridge.faults import SLOW_ENV
from bridge.metrics import REGISTRY, UDP
from bridge.protocol.datagram import DatagramCodec, LinkHeartbeat, ObjectHeader, ObjectKind
from tests.support import crash_env, crash_marks, json_lines, small_tmpfs

T = 256
K = 16
REPO = Path(__file__).resolve().parents[2]


def datagrams(
    codec: DatagramCodec,
    epoch: int,
    oid: int,
    name: str,
    body: bytes,
    *,
    repair: float = 0.25,
    digest: bytes | None = None,
    length: int | None = None,
    t: int = T,
    k: int = K,
    round_robin: bool = False,
) -> list[bytes]:
    """Every symbol of one object, block after block (or esi by esi across blocks)."""
    env = envelope_prefix(name) + body if not name.startswith("raw:") else body
    h = ObjectHeader(
        oid, ObjectKind.BUNDLE, "u1", oid + 1, length if length is not None else len(env),
        digest or hashlib.sha256(env).digest(), t, k,
    )  # fmt: skip
    sealer = codec.symbol_sealer(epoch, h)
    syms = []
    for b in range(block_count(len(env), t, k)):
        p = block_plan(len(env), t, k, b)
        for esi, sym in encode_block(env[p.offset : p.offset + p.length], t,
                                     repair_count(p.k, repair, 2)):  # fmt: skip
            syms.append((b, esi, sym))
    if round_robin:
        syms.sort(key=lambda x: (x[1], x[0]))
    packet = oid * 1_000_000
    return [sealer.seal(packet + i, b, esi, sym) for i, (b, esi, sym) in enumerate(syms)]


@dataclass
class Rx:
    cfg: Config
    addr: tuple[str, int]
    codec: DatagramCodec
    sock: socket.socket
    stop: threading.Event
    thread: threading.Thread
    result: list[ReceiveSummary]

    @property
    def inbox(self) -> Path:
        return Path(self.cfg.red.inbox)

    @property
    def spool(self) -> Path:
        return Path(self.cfg.udp.receive.spool_dir)  # type: ignore[union-attr]

    def send(self, items: list[bytes]) -> None:
        for d in items:
            self.sock.sendto(d, self.addr)
            time.sleep(0)  # let the receiver keep up (no pacing needed for a few hundred)

    def wait(self, cond: Any, what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.thread.is_alive(), "receiver thread died"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def finish(self) -> ReceiveSummary:
        self.stop.set()
        self.thread.join(timeout=30)
        return self.result[0]


def _cfg(tmp: Path, port: int, **recv: Any) -> Config:
    generate_key_file(tmp / "udp.key", force=True)
    data = {
        "channels": [{"name": "u1", "encrypt": False, "transport": "udp"}],
        "red": {"inbox": "red/inbox"},
        "udp": {
            "key_file": "udp.key",
            "receive": {"bind": f"127.0.0.1:{port}", "expire_seconds": 1.0, **recv},
        },
    }
    return config_from_dict(data, base=tmp, environ={})


@contextmanager
def receiving(tmp: Path, **recv: Any) -> Iterator[Rx]:
    """A receiver in a thread on a free loopback port, and a socket to send to it."""
    port = free_udp_port()
    cfg = _cfg(tmp, port, **recv)
    stop, ready, result = threading.Event(), threading.Event(), []
    th = threading.Thread(
        target=lambda: result.append(run_receiver(cfg, stop=stop, ready=lambda _: ready.set())),
        daemon=True,
    )
    th.start()
    assert ready.wait(20)
    codec = DatagramCodec(load_key(tmp / "udp.key"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        yield Rx(cfg, ("127.0.0.1", port), codec, sock, stop, th, result)
    finally:
        stop.set()
        th.join(timeout=30)
        sock.close()


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Rx]:
    with receiving(tmp_path, max_object_bytes=1 << 20) as r:
        yield r


def test_hostile_datagrams_are_counted_and_nothing_bad_is_delivered(rx: Rx) -> None:
    good = datagrams(rx.codec, 5, 1, "u1.000000000002.ok.dbundle", os.urandom(10_000))
    foreign = datagrams(DatagramCodec(os.urandom(32)), 5, 2, "u1.x.dbundle", b"evil" * 100)
    flipped = bytearray(good[3])
    flipped[200] ^= 0x10
    rx.send([b"", b"\xd1", os.urandom(600), good[0][:50], bytes(flipped), *foreign, *good])
    rx.wait(lambda: (rx.inbox / "u1.000000000002.ok.dbundle").exists(), "the good file")
    s = rx.finish()
    assert s.dropped["short"] == 2  # b"" and one byte
    assert s.dropped["magic"] == 1
    assert s.dropped["tag"] == len(foreign) + 2  # + the truncated and the flipped symbol
    assert sorted(p.name for p in rx.inbox.iterdir()) == ["u1.000000000002.ok.dbundle"]
    assert s.objects_completed == 1
    assert s.socket_overflows == 0  # the kernel tells (/proc/net/udp), and dropped none here


def test_lying_objects_become_gaps_never_files(rx: Rx) -> None:
    body = os.urandom(5000)
    rx.send(datagrams(rx.codec, 7, 1, "u1.a.dbundle", body, digest=b"\x00" * 32))
    rx.send(datagrams(rx.codec, 7, 2, "../../etc/passwd", b"root::0:0"))
    rx.send(datagrams(rx.codec, 7, 3, ".hidden", b"x"))
    rx.send(datagrams(rx.codec, 7, 4, "raw:", b"\xff\xff" + b"no name"))
    rx.send(datagrams(rx.codec, 7, 5, "u1.big.dbundle", b"x", length=2 << 20)[:3])
    rx.wait(lambda: len(read_gap_records(rx.spool)) >= 5, "five gap records")
    s = rx.finish()
    reasons = sorted(g["reason"] for g in read_gap_records(rx.spool))
    assert reasons == ["bad_name", "bad_name", "bad_name", "digest_mismatch", "too_large"]
    assert list(rx.inbox.iterdir()) == []
    assert s.dropped.get("too_large") == 3
    assert not list((rx.spool / "objects").iterdir())


def test_clashing_names_are_never_overwritten(rx: Rx) -> None:
    name = "u1.000000000009.clash.dbundle"
    first, other = os.urandom(3000), os.urandom(3000)
    rx.send(datagrams(rx.codec, 9, 1, name, first))
    rx.wait(lambda: (rx.inbox / name).exists(), "first copy")
    rx.send(datagrams(rx.codec, 9, 2, name, first))  # same bytes again: a duplicate
    rx.send(datagrams(rx.codec, 9, 3, name, other))  # other bytes under that name
    rx.wait(lambda: len(list(rx.inbox.iterdir())) == 2, "the clashing copy")
    s = rx.finish()
    assert (rx.inbox / name).read_bytes() == first
    assert (rx.inbox / f"{name}~9.3").read_bytes() == other
    assert s.duplicate_objects == 1


def test_incomplete_objects_expire_as_gaps_and_late_symbols_are_counted(rx: Rx) -> None:
    dg = datagrams(rx.codec, 11, 1, "u1.000000000004.late.dbundle", os.urandom(20_000), repair=0)
    rx.send(dg[: len(dg) // 2])
    rx.wait(lambda: read_gap_records(rx.spool), "the timeout gap", timeout=10)
    done = datagrams(rx.codec, 11, 2, "u1.000000000005.done.dbundle", os.urandom(900))
    rx.send(done)
    rx.wait(lambda: (rx.inbox / "u1.000000000005.done.dbundle").exists(), "second file")
    rx.send(done[:2])  # stragglers of a delivered object
    time.sleep(0.5)
    s = rx.finish()
    (gap,) = read_gap_records(rx.spool)
    assert (
        gap["reason"] == "timeout" and gap["seq"] == 2 and gap["blocks_done"] < gap["blocks_total"]
    )
    assert s.dropped.get("late") == 4  # 2 repair symbols after completion + 2 stragglers


def test_spool_rebuilds_an_object_after_the_process_is_gone(tmp_path: Path) -> None:
    key = os.urandom(32)
    codec = DatagramCodec(key)
    body = os.urandom(100_000)
    dg = [codec.open(d) for d in datagrams(codec, 3, 1, "u1.000000000001.r.dbundle", body)]
    ra = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8)
    half = len(dg) // 2
    for sym in dg[:half]:
        ra.add(sym, 1.0)  # type: ignore[arg-type]
    ra.flush_all()
    spooled = list((tmp_path / "objects").iterdir())
    assert len(spooled) == 1 and (spooled[0] / "symbols.log").stat().st_size > 0
    del ra  # as after kill -9: nothing but the spool is left
    ra2 = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8)
    assert ra2.recover(2.0) == 1
    assert not ra2.ready
    for sym in dg[half:]:
        ra2.add(sym, 3.0)  # type: ignore[arg-type]
    (d,) = ra2.ready
    assert (d.path / "data").read_bytes() == envelope_prefix("u1.000000000001.r.dbundle") + body


def test_sender_copies_and_journal_and_pace(rx: Rx, tmp_path: Path) -> None:
    from bridge.diode.udp_sender import JOURNAL, Journal, run_sender

    data = {
        "channels": [
            {"name": "u1", "encrypt": False, "transport": "udp"},
            {"name": "f1", "encrypt": False, "transport": "file"},
        ],
        "black": {"outbox": "black/outbox"},
        "udp": {
            "key_file": "udp.key",
            "mtu": 1500,
            "send": {
                "destination": f"127.0.0.1:{rx.addr[1]}",
                "copies": 2,
                "rate_bytes_per_second": 20_000_000,
                "heartbeat_seconds": 0.2,
            },
        },
    }
    cfg = config_from_dict(data, base=tmp_path, environ={})
    outbox = Path(cfg.black.outbox)
    outbox.mkdir(parents=True)
    before = _udp_metrics()
    body = os.urandom(700_000)
    name = "u1.000000000003.0123456789abcdef0123456789abcdef.dbundle"
    (outbox / name).write_bytes(body)
    (outbox / "f1.000000000001.0123456789abcdef0123456789abcdef.dbundle").write_bytes(b"file")
    (outbox / "notes.txt").write_bytes(b"not a wire name: left alone")
    summary = run_sender(cfg, until_idle=True, timeout=60)
    assert summary.files == [name] and summary.heartbeats >= 2
    rx.wait(lambda: (rx.inbox / name).exists(), "the file")
    time.sleep(0.5)  # the second copy arrives after the first was delivered
    s = rx.finish()
    assert (rx.inbox / name).read_bytes() == body
    assert s.objects_completed == 1 and s.dropped.get("late", 0) > 0  # copy 2: late, not twice
    assert sorted(p.name for p in outbox.iterdir()) == [
        "f1.000000000001.0123456789abcdef0123456789abcdef.dbundle",
        "notes.txt",
    ]
    state = Path(cfg.udp.send.state_dir)  # type: ignore[union-attr]
    assert Journal(state).last[name]["state"] == "sent"
    assert (state / JOURNAL).read_text().count('"sending"') == 1
    # about 2 x (700 KB + repair) at 20 MB/s (after a 256 KB burst): the pace was applied
    assert summary.seconds >= (summary.bytes - 262_144) / 20_000_000 * 0.9
    assert s.heartbeats >= 2
    # the same counts reach Prometheus (sender and receiver share this process's registry)
    got = {k: v - before.get(k, 0.0) for k, v in _udp_metrics().items()}
    sent = got["datagrams_sent_total/source"] + got["datagrams_sent_total/repair"]
    assert sent == summary.datagrams and got["datagrams_sent_total/repair"] > 0
    assert got["datagrams_sent_total/heartbeat"] == summary.heartbeats
    assert got["objects_sent_total/u1"] == 1 and got["bytes_sent_total"] == summary.bytes
    assert got["datagrams_received_total"] == s.datagrams
    assert got["datagrams_dropped_total/late"] == s.dropped["late"]
    assert got["objects_completed_total/u1"] == 1
    assert got["goodput_bytes_total"] == len(body)
    assert got["repair_symbols_used_total"] == s.repair_symbols_used
    assert 0 <= _udp_metrics()["heartbeat_age_seconds"] < 5


def _udp_metrics() -> dict[str, float]:
    """Every bridge_udp_* sample of this process, keyed "name/label values"."""
    out: dict[str, float] = {}
    for fam in REGISTRY.collect():
        for smp in fam.samples:
            if smp.name.startswith("bridge_udp_") and not smp.name.endswith("_created"):
                key = "/".join([smp.name.removeprefix("bridge_udp_"), *smp.labels.values()])
                out[key] = smp.value
    return out


def test_a_resend_under_a_new_epoch_supersedes_the_old_partial_object(tmp_path: Path) -> None:
    codec = DatagramCodec(os.urandom(32))
    body = os.urandom(30_000)
    name = "u1.000000000001.s.dbundle"
    old = [codec.open(d) for d in datagrams(codec, 1, 7, name, body)]
    new = [codec.open(d) for d in datagrams(codec, 2, 0, name, body)]
    ra = Reassembler(tmp_path, max_object_bytes=1 << 30, max_open_objects=8)
    for sym in old[:5]:
        ra.add(sym, 1.0)  # type: ignore[arg-type]
    assert list(ra.open) == [(1, 7)]
    for sym in new:
        ra.add(sym, 2.0)  # type: ignore[arg-type]
    assert not ra.open and [d.epoch for d in ra.ready] == [2]
    assert read_gap_records(tmp_path) == []  # superseded, not a gap
    assert [p.name for p in (tmp_path / "objects").iterdir()] == [ra.ready[0].path.name]


def test_heartbeats_and_epochs_reach_the_status_file(rx: Rx) -> None:
    def hb(epoch: int, last_seq: int) -> bytes:
        return rx.codec.seal_heartbeat(LinkHeartbeat(
            epoch, 1 << 40, time.time(), 2.0, {"u1": {"last_seq": last_seq, "objects": 3}},
            {"datagrams": 10},
        ))  # fmt: skip

    status = rx.spool / "status.json"
    written = (read_json(status) or {}).get("written_at", 0)
    rx.wait(lambda: (read_json(status) or {}).get("written_at", 0) > written + 1.0, "2 writes")
    assert (read_json(status) or {})["heartbeat_age_seconds"] is None  # never heard
    assert UDP.heartbeat_age._value.get() >= 1.0  # the gauge: since start, not a fresh 0
    rx.send([hb(20, 7)])
    rx.wait(lambda: ((read_json(status) or {}).get("heartbeat") or {}).get("epoch") == 20, "hb")
    rx.send([hb(20, 7)])  # a capture of it, replayed
    doc = read_json(status) or {}
    assert doc["heartbeat"]["channels"] == {"u1": {"last_seq": 7, "objects": 3}}
    assert doc["epoch"] == 20 and doc["heartbeat_age_seconds"] is not None
    # the sender restarted: a symbol of epoch 21; then a straggling heartbeat of epoch 20
    rx.send(datagrams(rx.codec, 21, 1, "u1.000000000008.e.dbundle", os.urandom(2000))[:1])
    rx.send([hb(20, 6)])
    rx.wait(lambda: (read_json(status) or {}).get("epoch") == 21, "the new epoch")
    time.sleep(1.2)  # one more status write
    s = rx.finish()
    doc = read_json(status) or {}
    assert doc["heartbeat"]["channels"]["u1"]["last_seq"] == 7  # the old session's word ignored
    assert (s.epoch, s.epochs_seen, s.heartbeats) == (21, 2, 1)
    assert doc["datagrams"] == 4 and doc["dropped"] == {"replayed": 1, "stale_epoch": 1}
    assert UDP.heartbeat_age._value.get() < 5.0


def test_replayed_datagrams_of_a_delivered_file_are_late_and_deliver_nothing(rx: Rx) -> None:
    name = "u1.000000000012.replay.dbundle"
    dg = datagrams(rx.codec, 30, 1, name, os.urandom(4000))
    rx.send(dg)
    rx.wait(lambda: (rx.inbox / name).exists(), "the file")
    mtime = (rx.inbox / name).stat().st_mtime_ns
    rx.send(dg)  # a capture replayed whole
    time.sleep(0.5)
    s = rx.finish()
    assert s.objects_completed == 1 and s.duplicate_objects == 0
    assert s.dropped.get("late", 0) >= len(dg)
    assert [p.name for p in rx.inbox.iterdir()] == [name]
    assert (rx.inbox / name).stat().st_mtime_ns == mtime


class RxProc:
    """`diode udp receive` as its own process, its output in a log file."""

    def __init__(self, cfg_path: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        (cfg_path.parent / "red" / "udp-spool" / "status.json").unlink(missing_ok=True)
        env = dict(os.environ, DIODE_LOG_FORMAT="json", DIODE_LOG_LEVEL="INFO", **(env or {}))
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from bridge.cli import main; main()",
                 "udp", "receive", "--config", str(cfg_path)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        status = cfg_path.parent / "red" / "udp-spool" / "status.json"
        deadline = time.monotonic() + 30
        while not status.exists():
            assert self.proc.poll() is None, f"receiver died:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.05)

    def events(self) -> list[dict[str, Any]]:
        return json_lines(self.log)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> dict[str, Any]:
        stop_process(self.proc, timeout=60)
        docs = [e for e in self.events() if "msg" not in e]
        assert docs, self.log.read_text()[-3000:]
        return docs[-1]


def _spooled_symbol_bytes(spool: Path) -> int:
    return sum(p.stat().st_size for p in spool.glob("objects/*/symbols.log"))


def receiver_config(tmp: Path, port: int, **receive: float | int) -> Path:
    """``tmp/diode.toml`` for a `diode udp receive` process: channel u1, red inbox, the key in
    ``tmp/udp.key``, binding 127.0.0.1:``port``, and ``receive``'s extra [udp.receive] keys."""
    extra = "".join(f"{k} = {v!r}\n" for k, v in receive.items())
    path = tmp / "diode.toml"
    path.write_text(f"""
[[channels]]
name = "u1"
encrypt = false
transport = "udp"

[red]
inbox = "red/inbox"

[udp]
key_file = "udp.key"

[udp.receive]
bind = "127.0.0.1:{port}"
{extra}""")
    return path


def test_a_receiver_killed_9_mid_object_completes_it_from_its_spool(tmp_path: Path) -> None:
    port = free_udp_port()
    generate_key_file(tmp_path / "udp.key")
    cfg_path = receiver_config(tmp_path, port, expire_seconds=60.0)
    codec = DatagramCodec(load_key(tmp_path / "udp.key"))
    name = "u1.000000000001.0123456789abcdef0123456789abcdef.dbundle"
    t, k = 1024, 64
    body = os.urandom(48 * t * k - len(envelope_prefix(name)))  # 48 blocks of 64 + 7 repair
    dg = datagrams(codec, 50, 1, name, body, repair=0.1, t=t, k=k, round_robin=True)
    # esi by esi across blocks: the first half leaves every block about half-received, so
    # the object can only complete if the restarted receiver had them back from the spool
    half = len(dg) // 2
    spool, inbox = tmp_path / "red" / "udp-spool", tmp_path / "red" / "inbox"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = RxProc(cfg_path, tmp_path / "rx1.log")
    try:
        for i, d in enumerate(dg[:half]):
            sock.sendto(d, ("127.0.0.1", port))
            if not i % 64:
                time.sleep(0.001)  # well below what the receiver takes: no loss
        deadline = time.monotonic() + 30
        while _spooled_symbol_bytes(spool) < half * (8 + t):  # flushed every 0.2 s
            assert time.monotonic() < deadline, "the receiver did not spool the symbols"
            time.sleep(0.05)
        rx.kill9()
        assert _spooled_symbol_bytes(spool) == half * (8 + t)  # every one, none decoded
        assert not inbox.exists() or list(inbox.iterdir()) == []

        rx = _restarted(cfg_path, tmp_path / "rx2.log", 1)
        for i, d in enumerate(dg[half:]):
            sock.sendto(d, ("127.0.0.1", port))
            if not i % 64:
                time.sleep(0.001)
        _await_delivery(rx, inbox / name, "the object did not complete after the restart")
        summary = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()
    assert (inbox / name).read_bytes() == body
    assert summary["objects_completed"] == 1 and summary["datagrams"] == len(dg) - half
    assert read_gap_records(spool) == []
    assert list((spool / "objects").iterdir()) == [] and list((spool / "tmp").iterdir()) == []


def _disk_usage(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def _blocks_done(spool: Path) -> int:
    return sum(p.stat().st_size // 4 for p in spool.glob("objects/*/blocks.done"))


def _big_object(
    tmp_path: Path, blocks: int, epoch: int
) -> tuple[int, Path, str, bytes, list[list[bytes]]]:
    """A receiver config (expiry 60 s) and an object of ``blocks`` blocks of 64 symbols of 8
    KiB (512 KiB each) and 7 repair symbols, sent in ``epoch``: the port, the config, the
    file's name, its body and its datagrams block by block."""
    port = free_udp_port()
    generate_key_file(tmp_path / "udp.key")
    cfg_path = receiver_config(tmp_path, port, expire_seconds=60.0)
    codec = DatagramCodec(load_key(tmp_path / "udp.key"))
    name = "u1.000000000001.0123456789abcdef0123456789abcdef.dbundle"
    t, k, n = 8192, 64, 71
    body = os.urandom(blocks * t * k - len(envelope_prefix(name)))
    dg = datagrams(codec, epoch, 1, name, body, repair=0.1, t=t, k=k)
    assert len(dg) == blocks * n
    return port, cfg_path, name, body, [dg[b * n : (b + 1) * n] for b in range(blocks)]


def test_a_receiver_killed_9_after_compacting_its_spool_completes_the_object(
    tmp_path: Path,
) -> None:
    """A 48 MiB object sent block after block: once the rebuilt blocks' symbols outweigh the
    rest (and reach 16 MiB), the receiver compacts the object's symbols.log, so the spool
    holds about the rebuilt bytes, not twice them. Killed -9 then, the restarted receiver
    completes the object from that spool, blocks half received before a compaction too."""
    port, cfg_path, name, body, block = _big_object(tmp_path, 96, 60)
    t, k = 8192, 64
    # blocks 0-69 whole (a compaction after about 33, and 66, rebuilt blocks), with the first
    # 40 symbols of block 70 before blocks 60-69 (the second compaction must keep them) and of
    # block 71 after; the rest after the restart: blocks 70 and 71 need what was spooled
    first = [d for b in range(60) for d in block[b]] + block[70][:40]
    first += [d for b in range(60, 70) for d in block[b]] + block[71][:40]
    rest = block[70][40:] + block[71][40:] + [d for b in range(72, 96) for d in block[b]]
    spool, inbox = tmp_path / "red" / "udp-spool", tmp_path / "red" / "inbox"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = RxProc(cfg_path, tmp_path / "rx1.log")
    try:
        _send_slowly(sock, port, first)
        deadline = time.monotonic() + 30
        while (read_json(spool / "status.json") or {}).get("datagrams", 0) < len(first):
            assert time.monotonic() < deadline, "the receiver did not take every datagram"
            time.sleep(0.05)
        # the last symbols flushed (every 0.2 s): the log holds blocks 70 and 71's 40 each
        logs = list((spool / "objects").glob("*/symbols.log"))
        while not logs or logs[0].stat().st_size < 80 * (8 + t):
            assert time.monotonic() < deadline, "the receiver did not flush its symbols"
            time.sleep(0.05)
            logs = list((spool / "objects").glob("*/symbols.log"))
        rx.kill9()
        assert _blocks_done(spool) == 70
        rebuilt = 70 * t * k
        used = _disk_usage(spool / "objects")
        # without compaction: the rebuilt bytes plus all their symbols again (2x)
        assert rebuilt < used <= rebuilt + (16 << 20) + (2 << 20), used

        rx = _restarted(cfg_path, tmp_path / "rx2.log", 1)
        _send_slowly(sock, port, rest)
        _await_delivery(rx, inbox / name, "the object did not complete after the restart")
        summary = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()
    assert (inbox / name).read_bytes() == body
    assert summary["objects_completed"] == 1 and read_gap_records(spool) == []
    assert list((spool / "objects").iterdir()) == []


def test_a_receiver_killed_9_right_after_a_slow_compaction_loses_nothing_it_took_meanwhile(
    tmp_path: Path,
) -> None:
    """The object's first compaction takes 2 s (a slow disk, DIODE_SLOW_AT): the receive loop
    goes on taking datagrams and appending them to the old log meanwhile, and carries them
    into the new one. Killed -9 just after the new log is renamed into place, the restarted
    receiver completes the object from it: blocks half received before the compaction (in
    its snapshot) and while it ran (carried over)."""
    port, cfg_path, name, body, block = _big_object(tmp_path, 64, 70)
    t = 8192
    # blocks 0-44 whole (the compaction begins after about 33, when the rebuilt blocks'
    # records reach 16 MiB), the first 40 symbols of block 45 before blocks 30-44 and of
    # block 46 after, all within the 2 s; the rest after the restart
    first = [d for b in range(30) for d in block[b]] + block[45][:40]
    first += [d for b in range(30, 45) for d in block[b]] + block[46][:40]
    rest = block[45][40:] + block[46][40:] + [d for b in range(47, 64) for d in block[b]]
    spool, inbox = tmp_path / "red" / "udp-spool", tmp_path / "red" / "inbox"
    mark = tmp_path / "crash.marks"
    crash = {**crash_env("udp.after_symbols_log_compacted", mark), SLOW_ENV: "udp.compaction:2"}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = RxProc(cfg_path, tmp_path / "rx1.log", crash)
    try:
        _send_slowly(sock, port, first)
        rx.proc.wait(timeout=60)  # the crash point, once the compaction is taken in
        assert crash_marks(mark) == ["udp.after_symbols_log_compacted"]
        (ev,) = [e for e in rx.events() if e.get("msg") == "symbols.log compacted"]
        rec = 8 + t
        assert ev["seconds"] >= 2 and ev["kept_bytes"] == 40 * rec, ev  # block 45's
        # what the loop took during those 2 s, carried into the new log: blocks rebuilt
        # meanwhile (their records dead now, 63 each) and block 46's 40 symbols
        assert ev["carried_bytes"] >= (10 * 63 + 40) * rec, ev
        assert _blocks_done(spool) == 45
        (log,) = (spool / "objects").glob("*/symbols.log")
        assert log.stat().st_size == ev["kept_bytes"] + ev["carried_bytes"]
        assert not list((spool / "objects").glob("*/symbols.log.tmp"))

        rx = _restarted(cfg_path, tmp_path / "rx2.log", 1, crash)
        _send_slowly(sock, port, rest)
        _await_delivery(rx, inbox / name, "the object did not complete after the restart")
        summary = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()
    assert (inbox / name).read_bytes() == body
    assert summary["objects_completed"] == 1 and read_gap_records(spool) == []


@pytest.mark.parametrize("point", ["udp.after_object_trashed", "udp.object_half_removed"])
def test_a_receiver_killed_9_while_removing_an_expired_object_cleans_it_up_at_restart(
    tmp_path: Path, point: str
) -> None:
    """An object expires: its gap record is written, its folder renamed into trash/, then
    removed on a background thread. Killed -9 right after the rename or part way through the
    removal, the restarted receiver never takes what is left for an object (nothing rebuilt,
    delivered or recorded again), removes it, and goes on."""
    port = free_udp_port()
    generate_key_file(tmp_path / "udp.key")
    cfg_path = receiver_config(tmp_path, port, expire_seconds=1.0)
    codec = DatagramCodec(load_key(tmp_path / "udp.key"))
    t, k = 1024, 64
    name = "u1.000000000002.0123456789abcdef0123456789abcdef.dbundle"
    dg = datagrams(codec, 80, 1, name, os.urandom(16 * t * k), repair=0, t=t, k=k)
    spool, inbox = tmp_path / "red" / "udp-spool", tmp_path / "red" / "inbox"
    mark = tmp_path / "crash.marks"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx = RxProc(cfg_path, tmp_path / "rx1.log", crash_env(point, mark))
    try:
        _send_slowly(sock, port, dg[: len(dg) // 2])  # 8 of 17 blocks: it can only expire
        rx.proc.wait(timeout=30)  # the crash point, once it has expired
        assert crash_marks(mark) == [point]
        (gap,) = read_gap_records(spool)  # written before the folder went
        assert (gap["object_id"], gap["reason"], gap["blocks_done"]) == (1, "timeout", 8)
        assert list((spool / "objects").iterdir()) == []
        (left,) = (spool / "trash").iterdir()
        files = sorted(f.name for f in left.iterdir())
        if point == "udp.after_object_trashed":
            assert files == ["blocks.done", "data", "meta.json", "symbols.log"]
            assert (left / "data").stat().st_size >= 8 * t * k
        else:
            assert files == ["blocks.done", "data", "symbols.log"]  # meta.json went first

        rx = _restarted(cfg_path, tmp_path / "rx2.log", 0)
        swept = [e for e in rx.events() if e.get("msg", "").startswith("spool trash left")]
        assert swept and swept[0]["folders"] == 1
        deadline = time.monotonic() + 10
        while list((spool / "trash").iterdir()):
            assert time.monotonic() < deadline, "the trash was not emptied"
            time.sleep(0.05)
        other = "u1.000000000003.0123456789abcdef0123456789abcdef.dbundle"
        body = os.urandom(50_000)
        _send_slowly(sock, port, datagrams(codec, 81, 1, other, body))
        deadline = time.monotonic() + 30
        while not (inbox / other).exists():
            assert time.monotonic() < deadline, "the next object was not delivered"
            time.sleep(0.05)
        summary = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()
    assert [p.name for p in inbox.iterdir()] == [other] and (inbox / other).read_bytes() == body
    assert summary["objects_completed"] == 1 and summary["objects_expired"] == 0
    assert read_gap_records(spool) == [gap]  # not recorded again
    assert list((spool / "objects").iterdir()) == [] and list((spool / "trash").iterdir()) == []


def _restarted(
    cfg_path: Path, log: Path, rebuilt: int, env: dict[str, str] | None = None
) -> RxProc:
    """A receiver process started again; it must say it rebuilt ``rebuilt`` spooled objects."""
    rx = RxProc(cfg_path, log, env)
    started = [e for e in rx.events() if e.get("msg") == "udp receiver listening"]
    assert started and started[0]["objects_rebuilt"] == rebuilt
    return rx


def _await_delivery(rx: RxProc, path: Path, what: str) -> None:
    """Until ``path`` is in the inbox (30 s); the receiver must stay up meanwhile."""
    deadline = time.monotonic() + 30
    while not path.exists():
        assert rx.proc.poll() is None, rx.log.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _send_slowly(sock: socket.socket, port: int, items: list[bytes]) -> None:
    """About 40 MB/s of 8 KiB datagrams: well below what the receiver takes."""
    for i, d in enumerate(items):
        sock.sendto(d, ("127.0.0.1", port))
        if i % 16 == 15:
            time.sleep(0.003)


def test_an_object_larger_than_half_the_spool_disk_is_delivered(
    tmp_path: Path, small_disk: Path
) -> None:
    """On a 2 MB disk, a 1.5 MiB object fits only if its rebuilt blocks' symbols are let go
    (without compaction it needs about 3 MiB: a spool_error gap)."""
    spool = small_disk / "spool"
    env = envelope_prefix("u1.000000000001.fits.dbundle") + os.urandom(3 << 19)
    ra = Reassembler(spool, max_object_bytes=4 << 20, max_open_objects=8,
                     compact_log_bytes=128 << 10)  # fmt: skip
    codec = DatagramCodec(os.urandom(32))
    for raw in datagrams(codec, 1, 1, "raw:", env, t=1024, k=64):
        ra.add(codec.open(raw), 1.0)  # type: ignore[arg-type]
        ra.wait_compactions()  # a disk fast next to the link: each taken in at once
    assert read_gap_records(spool) == [] and ra.compacted > 0
    (d,) = ra.ready
    assert (d.path / "data").read_bytes() == env


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A real 2 MB filesystem (tmpfs) for the receiver's spool."""
    with small_tmpfs("2m", "udpfs") as d:
        yield d


def test_a_full_spool_disk_makes_a_gap_and_the_receiver_goes_on(
    tmp_path: Path, small_disk: Path
) -> None:
    spool = small_disk / "spool"
    with receiving(tmp_path, max_object_bytes=64 << 20, spool_dir=str(spool)) as rx:
        codec, inbox = rx.codec, rx.inbox
        big = datagrams(codec, 21, 1, "u1.000000000001.big.dbundle", os.urandom(3 << 20), repair=0)
        rx.send(big)  # 3 MB of rebuilt blocks into a 2 MB spool: ENOSPC half way
        rx.wait(lambda: read_gap_records(spool), "the spool_error gap record")
        (gap,) = read_gap_records(spool)
        assert gap["reason"] == "spool_error" and gap["seq"] == 2, gap
        assert gap["error"].startswith("ENOSPC"), gap  # the fault really fired
        assert 0 < gap["blocks_done"] < gap["blocks_total"], gap
        assert not list((spool / "objects").iterdir())  # its files were removed: room again
        # the receiver is still running: the next object is spooled and delivered intact
        small = os.urandom(300_000)
        rx.send(datagrams(codec, 21, 2, "u1.000000000002.small.dbundle", small))
        name = inbox / "u1.000000000002.small.dbundle"
        rx.wait(name.exists, "the next file after the full disk")
        assert name.read_bytes() == small
        rx.send(big[-5:])  # stragglers of the given-up object are dropped, never respooled
        time.sleep(0.5)
        s = rx.finish()
    assert s.objects_completed == 1 and s.objects_expired == 1
    assert s.dropped.get("spool_error", 0) >= 5 + 1
    assert not (inbox / "u1.000000000001.big.dbundle").exists()


@pytest.mark.parametrize("gro", ["auto", "off"])
def test_coalesced_buffers_from_a_gso_sender_land_the_same_files(tmp_path: Path, gro: str) -> None:
    """Datagrams leave in GSO batches; with UDP GRO the receiver takes them as coalesced
    buffers (fewer receive calls than datagrams) and cuts them apart; with it off, one call
    per datagram. Either way every file lands byte-identical."""
    bodies = {f"u1.{i:012d}.gro.dbundle": os.urandom(40_000 + i) for i in range(1, 4)}
    with receiving(tmp_path, gro=gro) as rx:
        b = DatagramBatcher(
            rx.sock, rx.addr, gso=True, max_bytes=65_507, pace=lambda n: 0.0, on_sent=lambda: None
        )
        for oid, (name, body) in enumerate(bodies.items(), start=1):
            for d in datagrams(rx.codec, 13, oid, name, body):
                b.add(d)
            b.flush()
            time.sleep(0.01)
        rx.wait(lambda: all((rx.inbox / n).exists() for n in bodies), "the three files")
        s = rx.finish()
    assert b.gso_sends > 0, "the sender never batched"
    assert {n: (rx.inbox / n).read_bytes() for n in bodies} == bodies
    assert s.objects_completed == 3 and not s.dropped.get("tag")
    if gro == "auto":
        assert s.receive_calls < s.datagrams, "no buffer held more than one datagram"
    else:
        assert s.receive_calls == s.datagrams


@pytest.mark.parametrize("stage", ["journal", "discard"])
def test_the_receive_loop_goes_on_while_a_delivery_does_its_disk_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """The delivery thread's fsync of done.jsonl and its removal of the object's spool (a
    data file of up to max_object_bytes) run outside the lock the receive loop takes for
    every datagram: while either is held up (a slow disk), the loop still places symbols."""
    import bridge.diode.udp_receiver as receiver_module

    entered, release = threading.Event(), threading.Event()
    held: list[str] = []

    def slow(real: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            held.append(stage)
            entered.set()
            assert release.wait(30), "never released"
            return real(*args)

        return wrapper

    if stage == "journal":
        monkeypatch.setattr(Reassembler, "journal_delivered", slow(Reassembler.journal_delivered))
    else:
        monkeypatch.setattr(
            receiver_module, "discard_spooled", slow(receiver_module.discard_spooled)
        )
    with receiving(tmp_path, max_object_bytes=1 << 20, expire_seconds=60) as rx:
        first = "u1.000000000001.first.dbundle"
        sent = datagrams(rx.codec, 31, 1, first, os.urandom(50_000))
        rx.send(sent)
        assert entered.wait(20), "the delivery never reached its disk work"
        second = datagrams(rx.codec, 31, 2, "u1.000000000002.second.dbundle",
                           os.urandom(50_000), repair=0)  # fmt: skip
        part = second[: len(second) // 2]  # half an object: it stays open
        rx.send(part)

        def placed() -> bool:
            st = read_json(rx.spool / "status.json") or {}
            return st.get("open_objects") == 1 and st.get("datagrams", 0) >= len(sent) + len(part)

        rx.wait(placed, "the loop placing symbols while the delivery is held", timeout=10)
        assert held == [stage] and not release.is_set()  # the slow disk work really was under way
        release.set()
        rx.wait(lambda: (rx.inbox / first).exists(), "the first file")
        rx.send(second[len(part) :])
        rx.wait(lambda: (rx.inbox / "u1.000000000002.second.dbundle").exists(), "the second")
        s = rx.finish()
    assert s.objects_completed == 2
    assert not list((rx.spool / "objects").iterdir())


def test_the_delivery_journal_is_cut_back_to_what_the_receiver_remembers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """done.jsonl gets a record per delivered object: past a size it is rewritten with the
    records the receiver remembers, so neither the disk nor the start-up read grows forever."""
    import bridge.diode.udp_spool as spool_mod

    monkeypatch.setattr(spool_mod, "_DONE_REMEMBERED", 10)
    monkeypatch.setattr(spool_mod, "_DONE_COMPACT_BYTES", 4000)
    ra = Reassembler(tmp_path, max_object_bytes=1 << 20, max_open_objects=8)
    for oid in range(100):
        h = ObjectHeader(oid, ObjectKind.BUNDLE, "u1", oid + 1, 10, bytes([oid]) * 32, T, K)
        ra.journal_delivered(spool_mod.Delivery(9, h, tmp_path, 0), f"u1.{oid + 1:012d}.x.dbundle")
    done = tmp_path / spool_mod.DONE
    lines = done.read_text().splitlines()
    assert 10 <= len(lines) < 40 and lines[-1].count('"object_id": 99') == 1  # cut, newest kept
    again = Reassembler(tmp_path, max_object_bytes=1 << 20, max_open_objects=8)
    assert set(again.done) == {(9, oid) for oid in range(90, 100)}


def test_a_rebuilt_object_whose_spooled_data_vanished_becomes_a_gap_not_an_endless_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator removes a rebuilt object's spooled ``data`` before its delivery: the
    delivery thread records one ``spool_error`` gap naming the file and goes on delivering
    (before, it retried the ENOENT forever and delivered nothing after it)."""
    import bridge.diode.udp_receiver as receiver_module

    removed: list[Path] = []
    real = receiver_module.verify_and_read_name

    def removed_by_hand(d: Any) -> Any:
        if not removed:
            (d.path / "data").unlink()
            removed.append(d.path / "data")
        return real(d)

    monkeypatch.setattr(receiver_module, "verify_and_read_name", removed_by_hand)
    with receiving(tmp_path, max_object_bytes=1 << 20, expire_seconds=60) as rx:
        rx.send(datagrams(rx.codec, 41, 1, "u1.000000000001.gone.dbundle", os.urandom(20_000)))
        rx.wait(lambda: removed, "the delivery of the first object")
        second = "u1.000000000002.next.dbundle"
        rx.send(datagrams(rx.codec, 41, 2, second, os.urandom(20_000)))
        rx.wait(lambda: (rx.inbox / second).exists(), "the next object's delivery", timeout=10)
        s = rx.finish()
    gaps = read_gap_records(rx.spool)
    assert [(g["object_id"], g["reason"]) for g in gaps] == [(1, "spool_error")]
    assert gaps[0]["error"] == f"spooled data file gone: {removed[0]}"
    assert s.delivery_errors == 0 and s.objects_completed == 1
    assert not (rx.inbox / "u1.000000000001.gone.dbundle").exists()
    assert not list((rx.spool / "objects").iterdir())


def test_an_unexpected_delivery_failure_is_logged_counted_and_retried_not_a_dead_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery that fails with something other than an OSError (a bug, a RecursionError)
    once: the delivery thread logs and counts it, retries, delivers the object, and delivers the
    next (before, the thread died and nothing was delivered again while datagrams kept
    arriving)."""
    import bridge.diode.udp_receiver as receiver_module

    failed: list[str] = []
    real = receiver_module.verify_and_read_name

    def fails_once(d: Any) -> Any:
        if not failed:
            failed.append("fired")
            raise ValueError("unexpected")
        return real(d)

    monkeypatch.setattr(receiver_module, "verify_and_read_name", fails_once)
    with receiving(tmp_path, max_object_bytes=1 << 20, expire_seconds=60) as rx:
        first, second = "u1.000000000001.a.dbundle", "u1.000000000002.b.dbundle"
        rx.send(datagrams(rx.codec, 41, 1, first, os.urandom(20_000)))
        rx.wait(lambda: failed, "the failing delivery")
        rx.send(datagrams(rx.codec, 41, 2, second, os.urandom(20_000)))
        rx.wait(lambda: (rx.inbox / first).exists(), "the retried delivery", timeout=10)
        rx.wait(lambda: (rx.inbox / second).exists(), "the next object's delivery", timeout=10)
        s = rx.finish()
    assert failed == ["fired"]
    assert s.delivery_errors == 1 and s.objects_completed == 2
    assert read_gap_records(rx.spool) == []


def test_a_sender_with_another_key_is_warned_about_not_only_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The two sides' key files differ: every datagram fails its tag. Only a counter rose,
    and `diode status` showed a quiet link. The receiver now warns, naming the likely causes,
    at most once a minute; a few corrupted datagrams among good ones do not warn."""
    with caplog.at_level("WARNING", logger="bridge.diode.udp_receiver"):
        with receiving(tmp_path, max_object_bytes=1 << 20) as rx:
            good = datagrams(rx.codec, 5, 1, "u1.000000000001.ok.dbundle", os.urandom(50_000))
            bad = bytearray(good[0])
            bad[-1] ^= 1
            rx.send([*good, bytes(bad)])
            rx.wait(lambda: (rx.inbox / "u1.000000000001.ok.dbundle").exists(), "delivery")
            time.sleep(1.5)  # a status write with one failure among many good: no warning
            assert not [r for r in caplog.records if "fail authentication" in r.getMessage()]
            other = DatagramCodec(os.urandom(32))
            rx.send(datagrams(other, 6, 2, "u1.000000000002.x.dbundle", os.urandom(50_000)))
            rx.wait(lambda: any("fail authentication" in r.getMessage()
                                for r in caplog.records), "the warning", timeout=10)  # fmt: skip
            rx.send(datagrams(other, 6, 3, "u1.000000000003.x.dbundle", os.urandom(50_000)))
            time.sleep(1.5)
            s = rx.finish()
    warned = [r for r in caplog.records if "fail authentication" in r.getMessage()]
    assert len(warned) == 1 and "udp.key_file differs" in warned[0].getMessage()
    assert s.dropped["tag"] >= 2 * AUTH_WARN_MIN


def test_a_status_file_it_cannot_write_is_said_once_a_minute_not_every_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk under the spool refused the status file each second, and each refusal was
    logged: an error line a second for as long as it lasted. Once a minute, and once more
    when it is written again."""
    spool = tmp_path / "spool"
    (spool / "status.json").mkdir(parents=True)  # the fault: the rename onto it fails
    with caplog.at_level("INFO", logger="bridge.diode.udp_receiver"):
        with receiving(tmp_path, max_object_bytes=1 << 20, spool_dir=str(spool)) as rx:
            time.sleep(3.5)  # three status writes at least
            said = [r for r in caplog.records if "status file not written" in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in said]
            (spool / "status.json").rmdir()
            rx.wait(lambda: (spool / "status.json").is_file(), "the status file written again")
    assert any("status file written again" in r.getMessage() for r in caplog.records)
