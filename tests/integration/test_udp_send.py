"""UDP sender on a real socket: a plain test receiver (open + BlockDecoder) rebuilds every file
byte-identical; files of other transports stay; the journal makes restarts neither skip nor
needlessly repeat; heartbeats keep coming during a long file; files changed under it are
skipped."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from bridge.config import Config, config_from_dict
from bridge.demo.udp_link import free_udp_port
from bridge.diode.link_status import read_json
from bridge.diode.udp_fec import BlockDecoder, block_count, block_plan
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.diode.udp_receiver import run_receiver
from bridge.diode.udp_sender import (
    EPOCH,
    JOURNAL,
    Journal,
    SendSummary,
    _Sender,
    envelope_prefix,
    run_sender,
)
from bridge.errors import ConfigError, StateError
from bridge.faults import CRASH_ENV, MARK_ENV
from bridge.protocol.datagram import (
    DatagramCodec,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    Symbol,
    heartbeat_room,
    symbol_size_for,
)
from tests.support import lo_route, without_dac

ID = "0123456789abcdef0123456789abcdef"
K = 16  # small blocks: many of them, block edges cheap to hit


def bundle(channel: str, seq: int) -> str:
    return f"{channel}.{seq:012d}.{ID}.dbundle"


@dataclass
class Heard:
    """Everything the test receiver opened, in arrival order (with arrival times)."""

    items: list[tuple[float, Symbol | LinkHeartbeat]] = field(default_factory=list)

    def symbols(self) -> list[Symbol]:
        return [d for _, d in self.items if isinstance(d, Symbol)]

    def heartbeats(self) -> list[tuple[float, LinkHeartbeat]]:
        return [(t, d) for t, d in self.items if isinstance(d, LinkHeartbeat)]

    def files(self, *, strict: bool = True) -> dict[str, bytes]:
        """Rebuild every object (per epoch and object id): name -> file bytes, digest checked;
        an object that cannot be rebuilt fails, or with ``strict=False`` is left out."""
        blocks: dict[tuple[int, int], dict[int, BlockDecoder]] = defaultdict(dict)
        headers: dict[tuple[int, int], ObjectHeader] = {}
        for s in self.symbols():
            key = (s.epoch, s.obj.object_id)
            h = headers.setdefault(key, s.obj)
            assert h == s.obj, f"object {key} changed its header"
            dec = blocks[key].get(s.block)
            if dec is None:
                plan = block_plan(h.length, h.symbol_size, h.block_symbols, s.block)
                dec = blocks[key][s.block] = BlockDecoder(plan, h.symbol_size)
            dec.add(s.esi, s.payload)
        out: dict[str, bytes] = {}
        for key, h in headers.items():
            n = block_count(h.length, h.symbol_size, h.block_symbols)
            decs = blocks[key]
            whole = sorted(decs) == list(range(n)) and all(d.complete for d in decs.values())
            if not strict and not whole:
                continue
            assert sorted(decs) == list(range(n)), f"object {key}: blocks missing"
            assert all(d.complete for d in decs.values()), f"object {key}: block not rebuilt"
            env = b"".join(decs[i].data() for i in range(n))
            assert len(env) == h.length and hashlib.sha256(env).digest() == h.digest
            nlen = int.from_bytes(env[:2], "big")
            name = env[2 : 2 + nlen].decode("ascii")
            assert name not in out or out[name] == env[2 + nlen :], f"{name} twice, differing"
            out[name] = env[2 + nlen :]
        return out


class Listener:
    """A raw socket on 127.0.0.1 that opens every datagram it gets, in its own thread."""

    def __init__(self, codec: DatagramCodec) -> None:
        self.codec = codec
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.heard = Heard()
        self.raw: list[tuple[float, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raw = self.raw
        while not self._stop.is_set():
            try:
                raw.append((time.monotonic(), self.sock.recv(65535)))
            except TimeoutError:
                continue

    def quiet(self, seconds: float = 0.3) -> Heard:
        """Wait until nothing arrived for ``seconds``, then open what came."""
        n = -1
        while n != len(self.raw):
            n = len(self.raw)
            time.sleep(seconds)
        self.heard.items = [(t, self.codec.open(b)) for t, b in self.raw]
        return self.heard

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@dataclass
class Env:
    tmp: Path
    listener: Listener

    def cfg(self, *, udp_outbox: str | None = None, **send: Any) -> Config:
        return config_from_dict(self.data(udp_outbox=udp_outbox, **send), base=self.tmp,
                                environ={})  # fmt: skip

    def data(self, *, udp_outbox: str | None = None, **send: Any) -> dict[str, Any]:
        """The config's document (``cfg`` parses it; a child process is handed it as JSON)."""
        data: dict[str, Any] = {
            "channels": [
                {"name": "u1", "encrypt": False, "transport": "udp"},
                {"name": "u2", "encrypt": False, "transport": "udp"},
                {"name": "f1", "encrypt": False, "transport": "file"},
            ],
            "black": {"outbox": "black/outbox"},
            "udp": {
                "key_file": "udp.key",
                "mtu": 1500,
                "send": {
                    "destination": f"127.0.0.1:{self.listener.port}",
                    "rate_bytes_per_second": 40_000_000,
                    "block_symbols": K,
                    "scan_seconds": 0.05,
                    **send,
                },
            },
        }
        if udp_outbox is not None:
            data["black"]["udp_outbox"] = udp_outbox
        return data

    @property
    def outbox(self) -> Path:
        p = self.tmp / "black" / "outbox"
        p.mkdir(parents=True, exist_ok=True)
        return p

    @property
    def state(self) -> Path:
        return self.tmp / "black" / "udp-send"

    def journal(self) -> list[dict[str, Any]]:
        text = (self.state / JOURNAL).read_text()
        return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    generate_key_file(tmp_path / "udp.key", force=True)
    listener = Listener(DatagramCodec(load_key(tmp_path / "udp.key")))
    try:
        yield Env(tmp_path, listener)
    finally:
        listener.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_every_file_is_rebuilt_byte_identical_and_only_udp_files_are_taken(
    env: Env, workers: int
) -> None:
    t = symbol_size_for(1500, "u1")
    assert t == symbol_size_for(1500, "u2")
    pre = len(envelope_prefix(bundle("u1", 1)))
    files = {
        bundle("u1", 1): b"",
        bundle("u1", 2): b"x",
        bundle("u1", 3): os.urandom(t - pre),  # the envelope is exactly one symbol
        bundle("u1", 4): os.urandom(t - pre + 1),  # one byte into the second symbol
        "u1.000000000005.dheartbeat": b'{"heartbeat": 5}',
        bundle("u2", 7): os.urandom(t * K - pre),  # exactly one whole block
        bundle("u2", 8): os.urandom(t * K - pre + 1),  # one byte into a second block
        bundle("u2", 9): os.urandom(2_000_000),  # many blocks
    }
    stay = {
        bundle("f1", 1): b"file transport: not ours",
        "notes.txt": b"not a wire name",
        bundle("u1", 0): b"seq 0 is no bundle name",
        ".u1.000000000006." + ID + ".dbundle.tmp": b"a mover's temp file",
        "u3.000000000001." + ID + ".dbundle": b"an unknown channel",
    }
    for i, (name, body) in enumerate({**files, **stay}.items()):
        (env.outbox / name).write_bytes(body)
        os.utime(env.outbox / name, (1000 + i, 1000 + i))  # oldest first = this order
    (env.outbox / bundle("u1", 7)).mkdir()  # a directory with a bundle's name: left alone

    summary = run_sender(env.cfg(encode_workers=workers), until_idle=True, timeout=60)
    heard = env.listener.quiet()
    blocks = sum(block_count(len(envelope_prefix(n)) + len(b), t, K) for n, b in files.items())
    # with workers, every block's repair symbols came from them; without, from the sender
    assert summary.blocks_encoded_here == (0 if workers else blocks)
    assert summary.encode_workers_lost == 0

    sending = [r["name"] for r in env.journal() if r["state"] == "sending"]
    assert sending == list(files)  # oldest first, every udp file once
    assert sorted(summary.files) == sorted(files)
    assert heard.files() == files
    assert sorted(p.name for p in env.outbox.iterdir()) == sorted([*stay, bundle("u1", 7)])
    j = Journal(env.state)
    assert {n: r["state"] for n, r in j.last.items()} == dict.fromkeys(files, "sent")
    j.close()

    packets = [d.packet for _, d in heard.items]
    assert packets == list(range(len(packets)))  # loopback, paced: nothing lost, in order
    assert {d.epoch for _, d in heard.items} == {summary.epoch}
    syms = heard.symbols()
    by_name: dict[int, ObjectHeader] = {}
    for s in syms:
        by_name.setdefault(s.obj.object_id, s.obj)
    assert sorted(by_name) == list(range(len(files)))  # object ids 0.. within the epoch
    kinds = {h.object_id: (h.kind, h.channel, h.seq) for h in by_name.values()}
    assert kinds[4] == (ObjectKind.HEARTBEAT_FILE, "u1", 5)
    assert kinds[7] == (ObjectKind.BUNDLE, "u2", 9)
    assert all(h.symbol_size == t and h.block_symbols == K for h in by_name.values())
    assert summary.datagrams + summary.heartbeats == len(packets)
    last_hb = heard.heartbeats()[-1][1]
    assert last_hb.channels["u1"] == {"last_seq": 4, "objects": 5}
    assert last_hb.channels["u2"] == {"last_seq": 9, "objects": 3}
    status = json.loads((env.state / "status.json").read_text())
    assert status["epoch"] == summary.epoch and status["queue"] == 0


