"""Benchmark, UDP transport: goodput and delivery vs loss, against raw sendto on the same path.

    python benchmarks/udp.py [--mb 200] [--file-mb 10] [--mtu 1500 9000] [--rate-mb 150]
                             [--paths relay netns] [--only SCENARIO ...] [--out DIR]

Per MTU and path, in one run:

* baseline: a raw Python ``sendto`` loop (datagrams of the size ours have at this MTU) to a
  raw receiver process that only counts, for a few seconds — what Python moves on this path;
* our transport: ``--mb`` of bundle-named files (``--file-mb`` each) in a fresh outbox,
  ``diode udp receive`` as its own process, ``diode udp send --until-idle`` as another,
  at 0%, 1% and 5% random loss, 5% loss in bursts (mean 4), 5% in bursts of exactly 50, and
  with reordering. Goodput = bytes of files delivered intact / (first datagram sent -> last
  file renamed into the inbox). "intact" counts files whose SHA-256 matches; a file not
  delivered must appear as a gap record.

Paths: ``relay`` — loss by ``diode udp relay`` (a Python process: it costs CPU on this
2-core machine, so its rates are a floor); ``netns`` — two network namespaces joined by a
veth, loss applied by nftables (``numgen random mod 100000 < N drop`` on the receiver's
ingress), which costs the endpoints no CPU; nftables makes random bursts only by time (a set
with a timeout) and fixed-length bursts only at a fixed spacing (``numgen inc``), so burst scenarios
run through the relay only. Needs root, ``ip`` and ``nft`` (``apt-get install nftables``) for
``netns``; without them that path is skipped with the reason.

Writes ``<out>/udp-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bridge.demo.udp_link import last_json, stop_process  # noqa: E402
from bridge.diode.link_status import read_gap_records, read_json  # noqa: E402
from bridge.diode.udp_key import generate_key_file  # noqa: E402
from bridge.protocol.datagram import SYMBOL_HEADER_LEN, TAG_LEN, symbol_size_for  # noqa: E402
from bridge.protocol.naming import bundle_name  # noqa: E402

CLI = [sys.executable, "-c", "from bridge.cli import main; main()"]
CHANNEL = "bench"


@dataclass(frozen=True)
class Scenario:
    name: str
    relay_args: tuple[str, ...]
    nft_loss_per_100k: int | None  # None: this scenario needs the relay (bursts, reordering)
    overhead: float


SCENARIOS = [
    Scenario("loss 0%", (), 0, 0.05),
    Scenario("loss 1% random", ("--loss", "1"), 1_000, 0.10),
    Scenario("loss 5% random", ("--loss", "5"), 5_000, 0.25),
    Scenario("loss 5% bursts (mean 4)", ("--burst-loss", "5", "--burst-mean", "4"), None, 0.25),
    Scenario(
        "loss 5% bursts of 50",
        ("--burst-loss", "5", "--burst-mean", "50", "--burst-max", "50"),
        None,
        0.25,
    ),
    Scenario("reorder 5% + dup 1%", ("--reorder", "5", "--duplicate", "1"), None, 0.05),
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------ netns
class Netns:
    """Sender and receiver namespaces joined by a veth; nftables drops on the receiver."""

    def __init__(self, mtu: int) -> None:
        tag = f"{os.getpid() % 100000}"
        self.s, self.r = f"dbr-s{tag}", f"dbr-r{tag}"
        self.s_addr, self.r_addr = "10.213.0.1", "10.213.0.2"
        self.mtu = mtu
        cmds = [
            ["ip", "netns", "add", self.s],
            ["ip", "netns", "add", self.r],
            ["ip", "link", "add", f"v{tag}s", "type", "veth", "peer", "name", f"v{tag}r"],
            ["ip", "link", "set", f"v{tag}s", "netns", self.s],
            ["ip", "link", "set", f"v{tag}r", "netns", self.r],
        ]
        for ns, dev, addr in ((self.s, f"v{tag}s", self.s_addr), (self.r, f"v{tag}r", self.r_addr)):
            cmds += [
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                ["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu), "up"],
            ]
        # The sender's UDP GSO batches must reach nftables as the datagrams they carry: with
        # one segment at most, the kernel cuts a batch apart before the veth (as a NIC would on
        # the wire), so the loss rule drops datagrams, not whole batches.
        cmds.append(["ip", "-n", self.s, "link", "set", f"v{tag}s", "gso_max_segs", "1"])
        try:
            for c in cmds:
                subprocess.run(c, check=True, capture_output=True)
        except subprocess.CalledProcessError as e:
            self.close()
            raise RuntimeError(f"{' '.join(e.cmd)}: {e.stderr.decode().strip()}") from None

    def set_loss(self, per_100k: int) -> None:
        subprocess.run(["ip", "netns", "exec", self.r, "nft", "flush", "ruleset"], check=True)
        if per_100k <= 0:
            return
        rules = f"""table inet dbr {{
  chain pre {{
    type filter hook prerouting priority -300; policy accept;
    meta l4proto udp numgen random mod 100000 < {per_100k} counter drop
  }}
}}"""
        subprocess.run(["ip", "netns", "exec", self.r, "nft", "-f", "-"], input=rules.encode(),
                       check=True)  # fmt: skip

    def dropped(self) -> int:
        out = subprocess.run(
            ["ip", "netns", "exec", self.r, "nft", "-j", "list", "ruleset"],
            capture_output=True, check=False,
        ).stdout  # fmt: skip
        try:
            for item in json.loads(out).get("nftables", []):
                for expr in item.get("rule", {}).get("expr", []):
                    if "counter" in expr:
                        return int(expr["counter"]["packets"])
        except ValueError:
            pass
        return 0

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        for ns in (self.s, self.r):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install nftables iproute2)"
    return None


# ------------------------------------------------------------------------------ baseline
_RAW_RECEIVER = """
import socket, sys, time, json
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (Linux; not in Python 3.11)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(1.0)
buf = bytearray(65536); n = b = 0
print("ready", flush=True)
while True:
    try:
        k = s.recv_into(buf)
    except TimeoutError:
        if n: break
        continue
    n += 1; b += k
