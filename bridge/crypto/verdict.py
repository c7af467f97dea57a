"""Crypto: read gpg's status lines and judge whether red may accept a decrypted message.

Pure logic, no gpg run: ``parse_status`` splits gpg's stderr (``--status-fd 2``) into
status lines and diagnostics, ``judge`` turns that transcript into an ``Opened`` or an
error, ``check_length`` compares the plaintext written with what the literal packet said.

A message is accepted only when gpg reports, in this order of checks:

- no BADSIG anywhere (tampered content);
- if encrypted: DECRYPTION_OKAY and END_DECRYPTION, and integrity protection (MDC or AEAD)
  as DECRYPTION_INFO states it;
- exactly one signature (one GOODSIG/…SIG result, exactly one NEWSIG);
- that signature GOOD (not ERRSIG, expired or revoked) with a VALIDSIG;
- the VALIDSIG primary-key fingerprint in the pinned set, signature class 00 (binary);
- a PLAINTEXT packet and exit 0 — or exit 2 caused only by trying our key on another
  recipient's hidden (``--throw-keyids``) ECDH slot, with no other error logged.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bridge.errors import CryptoError, SignatureError

__all__ = ["Opened", "StatusLine", "Transcript", "check_length", "judge", "parse_status"]

StatusLine = tuple[str, list[str]]
"""One ``[GNUPG:] KEYWORD arg…`` line: the keyword and its space-separated arguments."""

_STATUS_PREFIX = "[GNUPG:] "
_HIDDEN_TRIAL_ERROR = "ecdh failed in gcry_cipher_decrypt: Checksum error"
_FATAL_MARKERS = (
    "error writing",
    "error closing",
    "error flushing",
    "max-output",
    "handle plaintext failed",
    "no space left",
    "read error",
    "invalid packet",
    "unexpected",
    "premature",
    "crc error",
)
_SIG_RESULTS = ("GOODSIG", "BADSIG", "EXPSIG", "EXPKEYSIG", "REVKEYSIG", "ERRSIG")
_REASON_CODES = ("FAILURE", "ERROR", "INV_RECP", "INV_SGNR", "NO_SGNR", "KEY_NOT_CREATED")


@dataclass(frozen=True)
class Opened:
    """What red learned from a bundle that passed verification."""

    signer_fpr: str
    """Primary-key fingerprint of the (pinned) signer."""
    signed_at: datetime
    """Signature creation time, UTC."""
    encrypted: bool
    """False for a signed-only message (a channel that opted out of encryption)."""


@dataclass
class Transcript:
    """What one gpg run said: exit code, status lines, other stderr lines."""

    rc: int
    status: list[StatusLine] = field(default_factory=list)
    diag: list[str] = field(default_factory=list)

    def has(self, keyword: str) -> bool:
        return any(k == keyword for k, _ in self.status)

    def all(self, keyword: str) -> list[list[str]]:
        return [a for k, a in self.status if k == keyword]

    def first(self, keyword: str) -> list[str] | None:
        found = self.all(keyword)
        return found[0] if found else None

    def reason(self) -> str:
        """gpg's own words: FAILURE/ERROR/INV_* status lines and the last diagnostics."""
        codes = [f"{k} {' '.join(a)}" for k, a in self.status if k in _REASON_CODES]
        lines = [d.removeprefix("gpg: ") for d in self.diag if d.strip()][-4:]
        parts = [f"gpg exit {self.rc}"] + codes + lines
        return "; ".join(parts)


def parse_status(stderr: str) -> tuple[list[StatusLine], list[str]]:
    """Split gpg's stderr into ``[GNUPG:]`` status lines and the other (diagnostic) lines.

    Lines end at ``\n`` only: gpg quotes packet data in its diagnostics (an unknown signer's
    ``issuer "..."``) without escaping U+2028, U+0085 or a form feed, which ``str.splitlines``
    would take for line ends, so a hostile file could forge a status line."""
    status: list[StatusLine] = []
    diag: list[str] = []
    for raw in stderr.split("\n"):
        raw = raw.removesuffix("\r")
        if not raw:
            continue
        if raw.startswith(_STATUS_PREFIX):
            words = raw[len(_STATUS_PREFIX) :].split(" ")
            status.append((words[0], words[1:]))
        else:
            diag.append(raw)
    return status, diag


