"""Diode, UDP: `diode udp status` and `diode status` show the link as a real sender and a
real receiver (each its own `diode` process, loopback) last reported it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bridge.demo.udp_link import free_udp_port, stop_process
from bridge.diode.udp_key import generate_key_file
from tests.integration.test_udp_receive import receiver_config
from tests.support import REPO

NAME = "u1.000000000001.0123456789abcdef0123456789abcdef.dbundle"


def _config(tmp: Path, port: int) -> Path:
    """The receiver's config (``receiver_config``) plus black's outbox and the sender's
    section: both ends of the link from one file, as on this one machine."""
    path = receiver_config(tmp, port)
    with open(path, "a") as f:
        f.write(f"""
[black]
outbox = "black/outbox"

[udp.send]
destination = "127.0.0.1:{port}"
heartbeat_seconds = 0.3
scan_seconds = 0.05
""")
    return path


def _diode(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from bridge.cli import main; main()", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _start(cfg: Path, what: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from bridge.cli import main; main()",
             "udp", what, "--config", str(cfg)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, DIODE_LOG_FORMAT="json"),
        )  # fmt: skip


def _link(cfg: Path) -> dict[str, Any]:
    r = _diode("udp", "status", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


def _wait(what: str, ok: Callable[[], bool], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while not ok():
        assert all(p.poll() is None for p in procs), f"a process died waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def link(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    generate_key_file(tmp_path / "udp.key")
    cfg = _config(tmp_path, free_udp_port())
    (tmp_path / "black" / "outbox").mkdir(parents=True)
    procs = [_start(cfg, "receive", tmp_path / "rx.log")]
    _wait("the receiver's status", lambda: (tmp_path / "red/udp-spool/status.json").exists(), procs)
    procs.append(_start(cfg, "send", tmp_path / "tx.log"))
    try:
        yield cfg, procs
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p, timeout=30)


def test_status_shows_both_ends_of_a_live_link_then_a_dead_sender(
    tmp_path: Path, link: tuple[Path, list[subprocess.Popen[bytes]]]
) -> None:
    cfg, (rx, tx) = link
    body = os.urandom(300_000)
    (tmp_path / "black" / "outbox" / NAME).write_bytes(body)
    inbox = tmp_path / "red" / "inbox" / NAME
    _wait("the file in red's inbox", inbox.exists, [rx, tx])
    assert inbox.read_bytes() == body

    def settled() -> bool:
        doc = _link(cfg)
        s, r = doc["sender"] or {}, doc["receiver"] or {}
        hb = r.get("heartbeat") or {}
        done = r.get("objects_completed") == 1 and s.get("files") == 1  # written every 1 s
        return done and hb.get("epoch") == s.get("epoch") is not None

    _wait("both status files to tell of the file and a heartbeat", settled, [rx, tx])
    doc = _link(cfg)
    send, recv = doc["sender"], doc["receiver"]
    assert doc["transport"] == "udp" and doc["channels"] == ["u1"]
    assert doc["gaps_total"] == 0 and doc["gaps"] == []
    assert recv["epoch"] == send["epoch"] and recv["heartbeat_age_seconds"] < 5
    assert send["age_seconds"] < 5 and recv["age_seconds"] < 5
    assert send["running"] is True and recv["running"] is True
    assert send["datagrams"] >= 300_000 // 1500 and recv["datagrams"] >= 300_000 // 1500
    assert send["channels"]["u1"] == {"last_seq": 1, "objects": 1}
    # running ends report their rates so far (seconds was 0 until the process stopped)
    assert send["seconds"] > 0 and send["mb_per_s"] > 0, send
    assert recv["seconds"] > 0 and recv["goodput_mb_per_s"] > 0, recv

    for side in ("black", "red"):  # the tables name both ends, with the epoch
        r = _diode("status", "--config", str(cfg), "--side", side)
        assert r.returncode == 0, r.stderr
        assert "UDP link (no gap)" in r.stdout and str(send["epoch"]) in r.stdout, r.stdout
    r = _diode("status", "--config", str(cfg), "--side", "red", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["link"]["receiver"]["epoch"] == send["epoch"]

    tx.send_signal(signal.SIGKILL)  # the sender dies: its status file ages, heartbeats stop
    tx.wait(30)
    time.sleep(4.0)
    doc = _link(cfg)  # the receiver rewrites its status every second, the dead sender never
    assert doc["sender"]["age_seconds"] >= 4 > doc["receiver"]["age_seconds"]
    assert doc["sender"]["running"] is False and doc["receiver"]["running"] is True
    assert doc["receiver"]["heartbeat_age_seconds"] >= 2  # none since the kill

    rx.send_signal(signal.SIGKILL)  # the receiver dies too: ages count on, as of now
    rx.wait(30)
    time.sleep(3.0)
    later = _link(cfg)["receiver"]
    assert later["age_seconds"] >= 3 and later["running"] is False
    assert later["heartbeat_age_seconds"] >= doc["receiver"]["heartbeat_age_seconds"] + 3


def test_a_receiver_stopped_a_moment_ago_is_not_shown_running(
    tmp_path: Path, link: tuple[Path, list[subprocess.Popen[bytes]]]
) -> None:
    """A receiver stopped with SIGTERM writes its status as it goes: a second later the file
    is as fresh as a live one's. Its age alone made it look alive; ``running`` tells."""
    cfg, (rx, tx) = link

    def both_running() -> bool:
        doc = _link(cfg)
        return all((doc[end] or {}).get("running") for end in ("sender", "receiver"))

    _wait("both ends' status", both_running, [rx, tx])
    stop_process(tx, timeout=30)
    assert stop_process(rx, timeout=30) == 0
    doc = _link(cfg)
    recv, send = doc["receiver"], doc["sender"]
    assert recv["age_seconds"] < 2, recv  # the file is fresh: the stop just wrote it
    assert recv["running"] is False and send["running"] is False, doc


