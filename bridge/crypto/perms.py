"""Crypto (both sides): restrictive permissions for secrets at rest, and the checks on them.

Modes the bridge writes: GnuPG homes 0700 and every file in them 0600, exported public keys
0644, configuration written by the CLI 0600. ``permission_problems`` lists what an operator
must tighten (``diode keys check`` fails on it; the black and red jobs' startup logs it as
warnings): a config file group/others may write to (it decides which keys are trusted), and
the side's directories that group/others may write to (they may exist before the bridge
creates them, and it leaves an existing directory's mode as it is).
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from bridge.config import Config
from bridge.crypto.passphrase import file_problem
from bridge.diode.file_drop import OUTBOX_DIR_MODE, default_staging
from bridge.errors import ConfigError
from bridge.fsutil import DIR_MODE, fsync_dir, tmp_path_for, write_all
from bridge.red.layout import RED_DIR_KEYS

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "PUBLIC_FILE_MODE",
    "RED_INBOX_DIR_MODE",
    "check_dir_path",
    "lock_down_home",
    "permission_problems",
    "secret_keys_in",
    "write_file",
]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644
RED_INBOX_DIR_MODE = 0o770
"""The most red's inbox may allow: a vendor mover (or the UDP receiver) of red's group writes
there; others never."""

_SECRET_WORDS = ("password", "secret", "token")

log = logging.getLogger(__name__)


def check_dir_path(path: Path, *, what: str) -> None:
    """ConfigError unless ``path`` is a directory or could be created as one (no existing
    ancestor is a file); names the path, the culprit and the fix. Creates nothing."""
    for p in (path, *path.parents):
        try:
            st = p.stat()
        except (FileNotFoundError, NotADirectoryError):  # missing, or under a file: look up
            if p.is_symlink():
                raise ConfigError(
                    f"{what} {path}: {p} is a symlink to {os.readlink(p)}, which does not "
                    "exist: create its target directory, or pass another directory"
                ) from None
            continue
        except OSError as e:
            raise ConfigError(f"{what} {path}: cannot look at {p}: {e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):
            where = "is" if p == path else f"is inside {p}, which is"
            raise ConfigError(
                f"{what} {path} {where} a file, not a directory: pass a directory (it is "
                "created if missing)"
            )
        return


def write_file(final: Path, data: bytes, *, mode: int) -> None:
    """Durably write ``data`` to ``final`` with exactly ``mode`` (never wider, even briefly).

    Temp name beside it (created with ``mode`` and O_EXCL), fsync, rename, fsync the folder.
    A parent that cannot be a directory (a file is in the way) is a ConfigError naming it.
    """
    check_dir_path(final.parent, what=f"directory for {final.name}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create directory {final.parent} for {final.name}: {e.strerror or e}; "
            "create it, or write the file elsewhere"
        ) from None
    tmp = tmp_path_for(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o600)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)  # the umask cannot widen, but it may narrow: set it exactly
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def lock_down_home(home: Path) -> None:
    """GnuPG home and its folders 0700, its regular files 0600 (sockets left alone).

    Symlinks inside the home are not followed (their targets are not the home's to change):
    each is logged as a warning naming it and the fix.
    """
    os.chmod(home, PRIVATE_DIR_MODE)
    for root, dirs, files in os.walk(home):
        for name in (*dirs, *files):
            p = os.path.join(root, name)
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                log.warning(
                    "GnuPG home %s: %s is a symlink (to %s), left as it is: make sure its "
                    "target is private (chmod 700 a directory, 600 a file), or replace the "
                    "link with what it points to",
                    home,
                    p,
                    os.readlink(p),
                )
            elif stat.S_ISDIR(mode):
                os.chmod(p, PRIVATE_DIR_MODE)
            elif stat.S_ISREG(mode):
                os.chmod(p, PRIVATE_FILE_MODE)


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def secret_keys_in(data: dict[str, Any]) -> list[str]:
    """Dotted names of the keys of a raw config mapping that hold secrets (values not shown).

    A secret is a non-empty value under a key naming a password, secret or token, or a URL
    with a password in it (``amqp_url = "amqp://user:PASSWORD@host"``).
    """
    found = []
    for name, value in _walk(data, ""):
        if not isinstance(value, str) or not value:
            continue
        leaf = name.rsplit(".", 1)[-1].lower()
        if any(w in leaf for w in _SECRET_WORDS):
            found.append(name)
        elif "://" in value:
            try:
                has_password = urllib.parse.urlsplit(value).password is not None
            except ValueError:
                has_password = False
            if has_password:
                found.append(name)
    return found


def permission_problems(cfg: Config, *, side: Literal["black", "red"]) -> list[str]:
    """What group/others can reach on this side's host; each entry says how to fix it.

    Checked: the config file (writable by group/others, or in a directory they may write
    to: it decides which keys are trusted; readable by them when it holds secrets), the
    side's GnuPG home and the files in it, the side's passphrase file, and the side's
    directories, for write access beyond the modes the bridge creates them with: on black
    the outbox, udp_outbox, staging, archive, state and spool directories; on red the inbox,
    work, processed, quarantine, state, checkpoint and tables directories (and the UDP
    receiver's spool when [udp] is configured).
    """
    problems: list[str] = []
    if cfg.source is not None:
        problems += _config_problems(Path(cfg.source))
    sect = cfg.black if side == "black" else cfg.red
    home = Path(sect.gnupg_home)
    mode = _mode(home)
    if mode is not None and mode & 0o077:
        problems.append(
            f"GnuPG home {home} ({side}.gnupg_home) is accessible by group/others (mode "
            f"{mode:04o}): run `chmod 700 {home}`"
        )
    if mode is not None:
        loose = []
        for root, _dirs, files in os.walk(home):
            for f in files:
                p = Path(root) / f
                try:
                    st = p.lstat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                    loose.append(p)
        if loose:
            shown = ", ".join(str(p.relative_to(home)) for p in loose[:5])
            more = f" and {len(loose) - 5} more" if len(loose) > 5 else ""
            problems.append(
                f"{len(loose)} file(s) in GnuPG home {home} are accessible by group/others "
                f"({shown}{more}): run `chmod -R go-rwx {home}`"
            )
    pfile = getattr(sect, "passphrase_file", None)
    if pfile is not None:
        source = f"passphrase file {pfile} ({side}.passphrase_file)"
        try:
            problem = file_problem(Path(pfile).stat(), pfile, source)
        except OSError:  # missing: the passphrase check says so, with its fix
            problem = None
        if problem is not None:
            problems.append(problem)
    dirs = _black_dirs(cfg) if side == "black" else _red_dirs(cfg)
    problems += _dir_problems(side, dirs)
    return problems


def _writable_by(mode: int) -> str:
    return {0o020: "group", 0o002: "others"}.get(mode & 0o022, "group and others")


def _config_problems(src: Path) -> list[str]:
    """The config file: nobody but its owner may change it (it sets link.black_signers on
    red and the channels' recipients on black: whoever writes it picks the keys trusted), and
    nobody else may read it when it holds secrets."""
    mode = _mode(src)
    if mode is None:
        return []
    problems: list[str] = []
    if mode & 0o022:
        problems.append(
            f"config {src} is writable by {_writable_by(mode)} (mode {mode:04o}): whoever "
            "writes it chooses the trusted keys (link.black_signers, channel recipients); "
            f"run `chmod go-w {src}`"
        )
    parent = src.resolve().parent
    pmode = _mode(parent)
    if pmode is not None and pmode & 0o022 and not pmode & stat.S_ISVTX:
        problems.append(
            f"config {src} is in directory {parent}, writable by {_writable_by(pmode)} (mode "
            f"{pmode:04o}): a local user could replace the config and choose the trusted "
            f"keys; run `chmod go-w {parent}`, or keep the config in a directory only its "
            "owner writes"
        )
    if mode & 0o077:
        try:
            secrets = secret_keys_in(tomllib.loads(src.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            secrets = []
        if secrets:
            problems.append(
                f"config {src} holds secrets ({', '.join(secrets)}) and is readable by "
                f"group/others (mode {mode:04o}): run `chmod 600 {src}`, or move the secrets "
                "to DIODE__SECTION__KEY environment variables"
            )
    return problems


def _black_dirs(cfg: Config) -> list[tuple[str, Path, int]]:
    """``(config key, path, most permissive intended mode)`` of black's directories.

    Only the outbox is group-writable (``OUTBOX_DIR_MODE``: the vendor's mover takes files).
    A writable staging dir would let a local user swap a sealed temp file between gpg and
    its rename into the outbox; a writable archive, state or spool dir, what resend re-drops,
    the bundle chain or the messages themselves.
    """
    b = cfg.black
    dirs: list[tuple[str, Path, int]] = [
        ("black.outbox", Path(b.outbox), OUTBOX_DIR_MODE),
        ("black.staging_dir", Path(b.staging_dir or default_staging(Path(b.outbox))), DIR_MODE),
        ("black.archive", Path(b.archive), DIR_MODE),
        ("black.state_dir", Path(b.state_dir), DIR_MODE),
        ("black.spool_dir", Path(b.spool_dir), DIR_MODE),
    ]
    if b.udp_outbox is not None and Path(b.udp_outbox) != Path(b.outbox):
        dirs.insert(1, ("black.udp_outbox", Path(b.udp_outbox), DIR_MODE))
    return dirs


def _red_dirs(cfg: Config) -> list[tuple[str, Path, int]]:
    """``(config key, path, most permissive intended mode)`` of red's directories.

    Only the inbox may be group-writable (``RED_INBOX_DIR_MODE``: a vendor's mover drops
    files there). A writable work dir would let a local user swap a verified plaintext
    before it lands; a writable state, tables or checkpoint dir, the ledger, the sequence
    state, approvals or the landed messages; processed and quarantine hold the evidence.
    """
    r = cfg.red
    dirs = [
        (f"red.{key}", Path(getattr(r, key)), RED_INBOX_DIR_MODE if key == "inbox" else DIR_MODE)
        for key in RED_DIR_KEYS
    ]
    if cfg.udp is not None:
        dirs.append(("udp.receive.spool_dir", Path(cfg.udp.receive.spool_dir), DIR_MODE))
    return dirs


def _dir_problems(side: str, dirs: list[tuple[str, Path, int]]) -> list[str]:
    """The directories of ``dirs`` that group/others can write to beyond their intended mode;
    nothing is ever world-writable. Missing directories are no problem: the bridge creates
    them with its own modes."""
    problems: list[str] = []
    for key, d, intended in dirs:
        mode = _mode(d)
        loose = 0 if mode is None else mode & 0o022 & ~intended
        if mode is None or not loose:
            continue
        fix = "o-w" if intended & 0o020 else "go-w"  # the outbox / inbox stays the mover's
        problems.append(
            f"{key} {d} is writable by {_writable_by(loose)} (mode {mode:04o}): a local user "
            f"could replace the files {side} keeps there; run `chmod {fix} {d}`"
        )
    return problems
