"""Diode, UDP (red): `diode udp receive` — datagrams -> durable spool -> files in red's inbox.

A tight loop in its own process reads the one configured address, drops what does not
authenticate before any work, and hands symbols to the reassembler (``udp_spool``). Objects
whose blocks are all rebuilt go to a delivery thread that checks the SHA-256, writes the file
aside, fsyncs and renames it into the inbox (hashing and copying release the GIL, so the loop
keeps reading). Every datagram is counted: received, or dropped by reason.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.config import Config, UdpConfig
from bridge.diode.link_status import RECEIVER_LOCK
from bridge.diode.udp_decode import DecoderPool
from bridge.diode.udp_key import load_key
from bridge.diode.udp_socket import SocketDrops, set_rcvbuf
from bridge.diode.udp_spool import (
    Delivery,
    Reassembler,
    deliver,
    delivery_tmp_dir,
    discard_spooled,
    verify_and_read_name,
)
from bridge.errors import ConfigError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock, os_error_text
from bridge.logs import Recurring, get_logger, log_event
from bridge.metrics import UDP
from bridge.protocol.datagram import DatagramCodec, DatagramError, LinkHeartbeat
from bridge.signals import stop_on_signals

__all__ = ["ReceiveSummary", "run_receiver"]

log = get_logger("bridge.diode.udp_receiver")

_STATUS_EVERY = 1.0
AUTH_WARN_MIN = 10
"""Tag failures since the last status write that, at half the datagrams or more, warn."""
AUTH_WARN_EVERY = 60.0
"""At most one authentication warning this often (seconds)."""
_FLUSH_EVERY = 0.2
_BUF = 1 << 18
"""Receive buffer: more than a coalesced (GRO) buffer can hold (64 KiB)."""
_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the IntFlag's & costs ~0.8 µs a datagram
UDP_GRO = getattr(socket, "UDP_GRO", 104)
"""Linux's socket option (Python 3.11's socket module lacks the constant)."""


def in_flight_bytes(udp: UdpConfig) -> int:
    """Red, UDP receive (start): what the decoders may have to hold for the sender's interleaving
    as ``udp`` sets it: twice its window plus one block, in datagrams of up to ``udp.mtu`` (in a
    simulation at 0-1% loss they held up to ~1.3 x (window + block) symbols)."""
    s = udp.send
    return 2 * (s.interleave_datagrams + s.block_symbols) * udp.mtu


def _check_memory_cap(udp: UdpConfig) -> None:
    """Red, UDP receive (start): warn when ``max_held_bytes`` is below ``in_flight_bytes``: the
    receiver would evict objects while their symbols still arrive (a warning, not an error:
    this host's [udp.send] may not be the sender's)."""
    need, cap = in_flight_bytes(udp), udp.receive.max_held_bytes
    if cap < need:
        log_event(log, 30, "udp.receive.max_held_bytes is below what the sender's interleaving "
                  "keeps in flight: objects still arriving may be evicted as gaps",
                  max_held_bytes=cap, in_flight_bytes=need,
                  interleave_datagrams=udp.send.interleave_datagrams,
                  block_symbols=udp.send.block_symbols, mtu=udp.mtu,
                  fix=f"set udp.receive.max_held_bytes >= {need}, or lower the sender's "
                  "udp.send.interleave_datagrams (judged from this host's [udp.send]: the "
                  "sender's own config may differ)")  # fmt: skip


def _enable_gro(sock: socket.socket) -> bool:
    """Ask for coalesced receives (Linux >= 5.0); False where the kernel has no UDP GRO."""
    try:
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
        return True
    except OSError as e:
        log_event(log, 20, "UDP GRO unavailable: one system call per datagram", error=str(e))
        return False


def _segment_size(anc: list[tuple[int, int, bytes]]) -> int:
    """The datagram size of a coalesced buffer (0: the buffer is one datagram)."""
    for level, kind, data in anc:
        if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            return int(struct.unpack_from("=i", data)[0])
    return 0


@dataclass
class ReceiveSummary:
    """What one run of the receiver saw."""

    datagrams: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    objects_completed: int = 0
    objects_expired: int = 0
    objects_unseen: int = 0
    """Object ids no datagram ever came for, recorded as ``unseen`` gaps."""
    unseen_arrived_late: int = 0
    """Objects recorded ``unseen`` whose datagrams came after all (delivered all the same)."""
    duplicate_objects: int = 0
    repair_symbols_used: int = 0
    goodput_bytes: int = 0
    epoch: int | None = None
    epochs_seen: int = 0
    heartbeats: int = 0
    receive_calls: int = 0
    """System calls that returned datagrams (fewer than datagrams with UDP GRO)."""
    delivery_errors: int = 0
    """Deliveries into the inbox the disk refused (each retried; the object stays spooled)."""
    blocks_decoded_by_workers: int = 0
    """Blocks RaptorQ rebuilt in decoder worker processes (they had lost a source symbol)."""
    blocks_decoded_here: int = 0
    """Such blocks rebuilt in the receiver's process: decode_workers = 0, a worker lost with
    blocks in hand, every slot busy and the queue full, or while rebuilding the spool at
    start."""
    decode_workers_lost: int = 0
    socket_overflows: int | None = 0
    """Datagrams the kernel dropped because the socket's receive buffer was full (the receiver
    fell behind: not line loss); None where the kernel does not tell (no /proc/net/udp)."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["dropped"] = dict(self.dropped)
        d["goodput_mb_per_s"] = (
            round(self.goodput_bytes / self.seconds / 1e6, 2) if self.seconds else 0.0
        )
        return d


