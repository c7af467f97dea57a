"""Diode, UDP (both sides): the link's pre-shared datagram key, made, stored 0600 and checked."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from bridge.crypto.perms import PRIVATE_FILE_MODE, write_file
from bridge.errors import ConfigError
from bridge.protocol.datagram import KEY_LEN

__all__ = ["generate_key_file", "load_key"]


def generate_key_file(path: Path, *, force: bool = False) -> None:
    """Write a fresh random key (64 hex digits) to ``path``, mode 0600; never overwrite unasked."""
    path = Path(path)
    if path.exists() and not force:
        raise ConfigError(
            f"{path} already exists: it may be the key the other side uses; pass --force to "
            "replace it (then copy the new file to both sides)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, secrets.token_hex(KEY_LEN).encode("ascii") + b"\n", mode=PRIVATE_FILE_MODE)


def load_key(path: Path) -> bytes:
    """Read the key file: hex, at least 32 bytes, readable by its owner only (fail fast)."""
    path = Path(path)
    hint = "make one with `diode udp keygen --out FILE` and copy it to both sides"
    try:
        st = os.stat(path)
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"udp.key_file {path} does not exist: {hint}") from None
    except OSError as e:
        raise ConfigError(f"udp.key_file {path} cannot be read ({e.strerror}): {hint}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"udp.key_file {path} is not a regular file: {hint}")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"udp.key_file {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users could "
            f"read the link key; run `chmod 600 {path}`"
        )
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"udp.key_file {path} must hold hex digits only: {hint}") from None
    if len(key) < KEY_LEN:
        raise ConfigError(
            f"udp.key_file {path} holds {len(key)} bytes; at least {KEY_LEN} are needed: {hint}"
        )
    return key
