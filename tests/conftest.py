"""Shared test fixtures: real RabbitMQ vhosts, a session-scoped local Spark, temp GnuPG homes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bridge.black.management import ManagementClient

MGMT = os.environ.get("DIODE_TEST_MGMT", "http://127.0.0.1:15672")
AMQP_HOST = os.environ.get("DIODE_TEST_AMQP_HOST", "127.0.0.1")
AUTH = ("guest", "guest")


@dataclass(frozen=True)
class Vhost:
    """A throw-away RabbitMQ vhost on the real broker."""

    name: str
    amqp_url: str
    management_url: str = MGMT


def _create_vhost(prefix: str) -> Vhost:
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    ManagementClient(MGMT, *AUTH).put_vhost(name)
    q = urllib.parse.quote(name, safe="")
    return Vhost(name=name, amqp_url=f"amqp://guest:guest@{AMQP_HOST}:5672/{q}")


def _delete_vhost(v: Vhost) -> None:
    ManagementClient(MGMT, *AUTH, timeout=60).delete_vhost(v.name)


@pytest.fixture
def black_vhost() -> Iterator[Vhost]:
    """A fresh black vhost, deleted afterwards."""
    v = _create_vhost("diode-test-black")
    try:
        yield v
    finally:
        _delete_vhost(v)


@pytest.fixture
def red_vhost() -> Iterator[Vhost]:
    """A fresh red vhost, deleted afterwards."""
    v = _create_vhost("diode-test-red")
    try:
        yield v
    finally:
        _delete_vhost(v)


@pytest.fixture
def tables(tmp_path: Path) -> Any:
    """Red's tables (delta-rs), created empty under ``tmp_path/tables``."""
    from bridge.red.tables import RedTables

    t = RedTables(tmp_path / "tables", "delta-rs")
    t.ensure()
    return t


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp folder with a short path (gpg-agent sockets must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="dt", dir="/tmp"))
    try:
        yield d
    finally:
        homes = {p.parent for n in ("pubring.kbx", "public-keys.d") for p in d.rglob(n)}
        for home in homes:  # gpg-agent, and keyboxd where a GnuPG 2.4 home uses it
            subprocess.run(
                ["gpgconf", "--homedir", str(home), "--kill", "all"],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------- broker resource alarm
BROKER_SETTINGS_LOCK = Path(tempfile.gettempdir()) / "diode-test-broker-settings.lock"
"""Held (flock) by the one test session changing the shared broker's settings: another session
on this machine (CI beside a developer's run) waits, and never saves or restores the changed
values as the broker's own."""


@contextmanager
def _broker_settings_lock(*, wait: bool = True) -> Iterator[bool]:
    """Hold BROKER_SETTINGS_LOCK for the block; yields False (not held) if ``wait`` is False
    and another session holds it."""
    fd = os.open(BROKER_SETTINGS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


WATERMARK_SAVED = Path(tempfile.gettempdir()) / "diode-test-memory-watermark"
"""The broker's own memory watermark while a test raises an alarm: restored by that test, or
by the next session's start if the test process was killed (a broker left alarmed blocks every
publisher of every later test)."""


def _ctl(*args: str) -> str:
    out = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {out.stderr.strip() or out.stdout}")
    return out.stdout.strip()


def _memory_alarmed() -> bool:
    return "memory" in _ctl("eval", "rabbit_alarm:get_alarms().")


def _restore_watermark() -> None:
    saved = WATERMARK_SAVED.read_text().split()
    _ctl("set_vm_memory_high_watermark", *saved)
    for _ in range(100):
        if not _memory_alarmed():
            break
        time.sleep(0.1)
    WATERMARK_SAVED.unlink()


RABBIT_ENV_SAVED = Path(tempfile.gettempdir()) / "diode-test-rabbit-env.json"
"""The broker's own `rabbit` application settings while a test changes them (as
WATERMARK_SAVED): the Erlang terms to set back, or null for a key that was unset."""


def _restore_rabbit_env() -> None:
    for key, term in json.loads(RABBIT_ENV_SAVED.read_text()).items():
        if term is None:
            _ctl("eval", f"application:unset_env(rabbit, {key}).")
        else:
            _ctl("eval", f"application:set_env(rabbit, {key}, {term}).")
    RABBIT_ENV_SAVED.unlink()


@contextmanager
def rabbit_env(**terms: str) -> Iterator[None]:
    """Set the broker's `rabbit` application settings (Erlang terms, e.g. consumer_timeout=
    "1000") for the block, and put the broker's own back after it, even if the run is killed
    (the next session's start does). Skips where rabbitmqctl cannot run here."""
    saved: dict[str, str | None] = {}
    with _broker_settings_lock():
        try:
            for key in terms:
                now = _ctl("eval", f"application:get_env(rabbit, {key}).")
                saved[key] = now[len("{ok,") : -1] if now.startswith("{ok,") else None
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"changing broker settings needs rabbitmqctl on the broker's host: {e}")
        RABBIT_ENV_SAVED.write_text(json.dumps(saved))
        try:
            for key, term in terms.items():
                _ctl("eval", f"application:set_env(rabbit, {key}, {term}).")
            yield
        finally:
            _restore_rabbit_env()


def pytest_sessionstart(session: pytest.Session) -> None:
    with _broker_settings_lock(wait=False) as held:
        if not held:  # another session is changing them now: they are not left over
            return
        if WATERMARK_SAVED.exists():
            _restore_watermark()
        if RABBIT_ENV_SAVED.exists():
            _restore_rabbit_env()


@pytest.fixture
def memory_alarm() -> Iterator[None]:
    """A real memory alarm on the test broker for the whole test (:func:`raised_memory_alarm`)."""
    with raised_memory_alarm():
        yield


@contextmanager
def raised_memory_alarm() -> Iterator[None]:
    """A real memory alarm on the test broker (its high watermark set far below what it uses):
    it blocks every publishing connection until the block ends. Skips where rabbitmqctl cannot
    run here (not root, or the broker on another host)."""
    with _broker_settings_lock():
        try:
            now = _ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"a memory alarm needs rabbitmqctl on the broker's host: {e}")
        if now.startswith("{absolute,"):
            saved = f"absolute {now.strip('{}').split(',')[1].strip()}"
        else:
            saved = str(float(now))
        WATERMARK_SAVED.write_text(saved)
        try:
            _ctl("set_vm_memory_high_watermark", "0.0001")
            deadline = time.monotonic() + 30
            while not _memory_alarmed():
                assert time.monotonic() < deadline, "the broker raised no memory alarm"
                time.sleep(0.1)
            yield
        finally:
            _restore_watermark()


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark session for the whole test run."""
    from bridge.spark import get_spark

    s = get_spark("diode-tests", master="local[2]")
    yield s
    s.stop()
