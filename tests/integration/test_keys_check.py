"""Crypto (black): `diode keys check --side black` checks what `diode check` checks of black's
keys, recipients included, and a wrong signing_key names the keys the home does hold; real gpg."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from bridge.cli import cli
from bridge.crypto.keys import SideKeys, import_public_keys, init_side

pytestmark = pytest.mark.gpg


def _hosts(root: Path) -> tuple[SideKeys, SideKeys]:
    """A black host and a red host, each with its own key; nothing imported yet."""
    black = init_side("black", root / "bh" / "keys", bridge_id="t")
    red = init_side("red", root / "rh" / "keys", name="ops", bridge_id="t")
    return black, red


def _config(
    root: Path, black: SideKeys, *, signing_key: str, signers: list[str], recipients: list[str]
) -> Path:
    p = root / "diode.toml"
    p.write_text(
        f"[link]\nblack_signers = {json.dumps(signers)}\n"
        f'[[channels]]\nname = "c1"\nrecipients = {json.dumps(recipients)}\n'
        '[[channels]]\nname = "plain"\nencrypt = false\n'
        f'[black]\ngnupg_home = "{black.home}"\nsigning_key = "{signing_key}"\n'
    )
    p.chmod(0o600)
    return p


def _keys_check(cfg: Path) -> Result:
    return CliRunner().invoke(cli, ["keys", "check", "--side", "black", "--config", str(cfg)])


def test_black_keys_check_needs_every_recipient(short_tmp: Path) -> None:
    black, red = _hosts(short_tmp)
    cfg = _config(
        short_tmp, black, signing_key=black.fpr, signers=[black.fpr], recipients=[red.fpr]
    )
    # red's public key never imported on black: the runbook's check after import must say so
    missing = _keys_check(cfg)
    assert missing.exit_code == 2, missing.output
    assert "ok:" not in missing.output
    assert "recipients of channel 'c1'" in missing.output, missing.output
    assert red.fpr in missing.output and "diode keys import" in missing.output
    # imported: the check passes (the plaintext channel needs no recipient)
    import_public_keys(black.home, [red.public_file])
    cfg = _config(
        short_tmp, black, signing_key=black.fpr, signers=[black.fpr], recipients=[red.fpr]
    )
    ok = _keys_check(cfg)
    assert ok.exit_code == 0, ok.output
    assert f"ok: black keys in {black.home}" in ok.output


def test_black_keys_check_needs_recipients_that_can_encrypt(short_tmp: Path) -> None:
    black, red = _hosts(short_tmp)
    import_public_keys(black.home, [red.public_file])
    # black's own key pinned as a recipient by mistake: present, but it cannot encrypt
    cfg = _config(
        short_tmp, black, signing_key=black.fpr, signers=[black.fpr], recipients=[black.fpr]
    )
    r = _keys_check(cfg)
    assert r.exit_code == 2, r.output
    assert "recipients of channel 'c1'" in r.output, r.output
    assert f"{black.fpr} has no usable encryption subkey" in r.output, r.output


def test_a_wrong_signing_key_lists_the_keys_the_home_holds(short_tmp: Path) -> None:
    black, red = _hosts(short_tmp)
    import_public_keys(black.home, [red.public_file])
    wrong = "1" * 40  # consistently wrong: in signing_key and black_signers alike
    cfg = _config(short_tmp, black, signing_key=wrong, signers=[wrong], recipients=[red.fpr])
    r = _keys_check(cfg)
    assert r.exit_code == 2, r.output
    assert f"secret key {wrong} missing" in r.output, r.output
    assert f"{black.fpr}  t black signer" in r.output, r.output  # fingerprint and uid
    assert "set black.signing_key to it" in r.output
    assert "diode keys init" not in r.output  # it would refuse: the home holds a key
    # black.gnupg_home pointed at red's home: only red keys there, said as such
    red_home = cfg.read_text().replace(str(black.home), str(red.home))
    cfg.write_text(red_home)
    r = _keys_check(cfg)
    assert r.exit_code == 2, r.output
    assert f"{red.fpr}  " in r.output and "(a red key)" in r.output, r.output
    assert "point black.gnupg_home at black's home" in r.output
