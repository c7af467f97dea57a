"""Benchmark, black: the spool's write rate against a raw fsynced append loop, same disk, same run.

    python benchmarks/spool.py [--small N] [--large N] [--dir DIR] [--out DIR]

For 1 KB and 1 MB records, groups of 500 (one fsync per group) in both:

* raw: open a file, ``write`` each record, ``flush`` + ``fsync`` every 500 — the floor of any
  durable append;
* spool: ``SpoolWriter.append_one`` one delivery at a time (as the tap receives them) and
  ``sync`` every 500 (Arrow batch, fsync, TAIL);
* spool, bulk: the same with one ``append`` of 500 records per group.

Each is run ``--rounds`` times in rotating order after an ``os.sync()`` (so one run's dirty
pages do not slow the next one's fsync); the median wall time counts. CPU seconds of this
process are recorded too: the rest of the wall time is the disk.

Writes ``<out>/spool-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.black.spool import SpoolReader, SpoolWriter  # noqa: E402

GROUP = 500
PROPS = b"\x90\x00\x10application/json\x02"  # content-type + delivery-mode, as a broker sends


def _raw(path: Path, bodies: list[bytes]) -> None:
    with open(path, "wb") as f:
        for i, b in enumerate(bodies, 1):
            f.write(b)
            if i % GROUP == 0 or i == len(bodies):
                f.flush()
                os.fsync(f.fileno())


def _spool(root: Path, bodies: list[bytes], *, bulk: bool) -> None:
    with SpoolWriter.open(root, "bench", min_free_bytes=0) as w:
        if bulk:
            for lo in range(0, len(bodies), GROUP):
                g = bodies[lo : lo + GROUP]
                n = len(g)
                w.append(["bench.x"] * n, ["rk"] * n, [False] * n, [PROPS] * n, g)
                w.sync(w.durable_end - 1)
        else:
            for i, b in enumerate(bodies, 1):
                w.append_one("bench.x", "rk", False, PROPS, b)
                if i % GROUP == 0 or i == len(bodies):
                    w.sync(w.durable_end - 1)
        assert w.durable_end == len(bodies)


def _read(root: Path, n: int) -> None:
    assert sum(b.num_rows for b in SpoolReader(root, "bench").read(0, n)) == n


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    os.sync()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def measure_spool_rate(directory: Path, n: int, size: int, rounds: int = 3) -> dict[str, Any]:
    """Write ``n`` records of ``size`` bytes raw and through the spool under ``directory``."""
    body = os.urandom(size)
    bodies = [body] * n  # one object: memory stays flat, every write still copies it
    work = Path(tempfile.mkdtemp(prefix="spoolbench", dir=directory))
    runs: dict[str, Callable[[Path], None]] = {
        "raw": lambda d: _raw(d / "raw.bin", bodies),
        "spool": lambda d: _spool(d, bodies, bulk=False),
        "spool_bulk": lambda d: _spool(d, bodies, bulk=True),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    read: list[tuple[float, float]] = []
    try:
        for r in range(rounds):
            names = list(runs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                d = work / f"{name}-{r}"
                d.mkdir()
                times[name].append(_timed(lambda: runs[name](d)))  # noqa: B023
                if name == "spool":
                    read.append(_timed(lambda: _read(d, n)))  # noqa: B023
                shutil.rmtree(d)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = n * size / 2**20
    res: dict[str, Any] = {"records": n, "record_bytes": size, "group": GROUP, "rounds": rounds}
    for name, ts in times.items():
        wall, cpu = sorted(ts)[len(ts) // 2]
        res[f"{name}_msg_s"] = n / wall
        res[f"{name}_mb_s"] = mb / wall
        res[f"{name}_cpu_share"] = cpu / wall
        res[f"{name}_walls_s"] = [round(t, 4) for t, _ in ts]
    res["ratio"] = res["spool_msg_s"] / res["raw_msg_s"]
    res["ratio_bulk"] = res["spool_bulk_msg_s"] / res["raw_msg_s"]
    res["read_msg_s"] = n / sorted(read)[len(read) // 2][0]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--small", type=int, default=200_000, help="1 KB records")
    ap.add_argument("--large", type=int, default=1_000, help="1 MB records")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, median counts")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk to test")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    res: dict[str, Any] = {
        "when": dt.datetime.now(dt.UTC).isoformat(),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "dir": str(a.dir),
        "small": measure_spool_rate(a.dir, a.small, 1024, a.rounds),
        "large": measure_spool_rate(a.dir, a.large, 1024 * 1024, a.rounds),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"spool-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"groups of {GROUP} records, one fsync per group, in {a.dir}; median of {a.rounds}")
    print(
        f"{'test':<6} {'raw fsynced append':>24} {'spool, per record':>24} {'ratio':>6} "
        f"{'spool, bulk append':>24} {'ratio':>6}  {'spool CPU':>9} {'read (mmap)':>15}"
    )
    for name, key in (("1 KB", "small"), ("1 MB", "large")):
        r = res[key]
        print(
            f"{name:<6} {r['raw_msg_s']:>9,.0f} msg/s {r['raw_mb_s']:>6,.0f} MB/s "
            f"{r['spool_msg_s']:>9,.0f} msg/s {r['spool_mb_s']:>6,.0f} MB/s {r['ratio']:>6.2f} "
            f"{r['spool_bulk_msg_s']:>9,.0f} msg/s {r['spool_bulk_mb_s']:>6,.0f} MB/s "
            f"{r['ratio_bulk']:>6.2f}  {r['spool_cpu_share']:>8.0%} "
            f"{r['read_msg_s']:>9,.0f} msg/s"
        )
    print("spool CPU = this process's CPU time / wall time of the per-record spool run")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