def test_a_restart_unlinks_what_was_sent_resends_what_changed_and_raises_the_epoch(
    env: Env,
) -> None:
    """A crash between journaling "sent" and the unlink leaves the very file in the outbox: the
    restart unlinks it unsent. A copy dropped again under a sent name (``diode resend``, same
    bytes) and a new file of that name are sent again."""
    same, changed, redropped = bundle("u1", 1), bundle("u1", 2), bundle("u1", 3)
    (env.outbox / same).write_bytes(b"same bytes")
    (env.outbox / changed).write_bytes(b"first bytes")
    (env.outbox / redropped).write_bytes(b"resent bytes")
    data = {
        "channels": [{"name": "u1", "encrypt": False, "transport": "udp"}],
        "black": {"outbox": "black/outbox"},
        "udp": {
            "key_file": "udp.key",
            "send": {"destination": f"127.0.0.1:{env.listener.port}", "block_symbols": K},
        },
    }
    mark = env.tmp / "crash.mark"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(data), str(env.tmp)],
        cwd=Path(__file__).resolve().parents[2],
        env=os.environ | {CRASH_ENV: "udp.after_sent:3", MARK_ENV: str(mark)},
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL and mark.read_text().split() == ["udp.after_sent"]
    sent = {r["name"]: r for r in env.journal() if r["state"] == "sent"}
    assert set(sent) == {same, changed, redropped}
    assert not (env.outbox / same).exists() and not (env.outbox / changed).exists()
    assert (env.outbox / redropped).exists()  # killed after its "sent", before its unlink
    epoch1 = int((env.state / EPOCH).read_text())
    assert {sent[n]["epoch"] for n in sent} == {epoch1}

    resent = (env.outbox / same).with_suffix(".tmp")
    resent.write_bytes(b"same bytes")  # diode resend: a copy, the same bytes, renamed in
    resent.rename(env.outbox / same)
    (env.outbox / changed).write_bytes(b"other bytes")  # a new file of that name
    before = len(env.listener.quiet().symbols())
    second = run_sender(env.cfg(), until_idle=True, timeout=30)
    heard = env.listener.quiet()

    assert second.epoch > epoch1
    assert sorted(second.files) == [same, changed] and second.already_sent == 1
    assert second.skipped == 0 and not list(env.outbox.iterdir())
    new = Heard(heard.items[len(heard.items) - (second.datagrams + second.heartbeats) :])
    assert len(heard.symbols()) - before == len(new.symbols())
    assert {d.epoch for _, d in new.items} == {second.epoch}
    assert new.files() == {same: b"same bytes", changed: b"other bytes"}
    sending = [r["name"] for r in env.journal() if r["state"] == "sending"]
    assert sorted(sending) == sorted([same, changed, redropped, same, changed])


