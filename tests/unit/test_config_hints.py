"""Unit: config errors that point at the likely fix (a key in the wrong section, a signing_key
typo or short id)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import load_config
from bridge.errors import ConfigError

FPR = "0123456789ABCDEF0123456789ABCDEF01234567"


def _error(tmp_path: Path, text: str) -> str:
    p = tmp_path / "d.toml"
    p.write_text('[[channels]]\nname = "a"\nencrypt = false\n' + text)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    return str(e.value)


@pytest.mark.parametrize(
    ("text", "loc", "hint"),
    [
        ("[black]\nmax_rows = 10\n", "black.max_rows", "did you mean black.bundle.max_rows?"),
        (  # written after [[channels]]: TOML puts it in the channel's table
            f'signing_key = "{FPR}"\n',
            "channels.0.signing_key",
            "did you mean black.signing_key?",
        ),
        (
            f'[black]\nrecipients = ["{FPR}"]\n',
            "black.recipients",
            "did you mean recipients in a [[channels]] table?",
        ),
        ('[red]\nbind = "0.0.0.0"\n', "red.bind", "did you mean udp.receive.bind?"),
    ],
)
def test_a_key_in_the_wrong_section_names_where_it_belongs(
    tmp_path: Path, text: str, loc: str, hint: str
) -> None:
    msg = _error(tmp_path, text)
    assert f"{loc}: unknown key here: {hint}" in msg, msg


def test_an_unknown_key_known_nowhere_keeps_the_typo_hint(tmp_path: Path) -> None:
    msg = _error(tmp_path, "[black]\nmax_rowz = 10\n")
    assert "black.max_rowz: unknown key (typo? see conf/diode.example.toml" in msg, msg
    assert "did you mean" not in msg


def test_suggestions_are_at_most_three(tmp_path: Path) -> None:
    msg = _error(tmp_path, '[link]\nstate_dir = "s"\n')  # a key of black, red and udp.send
    hint = msg.split("did you mean ", 1)[1]
    assert 1 <= hint.count(" or ") + 1 <= 3, msg
    assert "black.state_dir" in hint and "red.state_dir" in hint, msg


def test_a_signing_key_typo_is_called_one(tmp_path: Path) -> None:
    typo = FPR[:-1] + "8"
    msg = _error(tmp_path, f'[link]\nblack_signers = ["{FPR}"]\n[black]\nsigning_key = "{typo}"\n')
    assert f"black.signing_key {typo} is not listed in link.black_signers ({FPR})" in msg, msg
    assert "check black.signing_key (a typo?)" in msg.lower(), msg
    assert "add it to link.black_signers on both sides" in msg
    assert not msg.rstrip().endswith("add it there")


@pytest.mark.parametrize("signers", [f'black_signers = ["{FPR}"]\n', ""])
def test_a_short_signing_key_is_not_a_fingerprint(tmp_path: Path, signers: str) -> None:
    """Like a short id in link.black_signers; with or without signers pinned."""
    msg = _error(tmp_path, f'[link]\n{signers}[black]\nsigning_key = "{FPR[-8:]}"\n')
    assert "black.signing_key" in msg and "is not a full OpenPGP fingerprint" in msg, msg
    assert "not listed in link.black_signers" not in msg


def test_a_spaced_lowercase_signing_key_is_normalized(tmp_path: Path) -> None:
    spaced = " ".join(FPR[i : i + 4] for i in range(0, 40, 4)).lower()
    p = tmp_path / "d.toml"
    p.write_text(
        f'[link]\nblack_signers = ["{FPR}"]\n[[channels]]\nname = "a"\nencrypt = false\n'
        f'[black]\nsigning_key = "{spaced}"\n'
    )
    assert load_config(p, environ={}).black.signing_key == FPR
