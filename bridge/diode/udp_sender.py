"""Diode, UDP (black): `diode udp send` — the outbox's mover for "udp" channels, as datagrams.

    outbox/<file of a udp channel> --envelope, SHA-256--> blocks --RaptorQ--> symbols
        --stamp (a block's datagrams, headers written at once)--> interleave
        --number, tag (a batch at a time)--> token bucket --> sendmsg --> diode --> receiver

Each run is a new *epoch* (stored durably before the first datagram, strictly above every
earlier one), so the receiver knows a restart for what it is. Before the first datagram of a
file, the journal records it as ``sending``; after its last datagram (of the last copy),
``sent``, then the file is unlinked from the outbox (black keeps its archive copy for `diode
resend`). A restart unlinks files already ``sent`` and sends the others again, whole, under
the new epoch: nothing is skipped, at most the files in flight are repeated.

The journal is the gate: no datagram of a file goes before its ``sending`` record, and a file
leaves the outbox only once its ``sent`` record is durable. When udp.send.state_dir refuses a
record (full, an I/O error), no new file starts and a file sent whole stays in the outbox
(queued: never taken again) until the record is written, tried again every second; heartbeats
go on. Stopped first, such a file counts as in flight: it goes again at the next start. The
status file and the journal's compaction only inform and tidy: a write of them refused is
logged (at most a minute apart while it lasts) and tried again, never fatal. A compaction keeps
the record of every file still in the outbox, so a file sent but not yet removed stays known.

A sent file the sender may not remove (permissions, an immutable or read-only outbox) is logged
once with the fix, counted (``undeletable``) and left there, remembered as sent: the journal's
``sent`` record makes every later run remove it, or leave it again, never send it again.

A file is taken once it is settled (unchanged for ``settle_seconds``: a writer filling it in
place is waited for); it is digested a slice per loop turn (heartbeats keep their period on a
large file) and read block by block, its descriptor closed once its last block is read (one
outbox file open at a time, however many small files the interleaver spreads). A file that
cannot be read is logged, counted and left alone until it changes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.config import Config
from bridge.diode.link_status import SENDER_LOCK
from bridge.diode.udp_batch import MAX_SEGMENTS, DatagramBatcher
from bridge.diode.udp_encode import EncoderPool, slot_bytes_for
from bridge.diode.udp_fec import (
    block_count,
    block_plan,
    padded_block,
    repair_count,
)
from bridge.diode.udp_interleave import Interleaver
from bridge.diode.udp_key import load_key
from bridge.diode.udp_pacing import TokenBucket
from bridge.diode.udp_socket import route_mtu, route_source
from bridge.errors import ConfigError, TransportError
from bridge.faults import crash_point, slow_point
from bridge.fsutil import (
    atomic_write_bytes,
    durable_mkdir,
    exclusive_lock,
    fsync_dir,
    os_error_text,
    tmp_path_for,
    write_all,
    write_new_file,
    write_refusal,
)
from bridge.logs import Recurring, get_logger, log_event
from bridge.metrics import UDP
from bridge.protocol.datagram import (
    DatagramCodec,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    SymbolSealer,
    heartbeat_room,
    split_heartbeat,
    symbol_size_for,
)
from bridge.protocol.naming import parse_bundle_name, parse_heartbeat_name
from bridge.signals import stop_on_signals

__all__ = ["SendSummary", "Journal", "run_sender", "envelope_prefix"]

log = get_logger("bridge.diode.udp_sender")

JOURNAL = "journal.jsonl"
EPOCH = "epoch"
_JOURNAL_COMPACT_BYTES = 4 << 20
_CHUNK = 1 << 20
_TURN_DATAGRAMS = 256
"""Datagrams sent per loop turn at most (then the clock: heartbeats, status)."""
_DIGEST_SLICE = 0.02
"""Seconds of hashing per loop turn at most (then heartbeats and sends get their turn)."""
RECENT_FILES = 10_000
"""Names of files sent kept in the summary (the most recent); ``files_sent`` counts them all."""
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
"""Errors of the process, not of the file: it is tried again at the next scan."""
JOURNAL_RETRY_S = 1.0
"""After the state dir refused a journal record: seconds until it is tried again (no file
starts meanwhile)."""
COMPACT_RETRY_S = (1.0, 60.0)
"""After the state dir refused a compaction: seconds until it is tried again, first and at most
(doubling: a rewrite of megabytes each second would take what room a full disk frees)."""
REFUSED_LOG_S = 60.0
"""How often at most the sender logs that the state dir still refuses a write, for one reason."""
_FIX_STATE = "free space on, or give the sender's user write access to, udp.send.state_dir"
_REFUSED = {
    "journal": (
        40,
        "udp sender journal record not written: no file starts until it is, tried again",
        "heartbeats go on; a file sent whole stays in the outbox until its sent record is "
        "written (stopped first, it goes again at the next start)",
    ),
    "status": (
        30,
        "udp sender status file not written: tried again",
        "the sender goes on; its status file (diode status, diode udp status) grows old",
    ),
    "compaction": (
        30,
        "udp sender journal not compacted: tried again",
        "the sender goes on; the journal keeps growing until it is compacted",
    ),
}
"""What the state dir refused: log level, message, what it means."""

FileKey = tuple[int, int, int, int]
"""(inode, size, mtime, ctime in ns) of an outbox file: a change of any (a write, a chmod) makes
it a new file."""
_NO_KEY: FileKey = (-1, -1, -1, -1)


def file_key(st: os.stat_result) -> FileKey:
    """The key of a stat'ed outbox file."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def envelope_prefix(name: str) -> bytes:
    """The bytes before the file's own in an object: u16 name length, then the name."""
    raw = name.encode("ascii")
    return len(raw).to_bytes(2, "big") + raw


