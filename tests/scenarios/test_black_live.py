"""Scenario: the continuous black job, live — idle heartbeats, an exchange born while it runs, a
direct exchange without routing keys that must be reported, and heartbeats that keep their
period while a large batch is sealed.

Real broker vhost, real gpg, real Spark in a subprocess (``spark_jobs/black_drain.py --trigger
continuous``) in its own process group, killed as a group in a ``finally``. Everything the job
produced is read back with independent tools only: the ``gpg`` command line, ``pyarrow.parquet``
and the RabbitMQ management API.

1. Idle: with no traffic, heartbeats (``.dheartbeat``) keep coming; their seqs are gapless, each
   decrypts and verifies with the red key to a heartbeat JSON with ``last_bundle_seq`` null
   (nothing shipped yet). No bundle appears.
2. A NEW topic exchange declared while the job runs is bound to the channel's mirror queue by
   the mirror loop; every message published to it arrives in bundles (exchange_type "topic"),
   and a later heartbeat names the highest bundle seq.
3. A direct exchange matching the channel's patterns but without ``direct_routing_keys`` is
   reported by the mirror (a WARNING on the job's stderr, once) and its messages are in no bundle.
4. A backlog of large messages made durable by the tap in one group is sealed in one long
   micro-batch (several bundles). The heartbeat writer does not wait for the sealer: the gaps
   between the heartbeats' ``black_time`` around and during that sealing stay under twice
   ``heartbeat_seconds``. The test first proves the case happened: the sealing lasted at least
   two heartbeat periods (else a heartbeat blocked by it could not have shown).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import signal
import urllib.parse
from pathlib import Path
from typing import Any

import pika
import pyarrow.parquet as pq
import pytest
import requests

from bridge.crypto.keys import init_keys
from tests.support import BlackJob, bundle_files, gpg_open_cli, publish_confirmed, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

AUTH = ("guest", "guest")
CHANNEL = "live"
BRIDGE_ID = "live-black"
TOPIC_EX = "live.orders"  # declared only once the job runs
DIRECT_EX = "live.commands"  # direct, and no direct_routing_keys for it
BLOB_EX = "live.blobs"  # fanout, for the large messages
N_TOPIC = 57
N_DIRECT = 13
MAX_ROWS = 20
HEARTBEAT_S = 1.0
N_BIG = 100
BIG_BYTES = 4 * 1024 * 1024


def tap_pids(job_pid: int) -> list[int]:
    """The pids of ``diode black tap`` processes whose parent is ``job_pid``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == job_pid and b"tap" in cmd:
            found.append(int(d.name))
    return found


def write_config(work: Path, amqp_url: str, mgmt: str, black_fpr: str, red_fpr: str) -> Path:
    p = work / "diode.toml"
    p.write_text(
        f"""
[link]
bridge_id = "{BRIDGE_ID}"
black_signers = ["{black_fpr}"]

[[channels]]
name = "{CHANNEL}"
exchanges = ["live.*"]
recipients = ["{red_fpr}"]

[black]
amqp_url = "{amqp_url}"
management_url = "{mgmt}"
gnupg_home = "keys/black"
signing_key = "{black_fpr}"
discover = true
discover_interval_seconds = 1.0
heartbeat_seconds = {HEARTBEAT_S}
trigger_seconds = 1.0
max_messages_per_batch = 1000
max_batch_bytes = 1073741824

[black.bundle]
max_rows = {MAX_ROWS}
max_age_seconds = 1.0

[black.tap]
# the large backlog becomes durable in one group, so Spark plans it as one micro-batch
group_messages = {N_BIG}
group_seconds = 5.0
group_bytes = {2 * N_BIG * BIG_BYTES}
"""
    )
    p.chmod(0o600)  # it holds the AMQP password
    return p


# --------------------------------------------------------------------------- independent reading


def heartbeat_files(outbox: Path) -> dict[int, Path]:
    out = {}
    for p in outbox.glob("*.dheartbeat"):
        channel, seq, _ = p.name.split(".")
        assert channel == CHANNEL, p.name
        out[int(seq)] = p
    return out


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)


def check_heartbeat(hb: dict[str, Any], seq: int) -> None:
    assert hb["format"] == 1
    assert hb["channel"] == CHANNEL and hb["bridge_id"] == BRIDGE_ID
    assert hb["heartbeat_seq"] == seq, "heartbeat name and content disagree"
    assert hb["interval_seconds"] == HEARTBEAT_S
    t = parse_time(hb["black_time"])
    assert abs((dt.datetime.now(dt.UTC) - t).total_seconds()) < 600, hb["black_time"]


