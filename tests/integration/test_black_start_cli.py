"""Integration: `diode check` and `diode black run` refuse a channel's spool or archive folder
black cannot write (left so by a restore, a chattr, another owner) with exit 2, naming the
folder, its key and channel and the fix, before any tap drains the broker and before Spark
starts (``JAVA_HOME`` is poisoned: a command that reached Spark says so). Real CLI, real gpg,
real directories refused for real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bridge.crypto.keys import init_keys
from tests.conftest import Vhost
from tests.integration.test_cli_failfast import _cfg, _run
from tests.unit.test_black_dirs import refused_dir

pytestmark = [pytest.mark.gpg]


@pytest.mark.parametrize(("key", "top"), [("spool_dir", "spool"), ("archive", "archive")])
def test_check_and_black_run_refuse_a_channel_folder_black_cannot_write(
    short_tmp: Path, black_vhost: Vhost, key: str, top: str
) -> None:
    """It was found mid-run: the tap died (its traceback in the log, the job's error naming
    no folder), or the first bundle failed to seal once the taps had drained the broker."""
    inv = init_keys(short_tmp / "keys")
    p = _cfg(short_tmp, inv.black_fpr, list(inv.red_fprs.values()), black_vhost.amqp_url,
             'discover = false\noutbox = "black/outbox"\narchive = "black/archive"\n'
             'spool_dir = "black/spool"\nstate_dir = "black/state"\n')  # fmt: skip
    folder = short_tmp / "black" / top / "c1"
    folder.mkdir(parents=True)
    with refused_dir(folder) as why:
        for cmd in (["check"], ["black", "run", "--trigger", "available-now"]):
            code, out = _run(*cmd, "--config", str(p))
            assert code == 2, (cmd, out)
            assert f"black.{key} {folder} is not writable by the user running black" in out, out
            assert f"(uid {os.getuid()}; {why}" in out, out
            assert "it is the folder of channel 'c1'" in out, out
            assert f"`chown -R {os.getuid()} {folder}`" in out, out
    assert not any(folder.iterdir())
    assert not (short_tmp / "black" / "spool" / "c1" / "LOCK").exists(), "no tap ran"
