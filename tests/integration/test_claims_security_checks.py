"""Two security claims of the start checks, with real keys and a real config file: black warns
about a channel that ships signed plaintext (runbook: `channel opted out of encryption`), and
red refuses a GnuPG home that holds the SECRET key of a pinned black signer."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.black.job import check_black_config
from bridge.cli import cli
from bridge.config import Config, load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import SideKeys, decryption_gpg, import_public_keys, init_side
from bridge.errors import CryptoError
from bridge.red.job import check_red_config
from tests.support import captured_logs

pytestmark = pytest.mark.gpg

OPTED_OUT = "channel opted out of encryption: bundles are signed plaintext"


def _pair(root: Path) -> tuple[SideKeys, SideKeys]:
    """A black host and a red host, public keys crossed as the runbook says."""
    black = init_side("black", root / "bh" / "keys", bridge_id="t")
    red = init_side("red", root / "rh" / "keys", name="ops", bridge_id="t")
    import_public_keys(black.home, [red.public_file])
    import_public_keys(red.home, [black.public_file])
    return black, red


def _config(root: Path, black: SideKeys, red: SideKeys) -> Config:
    """A config file (mode 0600) with channel ``sealed`` (encrypted to red) and ``open``
    (``encrypt = false``), loaded as the commands load it."""
    dirs = "".join(
        f'{k} = "{root / "black" / k}"\n' for k in ("outbox", "archive", "state_dir", "spool_dir")
    )
    red_dirs = "".join(
        f'{k} = "{root / "red" / k}"\n'
        for k in ("inbox", "work_dir", "state_dir", "processed_dir", "quarantine_dir")
    )
    text = (
        f'[link]\nbridge_id = "t"\nblack_signers = ["{black.fpr}"]\n\n'
        f'[black]\ngnupg_home = "{black.home}"\nsigning_key = "{black.fpr}"\n{dirs}\n'
        f'[red]\ngnupg_home = "{red.home}"\n{red_dirs}\n'
        f'[[channels]]\nname = "sealed"\nrecipients = ["{red.fpr}"]\n\n'
        '[[channels]]\nname = "open"\nencrypt = false\n'
    )
    path = root / "diode.toml"
    path.write_text(text)
    path.chmod(0o600)
    return load_config(path, environ={})


def _kill_agents(*homes: Path) -> None:
    for home in homes:
        subprocess.run(
            ["gpgconf", "--homedir", str(home), "--kill", "all"], capture_output=True, check=False
        )


# ------------------------------------------------------------------------ black: opting out


def test_black_start_check_warns_for_each_channel_that_opted_out_of_encryption(
    short_tmp: Path,
) -> None:
    black, red = _pair(short_tmp)
    cfg = _config(short_tmp, black, red)
    assert [(c.name, c.encrypt) for c in cfg.channels] == [("sealed", True), ("open", False)]
    with captured_logs("bridge.black.job") as records:
        check_black_config(cfg, one_shot=True)  # what `diode check` and the job's start run
    warned = [r for r in records if r.getMessage() == OPTED_OUT]
    assert [(r.levelno, getattr(r, "channel", None)) for r in warned] == [
        (logging.WARNING, "open")
    ], [(r.levelname, r.getMessage(), r.__dict__.get("channel")) for r in records]


# ------------------------------------------------------------------------ red: black's secret


def _leak_black_secret(black: SideKeys, red: SideKeys) -> None:
    """Black's SECRET signing key copied into the red home (a backup restored to the wrong
    host, a careless export): red could then sign as black."""
    exported = subprocess.run(
        ["gpg", "--homedir", str(black.home), "--batch", "--export-secret-keys", black.fpr],
        capture_output=True,
        check=True,
    ).stdout
    assert exported, f"nothing exported from {black.home}"
    Gpg(red.home).import_keys(exported)


def test_red_refuses_a_home_holding_the_secret_of_a_pinned_black_signer(
    short_tmp: Path,
) -> None:
    black, red = _pair(short_tmp)
    cfg = _config(short_tmp, black, red)
    decryption_gpg(cfg, one_shot=True)  # the same home, before the leak: accepted

    _leak_black_secret(black, red)
    refused = f"red GnuPG home {red.home} holds the SECRET of pinned black key\\(s\\) {black.fpr}"
    with pytest.raises(CryptoError, match=refused):
        decryption_gpg(cfg, one_shot=True)
    with pytest.raises(CryptoError, match=refused):
        check_red_config(cfg)  # `diode red run` checks this before Spark starts
    _kill_agents(red.home)

    r = CliRunner().invoke(
        cli, ["keys", "check", "--side", "red", "--config", str(cfg.source)], catch_exceptions=False
    )
    assert r.exit_code != 0, r.output
    assert "holds the SECRET of pinned black key(s)" in r.output and black.fpr in r.output
    assert "--delete-secret-keys" in r.output  # the fix is named
