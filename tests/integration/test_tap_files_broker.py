"""Black, tap and spool files on a real vhost: a spool file the file system refuses stops the
tap before it consumes, or, refused while it runs, stops it without acking what is not
durable; either way the job's error carries the tap's reason (the file, errno and fix), not
only an exit status. A disk that fills up (spool and state dir on it) pauses the tap instead
of killing it. Real files (``chattr +i`` as root), a real small tmpfs, no mock."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bridge.amqp.client import Connection
from bridge.black.tap import Tap, tap_status
from bridge.black.taps import TapSupervisor, UntilEmptyTaps
from bridge.config import Config, load_config
from bridge.errors import ConfigError
from bridge.protocol.properties import Properties, encode_properties
from tests.integration.test_tap import (
    QUEUE,
    _fill,
    messages,
    publish_raw,
    queue_depth,
    setup_mirror,
    spooled,
    write_config,
)
from tests.support import small_tmpfs

pytestmark = [pytest.mark.broker]


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i path`` (refuses writes even to root, even through open descriptors on
    ext4), cleared afterwards; skips without root or where the file system has no such
    attribute."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root (CAP_LINUX_IMMUTABLE)")
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i refused on {path}'s file system: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _never_delivered(url: str, n: int) -> None:
    """The mirror queue holds ``n`` messages, none of them ever delivered (no tap took one)."""
    with Connection.open(url) as conn:
        assert conn.channel().queue_declare(QUEUE, passive=True).message_count == n
    import pika

    c = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = c.channel()
        for _ in range(n):
            method, _props, _body = ch.basic_get(QUEUE, auto_ack=False)
            assert method is not None and not method.redelivered, "a tap had taken it"
    finally:
        c.close()  # unacked: back to the queue


def _drain(cfg: Config) -> list[bytes]:
    """Run a tap until the mirror queue is empty; the bodies the spool holds."""
    Tap(cfg, "main", until_empty=True).run()
    return [r["body"] for r in spooled(cfg)]


@pytest.mark.parametrize("name", ["TAIL", "segment"])
def test_a_refused_spool_file_stops_the_tap_before_it_consumes_and_the_job_says_why(
    black_vhost: Any, tmp_path: Path, name: str
) -> None:
    """The job's taps found it themselves: the tap died with a PermissionError traceback
    (exit 1) and the job said ``tap failed for channel(s) {'main': 1} (exit status); its log
    above says why``. Now the tap refuses at its start (exit 2), before it takes a message,
    and the job's ConfigError names the file, the channel, the key and the fix."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url, group_messages=5, group_seconds=0.2)
    setup_mirror(cfg, url)
    publish_raw(url, messages(5))
    assert len(_drain(cfg)) == 5
    d = Path(cfg.black.spool_dir) / "main"
    path = d / "TAIL" if name == "TAIL" else sorted(d.glob("seg-*.arrow"))[-1]
    publish_raw(url, messages(5))
    with immutable(path):
        with pytest.raises(ConfigError) as e:
            UntilEmptyTaps(cfg, timeout=60).finish()
        _never_delivered(url, 5)
    msg = str(e.value)
    assert "tap failed for channel(s) {'main': 2} (exit status): 'main': " in msg, msg
    assert f"black.spool_dir: {path}, in the spool of channel 'main', is not writable" in msg
    assert "(EPERM)" in msg and f"`chattr -i -a {path}`" in msg, msg
    assert len(_drain(cfg)) == 10, "writable again: the tap takes up where it stopped"


