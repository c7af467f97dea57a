"""Crypto verdict: real gpg 2.2.40 transcripts, judged without running gpg.

Every transcript below was captured once from ``gpg --status-fd`` decrypting messages
sealed with keys from ``bridge.crypto.keys.init_keys`` (ed25519/cv25519), then trimmed:
KEY_CONSIDERED, SIG_ID and CARDCTRL lines, the scdaemon notice and trailing spaces are
left out. Status and diagnostic lines are interleaved on one stream in real runs; here
the diagnostics follow the status lines, which ``parse_status`` does not care about.
"""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

import pytest

import bridge.crypto.gpg as gpg_mod
import bridge.crypto.verdict as verdict_mod
from bridge.crypto.verdict import Opened, Transcript, check_length, judge, parse_status
from bridge.errors import CryptoError, SignatureError

BLACK = "973EB04C1A987107CFBCABC33C49DD86908A85B2"
"""The pinned black signing key."""
OTHER = "C0527ACBA44F2C6B80D5F159733345D9DF650519"
"""A second signing key red has the public key of, but which is not pinned."""
R1, R1_SUB = "C0A9969542553B3408A99AF8A8855B87D7F0F62D", "F913A08851A379C9528ACBBB6B45E2E06D38DED5"
"""Red key 1 (held by red) and its encryption subkey."""
R2, R2_SUB = "DBD9D92046F0A0438F12DE62FD62BD5A073F1E6C", "0F5DE9B61D88DD6E56FCC4E10B10C7C96E40FD6D"
"""Red key 2 (held by another red site) and its encryption subkey."""
HOME = "/tmp/vd/k/red"
SIGNED_AT = datetime(2026, 11, 21, 6, 39, 5, tzinfo=UTC)

# Sealed by Gpg.seal to two hidden recipients; red holds the first one's key.
GOOD_ENCRYPTED = f"""
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] DECRYPTION_KEY {R1_SUB} {R1} u
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 2 9 0
[GNUPG:] PLAINTEXT 62 1795243145
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243145 0 4 0 22 10 00 {BLACK}
[GNUPG:] DECRYPTION_OKAY
[GNUPG:] GOODMDC
[GNUPG:] END_DECRYPTION
gpg: anonymous recipient; trying secret key 6B45E2E06D38DED5 ...
gpg: okay, we are the anonymous recipient.
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: Signature made Sat Nov 21 06:39:05 2026 UTC
gpg:                using EDDSA key {BLACK}
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: WARNING: Using untrusted key!
"""

# Gpg.seal(encrypt=False): a binary signed message.
GOOD_SIGNED = f"""
[GNUPG:] PLAINTEXT 62 1795243145
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243145 0 4 0 22 8 00 {BLACK}
gpg: Signature made Sat Nov 21 06:39:05 2026 UTC
gpg:                using EDDSA key {BLACK}
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: WARNING: Using untrusted key!
"""

# GOOD_SIGNED with one bit of the literal data flipped (gpg exit 1).
BADSIG = f"""
[GNUPG:] PLAINTEXT 62 1795243145
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] BADSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] FAILURE gpg-exit 33554433
gpg: Signature made Sat Nov 21 06:39:05 2026 UTC
gpg:                using EDDSA key {BLACK}
gpg: BAD signature from "diode-bridge black signer" [unknown]
"""

# gpg --encrypt without --sign.
NO_SIGNATURE = f"""
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] DECRYPTION_KEY {R1_SUB} {R1} u
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 2 9 0
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] DECRYPTION_OKAY
[GNUPG:] GOODMDC
[GNUPG:] END_DECRYPTION
gpg: anonymous recipient; trying secret key 6B45E2E06D38DED5 ...
gpg: okay, we are the anonymous recipient.
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: encrypted with ECDH key, ID 0000000000000000
"""

# gpg --sign -u BLACK -u OTHER: both signatures are good, and both keys are known.
TWO_SIGNATURES = f"""
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243153 0 4 0 22 8 00 {BLACK}
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 733345D9DF650519 second signer
[GNUPG:] VALIDSIG {OTHER} 2026-11-21 1795243153 0 4 0 22 8 00 {OTHER}
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: Good signature from "second signer" [unknown]
"""

# gpg --sign -u OTHER: a good signature by a key red knows but does not pin.
UNPINNED = f"""
[GNUPG:] PLAINTEXT 62 1795243175
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 733345D9DF650519 second signer
[GNUPG:] VALIDSIG {OTHER} 2026-11-21 1795243175 0 4 0 22 8 00 {OTHER}
gpg: Good signature from "second signer" [unknown]
"""

# gpg --clearsign: a good signature by the pinned key, but over canonical text (class 01).
CLEARSIGNED = f"""
[GNUPG:] PLAINTEXT 74 0
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243270 0 4 0 22 8 01 {BLACK}
gpg: Good signature from "diode-bridge black signer" [unknown]
"""

