"""UDP link on real loopback sockets (mutation review, wave 2): a straggler of an older sender
session never takes the receiver's epoch back, a heartbeat that does not authenticate is
dropped and counted before it says anything about the link; a sender's new epoch is above the
one it saved even when the clock is behind it, no (epoch, packet) nonce is used twice across
split heartbeat rounds, and a copy re-dropped under a name in flight is sent, never unlinked."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bridge import faults
from bridge.config import config_from_dict
from bridge.diode.link_status import read_json
from bridge.diode.udp_sender import EPOCH, run_sender
from bridge.metrics import UDP
from bridge.protocol.datagram import DatagramCodec, LinkHeartbeat
from tests.integration.test_udp_receive import datagrams, receiving
from tests.integration.test_udp_send import Env, bundle, send_in_background
from tests.integration.test_udp_send import env as env  # noqa: F401 - the sender fixture


def _datagrams_counted(status: Path, n: int) -> bool:
    return (read_json(status) or {}).get("datagrams", 0) >= n


def test_a_straggler_of_an_older_epoch_never_takes_the_epoch_back(tmp_path: Path) -> None:
    with receiving(tmp_path, max_object_bytes=1 << 20) as rx:
        status = rx.spool / "status.json"
        old = datagrams(rx.codec, 20, 1, "u1.000000000002.a.dbundle", os.urandom(3000))
        new = datagrams(rx.codec, 21, 1, "u1.000000000003.b.dbundle", os.urandom(3000))
        rx.send(old[:1])
        rx.wait(lambda: (read_json(status) or {}).get("epoch") == 20, "epoch 20")
        rx.send(new[:1])  # the sender restarted
        rx.wait(lambda: (read_json(status) or {}).get("epoch") == 21, "epoch 21")
        rx.send(old[1:2])  # a datagram of the old session, delayed on the line
        rx.wait(lambda: _datagrams_counted(status, 3), "the straggler read")
        assert UDP.sender_epoch._value.get() == 21
        s = rx.finish()
    assert s.datagrams == 3  # the straggler was read (the case happened)
    assert (s.epoch, s.epochs_seen) == (21, 2)
    assert (read_json(status) or {})["epoch"] == 21


def test_a_forged_heartbeat_is_dropped_as_tag_and_changes_nothing(tmp_path: Path) -> None:
    with receiving(tmp_path, max_object_bytes=1 << 20) as rx:
        status = rx.spool / "status.json"
        forged = DatagramCodec(os.urandom(32)).seal_heartbeat(LinkHeartbeat(
            99, 1, time.time(), 2.0, {"u1": {"last_seq": 500, "objects": 500}},
            {"datagrams": 1, "objects_started": 1000},
        ))  # fmt: skip
        rx.send([forged])
        rx.wait(lambda: _datagrams_counted(status, 1), "the forged heartbeat read")
        s = rx.finish()
    doc = read_json(status) or {}
    assert s.dropped.get("tag") == 1 and doc["dropped"].get("tag") == 1
    assert s.heartbeats == 0 and doc["heartbeat"] is None
    assert s.epoch is None and s.objects_unseen == 0


def test_the_epoch_rises_above_the_saved_one_even_when_the_clock_stepped_back(env: Env) -> None:
    """Epochs are the nonce's first half and tell the receiver of a restart: a new one is
    always above the last one saved, whatever the clock says now."""
    env.state.mkdir(parents=True, exist_ok=True)
    saved = time.time_ns() + 10**15  # a run under a clock ~11 days ahead saved this one
    (env.state / EPOCH).write_text(f"{saved}\n")
    name = bundle("u1", 1)
    (env.outbox / name).write_bytes(os.urandom(3000))
    s = run_sender(env.cfg(), until_idle=True, timeout=30)
    heard = env.listener.quiet()
    assert s.epoch == saved + 1
    assert int((env.state / EPOCH).read_text()) == saved + 1
    assert list(heard.files()) == [name]
    assert {d.epoch for d in heard.symbols()} == {saved + 1}


def test_no_packet_number_is_used_twice_across_rounds_of_split_heartbeats(env: Env) -> None:
    """(epoch, packet) is the datagram's GCM nonce: an idle sender whose heartbeat rounds
    split over several datagrams (many channels) must still never repeat one."""
    chans = [f"channel-{i:02d}-" + "x" * 13 for i in range(64)]
    data = env.data(settle_seconds=0, encode_workers=0, heartbeat_seconds=0.1)
    data["channels"] = [{"name": c, "encrypt": False, "transport": "udp"} for c in chans]
    (env.outbox / bundle(chans[0], 1)).write_bytes(os.urandom(2000))
    cfg = config_from_dict(data, base=env.tmp, environ={})
    s = run_sender(cfg, until_idle=False, timeout=1.5)
    env.listener.quiet()
    nonces = [bytes(b[4:20]) for _, b in env.listener.raw]
    heartbeats = [b for _, b in env.listener.raw if b[3] == 2]
    assert s.heartbeats == len(heartbeats) >= 3 * 4  # several rounds, each split (the case)
    assert len(set(nonces)) == len(nonces)


def test_a_copy_dropped_under_a_name_in_flight_is_sent_never_unlinked_unsent(env: Env) -> None:
    """`diode resend` re-drops a bundle while the sender still sends the first copy: when the
    first is journaled sent, only that very file may be unlinked; the new copy is sent too."""
    name = bundle("u1", 1)
    body = os.urandom(400_000)
    (env.outbox / name).write_bytes(body)
    cfg = env.cfg(rate_bytes_per_second=400_000, interleave_datagrams=32, settle_seconds=0)
    th, result = send_in_background(env, cfg)
    first_ino = (env.outbox / name).stat().st_ino
    copy = env.outbox / ".resend.tmp"
    copy.write_bytes(body)  # the same bytes, a new file, renamed over the name (as resend does)
    copy.rename(env.outbox / name)
    assert (env.outbox / name).stat().st_ino != first_ino
    th.join(timeout=30)
    assert result, "the sender did not finish"
    sent = [r for r in env.journal() if r["state"] == "sent" and r["name"] == name]
    assert [r["ino"] for r in sent][:1] == [first_ino]  # the first copy went out (the case)
    assert len(sent) == 2 and sent[1]["ino"] != first_ino  # and the new one after it
    assert not (env.outbox / name).exists()
    assert env.listener.quiet().files() == {name: body}


def _digesting(path: Path) -> bool:
    """Whether this process holds ``path`` open (the sender thread is digesting it)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def test_a_file_abandoned_before_its_first_datagram_still_counts_as_started(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file cut short while it is digested is given up before any datagram of it: its id
    must not hold ``objects_started`` back (the receiver's unseen-object claims would stop
    there for the rest of the epoch, and a later object lost whole would go unreported)."""
    big = env.outbox / bundle("u1", 1)
    size = 32 << 20
    with open(big, "wb") as f:
        f.truncate(size)  # sparse
    # each chunk of the digest takes >= 20 ms: the cut lands mid-digest on any machine
    monkeypatch.setattr(faults, "_SLOW", ("udp.digest", 0.02))
    cfg = env.cfg(settle_seconds=0, heartbeat_seconds=0.1, encode_workers=0)
    result: list[Any] = []
    th = threading.Thread(
        target=lambda: result.append(run_sender(cfg, until_idle=True, timeout=30)), daemon=True
    )
    th.start()
    deadline = time.monotonic() + 10
    while not _digesting(big):
        assert th.is_alive() and time.monotonic() < deadline, "the digest was not seen"
        time.sleep(0.001)
    os.truncate(big, 0)  # cut short mid-digest: its first block cannot be read as digested
    th.join(timeout=30)
    assert result, "the sender did not finish"
    s = result[0]
    assert s.skipped >= 1  # given up (the case happened)
    journal = env.journal()
    sending = [r for r in journal if r["state"] == "sending"]
    assert sending[0]["size"] < size  # digested short: cut mid-digest (the case happened)
    ids = [r["object_id"] for r in sending]
    assert len(ids) >= 2  # the cut file got an id, then (changed) another one: sent empty
    last = max(hb.counters["objects_started"] for _, hb in env.listener.quiet().heartbeats())
    assert last == max(ids) + 1