print(json.dumps({"datagrams": n, "bytes": b}), flush=True)
"""

_RAW_SENDER = """
import socket, sys, time, json, os
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
dest = (sys.argv[1], int(sys.argv[2])); size = int(sys.argv[3]); secs = float(sys.argv[4])
data = os.urandom(size); n = 0; t0 = time.perf_counter(); end = t0 + secs
while True:
    for _ in range(256):
        try:
            s.sendto(data, dest); n += 1
        except OSError:
            time.sleep(0.0005)
    if time.perf_counter() > end: break
dt = time.perf_counter() - t0
print(json.dumps({"datagrams": n, "seconds": dt}), flush=True)
"""


def raw_sink(prefix_r: list[str], host: str, port: int) -> subprocess.Popen[str]:
    """The raw counting receiver, started and ready (prints its counts as JSON when idle)."""
    recv = subprocess.Popen(
        [*prefix_r, sys.executable, "-c", _RAW_RECEIVER, host, str(port)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert recv.stdout is not None
    recv.stdout.readline()
    return recv


def raw_baseline(
    prefix_s: list[str], prefix_r: list[str], host: str, port: int, size: int, seconds: float
) -> dict[str, Any]:
    recv = raw_sink(prefix_r, host, port)
    out = subprocess.run(
        [*prefix_s, sys.executable, "-c", _RAW_SENDER, host, str(port), str(size), str(seconds)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    sent = json.loads(out.strip().splitlines()[-1])
    got = json.loads(recv.communicate(timeout=60)[0].strip().splitlines()[-1])
    secs = sent["seconds"]
    return {
        "datagram_bytes": size,
        "sent_per_s": round(sent["datagrams"] / secs),
        "received_per_s": round(got["datagrams"] / secs),
        "sent_mb_per_s": round(sent["datagrams"] * size / secs / 1e6, 1),
        "received_mb_per_s": round(got["bytes"] / secs / 1e6, 1),
        "receive_fraction": round(got["datagrams"] / max(1, sent["datagrams"]), 4),
    }


# ------------------------------------------------------------------------------ our transport
def fresh_root(work: Path, name: str) -> Path:
    """An empty run folder under ``work`` holding a copy of the link key (mode 0600)."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copy(work / "udp.key", root / "udp.key")
    os.chmod(root / "udp.key", 0o600)
    return root


def endpoints(ns: Netns | None) -> tuple[str, list[str], list[str]]:
    """The receiver's address and the sender's and receiver's command prefixes of a lossless
    run: loopback, or the two namespaces with the loss rule cleared."""
    if ns is None:
        return "127.0.0.1", [], []
    ns.set_loss(0)
    return ns.r_addr, ns.prefix(ns.s), ns.prefix(ns.r)