# GOOD_ENCRYPTED with the last byte (inside the MDC packet) flipped (gpg exit 2).
BAD_MDC = f"""
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] DECRYPTION_KEY {R1_SUB} {R1} u
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 2 9 0
[GNUPG:] PLAINTEXT 62 1795243145
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243145 0 4 0 22 10 00 {BLACK}
[GNUPG:] BADMDC
[GNUPG:] DECRYPTION_FAILED
[GNUPG:] END_DECRYPTION
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: WARNING: encrypted message has been manipulated!
"""

# Sealed with --rfc2440 (no MDC). gpg 2.2 fails it itself (exit 2) ...
NO_MDC = f"""
[GNUPG:] ENC_TO 6B45E2E06D38DED5 18 0
[GNUPG:] DECRYPTION_KEY {R1_SUB} {R1} u
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 0 9 0
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243153 0 4 0 22 10 00 {BLACK}
[GNUPG:] DECRYPTION_FAILED
[GNUPG:] END_DECRYPTION
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: WARNING: message was not integrity protected
gpg: decryption forced to fail!
"""

# ... but with --ignore-mdc-error (e.g. from a gpg.conf) it says DECRYPTION_OKAY, exit 0.
NO_MDC_IGNORED = f"""
[GNUPG:] ENC_TO 6B45E2E06D38DED5 18 0
[GNUPG:] DECRYPTION_KEY {R1_SUB} {R1} u
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 0 9 0
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243153 0 4 0 22 10 00 {BLACK}
[GNUPG:] DECRYPTION_OKAY
[GNUPG:] END_DECRYPTION
gpg: Good signature from "diode-bridge black signer" [unknown]
gpg: WARNING: message was not integrity protected
"""

# Two hidden recipients; red holds only the SECOND one's key, so gpg first tries it on
# the other slot, logs the ECDH checksum miss and exits 2 although all is well.
HIDDEN_TRIAL = f"""
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] DECRYPTION_KEY {R2_SUB} {R2} -
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 2 9 0
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] NEWSIG
[GNUPG:] GOODSIG 3C49DD86908A85B2 diode-bridge black signer
[GNUPG:] VALIDSIG {BLACK} 2026-11-21 1795243153 0 4 0 22 10 00 {BLACK}
[GNUPG:] DECRYPTION_OKAY
[GNUPG:] GOODMDC
[GNUPG:] END_DECRYPTION
gpg: anonymous recipient; trying secret key 0B10C7C96E40FD6D ...
gpg: ecdh failed in gcry_cipher_decrypt: Checksum error
gpg: anonymous recipient; trying secret key 0B10C7C96E40FD6D ...
gpg: okay, we are the anonymous recipient.
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: Good signature from "diode-bridge black signer" [unknown]
"""

# The same message written to /dev/full: same status lines and ECDH noise, exit 2, plus
# a real error that must not be excused.
HIDDEN_TRIAL_DISK_FULL = (
    HIDDEN_TRIAL
    + """gpg: error closing '/dev/full': No space left on device
gpg: handle plaintext failed: No space left on device
"""
)

# The same message opened in a home that holds neither recipient key.
NOT_A_RECIPIENT = """
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_FAILED
[GNUPG:] END_DECRYPTION
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: encrypted with ECDH key, ID 0000000000000000
gpg: decryption failed: No secret key
"""

# The same message with --max-output 10: gpg stops before it reaches the signature.
MAX_OUTPUT = f"""
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] ENC_TO 0000000000000000 18 0
[GNUPG:] DECRYPTION_KEY {R2_SUB} {R2} -
[GNUPG:] NO_SECKEY 0000000000000000
[GNUPG:] BEGIN_DECRYPTION
[GNUPG:] DECRYPTION_INFO 2 9 0
[GNUPG:] PLAINTEXT 62 1795243153 ''
[GNUPG:] PLAINTEXT_LENGTH 120
[GNUPG:] DECRYPTION_OKAY
[GNUPG:] GOODMDC
[GNUPG:] END_DECRYPTION
gpg: ecdh failed in gcry_cipher_decrypt: Checksum error
gpg: okay, we are the anonymous recipient.
gpg: error writing to '/tmp/vd/out': exceeded --max-output limit

gpg: handle plaintext failed: Provided object is too large
"""


def transcript(stderr: str, rc: int = 0) -> Transcript:
    status, diag = parse_status(stderr.lstrip("\n"))
    return Transcript(rc=rc, status=status, diag=diag)


def verdict(stderr: str, rc: int = 0, pinned: frozenset[str] = frozenset({BLACK})) -> Opened:
    return judge(transcript(stderr, rc), pinned, "b1", home=HOME)


