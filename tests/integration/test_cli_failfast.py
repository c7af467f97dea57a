"""Integration: misconfiguration fails fast through the real `diode` CLI with a message that
says how to fix it (unknown key, missing recipient key, unreachable broker)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.crypto.keys import init_keys

pytestmark = [pytest.mark.gpg]

DIODE = [sys.executable, "-m", "bridge.cli"]


def _cfg(work: Path, black: str, recipients: list[str], amqp: str, extra: str = "") -> Path:
    p = work / "d.toml"
    p.write_text(
        f'[link]\nblack_signers = ["{black}"]\n'
        f'[[channels]]\nname = "c1"\nrecipients = {json.dumps(recipients)}\n'
        f'[black]\namqp_url = "{amqp}"\ngnupg_home = "keys/black"\nsigning_key = "{black}"\n'
        f'management_url = "http://127.0.0.1:9"\n{extra}'
    )
    return p


def _run(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run(
        [*DIODE, "--log-format", "text", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def test_unknown_key(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        extra="trigger_second = 5\n",
    )
    code, out, _ = _run("check", "--config", str(p))
    assert code == 2
    assert "black.trigger_second" in out and "unknown key" in out and "diode.example.toml" in out


def test_missing_recipient_key(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    stranger = "ABCDEF0123456789ABCDEF0123456789ABCDEF01"
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        [*inv.red_fprs.values(), stranger],
        "amqp://guest:guest@127.0.0.1:5672/%2F",
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out, secs = _run(*cmd, "--config", str(p))
        assert code != 0
        assert stranger in out and "c1" in out and "import" in out, out
        assert "Traceback" not in out
        assert secs < 20, f"{cmd} took {secs:.1f}s: must fail before Spark starts"


def test_unreachable_broker(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp, inv.black_fpr, list(inv.red_fprs.values()), "amqp://guest:s3cret@127.0.0.1:1/%2F"
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"], ["mirror"]):
        code, out, secs = _run(*cmd, "--config", str(p))
        assert code != 0, out
        assert "127.0.0.1:1" in out and "amqp_url" in out, out
        assert "s3cret" not in out, "credentials must never be printed"
        assert "Traceback" not in out
        assert secs < 20, f"{cmd} took {secs:.1f}s"