@dataclass
class SendSummary:
    """What one run of the sender did."""

    epoch: int = 0
    files: list[str] = field(default_factory=list)
    """The most recent names sent (at most RECENT_FILES; ``files_sent`` counts them all)."""
    files_sent: int = 0
    datagrams: int = 0
    bytes: int = 0
    file_bytes: int = 0
    skipped: int = 0
    unreadable: int = 0
    """Outbox files the sender could not read (logged; left alone until they change)."""
    already_sent: int = 0
    undeletable: int = 0
    """Files sent (in this run or before a restart) the sender may not remove from the outbox
    (logged once each, with the fix): left there, never sent again."""
    state_errors: int = 0
    """Writes udp.send.state_dir refused: journal records, status files, compactions (logged;
    tried again)."""
    unjournaled: int = 0
    """Files sent whole whose ``sent`` record the state dir refused, not written yet (kept in
    the outbox; those left when the run ends go again at the next start)."""
    heartbeats: int = 0
    """Link heartbeat datagrams (a round with many channels is several)."""
    heartbeat_errors: int = 0
    """Heartbeat datagrams not sent: they could not be sealed (logged)."""
    send_calls: int = 0
    """System calls that sent datagrams (fewer than datagrams with UDP GSO)."""
    encode_workers_lost: int = 0
    """Encoder worker processes that exited under the sender (their blocks were re-encoded)."""
    blocks_encoded_here: int = 0
    """Blocks encoded in the sender's own process (encode_workers = 0, or workers lost)."""
    seconds: float = 0.0

    def sent(self, name: str) -> None:
        """Count a file sent; keep its name among the recent ones."""
        self.files_sent += 1
        self.files.append(name)
        if len(self.files) >= 2 * RECENT_FILES:
            del self.files[:-RECENT_FILES]

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["files"] = self.files_sent
        d["mb_per_s"] = round(self.file_bytes / self.seconds / 1e6, 2) if self.seconds else 0.0
        return d


