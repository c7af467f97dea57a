"""Benchmark, both sides: bridge.amqp's consume loop against a raw pika loop, same broker, same run.

    python benchmarks/amqp_client.py [--messages N] [--size BYTES] [--rounds R] [--out DIR]

Each round publishes N persistent messages (default 200k of 1 KB) into a durable classic queue
and drains them with (a) pika ``basic_consume``, prefetch 1000, ``basic_ack(multiple=True)``
every 500 deliveries, then publishes N again and drains them with (b) ``bridge.amqp`` the same
way (every other round in the opposite order). Rates are wall-clock from the consumer's
start to the last delivery; the consumer's own CPU time per message says how much of a core
the client spends (the rest is the broker).
The publishing rate of ``bridge.amqp`` (confirms, 1000 in flight) is reported as well.

Writes ``<out>/amqp_client-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pika
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.amqp.client import Connection  # noqa: E402
from bridge.black.management import ManagementClient  # noqa: E402
from bridge.errors import ManagementApiError  # noqa: E402

MGMT = "http://127.0.0.1:15672"
AUTH = ("guest", "guest")
QUEUE = "bench.classic"
PREFETCH = 1000
ACK_EVERY = 500
CONFIRM_WINDOW = 1000
# content_type "application/octet-stream", delivery_mode 2 (persistent), as a content header
PROPS = b"\x90\x00" + bytes([24]) + b"application/octet-stream" + b"\x02"


def broker_process() -> psutil.Process | None:
    """The local RabbitMQ VM (beam.smp), to charge its CPU time per message; None if remote."""
    for p in psutil.process_iter(["name"]):
        if "beam" in (p.info["name"] or ""):
            return p
    return None


def cpu_seconds(p: psutil.Process | None) -> float:
    if p is None:
        return float("nan")
    t = p.cpu_times()
    return float(t.user + t.system)


def make_vhost() -> tuple[str, str]:
    """A throw-away vhost: the management API, or ``rabbitmqctl`` when the API is off."""
    name = f"diode-bench-{uuid.uuid4().hex[:8]}"
    try:
        ManagementClient(MGMT, *AUTH, timeout=30).put_vhost(name)
    except ManagementApiError:
        subprocess.run(["rabbitmqctl", "add_vhost", name], check=True, capture_output=True)
        subprocess.run(
            ["rabbitmqctl", "set_permissions", "-p", name, AUTH[0], ".*", ".*", ".*"],
            check=True, capture_output=True,
        )  # fmt: skip
    return name, f"amqp://guest:guest@127.0.0.1:5672/{urllib.parse.quote(name, safe='')}"


def drop_vhost(name: str) -> None:
    try:
        ManagementClient(MGMT, *AUTH, timeout=60).delete_vhost(name)
    except ManagementApiError:
        subprocess.run(["rabbitmqctl", "delete_vhost", name], check=False, capture_output=True)


def publish(url: str, n: int, size: int) -> float:
    """n persistent messages with bridge.amqp, confirms on, CONFIRM_WINDOW in flight; msg/s."""
    conn = Connection.open(url)
    ch = conn.channel()
    ch.queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "classic"})
    ch.confirm_select()
    pool = [os.urandom(size) for _ in range(256)]
    confirmed = 0
    t0 = time.monotonic()
    for i in range(1, n + 1):
        ch.publish("", QUEUE, PROPS, pool[i & 255])
        while i - confirmed >= CONFIRM_WINDOW or (i == n and confirmed < n):
            for c in conn.poll(1.0).confirms:
                if not c.ack:
                    raise RuntimeError(f"broker nacked publish {c.delivery_tag}")
                confirmed = max(confirmed, c.delivery_tag)
    secs = time.monotonic() - t0
    depth = ch.queue_depth(QUEUE)
    conn.close()
    if depth != n:
        raise RuntimeError(f"queue holds {depth} messages after publishing {n}")
    return n / secs


def drain_pika(url: str, n: int) -> dict[str, float]:
    """Baseline: pika BlockingConnection basic_consume, prefetch 1000, ack multiple every 500."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=PREFETCH)
    got = [0]

    def on(c: Any, m: Any, _p: Any, _b: bytes) -> None:
        got[0] += 1
        if got[0] % ACK_EVERY == 0 or got[0] == n:
            c.basic_ack(m.delivery_tag, multiple=True)

    c0, t0 = time.process_time(), time.monotonic()
    ch.basic_consume(QUEUE, on)
    while got[0] < n:
        conn.process_data_events(time_limit=0.5)
    secs, cpu = time.monotonic() - t0, time.process_time() - c0
    conn.close()
    return {"msg_s": n / secs, "seconds": secs, "cpu_us_per_msg": cpu / n * 1e6}


