"""Benchmark, black: the pipeline against baselines measured in the same run (DESIGN.md section 7).

    python benchmarks/black.py [--small N] [--large N] [--backlog N] [--out DIR]

* 1 KB messages: raw pika stream-consume rate of the same broker (baseline) vs black's
  drained-sealed-and-in-the-outbox rate. Target >= 0.8x.
* 1 MB messages: raw ``gpg`` sign+encrypt MB/s of the same keys and options (baseline) vs
  the pipeline's body MB/s. Target >= 0.75x.
* Backlog: drain a large backlog of 1 KB messages while sampling the resident memory of the
  whole process tree (driver, JVM, Python workers); flat means the last half's peak stays
  within 1.25x of the first half's.

Writes ``<out>/black-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pika
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.black.job import BlackRun  # noqa: E402
from bridge.black.management import ManagementClient  # noqa: E402
from bridge.black.streams import stream_bounds  # noqa: E402
from bridge.config import load_config  # noqa: E402
from bridge.crypto.keys import init_keys  # noqa: E402
from bridge.logs import setup_logging  # noqa: E402
from bridge.spark import get_spark  # noqa: E402

MGMT = "http://127.0.0.1:15672"
AUTH = ("guest", "guest")


def make_vhost() -> tuple[str, str]:
    name = f"diode-bench-{uuid.uuid4().hex[:8]}"
    ManagementClient(MGMT, *AUTH, timeout=30).put_vhost(name)
    return name, f"amqp://guest:guest@127.0.0.1:5672/{urllib.parse.quote(name, safe='')}"


def drop_vhost(name: str) -> None:
    ManagementClient(MGMT, *AUTH, timeout=60).delete_vhost(name)


def write_config(work: Path, url: str, inv: Any, channel: str, **black: Any) -> Path:
    extra = "\n".join(f"{k} = {json.dumps(v)}" for k, v in black.items())
    p = work / f"{channel}.toml"
    p.write_text(f"""