class Journal:
    """Append-only JSON lines, one fsync per record; the last record of a name wins."""

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / JOURNAL
        self.last: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line: that record was never durable
                if isinstance(rec, dict) and isinstance(rec.get("name"), str):
                    self.last[rec["name"]] = rec
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._tail_unsure = False
        """An append failed: the file may end in part of a record, cut off before the next."""
        self._dir_unsynced = False
        """A compaction's rename is not known durable: the folder is fsynced before the next
        record, so no record goes into a file a power loss could take back."""
        self._kept = 0
        """Bytes the last compaction kept: the next is due at twice that (never rewriting a
        journal of mostly kept records over and over)."""
        self._cut_torn_line()

    def _cut_torn_line(self, *, said: bool = False) -> None:
        """Cut a torn last line (power loss mid-append) back to the last newline, fsynced, so
        the next record starts on a line of its own instead of being glued onto it (logged
        unless ``said``: an append refused at run time, logged as such)."""
        end = os.fstat(self._fd).st_size
        if not end or os.pread(self._fd, 1, end - 1) == b"\n":
            return
        keep = end
        while keep > 0:
            start = max(0, keep - _CHUNK)
            at = os.pread(self._fd, keep - start, start).rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            keep = start
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)
        if not said:
            log_event(log, 30, "sender journal ended in a torn record: cut off",
                      path=str(self.path), bytes_cut=end - keep)  # fmt: skip

    def record(self, **rec: Any) -> None:
        """Append ``rec`` and fsync it. OSError when the disk refuses (full, an I/O error): the
        record is not taken (``last`` unchanged), and part of it written is cut off before the
        next one, which starts on a line of its own."""
        rec["time"] = round(time.time(), 3)
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        if self._dir_unsynced:
            fsync_dir(self.path.parent)
            self._dir_unsynced = False
        if self._tail_unsure:
            self._cut_torn_line(said=True)
            self._tail_unsure = False
        try:
            write_all(self._fd, line)
            os.fsync(self._fd)
        except OSError:
            self._tail_unsure = True
            raise
        self.last[rec["name"]] = rec

    def due(self) -> bool:
        """True once the journal has grown past its compaction size (and twice what the last
        compaction kept)."""
        return os.fstat(self._fd).st_size >= max(_JOURNAL_COMPACT_BYTES, 2 * self._kept)

    def compact(self, keep: set[str]) -> None:
        """Rewrite with the last record of each name in ``keep`` (files still in the outbox).
        OSError (the disk refused) leaves the journal as it was, still appended to: the new
        file is opened before it replaces the old one."""
        last = {n: r for n, r in self.last.items() if n in keep}
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in last.values()).encode()
        tmp = tmp_path_for(self.path)
        fd = -1
        try:
            write_new_file(tmp, text, mode=0o600)
            fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            os.replace(tmp, self.path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(self._fd)
        self._fd, self.last, self._tail_unsure, self._kept = fd, last, False, len(text)
        self._dir_unsynced = True
        fsync_dir(self.path.parent)
        self._dir_unsynced = False

    def close(self) -> None:
        os.close(self._fd)


def _same_file_sent(done: dict[str, Any] | None, digest: str, st: os.stat_result) -> bool:
    """True when the journal's last record of a name says this very file was sent: same digest,
    inode and mtime (a crash between "sent" and the unlink). A copy dropped again under that
    name (``diode resend``) is a new file and is sent again, even with the same bytes."""
    return (
        done is not None
        and done.get("state") == "sent"
        and done.get("digest") == digest
        and done.get("ino") == st.st_ino
        and done.get("mtime_ns") == st.st_mtime_ns
    )


def _make_state_dir(d: Path) -> None:
    """Black, UDP send (start): create ``udp.send.state_dir`` and check the sender can create,
    rename and remove files there; a ConfigError with the fix otherwise (a raw OSError from
    its lock or first journal record before)."""
    try:
        durable_mkdir(d)
    except OSError as e:
        raise ConfigError(
            f"cannot create udp.send.state_dir {d}: {os_error_text(e)}; {_FIX_STATE}, or point "
            "it elsewhere"
        ) from None
    refused = write_refusal(d, visible=True)
    if refused is not None:
        raise ConfigError(
            f"udp.send.state_dir {d} refuses the sender's files (uid {os.getuid()}; "
            f"{os_error_text(refused)}): {_FIX_STATE} (an immutable or append-only attribute: "
            f"lsattr -d {d}; chattr -i -a), or point it elsewhere"
        )


def _still(name: str, key: FileKey, before: dict[str, FileKey], now: dict[str, FileKey]) -> bool:
    """True when ``before`` remembers this very file (same key): it is remembered in ``now``."""
    if before.get(name) != key:
        return False
    now[name] = key
    return True


def _names_in(d: Path) -> set[str]:
    """The names in directory ``d`` (none when it is missing)."""
    try:
        return set(os.listdir(d))
    except FileNotFoundError:
        return set()


def _new_epoch(state_dir: Path) -> int:
    path = state_dir / EPOCH
    prev = 0
    if path.exists():
        try:
            prev = int(path.read_text().strip())
        except ValueError:
            raise TransportError(
                f"{path} is damaged; write into it a number above the last epoch the receiver "
                "logged (or the current time in ns) and start again"
            ) from None
    epoch = max(prev + 1, time.time_ns())
    atomic_write_bytes(path, f"{epoch}\n".encode(), mode=0o600)
    return epoch


@dataclass
class _Opening:
    """An outbox file being digested (a slice per loop turn) before its first datagram."""

    path: Path
    fd: int
    st: os.stat_result
    digest: Any
    off: int = 0


@dataclass
class _Object:
    """One file being sent: its header, its descriptor (-1 once its last block is read), what
    is left to send."""

    path: Path
    name: str
    channel: str
    header: ObjectHeader
    sealer: SymbolSealer
    fd: int
    ino: int
    size: int
    copy: int = 0
    next_block: int = 0
    blocks_open: int = 0
    failed: bool = False
    mtime_ns: int = 0
    started: bool = False
    """A datagram of it was handed to the socket (heartbeats count it in objects_started)."""
    changed: bool = False
    """Its size or mtime differed from the digest's when its last block was read."""


@dataclass(slots=True, eq=False)
class _Block:
    """One FEC block being sent: its datagrams stamped (``SymbolSealer.stamp``), ``size``
    bytes apart, in symbol order (source symbols 0..k-1, then the repair symbols)."""

    obj: _Object
    index: int
    datagrams: memoryview
    size: int
    k: int
    left: int


class _Sender:
    def __init__(self, cfg: Config, stop: threading.Event) -> None:
        if cfg.udp is None:
            raise ConfigError(
                "no [udp] section: `diode udp send` needs one (conf/diode.example.toml)"
            )
        self.channels = set(cfg.udp_channels())
        if not self.channels:
            raise ConfigError(
                'no channel has transport = "udp": nothing for `diode udp send` to carry'
            )
        self.cfg, self.u, self.stop = cfg, cfg.udp.send, stop
        self.mtu = cfg.udp.mtu
        self.outbox = cfg.udp_outbox()  # black.udp_outbox, else the outbox
        self.codec = DatagramCodec(load_key(cfg.udp.key_file))
        host, _, port = self.u.destination.rpartition(":")
        self.dest = (host.strip("[]"), int(port))
        self.ipv6 = ":" in self.dest[0]
        route = route_mtu(self.dest, ipv6=self.ipv6)
        if route is not None and route < self.mtu:
            raise ConfigError(
                f"udp.mtu = {self.mtu} but the route to {self.u.destination} has MTU {route} "
                f"(`ip route get {self.dest[0]}`): every full datagram would be split into IP "
                f"fragments, which many diodes drop; set udp.mtu = {route} on both sides"
            )
        self.sock = socket.socket(
            socket.AF_INET6 if self.ipv6 else socket.AF_INET, socket.SOCK_DGRAM
        )
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        if self.u.source:
            shost, _, sport = self.u.source.rpartition(":")
            try:
                self.sock.bind((shost.strip("[]"), int(sport)))
            except OSError as e:
                raise ConfigError(f"udp.send.source {self.u.source}: cannot bind ({e})") from None
        elif (src := route_source(self.dest, ipv6=self.ipv6)) is not None:
            # bound to the route's own address: a first send would bind every interface
            self.sock.bind((src, 0))
        self.state_dir = Path(self.u.state_dir)
        self.summary = SendSummary()
        self.queue: deque[Path] = deque()
        self.queued: dict[str, FileKey] = {}
        """Names queued or being sent, with their key when the scan took them."""
        self.settling: dict[str, tuple[FileKey, float]] = {}
        """Files seen but not settled yet: their key and when (monotonic) it was first seen."""
        self.settle_due: float | None = None
        """When (monotonic) the next settling file may be settled: scan then."""
        self.unreadable: dict[str, FileKey] = {}
        """Files that could not be read, by name: left alone until their key changes."""
        self.undeletable: dict[str, FileKey] = {}
        """Files sent that could not be removed, by name: left alone until their key changes
        (then the journal's ``sent`` record has the next try remove them, unsent)."""
        self.unjournaled: deque[_Object] = deque()
        """Files sent whole whose ``sent`` record the state dir refused, oldest first: kept
        queued (in the outbox, never taken again) until it is written."""
        self.journal_retry_at = 0.0
        """While the state dir refuses journal records: when (monotonic) to try again; 0 else."""
        self.refused: dict[str, Recurring] = {}
        """What the state dir refuses now (``_REFUSED``'s keys): why, and when it was logged."""
        self.compact_retry = (0.0, 0.0)
        """After a compaction was refused: when (monotonic) to try again, and the wait before."""
        self.opening: _Opening | None = None
        self.digest_until = 0.0
        """This loop turn's hashing ends then (monotonic)."""
        self.feeding: _Object | None = None
        self.il: Interleaver[_Block] = Interleaver(self.u.interleave_datagrams)
        self.packet = 0
        self.object_id = 0
        self.unstarted: dict[int, None] = {}
        """Ids given to objects no datagram of which was sent yet, lowest first."""
        self.per_channel: dict[str, dict[str, int | None]] = {
            c: {"last_seq": None, "objects": 0} for c in sorted(self.channels)
        }
        self.last_heartbeat = 0.0
        self.started = time.monotonic()
        """When ``run`` began (monotonic): the status file's ``seconds`` count from it."""
        self.hb_room = heartbeat_room(self.mtu, ipv6=self.ipv6)
        self.last_status = 0.0
        self.repairs_sent = 0
        self._pushed = (0, 0, 0)  # datagrams, repairs, bytes already added to the metrics
        self.bucket = TokenBucket(
            self.u.rate_bytes_per_second, self.u.burst_bytes, time.monotonic()
        )
        self.finished: list[_Block] = []  # blocks whose last symbol waits in the batch
        self.pool: EncoderPool[tuple[_Object, int, int]] = EncoderPool(0, 0)  # run() starts it
        self.batch = DatagramBatcher(
            self.sock,
            self.dest,
            gso=self.u.gso == "auto",
            # a batch is paced as one: at most 50 ms of the rate, so heartbeats keep time
            max_bytes=int(self.u.rate_bytes_per_second * 0.05),
            pace=self._pace,
            on_sent=self._sent,
        )

    # -- outbox --------------------------------------------------------------------------
    def _ours(self, name: str) -> tuple[str, ObjectKind, int] | None:
        for parse, kind in (
            (parse_bundle_name, ObjectKind.BUNDLE),
            (parse_heartbeat_name, ObjectKind.HEARTBEAT_FILE),
        ):
            try:
                parsed = parse(name)
            except Exception:  # noqa: BLE001 - any name that is not ours is left alone
                continue
            seq = getattr(parsed, "bundle_seq", None) or getattr(parsed, "heartbeat_seq", 0)
            if parsed.channel in self.channels:
                return parsed.channel, kind, int(seq or 0)
            return None
        return None

    def scan(self) -> int:
        """Queue the settled outbox files of udp channels not queued yet (oldest first)."""
        found: list[tuple[float, str, Path]] = []
        try:
            entries = list(os.scandir(self.outbox))
        except FileNotFoundError:
            return 0
        now, wall = time.monotonic(), time.time()
        settling, unreadable, undeletable = self.settling, self.unreadable, self.undeletable
        self.settling, self.unreadable, self.undeletable = {}, {}, {}  # only names still here
        self.settle_due = None
        for e in entries:
            if e.name in self.queued or e.name.startswith(".") or self._ours(e.name) is None:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as err:
                self._stat_failed(e.name, unreadable, err)
                continue
            if not e.is_file(follow_symlinks=False):
                continue
            key = file_key(st)
            if _still(e.name, key, unreadable, self.unreadable) or _still(
                e.name, key, undeletable, self.undeletable
            ):
                continue  # the same unreadable, or sent and undeletable, file: said once already
            if self._settled(e.name, key, st.st_mtime, settling.get(e.name), now, wall):
                found.append((st.st_mtime, e.name, Path(e.path)))
                self.queued[e.name] = key
        for _, _, path in sorted(found):
            self.queue.append(path)
        return len(found)

    def _settled(
        self,
        name: str,
        key: FileKey,
        mtime: float,
        seen: tuple[FileKey, float] | None,
        now: float,
        wall: float,
    ) -> bool:
        """True when the file was left alone for ``settle_seconds``: its mtime is that old, or
        its key did not change since a scan that long ago. Else it is kept in ``settling``
        (a writer may still be filling it in place under its final name)."""
        settle = self.u.settle_seconds
        if settle <= 0 or wall - mtime >= settle:
            return True
        if seen is not None and seen[0] == key:
            if now - seen[1] >= settle:
                return True
            since = seen[1]
        else:
            since = now
        self.settling[name] = (key, since)
        due = min(since + settle, now + max(0.0, mtime + settle - wall))
        self.settle_due = due if self.settle_due is None else min(self.settle_due, due)
        return False

    def _stat_failed(self, name: str, unreadable: dict[str, FileKey], err: OSError) -> None:
        """An outbox entry that cannot even be stat'ed: unreadable, said once."""
        key = _NO_KEY
        if unreadable.get(name) != key:
            self._unreadable(name, key, err, "stat")
        self.unreadable[name] = key

    def _unreadable(self, name: str, key: FileKey, err: OSError, stage: str) -> None:
        """Loss is data: log and count a file the sender cannot read, and leave it alone
        until it changes (a restart tries it once again)."""
        self.unreadable[name] = key
        self.summary.unreadable += 1
        log_event(log, 40, "outbox file unreadable: skipped until it changes", file_name=name,
                  stage=stage, errno=errno.errorcode.get(err.errno or 0, str(err.errno)),
                  error=str(err), outbox=str(self.outbox))  # fmt: skip

    def _open_next(self) -> _Object | None:
        """The next queued file, digested and journaled ``sending``; None when the queue is
        empty or this turn's hashing time is spent (a large file goes on at the next turn)."""
        while True:
            if self._journal_waits():
                return None  # no file starts before its "sending" record
            op = self.opening
            if op is None:
                if not self.queue:
                    return None
                op = self.opening = self._begin(self.queue.popleft())
                if op is None:
                    continue
            try:
                done = self._digest_some(op)
            except OSError as e:
                self.opening = None
                os.close(op.fd)
                self._unreadable(op.path.name, file_key(op.st), e, "read")
                self._forget(op.path.name, skipped=True)
                continue
            if not done:
                return None
            if self._sent_before(op):
                self.opening = None
                continue
            obj = self._to_object(op)
            if obj is None:
                return None  # its "sending" record was refused: kept, tried again later
            self.opening = None
            return obj

    def _begin(self, path: Path) -> _Opening | None:
        """Open a queued file for its digest; None (logged, counted) when it cannot be."""
        name = path.name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            log_event(log, 30, "outbox file vanished before it was sent", file_name=name)
            self._forget(name, skipped=True)
            return None
        except OSError as e:
            if e.errno in _TRANSIENT:
                log_event(log, 40, "outbox file not opened: tried again at the next scan",
                          file_name=name, error=str(e))  # fmt: skip
            else:
                self._unreadable(name, self.queued.get(name, _NO_KEY), e, "open")
            self._forget(name, skipped=True)
            return None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            self._unreadable(name, self.queued.get(name, _NO_KEY), e, "fstat")
            self._forget(name, skipped=True)
            return None
        return _Opening(path, fd, st, hashlib.sha256(envelope_prefix(name)))

    def _digest_some(self, op: _Opening) -> bool:
        """Hash the file on until its end (True) or until this turn's time is spent (False);
        a file's first chunk, and the read that confirms a short one was its last, always go
        (a small file is never split across turns, a large one never stalls)."""
        short = False
        while True:
            if op.off and not short and time.monotonic() >= self.digest_until:
                return False
            chunk = os.pread(op.fd, _CHUNK, op.off)
            slow_point("udp.digest")  # tests: a digest slow enough to be cut short
            if not chunk:
                return True
            op.digest.update(chunk)
            op.off += len(chunk)
            short = len(chunk) < _CHUNK

    def _sent_before(self, op: _Opening) -> bool:
        """True when the journal says this digested file is the very one sent already (before a
        restart, not removed yet): it is removed now (or left, if it may not be), not resent."""
        name, st = op.path.name, op.st
        if not _same_file_sent(self.journal.last.get(name), op.digest.hexdigest(), st):
            return False
        os.close(op.fd)
        self._remove_sent(op.path, st.st_ino)
        self.summary.already_sent += 1
        self._forget(name)
        return True

    def _to_object(self, op: _Opening) -> _Object | None:
        """A digested file as an object to send, journaled ``sending`` first; None when the
        state dir refused that record (the caller keeps the file and tries again later)."""
        path, fd, st = op.path, op.fd, op.st
        name = path.name
        ours = self._ours(name)
        assert ours is not None
        channel, kind, seq = ours
        prefix = envelope_prefix(name)
        digest = op.digest
        size = op.off
        hexd = digest.hexdigest()
        t = symbol_size_for(self.mtu, channel, ipv6=self.ipv6)
        header = ObjectHeader(
            object_id=self.object_id,
            kind=kind,
            channel=channel,
            seq=seq,
            length=len(prefix) + size,
            digest=digest.digest(),
            symbol_size=t,
            block_symbols=self.u.block_symbols,
        )
        if not self._journal(
            state="sending", name=name, size=size, digest=hexd, epoch=self.epoch,
            object_id=header.object_id,
        ):  # fmt: skip
            return None
        self.object_id += 1
        self.unstarted[header.object_id] = None
        return _Object(
            path, name, channel, header, self.codec.symbol_sealer(self.epoch, header), fd,
            st.st_ino, size, mtime_ns=st.st_mtime_ns,
        )  # fmt: skip

    def _forget(self, name: str, *, skipped: bool = False) -> None:
        self.queued.pop(name, None)
        if skipped:
            self.summary.skipped += 1

    def _remove_sent(self, path: Path, ino: int) -> None:
        """Remove a file sent (and journaled ``sent``) from the outbox: the very file, not a new
        one of that name. One the sender may not remove is logged once, counted and left."""
        st = None
        try:
            st = os.stat(path)
            if st.st_ino == ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # EACCES, EPERM (immutable), EROFS: sent all the same
            self._undeletable(path.name, _NO_KEY if st is None else file_key(st), e)

    def _undeletable(self, name: str, key: FileKey, err: OSError) -> None:
        """A file sent that the sender may not remove: logged once (with the fix), counted,
        and left alone until it changes; its ``sent`` record keeps it from being sent again."""
        self.summary.undeletable += 1
        UDP.sent_undeletable.inc()
        if self.undeletable.get(name) != key:
            log_event(log, 40, "sent file not removed from the outbox: left there, never sent "
                      "again", file_name=name, error=os_error_text(err), outbox=str(self.outbox),
                      fix="let the sender's user delete files in the outbox: write access to "
                      "it, no immutable or append-only attribute (lsattr -d), a writable mount; "
                      "the sender then removes it at its next start, or remove it by hand"
                      )  # fmt: skip
        self.undeletable[name] = key

    def _journal(self, **rec: Any) -> bool:
        """Append a journal record; False when the state dir refused it (logged at most a minute
        apart, counted; no file starts until ``JOURNAL_RETRY_S`` has passed)."""
        try:
            self.journal.record(**rec)
        except OSError as e:
            self.journal_retry_at = time.monotonic() + JOURNAL_RETRY_S
            self._refused("journal", self.journal.path, e)
            return False
        self.journal_retry_at = 0.0
        self._written_again("journal", self.journal.path)
        return True

    def _journal_waits(self) -> bool:
        """True while the state dir refused the last journal record less than
        ``JOURNAL_RETRY_S`` ago: nothing that needs a record is tried before."""
        return bool(self.journal_retry_at) and time.monotonic() < self.journal_retry_at

    def _refused(self, what: str, path: Path, err: OSError) -> None:
        """The state dir refused a write (``_REFUSED``'s ``what``): counted, and logged when
        the reason is new or ``REFUSED_LOG_S`` after it was last."""
        self.summary.state_errors += 1
        UDP.sender_state_errors.labels(what).inc()
        why = os_error_text(err)
        if not self.refused.setdefault(what, Recurring(REFUSED_LOG_S)).due(why):
            return
        level, msg, means = _REFUSED[what]
        log_event(log, level, msg, path=str(path), error=why, means=means,
                  fix=f"{_FIX_STATE} ({self.state_dir})")  # fmt: skip

    def _written_again(self, what: str, path: Path) -> None:
        said = self.refused.get(what)
        if said is not None and said.over():
            log_event(log, 30, "udp sender state written again", what=what, path=str(path))

    def _block_bytes(self, obj: _Object, index: int) -> bytes:
        h = obj.header
        plan = block_plan(h.length, h.symbol_size, h.block_symbols, index)
        prefix = envelope_prefix(obj.name)
        start, end = plan.offset, plan.offset + plan.length
        head = prefix[start:end] if start < len(prefix) else b""
        fstart = max(0, start - len(prefix))
        body = os.pread(obj.fd, end - len(prefix) - fstart, fstart) if end > len(prefix) else b""
        data = head + body
        if len(data) != plan.length:
            raise TransportError(f"{obj.name} changed while it was sent (short read)")
        return data

    def _release(self, obj: _Object) -> None:
        """Close the file once its last block is read (what is in flight is in memory), noting
        whether it changed since its digest."""
        if obj.fd < 0:
            return
        try:
            obj.changed = obj.changed or self._changed(obj)
        except OSError:
            obj.changed = True
        os.close(obj.fd)
        obj.fd = -1

    def _next_block(self) -> tuple[_Object, int, bytes, int, int] | None:
        """Read the next block to send (of this object, or the next file): ``(object, block
        index, padded block, repair count, first repair index)``; None when nothing is left."""
        while True:
            if self.feeding is None:
                self.feeding = self._open_next()
                if self.feeding is None:
                    return None
            obj = self.feeding
            h = obj.header
            try:
                padded = padded_block(self._block_bytes(obj, obj.next_block), h.symbol_size)
            except (OSError, TransportError) as e:
                log_event(log, 40, "outbox file could not be read: skipped", file_name=obj.name,
                          error=str(e))  # fmt: skip
                self._abandon(obj)
                self.feeding = None
                continue
            k = len(padded) // h.symbol_size
            n_rep = repair_count(k, self.u.repair_overhead, self.u.min_repair_symbols)
            index, first = obj.next_block, n_rep * obj.copy  # a later copy: fresh repairs
            obj.blocks_open += 1
            obj.next_block += 1
            if obj.next_block >= block_count(h.length, h.symbol_size, h.block_symbols):
                obj.copy += 1
                if obj.copy < self.u.copies:
                    obj.next_block = 0
                else:
                    self.feeding = None
                    self._release(obj)
            return obj, index, padded, n_rep, first

    def _more_to_feed(self) -> bool:
        """True while a block can be read or is being encoded (files queued wait while the
        journal refuses their ``sending`` record)."""
        return (
            self.feeding is not None
            or bool(self.pool.pending())
            or ((self.opening is not None or bool(self.queue)) and not self._journal_waits())
        )

    def _feed_one_block(self, wait: float) -> bool:
        """Add one encoded block to the interleaver (the workers encode ahead); False when
        none is ready within ``wait`` seconds or nothing is left to send."""
        pool = self.pool
        while pool.room():
            nxt = self._next_block()
            if nxt is None:
                break
            obj, index, padded, n_rep, first = nxt
            pool.submit((obj, index, first), padded, obj.header.symbol_size, n_rep, first)
        done = pool.next_done(wait)
        if done is None:
            return False
        (obj, index, first), padded, repairs = done
        k = len(padded) // obj.header.symbol_size
        stamped = obj.sealer.stamp(index, ((0, padded), (k + first, b"".join(repairs))))
        n = k + len(repairs)
        self.il.add(_Block(obj, index, memoryview(stamped), obj.sealer.size, k, n), n)
        return True

    def _abandon(self, obj: _Object) -> None:
        """Give up on a file that changed under us: no "sent", left in the outbox (its id
        counts as started: the receiver records it ``unseen`` if no datagram of it went)."""
        obj.failed = True
        self.unstarted.pop(obj.header.object_id, None)
        self._forget(obj.name, skipped=True)
        if obj.fd >= 0:
            os.close(obj.fd)
            obj.fd = -1

    def _changed(self, obj: _Object) -> bool:
        st = os.fstat(obj.fd)
        return st.st_size != obj.size or st.st_mtime_ns != obj.mtime_ns

    def _changed_since(self, obj: _Object) -> bool:
        """True when the file changed since its digest: when its last block was read, or in
        the outbox since (a file removed or replaced meanwhile was read whole)."""
        if obj.changed:
            return True
        try:
            st = os.stat(obj.path)
        except FileNotFoundError:
            return False
        return st.st_ino == obj.ino and (st.st_size, st.st_mtime_ns) != (obj.size, obj.mtime_ns)

    def _block_done(self, blk: _Block) -> None:
        obj = blk.obj
        obj.blocks_open -= 1
        if obj.blocks_open or self.feeding is obj:
            return
        if obj.failed:
            return  # its last queued symbols are out; it was never sent whole
        if self._changed_since(obj):
            log_event(log, 40, "outbox file changed while it was sent: skipped",
                      file_name=obj.name, object_id=obj.header.object_id)  # fmt: skip
            self._abandon(obj)
            return
        if self.unjournaled or not self._journal_sent(obj):
            self.unjournaled.append(obj)  # after those refused before it: in order
        ch = self.per_channel[obj.channel]
        ch["objects"] = int(ch["objects"] or 0) + 1
        if obj.header.kind == ObjectKind.BUNDLE:
            ch["last_seq"] = max(int(ch["last_seq"] or 0), obj.header.seq)
        self.summary.sent(obj.name)
        self.summary.file_bytes += obj.size
        UDP.objects_sent.labels(obj.channel).inc()
        log_event(log, 20, "file sent", file_name=obj.name, bytes=obj.size,
                  object_id=obj.header.object_id, copies=self.u.copies)  # fmt: skip

    def _journal_sent(self, obj: _Object) -> bool:
        """Journal a file sent whole as ``sent``, then remove it from the outbox; False when the
        state dir refused the record (the file stays, queued)."""
        if not self._journal(
            state="sent", name=obj.name, size=obj.size, digest=obj.header.digest.hex(),
            epoch=self.epoch, object_id=obj.header.object_id, ino=obj.ino,
            mtime_ns=obj.mtime_ns,
        ):  # fmt: skip
            return False
        crash_point("udp.after_sent")  # journaled "sent", the file still in the outbox
        self._remove_sent(obj.path, obj.ino)
        self._forget(obj.name)
        return True

    def _journal_unjournaled(self, *, last: bool = False) -> None:
        """Write the ``sent`` records the state dir refused, oldest first, once it is time to
        try again (``last``: now, the run ending); what is still refused at the end is logged:
        those files stay in the outbox and go again at the next start."""
        while self.unjournaled and (last or not self._journal_waits()):
            if not self._journal_sent(self.unjournaled[0]):
                break
            self.unjournaled.popleft()
        self.summary.unjournaled = len(self.unjournaled)
        if last and self.unjournaled:
            names = [o.name for o in self.unjournaled]
            log_event(log, 40, "udp sender stopped with files sent whose sent record was not "
                      "written: they stay in the outbox and go again at the next start",
                      files=len(names), file_names=names[:20], state_dir=str(self.state_dir),
                      fix=_FIX_STATE)  # fmt: skip

    # -- the wire ------------------------------------------------------------------------
    def _run_length(self) -> int:
        """Black, send stage: symbols to send before the interleaver wants another block (all
        that is pending when nothing is left to feed, or while the encoders are behind), at
        most one GSO batch; 0 when none."""
        il = self.il
        pending = il.pending()
        n = pending - il.window + 1 if self._more_to_feed() else pending
        return min(n if n > 0 else pending, MAX_SEGMENTS)

    def _send_run(self, n: int) -> tuple[int, float]:
        """Black, send stage: the next ``n`` scheduled symbols (at most what joins the batch)
        numbered, tagged and handed to the batch; returns how many, and the seconds paced by
        the flushes that made room for them. A block goes to ``finished`` once its last
        datagram is in the batch, so the flush that sends it journals its file."""
        il, batch = self.il, self.batch
        first = il.peek()
        assert first is not None
        size = first.size
        fit, waited = batch.room(size)
        sealer = first.obj.sealer
        views: list[memoryview] = []
        repairs = 0
        run = il.take(min(n, fit))
        for blk, i in run:
            if blk.size != size or len(views) >= fit:  # another channel's size: a new batch
                self._hand(sealer, views, size)
                views = []
                size, sealer = blk.size, blk.obj.sealer
                fit, w = batch.room(size)
                waited += w
            off = i * size
            views.append(blk.datagrams[off : off + size])
            repairs += i >= blk.k
            blk.left -= 1
            if not blk.left:
                self.finished.append(blk)  # not bound: a flush (on_sent) replaces the list
            if not blk.obj.started:
                self._start(blk.obj)
        self._hand(sealer, views, size)
        self.repairs_sent += repairs
        return len(run), waited

    def _hand(self, sealer: SymbolSealer, views: list[memoryview], size: int) -> None:
        """Black, send stage: number and tag stamped datagrams of ``size`` bytes in the order
        they leave, and add them to the batch (they fit: ``DatagramBatcher.room``)."""
        sealer.seal_stamped(views, self.packet)
        self.batch.extend(views, size)
        self.packet += len(views)
        self.summary.datagrams += len(views)
        self.summary.bytes += len(views) * size

    def _pace(self, nbytes: int) -> float:
        """The token bucket's wait before ``nbytes`` go out (slept here, and returned)."""
        wait = self.bucket.take(nbytes, time.monotonic())
        if wait > 0:
            time.sleep(wait)
        return wait

    def _sent(self) -> None:
        """A send went out: the blocks whose last symbols it carried are done (a file is
        journaled "sent" only once every datagram of it is in the kernel's hands)."""
        done, self.finished = self.finished, []
        for blk in done:
            self._block_done(blk)

    def _start(self, obj: _Object) -> None:
        """The object's first datagram is in the batch (out before the next heartbeat)."""
        obj.started = True
        self.unstarted.pop(obj.header.object_id, None)

    def objects_started(self) -> int:
        """Every object id below this had a datagram sent in this epoch (ids are numbered
        before their first datagram, and interleaving may send a later one's first)."""
        return next(iter(self.unstarted), self.object_id)

    def _heartbeat(self, now: float) -> None:
        """One round of link heartbeats: one datagram, or as many as the channels need to fit
        the MTU (each complete: epoch, its own packet number, counters, a share of the
        channels). Never raises for its size: a datagram that cannot be sealed is logged."""
        self.last_heartbeat = now
        s = self.summary
        hb = LinkHeartbeat(
            self.epoch, self.packet, time.time(), self.u.heartbeat_seconds,
            {c: dict(v) for c, v in self.per_channel.items()},
            {"datagrams": s.datagrams, "bytes": s.bytes, "objects": s.files_sent,
             "skipped": s.skipped, "objects_started": self.objects_started()},
        )  # fmt: skip
        try:
            parts = split_heartbeat(hb, self.hb_room)
        except ValueError as e:
            parts = []
            self._heartbeat_error(hb, e)
        sent = 0
        for part in parts:
            try:
                data = self.codec.seal_heartbeat(part)
            except ValueError as e:
                self._heartbeat_error(part, e)
                continue
            self.batch.add(data)  # joins or follows what is collected; all of it goes now
            s.bytes += len(data)  # datagrams counts symbols: heartbeats are apart
            sent += 1
        self.batch.flush()
        self.packet += max(1, len(parts))  # a packet number is never used twice
        UDP.datagrams_sent.labels("heartbeat").inc(sent)
        s.heartbeats += sent

    def _heartbeat_error(self, hb: LinkHeartbeat, err: ValueError) -> None:
        self.summary.heartbeat_errors += 1
        log_event(log, 40, "link heartbeat not sent", epoch=hb.epoch, packet=hb.packet,
                  part=hb.part, parts=hb.parts, channels=len(hb.channels),
                  error=str(err))  # fmt: skip

    def _status(self, now: float) -> None:
        self.last_status = now
        s = self.summary
        s.send_calls = self.batch.sends
        d0, r0, b0 = self._pushed  # metrics in bulk: a labelled inc() per datagram costs too much
        UDP.datagrams_sent.labels("repair").inc(self.repairs_sent - r0)
        UDP.datagrams_sent.labels("source").inc(s.datagrams - d0 - (self.repairs_sent - r0))
        UDP.bytes_sent.inc(s.bytes - b0)
        self._pushed = (s.datagrams, self.repairs_sent, s.bytes)
        self._compact()
        s.unjournaled = len(self.unjournaled)
        s.seconds = round(now - self.started, 3)  # so far: its rates are the run's, not 0
        doc = {
            "written_at": time.time(),
            "pid": os.getpid(),
            "epoch": self.epoch,
            "destination": self.u.destination,
            "rate_bytes_per_second": self.u.rate_bytes_per_second,
            "queue": len(self.queue) + (self.opening is not None) + (self.feeding is not None),
            "channels": self.per_channel,
            **self.summary.to_json(),
        }
        path = self.state_dir / "status.json"
        try:
            atomic_write_bytes(path, json.dumps(doc).encode(), mode=0o600)
        except OSError as e:  # it only informs: the sender goes on, its heartbeats too
            self._refused("status", path, e)
        else:
            self._written_again("status", path)

    def _compact(self) -> None:
        """Compact the journal once it is due, keeping the records of the files queued or still
        in the outbox (one sent but not removed yet stays known as sent); refused, the journal
        is left as it was and tried again later (``COMPACT_RETRY_S``)."""
        at, wait = self.compact_retry
        if time.monotonic() < at or not self.journal.due():
            return
        try:
            self.journal.compact(set(self.queued) | _names_in(self.outbox))
        except OSError as e:
            first, most = COMPACT_RETRY_S
            wait = min(most, wait * 2) if wait else first
            self.compact_retry = (time.monotonic() + wait, wait)
            self._refused("compaction", self.journal.path, e)
        else:
            self.compact_retry = (0.0, 0.0)
            self._written_again("compaction", self.journal.path)

    def run(self, until_idle: bool, timeout: float | None) -> SendSummary:
        _make_state_dir(self.state_dir)
        with exclusive_lock(
            self.state_dir / SENDER_LOCK, what="udp sender",
            hint="another `diode udp send` uses this udp.send.state_dir; stop it first",
        ):  # fmt: skip
            self.journal = Journal(self.state_dir)
            u = self.u
            try:
                self.pool = EncoderPool(
                    u.encode_workers,
                    slot_bytes_for(
                        u.block_symbols,
                        repair_count(u.block_symbols, u.repair_overhead, u.min_repair_symbols),
                        self.mtu,
                    ),
                    slots=3,
                    on_lost=self._encoder_lost,
                )
            except OSError as e:
                self.journal.close()
                self.sock.close()
                raise ConfigError(
                    f"udp.send.encode_workers = {u.encode_workers}: an encoder worker could not "
                    f"start ({e}); set encode_workers = 0 to encode in the sender's process"
                ) from None
            try:
                return self._run(until_idle, timeout)
            finally:
                self._close_files()
                self.summary.encode_workers_lost = self.pool.lost_workers
                self.summary.blocks_encoded_here = self.pool.inline_blocks
                self.pool.close()
                self.journal.close()
                self.sock.close()

    def _close_files(self) -> None:
        """Close the outbox files still open when the run ends (the one being digested, the
        one being read)."""
        for fd in (
            self.opening.fd if self.opening is not None else -1,
            self.feeding.fd if self.feeding is not None else -1,
        ):
            if fd >= 0:
                os.close(fd)
        self.opening = None
        if self.feeding is not None:
            self.feeding.fd = -1

    def _encoder_lost(self, pid: int, code: int | None, why: str, held: int, left: int) -> None:
        log_event(
            log, 40, "udp encoder worker lost: its blocks are encoded in the sender",
            pid=pid, exit_code=code, why=why, blocks_held=held, workers_left=left,
        )  # fmt: skip

    def _run(self, until_idle: bool, timeout: float | None) -> SendSummary:
        self.epoch = _new_epoch(self.state_dir)
        fsync_dir(self.state_dir)
        self.summary.epoch = self.epoch
        _raise_fd_limit()
        log_event(log, 20, "udp sender starting", epoch=self.epoch,
                  destination=self.u.destination, rate=self.u.rate_bytes_per_second,
                  channels=sorted(self.channels))  # fmt: skip
        from bridge.red.watch import InboxWatcher  # inotify hints; listing stays the truth

        watcher = InboxWatcher(self.outbox)
        watcher.start()
        t0 = self.started = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        hb_every, il, batch = self.u.heartbeat_seconds, self.il, self.batch
        last_scan = 0.0
        hinted = False  # inotify told of a change in the outbox: list it
        try:
            self._heartbeat(time.monotonic())
            while not self.stop.is_set():
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    break
                if now - self.last_heartbeat >= hb_every:
                    self._heartbeat(now)
                if self.unjournaled:
                    self._journal_unjournaled()
                if now - self.last_status >= 1.0:
                    self._status(now)
                self.digest_until = now + _DIGEST_SLICE
                sent = 0
                while sent < _TURN_DATAGRAMS:  # the hot loop: a few batches between clock checks
                    while il.wants_more() and self._more_to_feed():
                        # wait for an encoder only when there is nothing else to send
                        if not self._feed_one_block(0.05 if not il.pending() else 0.0):
                            break
                    n = self._run_length()
                    if not n:
                        break  # nothing pending
                    count, waited = self._send_run(n)
                    sent += count
                    if waited and time.monotonic() - now >= 0.05:
                        break  # a slow pace: look at the clock (heartbeats) often enough
                if il.pending() or self._more_to_feed():
                    continue
                batch.flush()  # nothing more to send now: what is collected goes out
                due = self.settle_due is not None and now >= self.settle_due
                if now - last_scan >= self.u.scan_seconds or due or hinted or watcher.wait(0):
                    last_scan, hinted = now, False
                    if self.scan():
                        continue
                    if until_idle and not self.settling:
                        break
                # what woke it is kept for the next turn (the watcher forgets once it told)
                hinted = watcher.wait(min(self.u.scan_seconds, 0.1)) or hinted
            self._heartbeat(time.monotonic())  # flushes what is collected first
        finally:
            watcher.stop()
            self._journal_unjournaled(last=True)
            self.summary.seconds = round(time.monotonic() - t0, 3)
            self._status(time.monotonic())
        log_event(log, 20, "udp sender stopped", **self.summary.to_json())
        return self.summary


def _raise_fd_limit() -> None:
    """Raise the soft limit of open files to the hard one (the sender holds one outbox file
    at a time, but its sockets, pipes and journal count too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY in (soft, hard) or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log_event(log, 30, "open-file limit not raised", soft=soft, hard=hard, error=str(e))


def run_sender(
    cfg: Config,
    *,
    stop: threading.Event | None = None,
    until_idle: bool = False,
    timeout: float | None = None,
) -> SendSummary:
    """Send every outbox file of the udp channels (until stopped, or idle with until_idle)."""
    with stop_on_signals(stop or threading.Event()) as ev:
        return _Sender(cfg, ev).run(until_idle, timeout)
