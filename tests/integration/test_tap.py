"""Black, tap: mirror queue -> spool on a real vhost (drain, crash between fsync and ack,
queue length limit overflow and its dead letters, a full spool and what ends the pause, the
property bytes kept exactly as delivered)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import psutil
import pytest
import requests

from bridge.amqp.client import Connection
from bridge.black.mirror import Mirror
from bridge.black.spool import KIND_LOST, KIND_MESSAGE, SpoolReader
from bridge.black.state import ChannelState, StateStore
from bridge.black.tap import POSSIBLE_DUPLICATE, REENCODED, Tap, order_free, tap_status
from bridge.config import Config, load_config
from bridge.metrics import REGISTRY
from bridge.protocol.properties import (
    ByteArray,
    Float32,
    Float64,
    Int8,
    Properties,
    UInt16,
    decode_properties,
    encode_properties,
    field_table,
)
from tests.conftest import AUTH, MGMT
from tests.support import crash_env, crash_marks, publish_confirmed, small_tmpfs

pytestmark = [pytest.mark.broker]

REPO = Path(__file__).resolve().parents[2]
QUEUE = "diode.mirror.main"


def write_config(
    tmp: Path,
    amqp_url: str,
    queue_type: str = "classic",
    *,
    spool_dir: str = "spool",
    spool: dict[str, Any] | None = None,
    **tap: Any,
) -> Config:
    extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in tap.items())
    spool_extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in (spool or {}).items())
    p = tmp / "diode.toml"
    p.write_text(
        f"""
[[channels]]
name = "main"
exchanges = ["ev"]
encrypt = false

[black]
amqp_url = "{amqp_url}"
spool_dir = "{spool_dir}"
state_dir = "state"
mirror_queue_type = "{queue_type}"

[black.tap]
{extra}

