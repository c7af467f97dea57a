"""Crypto (both sides): each side creates its own keys, imports the other's public keys, and
opens its configured keys at startup.

On a real install the secret keys never leave their host::

    black host: diode keys init --side black --home keys/black    -> keys/pub/black.asc
    red host:   diode keys init --side red --name ops --home keys/red -> keys/pub/ops.asc
    carry the .asc files across (public keys only), then
    black host: diode keys import --home keys/black ops.asc       (a recipient)
    red host:   diode keys import --home keys/red black.asc       (the signer to pin)

Every command prints the config lines that pin full fingerprints. Keys never expire (an
expiry would silently stop the link). By default they have no passphrase (the bridge runs
unattended; the 0700 home on an encrypted disk protects them); with a ``Passphrase`` they are
protected, and the running side reads it from a file or the environment
(``bridge.crypto.passphrase``). ``signing_gpg`` / ``decryption_gpg`` check at startup, with a
test signature or decryption, that the configured keys can be used unattended.

``init_keys`` creates BOTH sides in one folder: for the demo and tests on one machine only.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from bridge.config import Config
from bridge.crypto.fingerprint import normalize_fingerprint
from bridge.crypto.gpg import Gpg, check_gpg_binary, gnupg_tool
from bridge.crypto.passphrase import Passphrase, resolve_passphrase
from bridge.crypto.perms import (
    PUBLIC_FILE_MODE,
    check_dir_path,
    lock_down_home,
    permission_problems,
    write_file,
)
from bridge.errors import ConfigError, CryptoError, KeyMissingError

__all__ = [
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
]

log = logging.getLogger(__name__)

Algo = Literal["ed25519", "rsa"]
Side = Literal["black", "red"]

DEFAULT_GPG = "gpg"
"""The gpg run when none is configured or passed: ``gpg`` from PATH."""

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# primary algorithm, encryption subkey algorithm
_ALGOS: dict[str, tuple[str, str]] = {
    "ed25519": ("ed25519", "cv25519"),
    "rsa": ("rsa3072", "rsa3072"),  # 128-bit security; 4096 only costs generation time
}
_MAX_KEY_FILE = 4 * 1024 * 1024  # a public key (even RSA with many signatures) is far smaller


def toml_str(value: object) -> str:
    """A TOML basic string: quote, backslash and control characters escaped, the rest raw."""
    out = []
    for ch in str(value):
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _check_algo(algo: str) -> None:
    if algo not in _ALGOS:
        raise CryptoError(f"unknown key algorithm {algo!r}; choose one of {sorted(_ALGOS)}")


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise CryptoError(
            f"red key name {name!r}: use lowercase letters, digits, '-' and '_' (max 63); it "
            "becomes <name>.asc"
        )


def generate_key(
    gpg: Gpg, uid: str, *, role: Literal["sign", "encrypt"], algo: Algo = "ed25519"
) -> str:
    """Create one key in ``gpg``'s home; returns its primary fingerprint.

    ``sign``: a signing primary key (black). ``encrypt``: a certify-only primary key with one
    encryption subkey (red never signs anything). Protected by ``gpg.passphrase`` if set.
    """
    _check_algo(algo)
    primary, sub = _ALGOS[algo]
    if role == "sign":
        return gpg.quick_gen_key(uid, algo=primary, usage="sign")
    fpr = gpg.quick_gen_key(uid, algo=primary, usage="cert")
    gpg.quick_add_key(fpr, algo=sub, usage="encr")
    return fpr


def _uid(side: Side, bridge_id: str, name: str) -> str:
    return f"{bridge_id} black signer" if side == "black" else f"{bridge_id} red {name}"


# ---------------------------------------------------------------------------- one side's keys


@dataclass(frozen=True)
class SideKeys:
    """What ``init_side`` created: one secret key in ``home``, its public key in a file."""

    side: Side
    name: str
    home: Path
    fpr: str
    public_file: Path
    passphrase: Passphrase | None = None
    binary: str = DEFAULT_GPG
    """The gpg that made it (``<side>.gpg_binary`` when not the default: a home made by one
    GnuPG release is used by the same)."""

    def to_toml_snippet(self) -> str:
        """Config lines that pin this key (fingerprints, never key ids)."""
        home = toml_str(self.home.resolve())
        pp: list[str] = []
        if self.binary != DEFAULT_GPG:  # a path as an absolute one: configs live elsewhere
            gpg = str(Path(self.binary).resolve()) if os.sep in self.binary else self.binary
            pp.append(f"gpg_binary = {toml_str(gpg)}")
        if self.passphrase is not None and self.passphrase.path is not None:
            pp.append(f"passphrase_file = {toml_str(self.passphrase.path.resolve())}")
        elif self.passphrase is not None:
            pp.append(f"passphrase_env = {toml_str(self.passphrase.env_name)}")
        if self.side == "black":
            lines = [
                "# on BOTH sides: red lands only bundles signed by a pinned key",
                "[link]",
                f"black_signers = [{toml_str(self.fpr)}]",
                "",
                "# black host",
                "[black]",
                f"gnupg_home = {home}",
                f"signing_key = {toml_str(self.fpr)}",
                *pp,
            ]
        else:
            lines = [
                "# red host",
                "[red]",
                f"gnupg_home = {home}",
                *pp,
                "",
                f"# on BOTH sides: add to `recipients` of every channel red key {self.name!r} "
                "may read",
                "[[channels]]",
                'name = "default"',
                f"recipients = [{toml_str(self.fpr)}]",
            ]
        return "\n".join([*lines, ""])


def _secret_roles(gpg: Gpg) -> dict[str, tuple[str, str]]:
    """fingerprint -> (capabilities, first uid) of every secret key in the home.

    The capabilities are gpg's letters for the whole key (upper case: usable now) followed
    by each secret subkey's own letters (lower case, whatever its validity): a revoked or
    expired red key shows only ``c`` for the whole key, its ``e`` is on its subkey.
    """
    public = {str(k["fingerprint"]).upper(): k for k in gpg._list(secret=False)}
    out = {}
    for k in gpg._list(secret=True):
        fpr = str(k["fingerprint"]).upper()
        pub = public.get(fpr, k)
        uids = pub.get("uids")
        first = uids[0] if isinstance(uids, list) and uids else ""
        subs = k.get("subkey_info")
        sub_caps = (
            [str(i.get("cap") or "") for i in subs.values()] if isinstance(subs, dict) else []
        )
        out[fpr] = (str(pub.get("cap") or "") + "".join(sub_caps).lower(), str(first))
    return out


def _is_red(caps: str) -> bool:
    """Whether a secret key with capability letters ``caps`` (``_secret_roles``) is red's.

    Black's key is a signing key without any encryption (sub)key; anything else is red's: an
    ``e`` in any case (upper: usable; lower: revoked or expired, still red's secret), or a
    key that cannot sign. Letter case is ignored: a revoked black key is still black's.
    """
    letters = caps.lower()
    return "e" in letters or "s" not in letters


def _secret_kind(caps: str) -> str:
    """Words for a secret key that has no business in black's home (for messages)."""
    if "E" in caps:
        return "a red key: can decrypt"
    if "e" in caps.lower():
        return "a red key, revoked or expired"
    return f"not black.signing_key; capabilities {caps!r}"


def _extra_secrets_message(gpg: Gpg, fpr: str, others: dict[str, str]) -> str:
    """Why black refuses a home holding secret keys besides ``fpr`` (fingerprint ->
    capabilities), with the fix for each kind: red's go back to red, a second black signing
    key (an old one kept after a rotation) to offline storage."""
    shown = ", ".join(f"{f} ({_secret_kind(caps)})" for f, caps in others.items())
    fixes = []
    if any(_is_red(caps) for caps in others.values()):
        fixes.append(
            "black must hold no red secret key (revoked or expired ones included): keep "
            "them on red only"
        )
    if not all(_is_red(caps) for caps in others.values()):
        fixes.append(
            "a second black signing key (an old one after a rotation?) must not stay where "
            "the job signs: red trusts only the fingerprints link.black_signers pins, so keep "
            f"it offline (`{gpg.binary} --homedir {gpg.home} --export-secret-keys FPR` to "
            "removable media)"
        )
    return (
        f"black GnuPG home {gpg.home} holds secret key(s) besides black.signing_key {fpr}: "
        f"{shown}. {'; '.join(fixes)}; then delete them here "
        f"(`{gpg.binary} --homedir {gpg.home} --delete-secret-keys FPR`)"
    )


def _delete_secret_key(gpg: Gpg, fpr: str) -> None:
    res = gpg._run(["--yes", "--delete-secret-and-public-keys", "--", fpr])
    if res.rc != 0:
        raise CryptoError(f"cannot delete key {fpr} from GnuPG home {gpg.home}: {res.reason()}")


def init_side(
    side: Side,
    home: Path,
    *,
    name: str = "red",
    pub_dir: Path | None = None,
    algo: Algo = "ed25519",
    bridge_id: str = "diode-bridge",
    passphrase: Passphrase | None = None,
    force: bool = False,
    binary: str = DEFAULT_GPG,
) -> SideKeys:
    """Create this side's secret key in ``home`` and export its public key (mode 0644).

    black: the signing key, exported to ``pub_dir/black.asc``. red: decryption key ``name``,
    exported to ``pub_dir/<name>.asc``. ``pub_dir`` defaults to ``home/../pub``. The home is
    left 0700 with its files 0600.

    Refuses (CryptoError) to create a second black signing key, a red key whose name exists,
    or any key in a home holding the OTHER side's secret keys (red secrets never sit on black,
    nor black's on red; revoked or expired ones included). ``force`` deletes the conflicting
    key of the same side once the new one exists: it is gone for good. ``binary``: the gpg to
    run (its gpgconf too). A gpg-agent this call started for ``home`` is stopped when it returns.
    """
    if side not in ("black", "red"):
        raise CryptoError(f"side must be 'black' or 'red', got {side!r}")
    _check_algo(algo)
    if side == "red":
        _check_name(name)
    home = Path(home)
    pub_dir = Path(pub_dir) if pub_dir is not None else home.parent / "pub"
    check_dir_path(pub_dir, what="public key directory (--pub-dir)")
    with _stopping_agent(home, binary):
        return _init_side(side, home, name, pub_dir, algo, bridge_id, passphrase, force, binary)


def _init_side(
    side: Side,
    home: Path,
    name: str,
    pub_dir: Path,
    algo: Algo,
    bridge_id: str,
    passphrase: Passphrase | None,
    force: bool,
    binary: str,
) -> SideKeys:
    fresh = not home.exists() and not home.is_symlink()
    gpg = Gpg(home, binary=binary, passphrase=passphrase)
    uid = _uid(side, bridge_id, name)
    other = "red" if side == "black" else "black"
    conflicting: list[str] = []  # "FPR ('uid')" of this side's keys that would be replaced
    conflicting_fprs: list[str] = []
    for fpr, (caps, key_uid) in _secret_roles(gpg).items():
        if _is_red(caps) == (side == "black"):  # revoked or expired keys count too
            raise CryptoError(
                f"GnuPG home {home} holds the {other} secret key {fpr} ({key_uid!r}): each "
                f"side keeps its keys on its own host, in its own home. Use another --home for "
                f"the {side} key, and move the {other} key to the {other} host"
            )
        if side == "black" or key_uid == uid:
            conflicting.append(f"{fpr} ({key_uid!r})")
            conflicting_fprs.append(fpr)
    if conflicting and not force:
        raise CryptoError(
            f"refusing to overwrite: GnuPG home {home} already holds {side} secret key "
            f"{', '.join(conflicting)}; it may be the only copy. Move the home "
            "away, use another --home, or re-run with --force to destroy them and create a "
            "new key (then redeploy its public key and the pinned fingerprint)"
        )
    try:
        fpr = generate_key(gpg, uid, role="sign" if side == "black" else "encrypt", algo=algo)
        public = pub_dir / ("black.asc" if side == "black" else f"{name}.asc")
        write_file(public, gpg.export_public(fpr).encode("ascii"), mode=PUBLIC_FILE_MODE)
        for old in conflicting_fprs:  # only once the new key exists
            _delete_secret_key(gpg, old)
        lock_down_home(home)
    except BaseException:
        if fresh:  # never remove a home we did not create
            _kill_agent(home, binary)
            shutil.rmtree(home, ignore_errors=True)
        raise
    return SideKeys(side, name, home, fpr, public, passphrase, binary)


# ---------------------------------------------------------------------------- public keys


@dataclass(frozen=True)
class ImportedKey:
    """A public key found in an imported file."""

    fpr: str
    uids: tuple[str, ...]
    capabilities: str
    """gpg's capability letters of the whole key: S sign, E encrypt, C certify."""
    validity: str
    """gpg's validity letter: 'r' revoked, 'e' expired, else usable."""
    source: Path

    @property
    def role(self) -> str:
        """'signer' (a black key to pin), 'recipient' (a red key) or 'unusable'."""
        if self.validity in ("r", "e", "i", "d"):
            return "unusable"
        if "E" in self.capabilities:
            return "recipient"
        return "signer" if "S" in self.capabilities else "unusable"


@dataclass
class _Primary:
    caps: str
    validity: str
    fpr: str = ""
    uids: list[str] = field(default_factory=list)


def _show_keys(gpg: Gpg, data: bytes, source: Path) -> list[ImportedKey]:
    """Parse a key file without importing it; CryptoError if it holds any secret key."""
    if b"PRIVATE KEY BLOCK" in data:
        raise CryptoError(_secret_refusal(source, []))
    res = gpg._run(["--with-colons", "--show-keys"], data=data)
    primaries: list[_Primary] = []
    secret: list[str] = []
    fpr_of: _Primary | None = None  # the primary whose fpr record comes next
    for line in res.stdout.decode("utf-8", "replace").splitlines():
        f = line.split(":")
        kind = f[0]
        if kind in ("sec", "ssb"):
            secret.append(f[4] if len(f) > 4 else "?")
        if kind in ("pub", "sec") and len(f) > 11:
            fpr_of = _Primary(caps=f[11], validity=f[1])
            primaries.append(fpr_of)
        elif kind in ("sub", "ssb"):
            fpr_of = None
        elif kind == "fpr" and fpr_of is not None and len(f) > 9:
            fpr_of.fpr, fpr_of = f[9].upper(), None
        elif kind == "uid" and primaries and len(f) > 9:
            primaries[-1].uids.append(f[9])
    keys = [
        ImportedKey(k.fpr, tuple(k.uids), k.caps, k.validity, source) for k in primaries if k.fpr
    ]
    if secret:
        raise CryptoError(_secret_refusal(source, secret))
    if not keys:
        raise CryptoError(
            f"{source}: no OpenPGP public key found ({res.reason()}); pass an exported public "
            "key such as black.asc or <red name>.asc"
        )
    return keys


def _secret_refusal(source: Path, ids: Sequence[str]) -> str:
    shown = f" ({', '.join(ids)})" if ids else ""
    return (
        f"{source} contains SECRET key material{shown}: refusing to import it (nothing was "
        "imported). Carry only public keys across: `diode keys init` writes them, or "
        "`gpg --armor --export FPR`. A secret key that left its host should be treated as "
        "exposed: create a new one"
    )


def import_public_keys(
    home: Path, files: Iterable[Path], *, binary: str = DEFAULT_GPG
) -> list[ImportedKey]:
    """Import public keys from ``files`` into ``home``; returns what they held.

    Every file is checked before anything is imported: a file holding secret key material,
    or no key at all, makes the whole call fail (CryptoError) with nothing imported.
    ``binary``: the gpg to run (its gpgconf too). A gpg-agent this call started for ``home``
    is stopped when it returns.
    """
    with _stopping_agent(Path(home), binary):
        return _import_public_keys(Gpg(Path(home), binary=binary), files)


def _import_public_keys(gpg: Gpg, files: Iterable[Path]) -> list[ImportedKey]:
    found: list[tuple[bytes, list[ImportedKey]]] = []
    for path in (Path(f) for f in files):
        try:
            size = path.stat().st_size
            if size > _MAX_KEY_FILE:
                raise CryptoError(f"{path}: {size} bytes is too large for a public key file")
            data = path.read_bytes()
        except OSError as e:
            raise CryptoError(f"cannot read key file {path}: {e.strerror}") from None
        found.append((data, _show_keys(gpg, data, path)))
    if not found:
        raise CryptoError("no key files given: pass one or more exported public keys (.asc)")
    out: list[ImportedKey] = []
    for data, keys in found:
        gpg.import_keys(data)
        out.extend(keys)
    lock_down_home(gpg.home)
    return out


def import_snippet(keys: Sequence[ImportedKey]) -> str:
    """Config lines that pin imported keys: black signers and red recipients."""
    signers = [k.fpr for k in keys if k.role == "signer"]
    recipients = [k.fpr for k in keys if k.role == "recipient"]
    lines: list[str] = []
    if signers:
        lines += [
            "# black signing key(s): pin on BOTH sides",
            "[link]",
            f"black_signers = [{', '.join(toml_str(f) for f in signers)}]",
            "",
        ]
    if recipients:
        lines += [
            "# red key(s): add to `recipients` of every channel they may read",
            "[[channels]]",
            'name = "default"',
            f"recipients = [{', '.join(toml_str(f) for f in recipients)}]",
            "",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- at startup


def _gpg_binary(cfg: Config, side: Side) -> str:
    """``<side>.gpg_binary``, checked (``check_gpg_binary``: ConfigError naming the key and the
    fix) when the config sets it; unset, ``gpg`` from PATH runs unchecked, as it always did."""
    sect = cfg.black if side == "black" else cfg.red
    if "gpg_binary" in sect.model_fields_set:
        check_gpg_binary(sect.gpg_binary, key=f"{side}.gpg_binary")
    return sect.gpg_binary


def _side_gpg(cfg: Config, side: Side, environ: Mapping[str, str] | None) -> Gpg:
    """A Gpg of ``side``'s home, binary and passphrase."""
    sect = cfg.black if side == "black" else cfg.red
    passphrase = resolve_passphrase(
        file=sect.passphrase_file, env_name=sect.passphrase_env, side=side, environ=environ
    )
    return Gpg(Path(sect.gnupg_home), binary=sect.gpg_binary, passphrase=passphrase)


def _passphrase_fix(cfg: Config, side: Side) -> str:
    sect = cfg.black if side == "black" else cfg.red
    env = sect.passphrase_env or f"DIODE_{side.upper()}_PASSPHRASE"
    return (
        f"write it as one line to a file readable only by the service account (chmod 600) "
        f"and set {side}.passphrase_file to its path, or export it in {env} "
        f"({side}.passphrase_env); never put it in the config or on a command line"
    )


def _warn_permissions(cfg: Config, side: Side) -> None:
    for problem in permission_problems(cfg, side=side):
        log.warning("%s", problem)


def signing_gpg(
    cfg: Config, *, environ: Mapping[str, str] | None = None, one_shot: bool = False
) -> Gpg:
    """Black's GnuPG home with the signing key unlocked; fails fast on anything to fix.

    Checks: the signing key is configured, present and can sign; the home holds no other
    secret key (a red key, revoked or expired ones too); a protected key has a passphrase
    that works (a test signature); every encrypted channel's recipients are present and can
    encrypt (``_require_recipients``). Loose permissions are logged as warnings (``diode keys
    check`` fails on them). ``one_shot`` (a check, not the black job): a gpg-agent this
    call started is stopped when it returns.
    """
    if not cfg.black.signing_key:
        raise ConfigError(
            "black.signing_key is empty: run `diode keys init --side black` on the black host "
            "and paste the fingerprint it prints"
        )
    binary = _gpg_binary(cfg, "black")
    with _agent_scope(Path(cfg.black.gnupg_home), binary, one_shot=one_shot):
        return _signing_gpg(cfg, environ)


def _signing_key_missing_message(home: Path, fpr: str, held: dict[str, tuple[str, str]]) -> str:
    """Why black.signing_key ``fpr`` is not usable when the home holds other secret keys
    (fingerprint -> (capabilities, uid)): listed, so a wrong fingerprint is fixed in the
    config (``diode keys init`` would refuse a home that already holds a key)."""
    shown = "\n".join(
        f"  - {f}  {uid or '(no user id)'}  ({'a red key' if _is_red(caps) else 'a signing key'})"
        for f, (caps, uid) in held.items()
    )
    if all(_is_red(caps) for caps, _ in held.values()):
        fix = (
            "it holds only red keys: point black.gnupg_home at black's home (the one "
            "`diode keys init --side black` made)"
        )
    else:
        fix = (
            "if the signing key listed is black's, set black.signing_key to it (and list it in "
            "link.black_signers on both sides), or point black.gnupg_home at the home that "
            f"holds {fpr}"
        )
    return (
        f"black.signing_key: secret key {fpr} missing from GnuPG home {home}, which holds "
        f"these secret key(s):\n{shown}\nFix: {fix}"
    )


def _require_recipients(gpg: Gpg, cfg: Config) -> None:
    """Every encrypted channel's recipients are in black's home, can encrypt, and get MDC (not
    OCB) from this gpg: the check ``diode check``, ``diode keys check --side black`` and the
    black job's start share."""
    checked: set[frozenset[str]] = set()  # channels mostly share their recipients
    for ch in cfg.channels:
        if ch.encrypt and frozenset(ch.recipients) not in checked:
            purpose = f"recipients of channel {ch.name!r}"
            gpg.require_keys(ch.recipients, purpose=purpose, capability="encrypt")
            gpg.check_encryption_mode(ch.recipients, purpose=purpose)
            checked.add(frozenset(ch.recipients))


def _signing_gpg(cfg: Config, environ: Mapping[str, str] | None) -> Gpg:
    _warn_permissions(cfg, "black")
    fpr = normalize_fingerprint(cfg.black.signing_key, what="black.signing_key")
    gpg = _side_gpg(cfg, "black", environ)
    held = _secret_roles(gpg)
    if held and fpr not in held:
        raise KeyMissingError(_signing_key_missing_message(gpg.home, fpr, held))
    gpg.require_keys([fpr], secret=True, purpose="black.signing_key", capability="sign")
    others = {f: caps for f, (caps, _) in held.items() if f != fpr}
    if others:
        raise CryptoError(_extra_secrets_message(gpg, fpr, others))
    gpg.check_unlock(
        fpr, capability="sign", purpose="black.signing_key", fix=_passphrase_fix(cfg, "black")
    )
    _require_recipients(gpg, cfg)
    return gpg


def decryption_gpg(
    cfg: Config, *, environ: Mapping[str, str] | None = None, one_shot: bool = False
) -> Gpg:
    """Red's GnuPG home with its decryption keys unlocked; fails fast on anything to fix.

    Checks: at least one secret decryption key; every pinned black signer is present; no
    pinned black key's SECRET is here; each protected key opens with the passphrase (a
    test decryption). ``one_shot`` (a check, not the red job): a gpg-agent this call
    started is stopped when it returns.
    """
    binary = _gpg_binary(cfg, "red")
    with _agent_scope(Path(cfg.red.gnupg_home), binary, one_shot=one_shot):
        return _decryption_gpg(cfg, environ)


def _decryption_gpg(cfg: Config, environ: Mapping[str, str] | None) -> Gpg:
    _warn_permissions(cfg, "red")
    if not cfg.link.black_signers:
        raise ConfigError(
            "link.black_signers is empty: red accepts nothing unpinned. Import black.asc "
            "(`diode keys import --home RED_HOME black.asc`) and paste the line it prints"
        )
    gpg = _side_gpg(cfg, "red", environ)
    gpg.require_keys(cfg.link.black_signers, purpose="link.black_signers", capability="sign")
    roles = _secret_roles(gpg)
    black_secret = [f for f in cfg.link.black_signers if f in roles]
    if black_secret:
        raise CryptoError(
            f"red GnuPG home {gpg.home} holds the SECRET of pinned black key(s) "
            f"{', '.join(black_secret)}: red must never be able to sign as black. Delete it "
            f"here (`{gpg.binary} --homedir {gpg.home} --delete-secret-keys FPR`)"
        )
    mine = [f for f, (caps, _) in roles.items() if "E" in caps]
    if not mine:
        raise KeyMissingError(
            f"red GnuPG home {gpg.home} holds no secret decryption key: run "
            f"`diode keys init --side red --name NAME --home {gpg.home}{gpg.gpg_option}` on "
            "the red host"
        )
    for f in mine:
        gpg.check_unlock(
            f, capability="encrypt", purpose="red decryption key", fix=_passphrase_fix(cfg, "red")
        )
    return gpg


# ---------------------------------------------------------------------------- demo and tests


@dataclass(frozen=True)
class KeyInventory:
    """What ``init_keys`` created: homes, fingerprints, and where the public keys are."""

    black_home: Path
    red_home: Path
    black_fpr: str
    red_fprs: dict[str, str] = field(default_factory=dict)
    pub_dir: Path = Path("keys/pub")

    def to_toml_snippet(self) -> str:
        """Config lines for a single-machine setup (both sides share them)."""
        recipients = ", ".join(toml_str(f) for f in self.red_fprs.values())
        names = ", ".join(self.red_fprs)
        return "\n".join(
            [
                "[link]",
                f"black_signers = [{toml_str(self.black_fpr)}]",
                "",
                "[black]",
                f"gnupg_home = {toml_str(self.black_home)}",
                f"signing_key = {toml_str(self.black_fpr)}",
                "",
                "[red]",
                f"gnupg_home = {toml_str(self.red_home)}",
                "",
                "[[channels]]",
                'name = "default"',
                f"# red keys: {names}",
                f"recipients = [{recipients}]",
                "",
            ]
        )


def _kill_agent(home: Path, binary: str) -> None:
    """Stop the daemons of ``home``: gpg-agent, and keyboxd where a ``use-keyboxd`` home
    (GnuPG 2.4) started one (none running: nothing happens). With the gpgconf of ``binary``'s
    install, which knows the daemons that gpg starts."""
    try:
        subprocess.run(
            [gnupg_tool(binary, "gpgconf"), "--homedir", str(home), "--kill", "all"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not stop the gpg-agent of GnuPG home %s: %s", home, e)


def _agent_running(home: Path, binary: str) -> bool:
    """Whether a gpg-agent serves ``home`` now (asked without starting one, by the
    gpg-connect-agent of ``binary``'s install).

    When that cannot be told (gpg-connect-agent missing or hung), True: an agent that may be
    another process's is never stopped.
    """
    if not home.is_dir():
        return False
    try:
        proc = subprocess.run(
            [gnupg_tool(binary, "gpg-connect-agent"), "--homedir", str(home), "--no-autostart"]
            + ["GETINFO pid", "/bye"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return any(line.startswith(b"D ") for line in proc.stdout.splitlines())


@contextmanager
def _stopping_agent(home: Path, binary: str) -> Iterator[None]:
    """Run a one-shot key operation on ``home`` with gpg ``binary``; stop the gpg-agent (and
    keyboxd) it started.

    An agent that was already running (a black or red job's, an operator's) is left alone.
    The agent would otherwise live on after the command, with any passphrase it cached.
    """
    before = _agent_running(home, binary)
    try:
        yield
    finally:
        if not before:
            _kill_agent(home, binary)  # none running: gpgconf starts none


def _agent_scope(home: Path, binary: str, *, one_shot: bool) -> AbstractContextManager[None]:
    return _stopping_agent(home, binary) if one_shot else nullcontext()


def _occupied(home: Path) -> bool:
    return home.exists() and (not home.is_dir() or any(home.iterdir()))


def init_keys(
    keys_dir: Path,
    *,
    red_names: Sequence[str] = ("red",),
    algo: Algo = "ed25519",
    bridge_id: str = "diode-bridge",
    force: bool = False,
    binary: str = DEFAULT_GPG,
) -> KeyInventory:
    """Demo and tests ONLY: both sides' homes on one machine, public keys cross-imported.

    Creates ``keys_dir/black`` (black signing key + red public keys), ``keys_dir/red`` (red
    decryption keys + black public key) and ``keys_dir/pub``. A real install runs
    ``init_side`` on each host instead, so black never holds a red secret key. Refuses
    (CryptoError) to touch an existing, non-empty home unless ``force=True``, which destroys
    both homes and their secret keys for good. ``binary``: the gpg of both sides.
    """
    names = list(red_names)
    bad = [n for n in names if not _NAME_RE.match(n)]
    if not names or bad or len(set(names)) != len(names):
        raise CryptoError(
            f"red names must be unique, non-empty, lowercase letters/digits/'-'/'_' "
            f"(they become pub/<name>.asc); got {names!r}"
        )
    _check_algo(algo)
    keys_dir = Path(keys_dir)
    black_home, red_home, pub_dir = keys_dir / "black", keys_dir / "red", keys_dir / "pub"
    existing = [h for h in (black_home, red_home) if _occupied(h)]
    if existing and not force:
        shown = ", ".join(str(h) for h in existing)
        raise CryptoError(
            f"refusing to overwrite existing GnuPG home(s) {shown}: they may hold the only "
            "copy of a secret key. Move them away first, or re-run with force=True "
            "to destroy them and create new keys"
        )
    for home in existing:
        _kill_agent(home, binary)
        shutil.rmtree(home)
    keys_dir.mkdir(parents=True, exist_ok=True)
    try:
        make = partial(init_side, pub_dir=pub_dir, algo=algo, bridge_id=bridge_id, binary=binary)
        black = make("black", black_home)
        reds = [make("red", red_home, name=n) for n in names]
        import_public_keys(black_home, [r.public_file for r in reds], binary=binary)
        import_public_keys(red_home, [black.public_file], binary=binary)
    except BaseException:
        for home in (black_home, red_home):
            _kill_agent(home, binary)
            shutil.rmtree(home, ignore_errors=True)
        raise
    return KeyInventory(
        black_home=black_home,
        red_home=red_home,
        black_fpr=black.fpr,
        red_fprs={r.name: r.fpr for r in reds},
        pub_dir=pub_dir,
    )
