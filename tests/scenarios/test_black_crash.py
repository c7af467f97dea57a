"""Scenario (issue #5): kill -9 the black tap and the black job, repeatedly; nothing is lost and
nothing is sealed twice.

Real broker vhost, real gpg, real Spark in a subprocess (``spark_jobs/black_drain.py``) in its
own process group (a SIGKILL of the group takes the JVM, the Python workers and the taps).

1. Deterministic: one crash point at a time (``bridge.faults``), each in its own ``available-now``
   run after more traffic: the tap between fsync and ack, the sealer after the journal's
   intent, the sealer after the outbox delivery. Each run must die there: a job by SIGKILL, a
   tap by SIGKILL that fails its run, and the mark file names the point. A clean run (in the
   test's process, on the session's Spark) then drains everything. The tap's other point,
   after its ack, is ``test_tap``'s, where no JVM start is paid for it.
2. Random: a continuous job while a producer keeps publishing; the tap process and the whole
   job are SIGKILLed at random moments, several times; the last continuous run drains the rest.

Everything the outbox ever exposed is taken by a greedy mover (re-drops kept apart) and read back
with the gpg command line and pyarrow alone: bundle seqs gapless, every copy of a bundle the same
plaintext (a re-drop byte-identical), the hash chain intact, no gaps, message seqs gapless and
each published message exactly once, in publish order, with its property bytes and body as sent.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bridge.black.gaplog import read_gaps
from bridge.black.job import BlackRun
from bridge.black.mirror import Mirror
from bridge.config import load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory, init_keys
from bridge.demo.traffic import DEMO_DIRECT_KEYS, declare_exchanges, sample_messages
from tests.conftest import Vhost
from tests.mover import GreedyMover, greedy_mover  # noqa: F401 - the fixture
from tests.support import (
    BlackJob,
    OpenedBundle,
    captured_logs,
    check_chain,
    check_messages,
    crash_env,
    crash_marks,
    open_bundles,
    publish_confirmed,
    tap_pid,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

CHANNEL = "default"
MAX_ROWS = 300
Message = tuple[str, str, bytes, bytes]
"""(exchange, routing key, property bytes, body) as published."""


# --------------------------------------------------------------------------- setup


def write_config(work: Path, vhost: Vhost, inv: KeyInventory) -> Path:
    red = ", ".join(f'"{f}"' for f in inv.red_fprs.values())
    direct = "\n".join(f'"{ex}" = {json.dumps(keys)}' for ex, keys in DEMO_DIRECT_KEYS.items())
    p = work / "diode.toml"
    p.write_text(
        f"""
[link]
bridge_id = "crash-black"
black_signers = ["{inv.black_fpr}"]

[[channels]]
name = "{CHANNEL}"
exchanges = ["*"]
deny = ["unrouted"]
recipients = [{red}]

[channels.direct_routing_keys]
{direct}

[black]
amqp_url = "{vhost.amqp_url}"
management_url = "{vhost.management_url}"
gnupg_home = "keys/black"
signing_key = "{inv.black_fpr}"
trigger_seconds = 1.0
heartbeat_seconds = 5.0
max_messages_per_batch = 1500
discover_interval_seconds = 5.0

[black.bundle]
max_rows = {MAX_ROWS}
max_age_seconds = 1.0

[black.tap]
prefetch = 300
group_messages = 100

[black.spool]
segment_bytes = 1048576
min_free_bytes = 0
"""
    )
    p.chmod(0o600)  # it holds the AMQP password
    return p


def messages(first: int, n: int) -> list[Message]:
    """``n`` varied messages (every header type, every property, empty and binary bodies), each
    made unique by its number so "exactly once" is checked message by message."""
    out: list[Message] = []
    for ex, rk, props, body in sample_messages(n * 2, seed=first):
        if rk == "order.unmirrored":
            continue
        out.append((ex, rk, props, body + b"|%d" % (first + len(out))))
        if len(out) == n:
            break
    return out


def publish(url: str, batch: list[Message]) -> None:
    """Publish with confirms through the bridge's client; returns once all are confirmed."""
    publish_confirmed(url, batch, client_name="crash-test-producer")


class Producer(threading.Thread):
    """Publishes small confirmed batches until stopped; ``sent`` holds what was confirmed."""

    def __init__(self, url: str, *, batch: int = 25, pause: float = 0.1) -> None:
        super().__init__(name="crash-test-producer", daemon=True)
        self.url, self.batch, self.pause = url, batch, pause
        self.sent: list[Message] = []
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                batch = messages(len(self.sent), self.batch)
                publish(self.url, batch)
                self.sent.extend(batch)
                self._stop_event.wait(self.pause)
        except BaseException as e:  # noqa: BLE001 - re-raised by stop()
            self.error = e

    def stop(self) -> list[Message]:
        self._stop_event.set()
        self.join(60)
        assert not self.is_alive() and self.error is None, f"producer failed: {self.error!r}"
        return self.sent


