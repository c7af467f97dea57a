"""Crypto (both sides): the passphrase of a protected key, read from a file or the environment.

The secret itself never enters the configuration, argv, logs or error messages: the config
names where it lives (``black.passphrase_file`` / ``black.passphrase_env``, same on red), this
module reads it, and ``Gpg`` hands it to gpg through a pipe (``--passphrase-fd``). A pickled
``Passphrase`` carries only its source and reads the secret again where it is unpickled.

A process that has read a passphrase never dumps core (``RLIMIT_CORE`` 0, and not dumpable
on Linux): the secret stays in its memory for the life of the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import resource
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from bridge.errors import ConfigError

__all__ = [
    "file_problem",
    "Passphrase",
    "resolve_passphrase",
    "check_env_name",
    "disable_core_dumps",
    "MAX_PASSPHRASE_BYTES",
]

log = logging.getLogger(__name__)

MAX_PASSPHRASE_BYTES = 4096
"""Longer is refused: the whole secret must fit one pipe write (the pipe buffer is 64 KiB)."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_PR_SET_DUMPABLE = 4  # <linux/prctl.h>
_dumps_disabled = False


def disable_core_dumps() -> None:
    """No core dump of this process from now on (its children inherit the limit).

    ``RLIMIT_CORE`` soft and hard 0 (cannot be raised again), and on Linux
    ``prctl(PR_SET_DUMPABLE, 0)``, which also stops a core_pattern pipe handler and ptrace
    by other processes of the same user (a child regains it when it execs). Once per
    process; a failure is logged, never raised: it costs protection, not the service.
    """
    global _dumps_disabled
    if _dumps_disabled:
        return
    _dumps_disabled = True
    done = []
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        done.append("RLIMIT_CORE 0")
    except (OSError, ValueError) as e:
        log.warning("could not disable core dumps (RLIMIT_CORE): %s", e)
    if sys.platform.startswith("linux"):
        try:
            _prctl(_PR_SET_DUMPABLE, 0)
            done.append("PR_SET_DUMPABLE 0")
        except (OSError, AttributeError) as e:
            log.warning("could not make the process non-dumpable (prctl): %s", e)
    log.debug("reading a key passphrase: core dumps disabled (%s)", ", ".join(done) or "none")


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    prctl.restype = ctypes.c_int
    if prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def check_env_name(name: str, where: str) -> str:
    """``name`` if it is an environment variable NAME; else ConfigError naming ``where`` only:
    what was given may be the passphrase itself, so it is never repeated."""
    if not _ENV_NAME.fullmatch(name):
        raise ConfigError(
            f"{where} takes the NAME of an environment variable ([A-Za-z_][A-Za-z0-9_]*, at "
            "most 128 characters), and what was given is not one (not repeated here: it may be "
            "a passphrase). Export the passphrase in a variable, e.g. DIODE_BLACK_PASSPHRASE, "
            "and pass that name; never the passphrase itself"
        )
    return name


