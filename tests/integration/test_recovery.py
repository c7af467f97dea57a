"""Integration: spool positions Spark committed but black never delivered (a crash while the sink
was sealing in the background) are shipped at the next start, even when no new message arrives
— and a recovery killed half-way (SIGKILL at the ``seal.after_deliver`` crash point) is finished
by the next start from the archived copy. Real RabbitMQ, tap, spool, Spark and gpg."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.black.job import BlackRun
from bridge.black.recovery import committed_offsets
from bridge.config import load_config
from bridge.crypto.keys import init_keys
from bridge.faults import CRASH_ENV, MARK_ENV
from bridge.metrics import REGISTRY
from tests.support import REPO, bundle_files, captured_logs, gpg_open_cli, read_plain_bundle

pytestmark = [pytest.mark.broker, pytest.mark.gpg, pytest.mark.spark]

# Black's start-up recovery pass alone (no Spark), in a process the crash point kills.
RECOVER_SCRIPT = """
import sys
from bridge.black.job import BlackRun
from bridge.black.recovery import recover_committed
from bridge.config import load_config

cfg = load_config(sys.argv[1], environ={})
run = BlackRun(cfg)
recover_committed(cfg, run.sealer, run.store)
"""


def _config(work: Path, url: str, inv: Any) -> Path:
    p = work / "d.toml"
    p.write_text(
        f"""
[link]
black_signers = ["{inv.black_fpr}"]
[[channels]]
name = "rc"
exchanges = ["rc.*"]
recipients = {json.dumps(list(inv.red_fprs.values()))}
[black]
amqp_url = "{url}"
gnupg_home = "keys/black"
signing_key = "{inv.black_fpr}"
heartbeat_seconds = 30.0
[black.bundle]
max_rows = 300
"""
    )
    p.chmod(0o600)
    return p


def _publish(url: str, first: int, n: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare("rc.events", "fanout", durable=True)
    ch.confirm_delivery()
    for i in range(first, first + n):
        ch.basic_publish("rc.events", "", b"m%d" % i, pika.BasicProperties(message_id=str(i)))
    conn.close()


def _redropped() -> float:
    v = REGISTRY.get_sample_value(
        "bridge_black_bundles_recovered_total", {"channel": "rc", "how": "redropped"}
    )
    return v or 0.0


def _recovery_log() -> contextlib.AbstractContextManager[list[logging.LogRecord]]:
    """Records of black's recovery pass meanwhile (whatever the logging setup)."""
    return captured_logs("bridge.black.recovery")


def test_committed_but_undelivered_batches_ship_at_start(
    black_vhost, short_tmp: Path, spark
) -> None:  # type: ignore[no-untyped-def]
    inv = init_keys(short_tmp / "keys")
    cfg_path = _config(short_tmp, black_vhost.amqp_url, inv)
    cfg = load_config(cfg_path, environ={})
    state = Path(cfg.black.state_dir) / "channel-rc.json"
    _publish(black_vhost.amqp_url, 0, 0)  # declares the exchange before the mirror binds it
    BlackRun(cfg).mirror.sync()

    _publish(black_vhost.amqp_url, 0, 600)
    first = BlackRun(cfg).run(spark, "available-now", timeout=300)
    assert first.messages == 600
    journal_after_first = state.read_bytes()
    shipped_first = {p.name for p in bundle_files(cfg.black.outbox)}
    assert len(shipped_first) == 2

    _publish(black_vhost.amqp_url, 600, 700)
    second = BlackRun(cfg).run(spark, "available-now", timeout=300)
    assert second.messages == 700
    assert committed_offsets(Path(cfg.black.checkpoint_dir)) == {"rc": 1300}

    # the crash: Spark committed the second run's batch, black's delivery never happened
    state.write_bytes(journal_after_first)
    for p in bundle_files(cfg.black.outbox):
        if p.name not in shipped_first:
            p.unlink()
            (cfg.black.archive / "rc" / p.name).unlink()

    # the next start's recovery pass is itself killed after delivering its 2nd bundle (seq 4)
    mark = short_tmp / "crash.mark"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}
    env.update({CRASH_ENV: "seal.after_deliver:2", MARK_ENV: str(mark), "PYTHONPATH": str(REPO)})
    r = subprocess.run(
        [sys.executable, "-c", RECOVER_SCRIPT, str(cfg_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        start_new_session=True,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert mark.read_text().split() == ["seal.after_deliver"]
    journal = json.loads(state.read_text())
    assert journal["last_bundle_seq"] == 3 and journal["last_seq"] == 899
    assert journal["pending"] is not None
    assert len(bundle_files(cfg.black.outbox)) == 4  # bundle 4 delivered, not journaled

    before = _redropped()
    with _recovery_log() as log:
        third = BlackRun(cfg).run(spark, "available-now", timeout=300)  # nothing new published
    assert _redropped() - before == 1, "bundle 4 must be finished from its archived copy"
    assert any("committed but black had not delivered" in x.getMessage() for x in log)
    # everything came from the recovery pass: Spark had nothing left to read
    assert (third.recovered_bundles, third.messages, third.batches) == (2, 400, 0)

    seqs: list[int] = []
    prev = None
    names = bundle_files(cfg.black.outbox)
    assert len(names) == 5
    for i, p in enumerate(names, start=1):
        plain = gpg_open_cli(inv.red_home, p, inv.black_fpr)
        manifest, rows = read_plain_bundle(plain)
        assert manifest["bundle_seq"] == i and manifest["prev_sha256"] == prev
        assert manifest["gaps"] == []
        prev = hashlib.sha256(plain).hexdigest()
        seqs += [r["seq"] for r in rows]
        assert [r["body"] for r in rows] == [b"m%d" % r["seq"] for r in rows]
        assert [r["message_id"] for r in rows] == [str(r["seq"]) for r in rows]
    assert seqs == list(range(1300))
    journal = json.loads(state.read_text())
    assert (journal["last_bundle_seq"], journal["last_seq"], journal["pending"]) == (5, 1299, None)

    shutil.rmtree(cfg.black.checkpoint_dir)  # a deleted checkpoint: the journal decides
    assert BlackRun(cfg).run(spark, "available-now", timeout=300).messages == 0
    assert len(bundle_files(cfg.black.outbox)) == 5
