"""Scenario: the continuous black job, live — idle heartbeats, an exchange born while it runs,
and a direct exchange without routing keys that must be reported, not silently mirrored.

Real broker vhost, real gpg, real Spark in a subprocess (``spark_jobs/black_drain.py --trigger
continuous``) in its own process group, killed as a group in a ``finally``. Everything the job
produced is read back with independent tools only: the ``gpg`` command line, ``pyarrow.parquet``
and the RabbitMQ management API.

1. Idle: with no traffic, heartbeats (``.dheartbeat``) keep coming every ``heartbeat_seconds``;
   their seqs are gapless, each decrypts and verifies with the red key to a heartbeat JSON with
   ``last_bundle_seq`` null (nothing shipped yet). No bundle appears.
2. A NEW topic exchange declared while the job runs is bound by the mirror loop within a few
   discover intervals; every message published to it arrives in bundles (exchange_type
   "topic"), and a later heartbeat names the highest bundle seq.
3. A direct exchange matching the channel's patterns but without ``direct_routing_keys`` is
   reported by the mirror (a WARNING on the job's stderr) and its messages are in no bundle.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pika
import pyarrow.parquet as pq
import pytest
import requests

from bridge.crypto.keys import init_keys
from tests.support import BlackJob, bundle_files, gpg_open_cli, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

AUTH = ("guest", "guest")
CHANNEL = "live"
BRIDGE_ID = "live-black"
TOPIC_EX = "live.orders"  # declared only once the job runs
DIRECT_EX = "live.commands"  # direct, and no direct_routing_keys for it
N_TOPIC = 57
N_DIRECT = 13
MAX_ROWS = 20


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
heartbeat_seconds = 1.0
trigger_seconds = 1.0
max_messages_per_batch = 1000

[black.bundle]
max_rows = {MAX_ROWS}
"""
    )
    return p


# --------------------------------------------------------------------------- the job


# --------------------------------------------------------------------------- independent reading


def heartbeat_files(outbox: Path) -> dict[int, Path]:
    out = {}
    for p in outbox.glob("*.dheartbeat"):
        channel, seq, _ = p.name.split(".")
        assert channel == CHANNEL, p.name
        out[int(seq)] = p
    return out