def judge(res: Transcript, pinned: AbstractSet[str], what: str, *, home: Path | str) -> Opened:
    """Decide from gpg's status lines; the order goes from most to least specific.

    ``pinned`` holds normalized primary fingerprints; ``what`` names the message and
    ``home`` the GnuPG home in error messages. Raises SignatureError for a bad, missing,
    extra or unpinned signature, CryptoError for anything else.
    """
    encrypted = any(
        res.has(k) for k in ("ENC_TO", "BEGIN_DECRYPTION", "NO_SECKEY", "DECRYPTION_FAILED")
    )
    sigs = [(k, a) for k, a in res.status if k in _SIG_RESULTS]
    pinned_txt = ", ".join(sorted(pinned))
    for k, a in sigs:
        if k == "BADSIG":
            raise SignatureError(
                f"{what}: BAD signature by key {a[0] if a else '?'}: the content was "
                "altered after signing (tampered or corrupted in transit)"
            )
    if encrypted and not res.has("DECRYPTION_OKAY"):
        nosec = [a[0] for a in res.all("NO_SECKEY") if a]
        if nosec and not res.has("DECRYPTION_KEY"):
            shown = ", ".join(sorted(set(nosec)))
            raise CryptoError(
                f"{what}: cannot decrypt: not a recipient; no secret key in GnuPG home "
                f"{home} opens it (recipient key ids: {shown}; all zeros means "
                "hidden recipients). Is this red key listed in the channel's recipients?"
            )
        bad = " (integrity check failed: tampered)" if res.has("BADMDC") else ""
        raise CryptoError(
            f"{what}: cannot decrypt{bad}: {res.reason()}; garbage, truncated or tampered"
        )
    info = res.first("DECRYPTION_INFO")
    if encrypted and info is None:
        raise CryptoError(
            f"{what}: gpg decrypted it but stated no DECRYPTION_INFO: its integrity protection "
            "(MDC/AEAD) is not confirmed"
        )
    if encrypted and info is not None and info[0] == "0" and (len(info) < 3 or info[2] == "0"):
        if res.has("GOODMDC"):  # GnuPG 2.2 reading OCB: "DECRYPTION_INFO 0 <cipher> 0"
            raise CryptoError(
                f"{what}: encrypted with OCB (LibrePGP AEAD), which this gpg (GnuPG 2.2) "
                "decrypts without confirming the integrity protection in DECRYPTION_INFO: "
                "rejected. Black's gpg (2.3+) chose OCB because the red key advertises the AEAD "
                "feature: update that key's preferences and import it on black again (runbook: "
                "GnuPG releases; black's `diode check` names the keys), or run red on GnuPG 2.4"
            )
        raise CryptoError(f"{what}: encrypted without integrity protection (no MDC/AEAD)")
    if not sigs:
        if res.rc != 0 or not res.has("PLAINTEXT"):
            raise CryptoError(
                f"{what}: not a readable OpenPGP message: {res.reason()}; "
                "garbage or truncated input"
            )
        raise SignatureError(f"{what}: no signature; pinned signers: {pinned_txt}")
    newsig = len(res.all("NEWSIG"))
    if len(sigs) > 1 or newsig != 1:
        raise SignatureError(
            f"{what}: {len(sigs)} signature result(s) and {newsig} NEWSIG from gpg; a bundle "
            "carries exactly one signature (by a pinned key)"
        )
    kind, a = sigs[0]
    if kind == "ERRSIG":
        rc = a[5] if len(a) > 5 else "?"
        issuer = a[6] if len(a) > 6 and a[6] != "-" else (a[0] if a else "?")
        if rc == "9" or res.has("NO_PUBKEY"):
            raise SignatureError(
                f"{what}: signed by unknown key {issuer} (not in GnuPG home {home}); "
                f"pinned signers: {pinned_txt}"
            )
        raise SignatureError(f"{what}: cannot check signature by {issuer}: {res.reason()}")
    if kind in ("EXPKEYSIG", "REVKEYSIG", "EXPSIG"):
        state = {
            "EXPKEYSIG": "expired key",
            "REVKEYSIG": "revoked key",
            "EXPSIG": "expired signature",
        }
        raise SignatureError(f"{what}: signature by {state[kind]} {a[0] if a else '?'}")
    valid = res.first("VALIDSIG")
    if valid is None or len(valid) < 10:
        raise SignatureError(f"{what}: good signature but no VALIDSIG from gpg: {res.reason()}")
    primary = valid[9].upper()
    if primary not in pinned:
        raise SignatureError(
            f"{what}: valid signature by key {primary}, which is NOT pinned "
            f"(pinned: {pinned_txt}); if this black key is legitimate add it to "
            "link.black_signers"
        )
    if valid[8] != "00":
        raise SignatureError(
            f"{what}: signature class {valid[8]} by {primary}; bundles are binary "
            "signed messages (class 00), not clearsigned text"
        )
    if encrypted and not res.has("END_DECRYPTION"):
        raise CryptoError(f"{what}: gpg did not finish decrypting (no END_DECRYPTION)")
    if not res.has("PLAINTEXT") or (res.rc != 0 and not _only_hidden_key_trials(res)):
        raise CryptoError(f"{what}: gpg failed after a good signature: {res.reason()}")
    return Opened(signer_fpr=primary, signed_at=_sig_time(valid[2]), encrypted=encrypted)


def check_length(res: Transcript, written: int, what: str) -> None:
    """The plaintext written must be as long as the literal packet said (catches ENOSPC)."""
    declared = res.first("PLAINTEXT_LENGTH")
    if declared and declared[0].isdigit() and int(declared[0]) != written:
        raise CryptoError(
            f"{what}: wrote {written} of {declared[0]} plaintext bytes (disk full?); "
            "free space and retry"
        )


def _only_hidden_key_trials(res: Transcript) -> bool:
    """True when gpg's non-zero exit only reflects trying our key on another's hidden slot.

    With ``--throw-keyids`` gpg tries each secret key on each anonymous ECDH recipient
    packet; a miss logs "ecdh failed ... Checksum error" and makes gpg exit 2 although
    the message then decrypts and verifies (the plain gpg CLI exits 2 as well). Any other
    error (disk full, max-output, bad packets) still fails the bundle.
    """
    hidden_ecdh = any(a[:2] == ["0000000000000000", "18"] for a in res.all("ENC_TO"))
    missed = any(_HIDDEN_TRIAL_ERROR in d for d in res.diag)
    fatal = any(m in d.lower() for d in res.diag for m in _FATAL_MARKERS)
    done = res.has("DECRYPTION_OKAY") and res.has("END_DECRYPTION")
    return hidden_ecdh and missed and done and not fatal


def _sig_time(value: str) -> datetime:
    """VALIDSIG's timestamp: seconds since the epoch, or ISO 8601 ``YYYYMMDDThhmmss``."""
    if "T" in value:
        return datetime.strptime(value, "%Y%m%dT%H%M%S").replace(tzinfo=UTC)
    return datetime.fromtimestamp(int(value), tz=UTC)