def file_problem(st: os.stat_result, path: Path | str, source: str) -> str | None:
    """What is wrong with a passphrase file whose status is ``st`` (``source``: its words for
    messages), with the fix; None if nothing. Only a regular file is told to be chmodded: a
    device, FIFO or directory (``/dev/null``) is named as the wrong kind of file, never handed
    to ``chmod``, which would change it for the whole host."""
    if not stat.S_ISREG(st.st_mode):
        return (
            f"{source} is not a regular file (a device, FIFO or directory): write the "
            "passphrase to a file of its own (`install -m 600 /dev/null FILE`, then the "
            "passphrase in it) and point passphrase_file at it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return f"{source} is accessible by group/others (mode {mode:04o}): run `chmod 600 {path}`"
    return None


class Passphrase:
    """Where a key's passphrase comes from; ``secret()`` reads it (once per process)."""

    __slots__ = ("path", "env_name", "_secret")

    def __init__(self, *, path: Path | None = None, env_name: str | None = None) -> None:
        if (path is None) == (env_name is None):
            raise ValueError("a passphrase comes from exactly one of a file or an env variable")
        self.path = None if path is None else Path(path)
        self.env_name = None if env_name is None else check_env_name(env_name, "passphrase_env")
        self._secret: bytes | None = None

    @property
    def source(self) -> str:
        """Human words for the source, for messages (never the secret)."""
        if self.path is not None:
            return f"passphrase file {self.path}"
        return f"environment variable {self.env_name}"

    def __repr__(self) -> str:
        return f"Passphrase(<{self.source}>)"

    __str__ = __repr__

    def __getstate__(self) -> dict[str, object]:
        return {"path": self.path, "env_name": self.env_name}  # never the secret

    def __setstate__(self, state: dict[str, object]) -> None:
        self.path = state["path"]  # type: ignore[assignment]
        self.env_name = state["env_name"]  # type: ignore[assignment]
        self._secret = None

    def secret(self, environ: Mapping[str, str] | None = None) -> bytes:
        """The passphrase bytes, validated; ConfigError (naming the source only) if unusable."""
        if self._secret is None:
            disable_core_dumps()  # before the secret is in this process's memory
            raw = self._read_file() if self.path is not None else self._read_env(environ)
            self._secret = self._check(raw)
        return self._secret

    def _read_file(self) -> bytes:
        assert self.path is not None
        fix = f"create it with `install -m 600 /dev/null {self.path}` and write the passphrase"
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ConfigError(f"{self.source} does not exist: {fix}") from None
        except OSError as e:
            raise ConfigError(f"cannot open {self.source}: {e.strerror}; {fix}") from None
        try:
            st = os.fstat(fd)
            problem = file_problem(st, self.path, self.source)
            if problem is not None:
                raise ConfigError(problem)
            os.set_blocking(fd, True)
            if st.st_size > MAX_PASSPHRASE_BYTES + 2:
                raise ConfigError(
                    f"{self.source} holds {st.st_size} bytes: a passphrase is one line of at "
                    f"most {MAX_PASSPHRASE_BYTES} bytes"
                )
            data = os.read(fd, MAX_PASSPHRASE_BYTES + 3)
        finally:
            os.close(fd)
        if data.endswith(b"\r\n"):
            return data[:-2]
        return data[:-1] if data.endswith(b"\n") else data

    def _read_env(self, environ: Mapping[str, str] | None) -> bytes:
        assert self.env_name is not None
        env = os.environ if environ is None else environ
        value = env.get(self.env_name)
        if value is None:
            raise ConfigError(f"{self.source} is not set")
        return os.fsencode(value)

    def _check(self, raw: bytes) -> bytes:
        if not raw:
            raise ConfigError(
                f"{self.source} is empty: write the key's passphrase there, or remove the "
                "setting if the key has none"
            )
        if len(raw) > MAX_PASSPHRASE_BYTES:
            raise ConfigError(f"{self.source}: longer than {MAX_PASSPHRASE_BYTES} bytes")
        if any(c in raw for c in (b"\n", b"\r", b"\0")):
            raise ConfigError(
                f"{self.source}: a passphrase must be ONE line without NUL bytes (gpg reads "
                "it up to the first newline)"
            )
        return raw


def resolve_passphrase(
    *,
    file: Path | None,
    env_name: str | None,
    side: str,
    environ: Mapping[str, str] | None = None,
) -> Passphrase | None:
    """The configured passphrase source of one side, read and checked now; None if none.

    ``file`` wins when set; then the variable ``env_name`` if it is set. Both at once is
    ambiguous and refused (ConfigError), as is an unreadable or group/world-readable file.
    """
    env = os.environ if environ is None else environ
    in_env = env_name is not None and env_name in env
    if file is not None and in_env:
        raise ConfigError(
            f"{side}.passphrase_file is set AND the environment variable {env_name} is set: "
            f"keep one source of the {side} key passphrase (unset {env_name}, or remove "
            f"{side}.passphrase_file)"
        )
    if file is not None:
        pp = Passphrase(path=file)
    elif in_env:
        pp = Passphrase(env_name=env_name)
    else:
        return None
    pp.secret(env)  # fail fast on an unreadable source
    return pp
