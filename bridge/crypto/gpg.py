"""Crypto: sign-then-encrypt bundles on black, decrypt-and-verify them on red, with GnuPG.

Black seals every bundle as ONE OpenPGP message: signed by the black key, then encrypted
to every recipient of the channel (``--throw-keyids`` hides who they are). A channel that
opted out of encryption ships a binary OpenPGP *signed* message instead. Red opens a
bundle into a hidden temp file beside the destination and renames it into place only when
gpg reports exactly one GOOD signature whose primary-key fingerprint is pinned; anything
else deletes the temp file (gpg writes the plaintext in full even when the signature is
bad) and raises.

Hot path (``seal``/``open``): gpg is run directly with ``--status-fd`` and reads/writes
the files itself, so a 1 GB bundle never passes through Python memory or a pipe. The file
gpg writes is created by the bridge first, 0600 whatever the umask, and gpg gets only its
descriptor (``--output -``): a plaintext or sealed bundle is never readable by others.
Key listing, import and export go through python-gnupg. What gpg's status lines mean,
and which of them red accepts, is decided in ``bridge.crypto.verdict``.

A passphrase-protected key works when the ``Gpg`` is built with a ``Passphrase``: every call
that uses a secret key gets it through a pipe (``--passphrase-fd``), never on argv, and the
environment variable it came from is removed from gpg's environment.

Which gpg runs is the ``Gpg``'s ``binary``: ``<side>.gpg_binary`` (default ``gpg``, from PATH),
checked at start by ``check_gpg_binary``; gpgconf and gpg-connect-agent are always those of the
same install (``gnupg_tool``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gnupg

from bridge.crypto.fingerprint import normalize_fingerprint
from bridge.crypto.passphrase import Passphrase
from bridge.crypto.verdict import Opened, Transcript, judge, parse_status
from bridge.crypto.verdict import check_length as _check_length
from bridge.errors import ConfigError, CryptoError, KeyMissingError, SignatureError
from bridge.fsutil import fsync_dir, tmp_path_for, write_all

__all__ = ["Gpg", "Opened", "normalize_fingerprint"]

log = logging.getLogger(__name__)

# Bundles are sealed with -z 0, so a plaintext is never larger than its message; this
# slack only covers packet overhead of small messages. Anything bigger is a compression
# bomb (hostile input: gpg writes the plaintext BEFORE it checks the signature).
_OUTPUT_SLACK = 1024 * 1024
# Long homes push gpg-agent's socket past the 108-byte AF_UNIX limit.
_SOCKET_PATH_LIMIT = 100

KEY_PREFERENCES = "AES256 AES192 AES SHA512 SHA384 SHA256 SHA224 ZLIB BZIP2 ZIP Uncompressed"
"""Algorithm preferences of every key the bridge creates (``--default-preference-list``).

