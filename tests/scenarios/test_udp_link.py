"""Scenario, UDP link: `diode udp send` -> `diode udp relay` (lossy) -> `diode udp receive`.

Real processes of the real CLI, real sockets on 127.0.0.1, real files. Every file sent arrives
byte-identical in red's inbox, or is reported as a gap; nothing is ever delivered corrupt; a
sender or receiver killed -9 mid-transfer resumes without loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bridge.config import Config, load_config
from bridge.demo.udp_link import free_udp_port, stop_process
from bridge.diode.link_status import gap_objects, read_gap_records, read_json
from bridge.diode.udp_key import generate_key_file
from bridge.protocol.naming import bundle_name, heartbeat_name
from tests.support import json_lines

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SOCKET_BUFFER = 64 << 20
"""The relay's and the receiver's (forced as root): about a second of this link's datagrams,
so a relay or receiver the scheduler holds off (a loaded machine) catches up instead of
overrunning its socket into a loss burst that no repair budget covers."""


class Proc:
    """One `diode ...` process with its output in a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}-{time.monotonic_ns()}.log"
        env = dict(os.environ, DIODE_LOG_FORMAT="json", DIODE_LOG_LEVEL="INFO")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from bridge.cli import main; main()", *args],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        return stop_process(self.proc)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        return json_lines(self.log)

    def summary(self) -> dict[str, Any]:
        docs = [e for e in self.events() if "msg" not in e]
        assert docs, f"{self.name} printed no summary:\n{self.text()[-3000:]}"
        return docs[-1]


@dataclass
class Link:
    root: Path
    cfg_path: Path
    cfg: Config
    relay_port: int
    receive_port: int

    @property
    def outbox(self) -> Path:
        return Path(self.cfg.black.outbox)

    @property
    def inbox(self) -> Path:
        return Path(self.cfg.red.inbox)

    def cli(self, name: str, *args: str) -> Proc:
        return Proc(name, [*args, "--config", str(self.cfg_path)], self.root)

    def relay(self, *impairments: str) -> Proc:
        fwd = f"127.0.0.1:{self.receive_port}"
        listen = f"127.0.0.1:{self.relay_port}"
        args = ["udp", "relay", "--listen", listen, "--forward", fwd,
                "--rcvbuf-bytes", str(SOCKET_BUFFER), *impairments]  # fmt: skip
        return Proc("relay", args, self.root)

    def receiver(self) -> Proc:
        p = self.cli("receiver", "udp", "receive")
        status = Path(self.cfg.udp.receive.spool_dir) / "status.json"  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while not status.exists() or not p.text():
            assert p.alive(), f"receiver died:\n{p.text()[-3000:]}"
            assert time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.1)
        return p


def _config(root: Path, relay_port: int, receive_port: int, **send: Any) -> Path:
    send_keys = {
        "destination": f'"127.0.0.1:{relay_port}"',
        "rate_bytes_per_second": 40_000_000,
        "repair_overhead": 0.25,
        "min_repair_symbols": 4,
        "heartbeat_seconds": 0.5,
        "scan_seconds": 0.1,
    }
    send_keys.update({k: (f'"{v}"' if isinstance(v, str) else v) for k, v in send.items()})
    lines = "\n".join(f"{k} = {v}" for k, v in send_keys.items())
    text = f"""
[[channels]]
name = "u1"
encrypt = false
transport = "udp"

[[channels]]
name = "u2"
encrypt = false
transport = "udp"

[[channels]]
name = "f1"
encrypt = false
transport = "file"

[black]
outbox = "black/outbox"

[red]
inbox = "red/inbox"

[udp]
key_file = "udp.key"

[udp.send]
{lines}

[udp.receive]
bind = "127.0.0.1:{receive_port}"
expire_seconds = 20.0
rcvbuf_bytes = {SOCKET_BUFFER}
"""
    path = root / "diode.toml"
    path.write_text(text)
    return path


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    generate_key_file(tmp_path / "udp.key")
    relay_port, receive_port = free_udp_port(), free_udp_port()
    cfg_path = _config(tmp_path, relay_port, receive_port)
    cfg = load_config(cfg_path, environ={})
    for d in (cfg.black.outbox, cfg.red.inbox):
        Path(d).mkdir(parents=True, exist_ok=True)
    yield Link(tmp_path, cfg_path, cfg, relay_port, receive_port)


def _drop(outbox: Path, channel: str, seq: int, data: bytes) -> str:
    """A file as black drops it: written aside, renamed into the outbox."""
    name = bundle_name(channel, seq, hashlib.md5(data + bytes([seq % 256])).hexdigest())
    tmp = outbox.parent / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, outbox / name)
    return name


