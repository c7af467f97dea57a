"""Crypto: the verdict on gpg status lines, fingerprints and the public surface (no gpg run)."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bridge.crypto.gpg as gpg_mod
import bridge.crypto.keys as keys_mod
from bridge.crypto.gpg import Gpg, Opened, _Result, normalize_fingerprint
from bridge.crypto.keys import KeyInventory
from bridge.errors import CryptoError, SignatureError

B = "A" * 40
X = "B" * 40
SUB = "C" * 40
TS = "1795240262"


def _res(lines: str, rc: int = 0, diag: tuple[str, ...] = ()) -> _Result:
    res = _Result(rc=rc, diag=list(diag))
    for line in lines.strip().splitlines():
        words = line.split()
        res.status.append((words[0], words[1:]))
    return res


GOOD_ENC = f"""
ENC_TO 0000000000000000 18 0
DECRYPTION_KEY {SUB} {X} u
BEGIN_DECRYPTION
DECRYPTION_INFO 2 9 0
PLAINTEXT 62 {TS}
PLAINTEXT_LENGTH 1000
NEWSIG
GOODSIG {B[-16:]} black
VALIDSIG {SUB} 2026-11-21 {TS} 0 4 0 22 10 00 {B}
DECRYPTION_OKAY
GOODMDC
END_DECRYPTION
"""


@pytest.fixture
def g(tmp_path: Path) -> Gpg:
    return Gpg(tmp_path / "home")


def test_public_surface() -> None:
    assert gpg_mod.__all__ == ["Gpg", "Opened", "normalize_fingerprint"]
    assert set(keys_mod.__all__) == {
        "Algo",
        "ImportedKey",
        "KeyInventory",
        "Side",
        "SideKeys",
        "decryption_gpg",
        "generate_key",
        "import_public_keys",
        "import_snippet",
        "init_keys",
        "init_side",
        "signing_gpg",
    }


def test_good_encrypted(g: Gpg) -> None:
    opened = g._judge(_res(GOOD_ENC), {B}, "b1")
    assert opened == Opened(B, datetime.fromtimestamp(int(TS), tz=UTC), encrypted=True)


def test_good_signed_only_iso_time(g: Gpg) -> None:
    lines = f"PLAINTEXT 62 0\nNEWSIG\nGOODSIG X b\nVALIDSIG {B} d 20260102T030405 0 4 0 22 8 00 {B}"
    opened = g._judge(_res(lines), {B}, "b1")
    assert not opened.encrypted
    assert opened.signed_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_unpinned(g: Gpg) -> None:
    with pytest.raises(SignatureError, match=f"{B}.*NOT pinned.*{X}"):
        g._judge(_res(GOOD_ENC), {X}, "b1")


def test_hidden_recipient_exit_2_is_tolerated_but_nothing_else(g: Gpg) -> None:
    trial = ("gpg: ecdh failed in gcry_cipher_decrypt: Checksum error",)
    assert g._judge(_res(GOOD_ENC, rc=2, diag=trial), {B}, "b1").signer_fpr == B
    with pytest.raises(CryptoError, match="after a good signature"):
        g._judge(_res(GOOD_ENC, rc=2), {B}, "b1")
    disk_full = (*trial, "gpg: error writing to 'x': No space left on device")
    with pytest.raises(CryptoError, match="after a good signature"):
        g._judge(_res(GOOD_ENC, rc=2, diag=disk_full), {B}, "b1")


@pytest.mark.parametrize(
    ("lines", "error", "match"),
    [
        (f"NEWSIG\nBADSIG {B[-16:]} b", SignatureError, "BAD signature"),
        ("PLAINTEXT 62 0", SignatureError, "no signature"),
        ("NODATA 1", CryptoError, "not a readable"),
        ("NEWSIG\nERRSIG 1234 22 10 00 1 9 -\nNO_PUBKEY 1234", SignatureError, "unknown key 1234"),
        (f"NEWSIG\nERRSIG 1234 22 10 00 1 9 {X}", SignatureError, f"unknown key {X}"),
        (f"NEWSIG\nERRSIG 1234 99 10 00 1 4 {X}", SignatureError, "cannot check"),
        (f"NEWSIG\nREVKEYSIG {B[-16:]} b", SignatureError, "revoked"),
        (f"NEWSIG\nEXPKEYSIG {B[-16:]} b", SignatureError, "expired key"),
        ("NEWSIG\nGOODSIG X b", SignatureError, "no VALIDSIG"),
        (
            f"NEWSIG\nGOODSIG X b\nVALIDSIG {B} d 1 0 4 0 22 8 00 {B}\n"
            f"NEWSIG\nGOODSIG X b\nVALIDSIG {B} d 1 0 4 0 22 8 00 {B}",
            SignatureError,
            "2 signature result",
        ),
        (f"NEWSIG\nGOODSIG X b\nVALIDSIG {B} d 1 0 4 0 22 8 01 {B}", SignatureError, "class 01"),
        (
            "ENC_TO 0000000000000000 18 0\nNO_SECKEY 0000000000000000\nBEGIN_DECRYPTION\n"
            "DECRYPTION_FAILED\nEND_DECRYPTION",
            CryptoError,
            "not a recipient",
        ),
        (
            f"ENC_TO 1 18 0\nDECRYPTION_KEY {SUB} {X} u\nBEGIN_DECRYPTION\nBADMDC",
            CryptoError,
            "integrity check failed",
        ),
        (
            "ENC_TO 1 18 0\nBEGIN_DECRYPTION\nDECRYPTION_INFO 0 9 0\nDECRYPTION_OKAY",
            CryptoError,
            "without integrity",
        ),
    ],
)
def test_verdicts(g: Gpg, lines: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        g._judge(_res(lines), {B}, "b1")


def test_decrypt_failure_is_not_a_signature_error(g: Gpg) -> None:
    with pytest.raises(CryptoError) as info:
        g._judge(_res("ENC_TO 1 18 0\nBEGIN_DECRYPTION\nDECRYPTION_FAILED"), {B}, "b1")
    assert not isinstance(info.value, SignatureError)


def test_short_plaintext_is_refused() -> None:
    gpg_mod._check_length(_res("PLAINTEXT_LENGTH 10"), 10, "b1")
    gpg_mod._check_length(_res("PLAINTEXT 62 0"), 3, "b1")  # partial lengths: unknown
    with pytest.raises(CryptoError, match="wrote 9 of 10"):
        gpg_mod._check_length(_res("PLAINTEXT_LENGTH 10"), 9, "b1")


@given(st.text(alphabet="0123456789abcdefABCDEF ", max_size=80))
def test_normalize_fingerprint(raw: str) -> None:
    compact = raw.replace(" ", "").upper()
    if len(compact) in (40, 64):
        assert normalize_fingerprint(raw) == compact
    else:
        with pytest.raises(CryptoError, match="not a full OpenPGP fingerprint"):
            normalize_fingerprint(raw)


@pytest.mark.parametrize("bad", ["--armor", "ABCD1234", "black", B + "\n"])
def test_fingerprints_are_never_options_or_names(bad: str) -> None:
    with pytest.raises(CryptoError):
        normalize_fingerprint(bad)


def test_toml_snippet_parses(tmp_path: Path) -> None:
    inv = KeyInventory(
        black_home=tmp_path / "black",
        red_home=tmp_path / "red",
        black_fpr=B,
        red_fprs={"r1": X, "r2": SUB},
        pub_dir=tmp_path / "pub",
    )
    data = tomllib.loads(inv.to_toml_snippet())
    assert data["link"]["black_signers"] == [B]
    assert data["black"]["signing_key"] == B
    assert data["channels"][0]["recipients"] == [X, SUB]


def test_home_permissions(tmp_path: Path) -> None:
    Gpg(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700
    (tmp_path / "f").write_text("x")
    with pytest.raises(CryptoError, match="not a directory"):
        Gpg(tmp_path / "f")