def queue_binding_sources(mgmt: str, vhost: str, queue: str) -> set[str]:
    v, q = urllib.parse.quote(vhost, safe=""), urllib.parse.quote(queue, safe="")
    r = requests.get(f"{mgmt}/api/queues/{v}/{q}/bindings", auth=AUTH, timeout=10)
    if r.status_code == 404:
        return set()
    r.raise_for_status()
    return {b["source"] for b in r.json() if b["source"]}


class Bundles:
    """Reads each new bundle of the outbox once (gpg CLI + pyarrow); rows kept light."""

    def __init__(self, outbox: Path, red_home: Path, black_fpr: str) -> None:
        self.outbox, self.red_home, self.black_fpr = outbox, red_home, black_fpr
        self.manifests: dict[int, dict[str, Any]] = {}
        self.rows: list[dict[str, Any]] = []
        """Every row, the body replaced by its SHA-256 for messages of BLOB_EX."""

    def update(self) -> int:
        """Read the bundles not read yet; returns how many rows were read so far."""
        for p in bundle_files(self.outbox):
            seq = int(p.name.split(".")[1])
            if seq in self.manifests:
                continue
            pf = pq.ParquetFile(io.BytesIO(gpg_open_cli(self.red_home, p, self.black_fpr)))
            m = json.loads((pf.metadata.metadata or {})[b"diode.manifest"])
            assert m["bundle_seq"] == seq and m["channel"] == CHANNEL
            self.manifests[seq] = m
            for r in pf.read().to_pylist():
                if r["exchange"] == BLOB_EX:
                    r["body"] = hashlib.sha256(r["body"]).hexdigest()
                self.rows.append(r)
        return len(self.rows)


def micro_batches(job: BlackJob) -> list[dict[str, Any]]:
    """The sink's "micro-batch timing" events that sealed rows."""
    return [
        e
        for e in job.log_events()
        if e.get("logger") == "bridge.black.sink"
        and e.get("msg") == "micro-batch timing"
        and e.get("rows", 0) > 0
    ]


def publish_blobs(url: str, bodies: list[bytes]) -> None:
    blobs = [(BLOB_EX, "", b"\x00\x00", body) for body in bodies]
    publish_confirmed(url, blobs, client_name="live-test-blobs")


# --------------------------------------------------------------------------- the scenario