def without(stderr: str, keyword: str) -> str:
    """A real transcript with one status keyword's lines taken out."""
    kept = [line for line in stderr.splitlines() if line.split(" ")[:2] != ["[GNUPG:]", keyword]]
    return "\n".join(kept) + "\n"


# ------------------------------------------------------------------ parsing


def test_parse_status_splits_status_from_diagnostics() -> None:
    status, diag = parse_status(GOOD_ENCRYPTED.lstrip("\n"))
    assert [k for k, _ in status][:3] == ["ENC_TO", "DECRYPTION_KEY", "ENC_TO"]
    assert dict(status)["PLAINTEXT_LENGTH"] == ["120"]
    assert ("NEWSIG", []) in status
    assert len(status) == 14
    assert diag[0] == "gpg: anonymous recipient; trying secret key 6B45E2E06D38DED5 ..."
    assert all(not d.startswith("[GNUPG:]") for d in diag)


def test_parse_status_keeps_empty_and_quoted_arguments() -> None:
    status, _ = parse_status("[GNUPG:] PLAINTEXT 62 1795243153 ''\n[GNUPG:] PLAINTEXT 62 1 ")
    assert status == [("PLAINTEXT", ["62", "1795243153", "''"]), ("PLAINTEXT", ["62", "1", ""])]


def test_reason_quotes_gpg() -> None:
    reason = transcript(BADSIG, rc=1).reason()
    assert reason.startswith("gpg exit 1; FAILURE gpg-exit 33554433; ")
    assert reason.endswith('BAD signature from "diode-bridge black signer" [unknown]')


# ------------------------------------------------------------------ accepted


def test_good_encrypted() -> None:
    assert verdict(GOOD_ENCRYPTED) == Opened(BLACK, SIGNED_AT, encrypted=True)


def test_good_signed_only() -> None:
    assert verdict(GOOD_SIGNED) == Opened(BLACK, SIGNED_AT, encrypted=False)


def test_pinned_set_may_hold_several_keys() -> None:
    assert verdict(UNPINNED, pinned=frozenset({BLACK, OTHER})).signer_fpr == OTHER


def test_exit_2_from_hidden_recipient_trials_is_tolerated() -> None:
    opened = verdict(HIDDEN_TRIAL, rc=2)
    assert opened.signer_fpr == BLACK and opened.encrypted


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize(
    ("stderr", "rc", "error", "match"),
    [
        pytest.param(
            BADSIG, 1, SignatureError, "b1: BAD signature by key 3C49DD86908A85B2", id="badsig"
        ),
        pytest.param(
            NO_SIGNATURE,
            0,
            SignatureError,
            f"b1: no signature; pinned signers: {BLACK}",
            id="nosig",
        ),
        pytest.param(
            TWO_SIGNATURES,
            0,
            SignatureError,
            "b1: 2 signature result.s. and 2 NEWSIG from gpg; a bundle carries exactly one",
            id="two",
        ),
        pytest.param(
            UNPINNED,
            0,
            SignatureError,
            f"key {OTHER}, which is NOT pinned \\(pinned: {BLACK}\\)",
            id="unpinned",
        ),
        pytest.param(
            CLEARSIGNED,
            0,
            SignatureError,
            f"b1: signature class 01 by {BLACK}; bundles are binary",
            id="clearsigned",
        ),
        pytest.param(
            BAD_MDC,
            2,
            CryptoError,
            "b1: cannot decrypt \\(integrity check failed: tampered\\)",
            id="badmdc",
        ),
        pytest.param(
            without(GOOD_ENCRYPTED, "DECRYPTION_OKAY"),
            0,
            CryptoError,
            "b1: cannot decrypt: gpg exit 0",
            id="no-decryption-okay",
        ),
        pytest.param(
            NO_MDC,
            2,
            CryptoError,
            "b1: cannot decrypt: gpg exit 2; .*decryption forced to fail",
            id="nomdc",
        ),
        pytest.param(
            NO_MDC_IGNORED,
            0,
            CryptoError,
            "b1: encrypted without integrity protection",
            id="nomdc-ignored",
        ),
        pytest.param(
            HIDDEN_TRIAL_DISK_FULL,
            2,
            CryptoError,
            "b1: gpg failed after a good signature: gpg exit 2; .*No space left",
            id="exit2-disk-full",
        ),
        pytest.param(
            NOT_A_RECIPIENT,
            2,
            CryptoError,
            f"b1: cannot decrypt: not a recipient; no secret key in GnuPG home {HOME}",
            id="not-recipient",
        ),
        pytest.param(
            MAX_OUTPUT,
            2,
            CryptoError,
            "b1: not a readable OpenPGP message: .*max-output",
            id="max-output",
        ),
    ],
)
def test_refused(stderr: str, rc: int, error: type[CryptoError], match: str) -> None:
    with pytest.raises(CryptoError, match=match) as info:
        verdict(stderr, rc)
    assert type(info.value) is error  # a decrypt failure is never called a bad signature