def test_heartbeats_keep_coming_during_a_long_file(env: Env) -> None:
    name = bundle("u2", 5)
    body = os.urandom(1_500_000)
    (env.outbox / name).write_bytes(body)
    cfg = env.cfg(rate_bytes_per_second=1_000_000, heartbeat_seconds=0.2)
    summary = run_sender(cfg, until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert heard.files() == {name: body}
    syms = heard.symbols()
    first = next(t for t, d in heard.items if isinstance(d, Symbol))
    last = [t for t, d in heard.items if isinstance(d, Symbol)][-1]
    during = [(t, hb) for t, hb in heard.heartbeats() if first < t < last]
    assert last - first > 1.0  # paced: the file took more than a second
    assert len(during) >= (last - first) / 0.2 * 0.6
    gaps = [b[0] - a[0] for a, b in zip(during, during[1:], strict=False)]
    assert max(gaps) < 0.2 * 3  # no long silence while the file streams
    assert all(hb.channels["u2"]["last_seq"] is None for _, hb in during)  # not done yet
    end = heard.heartbeats()[-1][1]
    assert end.channels["u2"] == {"last_seq": 5, "objects": 1}
    assert end.counters["datagrams"] == summary.datagrams  # heartbeats counted apart
    assert len(syms) == summary.datagrams


def encoder_workers(pid: int) -> list[psutil.Process]:
    """The encoder worker processes of the sender running as (or in) process ``pid``."""
    return [
        c
        for c in psutil.Process(pid).children()
        if "bridge.diode.udp_encode" in " ".join(c.cmdline())
    ]


def test_an_encoder_worker_killed_mid_file_is_replaced_by_the_sender_itself(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    name = bundle("u1", 1)
    body = os.urandom(1_500_000)
    (env.outbox / name).write_bytes(body)
    cfg = env.cfg(rate_bytes_per_second=1_000_000, interleave_datagrams=64, encode_workers=1)
    with caplog.at_level("ERROR", logger="bridge.diode.udp_sender"):
        th, result = send_in_background(env, cfg)
        deadline = time.monotonic() + 10
        while not (workers := encoder_workers(os.getpid())):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # mid-file: 1.5 MB at 1 MB/s
        workers[0].kill()
        th.join(timeout=30)
    assert not th.is_alive() and result, "the sender died or hung"
    summary = result[0]
    assert summary.encode_workers_lost == 1  # the fault fired, under the sender
    assert summary.blocks_encoded_here > 0  # ... and the sender encoded what was left
    assert summary.files == [name]
    assert any("udp encoder worker lost" in r.getMessage() for r in caplog.records)
    assert env.listener.quiet().files() == {name: body}


def send_in_background(env: Env, cfg: Config) -> tuple[threading.Thread, list[Any]]:
    """``run_sender`` in a thread; returns once its journal says a file is being sent."""
    result: list[Any] = []
    th = threading.Thread(
        target=lambda: result.append(run_sender(cfg, until_idle=True, timeout=30)), daemon=True
    )
    th.start()
    wait_until_sending(env, th)
    return th, result


def wait_until_sending(env: Env, th: threading.Thread, timeout: float = 10) -> None:
    """Until the sender's journal says a file is being sent (its thread still alive)."""
    deadline = time.monotonic() + timeout
    while (
        not (env.state / JOURNAL).exists() or '"sending"' not in (env.state / JOURNAL).read_text()
    ):
        assert th.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)


def test_a_file_truncated_while_it_is_sent_is_never_journaled_sent_as_it_was(env: Env) -> None:
    big, after = bundle("u1", 1), bundle("u1", 2)
    body = os.urandom(1_000_000)
    (env.outbox / big).write_bytes(body)
    (env.outbox / after).write_bytes(b"the next file")
    os.utime(env.outbox / big, (1000, 1000))
    cfg = env.cfg(rate_bytes_per_second=500_000, interleave_datagrams=32)
    th, result = send_in_background(env, cfg)
    time.sleep(0.1)
    os.truncate(env.outbox / big, 100_000)  # an operator cut it short mid-send
    th.join(timeout=30)
    assert not th.is_alive() and result, "the sender died or hung"
    summary = result[0]
    assert summary.skipped == 1 and sorted(summary.files) == [big, after]
    whole = hashlib.sha256(envelope_prefix(big) + body).hexdigest()
    sent = [r for r in env.journal() if r["state"] == "sent"]
    assert whole not in {r["digest"] for r in sent}  # the 1 MB file was never sent whole
    # what the outbox holds now (the cut file) went out as a new object of its own
    heard = env.listener.quiet()
    assert heard.files(strict=False) == {big: body[:100_000], after: b"the next file"}
    assert len({s.obj.object_id for s in heard.symbols()}) == 3  # the cut one, then both


def test_copies_repeat_the_object_with_fresh_repair_symbols(env: Env) -> None:
    name = bundle("u1", 1)
    body = os.urandom(50_000)
    (env.outbox / name).write_bytes(body)
    summary = run_sender(env.cfg(copies=2), until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert summary.files == [name] and heard.files() == {name: body}
    syms = heard.symbols()
    assert {s.obj.object_id for s in syms} == {0}  # one object, sent twice
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for s in syms:
        seen[(s.block, s.esi)] += 1
    k = {s.block: block_plan(s.obj.length, s.obj.symbol_size, K, s.block).k for s in syms}
    assert all(n == 2 for (b, esi), n in seen.items() if esi < k[b])  # the data twice
    assert all(n == 1 for (b, esi), n in seen.items() if esi >= k[b])  # repair never repeated
    assert [r["state"] for r in env.journal()] == ["sending", "sent"]


def test_a_file_removed_while_it_is_sent_is_still_sent_whole(env: Env) -> None:
    name = bundle("u1", 1)
    body = os.urandom(400_000)
    (env.outbox / name).write_bytes(body)
    cfg = env.cfg(rate_bytes_per_second=400_000, interleave_datagrams=32)
    th, result = send_in_background(env, cfg)
    (env.outbox / name).unlink()  # a mover or operator took it: the open file is still read
    th.join(timeout=30)
    assert result and result[0].files == [name]
    assert env.listener.quiet().files() == {name: body}


def test_two_senders_cannot_share_a_state_dir_and_config_errors_fail_fast(env: Env) -> None:
    cfg = env.cfg()
    stop = threading.Event()
    th = threading.Thread(target=lambda: run_sender(cfg, stop=stop), daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not (env.state / "status.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(StateError, match="udp sender"):
        run_sender(cfg, until_idle=True, timeout=5)
    stop.set()
    th.join(timeout=10)
    assert not th.is_alive()

    no_udp = config_from_dict(
        {"channels": [{"name": "f1", "encrypt": False, "transport": "file"}]},
        base=env.tmp,
        environ={},
    )
    with pytest.raises(ConfigError, match=r"\[udp\]"):
        run_sender(no_udp, until_idle=True)


def test_with_black_udp_outbox_the_sender_takes_its_files_there_only(env: Env) -> None:
    udp = env.tmp / "black" / "udp-outbox"
    udp.mkdir(parents=True)
    mine, stray = bundle("u1", 1), bundle("u2", 1)
    (udp / mine).write_bytes(b"m" * 5000)
    (env.outbox / stray).write_bytes(b"s" * 5000)  # dropped before udp_outbox was set
    (env.outbox / bundle("f1", 1)).write_bytes(b"f" * 5000)
    summary = run_sender(env.cfg(udp_outbox="black/udp-outbox"), until_idle=True, timeout=30)
    assert summary.files == [mine] and not (udp / mine).exists()
    assert sorted(os.listdir(env.outbox)) == sorted([stray, bundle("f1", 1)])  # left alone
    assert env.listener.quiet().files() == {mine: b"m" * 5000}


def test_an_encoder_worker_that_cannot_start_fails_the_sender_with_the_fix(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    (env.outbox / bundle("u1", 1)).write_bytes(b"x" * 1000)
    broken = env.tmp / "broken"
    (broken / "bridge").mkdir(parents=True)
    (broken / "bridge" / "__init__.py").write_text("raise ImportError('a broken install')")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    with pytest.raises(ConfigError, match=r"encode_workers = 1: .* set encode_workers = 0"):
        run_sender(env.cfg(encode_workers=1), until_idle=True, timeout=30)
    assert not (env.state / JOURNAL).exists() or env.journal() == []  # nothing was sent
    monkeypatch.delenv("PYTHONPATH")
    assert run_sender(env.cfg(encode_workers=1), until_idle=True, timeout=30).files == [
        bundle("u1", 1)]  # fmt: skip


_CHILD = """
import json, sys
from bridge.config import config_from_dict
from bridge.diode.udp_sender import run_sender
data, base = json.loads(sys.argv[1]), sys.argv[2]
run_sender(config_from_dict(data, base=__import__("pathlib").Path(base), environ={}))
"""


def test_kill_9_mid_file_then_restart_sends_it_again_whole_under_a_new_epoch(env: Env) -> None:
    name = bundle("u2", 3)
    body = os.urandom(2_000_000)
    (env.outbox / name).write_bytes(body)

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CHILD,
            json.dumps(env.data(rate_bytes_per_second=500_000)),
            str(env.tmp),
        ],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 20
        while sum(isinstance(x, bytes) for _, x in env.listener.raw) < 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = encoder_workers(proc.pid)
        assert len(workers) == 1  # the default udp.send.encode_workers
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert [r["state"] for r in env.journal()] == ["sending"]  # killed mid-file
    gone = time.monotonic() + 10  # the sender's kill -9 closed their pipe: they exit too
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        assert time.monotonic() < gone, "an encoder worker outlived its sender"
        time.sleep(0.05)
    old_epoch = int((env.state / EPOCH).read_text())
    before = len(env.listener.quiet().symbols())

    cfg = env.cfg()
    summary = run_sender(cfg, until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert summary.epoch > old_epoch and summary.files == [name] and summary.skipped == 0
    fresh = Heard([(t, d) for t, d in heard.items if d.epoch == summary.epoch])
    assert len(heard.symbols()) > before
    assert fresh.files() == {name: body}  # whole from the new epoch alone
    assert [r["state"] for r in env.journal()] == ["sending", "sending", "sent"]
    assert not (env.outbox / name).exists()


# -- review fixes: open files, unreadable files, heartbeat size, settling, digest, journal ----


def outbox_fds(outbox: Path) -> list[str]:
    """What this process holds open in ``outbox`` (from /proc/self/fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(outbox) + "/"):
            out.append(target)
    return out


_LOW_FD_CHILD = """
import json, os, resource, sys, threading, time
from pathlib import Path
from bridge.config import config_from_dict
from bridge.diode.udp_sender import run_sender
data, base, outbox = json.loads(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] + "/"
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # soft and hard: nothing to raise to
peak, done = [0], threading.Event()
def watch():
    while not done.is_set():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(outbox)
            except OSError:
                pass
        peak[0] = max(peak[0], n)
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
s = run_sender(config_from_dict(data, base=base, environ={}), until_idle=True, timeout=120)
done.set()
print(json.dumps({"summary": s.to_json(), "peak": peak[0],
                  "limit": list(resource.getrlimit(resource.RLIMIT_NOFILE))}))
"""


def test_thousands_of_small_files_go_through_with_256_open_files_allowed(env: Env) -> None:
    """The interleaver spreads 2,000 small files over its 4,096-datagram window (over a
    thousand in flight at once): the sender holds one outbox file open at a time, so a limit
    of 256 descriptors (soft and hard) never stops it."""
    files = {bundle("u1", i): os.urandom(200) for i in range(1, 2001)}
    for name, body in files.items():
        (env.outbox / name).write_bytes(body)
    data = env.data(settle_seconds=0, encode_workers=0)  # the default interleave_datagrams = 4096
    proc = subprocess.run(
        [sys.executable, "-c", _LOW_FD_CHILD, json.dumps(data), str(env.tmp), str(env.outbox)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["limit"] == [256, 256]  # the low limit was in force for the whole run
    assert got["summary"]["files"] == 2000 and got["summary"]["skipped"] == 0
    assert 1 <= got["peak"] <= 1  # seen reading, never more than one outbox file open
    assert not list(env.outbox.iterdir())
    assert env.listener.quiet().files() == files


def test_a_sender_stopped_mid_file_leaves_no_outbox_file_open(env: Env) -> None:
    name = bundle("u1", 1)
    (env.outbox / name).write_bytes(os.urandom(2_000_000))
    stop = threading.Event()
    cfg = env.cfg(rate_bytes_per_second=500_000, interleave_datagrams=64, settle_seconds=0)
    result: list[SendSummary] = []
    th = threading.Thread(target=lambda: result.append(run_sender(cfg, stop=stop)), daemon=True)
    th.start()
    wait_until_sending(env, th)
    time.sleep(0.2)
    assert outbox_fds(env.outbox)  # the file is being read
    stop.set()
    th.join(timeout=10)
    assert result and result[0].files == []  # stopped mid-file
    assert [r["state"] for r in env.journal()] == ["sending"]
    assert outbox_fds(env.outbox) == []


_PERM_CHILD = """
import json, sys, threading, time
from pathlib import Path
from bridge.config import config_from_dict
from bridge.diode.udp_sender import run_sender
from bridge.logs import setup_logging
setup_logging(json_logs=True)
data, base, stop_file = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
stop = threading.Event()
def watch():
    while not stop_file.exists():
        time.sleep(0.02)
    stop.set()
threading.Thread(target=watch, daemon=True).start()
s = run_sender(config_from_dict(data, base=base, environ={}), stop=stop, timeout=60)
print(json.dumps(s.to_json()))
"""


def test_an_unreadable_file_is_logged_counted_and_left_alone_until_it_changes(env: Env) -> None:
    """One file the sender may not read (mode 0000; as root, the child runs without
    CAP_DAC_OVERRIDE): the others before and after it go, it is said once however often the
    outbox is listed, and goes once it is made readable."""
    names = [bundle("u1", i) for i in (1, 2, 3)]
    bodies = {n: os.urandom(5000) for n in names}
    for i, n in enumerate(names):
        (env.outbox / n).write_bytes(bodies[n])
        os.utime(env.outbox / n, (1000 + i, 1000 + i))
    bad = env.outbox / names[1]
    bad.chmod(0)
    prefix = without_dac()
    stop_file = env.tmp / "stop"
    data = json.dumps(env.data(settle_seconds=0, encode_workers=0))
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _PERM_CHILD, data, str(env.tmp), str(stop_file)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while sorted(os.listdir(env.outbox)) != [names[1]]:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the readable files were not sent"
            time.sleep(0.05)
        time.sleep(1.0)  # about 20 listings of the outbox with the unreadable file in it
        bad.chmod(0o644)  # fixed: a new ctime, so a new file to the sender
        while bad.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the file made readable was not sent"
            time.sleep(0.05)
    finally:
        stop_file.touch()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["unreadable"] == 1 and summary["files"] == 3  # the fault fired, once
    said = [json.loads(x) for x in err.splitlines() if "outbox file unreadable" in x]
    assert len(said) == 1 and said[0]["file_name"] == names[1] and said[0]["errno"] == "EACCES"
    assert env.listener.quiet().files() == bodies


def _hb_rounds(heard: Heard) -> list[list[LinkHeartbeat]]:
    """The heartbeats heard, as rounds (consecutive parts 0..parts-1 of one epoch)."""
    rounds: list[list[LinkHeartbeat]] = []
    for _, hb in heard.heartbeats():
        if hb.part == 0:
            rounds.append([])
        rounds[-1].append(hb)
    return rounds


def test_heartbeats_of_many_channels_are_split_to_fit_the_mtu(env: Env) -> None:
    chans = [f"channel-{i:02d}-" + "x" * 13 for i in range(64)]
    data = env.data(settle_seconds=0, encode_workers=0, heartbeat_seconds=0.1)
    data["channels"] = [{"name": c, "encrypt": False, "transport": "udp"} for c in chans]
    for c in chans:
        (env.outbox / bundle(c, 123456789012)).write_bytes(b"payload")
    cfg = config_from_dict(data, base=env.tmp, environ={})
    room = heartbeat_room(1500)
    whole = LinkHeartbeat(1 << 62, 1 << 40, time.time(), 0.1,
                          dict.fromkeys(chans, {"last_seq": 123456789012, "objects": 1}),
                          {"datagrams": 10**6, "bytes": 10**9, "objects": 64, "skipped": 0,
                           "objects_started": 64})  # fmt: skip
    assert len(whole.to_json()) > 4096 > room  # one datagram could not hold the channels

    summary = run_sender(cfg, until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert len(summary.files) == 64 and summary.heartbeat_errors == 0
    assert max(len(b) for _, b in env.listener.raw if b[3] == 2) <= 1500 - 28  # one IP packet
    rounds = _hb_rounds(heard)
    assert len(rounds) >= 2 and all(len(r) == r[0].parts > 1 for r in rounds)
    for r in rounds:
        assert [hb.part for hb in r] == list(range(len(r)))
        assert [hb.packet for hb in r] == list(range(r[0].packet, r[0].packet + len(r)))
        assert len({(hb.epoch, hb.sender_time, json.dumps(hb.counters)) for hb in r}) == 1
        assert sorted(c for hb in r for c in hb.channels) == sorted(chans)  # each once
    last = {c: v for hb in rounds[-1] for c, v in hb.channels.items()}
    assert last == dict.fromkeys(chans, {"last_seq": 123456789012, "objects": 1})
    assert summary.heartbeats == len(heard.heartbeats())


def _receiver(tmp: Path, port: int, chans: list[str]) -> tuple[Config, threading.Event, Any]:
    data = {
        "channels": [{"name": c, "encrypt": False, "transport": "udp"} for c in chans],
        "red": {"inbox": "red/inbox"},
        "udp": {"key_file": "udp.key", "receive": {"bind": f"127.0.0.1:{port}",
                                                   "decode_workers": 0}},
    }  # fmt: skip
    cfg = config_from_dict(data, base=tmp, environ={})
    stop, ready = threading.Event(), threading.Event()
    th = threading.Thread(
        target=lambda: run_receiver(cfg, stop=stop, ready=lambda _: ready.set()), daemon=True
    )
    th.start()
    assert ready.wait(20)
    return cfg, stop, th


def test_the_receiver_merges_the_channels_of_a_round_split_over_datagrams(env: Env) -> None:
    """A real sender with 64 channels, a real receiver: its status names every channel (not
    only the last datagram's share). Then crafted rounds: a new epoch whose first datagram
    heard carries one channel of several is not taken for a one-channel sender."""
    chans = [f"channel-{i:02d}-" + "x" * 13 for i in range(64)]
    port = free_udp_port()
    rcfg, stop, th = _receiver(env.tmp, port, chans)
    spool = Path(rcfg.udp.receive.spool_dir)  # type: ignore[union-attr]
    try:
        data = env.data(settle_seconds=0, encode_workers=0, heartbeat_seconds=0.1)
        data["channels"] = [{"name": c, "encrypt": False, "transport": "udp"} for c in chans]
        data["udp"]["send"]["destination"] = f"127.0.0.1:{port}"
        for c in chans:
            (env.outbox / bundle(c, 7)).write_bytes(b"payload")
        sent = run_sender(config_from_dict(data, base=env.tmp, environ={}), until_idle=True,
                          timeout=30)  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            hb = (read_json(spool / "status.json") or {}).get("heartbeat") or {}
            if hb.get("epoch") == sent.epoch and all(
                (hb["channels"].get(c) or {}).get("last_seq") == 7 for c in chans
            ):
                break
            assert time.monotonic() < deadline, f"status heartbeat: {hb}"
            time.sleep(0.05)
        assert hb["parts"] > 1 and len(hb["channels"]) == 64  # the fault: a split round

        codec = DatagramCodec(load_key(env.tmp / "udp.key"))
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        epoch = sent.epoch + 1
        few = {c: {"last_seq": None, "objects": 0} for c in chans[:3]}

        def part(packet: int, i: int, channels: dict[str, Any]) -> bytes:
            return codec.seal_heartbeat(LinkHeartbeat(
                epoch, packet, time.time(), 0.1, channels, {"objects_started": 0}, i, 2
            ))  # fmt: skip

        sock.sendto(part(0, 1, {chans[3]: {"last_seq": None, "objects": 0}}), ("127.0.0.1", port))
        time.sleep(0.1)  # heard alone: the receiver's first word of this epoch
        sock.sendto(part(1, 0, few), ("127.0.0.1", port))
        sock.close()
        deadline = time.monotonic() + 10
        while len(((read_json(spool / "status.json") or {}).get("heartbeat") or {}).get(
                "channels", {})) != 4:  # fmt: skip
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(timeout=30)
    ledgers = {e["epoch"]: e for e in json.loads((spool / "unseen.json").read_text())["epochs"]}
    assert ledgers[epoch]["channel"] is None  # not chans[3]: the epoch carries four


def test_a_file_written_in_place_is_taken_only_once_its_writer_is_done(env: Env) -> None:
    """An operator's `cp` into the outbox: the file grows under its final name for ~1.5 s, a
    write every 20 ms. The sender (default settle_seconds) takes it whole, once."""
    name = bundle("u1", 1)
    body = os.urandom(75 * 20_000)
    cfg = env.cfg()
    assert cfg.udp is not None and cfg.udp.send.settle_seconds == 1.0  # the default
    stop = threading.Event()
    result: list[SendSummary] = []
    th = threading.Thread(target=lambda: result.append(run_sender(cfg, stop=stop)), daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not (env.state / "status.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with open(env.outbox / name, "wb") as f:  # noqa: PTH123 - written as cp writes
        for i in range(0, len(body), 20_000):
            f.write(body[i : i + 20_000])
            f.flush()
            time.sleep(0.02)
        written = time.time()
    deadline = time.monotonic() + 20
    while (env.outbox / name).exists():
        assert th.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    stop.set()
    th.join(timeout=10)
    heard = env.listener.quiet()
    sending = [r for r in env.journal() if r["state"] == "sending"]
    assert len(sending) == 1 and sending[0]["size"] == len(body)
    assert sending[0]["time"] >= written + 0.9  # taken once the writer was done, and settled
    assert {s.obj.object_id for s in heard.symbols()} == {0}  # one object, never a partial one
    assert heard.files() == {name: body}
    assert result[0].files == [name] and result[0].skipped == 0


def test_a_file_renamed_in_is_taken_after_the_settle_time_not_the_next_scan(env: Env) -> None:
    """Black's own files appear by rename: with a settle time they wait that long, not until a
    listing of the outbox long after (scan_seconds = 5 here)."""
    cfg = env.cfg(scan_seconds=5.0, settle_seconds=0.3)
    stop = threading.Event()
    th = threading.Thread(target=lambda: run_sender(cfg, stop=stop), daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not (env.state / "status.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)
    name = bundle("u1", 1)
    tmp = env.outbox / f".{name}.tmp"
    tmp.write_bytes(b"renamed in")
    t0 = time.monotonic()
    tmp.rename(env.outbox / name)
    while (env.outbox / name).exists():
        assert th.is_alive() and time.monotonic() - t0 < 10
        time.sleep(0.01)
    took = time.monotonic() - t0
    stop.set()
    th.join(timeout=10)
    assert 0.25 <= took < 1.5, took
    assert env.listener.quiet().files() == {name: b"renamed in"}


def test_heartbeats_keep_their_period_while_a_large_file_is_digested(env: Env) -> None:
    """The SHA-256 of a 1 GiB file (sparse: hashing, not the disk, takes the time) before
    its first datagram: heartbeats every 50 ms keep coming."""
    name = bundle("u1", 1)
    with open(env.outbox / name, "wb") as f:  # noqa: PTH123
        f.truncate(1 << 30)
    cfg = env.cfg(heartbeat_seconds=0.05, settle_seconds=0, encode_workers=0)
    stop = threading.Event()
    th = threading.Thread(target=lambda: run_sender(cfg, stop=stop), daemon=True)
    th.start()
    wait_until_sending(env, th, timeout=30)
    time.sleep(0.1)
    stop.set()
    th.join(timeout=30)
    heard = env.listener.quiet()
    first_symbol = next(t for t, d in heard.items if isinstance(d, Symbol))
    beats = [t for t, _ in heard.heartbeats() if t < first_symbol]
    assert first_symbol - beats[0] >= 0.4  # the fault: the digest took many heartbeat periods
    assert len(beats) >= (first_symbol - beats[0]) / 0.05 * 0.5, len(beats)  # kept coming
    gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
    # no stall of the digest's length: a loaded machine (CI beside other work) delays a beat
    # now and then, and a slower digest gives it more chances, so the bound grows with it
    assert max(gaps) < max(0.05 * 4, (first_symbol - beats[0]) / 4), (max(gaps), first_symbol)


def test_a_torn_last_journal_line_is_cut_so_the_next_record_is_kept(env: Env) -> None:
    env.state.mkdir(parents=True)
    path = env.state / JOURNAL
    path.write_text('{"name": "a", "state": "sent"}\n{"name": "b", "sta')  # power loss
    j = Journal(env.state)
    assert path.read_text() == '{"name": "a", "state": "sent"}\n'  # cut at once
    j.record(state="sent", name="c", digest="x")
    j.close()
    j = Journal(env.state)
    j.close()
    assert sorted(j.last) == ["a", "c"]
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == ["a", "c"]


@pytest.fixture
def small_mtu_route() -> Iterator[str]:
    """127.0.0.77 reached through a route of MTU 1280 (a host route on lo, removed after)."""
    with lo_route("127.0.0.77", 1280) as route:
        yield route.addr


def test_a_udp_mtu_above_the_routes_mtu_is_refused_at_start(env: Env, small_mtu_route: str) -> None:
    """udp.mtu 1500 towards a route of MTU 1280: every full datagram would leave this host as
    IP fragments, which many diodes drop. Refused at start, naming both and the fix."""
    env.outbox  # noqa: B018 - made
    cfg = env.cfg(destination=f"{small_mtu_route}:{env.listener.port}")
    with pytest.raises(ConfigError) as err:
        run_sender(cfg, until_idle=True, timeout=5)
    text = str(err.value)
    assert "udp.mtu = 1500 but the route to 127.0.0.77:" in text and "MTU 1280" in text, text
    assert "set udp.mtu = 1280 on both sides" in text
    data = env.data(destination=f"{small_mtu_route}:{env.listener.port}")
    data["udp"]["mtu"] = 1280
    small = config_from_dict(data, base=env.tmp, environ={})
    summary = run_sender(small, until_idle=True, timeout=5)  # fits: it runs
    assert summary is not None


def test_the_senders_socket_is_bound_to_the_routes_address_not_every_interface(
    env: Env, small_mtu_route: str
) -> None:
    """Unbound, a UDP socket's first send binds it to 0.0.0.0: open to datagrams from every
    interface. The sender binds to the address its route sends from (udp.send.source unset),
    so a datagram to another local address of the host never reaches it."""
    env.outbox  # noqa: B018 - made
    sender = _Sender(env.cfg(), threading.Event())  # destination 127.0.0.1
    try:
        host, port = sender.sock.getsockname()
        assert host == "127.0.0.1" and port, (host, port)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.sendto(b"from elsewhere", (small_mtu_route, port))  # 127.0.0.77: not its own
        sender.sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sender.sock.recv(100)
    finally:
        sender.sock.close()
