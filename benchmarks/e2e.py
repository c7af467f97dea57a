"""Benchmark, end to end: the demo chain on a sustained stream, black broker to red broker.

    python benchmarks/e2e.py [--rate R] [--minutes M] [--size B] [--drain-minutes D]
                             [--black-trigger S] [--max-rows N] [--no-replay]
                             [--baseline N] [--sample-seconds S] [--dir DIR] [--out DIR]

What runs (each its own process group, as an operator would run them; logs in ``<out>``):

* a publisher in this process: ``--rate`` persistent ``--size`` byte messages per second for
  ``--minutes`` into a topic exchange on a black vhost, publisher confirms on (window 1000);
  each message's ``message_id`` is ``<publish time in ns, 19 digits>-<n>``, which is how the
  latency and the exactly-once checks below find it again;
* ``diode black run`` (continuous: mirror queue -> taps -> spool -> Spark -> sealed outbox);
* a stand-in file diode: ``bridge.demo.diode.move_outbox`` every 0.2 s (outbox -> inbox, in
  place, as a greedy vendor mover writes);
* ``diode red run`` (continuous: inbox -> verify + decrypt -> Delta);
* ``diode red replay`` into a red vhost (``--no-replay`` leaves it out), whose exchange is bound
  to a bounded queue so the broker routes every replayed message.

Every ``--sample-seconds`` the script scrapes each process's Prometheus endpoint (sealed,
landed, replayed) and samples the RSS and CPU of each process tree and of the broker.

Reported (DESIGN.md section 7, issue 6 targets):

* **sustained rate**: messages landed per second over the steady window (from 20% of the
  publishing time to its end) and the backlog's growth over that window (published - landed;
  ~0 when red keeps up). Target >= 20,000 msg/s, with the backlog not growing.
* **zero loss**: the ``messages`` table read back after the drain holds every published
  ``message_id`` exactly once; black reports no lost seq, red no open gap and no rejection.
* **latency**: publish -> landed (``landed_at``) p50/p90/p99 over every message, split at the
  bundle's ``created_at`` (black sealed it) and ``received_at`` (red saw the file). Target:
  p50 <= black trigger interval + 3 s.
* **memory**: peak RSS of each process tree in the 1st and 2nd half of the publishing window;
  flat when the 2nd half's peak is within 1.25x of the 1st half's.
* **baselines, same run, same broker**: the publisher alone at full speed (bridge.amqp,
  confirms) and a raw pika ``basic_consume`` drain of the same number of messages; the e2e
  rate is shown as a ratio of the pika drain (the broker-and-Python ceiling of this machine).
* **CPU**: seconds per message of each process tree and of the broker over the window: where
  the two cores go.

Needs RabbitMQ on 127.0.0.1:5672 with the management API (guest/guest), gpg, Java and the
venv. Works in throw-away vhosts and a temp dir and removes them (``--dir`` keeps the work
dir). Writes ``<out>/e2e-<utc time>.json`` and prints a table. Not part of CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from amqp_client import broker_process, cpu_seconds, drain_pika, drop_vhost, make_vhost  # noqa: E402
from amqp_client import publish as publish_queue  # noqa: E402

from bridge.amqp.client import Connection  # noqa: E402
from bridge.crypto.keys import KeyInventory, init_keys  # noqa: E402
from bridge.protocol.properties import Properties, encode_properties  # noqa: E402

MB = 1024 * 1024
EXCHANGE = "e2e.stream"
RED_QUEUE = "e2e.count"
WINDOW = 1000
"""Publisher confirms in flight."""
STEADY_FROM = 0.2
"""The steady window starts after this fraction of the publishing time (warm-up excluded)."""
FLAT_FACTOR = 1.25
TARGET_RATE = 20_000
TARGET_LATENCY_MARGIN = 3.0
MOVER = """
import sys, time
from pathlib import Path
from bridge.demo.diode import move_outbox
outbox, inbox = Path(sys.argv[1]), Path(sys.argv[2])
while True:
    if outbox.is_dir():
        move_outbox(outbox, inbox)
    time.sleep(0.2)
"""


# -- configuration -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(
    work: Path, inv: KeyInventory, black_url: str, red_url: str, args: argparse.Namespace
) -> Path:
    recipients = json.dumps(list(inv.red_fprs.values()))
    max_age = args.max_age if args.max_age is not None else args.black_trigger
    text = f"""# benchmarks/e2e.py: every key is explained in conf/diode.example.toml
