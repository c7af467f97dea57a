"""Benchmark, UDP receiver's own CPU per datagram: tag check, parse and placement, decoding.

    python benchmarks/udp_receiver.py [--files 8] [--loss 0 1 5] [--decode-workers 0 1]
                                      [--repeat 3] [--pin] [--out DIR]

Datagrams of ``--files`` 10 MB objects (MTU 1500, k = 128, the sender's defaults) are sealed
in memory and dropped at random by ``--loss`` percent, then fed, in this process, through
what the receive loop does for each one: ``DatagramCodec.open`` (tag check and parse) and
``Reassembler.add`` (placement, spool writes, RaptorQ for blocks that lost a source symbol,
or hand-off to decoder workers). No socket: this measures the loop's work, not the kernel's.

Baselines in the same run and on the same datagrams: the raw AES-GCM tag check
(``AESGCM.decrypt`` of each datagram, the least any authenticated receiver does) and
``open`` alone. CPU seconds are this process's (the loop's) and the live decoder workers'
apart (a run that lost a worker says so). "delivered" counts the rebuilt objects whose
SHA-256 matches.
``--pin`` puts this process and its workers on one CPU, so a worker's time is never overlap
hidden on another core and the loop's CPU is its own work only (on a 2-core VM whose cores
are hyperthreads, a busy sibling slows the loop down too, which makes unpinned runs noisy).

Writes ``<out>/udp_receiver-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.diode.udp_decode import DecoderPool  # noqa: E402
from bridge.diode.udp_fec import block_plan, encode_block, repair_count  # noqa: E402
from bridge.diode.udp_spool import Reassembler  # noqa: E402
from bridge.protocol.datagram import (  # noqa: E402
    TAG_LEN,
    DatagramCodec,
    ObjectHeader,
    ObjectKind,
    symbol_size_for,
)

K = 128
OVERHEAD = {0.0: 0.05, 1.0: 0.10, 5.0: 0.25}  # as benchmarks/udp.py's scenarios


def make_datagrams(codec: DatagramCodec, files: int, loss_pct: float, seed: int) -> list[bytes]:
    t = symbol_size_for(1500, "ch1")
    rnd = random.Random(seed)
    out = []
    packet = 0
    for f in range(files):
        data = rnd.randbytes(10 << 20)
        h = ObjectHeader(
            f + 1, ObjectKind.BUNDLE, "ch1", f, len(data), hashlib.sha256(data).digest(), t, K
        )
        sealer = codec.symbol_sealer(7, h)
        ovh = OVERHEAD.get(loss_pct, max(0.05, 3 * loss_pct / 100))
        for b in range(h.block_count):
            p = block_plan(h.length, t, K, b)
            chunk = data[p.offset : p.offset + p.length]
            for esi, sym in encode_block(chunk, t, repair_count(p.k, ovh, 4)):
                packet += 1
                if rnd.random() * 100 >= loss_pct:
                    out.append(sealer.seal(packet, b, esi, bytes(sym)))
    return out


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def run_once(codec: DatagramCodec, dgs: list[bytes], workers: int, files: int) -> dict[str, Any]:
    pool: DecoderPool[Any] | None = DecoderPool(workers) if workers else None
    try:
        start_cpu = cpu_of(pool.pids()) if pool else 0.0  # the workers' imports apart
        with tempfile.TemporaryDirectory(prefix="dbr-rx-bench-") as d:
            ra = Reassembler(Path(d), max_object_bytes=1 << 30, max_open_objects=64, decoder=pool)
            open_, add = codec.open, ra.add
            c0, t0 = time.process_time(), time.perf_counter()
            for i, dg in enumerate(dgs):
                add(open_(dg), 0.0)  # type: ignore[arg-type]
                if not i & 255 and ra.decoding():  # the loop takes results after each batch
                    ra.take_decoded()
            while ra.decoding():
                ra.take_decoded(0.05)
            ra.flush_all()
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            worker_cpu = cpu_of(pool.pids()) - start_cpu if pool else 0.0
            intact = sum(  # the rebuilt objects are the ones sent
                hashlib.sha256((d.path / "data").read_bytes()).digest() == d.header.digest
                for d in ra.ready
            )
            n = len(dgs)
            return {
                "decode_workers": workers,
                "loop_cpu_us": round(cpu / n * 1e6, 2),
                "worker_cpu_us": round(worker_cpu / n * 1e6, 2),
                "wall_us": round(wall / n * 1e6, 2),
                "delivered": intact,
                "workers_lost": pool.lost_workers if pool else 0,
                "files": files,
                "blocks_rebuilt": ra.rebuilt,
                "by_workers": ra.rebuilt_by_workers,
            }
    finally:
        if pool is not None:
            pool.close()


def baselines(codec: DatagramCodec, dgs: list[bytes]) -> dict[str, float]:
    aead = codec._aead  # noqa: SLF001 - the raw tag check, as open() calls it
    c0 = time.process_time()
    for dg in dgs:
        v = memoryview(dg)
        aead.decrypt(v[4:20], v[len(v) - TAG_LEN :], v[: len(v) - TAG_LEN])
    tag = time.process_time() - c0
    c0 = time.process_time()
    for dg in dgs:
        codec.open(dg)
    opened = time.process_time() - c0
    return {"tag_us": round(tag / len(dgs) * 1e6, 2), "open_us": round(opened / len(dgs) * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8, help="10 MB objects per run")
    ap.add_argument("--loss", type=float, nargs="+", default=[0.0, 1.0, 5.0], help="percent")
    ap.add_argument("--decode-workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--repeat", type=int, default=3, help="runs per value, alternating")
    ap.add_argument("--pin", action="store_true", help="this process and its workers on CPU 0")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args()
    if a.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # workers inherit it
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    codec = DatagramCodec(os.urandom(32))
    res: dict[str, Any] = {"started": stamp, "args": {k: str(v) for k, v in vars(a).items()},
                           "by_loss": []}  # fmt: skip
    for loss in a.loss:
        dgs = make_datagrams(codec, a.files, loss, seed=1)
        entry: dict[str, Any] = {"loss_pct": loss, "datagrams": len(dgs), **baselines(codec, dgs)}
        entry["runs"] = [
            run_once(codec, dgs, w, a.files) for _ in range(a.repeat) for w in a.decode_workers
        ]
        res["by_loss"].append(entry)
        print(json.dumps(entry), flush=True)
    out = a.out / f"udp_receiver-{stamp}.json"
    out.write_text(json.dumps(res, indent=2))
    print()
    head = (
        f"{'loss %':>6} {'tag µs':>7} {'open µs':>8} {'dec w':>5} {'loop µs (median)':>17} "
        f"{'x tag':>6} {'worker µs':>10} {'delivered':>9}"
    )
    print(head)
    print("-" * len(head))
    for e in res["by_loss"]:
        for w in a.decode_workers:
            runs = [r for r in e["runs"] if r["decode_workers"] == w]
            loop = statistics.median(r["loop_cpu_us"] for r in runs)
            worker = statistics.median(r["worker_cpu_us"] for r in runs)
            ok = min(r["delivered"] for r in runs)
            print(
                f"{e['loss_pct']:>6} {e['tag_us']:>7} {e['open_us']:>8} {w:>5} {loop:>17} "
                f"{loop / e['tag_us']:>6.1f} {worker:>10} {ok:>5}/{a.files:<3}"
            )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