def _wait_all(
    link: Link, names: dict[str, str], receiver: Proc, timeout: float, *, gaps_count: bool = True
) -> None:
    """Wait until every name is in the inbox or (if gaps_count) accounted for by a gap record."""
    deadline = time.monotonic() + timeout
    missing: set[str] = set(names)
    while time.monotonic() < deadline:
        assert receiver.alive(), f"receiver died:\n{receiver.text()[-3000:]}"
        present = {p.name for p in link.inbox.iterdir()}
        missing = set(names) - present
        if not missing:
            return
        if gaps_count:
            gaps = read_gap_records(Path(link.cfg.udp.receive.spool_dir))  # type: ignore[union-attr]
            if len(missing) <= gap_objects(gaps):
                return
        time.sleep(0.2)
    raise AssertionError(f"after {timeout}s still missing from inbox: {sorted(missing)[:10]}")


def test_hundreds_of_files_through_a_lossy_relay_arrive_intact_or_as_gaps(link: Link) -> None:
    rng = random.Random(7)
    sizes = [0, 1, 1359, 1360, 1361, 128 * 1360, 128 * 1360 + 1, 3 << 20, 100 << 20]
    sizes += [rng.choice([rng.randrange(0, 4096), rng.randrange(0, 300_000)]) for _ in range(200)]
    sent: dict[str, str] = {}  # name -> sha256
    for i, size in enumerate(sizes, start=1):
        data = rng.randbytes(size) if size < (1 << 20) else os.urandom(size)
        name = _drop(link.outbox, "u1" if i % 3 else "u2", i, data)
        sent[name] = hashlib.sha256(data).hexdigest()
    hb = heartbeat_name("u2", 1)
    (link.outbox / hb).write_bytes(b'{"heartbeat":1}')
    sent[hb] = hashlib.sha256(b'{"heartbeat":1}').hexdigest()
    stay = _drop(link.outbox, "f1", 1, b"for the vendor mover")

    receiver = link.receiver()
    relay = link.relay(
        "--loss", "2", "--burst-loss", "2", "--burst-mean", "4",
        "--reorder", "1", "--duplicate", "1", "--corrupt", "0.5", "--seed", "11",
    )  # fmt: skip
    try:
        sender = link.cli("sender", "udp", "send", "--until-idle", "--timeout", "300")
        assert sender.proc.wait(timeout=320) == 0, sender.text()[-3000:]
        _wait_all(link, sent, receiver, timeout=120)
    finally:
        relay.stop()
        receiver.stop()

    # the "file" channel's file is left for the vendor's mover; every udp file was taken
    assert sorted(p.name for p in link.outbox.iterdir()) == [stay]
    gaps = read_gap_records(Path(link.cfg.udp.receive.spool_dir))  # type: ignore[union-attr]
    delivered = {p.name: p for p in link.inbox.iterdir()}
    for name, digest in sent.items():
        if name in delivered:
            got = hashlib.sha256(delivered[name].read_bytes()).hexdigest()
            assert got == digest, f"{name} delivered corrupt"
    assert set(delivered) <= set(sent), f"unexpected files: {set(delivered) - set(sent)}"
    missing = set(sent) - set(delivered)
    assert len(missing) <= gap_objects(gaps), f"{sorted(missing)[:5]} missing without a gap record"
    relay_counts = relay.summary()
    recv_counts = receiver.summary()
    sent_counts = sender.summary()
    overruns = {  # datagrams lost to a full socket buffer, not to the relay's impairments
        "relay": sent_counts["datagrams"] + sent_counts["heartbeats"] - relay_counts["received"],
        "receiver": relay_counts["forwarded"] - recv_counts["datagrams"],
    }
    # with 25% repair (at least 4 per block) against ~4% loss, everything is repaired
    assert not missing, f"{len(missing)} files lost ({overruns=}): {gaps[:3]}"
    assert relay_counts["dropped_random"] > 0 and relay_counts["dropped_burst"] > 0
    assert relay_counts["corrupted"] > 0 and relay_counts["duplicated"] > 0
    assert relay_counts["reordered"] > 0
    dropped = recv_counts["dropped"]
    assert dropped.get("tag", 0) > 0, recv_counts  # the relay's bit flips were caught
    assert dropped.get("duplicate", 0) + dropped.get("surplus", 0) > 0, recv_counts
    assert recv_counts["objects_completed"] == len(sent)
    assert recv_counts["repair_symbols_used"] > 0
    assert recv_counts["heartbeats"] > 0 and recv_counts["epochs_seen"] == 1