[black.spool]
{spool_extra}
"""
    )
    return load_config(p)


def setup_mirror(cfg: Config, url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().exchange_declare("ev", "fanout", durable=True)
    conn.close()
    Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json").sync()


def publish_raw(
    url: str, messages: list[tuple[bytes, bytes]], routing_keys: list[str] | None = None
) -> None:
    """Publish (property bytes, body) pairs to "ev" with confirms (``publish_confirmed``)."""
    keys = routing_keys or [""] * len(messages)
    publish_confirmed(url, [("ev", rk, p, b) for rk, (p, b) in zip(keys, messages, strict=True)])


def messages(n: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        headers = field_table(
            {"i": i, "f": Float32(1.5), "d": Float64(-0.0), "b": Int8(-3), "u": UInt16(65535),
             "x": ByteArray(b"\x00\xff"), "nest": {"arr": [1, "two", None]}}
        )  # fmt: skip
        props = Properties(content_type="text/plain", delivery_mode=2, headers=headers,
                           message_id=f"m{i}", timestamp=1_700_000_000 + i)  # fmt: skip
        out.append((encode_properties(props), f"body-{i}".encode() * (1 + i % 5)))
    return out


def spooled(cfg: Config) -> list[dict[str, Any]]:
    r = SpoolReader(Path(cfg.black.spool_dir), "main")
    end = r.durable_end()
    rows: list[dict[str, Any]] = []
    for b in r.read(r.first_pos(), end):
        rows.extend(b.to_pylist())
    return rows


def queue_depth(url: str, queue: str) -> int:
    conn = Connection.open(url)
    try:
        return conn.channel().queue_depth(queue)
    finally:
        conn.close()


@contextlib.contextmanager
def _tap_running(cfg: Config) -> Iterator[threading.Thread]:
    """A continuous ``Tap`` of channel main on a thread of this process, stopped and joined
    when the block ends."""
    tap = Tap(cfg, "main")
    th = threading.Thread(target=tap.run, daemon=True)
    th.start()
    try:
        yield th
    finally:
        tap.stop()
        th.join(timeout=30)


def test_drain_keeps_property_bytes_exactly(black_vhost: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, black_vhost.amqp_url, group_messages=40, prefetch=100)
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = messages(300)
    publish_raw(black_vhost.amqp_url, sent)
    status = Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(300))
    assert all(r["kind"] == KIND_MESSAGE and r["exchange"] == "ev" for r in rows)
    assert [(r["properties_raw"], r["body"]) for r in rows] == sent
    assert (
        decode_properties(rows[7]["properties_raw"]).headers
        == decode_properties(sent[7][0]).headers
    )
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0
    assert status.durable_end == 300


def _tap_process(cfg: Config, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    assert cfg.source is not None
    return subprocess.run(
        [sys.executable, "-m", "bridge.cli", "black", "tap", "--config", str(cfg.source), "main",
         "--until-empty"],
        cwd=REPO, env=env, capture_output=True, timeout=120, check=False,
    )  # fmt: skip


def _tap_killed_at(cfg: Config, tmp_path: Path, point: str, nth: int = 1) -> dict[str, str]:
    """Run ``black tap --until-empty`` with crash point ``point`` armed for its ``nth`` hit:
    it must die there by SIGKILL (asserted). Returns the env that armed it; the mark it left
    disarms the point, so a process run with it again drains normally."""
    mark = tmp_path / "crash.mark"
    env = dict(os.environ, **crash_env(point, mark, nth), PYTHONPATH=str(REPO))
    first = _tap_process(cfg, env)
    assert first.returncode == -9, first.stderr.decode(errors="replace")[-2000:]
    assert crash_marks(mark) == [point], "the crash must hit the window it names"
    return env


@pytest.mark.parametrize(
    "point,queue_type",
    [("tap.after_sync", "classic"), ("tap.after_ack", "classic"), ("tap.after_sync", "quorum")],
)
def test_kill_between_fsync_and_ack_duplicates_nothing(
    black_vhost: Any, tmp_path: Path, point: str, queue_type: str
) -> None:
    """SIGKILL right after a group is durable but before (or just after) its ack: the broker
    redelivers it, the tap recognises every redelivery from the spool tail and skips it. A
    quorum queue adds x-delivery-count to redeliveries: stripped, so nothing changes."""
    cfg = write_config(tmp_path, black_vhost.amqp_url, queue_type, group_messages=50, prefetch=200)
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = messages(500)
    publish_raw(black_vhost.amqp_url, sent)
    env = _tap_killed_at(cfg, tmp_path, point, nth=3)
    assert len(spooled(cfg)) >= 150  # three groups were durable before the kill
    second = _tap_process(cfg, env)  # the mark disarms the point: this run drains the rest
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-2000:]
    rows = spooled(cfg)
    assert [r["body"] for r in rows] == [b for _, b in sent], "each message once, in order"
    for r, (raw, _) in zip(rows, sent, strict=True):
        if r["reason"] == REENCODED:  # a quorum redelivery: the broker re-sorted the headers
            assert queue_type == "quorum" and r["redelivered"]
            assert order_free(r["properties_raw"]) == order_free(raw)
        else:
            assert r["properties_raw"] == raw, r["pos"]
    st = tap_status(cfg, "main")
    assert st is not None
    if point == "tap.after_sync":  # the durable-but-unacked group came back and was skipped
        assert st.counters.get("redelivered_skipped", 0) >= 1
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def test_a_crash_among_byte_identical_messages_loses_none_and_marks_possible_duplicates(
    black_vhost: Any, tmp_path: Path
) -> None:
    """Producers that send byte-identical messages (no id, no timestamp): after a kill between
    fsync and ack a redelivery cannot be told from a twin the broker had not yet delivered.
    Nothing is skipped then: every message is spooled at least once and each redelivery that
    may repeat a spooled record is marked ``possible-duplicate`` (counted as inexact)."""
    cfg = write_config(tmp_path, black_vhost.amqp_url, group_messages=50, prefetch=200)
    setup_mirror(cfg, black_vhost.amqp_url)
    same = (encode_properties(Properties(delivery_mode=2)), b"ping")
    publish_raw(black_vhost.amqp_url, [same] * 500)
    env = _tap_killed_at(cfg, tmp_path, "tap.after_sync", nth=3)
    durable = len(spooled(cfg))
    assert durable >= 150
    second = _tap_process(cfg, env)
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-2000:]
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(len(rows)))
    assert all((r["properties_raw"], r["body"]) == same for r in rows)
    marked = [r for r in rows if r["reason"] == POSSIBLE_DUPLICATE]
    assert marked and all(r["redelivered"] and r["pos"] >= durable for r in marked)
    # the last group's ack was never sent: its 50 records come back, each kept and marked
    assert 500 + 50 <= len(rows) <= 500 + len(marked), (len(rows), len(marked))
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("redelivered_skipped", 0) == 0
    assert st.counters.get(f"inexact_{POSSIBLE_DUPLICATE}") == len(marked)
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def test_a_full_spool_pauses_the_tap_with_the_backlog_left_in_the_broker(
    black_vhost: Any, tmp_path: Path
) -> None:
    """At its quota the spool refuses more: the continuous tap hands back what it holds (no
    prefetch window of messages waits in its memory), waits disconnected, and resumes once
    black shipped and released segments. Every message is spooled once, in order, and
    counted once: ``delivered`` counts what was spooled, what a pause handed back is
    ``handed_back`` (it is delivered again later)."""
    cfg = write_config(
        tmp_path, black_vhost.amqp_url, group_messages=4, prefetch=100,
        spool={"max_bytes": 16 << 20, "segment_bytes": 1 << 20},
    )  # fmt: skip
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = [(encode_properties(Properties(message_id=f"m{i}")), bytes([i]) * 1_000_000)
            for i in range(40)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, sent)
    store = StateStore(Path(cfg.black.state_dir))
    with _tap_running(cfg) as th:

        def status() -> Any:
            st = tap_status(cfg, "main")
            assert th.is_alive() and st is not None
            return st

        deadline = time.monotonic() + 60
        while tap_status(cfg, "main") is None or not status().paused:
            assert time.monotonic() < deadline, "the tap never paused"
            time.sleep(0.1)
        assert "max_bytes" in status().paused
        held = status().durable_end
        assert 8 <= held < 40
        while True:  # the tap collects its ack proofs, then lets go of its connection
            with Connection.open(black_vhost.amqp_url) as conn:
                q = conn.channel().queue_declare(QUEUE, passive=True)
            if q.consumer_count == 0 or time.monotonic() > deadline + 30:
                break
            time.sleep(0.1)
        assert q.consumer_count == 0 and q.message_count == 40 - held  # all ready, none held
        while status().durable_end < 40:  # black ships what the spool holds, again and again
            store.save(ChannelState("main", last_seq=status().durable_end - 1))
            assert time.monotonic() < deadline + 60, "the tap did not resume"
            time.sleep(0.3)
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0
    r = SpoolReader(Path(cfg.black.spool_dir), "main")
    first = r.first_pos()
    rows = [x for b in r.read(first, r.durable_end()) for x in b.to_pylist()]
    assert [x["body"] for x in rows] == [b for _, b in sent[first:]]
    last = tap_status(cfg, "main")
    assert last is not None and last.durable_end == 40 and not last.paused
    assert last.counters.get("delivered") == 40, last.counters
    assert last.counters.get("handed_back", 0) >= 1, last.counters


def _limit_policy(vhost: str, **definition: Any) -> None:
    vh = urllib.parse.quote(vhost, safe="")
    r = requests.put(
        f"{MGMT}/api/policies/{vh}/limit-mirror",
        json={"pattern": r"^diode\.mirror\.main$", "definition": definition,
              "apply-to": "queues"},
        auth=AUTH, timeout=10,
    )  # fmt: skip
    assert r.status_code in (201, 204), r.text


def _wait_policy(vhost: str, queue: str = QUEUE) -> None:
    """Until the broker applied ``_limit_policy`` to the queue (asynchronous)."""
    vh = urllib.parse.quote(vhost, safe="")
    # the queue records, not the statistics (which lag by seconds)
    url = f"{MGMT}/api/queues/{vh}?disable_stats=true&enable_queue_totals=true"
    deadline = time.monotonic() + 20
    while not any(
        q.get("name") == queue and q.get("policy") == "limit-mirror"
        for q in requests.get(url, auth=AUTH, timeout=10).json()
    ):
        assert time.monotonic() < deadline, "the policy was never applied"
        time.sleep(0.1)


_PARENT = """
import sys, time
from bridge.black.taps import _start
from bridge.config import load_config
proc, _ = _start(load_config(sys.argv[1]), "main", until_empty=False)
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_a_tap_stops_when_the_job_that_started_it_is_killed(
    black_vhost: Any, tmp_path: Path
) -> None:
    """kill -9 of the black job alone (the OOM killer): its continuous tap notices and stops
    gracefully instead of holding the spool lock against the next job's taps."""
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    setup_mirror(cfg, black_vhost.amqp_url)
    assert cfg.source is not None
    log = tmp_path / "job.log"
    with open(log, "wb") as err:  # the tap's stderr is its job's
        parent = subprocess.Popen(
            [sys.executable, "-c", _PARENT, str(cfg.source)], cwd=REPO, stdout=subprocess.PIPE,
            stderr=err, env=dict(os.environ, PYTHONPATH=str(REPO)),
        )  # fmt: skip
    try:
        assert parent.stdout is not None
        tap = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while tap_status(cfg, "main") is None:  # the tap is up and has its spool
            assert tap.is_running() and time.monotonic() < deadline, "the tap did not start"
            time.sleep(0.1)
        parent.kill()
        parent.wait(timeout=10)
        gone = time.monotonic() + 15
        while tap.is_running() and tap.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < gone, "the tap outlived its job"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert "the black job that started this tap is gone: stopping" in log.read_text()