[link]
bridge_id = "bench-e2e"
black_signers = ["{inv.black_fpr}"]

[[channels]]
name = "e2e"
exchanges = ["{EXCHANGE}"]
recipients = {recipients}

[black]
amqp_url = "{black_url}"
management_url = "http://127.0.0.1:15672"
gnupg_home = "{inv.black_home}"
signing_key = "{inv.black_fpr}"
outbox = "{work}/black/outbox"
archive = "{work}/black/archive"
state_dir = "{work}/black/state"
checkpoint_dir = "{work}/black/checkpoint"
spool_dir = "{work}/black/spool"
trigger_seconds = {args.black_trigger}
heartbeat_seconds = 10.0

[black.bundle]
max_rows = {args.max_rows}
max_age_seconds = {max_age}

[red]
gnupg_home = "{inv.red_home}"
inbox = "{work}/red/inbox"
work_dir = "{work}/red/work"
processed_dir = "{work}/red/processed"
quarantine_dir = "{work}/red/quarantine"
state_dir = "{work}/red/state"
checkpoint_dir = "{work}/red/checkpoint"
tables_dir = "{work}/red/delta"
delta_engine = "delta-rs"
settle_seconds = 0.5

[red.replay]
amqp_url = "{red_url}"
approved = ["{EXCHANGE}"]
"""
    p = work / "diode.toml"
    p.write_text(text)
    p.chmod(0o600)  # it holds the broker URLs with credentials
    return p


def declare(black_url: str, red_url: str) -> None:
    """The producer's exchange on black; on red the same exchange (replay would declare it
    too) bound to a bounded queue, so the broker routes every replayed message."""
    with Connection.open(black_url, client_name="diode-bench-e2e-setup") as conn:
        conn.channel().exchange_declare(EXCHANGE, "topic", durable=True)
    with Connection.open(red_url, client_name="diode-bench-e2e-setup") as conn:
        ch = conn.channel()
        ch.exchange_declare(EXCHANGE, "topic", durable=True)
        ch.queue_declare(
            RED_QUEUE,
            durable=True,
            arguments={"x-max-length": 100_000, "x-overflow": "drop-head"},
        )
        ch.queue_bind(RED_QUEUE, EXCHANGE, "#")


# -- processes ---------------------------------------------------------------------------------
@dataclass
class Component:
    """One process group of the chain, its metrics endpoint and its log file."""

    name: str
    argv: list[str]
    log: Path
    metrics_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    _cpu0: float = 0.0

    def start(self, cwd: Path) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def tree(self) -> list[psutil.Process]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def rss(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def cpu(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    def metrics(self) -> dict[str, float] | None:
        """Every sample of the process's Prometheus endpoint, summed over label sets, from one
        scrape; None when the endpoint is not up (or the process has none)."""
        if self.metrics_port is None:
            return None
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
            ) as r:
                text = r.read().decode()
        except OSError:
            return None
        totals: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                totals[s.name] = totals.get(s.name, 0.0) + s.value
        return totals

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(grace if sig != signal.SIGKILL else 30)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # whatever of the group outlived its leader (JVM, taps, gpg)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode


def components(cfg: Path, out: Path, stamp: str, replay: bool, work: Path) -> list[Component]:
    py = sys.executable
    cli = [py, "-m", "bridge.cli", "--log-format", "json"]
    black_port, red_port, replay_port = free_port(), free_port(), free_port()
    log = lambda n: out / f"e2e-{stamp}-{n}.log"  # noqa: E731
    comps = [
        Component("black", [*cli, "black", "run", "--config", str(cfg), "--metrics-port",
                            str(black_port)], log("black"), black_port),
        Component("mover", [py, "-c", MOVER, str(work / "black/outbox"),
                            str(work / "red/inbox")], log("mover")),
        Component("red", [*cli, "red", "run", "--config", str(cfg), "--metrics-port",
                          str(red_port)], log("red"), red_port),
    ]  # fmt: skip
    if replay:
        comps.append(
            Component("replay", [*cli, "red", "replay", "--config", str(cfg), "--metrics-port",
                                 str(replay_port)], log("replay"), replay_port)
        )  # fmt: skip
    return comps


# -- publisher ---------------------------------------------------------------------------------
@dataclass
class Publisher:
    """Paced publisher with confirms; counts readable from the sampler thread."""

    url: str
    rate: float
    size: int
    published: int = 0
    confirmed: int = 0
    behind_s: float = 0.0
    """The furthest the publisher fell behind its schedule (it cannot publish faster)."""
    error: str | None = None
    stream_start_ns: int = 0
    """Wall clock when the timed stream began (warm-up messages are sent before it)."""

    conn: Connection | None = None

    def run(self, seconds: float) -> None:
        """Publish ``seconds * rate`` messages on schedule, then wait for their confirms. The
        connection stays open between calls (warm-up, then the stream), so delivery tags and
        message numbers stay the same count."""
        pool = [os.urandom(self.size) for _ in range(256)]
        keys = [f"sensor.{i}" for i in range(16)]
        batch = max(1, min(500, int(self.rate // 200)))
        try:
            if self.conn is None:
                self.conn = Connection.open(self.url, client_name="diode-bench-e2e-publisher")
                self.ch = self.conn.channel()
                self.ch.confirm_select()
            conn, ch = self.conn, self.ch
            self.stream_start_ns = time.time_ns()
            t0 = time.monotonic()
            n = n0 = self.published
            end = n0 + int(seconds * self.rate)
            while n < end:
                due = min(n0 + int((time.monotonic() - t0) * self.rate), end)
                if n >= due:
                    time.sleep(min(0.05, (n + batch - due) / self.rate))
                    self._confirms(conn, 0.0)
                    continue
                self.behind_s = max(self.behind_s, (due - n) / self.rate)
                msgs = []
                for _ in range(min(batch, due - n)):
                    n += 1
                    props = encode_properties(
                        Properties(
                            message_id=f"{time.time_ns():019d}-{n}",
                            delivery_mode=2,
                            content_type="application/octet-stream",
                        )
                    )
                    msgs.append((keys[n % 16], props, pool[n % 256]))
                sent = ch.publish_many(EXCHANGE, msgs)
                self.published = n
                self._confirms(conn, 0.0)
                while sent - self.confirmed >= WINDOW:
                    self._confirms(conn, 0.5)
            deadline = time.monotonic() + 120
            while self.confirmed < n:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{n - self.confirmed} publishes unconfirmed after 120 s")
                self._confirms(conn, 1.0)
        except Exception as e:  # the report says so; the drain below still runs
            self.error = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _confirms(self, conn: Connection, timeout: float) -> None:
        for c in conn.poll(timeout).confirms:
            if not c.ack:
                raise RuntimeError(f"the black broker nacked publish {c.delivery_tag}")
            self.confirmed = max(self.confirmed, c.delivery_tag)


# -- sampling ----------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Counts, RSS and CPU of every component (and the broker) every ``period`` seconds."""

    def __init__(self, comps: list[Component], pub: Publisher, period: float) -> None:
        super().__init__(daemon=True, name="e2e-sampler")
        self.comps, self.pub, self.period = comps, pub, period
        self.rows: list[dict[str, Any]] = []
        self.halt = threading.Event()
        self.broker = broker_process()

    def sample(self) -> dict[str, Any]:
        m = {c.name: c.metrics() for c in self.comps if c.metrics_port}

        def pick(comp: str, name: str) -> float | None:
            got = m[comp]
            return None if got is None else got.get(name, 0.0)

        row: dict[str, Any] = {
            "t": time.monotonic(),
            "published": self.pub.published,
            "confirmed": self.pub.confirmed,
            "sealed": pick("black", "bridge_black_messages_sealed_total"),
            "lost": pick("black", "bridge_black_messages_lost_total"),
            "landed": pick("red", "bridge_red_messages_landed_total"),
            "rejected": pick("red", "bridge_red_files_rejected_total"),
            "open_gaps": pick("red", "bridge_red_open_gaps"),
        }
        if "replay" in m:
            row["replayed"] = pick("replay", "bridge_red_replay_confirmed_total")
        row["rss_mb"] = {c.name: round(c.rss() / MB, 1) for c in self.comps}
        row["cpu_s"] = {c.name: round(c.cpu(), 2) for c in self.comps}
        if self.broker is not None:
            row["rss_mb"]["broker"] = round(self.broker.memory_info().rss / MB, 1)
            row["cpu_s"]["broker"] = round(cpu_seconds(self.broker), 2)
        return row

    def run(self) -> None:
        while not self.halt.is_set():
            self.rows.append(self.sample())
            self.halt.wait(self.period)

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.rows.append(self.sample())