def check_heartbeat(hb: dict[str, Any], seq: int) -> None:
    assert hb["format"] == 1
    assert hb["channel"] == CHANNEL and hb["bridge_id"] == BRIDGE_ID
    assert hb["heartbeat_seq"] == seq, "heartbeat name and content disagree"
    assert hb["interval_seconds"] == 1.0
    t = dt.datetime.strptime(hb["black_time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)
    assert abs((dt.datetime.now(dt.UTC) - t).total_seconds()) < 300, hb["black_time"]


def queue_binding_sources(mgmt: str, vhost: str, queue: str) -> set[str]:
    v, q = urllib.parse.quote(vhost, safe=""), urllib.parse.quote(queue, safe="")
    r = requests.get(f"{mgmt}/api/queues/{v}/{q}/bindings", auth=AUTH, timeout=10)
    if r.status_code == 404:
        return set()
    r.raise_for_status()
    return {b["source"] for b in r.json() if b["source"]}


# --------------------------------------------------------------------------- the scenario


def test_live_job_heartbeats_picks_up_new_exchange_and_reports_unbound_direct(
    black_vhost: Any, short_tmp: Path
) -> None:
    t0 = time.monotonic()
    work = short_tmp / "w"
    work.mkdir()
    inv = init_keys(work / "keys", red_names=("red",), bridge_id=BRIDGE_ID)
    red_fpr = next(iter(inv.red_fprs.values()))
    cfg_path = write_config(
        work, black_vhost.amqp_url, black_vhost.management_url, inv.black_fpr, red_fpr
    )
    outbox = work / "black" / "outbox"
    queue = f"diode.mirror.{CHANNEL}"

    job = BlackJob(cfg_path, "continuous", work)
    try:
        # ---- 1. idle heartbeats
        wait_for(lambda: heartbeat_files(outbox), 120, "the first heartbeat", job)
        up = time.monotonic()
        wait_for(lambda: len(heartbeat_files(outbox)) >= 2, 8, "2 heartbeats within 8 s", job)
        idle_window = time.monotonic() - up
        assert queue in {
            q["name"]
            for q in requests.get(
                f"{black_vhost.management_url}/api/queues/"
                f"{urllib.parse.quote(black_vhost.name, safe='')}",
                auth=AUTH,
                timeout=10,
            ).json()
        }, "the channel's stream queue was not declared"
        hbs = heartbeat_files(outbox)
        assert sorted(hbs) == list(range(1, len(hbs) + 1)), f"heartbeat seqs {sorted(hbs)}"
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
        declared = time.monotonic()
        wait_for(
            lambda: (
                TOPIC_EX
                in queue_binding_sources(black_vhost.management_url, black_vhost.name, queue)
            ),
            15,
            f"the mirror loop to bind {TOPIC_EX!r}",
            job,
        )
        bound_after = time.monotonic() - declared

        direct_msg = f"direct exchange {DIRECT_EX!r} is NOT mirrored"

        def direct_reported() -> list[dict[str, Any]]:
            return [
                e
                for e in job.log_events()
                if e.get("logger") == "bridge.black.mirror"
                and e.get("level") == "warning"
                and direct_msg in e.get("msg", "")
            ]

        warned = wait_for(direct_reported, 15, f"a warning about {DIRECT_EX!r}", job)
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
        rows: list[dict[str, Any]] = []
        manifests: dict[int, dict[str, Any]] = {}

        def all_arrived() -> bool:
            for p in bundle_files(outbox):
                seq = int(p.name.split(".")[1])
                if seq in manifests:
                    continue
                pf = pq.ParquetFile(io.BytesIO(gpg_open_cli(inv.red_home, p, inv.black_fpr)))
                m = json.loads((pf.metadata.metadata or {})[b"diode.manifest"])
                assert m["bundle_seq"] == seq and m["channel"] == CHANNEL
                manifests[seq] = m
                rows.extend(pf.read().to_pylist())
            return len(rows) >= N_TOPIC

        wait_for(all_arrived, 60, f"{N_TOPIC} messages in bundles", job, poll=0.5)
        time.sleep(2.5)  # two more trigger intervals: nothing else may turn up
        all_arrived()
        top = max(manifests)
        assert sorted(manifests) == list(range(1, top + 1)), sorted(manifests)
        assert top >= N_TOPIC // MAX_ROWS
        rows.sort(key=lambda r: r["seq"])
        assert [r["seq"] for r in rows] == list(range(N_TOPIC)), "seqs not gapless / each once"
        assert {r["exchange"] for r in rows} == {TOPIC_EX}, "a direct message was mirrored"
        assert not any(r["body"].startswith(b"direct-") for r in rows)
        for r, (rk, body, mid) in zip(rows, sent, strict=True):
            assert r["exchange_type"] == "topic", r["seq"]
            assert (r["routing_key"], r["body"], r["message_id"]) == (rk, body, mid), r["seq"]
        for m in manifests.values():
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

        hb = wait_for(heartbeat_names_top, 10, f"a heartbeat naming bundle {top}", job, poll=0.3)
        assert hb["last_seq"] == N_TOPIC - 1

        # no heartbeat, sealing or mirror failure along the way; the warning was said once
        bad = [e for e in job.log_events() if e.get("level") in ("error", "critical")]
        assert bad == [], bad
        assert len(direct_reported()) == 1, "the unbound direct exchange must be warned once"
    finally:
        job.kill()

    # ---- over the whole run: heartbeat seqs gapless; last_bundle_seq never decreases
    hbs = heartbeat_files(outbox)
    assert sorted(hbs) == list(range(1, len(hbs) + 1)), f"heartbeat seqs {sorted(hbs)}"
    last: list[int | None] = []
    for seq, p in sorted(hbs.items()):
        if seq <= idle_beats:
            continue
        beat = json.loads(gpg_open_cli(inv.red_home, p, inv.black_fpr))
        check_heartbeat(beat, seq)
        last.append(beat["last_bundle_seq"])
    known = [x for x in last if x is not None]
    assert known == sorted(known) and set(known) <= set(range(1, top + 1))
    assert last[-1] == top
    print(
        f"first 2 heartbeats in {idle_window:.1f}s; {TOPIC_EX} bound {bound_after:.1f}s after "
        f"declare; {top} bundles; {len(hbs)} heartbeats; {time.monotonic() - t0:.1f}s total"
    )
    assert time.monotonic() - t0 < 150
