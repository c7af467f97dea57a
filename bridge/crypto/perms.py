"""Crypto (both sides): restrictive permissions for secrets at rest, and the checks on them.

Modes the bridge writes: GnuPG homes 0700 and every file in them 0600, exported public keys
0644, configuration written by the CLI 0600. ``permission_problems`` lists what an operator
must tighten (``diode keys check`` fails on it; the black job's startup logs it as warnings),
including black's directories that group/others may write to (they may exist before black
creates them, and black leaves an existing directory's mode as it is).
"""

from __future__ import annotations

import os
import stat
import tomllib
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from bridge.config import Config
from bridge.diode.file_drop import OUTBOX_DIR_MODE, default_staging
from bridge.fsutil import DIR_MODE, fsync_dir, tmp_path_for, write_all

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "PUBLIC_FILE_MODE",
    "lock_down_home",
    "permission_problems",
    "secret_keys_in",
    "write_file",
]

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PUBLIC_FILE_MODE = 0o644

_SECRET_WORDS = ("password", "secret", "token")


def write_file(final: Path, data: bytes, *, mode: int) -> None:
    """Durably write ``data`` to ``final`` with exactly ``mode`` (never wider, even briefly).

    Temp name beside it (created with ``mode`` and O_EXCL), fsync, rename, fsync the folder.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
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
    """GnuPG home and its folders 0700, its regular files 0600 (sockets left alone)."""
    os.chmod(home, PRIVATE_DIR_MODE)
    for root, dirs, files in os.walk(home):
        for d in dirs:
            os.chmod(os.path.join(root, d), PRIVATE_DIR_MODE, follow_symlinks=False)
        for f in files:
            p = os.path.join(root, f)
            if stat.S_ISREG(os.lstat(p).st_mode):
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

    Checked: the config file (only if it holds secrets), the side's GnuPG home and the files
    in it, the side's passphrase file; on black also the outbox, udp_outbox, staging, archive,
    state and spool directories, for write access beyond the modes black creates them with.
    """
    problems: list[str] = []
    src = cfg.source
    if src is not None and (mode := _mode(src)) is not None and mode & 0o077:
        try:
            secrets = secret_keys_in(tomllib.loads(src.read_text(encoding="utf-8")))
        except (OSError, tomllib.TOMLDecodeError):
            secrets = []
        if secrets:
            problems.append(
                f"config {src} holds secrets ({', '.join(secrets)}) and is readable by "
                f"group/others (mode {mode:04o}): run `chmod 600 {src}`, or move the secrets "
                "to DIODE__SECTION__KEY environment variables"
            )
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
    if pfile is not None and (pmode := _mode(Path(pfile))) is not None and pmode & 0o077:
        problems.append(
            f"passphrase file {pfile} ({side}.passphrase_file) is accessible by group/others "
            f"(mode {pmode:04o}): run `chmod 600 {pfile}`"
        )
    if side == "black":
        problems += _black_dir_problems(cfg)
    return problems


def _black_dir_problems(cfg: Config) -> list[str]:
    """Black's directories that group/others can write to beyond what black intends.

    Only the outbox is group-writable (``OUTBOX_DIR_MODE``: the vendor's mover takes files);
    nothing is world-writable. A writable staging dir would let a local user swap a sealed
    temp file between gpg and its rename into the outbox; a writable archive, state or spool
    dir, what resend re-drops, the bundle chain or the messages themselves. Missing
    directories are no problem: black creates them with its own modes.
    """
    b = cfg.black
    dirs: list[tuple[str, Path, int]] = [
        ("outbox", Path(b.outbox), OUTBOX_DIR_MODE),
        ("staging_dir", Path(b.staging_dir or default_staging(Path(b.outbox))), DIR_MODE),
        ("archive", Path(b.archive), DIR_MODE),
        ("state_dir", Path(b.state_dir), DIR_MODE),
        ("spool_dir", Path(b.spool_dir), DIR_MODE),
    ]
    if b.udp_outbox is not None and Path(b.udp_outbox) != Path(b.outbox):
        dirs.insert(1, ("udp_outbox", Path(b.udp_outbox), DIR_MODE))
    problems: list[str] = []
    for key, d, intended in dirs:
        mode = _mode(d)
        loose = 0 if mode is None else mode & 0o022 & ~intended
        if mode is None or not loose:
            continue
        who = {0o020: "group", 0o002: "others"}.get(loose, "group and others")
        fix = "o-w" if intended & 0o020 else "go-w"  # the outbox stays the mover group's
        problems.append(
            f"black.{key} {d} is writable by {who} (mode {mode:04o}): a local user could "
            f"replace the files black writes there; run `chmod {fix} {d}`"
        )
    return problems