def at(rows: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The first sample taken at or after ``t`` (else the last)."""
    for r in rows:
        if r["t"] >= t:
            return r
    return rows[-1]


def _n(v: float | None) -> float:
    return float(v or 0.0)


# -- read back ---------------------------------------------------------------------------------
def read_back(tables: Path, published: int, stream_start_ns: int) -> dict[str, Any]:
    """Exactly-once (every message) and latency (the timed stream's messages) from the landed
    tables themselves."""
    msgs = DeltaTable(str(tables / "messages")).to_pyarrow_table(
        columns=["message_id", "landed_at", "bundle_id"]
    )
    bundles = DeltaTable(str(tables / "bundles")).to_pyarrow_table(
        columns=["bundle_id", "status", "created_at", "received_at"]
    )
    bundles = bundles.filter(pc.equal(bundles["status"], "landed"))
    ids = msgs["message_id"]
    unique = pc.count_distinct(ids).as_py()
    sent_ns = pc.cast(pc.utf8_slice_codeunits(ids, 0, 19), pa.int64()).to_numpy()
    ns = lambda col: pc.cast(col, pa.int64()).to_numpy(zero_copy_only=False) * 1000  # noqa: E731
    landed_ns = ns(msgs["landed_at"])
    idx = pc.index_in(msgs["bundle_id"], value_set=bundles["bundle_id"]).to_numpy(
        zero_copy_only=False
    )
    created_ns = ns(bundles["created_at"])[idx]
    received_ns = ns(bundles["received_at"])[idx]
    timed = sent_ns >= stream_start_ns
    sent_ns, landed_ns = sent_ns[timed], landed_ns[timed]
    created_ns, received_ns = created_ns[timed], received_ns[timed]

    def pct(a: np.ndarray) -> dict[str, float]:
        if not len(a):
            return {}
        q = np.percentile(a / 1e9, [50, 90, 99, 100])
        return {k: round(float(v), 3) for k, v in zip(("p50", "p90", "p99", "max"), q, strict=True)}

    return {
        "rows": msgs.num_rows,
        "unique_message_ids": unique,
        "duplicates": msgs.num_rows - unique,
        "missing": published - unique,
        "bundles_landed": bundles.num_rows,
        "latency_s": pct(landed_ns - sent_ns),
        "publish_to_sealed_s": pct(created_ns - sent_ns),
        "sealed_to_received_s": pct(received_ns - created_ns),
        "received_to_landed_s": pct(landed_ns - received_ns),
    }


# -- the run -----------------------------------------------------------------------------------
def baselines(url: str, n: int, size: int) -> dict[str, Any]:
    """The publisher alone (bridge.amqp, confirms) and a raw pika drain, same broker."""
    broker = broker_process()
    b0 = cpu_seconds(broker)
    pub = publish_queue(url, n, size)
    b1 = cpu_seconds(broker)
    drain = drain_pika(url, n)
    b2 = cpu_seconds(broker)
    return {
        "messages": n,
        "publish_msg_s": round(pub, 1),
        "pika_drain_msg_s": round(drain["msg_s"], 1),
        "broker_cpu_us_per_msg": {
            "publish": round((b1 - b0) / n * 1e6, 1),
            "drain": round((b2 - b1) / n * 1e6, 1),
        },
    }


def run(args: argparse.Namespace, work: Path, out: Path, stamp: str) -> dict[str, Any]:
    inv = init_keys(work / "keys", red_names=("red",), bridge_id="bench-e2e")
    (black_vhost, black_url), (red_vhost, red_url) = make_vhost(), make_vhost()
    base_vhost, base_url = make_vhost()
    comps: list[Component] = []
    try:
        print(f"  baselines ({args.baseline:,} messages) ...", flush=True)
        base = baselines(base_url, args.baseline, args.size)
        drop_vhost(base_vhost)
        declare(black_url, red_url)
        cfg = write_config(work, inv, black_url, red_url, args)
        comps = components(cfg, out, stamp, not args.no_replay, work)
        for c in comps:
            c.start(work)
        print("  waiting for the chain to come up ...", flush=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            dead = [c.name for c in comps if not c.alive()]
            if dead:
                raise RuntimeError(f"{dead} exited during start-up; see {out}/e2e-{stamp}-*.log")
            if all(c.metrics() is not None for c in comps if c.metrics_port):
                break
            time.sleep(1)
        pub = Publisher(black_url, args.rate, args.size)
        sampler = Sampler(comps, pub, args.sample_seconds)
        sampler.start()
        # warm-up: the queries' first (slowest) triggers and Spark's Python workers, not timed
        warm = max(1000, int(args.rate * 2))
        print(f"  warm-up: {warm:,} messages through the whole chain ...", flush=True)
        pub.run(warm / args.rate)
        wait_for(sampler, comps, pub.confirmed, not args.no_replay, 300)
        seconds = args.minutes * 60
        print(f"  publishing {args.rate:,.0f} msg/s for {seconds:.0f} s ...", flush=True)
        t_pub0 = time.monotonic()
        pub.run(seconds)
        t_pub1 = time.monotonic()
        pub.close()
        print(f"  draining (up to {args.drain_minutes} min) ...", flush=True)
        wait_for(sampler, comps, pub.confirmed, not args.no_replay, args.drain_minutes * 60)
        t_drained = time.monotonic()
        sampler.stop()
        alive = {c.name: c.alive() for c in comps}
        for c in reversed(comps):
            c.stop()
        rows = sampler.rows
        res = summarise(rows, t_pub0, t_pub1, t_drained, pub, warm, args)
        res["baseline"] = base
        res["alive_at_end"] = alive
        res["warm_up_messages"] = warm
        res["read_back"] = read_back(work / "red/delta", pub.confirmed, pub.stream_start_ns)
        res["samples"] = [{**r, "t": round(r["t"] - t_pub0, 2)} for r in rows]
        return res
    finally:
        for c in reversed(comps):
            c.stop()
        for v in (black_vhost, red_vhost, base_vhost):
            drop_vhost(v)


def wait_for(
    sampler: Sampler, comps: list[Component], want: int, replay: bool, timeout: float
) -> None:
    """Until ``want`` messages are landed (and replayed), a process died, or the time is up."""
    keys = ["landed"] + (["replayed"] if replay else [])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(c.alive() for c in comps):
        last = sampler.rows[-1] if sampler.rows else {}
        if all(_n(last.get(k)) >= want for k in keys):
            return
        time.sleep(1)


def summarise(
    rows: list[dict[str, Any]],
    t0: float,
    t1: float,
    t_drained: float,
    pub: Publisher,
    warm: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    ta = t0 + STEADY_FROM * (t1 - t0)
    a, b = at(rows, ta), at(rows, t1)
    window = b["t"] - a["t"]
    backlog = lambda r: r["published"] - _n(r["landed"])  # noqa: E731
    mid = (t0 + t1) / 2
    memory: dict[str, Any] = {}
    for name in rows[-1]["rss_mb"]:
        first = [r["rss_mb"].get(name, 0) for r in rows if t0 <= r["t"] < mid]
        second = [r["rss_mb"].get(name, 0) for r in rows if mid <= r["t"] <= t1]
        p1, p2 = max(first, default=0), max(second, default=0)
        memory[name] = {
            "peak_first_half_mb": p1,
            "peak_second_half_mb": p2,
            "flat": bool(p1) and p2 <= FLAT_FACTOR * p1,
        }
    landed = _n(b["landed"]) - _n(a["landed"])
    cpu = {
        k: round((b["cpu_s"].get(k, 0) - a["cpu_s"].get(k, 0)) / max(landed, 1) * 1e6, 1)
        for k in b["cpu_s"]
    }
    last = rows[-1]
    return {
        "rate_target": args.rate,
        "size": args.size,
        "publish_seconds": round(t1 - t0, 1),
        "published": pub.published,  # warm-up included
        "confirmed": pub.confirmed,
        "publisher_error": pub.error,
        "publisher_max_behind_s": round(pub.behind_s, 2),
        "publish_rate": round((pub.published - warm) / (t1 - t0), 1),
        "steady_window_s": round(window, 1),
        "sealed_rate": round((_n(b["sealed"]) - _n(a["sealed"])) / window, 1) if window else None,
        "landed_rate": round(landed / window, 1) if window else None,
        "backlog_at_window_start": backlog(a),
        "backlog_at_publish_end": backlog(b),
        "backlog_growth_msg_s": round((backlog(b) - backlog(a)) / window, 1) if window else None,
        "drain_seconds": round(t_drained - t1, 1),
        "sealed": last["sealed"],
        "landed": last["landed"],
        "replayed": last.get("replayed"),
        "black_lost": last["lost"],
        "red_rejected": last["rejected"],
        "red_open_gaps": last["open_gaps"],
        "memory": memory,
        "cpu_us_per_msg": cpu,
        "black_trigger_s": args.black_trigger,
        "black_max_age_s": args.max_age if args.max_age is not None else args.black_trigger,
    }


# -- report ------------------------------------------------------------------------------------
def verdicts(res: dict[str, Any]) -> dict[str, bool]:
    rb = res["read_back"]
    p50 = rb["latency_s"].get("p50")
    growth = res["backlog_growth_msg_s"] or 0.0
    return {
        "sustained": (res["landed_rate"] or 0) >= TARGET_RATE
        and res["publish_rate"] >= 0.98 * TARGET_RATE
        and growth <= 0.02 * res["rate_target"],
        "zero_loss": rb["missing"] == 0
        and rb["duplicates"] == 0
        and not res["black_lost"]
        and not res["red_rejected"]
        and not res["red_open_gaps"],
        "latency": p50 is not None and p50 <= res["black_trigger_s"] + TARGET_LATENCY_MARGIN,
        "memory_flat": all(m["flat"] for k, m in res["memory"].items() if k != "broker"),
    }


def print_table(res: dict[str, Any]) -> None:
    rb, base = res["read_back"], res["baseline"]
    line = "-" * 78
    print(f"\n{line}")
    print(f"published      {res['published']:>12,} at {res['publish_rate']:>9,.0f} msg/s "
          f"(target rate {res['rate_target']:,.0f}; behind by up to "
          f"{res['publisher_max_behind_s']} s)")  # fmt: skip
    print(f"sealed (black) {res['sealed_rate'] or 0:>12,.0f} msg/s over the steady window "
          f"({res['steady_window_s']} s)")  # fmt: skip
    ratio = (res["landed_rate"] or 0) / base["pika_drain_msg_s"] if base["pika_drain_msg_s"] else 0
    print(f"landed (red)   {res['landed_rate'] or 0:>12,.0f} msg/s   {ratio:.2f}x pika drain "
          f"({base['pika_drain_msg_s'] or 0:,.0f} msg/s); target >= {TARGET_RATE:,}")  # fmt: skip
    print(f"backlog        {res['backlog_at_window_start']:>12,.0f} -> "
          f"{res['backlog_at_publish_end']:,.0f} ({res['backlog_growth_msg_s']} msg/s growth); "
          f"drained in {res['drain_seconds']} s")  # fmt: skip
    print(f"publisher alone {base['publish_msg_s']:>11,.0f} msg/s (confirms, same broker)")
    print(f"read back      {rb['rows']:>12,} rows, {rb['unique_message_ids']:,} unique, "
          f"{rb['missing']:,} missing, {rb['duplicates']:,} duplicates; replayed "
          f"{res['replayed']}")  # fmt: skip
    for k in ("latency_s", "publish_to_sealed_s", "sealed_to_received_s", "received_to_landed_s"):
        print(f"{k:<22} " + "  ".join(f"{q} {v:>7.2f}" for q, v in rb[k].items()))
    print("memory (peak MB, 1st half -> 2nd half):")
    for name, m in res["memory"].items():
        print(f"  {name:<8} {m['peak_first_half_mb']:>8.0f} -> {m['peak_second_half_mb']:>8.0f}"
              f"  {'flat' if m['flat'] else 'GROWING'}")  # fmt: skip
    print("CPU per landed message (us): " + ", ".join(
        f"{k} {v}" for k, v in res["cpu_us_per_msg"].items()))  # fmt: skip
    print(line)
    for k, ok in res["verdicts"].items():
        print(f"{k:<14} {'met' if ok else 'NOT MET'}")
    print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=TARGET_RATE, help="messages per second")
    ap.add_argument("--minutes", type=float, default=10.0, help="publishing time")
    ap.add_argument("--size", type=int, default=1024, help="body bytes")
    ap.add_argument("--drain-minutes", type=float, default=10.0)
    ap.add_argument("--black-trigger", type=float, default=2.0, help="black.trigger_seconds")
    ap.add_argument("--max-rows", type=int, default=200_000, help="black.bundle.max_rows")
    ap.add_argument(
        "--max-age", type=float, default=None,
        help="black.bundle.max_age_seconds (default: the trigger: a bundle per trigger, the "
        "setting the latency target assumes)",
    )  # fmt: skip
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--baseline", type=int, default=200_000, help="messages for the baselines")
    ap.add_argument("--sample-seconds", type=float, default=5.0)
    ap.add_argument("--dir", type=Path, default=None, help="work dir (kept); default a temp dir")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    work = args.dir or Path(tempfile.mkdtemp(prefix="diode-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = run(args, work.resolve(), args.out.resolve(), stamp)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    res["verdicts"] = verdicts(res)
    path = args.out / f"e2e-{stamp}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print_table(res)
    print(f"wrote {path}")
    return 0 if all(res["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