def test_beyond_the_repair_budget_files_become_gaps_never_corrupt(link: Link) -> None:
    rng = random.Random(3)
    sent = {}
    for i in range(1, 21):
        data = rng.randbytes(400_000)
        sent[_drop(link.outbox, "u1", i, data)] = hashlib.sha256(data).hexdigest()
    text = link.cfg_path.read_text()
    text = text.replace("repair_overhead = 0.25", "repair_overhead = 0.0")
    text = text.replace("min_repair_symbols = 4", "min_repair_symbols = 0")
    text = text.replace("expire_seconds = 20.0", "expire_seconds = 3.0")
    link.cfg_path.write_text(text)
    receiver = link.receiver()
    relay = link.relay("--loss", "5", "--seed", "5")
    try:
        sender = link.cli("sender", "udp", "send", "--until-idle", "--timeout", "120")
        assert sender.proc.wait(timeout=150) == 0, sender.text()[-3000:]
        time.sleep(6)  # past expire_seconds: incomplete objects are given up
        _wait_all(link, sent, receiver, timeout=30)
    finally:
        relay.stop()
        receiver.stop()
    delivered = {p.name: p for p in link.inbox.iterdir()}
    for name, p in delivered.items():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == sent[name]
    gaps = read_gap_records(Path(link.cfg.udp.receive.spool_dir))  # type: ignore[union-attr]
    missing = set(sent) - set(delivered)
    assert missing, "5% loss without repair symbols should lose some 300-symbol files"
    assert {g.get("seq") for g in gaps} >= {int(n.split(".")[1]) for n in missing}
    assert all(g["reason"] for g in gaps)


def _journal_records(state_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(state_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_sender_and_receiver_killed_mid_transfer_resume_without_loss(link: Link) -> None:
    text = link.cfg_path.read_text().replace(
        "rate_bytes_per_second = 40000000", "rate_bytes_per_second = 4000000"
    )
    link.cfg_path.write_text(text)
    big = os.urandom(24 << 20)
    name = _drop(link.outbox, "u1", 1, big)
    small = _drop(link.outbox, "u1", 2, b"after the big one")
    state_dir = Path(link.cfg.udp.send.state_dir)  # type: ignore[union-attr]
    spool = Path(link.cfg.udp.receive.spool_dir)  # type: ignore[union-attr]

    receiver = link.receiver()
    relay = link.relay("--loss", "1", "--seed", "2")
    sender = link.cli("sender", "udp", "send")
    try:
        time.sleep(2.5)  # ~10 MB of 24 MB sent
        status = read_json(state_dir / "status.json") or {}
        first_epoch = status.get("epoch")
        sender.kill9()
        # the kill hit mid-file: its journal says "sending" and not "sent"
        recs = [r for r in _journal_records(state_dir) if r.get("name") == name]
        assert any(r.get("state") == "sending" for r in recs), recs
        assert not any(r.get("state") == "sent" for r in recs), recs
        assert (link.outbox / name).exists()
        spooled = sum(p.stat().st_size for p in spool.rglob("*") if p.is_file())
        assert spooled > 1 << 20, "the receiver had not spooled symbols of the big file"
        receiver.kill9()

        receiver = link.receiver()
        earlier = [receiver]
        # what arrives while the receiver restarts is lost for good; on a loaded machine that
        # outage can outgrow the repair budget, so the resend carries a second copy (fresh
        # repair symbols) and the test does not depend on how fast a process restarts
        text = link.cfg_path.read_text()
        assert "[udp.send]\n" in text
        text = text.replace("[udp.send]\n", "[udp.send]\ncopies = 2\n")
        link.cfg_path.write_text(text)
        sender = link.cli("sender", "udp", "send", "--until-idle", "--timeout", "200")
        time.sleep(2.0)
        receiver.kill9()  # again, while the resent file streams in
        receiver = link.receiver()
        earlier.append(receiver)
        assert sender.proc.wait(timeout=220) == 0, sender.text()[-3000:]
        # a superseded first-epoch object may be a gap record: wait for the files themselves
        _wait_all(link, {name: "", small: ""}, receiver, timeout=90, gaps_count=False)
    finally:
        relay.stop()
        receiver.stop()
        if sender.alive():
            sender.kill9()
    assert (link.inbox / name).read_bytes() == big
    assert (link.inbox / small).read_bytes() == b"after the big one"
    status = read_json(state_dir / "status.json") or {}
    assert first_epoch is not None and status["epoch"] > first_epoch
    # the last receiver took up the half-received object from the spool the kill left
    started = [e for e in receiver.events() if e.get("msg") == "udp receiver listening"]
    assert started and started[0]["objects_rebuilt"] >= 1, started
    # the new sender epoch was recognised as such: the resend superseded the partial object
    # of the killed sender's epoch (or a receiver saw the epoch change)
    told = {
        "sender restarted: new epoch",
        "udp object superseded: the sender resent it under a new epoch",
    }
    seen = [e for r in earlier for e in r.events() if e.get("msg") in told]
    assert seen and all(e.get("new_epoch", e.get("epoch")) > first_epoch for e in seen), seen
    assert read_gap_records(spool) == [] or all(
        g.get("reason") == "superseded" for g in read_gap_records(spool)
    )