def write_config(
    root: Path,
    dest: str,
    bind: str,
    mtu: int,
    rate: int,
    overhead: float,
    encode_workers: int,
    decode_workers: int = 1,
) -> Path:
    text = f"""
[[channels]]
name = "{CHANNEL}"
encrypt = false
transport = "udp"

[black]
outbox = "black/outbox"

[red]
inbox = "red/inbox"

[udp]
key_file = "udp.key"
mtu = {mtu}

[udp.send]
destination = "{dest}"
rate_bytes_per_second = {rate}
repair_overhead = {overhead}
min_repair_symbols = 4
encode_workers = {encode_workers}
scan_seconds = 0.1
heartbeat_seconds = 1.0
state_dir = "black/udp-send"

[udp.receive]
bind = "{bind}"
spool_dir = "red/udp-spool"
expire_seconds = 15.0
max_open_objects = 1024
rcvbuf_bytes = 33554432
decode_workers = {decode_workers}
"""
    p = root / "diode.toml"
    p.write_text(text)
    return p


def make_files(outbox: Path, total_mb: int, file_mb: float) -> dict[str, str]:
    outbox.mkdir(parents=True, exist_ok=True)
    n = max(1, int(total_mb / file_mb))
    size = int(file_mb * (1 << 20))
    blob = os.urandom(size + n)
    out = {}
    for i in range(1, n + 1):
        data = blob[i : i + size]
        name = bundle_name(CHANNEL, i, hashlib.md5(data).hexdigest())
        (outbox / name).write_bytes(data)
        out[name] = hashlib.sha256(data).hexdigest()
    return out


@contextmanager
def proc(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        yield p
    finally:
        stop_process(p, timeout=60)


def wait_relay_listening(log: Path, timeout: float = 60.0) -> None:
    """Until the relay says it listens (its ``relay listening`` line in ``log``)."""
    deadline = time.monotonic() + timeout
    while '"relay listening"' not in (log.read_text() if log.exists() else ""):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the relay did not listen within {timeout} s: {log}")
        time.sleep(0.05)


def run_transport(
    work: Path,
    sc: Scenario,
    mtu: int,
    rate: int,
    total_mb: int,
    file_mb: float,
    path: str,
    ns: Netns | None,
    encode_workers: int,
    decode_workers: int,
) -> dict[str, Any]:
    name = sc.name.replace(" ", "_").replace("%", "")
    root = fresh_root(work, f"{path}-{mtu}-{name}-d{decode_workers}")
    port, relay_port = free_port(), free_port()
    if ns is None:
        bind, dest = f"127.0.0.1:{port}", f"127.0.0.1:{relay_port}"
        pre_s: list[str] = []
        pre_r: list[str] = []
    else:
        bind = dest = f"{ns.r_addr}:{port}"
        pre_s, pre_r = ns.prefix(ns.s), ns.prefix(ns.r)
        ns.set_loss(sc.nft_loss_per_100k or 0)
    cfg = write_config(root, dest, bind, mtu, rate, sc.overhead, encode_workers, decode_workers)
    files = make_files(root / "black/outbox", total_mb, file_mb)
    inbox = root / "red/inbox"
    status = root / "red/udp-spool/status.json"
    log = root / "run.log"
    res: dict[str, Any] = {"path": path, "mtu": mtu, "scenario": sc.name, "overhead": sc.overhead,
                           "decode_workers": decode_workers}  # fmt: skip
    with proc([*pre_r, *CLI, "udp", "receive", "--config", str(cfg)], root / "recv.log") as rp:
        deadline = time.monotonic() + 60
        while not status.exists():
            if rp.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "recv.log").read_text()[-2000:])
            time.sleep(0.1)
        relay_ctx = (
            proc(
                [
                    *CLI,
                    "udp",
                    "relay",
                    "--listen",
                    dest,
                    "--forward",
                    bind,
                    *sc.relay_args,
                    "--seed",
                    "1",
                ],
                root / "relay.log",
            )  # fmt: skip
            if ns is None
            else None
        )
        if relay_ctx:
            relay_ctx.__enter__()
        try:
            if relay_ctx:  # sending before it binds would lose the first datagrams
                wait_relay_listening(root / "relay.log")
            else:
                time.sleep(0.3)
            t0 = time.monotonic()
            send = subprocess.run(
                [*pre_s, *CLI, "udp", "send", "--until-idle", "--timeout", "900", "--config",
                 str(cfg)],
                capture_output=True, text=True, cwd=REPO, check=False,
            )  # fmt: skip
            t_sent = time.monotonic()
            log.write_text(send.stderr)
            sent = json.loads(send.stdout.strip().splitlines()[-1]) if send.stdout else {}
            last_change, seen = time.monotonic(), 0
            while True:  # until everything is in, or nothing new for a while
                present = {p.name for p in inbox.iterdir()} if inbox.exists() else set()
                gaps = read_gap_records(root / "red/udp-spool")
                n = len(present & set(files))
                if n != seen:
                    seen, last_change = n, time.monotonic()
                if n + len(gaps) >= len(files) or time.monotonic() - last_change > 20:
                    break
                time.sleep(0.05)
            t_end = (
                max((p.stat().st_mtime for p in inbox.iterdir()), default=time.time())
                - time.time()
                + time.monotonic()
            )
        finally:
            if relay_ctx:
                relay_ctx.__exit__(None, None, None)
    recv = last_json(root / "recv.log") or (read_json(status) or {})
    intact = sum(
        1
        for name, digest in files.items()
        if (inbox / name).exists()
        and hashlib.sha256((inbox / name).read_bytes()).hexdigest() == digest
    )
    total_bytes = sum((inbox / n).stat().st_size for n in files if (inbox / n).exists())
    elapsed = max(1e-6, t_end - t0)
    res.update(
        files=len(files),
        intact=intact,
        corrupt=sum(1 for n in files if (inbox / n).exists()) - intact,
        gaps=len(read_gap_records(root / "red/udp-spool")),
        goodput_mb_per_s=round(total_bytes / elapsed / 1e6, 1),
        sender_mb_per_s=sent.get("mb_per_s"),
        send_seconds=round(t_sent - t0, 2),
        deliver_seconds=round(elapsed, 2),
        datagrams_sent=sent.get("datagrams"),
        datagrams_received=recv.get("datagrams"),
        dropped=recv.get("dropped"),
        repair_symbols_used=recv.get("repair_symbols_used"),
        blocks_decoded_by_workers=recv.get("blocks_decoded_by_workers"),
        blocks_decoded_here=recv.get("blocks_decoded_here"),
        send_calls=sent.get("send_calls"),
        receive_calls=recv.get("receive_calls"),
        relay=last_json(root / "relay.log") if ns is None else {"nft_dropped": ns.dropped()},
    )
    if ns is not None and sent.get("datagrams"):  # the loss nftables applied, per datagram
        res["loss_measured_pct"] = round(100 * ns.dropped() / sent["datagrams"], 2)
    shutil.rmtree(root / "black", ignore_errors=True)
    shutil.rmtree(root / "red", ignore_errors=True)
    return res