@pytest.mark.parametrize("overflow", [None, "reject-publish"])
def test_queue_length_limit_overflow_is_recorded_as_lost(
    black_vhost: Any, tmp_path: Path, overflow: str | None
) -> None:
    """An operator's max-length policy on the mirror queue drops the oldest messages: each one
    is dead-lettered to black, which records a lost position (reason maxlen), never silence,
    with the exchange and routing key the message was published with (from its x-death
    header: the dead letter itself is routed with the channel's name). A policy asking the
    broker to refuse publishes instead does not apply: the classic mirror queue's own
    x-overflow argument wins."""
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    setup_mirror(cfg, black_vhost.amqp_url)
    _limit_policy(
        black_vhost.name, **{"max-length": 10}, **({"overflow": overflow} if overflow else {})
    )
    _wait_policy(black_vhost.name)
    sent = messages(25)
    publish_raw(black_vhost.amqp_url, sent, [f"orders.{i}" for i in range(25)])
    Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(25)), "lost or not, positions stay gapless"
    lost = [r for r in rows if r["kind"] == KIND_LOST]
    kept = [r for r in rows if r["kind"] == KIND_MESSAGE]
    assert len(lost) == 15 and {r["reason"] for r in lost} == {"maxlen"}
    assert [(r["exchange"], r["routing_key"]) for r in lost] == [
        ("ev", f"orders.{i}") for i in range(15)
    ]
    assert [r["body"] for r in kept] == [b for _, b in sent[15:]]
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("lost_maxlen") == 15