def test_live_job_heartbeats_new_exchange_unbound_direct_and_a_long_seal(
    black_vhost: Any, short_tmp: Path
) -> None:
    work = short_tmp / "w"
    work.mkdir()
    inv = init_keys(work / "keys", red_names=("red",), bridge_id=BRIDGE_ID)
    red_fpr = next(iter(inv.red_fprs.values()))
    cfg_path = write_config(
        work, black_vhost.amqp_url, black_vhost.management_url, inv.black_fpr, red_fpr
    )
    outbox = work / "black" / "outbox"
    queue = f"diode.mirror.{CHANNEL}"
    bundles = Bundles(outbox, inv.red_home, inv.black_fpr)

    job = BlackJob(cfg_path, "continuous", work)
    try:
        # ---- 1. idle heartbeats
        wait_for(lambda: heartbeat_files(outbox), 120, "the first heartbeat", job)
        wait_for(lambda: len(heartbeat_files(outbox)) >= 2, 30, "a second heartbeat", job)
        queues = requests.get(
            f"{black_vhost.management_url}/api/queues/"
            f"{urllib.parse.quote(black_vhost.name, safe='')}",
            auth=AUTH,
            timeout=10,
        ).json()
        assert queue in {q["name"] for q in queues}, "the channel's mirror queue was not declared"
        hbs = heartbeat_files(outbox)
        first = min(hbs)  # a new install numbers heartbeats from the time, then counts on
        assert sorted(hbs) == list(range(first, first + len(hbs))), f"heartbeat seqs {sorted(hbs)}"
        for seq, p in sorted(hbs.items()):
            hb = json.loads(gpg_open_cli(inv.red_home, p, inv.black_fpr))
            check_heartbeat(hb, seq)
            assert hb["last_bundle_seq"] is None, "no bundle was ever shipped"
            assert hb["last_seq"] is None
        assert bundle_files(outbox) == [], "bundles from an idle vhost"
        idle_beats = max(hbs)

        # ---- 2./3. a new topic exchange and an unbound direct exchange, while running
        conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.exchange_declare(TOPIC_EX, "topic", durable=True)
        ch.exchange_declare(DIRECT_EX, "direct", durable=True)
        ch.exchange_declare(BLOB_EX, "fanout", durable=True)

        def bound() -> bool:
            src = queue_binding_sources(black_vhost.management_url, black_vhost.name, queue)
            return {TOPIC_EX, BLOB_EX} <= src

        wait_for(bound, 30, f"the mirror loop to bind {TOPIC_EX!r} and {BLOB_EX!r}", job)

        direct_msg = f"direct exchange {DIRECT_EX!r} is NOT mirrored"

        def direct_reported() -> list[dict[str, Any]]:
            return [
                e
                for e in job.log_events()
                if e.get("logger") == "bridge.black.mirror"
                and e.get("level") == "warning"
                and direct_msg in e.get("msg", "")
            ]

        warned = wait_for(direct_reported, 30, f"a warning about {DIRECT_EX!r}", job)
        assert warned[0].get("channel") == CHANNEL, warned[0]
        assert "direct_routing_keys" in warned[0]["msg"], "the warning must say how to fix it"
        assert DIRECT_EX not in queue_binding_sources(
            black_vhost.management_url, black_vhost.name, queue
        )

        sent = []
        for i in range(N_TOPIC):
            rk = f"eu.shop{i % 3}.order"
            body = f"order-{i}".encode() * (1 + i % 5)
            props = pika.BasicProperties(message_id=f"o{i}", headers={"i": i})
            ch.basic_publish(TOPIC_EX, rk, body, props)
            sent.append((rk, body, f"o{i}"))
            if i % 10 == 0:  # interleave the direct exchange's traffic
                ch.basic_publish(DIRECT_EX, "cmd", f"direct-{i}".encode())
        for i in range(N_DIRECT - (N_TOPIC + 9) // 10):
            ch.basic_publish(DIRECT_EX, f"cmd{i}", f"direct-x{i}".encode())
        conn.close()

        # ---- every topic message arrives in bundles
        wait_for(lambda: bundles.update() >= N_TOPIC, 90, f"{N_TOPIC} messages", job, poll=0.5)
        top = max(bundles.manifests)
        assert sorted(bundles.manifests) == list(range(1, top + 1)), sorted(bundles.manifests)
        assert top >= N_TOPIC // MAX_ROWS
        rows = sorted(bundles.rows, key=lambda r: r["seq"])
        assert [r["seq"] for r in rows] == list(range(N_TOPIC)), "seqs not gapless / each once"
        assert {r["exchange"] for r in rows} == {TOPIC_EX}, "a direct message was mirrored"
        for r, (rk, body, mid) in zip(rows, sent, strict=True):
            assert r["exchange_type"] == "topic", r["seq"]
            assert (r["routing_key"], r["body"], r["message_id"]) == (rk, body, mid), r["seq"]
        for m in bundles.manifests.values():
            assert m["gaps"] == [] and 0 < m["rows"] <= MAX_ROWS
            assert set(m["exchanges"]) == {TOPIC_EX}

        # ---- a later heartbeat names the highest bundle seq (and the last message seq)
        seen = max(heartbeat_files(outbox))

        def heartbeat_names_top() -> dict[str, Any] | None:
            hbs = heartbeat_files(outbox)
            newest = max(hbs)
            if newest <= seen:
                return None
            hb = json.loads(gpg_open_cli(inv.red_home, hbs[newest], inv.black_fpr))
            check_heartbeat(hb, newest)
            return hb if hb["last_bundle_seq"] == top else None

        hb = wait_for(heartbeat_names_top, 30, f"a heartbeat naming bundle {top}", job, poll=0.3)
        assert hb["last_seq"] == N_TOPIC - 1

        # ---- 4. a long seal of large messages: heartbeats keep their period meanwhile
        batches_before = len(micro_batches(job))
        blobs = [os.urandom(BIG_BYTES) for _ in range(N_BIG)]
        blob_sha = [hashlib.sha256(b).hexdigest() for b in blobs]
        publish_blobs(black_vhost.amqp_url, blobs)
        del blobs
        total = N_TOPIC + N_BIG
        wait_for(lambda: bundles.update() >= total, 240, f"{N_BIG} large messages", job, poll=1)
        sealed_at = dt.datetime.now(dt.UTC)
        hb_seen = max(heartbeat_files(outbox))
        wait_for(  # a heartbeat after the seal closes the window
            lambda: max(heartbeat_files(outbox)) >= hb_seen + 2, 30, "2 more heartbeats", job
        )
        big_batches = micro_batches(job)[batches_before:]
        longest = max(big_batches, key=lambda e: float(e["seal_seconds"]))
        seal_end = parse_time(longest["ts"])
        seal_start = seal_end - dt.timedelta(seconds=float(longest["seal_seconds"]))
        assert seal_end <= sealed_at

        # no heartbeat, sealing or mirror failure along the way; the warning was said once
        bad = [e for e in job.log_events() if e.get("level") in ("error", "critical")]
        assert bad == [], bad
        assert len(direct_reported()) == 1, "the unbound direct exchange must be warned once"

        # ---- 5. systemd's stop (KillMode=mixed): SIGTERM to the job's process only. The job
        #      stops its query and its taps, writes a last heartbeat, prints its summary and
        #      exits 0 (it died with -15, no summary)
        taps = tap_pids(job.proc.pid)
        assert taps, "no tap process found under the job"
        job.proc.send_signal(signal.SIGTERM)
        rc = job.wait(120)
        assert rc == 0, job.stderr_path.read_text()[-3000:]
        summary = json.loads(job.stdout_path.read_text().strip().splitlines()[-1])
        assert summary["messages"] == total, summary
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in taps), 30, "taps to end")
    finally:
        job.kill()

    # ---- the large messages: in bundles, each once, unchanged
    rows = sorted(bundles.rows, key=lambda r: r["seq"])
    assert [r["seq"] for r in rows] == list(range(total)), "seqs not gapless / each once"
    assert [r["body"] for r in rows[N_TOPIC:]] == blob_sha
    big_bundles = [m for m in bundles.manifests.values() if BLOB_EX in m["exchanges"]]
    assert all(m["gaps"] == [] for m in bundles.manifests.values())
    print(
        f"large messages: {len(big_batches)} micro-batch(es), {len(big_bundles)} bundles; "
        f"longest seal {longest['seal_seconds']}s ({longest['rows']} rows)"
    )
    # the case happened: one micro-batch sealed large messages for two heartbeat periods or more
    assert longest["rows"] >= N_BIG // 2, big_batches
    assert (seal_end - seal_start).total_seconds() >= 2 * HEARTBEAT_S, (
        f"the large batch sealed in {longest['seal_seconds']}s: too fast to prove anything; "
        "raise N_BIG"
    )

    # ---- over the whole run: heartbeat seqs gapless; last_bundle_seq never decreases; the
    #      period kept while the large batch was sealed
    hbs = heartbeat_files(outbox)
    assert sorted(hbs) == list(range(first, first + len(hbs))), f"heartbeat seqs {sorted(hbs)}"
    last: list[int | None] = []
    times: list[dt.datetime] = []
    for seq, p in sorted(hbs.items()):
        if seq <= idle_beats:
            continue
        beat = json.loads(gpg_open_cli(inv.red_home, p, inv.black_fpr))
        check_heartbeat(beat, seq)
        last.append(beat["last_bundle_seq"])
        times.append(parse_time(beat["black_time"]))
    known = [x for x in last if x is not None]
    top = max(bundles.manifests)
    assert known == sorted(known) and set(known) <= set(range(1, top + 1))
    assert last[-1] == top
    assert times == sorted(times)
    before = [t for t in times if t <= seal_start]
    after = [t for t in times if t >= seal_end]
    assert before and after, "heartbeats must exist on both sides of the large seal"
    window = [t for t in times if before[-1] <= t <= after[0]]
    gaps = [(b - a).total_seconds() for a, b in zip(window, window[1:], strict=False)]
    print(f"heartbeat gaps around the large seal: {[round(g, 2) for g in gaps]}")
    assert len(window) >= 3, "no heartbeat was written while the large batch sealed"
    assert max(gaps) < 2 * HEARTBEAT_S, (
        f"heartbeats stalled while a large batch sealed: gaps {gaps} (period {HEARTBEAT_S}s)"
    )
