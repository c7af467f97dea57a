"""Benchmark, red replay: the replay publisher against raw asynchronous confirmed publishing.

N landed 1 KB messages (one exchange, one channel, in ``messages`` as a red landing writes
them) are replayed into a throw-away vhost by ``Replayer(cfg).run(until_caught_up=True)`` with
its default confirm window. Baselines, measured in the same run on the same broker with the same
bodies, window and properties, each twice (before and after the replay, best kept):

* ``pika``: pika's ``SelectConnection`` publishing with publisher confirms, at most ``window``
  unconfirmed (the issue's baseline: a raw pika async-confirmed publish loop);
* ``bridge.amqp``: the bridge's own AMQP client in a bare publish-and-confirm loop (what the
  replay is built on; the replay's own cost is the difference).

Every exchange feeds a queue with ``x-max-length`` 1000 so the broker's memory stays flat.
Target (DESIGN.md section 7): replay >= 0.8x the raw pika loop. Writes
``<out>/replay-<utc time>.json`` and prints a table. ``benchmarks/red.py --replay N`` runs it
too, after the landing scenarios.

    .venv/bin/python benchmarks/replay.py                 # 50k x 1 KB, window 1000
    .venv/bin/python benchmarks/replay.py --messages 200000
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pika

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amqp_client import drop_vhost, make_vhost  # noqa: E402 - benchmarks/ is this script's dir

from bridge.amqp.client import Connection  # noqa: E402
from bridge.logs import setup_logging  # noqa: E402
from bridge.protocol.exchange import ExchangeDecl  # noqa: E402
from bridge.red.replay import Replayer  # noqa: E402
from bridge.red.tables import RedTables  # noqa: E402
from bridge.signals import exit_now  # noqa: E402
from tests.integration.test_red_replay import PLAIN, land, make_cfg, rows  # noqa: E402

TARGET = 0.8
PER_LANDING = 10_000


def pika_rate(url: str, exchange: str, n: int, body: bytes, window: int) -> float:
    """msg/s of pika's SelectConnection publishing ``n`` messages with confirms, at most
    ``window`` unconfirmed."""
    props = pika.BasicProperties(delivery_mode=1)
    st: dict[str, Any] = {"sent": 0, "acked": 0, "t0": 0.0, "t1": 0.0, "error": None}

    def pump(ch: Any) -> None:
        while st["sent"] < n and st["sent"] - st["acked"] < window:
            ch.basic_publish(exchange, "rk", body, props)
            st["sent"] += 1

    def on_confirm(frame: Any) -> None:
        m = frame.method
        if isinstance(m, pika.spec.Basic.Nack):
            st["error"] = f"nack {m.delivery_tag}"
        st["acked"] = max(st["acked"], m.delivery_tag)  # multiple or in order: a high mark
        if st["acked"] >= n:
            st["t1"] = time.perf_counter()
            conn.close()
        else:
            pump(st["ch"])

    def on_channel(ch: Any) -> None:
        st["ch"] = ch

        def go(_frame: Any) -> None:
            st["t0"] = time.perf_counter()
            pump(ch)

        ch.confirm_delivery(on_confirm, callback=go)

    def on_error(_conn: Any, err: Any) -> None:
        st["error"] = repr(err)
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        pika.URLParameters(url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=on_error,
        on_close_callback=lambda *_: conn.ioloop.stop(),
    )
    conn.ioloop.start()
    if st["error"] or not st["t1"]:
        raise RuntimeError(f"pika baseline failed: {st['error']} ({st['acked']} of {n} acked)")
    return n / (st["t1"] - st["t0"])


def bridge_rate(url: str, exchange: str, n: int, body: bytes, window: int) -> float:
    """msg/s of bridge.amqp publishing ``n`` messages with confirms, ``window`` in flight."""
    with Connection.open(url) as conn:
        pub = conn.channel()
        pub.confirm_select()
        t0 = time.perf_counter()
        sent = acked = 0
        while acked < n:
            while sent < n and sent - acked < window:
                sent = pub.publish(exchange, "rk", PLAIN, body)
            for cf in conn.poll(0.0 if sent < n else 0.5).confirms:
                if not cf.ack:
                    raise RuntimeError(f"bridge.amqp baseline: nack {cf.delivery_tag}")
                acked = max(acked, cf.delivery_tag)
        return n / (time.perf_counter() - t0)


def measure_replay(n: int, size: int, window: int, work: Path) -> dict[str, Any]:
    """Land ``n`` messages of ``size`` bytes, then measure the baselines and the replay."""
    n = max(PER_LANDING, n - n % PER_LANDING)
    vhost, url = make_vhost()
    try:
        tables = RedTables(work / "tables", "delta-rs")
        tables.ensure()
        x = ExchangeDecl("perf", "fanout", False)
        for ls in range(1, n // PER_LANDING + 1):
            seqs = range(ls * PER_LANDING, (ls + 1) * PER_LANDING)
            land(tables, ls, rows("c1", seqs, x, body_size=size))
        with Connection.open(url) as admin:
            ch = admin.channel()
            for name in ("perf", "raw"):
                ch.exchange_declare(name, "fanout")
                ch.queue_declare(f"q.{name}", arguments={"x-max-length": 1000})  # flat broker
                ch.queue_bind(f"q.{name}", name, "")
        body = b"c1:0." + b"." * size
        pika1, bridge1 = (
            pika_rate(url, "raw", n, body, window),
            bridge_rate(url, "raw", n, body, window),
        )
        cfg = make_cfg(work, url, ["perf"], in_flight=window)
        s = Replayer(cfg).run(until_caught_up=True, timeout=600)
        if s.confirmed != n or s.errors:
            raise RuntimeError(f"replay confirmed {s.confirmed} of {n}: {s.errors[:3]}")
        pika2, bridge2 = (
            pika_rate(url, "raw", n, body, window),
            bridge_rate(url, "raw", n, body, window),
        )
    finally:
        drop_vhost(vhost)
    pika_best, bridge_best = max(pika1, pika2), max(bridge1, bridge2)
    return {
        "messages": n,
        "body_bytes": size,
        "window": window,
        "replay_msg_s": round(s.rate),
        "replay_seconds": round(s.seconds, 3),
        "pika_msg_s": [round(pika1), round(pika2)],
        "bridge_amqp_msg_s": [round(bridge1), round(bridge2)],
        "ratio_vs_pika": round(s.rate / pika_best, 3),
        "ratio_vs_bridge_amqp": round(s.rate / bridge_best, 3),
        "target_vs_pika": TARGET,
        "met": s.rate / pika_best >= TARGET,
    }


def print_replay(r: dict[str, Any]) -> None:
    print(f"\nreplay of {r['messages']:,} x {r['body_bytes']} B, window {r['window']}")
    print(f"{'':24}{'msg/s':>10}{'ratio':>8}")
    print(f"{'replay publisher':24}{r['replay_msg_s']:>10,}")
    print(f"{'raw pika (best of 2)':24}{max(r['pika_msg_s']):>10,}{r['ratio_vs_pika']:>8.2f}x")
    print(f"{'raw bridge.amqp (best)':24}{max(r['bridge_amqp_msg_s']):>10,}"
          f"{r['ratio_vs_bridge_amqp']:>8.2f}x")  # fmt: skip
    verdict = "met" if r["met"] else "NOT met"
    print(f"target: replay >= {r['target_vs_pika']}x raw pika: {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--messages", type=int, default=50_000, help="rounded to 10,000s")
    ap.add_argument("--body-bytes", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1000, help="unconfirmed messages in flight")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    setup_logging(os.environ.get("DIODE_LOG_LEVEL", "WARNING"))
    with tempfile.TemporaryDirectory(prefix="dbr-replay-") as d:
        r = measure_replay(a.messages, a.body_bytes, a.window, Path(d))
    r |= {"when": dt.datetime.now(dt.UTC).isoformat(), "load_avg": os.getloadavg()}
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"replay-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(r, indent=2))
    print_replay(r)
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    exit_now(main())
