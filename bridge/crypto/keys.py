"""Crypto: create the black and red GnuPG homes and the pinned fingerprints for the config.

Layout written by ``init_keys`` (``diode keys init``)::

    keys_dir/black/   black signing key (secret) + every red public key
    keys_dir/red/     red decryption key(s) (secret) + the pinned black public key
    keys_dir/pub/     black.asc, <red name>.asc: public keys to carry across

Keys have NO passphrase: the bridge runs unattended, so their protection is the 0700
home folder (keep it on an encrypted disk, readable only by the service account).
Passphrase-protected keys work with ``Gpg.seal(..., passphrase_file=...)`` once imported.
Keys never expire (an expiry would silently stop the link); rotate them by running
``init_keys`` again with ``force=True`` and redeploying the public keys and config.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bridge.crypto.gpg import Gpg
from bridge.errors import CryptoError
from bridge.fsutil import atomic_write_bytes

__all__ = ["KeyInventory", "init_keys", "generate_key", "Algo"]

Algo = Literal["ed25519", "rsa"]

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# primary algorithm, encryption subkey algorithm
_ALGOS: dict[str, tuple[str, str]] = {
    "ed25519": ("ed25519", "cv25519"),
    "rsa": ("rsa3072", "rsa3072"),  # 128-bit security; 4096 only costs generation time
}


@dataclass(frozen=True)
class KeyInventory:
    """What ``init_keys`` created: homes, fingerprints, and where the public keys are."""

    black_home: Path
    red_home: Path
    black_fpr: str
    red_fprs: dict[str, str] = field(default_factory=dict)
    pub_dir: Path = Path("keys/pub")

    def to_toml_snippet(self) -> str:
        """Config lines to paste into ``conf/diode.toml`` (both sides share them)."""
        recipients = ", ".join(f'"{f}"' for f in self.red_fprs.values())
        names = ", ".join(self.red_fprs)
        return "\n".join(
            [
                "[link]",
                f'black_signers = ["{self.black_fpr}"]',
                "",
                "[black]",
                f'gnupg_home = "{self.black_home}"',
                f'signing_key = "{self.black_fpr}"',
                "",
                "[red]",
                f'gnupg_home = "{self.red_home}"',
                "",
                "[[channels]]",
                'name = "default"',
                f"# red keys: {names}",
                f"recipients = [{recipients}]",
                "",
            ]
        )


def generate_key(
    gpg: Gpg, uid: str, *, role: Literal["sign", "encrypt"], algo: Algo = "ed25519"
) -> str:
    """Create one passphrase-less key in ``gpg``'s home; returns its primary fingerprint.

    ``sign``: a signing primary key (black). ``encrypt``: a certify-only primary key
    with one encryption subkey (red never signs anything).
    """
    if algo not in _ALGOS:
        raise CryptoError(f"unknown key algorithm {algo!r}; choose one of {sorted(_ALGOS)}")
    primary, sub = _ALGOS[algo]
    if role == "sign":
        return gpg.quick_gen_key(uid, algo=primary, usage="sign")
    fpr = gpg.quick_gen_key(uid, algo=primary, usage="cert")
    gpg.quick_add_key(fpr, algo=sub, usage="encr")
    return fpr


def _kill_agent(home: Path) -> None:
    subprocess.run(
        ["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"],
        capture_output=True,
        check=False,
    )


def _occupied(home: Path) -> bool:
    return home.exists() and (not home.is_dir() or any(home.iterdir()))


def init_keys(
    keys_dir: Path,
    *,
    red_names: Sequence[str] = ("red",),
    algo: Algo = "ed25519",
    bridge_id: str = "diode-bridge",
    force: bool = False,
) -> KeyInventory:
    """Create black and red GnuPG homes under ``keys_dir`` with cross-imported public keys.

    Refuses (CryptoError) to touch an existing, non-empty home unless ``force=True``,
    which destroys the old secret keys for good.
    """
    names = list(red_names)
    bad = [n for n in names if not _NAME_RE.match(n)]
    if not names or bad or len(set(names)) != len(names):
        raise CryptoError(
            f"red names must be unique, non-empty, lowercase letters/digits/'-'/'_' "
            f"(they become pub/<name>.asc); got {names!r}"
        )
    if algo not in _ALGOS:
        raise CryptoError(f"unknown key algorithm {algo!r}; choose one of {sorted(_ALGOS)}")
    keys_dir = Path(keys_dir)
    black_home, red_home, pub_dir = keys_dir / "black", keys_dir / "red", keys_dir / "pub"
    existing = [h for h in (black_home, red_home) if _occupied(h)]
    if existing and not force:
        shown = ", ".join(str(h) for h in existing)
        raise CryptoError(
            f"refusing to overwrite existing GnuPG home(s) {shown}: they may hold the only "
            "copy of a secret key. Move them away first, or re-run with force=True "
            "(`diode keys init --force`) to destroy them and create new keys"
        )
    for home in existing:
        _kill_agent(home)
        shutil.rmtree(home)

    keys_dir.mkdir(parents=True, exist_ok=True)
    created: list[Path] = []
    try:
        for home in (black_home, red_home):
            created.append(home)
            home.mkdir(mode=0o700)
            home.chmod(0o700)
        black, red = Gpg(black_home), Gpg(red_home)
        black_fpr = generate_key(black, f"{bridge_id} black signer", role="sign", algo=algo)
        red_fprs = {
            n: generate_key(red, f"{bridge_id} red {n}", role="encrypt", algo=algo) for n in names
        }
        pub_dir.mkdir(parents=True, exist_ok=True)
        black_pub = black.export_public(black_fpr)
        atomic_write_bytes(pub_dir / "black.asc", black_pub.encode("ascii"))
        for n, fpr in red_fprs.items():
            red_pub = red.export_public(fpr)
            atomic_write_bytes(pub_dir / f"{n}.asc", red_pub.encode("ascii"))
            black.import_keys(red_pub)
        red.import_keys(black_pub)
    except BaseException:
        for home in created:
            _kill_agent(home)
            shutil.rmtree(home, ignore_errors=True)
        raise
    return KeyInventory(
        black_home=black_home,
        red_home=red_home,
        black_fpr=black_fpr,
        red_fprs=red_fprs,
        pub_dir=pub_dir,
    )