def state(work: Path) -> dict[str, Any]:
    return dict(json.loads((work / "black" / "state" / f"channel-{CHANNEL}.json").read_bytes()))


def events(job: BlackJob, msg: str) -> list[dict[str, Any]]:
    return [e for e in job.log_events() if msg in str(e.get("msg", ""))]


def delivered(mover: GreedyMover, inv: KeyInventory) -> dict[int, list[OpenedBundle]]:
    """Every bundle file the mover took (re-drops included), opened independently."""
    mover.stop()
    report = mover.validate(Gpg(inv.red_home), [inv.black_fpr])
    assert report.bundles, "the mover took no bundle"
    files = sorted(mover.dst.glob("*.dbundle")) + sorted((mover.dst / "dup").glob("*.dbundle"))
    return open_bundles(files, inv.red_home, inv.black_fpr)


@pytest.fixture
def world(
    black_vhost: Vhost,
    short_tmp: Path,
    greedy_mover: Callable[..., GreedyMover],  # noqa: F811
) -> tuple[Path, Path, KeyInventory, GreedyMover]:
    """(work dir, config path, keys, the greedy mover on the outbox)."""
    work = short_tmp / "w"
    work.mkdir()
    inv = init_keys(work / "keys", red_names=("red", "red-audit"), bridge_id="crash-black")
    declare_exchanges(black_vhost.amqp_url)
    cfg_path = write_config(work, black_vhost, inv)
    cfg = load_config(cfg_path, environ={})
    Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json").sync()  # queue first
    mover = greedy_mover(cfg.black.outbox)
    return work, cfg_path, inv, mover


# --------------------------------------------------------------------------- 1. deterministic

BATCH = 1200
TAP_POINTS = [("tap.after_sync", 3)]
SEAL_POINTS = [("seal.after_intent", 2), ("seal.after_deliver", 2)]


def test_kill_9_at_each_crash_point_then_finish(
    black_vhost: Vhost, world: tuple[Path, Path, KeyInventory, GreedyMover], spark: Any
) -> None:
    work, cfg_path, inv, mover = world
    mark = work / "crash.mark"
    sent: list[Message] = []
    fired: list[str] = []
    jobs: list[BlackJob] = []
    try:
        # -- the tap dies between fsync and ack: its run fails, the next tap recognises the
        #    redelivered records it already holds
        for point, nth in TAP_POINTS:
            batch = messages(len(sent), BATCH)
            publish(black_vhost.amqp_url, batch)
            sent += batch
            job = BlackJob(
                cfg_path, "available-now", work, tag=point, env=crash_env(point, mark, nth)
            )
            jobs.append(job)
            rc = job.wait(timeout=300)
            fired.append(point)
            assert crash_marks(mark) == fired, f"{point} did not fire:\n{job.tail()}"
            assert rc not in (0, -signal.SIGKILL), f"the job outlived its tap ({rc})"
            err = job.stderr_path.read_text(errors="replace")
            assert f"tap failed for channel(s) {{'{CHANNEL}': -9}}" in err, (
                f"the tap did not die of SIGKILL:\n{job.tail()}"
            )

        # -- the sealer dies after the journal's intent, then after a delivery
        pending: dict[str, dict[str, Any]] = {}
        for point, nth in SEAL_POINTS:
            batch = messages(len(sent), BATCH)
            publish(black_vhost.amqp_url, batch)
            sent += batch
            job = BlackJob(
                cfg_path, "available-now", work, tag=point, env=crash_env(point, mark, nth)
            )
            jobs.append(job)
            rc = job.wait(timeout=300)
            fired.append(point)
            assert rc == -signal.SIGKILL, (
                f"{point}: the job did not die of SIGKILL ({rc}):\n{job.tail()}"
            )
            assert crash_marks(mark) == fired, f"{point} did not fire"
            st = state(work)
            assert st["pending"], f"{point}: no bundle in flight in the journal"
            pending[point] = st["pending"]
        skipped = events(jobs[len(TAP_POINTS)], "redeliveries of them skipped")
        assert skipped and skipped[0]["records"] > 0, "the fsynced, unacked group never came back"
        intent = json.loads(pending["seal.after_intent"]["manifest"])
        rebuilt = events(jobs[-1], "re-creating a bundle interrupted by a crash (byte-identical)")
        assert [e["bundle_seq"] for e in rebuilt] == [intent["bundle_seq"]]

        with captured_logs("bridge.black.seal") as logged:
            summary = BlackRun(load_config(cfg_path)).run(spark, "available-now", timeout=300)
        assert summary.lost == 0, summary.to_json()
        after_deliver = json.loads(pending["seal.after_deliver"]["manifest"])
        redropped = [r for r in logged if "re-dropping the archived copy" in r.getMessage()]
        assert [getattr(r, "bundle_seq", None) for r in redropped] == [after_deliver["bundle_seq"]]
    finally:
        for j in jobs:
            if j.running():
                j.kill()
    assert crash_marks(mark) == [p for p, _ in TAP_POINTS + SEAL_POINTS]

    by_seq = delivered(mover, inv)
    rows = check_chain(by_seq, channel=CHANNEL, max_rows=MAX_ROWS)
    check_messages(rows, sent)

    # the bundle interrupted after its intent: delivered once, re-created byte-identically
    copies = by_seq[intent["bundle_seq"]]
    assert len(copies) == 1
    assert copies[0].manifest == intent
    assert copies[0].plain_sha256 == pending["seal.after_intent"]["sha256"]
    # the bundle interrupted after its delivery: the re-drop is the very same file
    copies = by_seq[after_deliver["bundle_seq"]]
    assert len(copies) == 2, [c.path.name for c in copies]
    assert copies[0].sealed_sha256 == copies[1].sealed_sha256
    assert copies[0].manifest == after_deliver
    assert read_gaps(work / "black" / "state", CHANNEL) == []
    print(f"{len(by_seq)} bundles, {len(rows)} messages; crash points fired: {fired}")
    print("runs:", [(j.tag, j.returncode) for j in jobs])


