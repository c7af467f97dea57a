"""Scenario (issue #5): the broker is restarted while the tap drains a backlog; the tap
reconnects by itself and every message lands in the spool exactly once.

Real broker (``rabbitmqctl stop_app`` / ``start_app`` on the shared node: the suite runs
sequentially; the node is always started again, and the test waits for the AMQP listener and
the management API before it returns), the tap as its own process (``diode black tap``, no
``--until-empty``: it must survive the outage, not end at it). The mirror queue is durable and
the messages persistent, so the backlog survives the restart; deliveries the tap held unacked,
and groups it made durable but whose ack the broker never applied, come back after the restart
(marked redelivered) and must not be spooled twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from bridge.amqp.client import Connection
from bridge.black.mirror import Mirror
from bridge.black.spool import KIND_MESSAGE, SpoolReader
from bridge.black.tap import tap_status
from bridge.config import Config, load_config
from bridge.errors import BrokerError
from bridge.protocol.properties import Properties, encode_properties, field_table
from tests.conftest import AUTH, MGMT, Vhost
from tests.support import REPO, publish_confirmed, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.broker]

CHANNEL = "main"
N = 40_000


def write_config(tmp: Path, amqp_url: str) -> Config:
    p = tmp / "diode.toml"
    p.write_text(
        f"""
[[channels]]
name = "{CHANNEL}"
exchanges = ["ev"]
encrypt = false

[black]
amqp_url = "{amqp_url}"
spool_dir = "spool"
state_dir = "state"

[black.tap]
# small groups: the drain takes long enough for the restart to land in the middle of it
prefetch = 20
group_messages = 20
"""
    )
    p.chmod(0o600)
    return load_config(p, environ={})


def sent_messages() -> list[tuple[bytes, bytes]]:
    """(property bytes, body): persistent, each unique."""
    out = []
    for i in range(N):
        props = Properties(
            delivery_mode=2, message_id=f"m{i}", headers=field_table({"i": i}) if i % 3 else None
        )
        out.append((encode_properties(props), b"%d|" % i + b"x" * (i % 700)))
    return out


def publish(url: str, messages: list[tuple[bytes, bytes]]) -> None:
    conn = Connection.open(url, client_name="restart-test-setup")
    try:
        conn.channel().exchange_declare("ev", "fanout", durable=True)
    finally:
        conn.close()
    publish_confirmed(
        url, (("ev", "", p, b) for p, b in messages), client_name="restart-test-producer"
    )


def rabbitmqctl(*args: str, timeout: float = 120) -> None:
    r = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert r.returncode == 0, f"rabbitmqctl {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"


def broker_up() -> bool:
    """The AMQP listener and the management API both answer."""
    try:
        Connection.open("amqp://guest:guest@127.0.0.1:5672/%2F").close()
        r = requests.get(f"{MGMT}/api/overview", auth=AUTH, timeout=5)
    except (BrokerError, OSError, requests.RequestException):
        return False
    return r.status_code == 200


def restore_broker() -> None:
    """start_app (a no-op on a running node), then wait until clients can use it again."""
    rabbitmqctl("start_app")
    rabbitmqctl("await_startup")
    deadline = time.monotonic() + 120
    while not broker_up():
        assert time.monotonic() < deadline, "the broker did not come back within 120 s"
        time.sleep(0.5)


@pytest.fixture
def restartable_broker() -> Iterator[None]:
    """Only where ``rabbitmqctl`` may restart the node; always leaves it running."""
    if os.geteuid() != 0:
        pytest.skip("restarting the broker needs root (rabbitmqctl)")
    try:
        rabbitmqctl("ping", timeout=60)  # status fails on a node whose disk monitor says NaN
    except (AssertionError, OSError) as e:
        pytest.skip(f"rabbitmqctl cannot reach the local node: {e}")
    try:
        yield
    finally:
        restore_broker()


def spooled(cfg: Config) -> list[dict[str, Any]]:
    r = SpoolReader(Path(cfg.black.spool_dir), CHANNEL)
    rows: list[dict[str, Any]] = []
    for b in r.read(r.first_pos(), r.durable_end()):
        rows.extend(b.to_pylist())
    return rows


def test_broker_restart_mid_drain_lands_everything_once(
    restartable_broker: None, black_vhost: Vhost, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, black_vhost.amqp_url)
    publish(black_vhost.amqp_url, [])  # declares the exchange
    Mirror(cfg, catalog_path=Path(cfg.black.state_dir) / "exchanges.json").sync()
    sent = sent_messages()
    publish(black_vhost.amqp_url, sent)

    assert cfg.source is not None
    log = tmp_path / "tap.log"
    # every group of 20 takes >= 4 ms more: the drain lasts >= 8 s whatever ran before (a
    # warm machine drained the whole backlog before the broker stopped, and nothing was proven)
    env = dict(os.environ, PYTHONPATH=str(REPO), DIODE_LOG_FORMAT="json")
    env["DIODE_SLOW_AT"] = "tap.after_sync:0.004"
    for k in ("DIODE_CRASH_AT", "DIODE_CRASH_MARK", "DIODE_CONFIG"):
        env.pop(k, None)
    with open(log, "wb") as out:
        tap = subprocess.Popen(
            [sys.executable, "-m", "bridge.cli", "black", "tap", "--config", str(cfg.source),
             CHANNEL],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    stopped = False
    try:

        def draining() -> bool:
            st = tap_status(cfg, CHANNEL)
            return st is not None and st.durable_end >= 1000

        wait_for(draining, 60, "the tap to be draining")
        assert tap.poll() is None, log.read_text()[-3000:]
        stopped = True
        rabbitmqctl("stop_app")
        assert not broker_up()

        def lost_broker() -> int | None:
            st = tap_status(cfg, CHANNEL)
            return st.durable_end if st and st.counters.get("reconnects", 0) >= 1 else None

        at_stop = wait_for(lost_broker, 60, "the tap to notice the broker is gone")
        assert at_stop < N, "the drain was over before the broker stopped: nothing was proven"
        time.sleep(1.0)  # the tap retries against a stopped broker at least once
        restore_broker()
        stopped = False

        def drained() -> bool:
            st = tap_status(cfg, CHANNEL)
            return st is not None and st.durable_end >= N

        wait_for(drained, 180, f"all {N} messages spooled after the restart")
        # a moment for anything spooled twice to show up, then a clean stop
        time.sleep(1.5)
        assert tap.poll() is None, "the tap exited instead of reconnecting"
        tap.send_signal(signal.SIGTERM)
        assert tap.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if tap.poll() is None:
            tap.kill()
            tap.wait(30)
        if stopped:
            restore_broker()

    st = tap_status(cfg, CHANNEL)
    assert st is not None and st.pid == tap.pid
    assert st.counters.get("reconnects", 0) >= 1, st.counters
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any("reconnecting" in e.get("msg", "") for e in events)

    rows = spooled(cfg)
    assert [r["pos"] for r in rows] == list(range(N)), "positions gapless, nothing twice"
    assert all(r["kind"] == KIND_MESSAGE and r["exchange"] == "ev" for r in rows)
    assert [(r["properties_raw"], r["body"]) for r in rows] == sent, "each once, in order"
    conn = Connection.open(black_vhost.amqp_url)
    try:
        assert conn.channel().queue_depth(f"diode.mirror.{CHANNEL}") == 0
    finally:
        conn.close()
    print(
        f"broker stopped at position {at_stop} of {N}; tap counters {st.counters}; "
        f"{sum(r['redelivered'] for r in rows)} spooled redeliveries"
    )