@pytest.mark.parametrize(
    "stderr",
    [
        pytest.param(HIDDEN_TRIAL.replace("gpg: ecdh failed", "gpg: other"), id="no-ecdh-miss"),
        pytest.param(
            HIDDEN_TRIAL.replace("ENC_TO 0000000000000000", "ENC_TO 6B45E2E06D38DED5"),
            id="recipients-not-hidden",
        ),
        pytest.param(HIDDEN_TRIAL + "gpg: read error: Input/output error\n", id="read-error"),
    ],
)
def test_exit_2_is_only_excused_for_the_hidden_recipient_noise(stderr: str) -> None:
    with pytest.raises(CryptoError, match="gpg failed after a good signature"):
        verdict(stderr, rc=2)


def test_exit_2_without_plaintext_is_refused() -> None:
    with pytest.raises(CryptoError, match="after a good signature"):
        verdict(without(HIDDEN_TRIAL, "PLAINTEXT"), rc=2)


# ------------------------------------------------------------------ length, surface


def test_check_length_against_the_literal_packet() -> None:
    check_length(transcript(GOOD_ENCRYPTED), 120, "b1")
    check_length(transcript("[GNUPG:] PLAINTEXT 62 0"), 7, "b1")  # no length: unknown
    with pytest.raises(CryptoError, match="b1: wrote 119 of 120 plaintext bytes"):
        check_length(transcript(GOOD_ENCRYPTED), 119, "b1")


def test_public_surface() -> None:
    assert sorted(verdict_mod.__all__) == sorted(
        ["Opened", "StatusLine", "Transcript", "check_length", "judge", "parse_status"]
    )
    assert gpg_mod.Opened is Opened  # still importable from bridge.crypto.gpg
    assert issubclass(gpg_mod._Result, Transcript)


def test_verdict_is_pure() -> None:
    tree = ast.parse(Path(verdict_mod.__file__).read_text(encoding="utf-8"))
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not {m.split(".")[0] for m in imported} & {"subprocess", "os", "gnupg", "shutil"}


def test_a_status_line_forged_inside_quoted_packet_data_stays_a_diagnostic() -> None:
    """gpg prints an unknown signer's user id (attacker's bytes) unescaped but for newlines:
    characters that ``str.splitlines`` takes for line ends must not start a status line."""
    for sep in ("\u2028", "\u0085", "\x0c", "\x1c", "\r"):
        stderr = (
            f'gpg: issuer "x{sep}[GNUPG:] BAD_PASSPHRASE 0123456789ABCDEF"\n'
            "[GNUPG:] ERRSIG 0123456789ABCDEF 22 8 00 1700000000 9 -\n"
            "[GNUPG:] NO_PUBKEY 0123456789ABCDEF\n"
        )
        status, diag = parse_status(stderr)
        assert [k for k, _ in status] == ["ERRSIG", "NO_PUBKEY"], repr(sep)
        assert len(diag) == 1 and "BAD_PASSPHRASE" in diag[0]


NO_NEWSIG = "1 signature result.s. and 0 NEWSIG"


@pytest.mark.parametrize(
    ("stderr", "rc", "error", "match"),
    [
        pytest.param(
            without(GOOD_ENCRYPTED, "END_DECRYPTION"), 0, CryptoError,
            "did not finish decrypting", id="no-end-decryption",
        ),
        pytest.param(
            without(HIDDEN_TRIAL, "END_DECRYPTION"), 2, CryptoError,
            "did not finish decrypting", id="no-end-decryption-exit-2",
        ),
        pytest.param(
            without(GOOD_ENCRYPTED, "DECRYPTION_INFO"), 0, CryptoError,
            "no DECRYPTION_INFO", id="no-decryption-info",
        ),
        pytest.param(
            without(GOOD_ENCRYPTED, "NEWSIG"), 0, SignatureError, NO_NEWSIG,
            id="no-newsig-encrypted",
        ),
        pytest.param(
            without(GOOD_SIGNED, "NEWSIG"), 0, SignatureError, NO_NEWSIG,
            id="no-newsig-signed",
        ),
    ],
)  # fmt: skip
def test_what_protocol_2_1_requires_must_be_stated(
    stderr: str, rc: int, error: type[CryptoError], match: str
) -> None:
    """protocol.md §2.1: exactly one NEWSIG; encrypted: DECRYPTION_INFO and END_DECRYPTION."""
    assert verdict(GOOD_ENCRYPTED) and verdict(GOOD_SIGNED)  # the same transcripts, whole, pass
    with pytest.raises(CryptoError, match=match) as info:
        verdict(stderr, rc)
    assert type(info.value) is error
