"""Benchmark, diode (UDP): RaptorQ vs zfec for one FEC block, and the cost of bridge's wrapper.

    python benchmarks/fec.py [--seconds S] [--trials N] [--mallopt] [--out DIR]

For symbol sizes T = 1360 (MTU 1500) and 8800 (jumbo), K in {32, 64, 128, 200} source symbols
and repair overhead 5 % / 25 % (r = ceil(K * overhead) repair symbols), in one process:

* encode MB/s: source bytes per second, producing every source and repair symbol;
* decode MB/s, no loss: the codec's decoder given the K source symbols (bridge itself skips
  the decoder then: its fast path is a concatenation);
* decode MB/s, 5 % lost: ceil(K / 20) source symbols lost, repair symbols in their place
  (RaptorQ is fed repair symbols until it decodes; zfec gets exactly K).

``raptorq`` and ``zfec`` are the bare bindings; ``bridge`` is ``bridge.diode.udp_fec``
(``encode_block`` / ``BlockDecoder``, RaptorQ plus Python bookkeeping) — what the sender and
receiver pay. zfec cannot do K + r > 256 and has no fresh repair symbols for a repeated send.

Then RaptorQ's decode failure rate when exactly K, K + 1, K + 2 distinct symbols (a random mix
of source and repair) are all a block gets, over ``--trials`` blocks each (T = 16: the rate does
not depend on T).

``--mallopt`` first raises glibc's mmap and trim thresholds (64 MB / 256 MB): with the
defaults, blocks of ~1 MB (T = 8800, K >= 64) are mapped and unmapped on every encode and
decode and run 2-3x slower (page faults), as they would in the sender and receiver.

Writes ``<out>/fec-<utc time>.json`` and prints tables. Not part of CI.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import raptorq

try:
    import zfec
except ImportError:  # the comparison needs it; the bridge itself does not
    sys.exit("benchmarks/fec.py compares against zfec: .venv/bin/pip install zfec")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.diode.udp_fec import BlockDecoder, block_plan, encode_block  # noqa: E402

SYMBOL_SIZES = (1360, 8800)
BLOCK_SYMBOLS = (32, 64, 128, 200)
OVERHEADS = (0.05, 0.25)
LOSS = 0.05


def _rate(nbytes: int, fn: Callable[[], object], seconds: float) -> float:
    """MB/s of ``fn`` over ``nbytes``: best of repeated runs filling about ``seconds``."""
    fn()  # warm up
    best = math.inf
    spent = 0.0
    runs = 0
    while spent < seconds or runs < 3:
        t0 = time.perf_counter()
        fn()
        dt_ = time.perf_counter() - t0
        best = min(best, dt_)
        spent += dt_
        runs += 1
    return nbytes / best / 1e6


def _pkt(esi: int, sym: bytes) -> bytes:
    return b"\x00" + esi.to_bytes(3, "big") + sym


def _lost(k: int) -> int:
    return math.ceil(k * LOSS)


def _raptorq(data: bytes, t: int, k: int, r: int, rnd: random.Random, s: float) -> dict[str, Any]:
    enc = lambda: raptorq.Encoder.with_defaults(data, t).get_encoded_packets(r)  # noqa: E731
    packets = enc()
    src, rep = packets[:k], packets[k:]

    def decode(pkts: list[bytes]) -> bytes | None:
        d = raptorq.Decoder.with_defaults(k * t, t)
        for p in pkts:
            got = d.decode(p)
            if got is not None:
                return bytes(got)
        return None

    drop = set(rnd.sample(range(k), _lost(k)))
    lossy = [p for i, p in enumerate(src) if i not in drop] + rep
    row: dict[str, Any] = {
        "encode": _rate(len(data), enc, s),
        "decode_no_loss": _rate(len(data), lambda: decode(src), s),
    }
    if decode(lossy) == data:
        row["decode_lossy"] = _rate(len(data), lambda: decode(lossy), s)
    else:
        row["decode_lossy"] = None  # too few repair symbols for this loss (5 % overhead, K=32)
    return row


def _zfec(data: bytes, t: int, k: int, r: int, rnd: random.Random, s: float) -> dict[str, Any]:
    if k + r > 256:
        return {"encode": None, "decode_no_loss": None, "decode_lossy": None}
    enc = zfec.Encoder(k, k + r)
    repair_ids = list(range(k, k + r))

    def encode() -> list[bytes]:
        blocks = [data[i * t : (i + 1) * t] for i in range(k)]
        return blocks + list(enc.encode(blocks, repair_ids))

    shares = encode()
    dec = zfec.Decoder(k, k + r)
    drop = set(rnd.sample(range(k), _lost(k)))
    ids = [i for i in range(k) if i not in drop] + repair_ids
    ids = ids[:k] if len(ids) >= k else []
    row: dict[str, Any] = {
        "encode": _rate(len(data), encode, s),
        "decode_no_loss": _rate(len(data), lambda: dec.decode(shares[:k], list(range(k))), s),
        "decode_lossy": None,
    }
    if ids:
        chosen = [shares[i] for i in ids]
        assert b"".join(dec.decode(chosen, ids)) == data
        row["decode_lossy"] = _rate(len(data), lambda: dec.decode(chosen, ids), s)
    return row


def _bridge(data: bytes, t: int, k: int, r: int, rnd: random.Random, s: float) -> dict[str, Any]:
    plan = block_plan(len(data), t, k, 0)
    symbols = encode_block(data, t, r)
    drop = set(rnd.sample(range(k), _lost(k)))
    lossy = [(e, p) for e, p in symbols if e not in drop]

    def decode(syms: list[tuple[int, bytes]]) -> bytes | None:
        d = BlockDecoder(plan, t)
        for esi, payload in syms:
            if d.add(esi, payload):
                return d.data()
        return None

    row: dict[str, Any] = {
        "encode": _rate(len(data), lambda: encode_block(data, t, r), s),
        "decode_no_loss": _rate(len(data), lambda: decode(symbols[:k]), s),
        "decode_lossy": None,
    }
    if decode(lossy) == data:
        row["decode_lossy"] = _rate(len(data), lambda: decode(lossy), s)
    return row


def _failure_rates(trials: int, rnd: random.Random) -> list[dict[str, Any]]:
    """How often RaptorQ cannot decode from exactly K + extra distinct symbols."""
    t = 16
    out = []
    for k in (10, 32, 128):
        data = os.urandom(k * t)
        packets = raptorq.Encoder.with_defaults(data, t).get_encoded_packets(k + 8)
        failures = {0: 0, 1: 0, 2: 0}
        for _ in range(trials):
            pick = rnd.sample(packets, k + 2)
            for extra in failures:
                d = raptorq.Decoder.with_defaults(k * t, t)
                got = None
                for p in pick[: k + extra]:
                    got = d.decode(p)
                    if got is not None:
                        break
                if got is None:
                    failures[extra] += 1
                else:
                    assert bytes(got) == data
        out.append({"k": k, "trials": trials, **{f"fail_k+{e}": n for e, n in failures.items()}})
    return out


def _mallopt() -> None:
    """Keep large buffers in the heap: no mmap/munmap (and page faults) per block."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 64 << 20) and libc.mallopt(m_trim_threshold, 256 << 20)):
        raise SystemExit("mallopt refused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.3, help="time per measurement")
    ap.add_argument("--trials", type=int, default=2000, help="blocks per failure-rate cell")
    ap.add_argument("--mallopt", action="store_true", help="raise glibc's mmap/trim thresholds")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args()
    if a.mallopt:
        _mallopt()
    rnd = random.Random(7)
    rows: list[dict[str, Any]] = []
    print(f"{'code':8} {'T':>5} {'K':>4} {'ovh':>4} {'r':>3}  enc MB/s  dec MB/s  dec 5% lost")
    for t in SYMBOL_SIZES:
        for k in BLOCK_SYMBOLS:
            data = os.urandom(k * t)
            for ovh in OVERHEADS:
                r = math.ceil(k * ovh)
                for name, fn in (("raptorq", _raptorq), ("zfec", _zfec), ("bridge", _bridge)):
                    row = {"code": name, "T": t, "K": k, "overhead": ovh, "r": r}
                    row.update(fn(data, t, k, r, rnd, a.seconds))
                    rows.append(row)
                    cells = [row[c] for c in ("encode", "decode_no_loss", "decode_lossy")]
                    shown = "  ".join(f"{c:8.0f}" if c is not None else f"{'-':>8}" for c in cells)
                    print(f"{name:8} {t:5} {k:4} {ovh:4} {r:3}  {shown}", flush=True)
    fails = _failure_rates(a.trials, rnd)
    print("\nRaptorQ decode failures from exactly K + e distinct symbols (T = 16)")
    for f in fails:
        print(
            f"  K={f['k']:4}: "
            + ", ".join(f"{key} {f[key]}/{f['trials']}" for key in f if key.startswith("fail"))
        )
    res = {
        "when": dt.datetime.now(dt.UTC).isoformat(),
        "cpu": os.cpu_count(),
        "load": os.getloadavg(),
        "mallopt": a.mallopt,
        "rows": rows,
        "failures": fails,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"fec-{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
