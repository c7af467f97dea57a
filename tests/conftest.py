"""Shared test fixtures: real RabbitMQ vhosts, a session-scoped local Spark, temp GnuPG homes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
def short_tmp() -> Iterator[Path]:
    """A temp folder with a short path (gpg-agent sockets must stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="dt", dir="/tmp"))
    try:
        yield d
    finally:
        for home in d.rglob("pubring.kbx"):
            subprocess.run(
                ["gpgconf", "--homedir", str(home.parent), "--kill", "gpg-agent"],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark session for the whole test run."""
    from bridge.spark import get_spark

    s = get_spark("diode-tests", master="local[2]")
    yield s
    s.stop()