No AEAD algorithm in it, so the key never advertises the AEAD feature: GnuPG 2.3+ encrypts
with OCB (LibrePGP AEAD packets) when EVERY recipient key advertises it, which upstream 2.4
builds do for new keys by default (Debian's only with ``compliance gnupg``). GnuPG 2.2 red
decrypts OCB but cannot confirm its integrity in DECRYPTION_INFO, so it rejects such bundles.
"""

OPEN_BASE_SECONDS = 60.0
"""Seconds any one ``open``/``open_bytes`` may take, whatever the message's size."""
OPEN_BYTES_PER_SECOND = 2 * 1024 * 1024
"""...plus its size at this rate: conservative (gpg decrypts and verifies at 100+ MB/s), so
an honest bundle is never cut off, while a tiny message built to keep gpg busy (nested
compressed packets unpacking to gigabytes of marker packets: no output, no status line) is
stopped within about ``OPEN_BASE_SECONDS``."""


MIN_GNUPG = (2, 2)
"""The oldest GnuPG release the bridge runs (``check_gpg_binary``)."""
GNUPG_TOOLS = ("gpgconf", "gpg-connect-agent")
"""The tools of a GnuPG install the bridge runs besides gpg: both from the same install."""
_VERSION_RE = re.compile(r"gpg \(GnuPG[^)]*\) (\d+)\.(\d+)(\.\S+)?")
_VERSION_SECONDS = 30.0


def _c_env() -> dict[str, str]:
    """The environment of every GnuPG tool run: this process's, in the C locale (its output is
    parsed), without a stale ``GPG_AGENT_INFO``."""
    env = {**os.environ, "LC_ALL": "C", "LANGUAGE": "C"}
    env.pop("GPG_AGENT_INFO", None)
    return env


def gnupg_tool(binary: str, tool: str) -> str:
    """``tool`` (``gpgconf``, ``gpg-connect-agent``) of the install ``binary`` belongs to: the
    one beside it when ``binary`` is a path, else ``tool`` looked up on PATH like ``binary``."""
    return str(Path(binary).with_name(tool)) if os.sep in binary else tool


def _gnupg_fix(key: str) -> str:
    return (
        f"install GnuPG {MIN_GNUPG[0]}.{MIN_GNUPG[1]} or later and set {key} to its gpg (an "
        "absolute path, e.g. /usr/bin/gpg2 or /opt/gnupg-2.4/bin/gpg, or a name on PATH), or "
        f"remove {key} to run `gpg` from PATH"
    )


def _locate(binary: str, key: str) -> str:
    """The file ``binary`` runs (a path as given, a bare name looked up on PATH); ConfigError
    naming ``key`` when it is missing, not a file or not executable."""
    said = f"{key} = {binary!r}"
    if os.sep not in binary:
        found = shutil.which(binary)
        if found is None:
            path = os.environ.get("PATH", "")
            raise ConfigError(f"{said}: not found on PATH ({path}): {_gnupg_fix(key)}")
        return found
    p = Path(binary)
    if not p.exists():
        raise ConfigError(f"{said}: no such file: {_gnupg_fix(key)}")
    if not p.is_file():
        raise ConfigError(f"{said}: not a file (a directory?): {_gnupg_fix(key)}")
    if not os.access(p, os.X_OK):
        raise ConfigError(f"{said}: not executable by this user: {_gnupg_fix(key)}")
    return binary


def check_gpg_binary(binary: str, *, key: str) -> str:
    """Fail fast unless ``binary`` runs GnuPG ``MIN_GNUPG`` or later, with ``GNUPG_TOOLS`` of the
    same install (``gnupg_tool``); returns its version ("2.4.7").

    Runs ``binary --version``. ConfigError naming ``key`` (``black.gpg_binary``...) and the fix
    when the binary is missing, not executable, not GnuPG, too old, or lacks a tool.
    """
    said = f"{key} = {binary!r}"
    path = _locate(binary, key)
    try:
        proc = subprocess.run(
            [path, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=_c_env(),
            check=False,
            timeout=_VERSION_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"{said}: `{path} --version` did not answer within {_VERSION_SECONDS:.0f} s: "
            f"{_gnupg_fix(key)}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{said}: cannot run it ({e.strerror or e}): {_gnupg_fix(key)}") from None
    out = proc.stdout.decode("utf-8", "replace").strip()
    first = out.splitlines()[0] if out else proc.stderr.decode("utf-8", "replace").strip()
    m = _VERSION_RE.match(first)
    if proc.returncode != 0 or m is None:
        raise ConfigError(
            f"{said} is not GnuPG: `{path} --version` exited {proc.returncode} and said "
            f"{first[:120]!r} (GnuPG says 'gpg (GnuPG) 2.x.y'): {_gnupg_fix(key)}"
        )
    version = f"{m[1]}.{m[2]}{m[3] or ''}"
    if (int(m[1]), int(m[2])) < MIN_GNUPG:
        raise ConfigError(f"{said} is GnuPG {version}, too old: {_gnupg_fix(key)}")
    for tool in GNUPG_TOOLS:
        beside = gnupg_tool(binary, tool)
        if os.sep in beside and not os.access(beside, os.X_OK):
            missing = f"{beside} is missing or not executable"
        elif os.sep not in beside and shutil.which(beside) is None:
            missing = f"{beside} is not on PATH"
        else:
            continue
        raise ConfigError(
            f"{said} is GnuPG {version}, but {missing}: the bridge runs gpgconf and "
            f"gpg-connect-agent of the same install (to ask and to stop gpg-agent). Set {key} "
            "to the gpg of a complete install (gpg, gpgconf and gpg-connect-agent in one "
            "folder, e.g. /opt/gnupg-2.4/bin/gpg), not to a link or copy of gpg elsewhere"
        )
    return version


class GpgTimeout(CryptoError):
    """gpg did not finish within its time and was killed (with its process group).

    Not a verdict by itself: a hung gpg-agent or a stalled disk looks the same as a message
    built to keep gpg busy; the caller checks the host to tell them apart.
    """

    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL gpg's process group (gpg and any helper it forked; gpg-agent detaches into a
    session of its own and lives on), then reap gpg."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already
    proc.wait()


def _passphrase_pipe(secret: bytes) -> int:
    """A pipe already holding ``secret`` + newline; returns the read end (caller closes it)."""
    rfd, wfd = os.pipe()  # both ends close-on-exec; pass_fds opens the read end to gpg only
    try:
        write_all(wfd, secret + b"\n")  # at most 4 KiB: one write, never blocks
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    return rfd


def _aead_algo(res: Transcript) -> str | None:
    """The AEAD algorithm gpg encrypted with (``BEGIN_ENCRYPTION <mdc> <cipher> [<aead>]``),
    or None for MDC (GnuPG 2.2 never writes the third field)."""
    begin = res.first("BEGIN_ENCRYPTION")
    if begin is None or len(begin) < 3 or begin[2] in ("", "0"):
        return None
    return begin[2]


def _aead_fix(recipients: Sequence[str]) -> str:
    """What to do when gpg would encrypt to ``recipients`` with OCB (every key advertises AEAD)."""
    shown = ", ".join(recipients)
    return (
        f"every recipient key ({shown}) advertises the AEAD feature, so this gpg (2.3+) "
        "encrypts with OCB (LibrePGP AEAD), which red on GnuPG 2.2 rejects and other OpenPGP "
        "tools cannot read. Fix on the red host of each key: "
        f'`gpg --homedir RED_HOME --default-preference-list "{KEY_PREFERENCES}" '
        "--quick-update-pref FPR` (GnuPG 2.3+; on 2.2: `gpg --homedir RED_HOME --edit-key FPR`, "
        "`setpref` with that list, `save`), then export it again "
        "(`gpg --homedir RED_HOME --armor --export FPR > NAME.asc`) and "
        "`diode keys import --home BLACK_HOME NAME.asc` on black (runbook: GnuPG releases)"
    )


def _passphrase_hint(res: Transcript, passphrase: Passphrase | None) -> str:
    """Why a secret-key operation failed, when it is the passphrase (never the secret)."""
    if any("bad passphrase" in d.lower() for d in res.diag):
        if passphrase is None:
            return " (bad passphrase)"
        return f" (the {passphrase.source} does not unlock the key: bad passphrase)"
    if res.has("NEED_PASSPHRASE") or any("can't get input" in d for d in res.diag):
        return (
            " (the key is passphrase-protected and no passphrase is configured: set "
            "<side>.passphrase_file or the variable named by <side>.passphrase_env)"
        )
    return ""


def _blocker_hint(path: Path) -> str:
    """`` (X is not a directory)`` when an existing ancestor of ``path`` is no directory."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            return "" if parent.is_dir() else f" ({parent} exists and is not a directory)"
    return ""


def _private_output(path: Path, *, what: str, replace: bool = False) -> int:
    """``path`` created now, 0600 whatever the umask, open for writing; returns the fd.

    gpg writes into this descriptor (``--output -``): it never creates the file itself, so
    the plaintext or sealed bundle is never readable by group/others, not even briefly.
    O_EXCL and O_NOFOLLOW: never a file or symlink someone else put there first.
    ``replace``: an existing ``path`` is removed first (gpg's ``--yes``). CryptoError naming
    ``path`` and ``what`` it is for when it cannot be created.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        if replace:
            path.unlink(missing_ok=True)
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise CryptoError(
            f"cannot create {path} for {what}: {e.strerror or e}{_blocker_hint(path)}"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # the umask may only narrow it; never leave it narrower either
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class _Result(Transcript):
    """A status transcript plus what gpg wrote to stdout (``--output -``)."""

    stdout: bytes = b""


class Gpg:
    """One GnuPG home, driven non-interactively (``--batch``, loopback pinentry, no tty)."""

    def __init__(
        self,
        home: Path,
        *,
        binary: str = "gpg",
        passphrase: Passphrase | None = None,
        timeout: float = 900.0,
        open_base_seconds: float = OPEN_BASE_SECONDS,
    ) -> None:
        if not timeout > 0 or not open_base_seconds > 0:
            raise ValueError(
                f"gpg timeouts must be positive seconds (timeout={timeout!r}, "
                f"open_base_seconds={open_base_seconds!r})"
            )
        self.home = Path(home)
        self.binary = binary
        """gpg to run: a path, or a name looked up on PATH (its tools: ``gnupg_tool``)."""
        self.passphrase = passphrase
        """Passphrase of the secret keys of this home (None: they have none)."""
        self.timeout = float(timeout)
        """Seconds one gpg call may take at most (a 1 GB bundle seals in well under a minute)."""
        self.open_base_seconds = float(open_base_seconds)
        """Opening a message may take this plus its size at ``OPEN_BYTES_PER_SECOND``."""
        if not self.home.exists():
            self._make_home()
        elif not self.home.is_dir():
            raise CryptoError(f"GnuPG home {self.home} exists but is not a directory")
        elif stat.S_IMODE(self.home.stat().st_mode) & 0o077:
            log.warning(
                "GnuPG home %s is readable by group/others; run `chmod 700 %s`",
                self.home,
                self.home,
            )
        self._pg: gnupg.GPG | None = None

    def __repr__(self) -> str:
        return f"Gpg(home={str(self.home)!r})"

    def _make_home(self) -> None:
        """Create the missing home, 0700; CryptoError naming the path and the fix otherwise."""
        if self.home.is_symlink():
            raise CryptoError(
                f"GnuPG home {self.home} is a symlink to {os.readlink(self.home)}, which does "
                f"not exist: create the target directory (mode 0700), or remove the link and "
                "point the home at a real directory"
            )
        try:
            self.home.mkdir(mode=0o700, parents=True)
        except OSError as e:
            raise CryptoError(
                f"cannot create GnuPG home {self.home}: {e.strerror or e}"
                f"{_blocker_hint(self.home)}; point the home at a directory this user may create"
            ) from None
        os.chmod(self.home, 0o700)  # mkdir's mode is masked by the umask

    # ------------------------------------------------------------------ plumbing

    @property
    def _gnupg(self) -> gnupg.GPG:
        if self._pg is None:
            try:
                self._pg = gnupg.GPG(
                    gnupghome=str(self.home), gpgbinary=self.binary, env=self._child_env()
                )
            except (OSError, ValueError) as e:
                raise CryptoError(
                    f"cannot run gpg binary {self.binary!r} for home {self.home}: {e}; "
                    "install GnuPG 2.2+, or set <side>.gpg_binary to its gpg"
                ) from None
        return self._pg

    @property
    def gpg_option(self) -> str:
        """`` --gpg-binary X`` for a ``diode keys`` command a fix names, when this is not the
        default gpg (those commands read no config); else nothing."""
        return "" if self.binary == "gpg" else f" --gpg-binary {self.binary}"

    def _child_env(self) -> dict[str, str]:
        """gpg's environment: C locale, and never the variable holding the passphrase."""
        env = _c_env()
        if self.passphrase is not None and self.passphrase.env_name:
            env.pop(self.passphrase.env_name, None)  # gpg and its agent never see it
        return env

    def _run(
        self,
        args: Sequence[str],
        *,
        data: bytes | None = None,
        stdin_fd: int | None = None,
        stdout_fd: int | None = None,
        secret: bool = False,
        timeout: float | None = None,
    ) -> _Result:
        """Run gpg with status lines on stderr; stdin is ``data`` (piped), the open file
        ``stdin_fd`` (read from its current offset), or closed. stdout is captured, or goes
        to the open file ``stdout_fd`` (then ``_Result.stdout`` is empty).

        ``secret``: the call uses a secret key, so the passphrase (if any) goes down a pipe.
        ``timeout``: seconds (default ``self.timeout``); past it gpg's process group is killed
        and GpgTimeout raised.
        """
        cmd = [
            self.binary,
            "--homedir",
            str(self.home),
            "--batch",
            "--no-tty",
            "--pinentry-mode",
            "loopback",
            "--status-fd",
            "2",
            "--no-auto-key-retrieve",  # red is air-gapped; never reach for a keyserver
        ]
        env = self._child_env()
        pass_fds: tuple[int, ...] = ()
        if secret and self.passphrase is not None:
            rfd = _passphrase_pipe(self.passphrase.secret())
            pass_fds = (rfd,)
            cmd += ["--passphrase-fd", str(rfd)]  # a descriptor number, never the secret
        cmd += list(args)
        stdin: int | None = subprocess.DEVNULL
        if stdin_fd is not None:
            stdin = stdin_fd
        elif data is not None:
            stdin = subprocess.PIPE
        seconds = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=subprocess.PIPE if stdout_fd is None else stdout_fd,
                stderr=subprocess.PIPE,
                env=env,
                pass_fds=pass_fds,
                process_group=0,  # its own group: a timeout kills gpg and whatever it forked
            )
        except FileNotFoundError:
            raise CryptoError(
                f"gpg binary {self.binary!r} not found (home {self.home}); install GnuPG 2.2+, "
                "or set <side>.gpg_binary to its gpg"
            ) from None
        finally:
            for fd in pass_fds:
                os.close(fd)
        with proc:
            try:
                out, err = proc.communicate(input=data, timeout=seconds)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise GpgTimeout(
                    f"gpg (home {self.home}) did not finish within {seconds:.0f} s and was "
                    "killed with its process group: is gpg-agent hung? "
                    f"(`{gnupg_tool(self.binary, 'gpgconf')} --homedir {self.home} --kill "
                    "gpg-agent`)",
                    seconds,
                ) from None
            except BaseException:
                _kill_group(proc)  # interrupted: never leave gpg writing behind us
                raise
        status, diag = parse_status(err.decode("utf-8", "replace"))
        return _Result(rc=proc.returncode, status=status, diag=diag, stdout=out or b"")

    def open_timeout(self, size: int) -> float:
        """Seconds opening a message of ``size`` bytes may take: ``open_base_seconds`` plus
        ``size`` at ``OPEN_BYTES_PER_SECOND``, at most ``timeout``."""
        return min(self.timeout, self.open_base_seconds + max(size, 0) / OPEN_BYTES_PER_SECOND)

    def _hint(self) -> str:
        if len(str(self.home / "S.gpg-agent.extra")) > _SOCKET_PATH_LIMIT:
            return (
                f" (note: the home path {self.home} is long; gpg-agent sockets must stay "
                "under 108 bytes: use a shorter path)"
            )
        return ""

    # ------------------------------------------------------------------ keys

    def _list(self, *, secret: bool) -> list[dict[str, object]]:
        try:
            return list(self._gnupg.list_keys(secret=secret))
        except (OSError, ValueError) as e:
            raise CryptoError(f"cannot list keys in GnuPG home {self.home}: {e}") from None

    def fingerprints(self, *, secret: bool = False) -> list[str]:
        """Primary-key fingerprints (uppercase hex) of the public or secret keyring."""
        return [str(k["fingerprint"]).upper() for k in self._list(secret=secret)]

    def require_keys(
        self,
        fprs: Iterable[str],
        *,
        secret: bool = False,
        purpose: str,
        capability: Literal["sign", "encrypt"] | None = None,
    ) -> None:
        """Fail fast, before any traffic, when a configured key is missing or unusable.

        Raises KeyMissingError naming every missing fingerprint, and CryptoError for keys
        that are present but expired, revoked, disabled or lack ``capability``.
        """
        wanted = [normalize_fingerprint(f, what=purpose) for f in fprs]
        public = {str(k["fingerprint"]).upper(): k for k in self._list(secret=False)}
        have = set(self.fingerprints(secret=True)) if secret else set(public)
        kind = "secret" if secret else "public"
        missing = [f for f in wanted if f not in have]
        unusable: list[str] = []
        for f in wanted:
            key = public.get(f)
            if key is None:
                continue
            validity = str(key.get("trust") or "")
            caps = str(key.get("cap") or "")
            if validity == "r":
                unusable.append(f"{f} is revoked")
            elif validity == "e":
                unusable.append(f"{f} is expired (extend it: gpg --quick-set-expire {f} never)")
            elif validity == "i" or "D" in caps:
                unusable.append(f"{f} is invalid or disabled")
            elif capability == "sign" and "S" not in caps:
                unusable.append(f"{f} cannot sign (capabilities {caps!r})")
            elif capability == "encrypt" and "E" not in caps:
                unusable.append(f"{f} has no usable encryption subkey (capabilities {caps!r})")
        if missing:
            if secret:  # a secret key never travels: it is made where it is used
                fix = (
                    "Fix: is this the right GnuPG home for this side? A secret key is created on "
                    "the host that uses it (`diode keys init --side black|red --home "
                    f"{self.home}{self.gpg_option}`) and never copied from another host; then "
                    "pin the "
                    "fingerprint it prints in the config"
                )
            else:
                fix = (
                    "Fix: import the other side's public key file (.asc, exported by its "
                    f"`diode keys init`): `diode keys import --home {self.home}"
                    f"{self.gpg_option} FILE.asc`; "
                    "if the fingerprint in the config is wrong, correct it"
                )
            lines = [
                f"{purpose}: {len(missing)} {kind} key(s) missing from GnuPG home {self.home}:",
                *(f"  - {f}" for f in missing),
                *(f"  - {u}" for u in unusable),
                fix,
            ]
            raise KeyMissingError("\n".join(lines))
        if unusable:
            raise CryptoError(
                f"{purpose}: unusable key(s) in GnuPG home {self.home}: "
                + "; ".join(unusable)
                + "; replace the key (`diode keys init`) or fix it with gpg"
            )

    def import_keys(self, armored: bytes | str) -> list[str]:
        """Import keys (or a revocation certificate); returns the primary fingerprints.

        Keys already present count as imported; a bare revocation certificate returns [].
        """
        data = armored.encode("ascii") if isinstance(armored, str) else armored
        try:
            res = self._gnupg.import_keys(data)
        except (OSError, ValueError) as e:
            raise CryptoError(f"cannot import keys into {self.home}: {e}") from None
        fprs = list(dict.fromkeys(str(f).upper() for f in res.fingerprints if f))
        if not fprs and not int(getattr(res, "n_revoc", 0) or 0):
            raise CryptoError(
                f"no OpenPGP key found to import into GnuPG home {self.home} "
                f"({res.summary()}); pass an armored key such as `pub/black.asc`"
            )
        return fprs

    def export_public(self, fpr: str) -> str:
        """ASCII-armored public key (with its subkeys) of one fingerprint."""
        fpr = normalize_fingerprint(fpr)
        armored = str(self._gnupg.export_keys(fpr, armor=True))
        if "BEGIN PGP PUBLIC KEY BLOCK" not in armored:
            raise KeyMissingError(
                f"cannot export public key {fpr}: not in GnuPG home {self.home}; "
                f"list keys with `{self.binary} --homedir {self.home} --list-keys`"
            )
        return armored

    def _new_key_protection(self) -> tuple[list[str], bool]:
        """gpg arguments that protect a new key with ``self.passphrase``, or with none."""
        if self.passphrase is None:
            return ["--passphrase", ""], False  # the empty string is no secret
        return [], True

    def quick_gen_key(self, uid: str, *, algo: str, usage: str, expire: str = "never") -> str:
        """Create a primary key (``--quick-gen-key``); returns its fingerprint.

        Protected by ``self.passphrase`` if set, else without a passphrase. Its preferences
        are ``KEY_PREFERENCES`` whatever the gpg release or its defaults: no AEAD feature.
        """
        prot, secret = self._new_key_protection()
        prefs = ["--default-preference-list", KEY_PREFERENCES]  # never advertises AEAD
        args = [*prot, *prefs, "--yes", "--quick-gen-key", "--", uid, algo, usage, expire]
        res = self._run(args, secret=secret)  # --yes: a uid may repeat (keys.init_side guards)
        created = [a for a in res.all("KEY_CREATED") if a and a[0] in ("P", "B")]
        if res.rc != 0 or not created:
            raise CryptoError(
                f"cannot create a {algo} key {uid!r} in GnuPG home {self.home}: "
                f"{res.reason()}{self._hint()}"
            )
        return created[0][1].upper()

    def quick_add_key(self, fpr: str, *, algo: str, usage: str, expire: str = "never") -> str:
        """Add a subkey (``--quick-add-key``, protected like its primary); returns its fpr."""
        fpr = normalize_fingerprint(fpr)
        prot, secret = self._new_key_protection()
        res = self._run([*prot, "--quick-add-key", fpr, algo, usage, expire], secret=secret)
        created = [a for a in res.all("KEY_CREATED") if a and a[0] == "S"]
        if res.rc != 0 or not created:
            raise CryptoError(
                f"cannot add a {algo} {usage} subkey to {fpr} in GnuPG home {self.home}: "
                f"{res.reason()}"
            )
        return created[0][1].upper()

    # ------------------------------------------------------------------ passphrases

    def keygrips(
        self, fpr: str, *, capability: Literal["sign", "encrypt"] | None = None
    ) -> list[str]:
        """Keygrips of the usable secret (sub)keys of ``fpr`` (that can ``capability``)."""
        fpr = normalize_fingerprint(fpr)
        res = self._run(["--with-colons", "--with-keygrip", "--list-secret-keys", "--", fpr])
        want = {"sign": "s", "encrypt": "e", None: ""}[capability]
        grips: list[str] = []
        take = False
        for line in res.stdout.decode("utf-8", "replace").splitlines():
            f = line.split(":")
            if f[0] in ("sec", "ssb") and len(f) > 11:
                take = f[1] not in ("r", "e", "i", "d") and want in f[11]
            elif f[0] == "grp" and len(f) > 9 and take:
                grips.append(f[9].upper())
                take = False
        return grips

    def _agent(self, *commands: str) -> list[str]:
        """Run gpg-agent commands (``gpg-connect-agent``) for this home; returns its lines."""
        binary = gnupg_tool(self.binary, "gpg-connect-agent")
        try:
            proc = subprocess.run(
                [binary, "--homedir", str(self.home), *commands, "/bye"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                env=self._child_env(),
                check=False,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CryptoError(
                f"cannot ask gpg-agent of GnuPG home {self.home} ({binary}): {e}{self._hint()}"
            ) from None
        lines = proc.stdout.decode("utf-8", "replace").splitlines()
        errors = [ln for ln in lines if ln.startswith("ERR ")]
        if proc.returncode != 0 or errors:
            raise CryptoError(
                f"gpg-agent of GnuPG home {self.home} refused {commands[0].split()[0]}: "
                f"{'; '.join(errors) or proc.stderr.decode('utf-8', 'replace').strip()}"
                f"{self._hint()}"
            )
        return lines

    def needs_passphrase(self, fpr: str, *, capability: Literal["sign", "encrypt"]) -> bool:
        """Whether the secret key that would ``capability`` for ``fpr`` is passphrase-protected.

        Asked from gpg-agent's key info, so a passphrase it still caches does not hide it.
        Raises KeyMissingError when no usable secret key of ``fpr`` can ``capability``.
        """
        grips = self.keygrips(fpr, capability=capability)
        if not grips:
            raise KeyMissingError(
                f"no usable secret key of {normalize_fingerprint(fpr)} that can {capability} "
                f"in GnuPG home {self.home}; list them with "
                f"`{self.binary} --homedir {self.home} --list-secret-keys`"
            )
        protection = {}
        for line in self._agent("KEYINFO --list"):
            words = line.split()
            if len(words) > 7 and words[:2] == ["S", "KEYINFO"]:
                protection[words[2].upper()] = words[7]
        return any(protection.get(g) == "P" for g in grips)

    def forget_passphrase(self, fpr: str) -> None:
        """Drop every cached passphrase of ``fpr``'s secret keys from gpg-agent."""
        grips = self.keygrips(fpr)
        if grips:
            self._agent(*(f"CLEAR_PASSPHRASE --mode=normal {g}" for g in grips))

    def check_unlock(
        self,
        fpr: str,
        *,
        capability: Literal["sign", "encrypt"],
        purpose: str,
        fix: str = "configure <side>.passphrase_file or the variable named by "
        "<side>.passphrase_env",
    ) -> None:
        """Fail fast when the secret key cannot be used unattended: a test sign or decrypt.

        A protected key without a configured passphrase (``fix`` says how to configure
        one), or with a wrong one, raises CryptoError; messages never hold the passphrase. A
        passphrase gpg-agent still caches is forgotten first (it would hide a wrong one
        until the cache expires, in the middle of a run), and again after the test, so the
        agent does not keep the key unlocked (every later call passes the passphrase itself).
        """
        fpr = normalize_fingerprint(fpr, what=purpose)
        protected = self.needs_passphrase(fpr, capability=capability)
        if protected and self.passphrase is None:
            raise CryptoError(
                f"{purpose}: key {fpr} in GnuPG home {self.home} is passphrase-protected and "
                f"no passphrase is configured: {fix}"
            )
        if protected:
            self.forget_passphrase(fpr)
        try:
            self._probe_unlock(fpr, capability=capability, purpose=purpose)
        finally:
            if protected:  # the test unlocked it: gpg-agent must not keep it unlocked after
                self.forget_passphrase(fpr)

    def _probe_unlock(
        self, fpr: str, *, capability: Literal["sign", "encrypt"], purpose: str
    ) -> None:
        """One test signature or decryption with ``fpr``; CryptoError if it fails."""
        probe = b"diode-bridge key check"
        if capability == "sign":
            res = self._run(
                ["--local-user", fpr, "-z", "0", "--sign", "--output", "-"],
                data=probe,
                secret=True,
            )
            ok = res.rc == 0 and res.has("SIG_CREATED")
        else:
            enc = self._test_encrypt([fpr], probe)
            if enc.rc != 0 or not enc.stdout:
                raise CryptoError(f"{purpose}: cannot encrypt to {fpr}: {enc.reason()}")
            res = self._run(["--decrypt", "--output", "-"], data=enc.stdout, secret=True)
            ok = res.rc == 0 and res.has("DECRYPTION_OKAY") and res.stdout == probe
        if not ok:
            raise CryptoError(
                f"{purpose}: test {'signature' if capability == 'sign' else 'decryption'} "
                f"with key {fpr} in GnuPG home {self.home} failed: {res.reason()}"
                f"{_passphrase_hint(res, self.passphrase)}{self._hint()}"
            )

    def _test_encrypt(self, recipients: Sequence[str], data: bytes) -> _Result:
        """Encrypt ``data`` to ``recipients`` (fingerprints) as a check, no secret key used:
        trust from the pinned fingerprints, no compression, no ``encrypt-to`` reader."""
        args = ["--trust-model", "always", "--no-encrypt-to", "-z", "0"]
        for r in recipients:
            args += ["--recipient", r]
        return self._run([*args, "--encrypt", "--output", "-"], data=data)

    # ------------------------------------------------------------------ seal (black)

    def _seal_args(
        self,
        *,
        signer: str,
        recipients: Sequence[str],
        encrypt: bool,
        hide_recipients: bool,
    ) -> list[str]:
        signer = normalize_fingerprint(signer, what="signer")
        args = [
            # Sound ONLY because every fingerprint is pinned in the configuration: we do
            # not rely on the web of trust to pick keys, the operator did that.
            "--trust-model",
            "always",
            "-z",
            "0",  # bundles are zstd Parquet already; compression costs 5x throughput
            "--set-filename",
            "",  # do not leak local temp names in the literal packet
            "--no-encrypt-to",  # a gpg.conf encrypt-to must not add a silent reader
            "--local-user",
            signer,
        ]
        if encrypt:
            rcpts = [normalize_fingerprint(r, what="recipient") for r in recipients]
            if not rcpts:
                raise CryptoError(
                    "encrypt=True needs at least one recipient fingerprint "
                    "(channels[].recipients), or encrypt=False for a signed-only message"
                )
            args.append("--throw-keyids" if hide_recipients else "--no-throw-keyids")
            for r in rcpts:
                args += ["--recipient", r]
            args += ["--sign", "--encrypt"]
        else:
            args += ["--sign"]
        return args

    def _check_sealed(
        self, res: _Result, *, signer: str, recipients: Sequence[str], encrypt: bool, what: str
    ) -> None:
        ok = res.rc == 0 and res.has("SIG_CREATED") and (res.has("END_ENCRYPTION") or not encrypt)
        if not ok:
            hint = _passphrase_hint(res, self.passphrase)
            raise CryptoError(
                f"cannot seal {what} with signer {signer} in GnuPG home {self.home}: "
                f"{res.reason()}{hint}{self._hint()}; check the keys with "
                f"`{self.binary} --homedir {self.home} --list-keys` (recipients need public keys, "
                "the signer its secret key)"
            )
        aead = _aead_algo(res) if encrypt else None
        if aead is not None:
            raise CryptoError(
                f"refusing the sealed {what} (GnuPG home {self.home}): gpg encrypted it with "
                f"AEAD algorithm {aead}, not MDC: {_aead_fix(recipients)}"
            )

    def check_encryption_mode(self, recipients: Sequence[str], *, purpose: str) -> None:
        """Black, at start: CryptoError when gpg would encrypt to ``recipients`` with OCB
        (LibrePGP AEAD) instead of MDC; one test encryption, no secret key involved."""
        rcpts = [normalize_fingerprint(r, what=purpose) for r in recipients]
        if not rcpts:
            return
        res = self._test_encrypt(rcpts, b"diode-bridge encryption mode check")
        if res.rc != 0 or not res.has("END_ENCRYPTION"):
            raise CryptoError(
                f"{purpose}: test encryption in GnuPG home {self.home} failed: {res.reason()}"
            )
        aead = _aead_algo(res)
        if aead is not None:
            raise CryptoError(
                f"{purpose}: gpg in GnuPG home {self.home} would encrypt with AEAD algorithm "
                f"{aead} (OCB), not MDC: {_aead_fix(rcpts)}"
            )

    def seal(
        self,
        src: Path | bytes | memoryview,
        dst: Path,
        *,
        signer: str,
        recipients: Sequence[str],
        encrypt: bool = True,
        hide_recipients: bool = True,
    ) -> None:
        """Sign ``src`` with ``signer`` then encrypt it to all ``recipients``, into ``dst``.

        One OpenPGP message, binary, uncompressed (``-z 0``). ``encrypt=False`` writes a
        binary signed message instead. ``src`` is a file gpg streams itself, or bytes (any
        bytes-like object, e.g. a view of a pyarrow Buffer: no copy) that gpg reads from an
        anonymous in-memory file (``memfd``; a pipe where there is none): the plaintext never
        touches the disk, and feeding gpg costs one memory copy instead of a loop of 4 KiB
        pipe writes. ``dst`` is created 0600 (whatever the umask; an existing one is replaced)
        before gpg writes into it, fsynced, and neither renamed nor moved (the caller owns temp
        names). On failure ``dst`` is removed and CryptoError carries gpg's reason.
        """
        args = self._seal_args(
            signer=signer, recipients=recipients, encrypt=encrypt, hide_recipients=hide_recipients
        )
        dst = Path(dst)
        what = str(src) if isinstance(src, Path) else f"{memoryview(src).nbytes} bytes"
        # 0600 before gpg writes a byte
        out_fd = _private_output(dst, what=f"the sealed {what}", replace=True)
        try:
            out = [*args, "--output", "-"]
            if not isinstance(src, Path):
                res = self._seal_from_memory(out, memoryview(src), out_fd)
            else:
                res = self._run([*out, "--", str(src)], stdout_fd=out_fd, secret=True)
            self._check_sealed(
                res, signer=signer, recipients=recipients, encrypt=encrypt, what=what
            )
            os.fsync(out_fd)
        except BaseException:
            dst.unlink(missing_ok=True)
            raise
        finally:
            os.close(out_fd)

    def _seal_from_memory(self, args: list[str], view: memoryview, out_fd: int) -> _Result:
        """Run a seal whose plaintext is ``view``: gpg reads it from a memfd (a pipe where
        there is none) and writes the message to ``out_fd``."""
        if not hasattr(os, "memfd_create"):
            return self._run(args, data=view.tobytes(), stdout_fd=out_fd, secret=True)
        fd = os.memfd_create("diode-plaintext", os.MFD_CLOEXEC)
        try:
            write_all(fd, view)
            os.lseek(fd, 0, os.SEEK_SET)
            return self._run(args, stdin_fd=fd, stdout_fd=out_fd, secret=True)
        finally:
            os.close(fd)

    def seal_bytes(
        self,
        data: bytes,
        *,
        signer: str,
        recipients: Sequence[str],
        encrypt: bool = True,
        hide_recipients: bool = True,
    ) -> bytes:
        """``seal`` for small payloads (heartbeats), in memory."""
        args = self._seal_args(
            signer=signer, recipients=recipients, encrypt=encrypt, hide_recipients=hide_recipients
        )
        res = self._run([*args, "--output", "-"], data=data, secret=True)
        what = f"{len(data)} bytes"
        self._check_sealed(res, signer=signer, recipients=recipients, encrypt=encrypt, what=what)
        return res.stdout

    # ------------------------------------------------------------------ open (red)

    def _open_args(self, limit: int) -> list[str]:
        return [
            "--trust-model",
            "always",  # trust comes from the pinned fingerprints checked below
            "--max-output",
            str(limit),
            "--yes",
        ]

    def _judge(self, res: _Result, pinned: set[str], what: str) -> Opened:
        """The verdict on one decrypt+verify run (``bridge.crypto.verdict.judge``)."""
        return judge(res, pinned, what, home=self.home)

    def _pinned(self, pinned_signers: Sequence[str]) -> set[str]:
        pinned = {normalize_fingerprint(f, what="pinned signer") for f in pinned_signers}
        if not pinned:
            raise SignatureError(
                "no pinned signers: list the black signing key fingerprint(s) in "
                "link.black_signers; red accepts nothing unpinned"
            )
        return pinned

    def open(
        self,
        src: Path,
        dst: Path,
        *,
        pinned_signers: Sequence[str],
        max_output: int | None = None,
    ) -> Opened:
        """Decrypt (if encrypted) and verify ``src``; ``dst`` appears only if all is well.

        gpg writes to a hidden temp file beside ``dst``, created 0600 beforehand (whatever
        the umask; gpg only gets its descriptor); it is renamed (fsynced) only on a single
        GOOD signature whose primary fingerprint is in ``pinned_signers``, else it is deleted.
        ``max_output`` caps the plaintext (default: the size of ``src`` plus 1 MiB, since
        bundles are never compressed), defusing compression bombs. gpg gets
        ``open_timeout(size)`` seconds; past that it is killed, the temp file deleted and
        GpgTimeout raised.
        """
        pinned = self._pinned(pinned_signers)
        src, dst = Path(src), Path(dst)
        try:
            size = src.stat().st_size
        except OSError as e:
            raise CryptoError(f"cannot read bundle {src}: {e.strerror}") from None
        limit = max_output if max_output is not None else size + _OUTPUT_SLACK
        tmp = tmp_path_for(dst)
        out_fd = _private_output(tmp, what=f"the plaintext of {src}")  # 0600 before gpg runs
        try:
            try:
                res = self._run(
                    [*self._open_args(limit), "--output", "-", "--decrypt", "--", str(src)],
                    stdout_fd=out_fd,
                    secret=True,
                    timeout=self.open_timeout(size),
                )
                opened = self._judge(res, pinned, str(src))
                _check_length(res, os.fstat(out_fd).st_size, str(src))
                os.fsync(out_fd)
            finally:
                os.close(out_fd)
            os.replace(tmp, dst)  # fsynced above
            fsync_dir(dst.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.debug("opened %s signer=%s encrypted=%s", src, opened.signer_fpr, opened.encrypted)
        return opened

    def open_bytes(
        self, data: bytes, *, pinned_signers: Sequence[str], max_output: int | None = None
    ) -> tuple[bytes, Opened]:
        """``open`` for small messages (heartbeats), in memory; plaintext only if valid."""
        pinned = self._pinned(pinned_signers)
        limit = max_output if max_output is not None else len(data) + _OUTPUT_SLACK
        res = self._run(
            [*self._open_args(limit), "--output", "-", "--decrypt"],
            data=data,
            secret=True,
            timeout=self.open_timeout(len(data)),
        )
        what = f"message of {len(data)} bytes"
        opened = self._judge(res, pinned, what)
        _check_length(res, len(res.stdout), what)
        return res.stdout, opened