@pytest.mark.parametrize("name", ["TAIL", "segment"])
def test_a_spool_file_refused_mid_run_stops_the_tap_with_nothing_acked_twice_or_lost(
    black_vhost: Any, tmp_path: Path, name: str
) -> None:
    """Someone made a spool file immutable while black ran. The tap took the bare OSError
    for a lost broker connection: a refused TAIL update left the durable batch pending and
    it was written again at new positions; then the tap died, was restarted, died again at
    its open, for ever, the job never saying why. Now the tap stops on a ConfigError (exit 2)
    that the continuous job's error carries, nothing it had not made durable is acked, and
    once the file is writable every message is in the spool once."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url, group_messages=5, group_seconds=0.2)
    setup_mirror(cfg, url)
    sent = messages(10)
    publish_raw(url, sent[:5])
    d = Path(cfg.black.spool_dir) / "main"
    sup = TapSupervisor(cfg).start()
    try:
        deadline = time.monotonic() + 30
        while (st := tap_status(cfg, "main")) is None or st.acked_through < 4:
            assert time.monotonic() < deadline, f"the tap did not spool the first 5: {st}"
            time.sleep(0.05)
        path = d / "TAIL" if name == "TAIL" else sorted(d.glob("seg-*.arrow"))[-1]
        with immutable(path):
            publish_raw(url, sent[5:])
            while sup.error is None:
                assert time.monotonic() < deadline + 30, "the job never learnt why"
                time.sleep(0.1)
            sup.stop()
            assert queue_depth(url, QUEUE) == 5, "what was not durable was never acked"
    finally:
        sup.stop()
    msg = str(sup.error)
    assert isinstance(sup.error, ConfigError)
    assert "the tap of channel 'main' stopped on a configuration error: " in msg, msg
    assert f"black.spool_dir: {path}, in the spool of channel 'main', is not writable" in msg
    assert f"`chattr -i -a {path}`" in msg and "Nothing that is not durable was acked" in msg
    assert _drain(cfg) == [b for _, b in sent], "each message once, in order"
    assert queue_depth(url, QUEUE) == 0


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A fresh 32 MiB tmpfs (a disk that really fills up)."""
    with small_tmpfs("32m", "tapfiles") as d:
        yield d


def test_a_disk_that_fills_up_under_the_spool_and_state_dir_pauses_the_tap(
    black_vhost: Any, tmp_path: Path, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The spool and the state dir on one disk (the default layout), filled by something
    else while the tap runs: the spool's ENOSPC pauses the tap, but writing its status file
    failed too and the tap took that OSError for a lost broker connection, then died with a
    traceback. Now the status file's failure is a warning, the tap stays paused (no resume
    into the same ENOSPC every second), acks nothing it did not make durable, and resumes
    once there is room: every message spooled once."""
    caplog.set_level(logging.INFO, logger="bridge")
    url = black_vhost.amqp_url
    base = write_config(
        tmp_path, url, group_messages=6, group_seconds=0.5, prefetch=100,
        spool_dir=str(small_disk / "spool"), spool={"min_free_bytes": 0},
    )  # fmt: skip
    assert base.source is not None
    text = base.source.read_text().replace('state_dir = "state"', f'state_dir = "{small_disk}"')
    base.source.write_text(text)
    cfg = load_config(base.source)
    setup_mirror(cfg, url)
    sent = [(encode_properties(Properties(message_id=f"m{i}")), bytes([i]) * 1_000_000)
            for i in range(12)]  # fmt: skip
    publish_raw(url, sent[:6])
    tap = Tap(cfg, "main")
    died: list[BaseException] = []

    def run() -> None:
        try:
            tap.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            died.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    filler = small_disk / "filler"
    try:
        deadline = time.monotonic() + 30
        while tap.status.acked_through < 5:
            assert th.is_alive() and time.monotonic() < deadline, died
            time.sleep(0.05)
        _fill(filler)
        publish_raw(url, sent[6:])
        while not (tap.status.paused and "No space left on device" in tap.status.paused):
            assert th.is_alive(), f"the tap died of the full disk: {died}"
            assert time.monotonic() < deadline + 30, "the tap never paused"
            time.sleep(0.05)
        assert f"{small_disk / 'spool' / 'main'}" in tap.status.paused
        time.sleep(3)  # full all along: it stays paused, disconnected, the rest in the broker
        assert th.is_alive() and tap.status.paused, died
        assert tap.status.durable_end == 6 and queue_depth(url, QUEUE) == 6
        filler.unlink()
        while tap.status.durable_end < 12:
            assert th.is_alive() and time.monotonic() < deadline + 90, "the tap did not resume"
            time.sleep(0.05)
    finally:
        tap.stop()
        th.join(30)
    assert not died, died
    assert [r["body"] for r in spooled(cfg)] == [b for _, b in sent]
    assert queue_depth(url, QUEUE) == 0
    logs = [r.getMessage() for r in caplog.records if r.name.startswith("bridge.black.tap")]
    assert sum("tap resumed" in m for m in logs) == 1, logs
    assert any(m.startswith("tap status file not written: No space left on device") for m in logs)
    assert not any("broker connection lost" in m for m in logs), logs
    st = tap_status(cfg, "main")
    assert st is not None and st.durable_end == 12 and not st.paused