# --------------------------------------------------------------------------- 2. random

KILLS = ["tap", "job", "tap", "tap"]
"""What is SIGKILLed, in order, at random moments; the last continuous run then drains."""


def test_random_kill_9_of_tap_and_job_while_traffic_flows(
    black_vhost: Vhost, world: tuple[Path, Path, KeyInventory, GreedyMover]
) -> None:
    work, cfg_path, inv, mover = world
    seed = int.from_bytes(os.urandom(4), "big")
    rnd = random.Random(seed)
    print(f"random seed {seed}")
    state_dir = work / "black" / "state"

    def bundles_taken() -> int:
        return sum(1 for t in mover.taken if t.name.endswith(".dbundle"))

    def more_than(n: int) -> Callable[[], bool]:
        return lambda: bundles_taken() > n

    def replaced(pid: int) -> Callable[[], bool]:
        return lambda: tap_pid(state_dir, CHANNEL) not in (None, pid)

    producer = Producer(black_vhost.amqp_url)
    jobs: list[BlackJob] = []
    kills: list[str] = []
    t0 = time.monotonic()
    try:
        producer.start()
        job = BlackJob(cfg_path, "continuous", work, tag="run0")
        jobs.append(job)
        wait_for(more_than(0), 180, "a first bundle", job)
        kills.append(f"first bundle at {time.monotonic() - t0:.0f}s")
        for i, what in enumerate(KILLS):
            time.sleep(rnd.uniform(0.2, 3.0))
            if what == "tap":
                pid = wait_for(lambda: tap_pid(state_dir, CHANNEL), 60, "a live tap", job)
                os.kill(pid, signal.SIGKILL)
                kills.append(f"tap {pid} at {time.monotonic() - t0:.0f}s")
                # the supervisor restarts it (a new pid) and the job lives on
                wait_for(replaced(pid), 60, "a restarted tap", job)
                wait_for(more_than(bundles_taken()), 120, "a bundle after the tap restart", job)
            else:
                job.kill()
                kills.append(f"job at {time.monotonic() - t0:.0f}s ({bundles_taken()} bundles)")
                job = BlackJob(cfg_path, "continuous", work, tag=f"run{i + 1}")
                jobs.append(job)
                wait_for(more_than(bundles_taken()), 180, "a bundle after the restart", job)
        sent = producer.stop()

        def drained() -> bool:  # the journal covers every message published
            st = state(work)
            return st["last_seq"] == len(sent) - 1 and st["pending"] is None

        wait_for(drained, 180, f"all {len(sent)} messages sealed", job, poll=0.5)
        kills.append(f"drained at {time.monotonic() - t0:.0f}s")
    finally:
        if producer.is_alive():
            producer.stop()
        for j in jobs:
            if j.running():
                j.kill()
    print(f"kills: {kills}; {time.monotonic() - t0:.0f}s")

    by_seq = delivered(mover, inv)
    rows = check_chain(by_seq, channel=CHANNEL, max_rows=MAX_ROWS)
    check_messages(rows, sent)
    assert read_gaps(state_dir, CHANNEL) == []
    redelivered = sum(len(c) - 1 for c in by_seq.values())
    print(f"{len(by_seq)} bundles ({redelivered} re-dropped), {len(rows)} messages")
