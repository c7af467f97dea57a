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
from bridge.diode.udp_fec import BlockDecoder, block_count, block_plan
from bridge.diode.udp_key import generate_key_file, load_key
from bridge.diode.udp_sender import EPOCH, JOURNAL, Journal, envelope_prefix, run_sender
from bridge.errors import ConfigError, StateError
from bridge.faults import CRASH_ENV, MARK_ENV
from bridge.protocol.datagram import (
    DatagramCodec,
    LinkHeartbeat,
    ObjectHeader,
    ObjectKind,
    Symbol,
    symbol_size_for,
)

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
        return config_from_dict(data, base=self.tmp, environ={})

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
    deadline = time.monotonic() + 10
    while (
        not (env.state / JOURNAL).exists() or '"sending"' not in (env.state / JOURNAL).read_text()
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return th, result


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

    def data(rate: int) -> dict[str, Any]:
        return {
            "channels": [{"name": "u2", "encrypt": False, "transport": "udp"}],
            "black": {"outbox": "black/outbox"},
            "udp": {
                "key_file": "udp.key",
                "send": {
                    "destination": f"127.0.0.1:{env.listener.port}",
                    "rate_bytes_per_second": rate,
                    "block_symbols": K,
                },
            },
        }

    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(data(500_000)), str(env.tmp)],
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

    cfg = config_from_dict(data(40_000_000), base=env.tmp, environ={})
    summary = run_sender(cfg, until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert summary.epoch > old_epoch and summary.files == [name] and summary.skipped == 0
    fresh = Heard([(t, d) for t, d in heard.items if d.epoch == summary.epoch])
    assert len(heard.symbols()) > before
    assert fresh.files() == {name: body}  # whole from the new epoch alone
    assert [r["state"] for r in env.journal()] == ["sending", "sending", "sent"]
    assert not (env.outbox / name).exists()