def test_a_damaged_status_file_is_reported_as_damaged_not_as_absent(tmp_path: Path) -> None:
    """A status file that is not JSON (a disk fault, a hand edit) was shown as "no status file",
    as if that end had never run on this host."""
    cfg = _config(tmp_path, free_udp_port())
    spool, state = tmp_path / "red" / "udp-spool", tmp_path / "black" / "udp-send"
    for d in (spool, state):
        d.mkdir(parents=True)
    (spool / "status.json").write_bytes(b'{"written_at": 17')  # cut short
    (state / "status.json").write_bytes(b"[1, 2]")
    doc = _link(cfg)
    recv, send = doc["receiver"], doc["sender"]
    assert recv is not None and recv["running"] is False and "not JSON" in recv["damaged"]
    assert send is not None and "not a JSON object" in send["damaged"]
    (spool / "status.json").unlink()
    (state / "status.json").unlink()
    doc = _link(cfg)
    assert doc["receiver"] is None and doc["sender"] is None  # never ran here: absent


def test_a_status_written_in_the_future_is_not_given_a_negative_age(tmp_path: Path) -> None:
    """A clock set back after the write: the age is 0, never negative, and the heartbeat's
    age is not made younger than the receiver said."""
    cfg = _config(tmp_path, free_udp_port())
    spool = tmp_path / "red" / "udp-spool"
    spool.mkdir(parents=True)
    doc = {"written_at": time.time() + 3600, "heartbeat_age_seconds": 7.0}
    (spool / "status.json").write_text(json.dumps(doc))
    recv = _link(cfg)["receiver"]
    assert recv["age_seconds"] == 0 and recv["heartbeat_age_seconds"] == 7.0, recv


def test_a_udp_section_no_channel_uses_is_shown_as_a_file_link(tmp_path: Path) -> None:
    """[udp] kept from the example, every channel on file transport, nothing ever ran: status
    said "transport": "udp" with two "no status file" ends, as if a UDP link were down."""
    path = _config(tmp_path, free_udp_port())
    path.write_text(path.read_text().replace('transport = "udp"\n', ""))
    doc = _link(path)
    assert doc == {"transport": "file", "udp": None}, doc
    spool = tmp_path / "red" / "udp-spool"
    spool.mkdir(parents=True)
    (spool / "status.json").write_text(json.dumps({"written_at": time.time()}))
    assert _link(path)["transport"] == "udp"  # it ran here: still shown


def test_status_on_a_host_where_only_the_receiver_ran_shows_red(tmp_path: Path) -> None:
    """Red's host runs `diode udp receive` before any red job: `diode status` (auto) showed a
    black table ("never ran") with the receiver under it."""
    from bridge.cli import _sides
    from bridge.config import load_config

    path = _config(tmp_path, free_udp_port())
    cfg = load_config(path, environ={})
    assert _sides(cfg, "auto") == ["black"]  # nothing ran here
    (tmp_path / "red" / "udp-spool").mkdir(parents=True)
    assert _sides(cfg, "auto") == ["red"]
    assert _sides(cfg, "black") == ["black"]  # an explicit side is kept