def test_a_mirror_queue_created_without_the_overflow_argument_is_taken_as_it_is(
    black_vhost: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mirror queue an older black created (no x-overflow) is refused with the argument
    (406): the sync takes it without, says so, and a refusing policy on it is reported."""
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    mirror = Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json")
    old = {k: v for k, v in mirror.queue_arguments("main").items() if k != "x-overflow"}
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    conn.channel().exchange_declare("ev", "fanout", durable=True)
    conn.channel().queue_declare(QUEUE, durable=True, arguments=old)
    conn.close()
    _limit_policy(black_vhost.name, **{"max-length": 10, "overflow": "reject-publish"})
    gauge = "bridge_black_mirror_queue_refusing"
    deadline = time.monotonic() + 20
    while True:
        report = mirror.sync()
        if REGISTRY.get_sample_value(gauge, {"channel": "main"}) == 1:
            break
        assert time.monotonic() < deadline, "the refusing policy was never reported"
        time.sleep(0.2)
    assert report.channels["main"].bound == ["ev"]
    assert "created without x-overflow" in caplog.text


def test_a_refusing_overflow_policy_on_a_quorum_mirror_queue_is_reported(
    black_vhost: Any, tmp_path: Path
) -> None:
    """On a quorum queue a policy's overflow wins over the queue's argument: at the limit the
    broker would nack producers, and black could never count those messages. The mirror sync
    says so (an error log and a gauge), every sync."""
    cfg = write_config(tmp_path, black_vhost.amqp_url, "quorum")
    setup_mirror(cfg, black_vhost.amqp_url)
    gauge = "bridge_black_mirror_queue_refusing"
    assert REGISTRY.get_sample_value(gauge, {"channel": "main"}) == 0
    _limit_policy(black_vhost.name, **{"max-length": 10, "overflow": "reject-publish"})
    mirror = Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json")
    deadline = time.monotonic() + 20
    while True:  # the broker applies a new policy asynchronously
        mirror.sync()
        if REGISTRY.get_sample_value(gauge, {"channel": "main"}) == 1:
            break
        assert time.monotonic() < deadline, "the refusing policy was never reported"
        time.sleep(0.2)


def test_non_utf8_routing_key_is_stored_and_declared_inexact(
    black_vhost: Any, tmp_path: Path
) -> None:
    """AMQP names are bytes; the row schema keeps them as text. A routing key that is not UTF-8
    is stored with U+FFFD and its record says so — the tap never chokes on it."""
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    setup_mirror(cfg, black_vhost.amqp_url)
    conn = Connection.open(black_vhost.amqp_url)
    try:
        ch = conn.channel()
        ch.confirm_select()
        ch.publish("ev", "k\udcff", b"\x00\x00", b"odd")  # wire bytes b"k\xff"
        last = ch.publish("ev", "plain", b"\x00\x00", b"ok")
        acked = 0
        while acked < last:
            acked = max([acked, *(c.delivery_tag for c in conn.poll(1.0).confirms)])
    finally:
        conn.close()
    Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [(r["routing_key"], r["reason"]) for r in rows] == [
        ("k\ufffd", "non-utf8-name"),
        ("plain", None),
    ]


def test_lost_spool_becomes_a_gap_not_silence(black_vhost: Any, tmp_path: Path) -> None:
    """The spool disappears after the tap acked messages that were never shipped: the next
    tap records those positions as lost (reason spool_lost) and goes on after them."""
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    setup_mirror(cfg, black_vhost.amqp_url)
    publish_raw(black_vhost.amqp_url, messages(50))
    Tap(cfg, "main", until_empty=True).run()
    assert len(spooled(cfg)) == 50

    shutil.rmtree(Path(cfg.black.spool_dir))  # nothing was shipped: the journal says seq -1
    publish_raw(black_vhost.amqp_url, messages(10))
    Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(60))
    assert {(r["kind"], r["reason"]) for r in rows[:50]} == {(KIND_LOST, "spool_lost")}
    assert all(r["kind"] == KIND_MESSAGE for r in rows[50:])
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("lost_spool_lost") == 50


def _dead_letters_then_killed(
    vhost: Any, tmp_path: Path, queue_type: str, point: str = "tap.before_dead_ack", **tap: Any
) -> tuple[Config, list[tuple[bytes, bytes]], list[str], dict[str, str]]:
    """25 messages into a mirror queue limited to 10 (the broker dead-letters the oldest 15),
    then a tap process killed after a group holding dead letters is durable and its mirror
    ack sent, before the dead queue's ack (``point``, asserted; ``tap``: its [black.tap]
    keys). Returns the config, what was published, the routing keys and the env that armed
    the point (its mark now disarms it)."""
    tap = tap or {"group_messages": 4, "prefetch": 50}
    cfg = write_config(tmp_path, vhost.amqp_url, queue_type, **tap)
    setup_mirror(cfg, vhost.amqp_url)
    _limit_policy(vhost.name, **{"max-length": 10})
    _wait_policy(vhost.name)
    sent = messages(25)
    keys = [f"k{i}" for i in range(25)]
    publish_raw(vhost.amqp_url, sent, keys)  # the broker drops the oldest 15
    env = _tap_killed_at(cfg, tmp_path, point)
    return cfg, sent, keys, env


def _each_loss_recorded_once(cfg: Config, keys: list[str]) -> list[dict[str, Any]]:
    """The spool's rows, gapless, with one lost record per dropped message (the first 15
    keys), each with its own exchange, routing key and reason."""
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(len(rows)))
    lost = [r for r in rows if r["kind"] == KIND_LOST]
    assert len(lost) == 15, f"{len(lost)} losses recorded for 15 dropped messages"
    assert [(r["exchange"], r["routing_key"], r["reason"]) for r in lost] == [
        ("ev", k, "maxlen") for k in keys[:15]
    ]
    return rows


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_crash_before_the_dead_letters_ack_records_each_loss_once(
    black_vhost: Any, tmp_path: Path, queue_type: str
) -> None:
    """SIGKILL after a group holding dead letters is durable, its mirror-queue ack sent but not
    its dead-queue ack: the broker redelivers the dead letters, and the restarted tap
    recognises each from the fingerprint its lost record keeps and skips it. The loss is
    counted exactly (15 dropped, 15 lost seqs), with each message's own exchange and routing
    key (from x-death), not the dead-letter routing key."""
    cfg, sent, keys, env = _dead_letters_then_killed(black_vhost, tmp_path, queue_type)
    recorded = sum(1 for r in spooled(cfg) if r["kind"] == KIND_LOST)
    assert recorded >= 1  # durable, their ack never sent
    second = _tap_process(cfg, env)  # the mark disarms the point: this run drains the rest
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-2000:]
    rows = _each_loss_recorded_once(cfg, keys)
    kept = [r for r in rows if r["kind"] == KIND_MESSAGE]
    assert [(r["routing_key"], r["body"]) for r in kept] == [
        (k, b) for k, (_, b) in zip(keys[15:], sent[15:], strict=True)
    ]
    st = tap_status(cfg, "main")
    assert st is not None
    assert st.counters.get("dead_redelivered_skipped") == recorded, st.counters
    assert st.counters.get("lost_maxlen", 0) == 15 - recorded, st.counters
    assert queue_depth(black_vhost.amqp_url, QUEUE + ".dead") == 0


def _drop_policy(vhost: str, queue: str = QUEUE) -> None:
    """Remove ``_limit_policy`` and wait until the broker no longer applies it to the queue."""
    vh = urllib.parse.quote(vhost, safe="")
    r = requests.delete(f"{MGMT}/api/policies/{vh}/limit-mirror", auth=AUTH, timeout=10)
    assert r.status_code == 204, r.text
    url = f"{MGMT}/api/queues/{vh}?disable_stats=true&enable_queue_totals=true"
    deadline = time.monotonic() + 20
    while any(
        q.get("name") == queue and q.get("policy") == "limit-mirror"
        for q in requests.get(url, auth=AUTH, timeout=10).json()
    ):
        assert time.monotonic() < deadline, "the policy was never removed"
        time.sleep(0.1)


def _hold(url: str, queue: str, *, prefetch: int = 1000) -> tuple[Connection, int]:
    """Another connection consuming ``queue`` without acking: once no other consumer is left
    (a killed tap's is dropped by the broker), it takes every message ready and holds them
    until it is closed (they go back to the queue then). Returns it and how many it holds."""
    conn = Connection.open(url)
    ch = conn.channel()
    deadline = time.monotonic() + 20
    while (info := ch.queue_declare(queue, passive=True)).consumer_count:
        assert time.monotonic() < deadline, f"a consumer stayed on {queue}"
        time.sleep(0.05)
    ch.basic_qos(prefetch)
    ch.basic_consume(queue)
    held = 0
    while held < min(info.message_count, prefetch):
        assert time.monotonic() < deadline, f"{queue}: {held} of {info.message_count} delivered"
        held += len(conn.poll(0.5).deliveries)
    return conn, held


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_dead_letters_redelivered_after_other_traffic_are_still_recorded_once(
    black_vhost: Any, tmp_path: Path, queue_type: str
) -> None:
    """The mirror queue's and the dead queue's deliveries are not ordered with each other.
    SIGKILL before the dead letters' ack (``tap.before_dead_ack``), and their redeliveries
    come back late: here another connection holds them (as a connection of a tap the broker
    has not dropped yet would). Meanwhile the restarted tap spools, acks and proves new
    messages, and stops. Those proofs say nothing of the dead queue: the lost records stay
    after ``acked_through``, so the next run still recognises their dead letters and each
    loss is counted once (before, the second run recorded them all again)."""
    cfg, sent, keys, _ = _dead_letters_then_killed(black_vhost, tmp_path, queue_type)
    recorded = [r["pos"] for r in spooled(cfg) if r["kind"] == KIND_LOST]
    assert recorded  # durable, their dead letters never acked
    _drop_policy(black_vhost.name)
    holder, held = _hold(black_vhost.amqp_url, QUEUE + ".dead")
    assert held == 15  # every dead letter, those recorded among them
    more = [(encode_properties(Properties(message_id=f"more{i}")), f"more-{i}".encode())
            for i in range(6)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, more, [f"more{i}" for i in range(6)])
    with _tap_running(cfg) as th:
        deadline = time.monotonic() + 30
        while sum(r["kind"] == KIND_MESSAGE for r in spooled(cfg)) < 16:
            assert th.is_alive() and time.monotonic() < deadline, "the kept messages never spooled"
            time.sleep(0.1)
        time.sleep(0.5)  # the acks of the last group are proven meanwhile
    second = tap_status(cfg, "main")
    assert second is not None
    # the window: new messages durable, acked and proven; no dead letter came back to the tap
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0
    assert [r["pos"] for r in spooled(cfg) if r["kind"] == KIND_LOST] == recorded
    assert second.counters.get("dead_redelivered_skipped", 0) == 0, second.counters
    assert second.acked_through < recorded[0], "a loss whose dead letter may come back is proven"
    holder.close()  # the dead letters go back to the dead queue
    Tap(cfg, "main", until_empty=True).run()
    rows = _each_loss_recorded_once(cfg, keys)
    kept = [r["body"] for r in rows if r["kind"] == KIND_MESSAGE]
    assert kept == [b for _, b in sent[15:]] + [b for _, b in more]
    st = tap_status(cfg, "main")
    assert st is not None
    assert st.counters.get("dead_redelivered_skipped") == len(recorded), st.counters
    assert queue_depth(black_vhost.amqp_url, QUEUE + ".dead") == 0


def _await_status(cfg: Config, th: threading.Thread, cond: Any, what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        st = tap_status(cfg, "main")
        if st is not None and cond(st):
            return st
        assert th.is_alive(), f"the tap died before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(0.05)


def test_a_tap_restarted_after_acks_never_proven_does_not_stay_paused(
    black_vhost: Any, tmp_path: Path
) -> None:
    """SIGKILL after a group's ack, before the broker's proof (``tap.after_ack``), with that
    group filling most of the spool's quota. The broker applied the ack: nothing comes back,
    so nothing on a new connection proves it, and the records stay after ``acked_through``
    where release never frees them. The restarted tap pauses at the quota and, finding that
    the broker delivers only new messages and holds no redelivery, settles them: the shipped
    records are released and the tap resumes by itself."""
    big = {"max_bytes": 16 << 20, "segment_bytes": 1 << 20}
    cfg = write_config(
        tmp_path, black_vhost.amqp_url, group_messages=12, group_seconds=5, prefetch=100,
        spool=big,
    )  # fmt: skip
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = [(encode_properties(Properties(message_id=f"m{i}")), bytes([i]) * 1_000_000)
            for i in range(24)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, sent[:12])
    _tap_killed_at(cfg, tmp_path, "tap.after_ack")
    deadline = time.monotonic() + 20
    while True:  # the broker dropped the dead tap's consumer; it had applied the ack
        with Connection.open(black_vhost.amqp_url) as conn:
            q = conn.channel().queue_declare(QUEUE, passive=True)
        if q.consumer_count == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (q.consumer_count, q.message_count) == (0, 0)
    r = SpoolReader(Path(cfg.black.spool_dir), "main")
    assert r.durable_end() == 12
    StateStore(Path(cfg.black.state_dir)).save(ChannelState("main", last_seq=11))  # shipped
    publish_raw(black_vhost.amqp_url, sent[12:])
    with _tap_running(cfg) as th:
        st = _await_status(cfg, th, lambda s: s.durable_end == 24, "the tap resumed", 15)
    assert st.acked_through >= 11 and not st.paused
    # it paused at least once (how many a group held depends on timing); spooled each once
    assert st.counters.get("handed_back", 0) >= 1 and st.counters.get("delivered") == 12
    rows = spooled(cfg)
    assert [(x["pos"], x["body"]) for x in rows] == [(i + 12, b) for i, (_, b) in
                                                     enumerate(sent[12:])]  # fmt: skip
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def _consumers_gone(url: str, *queues: str) -> None:
    """Until the broker dropped a killed tap's consumers of ``queues``; asserts it had applied
    the acks that tap sent (nothing left to redeliver)."""
    deadline = time.monotonic() + 20
    for queue in queues:
        while True:
            with Connection.open(url) as conn:
                q = conn.channel().queue_declare(queue, passive=True)
            if q.consumer_count == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (q.consumer_count, q.message_count) == (0, 0), (queue, q)


STILL_HELD = "another consumer still holds a queue that could redeliver"
DRAINED = "empty with no consumer: none can come back"
ALONE = "the tap is its only consumer now"


def _own_status(cfg: Config, th: threading.Thread) -> Any:
    """The status this process's tap wrote (not the one a killed tap process left)."""
    return _await_status(cfg, th, lambda s: s.pid == os.getpid(), "the tap's status", 20)


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_quiet_queue_that_will_never_redeliver_does_not_hold_acked_through(
    black_vhost: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, queue_type: str,
) -> None:  # fmt: skip
    """SIGKILL after the acks of a group holding every dead letter, before their proof
    (``tap.after_ack``): the broker applied them, so none comes back. When the tap restarts,
    another consumer holds the dead queue (as a dead tap's connection the broker has not
    dropped yet would), so the dead queue is *behind*; then that consumer goes and no dead
    letter ever comes again. The tap looks again (``RECHECK_S``), finds the queue empty with no
    consumer for ``DRAINED_HOLD_S`` and proves it: ``acked_through`` follows the new messages
    (before, it stayed where the crash left it until the spool filled, and the paused tap
    settled it)."""
    monkeypatch.setattr("bridge.black.tap.RECHECK_S", 0.3)
    monkeypatch.setattr("bridge.black.tap.DRAINED_HOLD_S", 1.0)
    caplog.set_level(logging.DEBUG, logger="bridge.black.tap")
    cfg, sent, keys, _ = _dead_letters_then_killed(
        black_vhost, tmp_path, queue_type, "tap.after_ack", group_messages=100, group_seconds=2,
        prefetch=100,
    )  # fmt: skip
    assert len(spooled(cfg)) == 25  # one group: the 10 kept and the 15 lost
    _consumers_gone(black_vhost.amqp_url, QUEUE, QUEUE + ".dead")
    holder, held = _hold(black_vhost.amqp_url, QUEUE + ".dead")
    assert held == 0
    more = [(encode_properties(Properties(message_id=f"more{i}")), f"more-{i}".encode())
            for i in range(6)]  # fmt: skip
    with _tap_running(cfg) as th:
        _own_status(cfg, th)
        publish_raw(black_vhost.amqp_url, more[:3], ["more0", "more1", "more2"])
        st = _await_status(cfg, th, lambda s: s.durable_end == 28, "new messages spooled", 20)
        time.sleep(1.5)  # rechecks meanwhile (asserted): the other consumer is still there
        st = tap_status(cfg, "main")
        assert st is not None and st.acked_through == -1, "a queue another consumer holds proved"
        assert any(STILL_HELD in r.getMessage() for r in caplog.records)
        assert not any(DRAINED in r.getMessage() for r in caplog.records)
        holder.close()
        publish_raw(black_vhost.amqp_url, more[3:], ["more3", "more4", "more5"])
        st = _await_status(
            cfg, th, lambda s: s.acked_through == 30, "acked_through followed", 20
        )  # fmt: skip
    assert any(DRAINED in r.getMessage() for r in caplog.records)
    assert not st.paused and st.counters.get("handed_back", 0) == 0, st
    rows = _each_loss_recorded_once(cfg, keys)
    kept = [r["body"] for r in rows if r["kind"] == KIND_MESSAGE]
    assert kept == [b for _, b in sent[15:]] + [b for _, b in more]


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_behind_queue_whose_other_consumer_left_catches_up_while_busy(
    black_vhost: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, queue_type: str,
) -> None:  # fmt: skip
    """SIGKILL after a group's acks, before their proof (``tap.after_ack``); the broker applied
    them. The tap restarts while another consumer holds the mirror queue's backlog, so no
    delivery can prove the queue caught up. Then that consumer goes, its backlog back in the
    queue: never empty while it drains, but the tap looks again (``RECHECK_S``), sees it is
    the only consumer, consumes afresh, and its next new message proves it. ``acked_through``
    follows while the backlog drains (a queue that is never empty proves nothing else: the
    drained check needs ``DRAINED_HOLD_S``, 70 s, of empty readings)."""
    monkeypatch.setattr("bridge.black.tap.RECHECK_S", 0.2)
    caplog.set_level(logging.DEBUG, logger="bridge.black.tap")
    # a message per group, fsynced and proven before the next: the backlog drains for a while
    cfg = write_config(tmp_path, black_vhost.amqp_url, queue_type, group_messages=1, prefetch=1)
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = messages(1)
    publish_raw(black_vhost.amqp_url, sent)
    _tap_killed_at(cfg, tmp_path, "tap.after_ack")
    assert len(spooled(cfg)) == 1
    _consumers_gone(black_vhost.amqp_url, QUEUE)
    backlog = [(encode_properties(Properties(message_id=f"b{i}")), f"b-{i}".encode())
               for i in range(3000)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, backlog)
    holder, held = _hold(black_vhost.amqp_url, QUEUE, prefetch=5000)
    assert held == 3000
    with _tap_running(cfg) as th:
        _own_status(cfg, th)
        time.sleep(1.0)  # rechecks meanwhile (asserted): the other consumer is still there
        st = tap_status(cfg, "main")
        assert st is not None and st.durable_end == 1 and st.acked_through == -1, st
        assert any(STILL_HELD in r.getMessage() for r in caplog.records)
        holder.close()  # the backlog goes back to the queue
        st = _await_status(
            cfg, th, lambda s: s.acked_through >= 20, "acked_through followed", 20
        )  # fmt: skip
        assert st.durable_end < 3001, "the backlog had drained: the proof came from elsewhere"
        st = _await_status(cfg, th, lambda s: s.durable_end == 3001, "the backlog drained", 120)
    assert any(ALONE in r.getMessage() for r in caplog.records)
    assert not any(DRAINED in r.getMessage() for r in caplog.records)
    rows = spooled(cfg)
    assert sorted(r["body"] for r in rows) == sorted(b for _, b in sent + backlog)


UNSETTLED = "spooled records whose acks were never proven stay unreleased"


def test_a_paused_tap_settles_without_taking_messages_it_would_hand_back(
    black_vhost: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A quorum queue counts every message handed back toward its delivery limit (2 here). A
    tap paused at its quota by records whose acks were never proven (``tap.after_ack``)
    tries to settle them every ``PROOF_RETRY_S`` — in vain while another consumer holds the
    mirror queue. Those attempts take no message; once the other consumer is gone, the next
    one takes a single message (prefetch 1), hands it back, settles, and the tap resumes.
    Nothing reaches the delivery limit: every message is spooled once, none dropped (before,
    each attempt took and handed back a whole prefetch window, and after two attempts the
    broker dead-lettered every waiting message as ``delivery_limit``)."""
    monkeypatch.setattr("bridge.black.tap.PROOF_RETRY_S", 0.5)
    caplog.set_level(logging.INFO, logger="bridge.black.tap")
    cfg = write_config(
        tmp_path, black_vhost.amqp_url, "quorum", group_messages=12, group_seconds=1,
        prefetch=100, spool={"max_bytes": 16 << 20, "segment_bytes": 1 << 20},
    )  # fmt: skip
    setup_mirror(cfg, black_vhost.amqp_url)
    _limit_policy(black_vhost.name, **{"delivery-limit": 2})
    _wait_policy(black_vhost.name)
    sent = [(encode_properties(Properties(message_id=f"m{i}")), bytes([i]) * 1_000_000)
            for i in range(24)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, sent[:12])
    _tap_killed_at(cfg, tmp_path, "tap.after_ack")
    assert SpoolReader(Path(cfg.black.spool_dir), "main").durable_end() == 12
    StateStore(Path(cfg.black.state_dir)).save(ChannelState("main", last_seq=11))  # shipped
    publish_raw(black_vhost.amqp_url, sent[12:])
    holder, held = _hold(black_vhost.amqp_url, QUEUE, prefetch=1)
    assert held == 1
    with _tap_running(cfg) as th:
        deadline = time.monotonic() + 30
        while sum(UNSETTLED in r.getMessage() for r in caplog.records) < 4:
            st = tap_status(cfg, "main")
            assert st is None or not any(k.startswith("lost_") for k in st.counters), (
                f"the broker dropped messages of the paused tap: {st.counters}"
            )
            assert th.is_alive() and time.monotonic() < deadline, "the tap never settled again"
            time.sleep(0.1)
        # at the pause, then at least three times more: each attempt failed
        st = tap_status(cfg, "main")
        assert st is not None and st.paused and st.durable_end == 12, st
        holder.close()  # its message goes back to the queue
        st = _await_status(cfg, th, lambda s: s.durable_end == 24, "the tap resumed", 30)
    assert not st.paused and st.acked_through >= 11
    assert st.counters.get("delivered") == 12, st.counters
    assert not any(k.startswith("lost_") for k in st.counters), st.counters
    # the group at the pause (the 11 not held), then one message: the failed attempts took none
    assert st.counters.get("handed_back") == 11 + 1, st.counters
    rows = spooled(cfg)
    assert [x["pos"] for x in rows] == list(range(12, 24))
    assert all(x["kind"] == KIND_MESSAGE for x in rows)
    assert sorted(x["body"] for x in rows) == [b for _, b in sent[12:]]  # once each
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0
    assert queue_depth(black_vhost.amqp_url, QUEUE + ".dead") == 0


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A fresh 32 MiB tmpfs (a disk that really fills up)."""
    with small_tmpfs("32m", "tapfs") as d:
        yield d


def _fill(path: Path) -> None:
    """Write ``path`` until its file system has not one byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)


def test_a_tap_paused_while_the_disk_refused_its_segment_roll_resumes_once_there_is_room(
    black_vhost: Any, tmp_path: Path, small_fs: Path
) -> None:
    """At its quota the spool closes its current segment so that release can free it; on a
    disk that is full at that moment the roll fails. The paused tap retries it while it waits:
    once the disk has room again and black shipped, the segment is closed and released and
    the tap resumes — it does not wait for a restart."""
    cfg = write_config(
        tmp_path, black_vhost.amqp_url, group_messages=6, group_seconds=5, prefetch=100,
        spool_dir=str(small_fs / "spool"),
        spool={"max_bytes": 16 << 20, "segment_bytes": 64 << 20, "min_free_bytes": 0},
    )  # fmt: skip
    setup_mirror(cfg, black_vhost.amqp_url)
    sent = [(encode_properties(Properties(message_id=f"m{i}")), bytes([i]) * 1_000_000)
            for i in range(18)]  # fmt: skip
    publish_raw(black_vhost.amqp_url, sent[:12])
    filler = small_fs / "filler"
    with _tap_running(cfg) as th:
        _await_status(cfg, th, lambda s: s.durable_end == 12, "12 spooled", 15)
        _fill(filler)  # something else filled the disk
        publish_raw(black_vhost.amqp_url, sent[12:])  # 6 MB more would pass the quota
        _await_status(cfg, th, lambda s: s.paused and "max_bytes" in s.paused, "a pause", 15)
        assert [p.name for p in (small_fs / "spool" / "main").glob("seg-*")] == [
            "seg-0000000000000000.arrow"  # the roll failed: nothing can be released
        ]
        StateStore(Path(cfg.black.state_dir)).save(ChannelState("main", last_seq=11))
        filler.unlink()  # room on the disk again, and black shipped everything
        st = _await_status(cfg, th, lambda s: s.durable_end == 18, "the tap resumed", 15)
    assert not st.paused and st.counters.get("delivered") == 18
    rows = spooled(cfg)
    assert [(x["pos"], x["body"]) for x in rows] == [(i + 12, b) for i, (_, b) in
                                                     enumerate(sent[12:])]  # fmt: skip
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def test_non_utf8_names_redelivered_after_a_crash_are_recognised(
    black_vhost: Any, tmp_path: Path
) -> None:
    """Routing keys that are not UTF-8, SIGKILL between fsync and ack: the restarted tap
    fingerprints each redelivery from its names as the spool stores them (U+FFFD), so it
    neither crashes on them nor spools them twice, and loses none."""
    cfg = write_config(tmp_path, black_vhost.amqp_url, group_messages=50, prefetch=50)
    setup_mirror(cfg, black_vhost.amqp_url)
    props = encode_properties(Properties(delivery_mode=2))
    sent = [("ev", f"k\udcff{i % 3}", props, f"odd-{i}".encode()) for i in range(200)]
    publish_confirmed(black_vhost.amqp_url, sent)  # wire routing keys b"k\xff0"...
    env = _tap_killed_at(cfg, tmp_path, "tap.after_sync", nth=2)
    assert len(spooled(cfg)) == 100  # two groups durable, the second never acked
    second = _tap_process(cfg, env)
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-2000:]
    rows = spooled(cfg)
    assert [r["body"] for r in rows] == [b for *_, b in sent], "each message once, in order"
    assert {(r["routing_key"], r["reason"]) for r in rows} == {
        (f"k\ufffd{i}", "non-utf8-name") for i in range(3)
    }
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("redelivered_skipped", 0) >= 1, st.counters
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def _deny_config(tmp_path: Path, url: str, **tap: Any) -> Config:
    """Channel main mirrors every exchange but ``secret*``; ``secret`` is bound into ``ev``
    (an exchange-to-exchange binding: its messages reach the mirror queue through ``ev``,
    keeping their own exchange name)."""
    cfg = write_config(tmp_path, url, **tap)
    assert cfg.source is not None
    text = cfg.source.read_text().replace(
        'exchanges = ["ev"]', 'exchanges = ["*"]\ndeny = ["secret*"]'
    )
    cfg.source.write_text(text)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare("ev", "fanout", durable=True)
    ch.exchange_declare("secret", "topic", durable=True)
    ch.exchange_bind(destination="ev", source="secret", routing_key="#")
    conn.close()
    cfg = load_config(cfg.source)
    report = Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json").sync()
    assert report.channels["main"].bound == ["ev"]
    return cfg


def _alternating(n: int) -> list[tuple[str, str, bytes, bytes]]:
    """``n`` messages to ``ev`` and ``n`` to ``secret``, one after the other."""
    props = encode_properties(Properties(delivery_mode=2))
    out = []
    for i in range(n):
        out.append(("ev", f"k{i}", props, f"ev-{i}".encode()))
        out.append(("secret", f"s{i}", props, f"classified-{i}".encode()))
    return out


def test_a_denied_exchange_bound_into_a_mirrored_one_reaches_no_record(
    black_vhost: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Messages of a denied exchange that reach the mirror queue through an exchange-to-
    exchange binding are dropped by the tap: never spooled, not even as the lost record of a
    dead letter (their names stay out too), acked with their group, counted ``denied`` and
    logged with the channel, exchange and count. Positions stay gapless."""
    caplog.set_level(logging.WARNING)
    cfg = _deny_config(tmp_path, black_vhost.amqp_url, group_messages=2, prefetch=10)
    _limit_policy(black_vhost.name, **{"max-length": 4})
    _wait_policy(black_vhost.name)
    publish_confirmed(black_vhost.amqp_url, _alternating(5))  # the oldest 6 are dead-lettered
    Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(len(rows)))
    assert all(r["exchange"] == "ev" for r in rows), rows
    assert sorted((r["kind"], r["routing_key"]) for r in rows) == [
        (KIND_MESSAGE, "k3"), (KIND_MESSAGE, "k4"),
        (KIND_LOST, "k0"), (KIND_LOST, "k1"), (KIND_LOST, "k2"),
    ]  # fmt: skip
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("denied") == 5, st.counters
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0
    assert queue_depth(black_vhost.amqp_url, QUEUE + ".dead") == 0
    warned = [r for r in caplog.records if "denies were dropped" in r.getMessage()]
    assert warned, caplog.text
    assert {(getattr(r, "exchange", None), getattr(r, "channel", None)) for r in warned} == {
        ("secret", "main")
    }
    assert sum(getattr(r, "count", 0) for r in warned) == 5


def test_a_crash_among_denied_deliveries_loses_and_duplicates_nothing(
    black_vhost: Any, tmp_path: Path
) -> None:
    """Denied deliveries between spooled ones, SIGKILL between fsync and ack, then a restart:
    they are acked only with their group (``multiple`` never passes an unsynced record), so
    every mirrored message is spooled exactly once, in order, and no denied one at all."""
    cfg = _deny_config(tmp_path, black_vhost.amqp_url, group_messages=20, prefetch=100)
    sent = _alternating(150)
    publish_confirmed(black_vhost.amqp_url, sent)
    env = _tap_killed_at(cfg, tmp_path, "tap.after_sync", nth=3)
    assert len(spooled(cfg)) >= 60
    second = _tap_process(cfg, env)
    assert second.returncode == 0, second.stderr.decode(errors="replace")[-2000:]
    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(len(rows)))
    assert [r["body"] for r in rows] == [b for e, *_, b in sent if e == "ev"]
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get("denied", 0) >= 1, st.counters
    assert queue_depth(black_vhost.amqp_url, QUEUE) == 0