class _Receiver:
    def __init__(self, cfg: Config, stop: threading.Event) -> None:
        if cfg.udp is None:
            raise ConfigError("no [udp] section: `diode udp receive` needs one")
        self.u = cfg.udp.receive
        _check_memory_cap(cfg.udp)
        self.stop = stop
        self.codec = DatagramCodec(load_key(cfg.udp.key_file))
        self.inbox = Path(self.u.inbox or cfg.red.inbox)
        self.root = Path(self.u.spool_dir)
        self._status_refused = Recurring()
        """The status file refused (a full disk): said once a minute while it lasts."""
        host, _, port = self.u.bind.rpartition(":")
        host = host.strip("[]")
        self.sock = socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
        )
        self.rcvbuf = self._rcvbuf()
        try:
            self.sock.bind((host, int(port)))
        except OSError as e:
            self.sock.close()
            raise ConfigError(
                f"udp.receive.bind {self.u.bind}: cannot bind ({e.strerror}); name an address "
                "of this host that no other process uses"
            ) from None
        self.sock.setblocking(False)  # one recv per datagram, no poll before each
        self.gro = self.u.gro == "auto" and _enable_gro(self.sock)
        self.summary = ReceiveSummary()
        self.heartbeat: dict[str, Any] | None = None
        self.heard = 0.0
        self.started = time.time()
        self._hb_last = (-1, -1)  # (epoch, packet) of the last heartbeat taken
        self._hb_epoch = -1
        self._hb_channels: dict[str, dict[str, int | None]] = {}  # of epoch _hb_epoch
        self.work: queue.Queue[Delivery | None] = queue.Queue()
        self.lock = threading.Lock()
        self._pushed: dict[str, int] = {}
        self._t0 = time.monotonic()
        """When the receive loop began (monotonic): the status file's ``seconds`` count from it."""
        self._auth = (0, 0, 0.0)
        """(datagrams, tag failures) at the last authentication check, and when it last warned."""
        self._overflows = SocketDrops(self.sock)

    def _rcvbuf(self) -> int:
        want = self.u.rcvbuf_bytes
        got = set_rcvbuf(self.sock, want)
        if got < want:
            log_event(log, 30, "socket receive buffer smaller than asked: bursts may be lost",
                      asked=want, granted=got,
                      fix="run as root (SO_RCVBUFFORCE) or raise net.core.rmem_max")  # fmt: skip
        return got

    # -- delivery thread ------------------------------------------------------------------
    def _deliver_loop(self, ra: Reassembler, tmp: Path) -> None:
        while True:
            d = self.work.get()
            if d is None:
                return
            delay = 1.0
            while True:
                try:
                    self._deliver_one(ra, d, tmp)
                    break
                except Exception as e:  # noqa: BLE001 - the thread must outlive any failure
                    if isinstance(e, FileNotFoundError) and not (d.path / "data").exists():
                        self._spooled_data_gone(ra, d)  # removed by hand: retrying cannot help
                        break
                    # the disk (full, I/O error), or anything else: the object stays spooled;
                    # a thread that died here would leave every later object undelivered
                    with self.lock:
                        self.summary.delivery_errors += 1
                    stopping = self.stop.is_set()
                    error = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
                    log_event(log, 40, "delivery into the inbox failed: kept in the spool, "
                              + ("delivered at the next start" if stopping else "retried"),
                              object_id=d.header.object_id, epoch=d.epoch, error=error,
                              retry_seconds=None if stopping else delay)  # fmt: skip
                    if not isinstance(e, OSError):
                        log.debug("delivery failure trace", exc_info=True)
                    if stopping or self.stop.wait(delay):
                        break
                    delay = min(delay * 2, 30.0)

    def _spooled_data_gone(self, ra: Reassembler, d: Delivery) -> None:
        """The rebuilt object's ``data`` file vanished before its delivery (removed by hand,
        or with the spool): a ``spool_error`` gap red sees, never a retry that cannot end."""
        self._give_up(ra, d, "spool_error", f"spooled data file gone: {d.path / 'data'}")

    def _give_up(self, ra: Reassembler, d: Delivery, reason: str, error: str | None = None) -> None:
        """Record a rebuilt object that is not delivered as a gap; its spooled files go once
        the record is durable (:meth:`Reassembler.fail`)."""
        with self.lock:
            discard = ra.fail(d, reason, error)
        if discard:  # else kept until the disk takes its gap record
            discard_spooled(d)

    def _deliver_one(self, ra: Reassembler, d: Delivery, tmp: Path) -> None:
        checked = verify_and_read_name(d)
        h = d.header
        if isinstance(checked, str):
            self._give_up(ra, d, checked)
            return
        name, offset = checked
        final, outcome = deliver(d, name, offset, tmp, self.inbox)
        # disk work (fsync, rmtree of a data file of up to max_object_bytes) outside the lock
        # the receive loop takes for every datagram: it would stall the loop into losses
        ra.journal_delivered(d, final)
        with self.lock:
            ra.remember_delivered(d)
            s = self.summary
            if outcome == "duplicate":
                s.duplicate_objects += 1
            else:
                s.objects_completed += 1
                s.goodput_bytes += h.length - offset
                s.repair_symbols_used += d.repairs_used
        discard_spooled(d)
        if outcome != "duplicate":
            UDP.objects_completed.labels(h.channel).inc()
            UDP.goodput_bytes.inc(h.length - offset)
            UDP.repair_symbols_used.inc(d.repairs_used)
        level = 40 if outcome == "renamed" else 20
        log_event(log, level, f"udp object {outcome}", file_name=final, channel=h.channel,
                  seq=h.seq, bytes=h.length - offset, epoch=d.epoch, object_id=h.object_id,
                  repairs_used=d.repairs_used)  # fmt: skip

    # -- the loop -------------------------------------------------------------------------
    def _on_heartbeat(self, hb: LinkHeartbeat, ra: Reassembler) -> str | None:
        """Take a link heartbeat; the reason it is dropped instead, if it is: ``stale_epoch``
        (an older sender session's straggler says nothing about the link now) or
        ``replayed`` (a packet number not above the last heartbeat's of its epoch)."""
        if hb.epoch < (self.summary.epoch or 0):
            return "stale_epoch"
        if (hb.epoch, hb.packet) <= self._hb_last:
            return "replayed"
        self._hb_last = (hb.epoch, hb.packet)
        self.summary.heartbeats += 1
        self._epoch(hb.epoch)
        self.heard = time.time()
        channels = self._merge_channels(hb)
        started = hb.counters.get("objects_started")  # absent from an older sender's
        if hb.parts == 1 or len(channels) > 1:
            # a round's first part heard names one channel of several: wait for another part,
            # lest the epoch be taken for a one-channel sender (its unseen records named so)
            ra.heard(hb.epoch, started if type(started) is int and started >= 0 else None,
                     channels)  # fmt: skip
        self.heartbeat = {
            "epoch": hb.epoch,
            "sender_time": hb.sender_time,
            "interval_seconds": hb.interval_seconds,
            "channels": channels,
            "counters": hb.counters,
            "part": hb.part,
            "parts": hb.parts,
            "received_at": self.heard,
        }
        return None

    def _merge_channels(self, hb: LinkHeartbeat) -> dict[str, dict[str, int | None]]:
        """The channels the epoch's heartbeats named, each as its latest heartbeat told it: a
        round split over several datagrams (many channels) carries a share in each."""
        if hb.epoch != self._hb_epoch:
            self._hb_epoch, self._hb_channels = hb.epoch, {}
        self._hb_channels.update(hb.channels)
        return dict(sorted(self._hb_channels.items()))

    def _epoch(self, epoch: int) -> None:
        cur = self.summary.epoch
        if cur is None or epoch > cur:
            if cur is None:
                log_event(log, 20, "sender epoch seen", epoch=epoch)
            else:
                log_event(log, 30, "sender restarted: new epoch", old_epoch=cur, epoch=epoch)
            self.summary.epoch = epoch
            self.summary.epochs_seen += 1
            UDP.sender_epoch.set(epoch)

    def _check_auth(self, datagrams: int, tags: int) -> None:
        """Warn (at most every AUTH_WARN_EVERY s) while most datagrams fail their tag check: a
        wrong udp.key_file on one side looks like silence otherwise (only a counter rises)."""
        seen, failed, warned = self._auth
        new, bad = datagrams - seen, tags - failed
        now = time.monotonic()
        if bad >= AUTH_WARN_MIN and 2 * bad >= new and now - warned >= AUTH_WARN_EVERY:
            log_event(log, 30, "datagrams fail authentication: udp.key_file differs between "
                      "the sides (compare sha256sum of both), another sender uses this address, "
                      "or the line corrupts them", failed=bad, received=new, bind=self.u.bind,
                      dropped_tag_total=tags)  # fmt: skip
            warned = now
        self._auth = (datagrams, tags, warned)

    def _count_decodes(self, ra: Reassembler) -> None:
        s = self.summary
        s.blocks_decoded_by_workers = ra.rebuilt_by_workers
        s.blocks_decoded_here = ra.rebuilt - ra.rebuilt_by_workers
        s.decode_workers_lost = ra.decoder.lost_workers if ra.decoder else 0

    def _status(self, ra: Reassembler) -> None:
        with self.lock:
            s = self.summary
            self._count_decodes(ra)
            for reason, n in ra.dropped.items():
                s.dropped[reason] = n
            s.objects_expired = ra.expired  # every gap: timeout, eviction, spool or digest error
            s.objects_unseen, s.unseen_arrived_late = ra.unseen_recorded, ra.unseen_arrived
            s.socket_overflows = self._overflows.since_start()
            s.seconds = round(time.monotonic() - self._t0, 3)  # so far: goodput is the run's
            doc = {
                "written_at": time.time(),
                "pid": os.getpid(),
                "bind": self.u.bind,
                "rcvbuf_bytes": self.rcvbuf,
                "open_objects": len(ra.open),
                "held_bytes": ra.held,
                "max_held_bytes": ra.max_held,
                "heartbeat": self.heartbeat,
                "heartbeat_age_seconds": round(time.time() - self.heard, 1) if self.heard else None,
                **s.to_json(),
            }
        pushed = self._pushed  # metrics in bulk: a labelled inc() per datagram costs too much
        UDP.datagrams_received.inc(s.datagrams - pushed.get("", 0))
        pushed[""] = s.datagrams
        dropped = dict(ra.dropped)
        if s.socket_overflows is not None:  # never read by the loop: the kernel dropped them
            dropped["socket_overflow"] = s.socket_overflows
        for reason, n in dropped.items():
            UDP.datagrams_dropped.labels(reason).inc(n - pushed.get(reason, 0))
            pushed[reason] = n
        UDP.heartbeat_age.set(time.time() - (self.heard or self.started))  # none yet: since start
        self._check_auth(s.datagrams, dropped.get("tag", 0))
        UDP.open_objects.set(len(ra.open))
        try:
            atomic_write_bytes(self.root / "status.json", json.dumps(doc).encode(), mode=0o600)
        except OSError as e:  # a full disk must not stop the receive loop; metrics still run
            if self._status_refused.due(os_error_text(e)):  # once a minute while it lasts
                log_event(log, 40, "receiver status file not written (said once a minute while "
                          "it lasts)", error=str(e), path=str(self.root / "status.json"),
                          )  # fmt: skip
        else:
            if self._status_refused.over():
                log_event(log, 30, "receiver status file written again",
                          path=str(self.root / "status.json"))  # fmt: skip

    def run(
        self, timeout: float | None, ready: Callable[[tuple[str, int]], None] | None
    ) -> ReceiveSummary:
        durable_mkdir(self.root)
        durable_mkdir(self.inbox)
        with exclusive_lock(
            self.root / RECEIVER_LOCK, what="udp receiver",
            hint="another `diode udp receive` uses this udp.receive.spool_dir; stop it first",
        ):  # fmt: skip
            try:
                return self._run(timeout, ready)
            finally:
                self.sock.close()

    def _run(
        self, timeout: float | None, ready: Callable[[tuple[str, int]], None] | None
    ) -> ReceiveSummary:
        pool: DecoderPool[Any] | None
        try:
            pool = (
                DecoderPool(self.u.decode_workers, on_lost=self._decoder_lost)
                if self.u.decode_workers
                else None
            )
        except OSError as e:
            raise ConfigError(
                f"udp.receive.decode_workers = {self.u.decode_workers}: a decoder worker could "
                f"not start ({e}); set decode_workers = 0 to decode in the receiver's process"
            ) from None
        try:
            return self._receive(timeout, ready, pool)
        finally:
            if pool is not None:
                pool.close()

    def _decoder_lost(self, pid: int, code: int | None, why: str, held: int, left: int) -> None:
        log_event(
            log, 40, "udp decoder worker lost: its blocks are decoded in the receiver",
            pid=pid, exit_code=code, why=why, blocks_held=held, workers_left=left,
        )  # fmt: skip

    def _receive(
        self,
        timeout: float | None,
        ready: Callable[[tuple[str, int]], None] | None,
        pool: DecoderPool[Any] | None,
    ) -> ReceiveSummary:
        ra = Reassembler(
            self.root,
            max_object_bytes=self.u.max_object_bytes,
            max_open_objects=self.u.max_open_objects,
            max_held_bytes=self.u.max_held_bytes,
            decoder=pool,
        )
        t0 = self._t0 = time.monotonic()
        tmp = delivery_tmp_dir(self.root, self.inbox)
        rebuilt = ra.recover(t0, tmp)
        worker = threading.Thread(target=self._deliver_loop, args=(ra, tmp), daemon=True)
        worker.start()
        log_event(log, 20, "udp receiver listening", bind=self.u.bind, inbox=str(self.inbox),
                  rcvbuf=self.rcvbuf, objects_rebuilt=rebuilt)  # fmt: skip
        self._status(ra)
        if ready is not None:
            ready(self.sock.getsockname()[:2])
        deadline = None if timeout is None else t0 + timeout
        buf = bytearray(_BUF)
        view = memoryview(buf)
        recv_into, recvmsg_into = self.sock.recv_into, self.sock.recvmsg_into
        gro, anc_size = self.gro, socket.CMSG_SPACE(4)
        wait = select.poll()
        wait.register(self.sock, select.POLLIN)
        open_ = self.codec.open
        dropped, s = ra.dropped, self.summary
        last_status = last_flush = last_expire = time.monotonic()
        epoch = -1
        try:
            while not self.stop.is_set():
                while ra.ready:
                    self.work.put(ra.ready.popleft())
                batch_now = time.monotonic()
                for _ in range(1024):
                    try:
                        if gro:
                            n, anc, flags, _ = recvmsg_into((buf,), anc_size)
                            seg = _segment_size(anc) or n
                            if n == _BUF and flags & _TRUNC:  # larger than any UDP datagram
                                dropped["malformed"] = dropped.get("malformed", 0) + 1
                                continue
                        else:
                            n = seg = recv_into(buf)
                    except BlockingIOError:
                        wait.poll(5 if ra.decoding() else 200)
                        break
                    s.receive_calls += 1
                    for off in range(0, n, seg) if seg else (0,):
                        s.datagrams += 1
                        try:
                            dg = open_(view[off : min(off + seg, n)])
                        except DatagramError as e:
                            dropped[e.reason] = dropped.get(e.reason, 0) + 1
                            continue
                        if type(dg) is LinkHeartbeat:
                            why = self._on_heartbeat(dg, ra)
                            if why is not None:
                                dropped[why] = dropped.get(why, 0) + 1
                            continue
                        if dg.epoch != epoch:  # type: ignore[union-attr]
                            epoch = dg.epoch
                            self._epoch(epoch)
                        with self.lock:
                            try:
                                ra.add(dg, batch_now)  # type: ignore[arg-type]
                            except OSError as e:  # the spool's disk: that object is a gap
                                ra.give_up(dg.epoch, dg.obj, e)  # type: ignore[union-attr]
                    if ra.ready:
                        break
                if ra.decoding():
                    with self.lock:
                        ra.take_decoded()
                now = time.monotonic()
                if now - last_flush >= _FLUSH_EVERY:
                    last_flush = now
                    with self.lock:
                        ra.flush_all()  # a write the disk refuses gives that object up
                if now - last_expire >= 1.0:
                    last_expire = now
                    with self.lock:
                        ra.expire_idle(now, self.u.expire_seconds)
                        ra.report_unseen(time.time(), self.u.expire_seconds)
                        ra.write_gaps()
                        ra.save_unseen(time.time())
                if now - last_status >= _STATUS_EVERY:
                    last_status = now
                    self._status(ra)
                if deadline is not None and now > deadline:
                    break
        finally:
            try:  # let the blocks in the workers' hands complete (a restart would decode them
                drain_until = time.monotonic() + 10  # again from the spool)
                while ra.decoding() and time.monotonic() < drain_until:
                    with self.lock:
                        ra.take_decoded(0.1)
            finally:
                with self.lock:
                    ra.flush_all()
                    ra.wait_compactions()  # a stop leaves the new log in place, not a .tmp
                    self._count_decodes(ra)
                    ra.save_unseen(time.time(), force=True)
            while ra.ready:
                self.work.put(ra.ready.popleft())
            self.work.put(None)
            worker.join(timeout=600)
            with self.lock:
                if left := ra.write_gaps():
                    log_event(log, 40, "udp receiver stopped with gap records the disk refused: "
                              "their objects' folders are kept in the spool and recorded again "
                              "at the next start", pending=left, spool=str(self.root))  # fmt: skip
            s.seconds = round(time.monotonic() - t0, 3)
            self._status(ra)
        log_event(log, 20, "udp receiver stopped", **s.to_json())
        return s


def run_receiver(
    cfg: Config,
    *,
    stop: threading.Event | None = None,
    timeout: float | None = None,
    ready: Callable[[tuple[str, int]], None] | None = None,
) -> ReceiveSummary:
    """Receive until stopped (SIGTERM / SIGINT in the main thread), or for ``timeout`` s."""
    with stop_on_signals(stop or threading.Event()) as ev:
        return _Receiver(cfg, ev).run(timeout, ready)