def sender_alone(
    work: Path,
    mtu: int,
    rate: int,
    total_mb: int,
    file_mb: float,
    ns: Netns | None,
    encode_workers: int,
) -> dict[str, Any]:
    """Our sender into the raw counting receiver: what the sender alone carries (on a real
    diode the receiver has a host of its own; here the sink still takes a share of the CPU)."""
    root = fresh_root(work, f"alone-{mtu}")
    port = free_port()
    host, pre_s, pre_r = endpoints(ns)
    cfg = write_config(root, f"{host}:{port}", f"{host}:{port}", mtu, rate, 0.10, encode_workers)
    make_files(root / "black/outbox", total_mb, file_mb)
    recv = raw_sink(pre_r, host, port)
    send = subprocess.run(
        [*pre_s, *CLI, "udp", "send", "--until-idle", "--timeout", "900", "--config", str(cfg)],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    sent = json.loads(send.stdout.strip().splitlines()[-1]) if send.stdout else {}
    got = json.loads(recv.communicate(timeout=60)[0].strip().splitlines()[-1])
    shutil.rmtree(root, ignore_errors=True)
    return {
        "mtu": mtu,
        "encode_workers": encode_workers,
        "file_mb_per_s": sent.get("mb_per_s"),
        "datagrams": sent.get("datagrams"),
        "send_calls": sent.get("send_calls"),
        "seconds": sent.get("seconds"),
        "sink_received_fraction": round(got["datagrams"] / max(1, sent.get("datagrams") or 1), 4),
    }


def print_table(res: dict[str, Any]) -> None:
    print()
    print(f"{'path':6} {'mtu':>5} {'baseline raw sendto':>22}")
    for b in res["baselines"]:
        print(
            f"{b['path']:6} {b['mtu']:>5} {b.get('received_mb_per_s', '-'):>10} MB/s received "
            f"({b.get('received_per_s', '-')} dgram/s of {b.get('datagram_bytes', '-')} B, "
            f"{b.get('receive_fraction', '-')} of sent)"
        )
    for al in res["sender_alone"]:
        print(
            f"{al['path']:6} {al['mtu']:>5} sender alone into a raw sink, "
            f"{al.get('encode_workers')} encode workers: "
            f"{al.get('file_mb_per_s')} MB/s of files, {al.get('datagrams')} datagrams in "
            f"{al.get('send_calls')} system calls, {al.get('sink_received_fraction')} received"
        )
    print()
    head = (
        f"{'path':6} {'mtu':>5} {'scenario':28} {'ovh':>5} {'dec w':>5} {'goodput MB/s':>12} "
        f"{'x raw':>6} {'intact':>9} {'gaps':>5} {'corrupt':>7} {'repairs used':>12}"
    )
    print(head)
    print("-" * len(head))
    base = {(b["path"], b["mtu"]): b.get("received_mb_per_s") for b in res["baselines"]}
    for r in res["runs"]:
        raw = base.get((r["path"], r["mtu"]))
        ratio = f"{r['goodput_mb_per_s'] / raw:.2f}" if raw else "-"
        print(
            f"{r['path']:6} {r['mtu']:>5} {r['scenario']:28} {r['overhead']:>5} "
            f"{r.get('decode_workers', '-'):>5} {r['goodput_mb_per_s']:>12} {ratio:>6} "
            f"{r['intact']:>4}/{r['files']:<4} "
            f"{r['gaps']:>5} {r['corrupt']:>7} {str(r['repair_symbols_used']):>12}"
        )
    for s in res.get("skipped", []):
        print(f"skipped: {s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="MB of files per scenario")
    ap.add_argument("--file-mb", type=float, default=10.0, help="size of each file")
    ap.add_argument("--mtu", type=int, nargs="+", default=[1500, 9000])
    ap.add_argument("--rate-mb", type=float, nargs="+", default=[150.0, 400.0],
                    help="sender pace per MTU, MB/s of datagrams")  # fmt: skip
    ap.add_argument("--paths", nargs="+", default=["relay", "netns"], choices=["relay", "netns"])
    ap.add_argument("--encode-workers", type=int, nargs="+", default=[0, 1],
                    help="udp.send.encode_workers of the sender-alone runs (one run each); "
                    "the transport runs use the last")  # fmt: skip
    ap.add_argument("--decode-workers", type=int, nargs="+", default=[1],
                    help="udp.receive.decode_workers: each scenario runs once per value, "
                    "alternating (--repeat times)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario and value")
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (substring)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    res: dict[str, Any] = {"started": stamp, "args": {k: str(v) for k, v in vars(a).items()},
                           "baselines": [], "sender_alone": [], "runs": [],
                           "skipped": []}  # fmt: skip
    scenarios = [s for s in SCENARIOS if not a.only or any(o in s.name for o in a.only)]
    work = Path(tempfile.mkdtemp(prefix="dbr-udp-bench-"))
    generate_key_file(work / "udp.key")
    try:
        for path in a.paths:
            why = netns_unavailable() if path == "netns" else None
            if why:
                res["skipped"].append(f"netns path: {why}")
                continue
            for i, mtu in enumerate(a.mtu):
                rate = int(a.rate_mb[min(i, len(a.rate_mb) - 1)] * 1e6)
                ns = Netns(mtu) if path == "netns" else None
                try:
                    size = symbol_size_for(mtu, CHANNEL) + SYMBOL_HEADER_LEN + len(CHANNEL)
                    size += TAG_LEN
                    host, pre_s, pre_r = endpoints(ns)
                    base = raw_baseline(pre_s, pre_r, host, free_port(), size, 3.0)
                    res["baselines"].append({"path": path, "mtu": mtu, **base})
                    print(f"baseline {path} mtu {mtu}: {base}", flush=True)
                    for workers in a.encode_workers:
                        alone = sender_alone(work, mtu, rate, a.mb, a.file_mb, ns, workers)
                        res["sender_alone"].append({"path": path, **alone})
                        print(f"sender alone {path} mtu {mtu}: {alone}", flush=True)
                    for sc in scenarios:
                        if ns is not None and sc.nft_loss_per_100k is None:
                            continue
                        for _ in range(a.repeat):
                            for dw in a.decode_workers:
                                r = run_transport(work, sc, mtu, rate, a.mb, a.file_mb, path,
                                                  ns, a.encode_workers[-1], dw)  # fmt: skip
                                res["runs"].append(r)
                                print(json.dumps(r), flush=True)
                finally:
                    if ns is not None:
                        ns.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = a.out / f"udp-{stamp}.json"
    out.write_text(json.dumps(res, indent=2))
    print_table(res)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
