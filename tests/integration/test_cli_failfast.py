"""Integration: misconfiguration fails fast through the real `diode` CLI with a message that
says how to fix it (unknown key, missing recipient key, unreachable broker, a config holding
secrets that others can read).

"Fast" is proven by order, not by a stopwatch: every run has a poisoned ``JAVA_HOME``, so a
command that started Spark before checking its config would die of the Java gateway instead of
printing the expected message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.crypto.keys import init_keys

pytestmark = [pytest.mark.gpg]

DIODE = [sys.executable, "-m", "bridge.cli"]
NO_JAVA = "/nonexistent/diode-test-no-java"
SPARK_STARTED = ("JAVA_GATEWAY", "Java gateway", NO_JAVA)
"""What the output holds if a command reached ``get_spark`` (the JVM cannot start)."""


def _cfg(work: Path, black: str, recipients: list[str], amqp: str, extra: str = "") -> Path:
    p = work / "d.toml"
    p.write_text(
        f'[link]\nblack_signers = ["{black}"]\n'
        f'[[channels]]\nname = "c1"\nrecipients = {json.dumps(recipients)}\n'
        f'[black]\namqp_url = "{amqp}"\ngnupg_home = "keys/black"\nsigning_key = "{black}"\n'
        f'management_url = "http://127.0.0.1:9"\n{extra}'
    )
    p.chmod(0o600)  # it holds secrets (the AMQP password): only its owner may read it
    return p


def _run(*args: str, timeout: float = 120) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIODE__", "DIODE_CONFIG"))}
    env["JAVA_HOME"] = NO_JAVA
    r = subprocess.run(
        [*DIODE, "--log-format", "text", *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang guard, not a measurement
        check=False,
        env=env,
    )
    out = r.stdout + r.stderr
    assert not any(s in out for s in SPARK_STARTED), f"{args} started Spark first:\n{out}"
    assert "Traceback" not in out, out
    return r.returncode, out


def test_unknown_key(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        extra="trigger_second = 5\n",
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code == 2, out
        assert "black.trigger_second" in out and "unknown key" in out, out
        assert "diode.example.toml" in out, out


def test_removed_stream_keys_are_rejected(short_tmp: Path) -> None:
    """Keys of the stream-queue design are gone: a config still holding one is an error."""
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        extra='stream_prefix = "diode."\nread_partitions = 2\n',
    )
    code, out = _run("check", "--config", str(p))
    assert code == 2, out
    assert "unknown key" in out, out
    assert "black.stream_prefix" in out or "black.read_partitions" in out, out


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
        code, out = _run(*cmd, "--config", str(p))
        assert code != 0
        assert stranger in out and "c1" in out and "import" in out, out
    # nothing of the run was set up: it stopped before the mirror, the spool and Spark
    assert not (short_tmp / "black" / "checkpoint").exists()
    assert not (short_tmp / "black" / "spool").exists()


def test_unreachable_broker(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp, inv.black_fpr, list(inv.red_fprs.values()), "amqp://guest:s3cret@127.0.0.1:1/%2F"
    )
    for cmd in (["check"], ["black", "run", "--trigger", "available-now"], ["mirror"]):
        code, out = _run(*cmd, "--config", str(p))
        assert code != 0, out
        assert "127.0.0.1:1" in out and "amqp_url" in out, out
        assert "s3cret" not in out, "credentials must never be printed"
    assert not (short_tmp / "black" / "checkpoint").exists()


def test_config_with_secrets_readable_by_others(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys")
    p = _cfg(
        short_tmp,
        inv.black_fpr,
        list(inv.red_fprs.values()),
        "amqp://guest:s3cret@127.0.0.1:5672/%2F",
    )
    p.chmod(0o644)
    code, out = _run("check", "--config", str(p))
    assert code == 1, out
    assert "chmod 600" in out and str(p) in out and "black.amqp_url" in out, out
    assert "s3cret" not in out, "credentials must never be printed"


def test_udp_commands_fail_fast_with_a_fix(short_tmp: Path) -> None:
    base = '[[channels]]\nname = "u1"\nencrypt = false\ntransport = "udp"\n[udp]\nkey_file = "k"\n'
    p = short_tmp / "u.toml"
    p.write_text(base)
    for cmd in (["udp", "send"], ["udp", "receive"]):
        code, out = _run(*cmd, "--config", str(p), "--timeout", "1")
        assert code == 2 and "diode udp keygen" in out, out
    key = short_tmp / "k"
    code, out = _run("udp", "keygen", "--out", str(key))
    assert code == 0 and key.stat().st_mode & 0o077 == 0, out
    key.chmod(0o640)
    code, out = _run("udp", "receive", "--config", str(p), "--timeout", "1")
    assert code == 2 and "chmod 600" in out, out
    key.chmod(0o600)
    p.write_text(base + '[udp.receive]\nbind = "0.0.0.0:47100"\n')
    code, out = _run("udp", "receive", "--config", str(p), "--timeout", "1")
    assert code == 2 and "every interface" in out, out
    p.write_text(base.replace('transport = "udp"', 'transport = "file"'))
    code, out = _run("udp", "send", "--config", str(p), "--timeout", "1")
    assert code == 2 and 'no channel has transport = "udp"' in out, out
