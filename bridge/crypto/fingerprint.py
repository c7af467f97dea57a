"""Crypto: the one rule for OpenPGP fingerprints in config and on the gpg command line."""

from __future__ import annotations

import re

from bridge.errors import CryptoError

__all__ = ["FINGERPRINT_RE", "normalize_fingerprint"]

FINGERPRINT_RE = re.compile(r"[0-9A-F]{40}|[0-9A-F]{64}")
"""A full v4 (40 hex) or v5 (64 hex) fingerprint; never a short key id or a user id."""


def normalize_fingerprint(value: str, *, what: str = "fingerprint") -> str:
    """Uppercase, space-free full fingerprint, or CryptoError (never a short key id or name)."""
    fpr = value.replace(" ", "").upper()
    if not FINGERPRINT_RE.fullmatch(fpr):  # fullmatch: "$" would accept a trailing newline
        raise CryptoError(
            f"{what}: {value!r} is not a full OpenPGP fingerprint (40 or 64 hex digits); "
            "`diode keys init` prints them, `gpg --list-keys --with-colons` shows them"
        )
    return fpr