[link]
bridge_id = "bench"
black_signers = ["{inv.black_fpr}"]
[[channels]]
name = "{channel}"
exchanges = ["bench.{channel}"]
recipients = {json.dumps(list(inv.red_fprs.values()))}
[black]
amqp_url = "{url}"
gnupg_home = "{inv.black_home}"
signing_key = "{inv.black_fpr}"
outbox = "{channel}/outbox"
archive = "{channel}/archive"
state_dir = "{channel}/state"
checkpoint_dir = "{channel}/checkpoint"
heartbeat_seconds = 30.0
{extra}
[black.bundle]
max_bytes = 268435456
max_rows = 500000
""")
    return p


def declare(url: str, exchange: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().exchange_declare(exchange, "fanout", durable=True)
    conn.close()


def publish_after_mirror(url: str, exchange: str, n: int, size: int, cfg_path: Path) -> float:
    """Publish n messages of `size` bytes, then wait until the stream holds them; seconds."""
    t0 = time.monotonic()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    props = pika.BasicProperties(
        content_type="application/octet-stream", delivery_mode=2, headers={"sensor": "s01", "n": 1}
    )
    # incompressible bodies: the worst case for Parquet, zstd and gpg
    pool = [os.urandom(size) for _ in range(64)] if size > 65536 else None
    for i in range(n):
        body = pool[i % 64] if pool else os.urandom(size)
        ch.basic_publish(exchange, "", body, props, mandatory=False)
    conn.close()
    cfg = load_config(cfg_path)
    channel = cfg.channels[0].name
    while stream_bounds(cfg, channel)[1] < n:
        time.sleep(0.5)
    return time.monotonic() - t0


def raw_stream_consume(url: str, queue: str, n: int, prefetch: int = 2000) -> float:
    """Baseline: a plain pika consumer reading n messages of a stream from the first offset."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got = [0]
    last = [None]

    def on(c: Any, m: Any, p: Any, b: bytes) -> None:
        got[0] += 1
        last[0] = m.delivery_tag
        if got[0] % (prefetch // 2) == 0:
            c.basic_ack(m.delivery_tag, multiple=True)

    t0 = time.monotonic()
    ch.basic_consume(queue, on, arguments={"x-stream-offset": "first"})
    while got[0] < n:
        conn.process_data_events(time_limit=0.5)
    dt_ = time.monotonic() - t0
    conn.close()
    return dt_


def raw_gpg(inv: Any, mb: int, work: Path) -> float:
    """Baseline: gpg sign+encrypt of an mb-MB file with the pipeline's options; MB/s."""
    src = work / "raw.bin"
    with open(src, "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1024 * 1024))
    cmd = [
        "gpg",
        "--homedir",
        str(inv.black_home),
        "--batch",
        "--yes",
        "--trust-model",
        "always",
        "-z",
        "0",
        "--throw-keyids",
        "--local-user",
        inv.black_fpr,
        "--sign",
        "--encrypt",
    ]
    for r in inv.red_fprs.values():
        cmd += ["-r", r]
    cmd += ["--output", str(work / "raw.gpg"), str(src)]
    best = 0.0
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, capture_output=True)
        best = max(best, mb / (time.monotonic() - t0))
    src.unlink()
    (work / "raw.gpg").unlink()
    return best


class RssSampler(threading.Thread):
    """Samples the RSS of this process and all its children (JVM, Python workers)."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._halt.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.samples.append((time.monotonic(), total))
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def pipeline(spark: Any, cfg_path: Path, sampler: RssSampler | None = None) -> tuple[float, Any]:
    cfg = load_config(cfg_path)
    run = BlackRun(cfg)
    if sampler:
        sampler.start()
    t0 = time.monotonic()
    summary = run.run(spark, "available-now")
    secs = time.monotonic() - t0
    if sampler:
        sampler.stop()
    return secs, summary


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--small", type=int, default=200_000, help="1 KB messages for the rate test")
    ap.add_argument("--large", type=int, default=300, help="1 MB messages for the gpg test")
    ap.add_argument(
        "--backlog", type=int, default=0, help="1 KB backlog for the memory test (e.g. 1000000)"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    setup_logging("WARNING")
    work = Path(tempfile.mkdtemp(prefix="db", dir="/tmp"))
    vhost, url = make_vhost()
    res: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
    }
    spark = None
    try:
        inv = init_keys(work / "keys", red_names=("red", "audit"))
        spark = get_spark("diode-bench")
        spark.range(10).count()  # warm the JVM

        # -- 1 KB -----------------------------------------------------------------------
        cfg = write_config(work, url, inv, "small", max_messages_per_batch=200_000)
        declare(url, "bench.small")
        BlackRun(load_config(cfg)).mirror.sync()
        pub = publish_after_mirror(url, "bench.small", a.small, 1024, cfg)
        base_s = raw_stream_consume(url, "diode.mirror.small", a.small)
        secs, summ = pipeline(spark, cfg)
        assert summ.messages == a.small, summ
        res["small"] = {
            "messages": a.small,
            "publish_msg_s": a.small / pub,
            "raw_consume_msg_s": a.small / base_s,
            "pipeline_msg_s": a.small / summ.drain_seconds,
            "ratio": base_s / summ.drain_seconds,
            "target": 0.8,
            "run_msg_s_with_startup": a.small / secs,
            "ratio_with_startup": base_s / secs,
            "bundles": summ.bundles,
            "batches": summ.batches,
        }

        # -- 1 MB -----------------------------------------------------------------------
        cfg = write_config(work, url, inv, "large", max_messages_per_batch=200)
        declare(url, "bench.large")
        BlackRun(load_config(cfg)).mirror.sync()
        publish_after_mirror(url, "bench.large", a.large, 1024 * 1024, cfg)
        gpg_mb_s = raw_gpg(inv, 100, work)
        secs, summ = pipeline(spark, cfg)
        assert summ.messages == a.large, summ
        res["large"] = {
            "messages": a.large,
            "raw_gpg_mb_s": gpg_mb_s,
            "pipeline_mb_s": a.large / summ.drain_seconds,
            "ratio": (a.large / summ.drain_seconds) / gpg_mb_s,
            "target": 0.75,
            "run_mb_s_with_startup": a.large / secs,
            "ratio_with_startup": (a.large / secs) / gpg_mb_s,
            "bundles": summ.bundles,
        }

        # -- backlog memory -----------------------------------------------------------------
        if a.backlog:
            cfg = write_config(work, url, inv, "backlog")
            declare(url, "bench.backlog")
            BlackRun(load_config(cfg)).mirror.sync()
            publish_after_mirror(url, "bench.backlog", a.backlog, 1024, cfg)
            sampler = RssSampler()
            secs, summ = pipeline(spark, cfg, sampler)
            assert summ.messages == a.backlog, summ
            s = sampler.samples
            half = len(s) // 2
            first = max(r for _, r in s[:half]) if half else 0
            last = max(r for _, r in s[half:]) if s else 0
            res["backlog"] = {
                "messages": a.backlog,
                "pipeline_msg_s": a.backlog / summ.drain_seconds,
                "rss_peak_first_half_mb": first / 2**20,
                "rss_peak_second_half_mb": last / 2**20,
                "flat": last <= 1.25 * first,
                "samples": len(s),
            }
    finally:
        if spark is not None:
            spark.stop()
        drop_vhost(vhost)
        shutil.rmtree(work, ignore_errors=True)

    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"black-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(res, indent=2))
    print(
        "\npipeline = sustained drain (first batch read -> last bundle in the outbox);"
        " +startup = whole run incl. Spark query start and broker probes"
    )
    print(
        f"{'test':<8} {'baseline':>18} {'pipeline':>18} {'ratio':>6} {'target':>6} {'+startup':>9}"
    )
    if "small" in res:
        r = res["small"]
        print(
            f"{'1 KB':<8} {r['raw_consume_msg_s']:>12,.0f} msg/s "
            f"{r['pipeline_msg_s']:>12,.0f} msg/s "
            f"{r['ratio']:>6.2f} {r['target']:>6} {r['ratio_with_startup']:>9.2f}"
        )
    if "large" in res:
        r = res["large"]
        print(
            f"{'1 MB':<8} {r['raw_gpg_mb_s']:>13,.1f} MB/s {r['pipeline_mb_s']:>13,.1f} MB/s "
            f"{r['ratio']:>6.2f} {r['target']:>6} {r['ratio_with_startup']:>9.2f}"
        )
    if "backlog" in res:
        r = res["backlog"]
        print(
            f"{'backlog':<8} {r['messages']:>13,} msgs {r['pipeline_msg_s']:>12,.0f} msg/s "
            f"  RSS peak {r['rss_peak_first_half_mb']:.0f} MB (1st half) -> "
            f"{r['rss_peak_second_half_mb']:.0f} MB "
            f"(2nd half), flat={r['flat']}"
        )
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
