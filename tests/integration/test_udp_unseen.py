"""UDP receiver (red), objects no datagram ever came for: a real sender and receiver on loopback
sockets, with a stand-in diode between them that loses every datagram of chosen objects. A
lost object is one ``unseen`` gap record, once (a hole below later objects, the last objects
before the link goes quiet, an older sender's holes, a huge hole as one range); a sender
restart and ids a stopped sender never claimed make none; a receiver killed between the record
and its state, then restarted, repeats none; an object arriving after its record is delivered."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, config_from_dict
from bridge.demo.udp_link import free_udp_port
from bridge.diode.link_status import read_gap_records, read_json
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.diode.udp_receiver import ReceiveSummary
from bridge.diode.udp_sender import Journal, SendSummary, run_sender
from bridge.diode.udp_socket import set_rcvbuf
from bridge.diode.udp_unseen import STATE
from bridge.faults import CRASH_ENV, MARK_ENV
from bridge.protocol.datagram import DatagramCodec, LinkHeartbeat
from tests.integration.test_udp_receive import (
    Rx,
    RxProc,
    _udp_metrics,
    datagrams,
    receiver_config,
    receiving,
)
from tests.support import crash_marks


class Diode:
    """A stand-in diode on loopback: forwards every datagram, except the symbols of the object
    ids in ``drop`` (counted, never sent on) and in ``hold`` (kept until :meth:`release`).
    It checks each heartbeat's ``objects_started`` against the ids it had datagrams of."""

    def __init__(
        self, forward: tuple[str, int], *, drop: Iterable[int] = (), hold: Iterable[int] = ()
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        set_rcvbuf(self.sock, 16 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.forward, self.drop, self.hold = forward, set(drop), set(hold)
        self.dropped: Counter[tuple[int, int]] = Counter()  # (epoch, object id) -> datagrams
        self.forwarded: Counter[tuple[int, int]] = Counter()
        self.heartbeats = 0
        self.claims: list[tuple[int, int]] = []  # (epoch, objects_started) of each heartbeat
        self.overclaims: list[tuple[int, int, list[int]]] = []
        self._ids: dict[int, set[int]] = {}  # epoch -> ids with a datagram here
        self.held: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                d = self.sock.recv(65536)
            except TimeoutError:
                continue
            if d[3] != 1:  # a link heartbeat: on, always
                self._heartbeat(d)
                self.sock.sendto(d, self.forward)
                continue
            key = (int.from_bytes(d[4:12], "big"), int.from_bytes(d[20:28], "big"))
            self._ids.setdefault(key[0], set()).add(key[1])
            with self._lock:
                if key[1] in self.drop:
                    self.dropped[key] += 1
                    continue
                if key[1] in self.hold:
                    self.held.append(d)
                    continue
                self.forwarded[key] += 1
            self.sock.sendto(d, self.forward)

    def _heartbeat(self, d: bytes) -> None:
        """A heartbeat must claim only objects a datagram of which went before it."""
        self.heartbeats += 1
        epoch = int.from_bytes(d[4:12], "big")
        started = json.loads(d[20:-16])["counters"]["objects_started"]
        self.claims.append((epoch, started))
        ids = self._ids.get(epoch, set())
        if not set(range(started)) <= ids:
            self.overclaims.append((epoch, started, sorted(ids)))

    def release(self) -> int:
        """Send on what was held (late, after everything else), and hold nothing more."""
        with self._lock:
            held, self.held = self.held, []
            self.hold.clear()
        for i, d in enumerate(held):
            self.sock.sendto(d, self.forward)
            if i % 64 == 63:
                time.sleep(0.001)
        return len(held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Rx]:
    with receiving(tmp_path, max_object_bytes=1 << 20) as r:
        yield r


def _sender_cfg(tmp: Path, dest: tuple[str, int], *, rate: int = 20_000_000) -> Config:
    """Heartbeats every 50 ms: several while the files go (at ``rate`` bytes a second)."""
    data = {
        "channels": [{"name": "u1", "encrypt": False, "transport": "udp"}],
        "black": {"outbox": "black/outbox"},
        "udp": {
            "key_file": "udp.key",
            "mtu": 1500,
            "send": {
                "destination": f"{dest[0]}:{dest[1]}",
                "rate_bytes_per_second": rate,
                "burst_bytes": 65_536,
                "heartbeat_seconds": 0.05,
            },
        },
    }
    return config_from_dict(data, base=tmp, environ={})


def _outbox_files(cfg: Config, seqs: Iterable[int]) -> dict[str, bytes]:
    """Bundles of channel u1 in the outbox, oldest first (the order the sender numbers them)."""
    outbox = Path(cfg.black.outbox)
    outbox.mkdir(parents=True, exist_ok=True)
    files = {}
    t0 = time.time_ns() - 10**12
    for i, seq in enumerate(seqs):
        body = os.urandom(30_000 + 7_000 * i)
        name = f"u1.{seq:012d}.{hashlib.md5(body).hexdigest()}.dbundle"
        (outbox / name).write_bytes(body)
        os.utime(outbox / name, ns=(t0 + i * 10**9, t0 + i * 10**9))
        files[name] = body
    return files


def _journal(cfg: Config) -> dict[str, dict[str, Any]]:
    """The sender journal's last record of each file name."""
    journal = Journal(Path(cfg.udp.send.state_dir))  # type: ignore[union-attr]
    journal.close()
    return journal.last


def _ids(cfg: Config, sent: SendSummary) -> dict[int, str]:
    """Object id -> file name, as the sender's journal recorded them in this run's epoch."""
    return {r["object_id"]: n for n, r in _journal(cfg).items() if r["epoch"] == sent.epoch}


def _unseen(spool: Path) -> list[dict[str, Any]]:
    return [g for g in read_gap_records(spool) if g.get("reason") == "unseen"]


def _settled(spool: Path, epoch: int) -> int | None:
    """How far the receiver's saved state has checked ``epoch``'s object ids (None: not)."""
    doc = read_json(spool / STATE) or {}
    bases = {e["epoch"]: e["base"] for e in doc.get("epochs", [])}
    return bases.get(epoch)


def _inbox(rx_inbox: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in rx_inbox.iterdir()}


@dataclass
class LossRun:
    """A sender run through a diode that lost every datagram of some objects."""

    rx: Rx
    diode: Diode
    cfg: Config
    sent: SendSummary
    summary: ReceiveSummary
    files: dict[str, bytes]
    ids: dict[int, str]
    metrics: dict[str, float]
    """bridge_udp_* samples: how much each grew over the run."""


def _lose_objects(tmp: Path, n_files: int, drop: set[int], *, rate: int = 20_000_000) -> LossRun:
    """Send ``n_files`` files through a diode that loses every datagram of the objects
    ``drop``; wait for their records, the other files and the check of every id, then stop
    the receiver."""
    with receiving(tmp, max_object_bytes=1 << 20) as rx:
        diode = Diode(rx.addr, drop=drop)
        try:
            cfg = _sender_cfg(tmp, diode.address, rate=rate)
            files = _outbox_files(cfg, range(1, n_files + 1))
            before = _udp_metrics()
            sent = run_sender(cfg, until_idle=True, timeout=60)
            ids = _ids(cfg, sent)
            kept = [ids[i] for i in ids if i not in drop]
            rx.wait(lambda: len(_unseen(rx.spool)) >= len(drop), "the unseen records")
            rx.wait(lambda: all((rx.inbox / n).exists() for n in kept), "the other files")
            rx.wait(lambda: _settled(rx.spool, sent.epoch) == n_files, "the check of every id")
            s = rx.finish()
        finally:
            diode.close()
    got = {k: v - before.get(k, 0.0) for k, v in _udp_metrics().items()}
    return LossRun(rx, diode, cfg, sent, s, files, ids, got)


def test_a_file_lost_whole_mid_run_is_one_unseen_gap_record(tmp_path: Path) -> None:
    run = _lose_objects(tmp_path, 8, {2}, rate=1_000_000)
    rx, sent, s, files, ids = run.rx, run.sent, run.summary, run.files, run.ids
    assert sorted(ids) == list(range(8)) and set(ids.values()) == set(files)
    lost = ids[2]
    # the case happened: every datagram of object 2 was lost, and only those; the sender
    # journaled the file as sent, objects 3 to 7 after it reached the receiver
    assert run.diode.dropped[(sent.epoch, 2)] > 0 and set(run.diode.dropped) == {(sent.epoch, 2)}
    assert set(run.diode.forwarded) == {(sent.epoch, i) for i in (0, 1, 3, 4, 5, 6, 7)}
    # heartbeats went while the files did, each claiming only objects already under way
    # (a count of the ids given, which run ahead of the first datagrams, may claim too many)
    assert len(run.diode.claims) >= 4 and run.diode.claims[-1] == (sent.epoch, 8)
    assert not run.diode.overclaims
    assert _journal(run.cfg)[lost]["state"] == "sent"
    (rec,) = read_gap_records(rx.spool)  # one record, and no other gap
    assert rec["reason"] == "unseen" and rec["evidence"] == "heartbeat"
    assert (rec["epoch"], rec["object_id"], rec["object_id_last"], rec["objects"]) == (
        sent.epoch, 2, 2, 1,
    )  # fmt: skip
    assert rec["channel"] == "u1"  # the heartbeat names one channel: every object is its
    assert _inbox(rx.inbox) == {n: b for n, b in files.items() if n != lost}
    assert (s.objects_completed, s.objects_unseen, s.objects_expired) == (7, 1, 0)
    assert (read_json(rx.spool / "status.json") or {})["objects_unseen"] == 1
    assert run.metrics["objects_expired_total/u1/unseen"] == 1


def test_the_last_file_lost_before_the_link_goes_quiet_is_found_by_the_heartbeat(
    tmp_path: Path,
) -> None:
    run = _lose_objects(tmp_path, 3, {2})
    rx, sent, s, ids = run.rx, run.sent, run.summary, run.ids
    assert sorted(ids) == [0, 1, 2]  # no object after the lost one: only a heartbeat tells
    assert run.diode.dropped[(sent.epoch, 2)] > 0 and run.diode.heartbeats >= 2
    assert set(run.diode.forwarded) == {(sent.epoch, 0), (sent.epoch, 1)}
    assert not run.diode.overclaims and run.diode.claims[-1] == (sent.epoch, 3)
    assert _journal(run.cfg)[ids[2]]["state"] == "sent"
    (rec,) = read_gap_records(rx.spool)
    assert (rec["reason"], rec["epoch"], rec["object_id"], rec["objects"]) == (
        "unseen", sent.epoch, 2, 1,
    )  # fmt: skip
    assert rec["evidence"] == "heartbeat"
    assert _inbox(rx.inbox) == {n: b for n, b in run.files.items() if n != ids[2]}
    assert s.objects_unseen == 1 and run.metrics["objects_expired_total/u1/unseen"] == 1


def _heartbeat(codec: DatagramCodec, epoch: int, packet: int, started: int | None) -> bytes:
    counters = {"datagrams": 0} if started is None else {"objects_started": started}
    return codec.seal_heartbeat(LinkHeartbeat(
        epoch, packet, time.time(), 0.2, {"u1": {"last_seq": None, "objects": 0}}, counters,
    ))  # fmt: skip


def _file(codec: DatagramCodec, epoch: int, oid: int) -> list[bytes]:
    return datagrams(codec, epoch, oid, f"u1.{oid + 1:012d}.unseen.dbundle", os.urandom(3000))


def test_an_older_sender_s_holes_are_found_below_later_objects_one_range_each(rx: Rx) -> None:
    """A sender whose heartbeats do not count objects_started: ids below a later one seen are
    claimed by it. Two holes, then an id 2^36: three records, the last one of 2^36 - 7 ids."""
    e = 40
    before = _udp_metrics()
    rx.send([_heartbeat(rx.codec, e, 1, None)])
    for oid in (0, 1, 3, 6, 1 << 36):
        rx.send(_file(rx.codec, e, oid))
    rx.wait(lambda: len(_unseen(rx.spool)) >= 3, "three unseen records")
    rx.wait(lambda: _settled(rx.spool, e) == (1 << 36) + 1, "the check of every id")
    s = rx.finish()
    recs = read_gap_records(rx.spool)
    assert [(g["object_id"], g["object_id_last"], g["objects"]) for g in recs] == [
        (2, 2, 1), (4, 5, 2), (7, (1 << 36) - 1, (1 << 36) - 7),
    ]  # fmt: skip
    assert all(g["reason"] == "unseen" and g["evidence"] == "later_object" for g in recs)
    assert all("channel" not in g and "seq" not in g for g in recs)  # nothing tells them
    assert s.objects_completed == 5 and s.objects_unseen == 1 + 2 + (1 << 36) - 7
    got = _udp_metrics()["objects_expired_total/?/unseen"] - before.get(
        "objects_expired_total/?/unseen", 0.0
    )
    assert got == s.objects_unseen


def test_a_sender_restart_makes_no_false_records(tmp_path: Path) -> None:
    """Two sender runs (two epochs, ids from 0 in each): every file arrives, every id of both
    epochs is checked, and nothing is recorded."""
    with receiving(tmp_path, max_object_bytes=1 << 20) as rx:
        diode = Diode(rx.addr)
        try:
            cfg = _sender_cfg(tmp_path, diode.address)
            files = _outbox_files(cfg, range(1, 4))
            first = run_sender(cfg, until_idle=True, timeout=60)
            files |= _outbox_files(cfg, range(4, 7))
            second = run_sender(cfg, until_idle=True, timeout=60)
            rx.wait(lambda: len(list(rx.inbox.iterdir())) == 6, "the six files")
            rx.wait(lambda: _settled(rx.spool, second.epoch) == 3, "the check of epoch 2")
            time.sleep(1.5)  # another check or two
            s = rx.finish()
        finally:
            diode.close()
    assert first.epoch < second.epoch and s.epochs_seen == 2
    assert {e for e, _ in diode.forwarded} == {first.epoch, second.epoch}
    assert sorted(i for e, i in diode.forwarded if e == second.epoch) == [0, 1, 2]
    assert not diode.overclaims and diode.claims[0] == (first.epoch, 0)
    assert diode.claims[-1] == (second.epoch, 3)
    assert read_gap_records(rx.spool) == [] and s.objects_unseen == 0
    assert _inbox(rx.inbox) == files


def test_ids_a_stopped_sender_never_claimed_are_not_reported(rx: Rx) -> None:
    """Epoch 50 numbered object 2 but stopped before its first datagram, while object 3 (sent
    first by the interleaver) went: its heartbeats claim 0..1 only. The new epoch 51 starts
    from 0. No record for either: 50's id 2 was never claimed."""
    codec = rx.codec
    rx.send([_heartbeat(codec, 50, 1, 0)])
    for oid in (0, 1, 3):
        rx.send(_file(codec, 50, oid))
    rx.send([_heartbeat(codec, 50, 2, 2)])
    rx.send([_heartbeat(codec, 51, 1, 0), *_file(codec, 51, 0), _heartbeat(codec, 51, 2, 1)])
    rx.wait(lambda: _settled(rx.spool, 51) == 1, "the check of epoch 51")
    rx.wait(lambda: _settled(rx.spool, 50) in (2, None), "the check of epoch 50")
    time.sleep(1.5)
    s = rx.finish()
    assert s.objects_completed == 4 and s.epochs_seen == 2
    assert read_gap_records(rx.spool) == [] and s.objects_unseen == 0


def test_a_receiver_killed_after_the_record_before_its_state_repeats_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_udp_port()
    generate_key_file(tmp_path / "udp.key")
    cfg_path = receiver_config(tmp_path, port, expire_seconds=1.0)
    codec = DatagramCodec(load_key(tmp_path / "udp.key"))
    spool, inbox = tmp_path / "red" / "udp-spool", tmp_path / "red" / "inbox"
    mark = tmp_path / "crash.mark"
    monkeypatch.setenv(CRASH_ENV, "udp.before_unseen_saved")
    monkeypatch.setenv(MARK_ENV, str(mark))
    e = 77
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def send(items: list[bytes]) -> None:
        for d in items:
            sock.sendto(d, ("127.0.0.1", port))
            time.sleep(0)

    def settled(rx: RxProc, through: int) -> None:
        deadline = time.monotonic() + 20
        while _settled(spool, e) != through:
            assert rx.proc.poll() is None, rx.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"epoch {e} not checked through {through}"
            time.sleep(0.05)

    rx = RxProc(cfg_path, tmp_path / "rx1.log")
    try:
        send([_heartbeat(codec, e, 1, 0)])  # the sender starts (a new spool: checked from here)
        for oid in (0, 1, 3):
            send(_file(codec, e, oid))
        send([_heartbeat(codec, e, 2, 4)])
        assert rx.proc.wait(timeout=20) == -9, rx.log.read_text()[-3000:]
        assert crash_marks(mark) == ["udp.before_unseen_saved"]  # the crash hit that window
        assert [(g["reason"], g["object_id"]) for g in read_gap_records(spool)] == [("unseen", 2)]
        assert _settled(spool, e) != 4  # the state does not know of the record
        assert len(list(inbox.iterdir())) == 3

        rx = RxProc(cfg_path, tmp_path / "rx2.log")  # the same environment: fired once only
        send([_heartbeat(codec, e, 3, 5), *_file(codec, e, 4)])
        settled(rx, 5)
        second = rx.stop()
        rx = RxProc(cfg_path, tmp_path / "rx3.log")  # stopped cleanly, started again
        send([_heartbeat(codec, e, 4, 6), *_file(codec, e, 5)])
        settled(rx, 6)
        third = rx.stop()
    finally:
        sock.close()
        if rx.proc.poll() is None:
            rx.kill9()
    assert [(g["reason"], g["object_id"]) for g in read_gap_records(spool)] == [("unseen", 2)]
    assert second["objects_unseen"] == third["objects_unseen"] == 0
    assert second["objects_completed"] == third["objects_completed"] == 1
    assert len(list(inbox.iterdir())) == 5


def test_a_file_that_arrives_after_its_unseen_record_is_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level("WARNING", logger="bridge.diode.udp_spool"),
        receiving(tmp_path, max_object_bytes=1 << 20) as rx,
    ):
        diode = Diode(rx.addr, hold={1})
        try:
            cfg = _sender_cfg(tmp_path, diode.address)
            files = _outbox_files(cfg, range(1, 4))
            sent = run_sender(cfg, until_idle=True, timeout=60)
            late = _ids(cfg, sent)[1]
            rx.wait(lambda: _unseen(rx.spool), "the unseen record")
            assert not (rx.inbox / late).exists()
            assert diode.release() > 0  # a relay that held them long: late, not lost
            rx.wait(lambda: (rx.inbox / late).exists(), "the late file")
            s = rx.finish()
        finally:
            diode.close()
    (rec,) = read_gap_records(rx.spool)  # the record stands, and is the only one
    assert (rec["reason"], rec["epoch"], rec["object_id"]) == ("unseen", sent.epoch, 1)
    assert _inbox(rx.inbox) == files
    assert s.objects_completed == 3 and s.objects_unseen == 1 and s.unseen_arrived_late == 1
    told = [r for r in caplog.records if "arrived after it was recorded unseen" in r.getMessage()]
    assert [(r.epoch, r.object_id) for r in told] == [(sent.epoch, 1)]  # type: ignore[attr-defined]