def test_a_quorum_redelivery_is_marked_inexact_only_if_its_header_order_may_differ(
    black_vhost: Any, tmp_path: Path
) -> None:
    """A quorum queue re-encodes a redelivery's content header to add x-delivery-count,
    sorting the header table. Stripped of that count, a message with no header or one header
    is byte-exact (kept unmarked); one with several may have had another order: marked
    ``quorum-reencoded``."""
    cfg = write_config(tmp_path, black_vhost.amqp_url, "quorum")
    setup_mirror(cfg, black_vhost.amqp_url)
    tables: list[dict[str, Any] | None] = [None, {"z": 1}, {"z": 1, "a": 2, "m": 3}]
    sent = [
        ("ev", "", encode_properties(Properties(delivery_mode=2, message_id=f"m{i}",
                                                headers=field_table(t) if t else None)),
         f"b{i}".encode())
        for i, t in enumerate(tables)
    ]  # fmt: skip
    publish_confirmed(black_vhost.amqp_url, sent)
    conn, held = _hold(black_vhost.amqp_url, QUEUE)  # delivered, then handed back unacked
    assert held == 3
    conn.close()
    Tap(cfg, "main", until_empty=True).run()
    rows = spooled(cfg)
    assert [r["body"] for r in rows] == [b for *_, b in sent]
    assert all(r["redelivered"] for r in rows)
    assert [r["reason"] for r in rows] == [None, None, REENCODED]
    assert [r["properties_raw"] for r in rows[:2]] == [p for _, _, p, _ in sent[:2]]
    assert order_free(rows[2]["properties_raw"]) == order_free(sent[2][2])
    st = tap_status(cfg, "main")
    assert st is not None and st.counters.get(f"inexact_{REENCODED}") == 1, st.counters