def drain_bridge(url: str, n: int) -> dict[str, float]:
    """bridge.amqp: the same loop (prefetch 1000, ack multiple every 500), then a sync."""
    conn = Connection.open(url)
    ch = conn.channel()
    ch.basic_qos(PREFETCH)
    got = 0
    size = 0
    c0, t0 = time.process_time(), time.monotonic()
    ch.basic_consume(QUEUE)
    while got < n:
        for d in conn.poll(0.5).deliveries:
            got += 1
            size += len(d.body)
            if got % ACK_EVERY == 0 or got == n:
                ch.ack(d.delivery_tag, multiple=True)
    secs, cpu = time.monotonic() - t0, time.process_time() - c0
    token = ch.request_sync()
    while token not in conn.poll(1.0).syncs:
        pass
    depth = ch.queue_depth(QUEUE)
    conn.close()
    if depth:
        raise RuntimeError(f"{depth} messages left in the queue after draining {n}")
    return {"msg_s": n / secs, "seconds": secs, "cpu_us_per_msg": cpu / n * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--messages", type=int, default=200_000, help="messages per drain")
    ap.add_argument("--size", type=int, default=1024, help="body bytes")
    ap.add_argument("--rounds", type=int, default=1, help="pika/bridge pairs; medians reported")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    vhost, url = make_vhost()
    beam = broker_process()
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(a.rounds):
            res_r: dict[str, Any] = {}
            order = ("pika", "bridge") if r % 2 == 0 else ("bridge", "pika")  # no order bias
            for side in order:
                pub = publish(url, a.messages, a.size)
                res_r.setdefault("publish_msg_s", pub)
                drain = drain_pika if side == "pika" else drain_bridge
                b0 = cpu_seconds(beam)
                res_r[side] = drain(url, a.messages)
                res_r[side]["broker_cpu_us_per_msg"] = (cpu_seconds(beam) - b0) / a.messages * 1e6
            rounds.append(res_r)
            base, ours = res_r["pika"], res_r["bridge"]
            print(
                f"round {r + 1}: pika {base['msg_s']:,.0f} msg/s, bridge.amqp "
                f"{ours['msg_s']:,.0f} msg/s ({ours['msg_s'] / base['msg_s']:.2f}x)",
                flush=True,
            )
    finally:
        drop_vhost(vhost)

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    res = {
        "when": dt.datetime.now(dt.UTC).isoformat(),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "messages": a.messages,
        "size": a.size,
        "prefetch": PREFETCH,
        "ack_every": ACK_EVERY,
        "queue": "classic, durable, persistent messages",
        "rounds": rounds,
        "publish_msg_s": statistics.median(r["publish_msg_s"] for r in rounds),
        "pika_msg_s": med("pika", "msg_s"),
        "bridge_msg_s": med("bridge", "msg_s"),
        "ratio": statistics.median(r["bridge"]["msg_s"] / r["pika"]["msg_s"] for r in rounds),
        "target": 1.0,
        "pika_cpu_us_per_msg": med("pika", "cpu_us_per_msg"),
        "bridge_cpu_us_per_msg": med("bridge", "cpu_us_per_msg"),
        "broker_cpu_us_per_msg_pika": med("pika", "broker_cpu_us_per_msg"),
        "broker_cpu_us_per_msg_bridge": med("bridge", "broker_cpu_us_per_msg"),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"amqp_client-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"\n{a.messages:,} x {a.size} B persistent, classic queue, prefetch {PREFETCH}, "
          f"ack multiple every {ACK_EVERY}; medians of {a.rounds} round(s)")  # fmt: skip
    print(f"{'consumer':<12} {'msg/s':>10} {'client CPU us/msg':>18} {'broker CPU us/msg':>18}")
    for side, label in (("pika", "pika"), ("bridge", "bridge.amqp")):
        print(
            f"{label:<12} {res[side + '_msg_s']:>10,.0f} {res[side + '_cpu_us_per_msg']:>18.1f} "
            f"{res['broker_cpu_us_per_msg_' + side]:>18.1f}"
        )
    print(f"ratio bridge.amqp / pika (median of rounds): {res['ratio']:.2f}x   "
          f"(bridge.amqp publish with confirms: {res['publish_msg_s']:,.0f} msg/s)")  # fmt: skip
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
