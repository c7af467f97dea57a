"""Diode, file drop: staged, atomic delivery into the outbox, an archive with retention, resend.

    <staging>/.<name>.<12 hex>.tmp     written and fsynced here (gpg output, heartbeats, re-drops)
        --rename(2)--> <outbox>/<name>  whole or not at all: a vendor's mover never sees a part
    <archive>/<channel>/<name>         a copy of every bundle, made before the rename (its
                                       temp is hidden beside it: the archive may be on another
                                       file system, and no mover looks there); with
                                       ``black.archive_mode = "link"`` a hard link instead
                                       (same inode as the outbox file: one write, one fsync)

The staging dir (``black.staging_dir``, default ``.<outbox name>.staging`` beside the outbox)
must be on the outbox's file system and mount, for the rename to be atomic (rename(2) refuses
to cross a bind mount, which keeps the device number); that is checked here by probing a rename
that creates nothing (also for ``black.udp_outbox``, where the UDP channels' files go when it
is set). A
directory black cannot write (permissions, an immutable attribute, a read-only mount) is found
at start by ``write_refusal``, which creates nothing visible in a drop dir. Black's own
directories (archive, staging, state, spool, checkpoint, GnuPG home) must not be inside the
outbox or the UDP outbox, nor the outbox inside the archive: refused here, before anything is
created. A mover may take
or delete any file of the outbox, dot-files included, at any moment: black never writes, reads
or stats a file once it is in the outbox, so a file gone right after its rename is a success,
and ``resend`` re-drops from the archive through the staging dir again.

Coordination (``<staging>/.drop.lock``): only the black job removes temp files, at start-up
(:meth:`Outbox.sweep_stale_temps`, exclusive lock), and each re-drop (``diode resend``, crash
recovery) and each ``archive_mode = "link"`` probe (every Outbox built in that mode) holds the
lock shared while its temp file exists. The job's own deliveries need no lock: its temps are
its own, and the state-dir run lock keeps a second job away. So ``diode resend`` runs beside
a running job, waiting at most for a start-up sweep. Pruning the archive needs no lock
either: a resend counts a bundle pruned under it as missing.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from bridge.config import Config
from bridge.errors import BundleNameError, ConfigError, StateError, TransportError
from bridge.fsutil import (
    DIR_MODE,
    FILE_MODE,
    WRITE_PROBE,
    durable_mkdir,
    exclusive_lock,
    fsync_dir,
    os_error_text,
    shared_lock,
    tmp_path_for,
    write_new_file,
    write_refusal,
)
from bridge.logs import get_logger, log_event
from bridge.protocol.naming import CHANNEL_RE, MAX_SEQ, parse_bundle_name

__all__ = [
    "DROP_LOCK",
    "LEFT_BEHIND",
    "LOCK_WAIT_SECONDS",
    "Outbox",
    "ResendReport",
    "cannot_create",
    "default_staging",
    "drop_dir_mode",
    "not_writable",
    "rename_refusal",
]

log = get_logger("bridge.diode.file_drop")
_TEMP_RE = re.compile(r"^\.[A-Za-z0-9._-]+\.[0-9a-f]{12}\.tmp$")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_NO_RANGE_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})
_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})

DROP_LOCK = ".drop.lock"
"""The lock file in the staging dir (see the module docstring)."""
OUTBOX_DIR_MODE = 0o770
"""The outbox only: black and the mover's group may add and remove files, others nothing."""
LOCK_WAIT_SECONDS = 120.0
"""How long a re-drop waits for a start-up sweep, and a sweep for one re-drop, by default."""
_PROBE_NAME = "archive-link-probe"
"""Base name of the ``archive_mode = "link"`` check's files (temp names: ``.<it>.<hex>.tmp``)."""
_RENAME_PROBE = "rename-probe"
"""Base name of the absent file the staging check renames (:func:`rename_refusal`)."""
_PROBE_ATTEMPTS = 3
"""Probes whose file vanished before the link (removed under us) before giving up."""
_ROOT_PROBES = (f".{_PROBE_NAME}.", f".{WRITE_PROBE}.")
"""The temp files a crash may leave in the archive root (the sweep removes them)."""

_SWEEP_HINT = (
    "a `diode resend` is re-dropping a bundle through the staging dir; let it finish (or stop "
    "it) and start the job again"
)
_REDROP_HINT = (
    "the black job holds it only while it sweeps stale temp files at start-up, which takes "
    "moments; if it lasts, something else holds it"
)


def default_staging(outbox: Path) -> Path:
    """``<outbox parent>/.<outbox name>.staging``: beside the outbox, on its file system."""
    outbox = Path(outbox)
    return outbox.parent / f".{outbox.name}.staging"


def rename_refusal(src_dir: Path, dst_dir: Path) -> OSError | None:
    """Why rename(2) would refuse to move a file from ``src_dir`` into ``dst_dir``, or None.

    Nothing is created, in ``dst_dir`` least of all (a mover may take any file there, dot-files
    included): the probe renames an absent name. The kernel checks that both directories are
    on one mount (EXDEV otherwise: another file system, or a bind mount of the same one, whose
    st_dev agrees), and that mount writable (EROFS), before it looks the name up: ENOENT means
    a real file would get that far. A missing directory also answers ENOENT (check first).
    """
    name = tmp_path_for(Path(_RENAME_PROBE)).name
    try:
        os.rename(src_dir / name, dst_dir / name)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e
    raise StateError(  # a random name: only something writing black's own dir could do this
        f"the rename probe {src_dir / name} existed and is now {dst_dir / name}: something "
        f"else writes files in {src_dir}; stop it, remove that file and start again"
    )


LEFT_BEHIND = {
    "spool_dir": "the channel's messages not shipped yet stay there and are reported lost",
    "archive": "the channel's archived bundles stay there, out of reach of resend and of "
    "crash recovery",
}
"""What pointing ``black.<key>`` elsewhere leaves in a channel's folder (:func:`not_writable`)."""


def drop_dir_mode(key: str) -> int:
    """Black, file drop: the mode black makes ``black.<key>`` with (the outbox: group-writable
    for the mover; the UDP outbox, staging and archive: black's own)."""
    return OUTBOX_DIR_MODE if key == "outbox" else DIR_MODE


def cannot_create(key: str, path: Path | str, why: str, mode: int) -> str:
    """Black, start: what to tell when ``black.<key>`` ``path`` cannot be made (``why``): the
    fix, with the ``mode`` black makes it with."""
    return (
        f"cannot create black.{key} {path}: {why}; create it (mode {mode:o}) for the user "
        f"running black, or point black.{key} elsewhere"
    )


def not_writable(
    key: str, d: Path, e: OSError, *, mode: int | None = None, channel: str | None = None
) -> str:
    """What to tell when ``black.<key>`` ``d`` refused black's files (``e``, from
    ``write_refusal`` or a delivery): the key, the path, the uid, the reason and the fix.

    ``mode``: the mode black makes ``d`` with (default :func:`drop_dir_mode`). ``channel``:
    ``d`` is that channel's folder inside ``black.<key>`` (spool, archive), whose files stay
    behind if ``black.<key>`` is pointed elsewhere: the message says which.
    """
    mode = drop_dir_mode(key) if mode is None else mode
    if e.errno == errno.EROFS:
        return (
            f"black.{key} {d} is on a read-only file system: black writes there. Mount it "
            f"read-write, or point black.{key} to a writable directory"
        )
    why = e.strerror or str(e)
    if e.errno == errno.EPERM:
        why += ": an immutable or append-only attribute (lsattr -d) refuses even root"
    uid = os.getuid()
    if channel is not None:
        left = LEFT_BEHIND.get(key, "the channel's files stay there")
        return (
            f"black.{key} {d} is not writable by the user running black (uid {uid}; {why}): it "
            f"is the folder of channel {channel!r}; give that user write access to it and to "
            f"the files in it (e.g. `chown -R {uid} {d}`, mode {mode:04o}), or point "
            f"black.{key} elsewhere ({left})"
        )
    who = "e.g. the mover's group" if key == "outbox" else "e.g. its owner"
    return (
        f"black.{key} {d} is not writable by the user running black (uid {uid}; {why}): "
        f"give that user write access ({who}, mode {mode:04o}), or point black.{key} elsewhere"
    )


@dataclass
class ResendReport:
    """What a resend re-dropped and what it could not find in the archive."""

    resent: list[str]
    """File names re-dropped, by bundle seq."""
    missing: list[tuple[int, int]]
    """Bundle seq ranges ``(first, last)``, inclusive and ascending, not in the archive (or
    pruned during the resend)."""


def _copy_fd(src: int, dst: int) -> int:
    """Copy all of ``src`` into ``dst`` in the kernel (a reflink where the file system can)."""
    size = os.fstat(src).st_size
    off = 0
    try:
        while off < size:
            n = os.copy_file_range(src, dst, size - off, off, off)
            if n == 0:
                break
            off += n
    except OSError as e:
        if e.errno not in _NO_RANGE_COPY:
            raise
        os.lseek(dst, off, os.SEEK_SET)
        while off < size:
            n = os.sendfile(dst, src, off, size - off)
            if n == 0:
                break
            off += n
    if off != size:
        raise OSError(errno.EIO, f"short copy: {off} of {size} bytes")
    return size


def _copy_to_new(src: int, dst: Path) -> int:
    """Copy ``src`` into the new file ``dst`` (FILE_MODE, fsynced); returns the size."""
    fd = os.open(dst, _CREATE, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        size = _copy_fd(src, fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


class Outbox:
    """The black outbox of a file diode, with its staging dir and its archive.

    ``channel_dirs`` sends some channels' files to another directory instead of the outbox
    (``black.udp_outbox``: the UDP channels'), on the same file system and staging dir.
    """

    def __init__(
        self,
        outbox: Path,
        archive: Path,
        *,
        retention_days: float,
        staging: Path | None = None,
        lock_wait: float = LOCK_WAIT_SECONDS,
        channel_dirs: Mapping[str, Path] | None = None,
        archive_link: bool = False,
        own_dirs: Mapping[str, Path] | None = None,
    ) -> None:
        """``own_dirs``: black's other directories by config key (``from_config``: state,
        spool, checkpoint, GnuPG home), refused inside the outbox like the archive."""
        self.outbox = Path(outbox)
        self.archive = Path(archive)
        self.staging = Path(staging) if staging is not None else default_staging(self.outbox)
        self.channel_dirs = {c: Path(d) for c, d in (channel_dirs or {}).items()}
        self.retention_seconds = retention_days * 86400.0
        self.lock_wait = lock_wait
        self.lock_path = self.staging / DROP_LOCK
        self._check_own_dirs_place({"archive": self.archive, **(own_dirs or {})})
        for key, d in [*self._drop_dirs(), ("archive", self.archive)]:
            self._mkdir(key, d)
        self._check_staging_place()
        self._mkdir("staging_dir", self.staging)
        self._check_staging_device()
        self.archive_link = archive_link
        if archive_link:
            self._check_archive_link()
        self._archive_dirs: set[str] = set()

    @classmethod
    def from_config(cls, cfg: Config, *, lock_wait: float = LOCK_WAIT_SECONDS) -> Outbox:
        """The outbox of a configuration (outbox, udp_outbox, archive, staging, retention)."""
        black = cfg.black
        return cls(
            Path(black.outbox),
            Path(black.archive),
            retention_days=black.archive_retention_days,
            staging=black.staging_dir,
            lock_wait=lock_wait,
            channel_dirs=cfg.outbox_dirs(),
            archive_link=black.archive_mode == "link",
            own_dirs={
                "state_dir": Path(black.state_dir),
                "spool_dir": Path(black.spool_dir),
                "checkpoint_dir": Path(black.checkpoint_dir),
                "gnupg_home": Path(black.gnupg_home),
            },
        )

    def dir_for(self, channel: str) -> Path:
        """Where ``channel``'s files appear: the outbox, or its own directory."""
        return self.channel_dirs.get(channel, self.outbox)

    def _drop_dirs(self) -> list[tuple[str, Path]]:
        """``(config key, directory)`` of every place files appear for a mover or the sender."""
        extra = sorted({d for d in self.channel_dirs.values() if d != self.outbox})
        return [("outbox", self.outbox)] + [("udp_outbox", d) for d in extra]

    @staticmethod
    def _mkdir(key: str, d: Path) -> None:
        """Black, start: make drop dir, archive or staging ``d`` (``black.<key>``) with its
        mode; ConfigError with the fix if it cannot be made."""
        # the outbox is shared with the vendor's mover (same group): it must be able to take
        # (delete) files there; archive, staging and the UDP outbox stay black's own
        mode = drop_dir_mode(key)
        try:
            durable_mkdir(d, mode=mode)
        except OSError as e:
            raise ConfigError(cannot_create(key, d, e.strerror or str(e), mode)) from None

    def _check_own_dirs_place(self, own: Mapping[str, Path]) -> None:
        """ConfigError if one of black's own directories (``own``: config key -> directory) is
        a drop dir or inside one, or a drop dir is inside the archive: a mover takes every file
        of the outbox, the UDP sender every file of its outbox (the archive's copies, the
        journal, temp files being written), and the archive pruner deletes the old files of
        every folder of the archive."""
        drops = [(key, d, d.resolve()) for key, d in self._drop_dirs()]
        for key, place in own.items():
            p = Path(place).resolve()
            for dkey, d, dr in drops:
                if p != dr and dr not in p.parents:
                    continue
                beside = d.parent / Path(place).name
                if beside.resolve() == dr:
                    beside = d.parent / key
                raise ConfigError(
                    f"black.{key} {place} is inside black.{dkey} {d}: whatever takes the files "
                    f"of black.{dkey} (the diode's mover, the UDP sender) would take black's own "
                    f"files and see them half-written. Set black.{key} to a directory outside "
                    f"black.{dkey}, e.g. {beside}, and move its contents there"
                )
        archive = self.archive.resolve()
        for dkey, d, dr in drops:
            if archive in dr.parents:
                raise ConfigError(
                    f"black.{dkey} {d} is inside black.archive {self.archive}: the archive "
                    f"pruner deletes old files in every folder of the archive, files waiting "
                    f"for the mover included. Put black.{dkey} beside the archive, e.g. "
                    f"{self.archive.parent / d.name}"
                )

    def _check_staging_place(self) -> None:
        staging = self.staging.resolve()
        for key, place in [*self._drop_dirs(), ("archive", self.archive)]:
            d = place.resolve()
            if staging == d or d in staging.parents:
                raise ConfigError(
                    f"black.staging_dir {self.staging} is inside black.{key} {d}: the mover (or "
                    "the archive pruner) would see temp files. Put it beside the outbox on the "
                    f"same file system (default: {default_staging(self.outbox)})"
                )

    def _check_staging_device(self) -> None:
        """ConfigError unless a file can be renamed from the staging dir into every drop dir:
        the same device, and no mount between them (a bind mount keeps the device number, and
        rename(2) still refuses to cross it: EXDEV), found by :func:`rename_refusal`."""
        dev_s = os.stat(self.staging).st_dev
        for key, d in self._drop_dirs():
            dev_o = os.stat(d).st_dev
            if dev_s != dev_o:
                raise ConfigError(
                    f"black.staging_dir {self.staging} (device {dev_s}) is not on the file "
                    f"system of black.{key} {d} (device {dev_o}): {self._staging_fix()}"
                )
            refused = rename_refusal(self.staging, d)
            if refused is None:
                continue
            if refused.errno == errno.EXDEV:
                raise ConfigError(
                    f"black.staging_dir {self.staging} and black.{key} {d} are on one file "
                    f"system (device {dev_s}) but on different mounts (a bind mount): rename(2) "
                    f"between them fails ({refused.strerror}). {self._staging_fix()}"
                )
            raise ConfigError(
                f"black.{key} {d} refuses a rename from black.staging_dir {self.staging} "
                f"({refused.strerror or refused}), the only way files enter it: make black.{key} "
                "writable for the user running black (and mounted read-write), or point it "
                "elsewhere"
            )

    def _staging_fix(self) -> str:
        """Why the staging dir must be on the outbox's mount, and how to get there."""
        return (
            "a rename into the outbox is atomic only within one file system and mount, else a "
            "mover could see partial files. Set black.staging_dir to a directory on the "
            f"outbox's file system outside the outbox (default: {default_staging(self.outbox)}) "
            "and keep black.udp_outbox on it too; if the outbox is itself a mount point (a bind "
            "mount included), mount the folder above it instead"
        )

    def _exdev_hint(self, e: BaseException, final: Path) -> str:
        """The fix, when the rename of a staged temp to ``final`` failed with EXDEV (the staging
        dir and the drop dir on different mounts since start-up); "" for anything else."""
        if not isinstance(e, OSError) or e.errno != errno.EXDEV:
            return ""
        if e.filename2 != os.fspath(final):
            return ""
        return (
            f"; black.staging_dir {self.staging} and {final.parent} are on different mounts "
            f"(another file system, or a bind mount of the same one), so nothing can be "
            f"delivered until that is fixed: {self._staging_fix()}; then start black again"
        )

    def _denied_hint(self, e: BaseException, channel: str | None) -> str:
        """The fix, when a delivery of ``channel`` (None: a staging write) was refused (EACCES,
        EPERM, EROFS): which of its drop dir, the staging dir and its archive folder black
        cannot write, found by ``write_refusal`` (nothing visible in the drop dir); "" for
        any other error."""
        if not isinstance(e, OSError) or e.errno not in _DENIED:
            return ""
        places = [("staging_dir", self.staging)]
        if channel is not None:
            drop, adir = self.dir_for(channel), self.archive / channel
            places = [
                ("outbox" if drop == self.outbox else "udp_outbox", drop),
                *places,
                ("archive", adir if adir.is_dir() else self.archive),
            ]
        for key, d in places:
            refused = write_refusal(d) if d.is_dir() else None
            if refused is not None and refused.errno in _DENIED:
                ch = channel if key == "archive" and d != self.archive else None
                return f"; {not_writable(key, d, refused, channel=ch)}; then start black again"
        keys = " and ".join(f"black.{key} {d}" for key, d in places)
        return (
            f"; the user running black (uid {os.getuid()}) may not write there: give it write "
            f"access to {keys}, or point them elsewhere; then start black again"
        )

    def _check_archive_link(self) -> None:
        """Link a probe file from the staging dir into the archive: a device check alone
        misses bind mounts (EXDEV) and shares without hard links (EPERM, EOPNOTSUPP).

        Every Outbox built with ``archive_link`` probes (the job's, and ``diode resend``'s
        beside a running job), so the probe holds the drop lock shared like a re-drop: a
        start-up sweep waits for it instead of removing it mid-check. Both names are temp
        names the sweep removes, should a crash leave them (the archive root's too).
        """
        with shared_lock(
            self.lock_path,
            what='black.archive_mode = "link" check',
            timeout=self.lock_wait,
            hint=_REDROP_HINT,
        ):
            for attempt in range(1, _PROBE_ATTEMPTS + 1):
                if self._probe_link():
                    return
                log_event(log, 30, "the archive link probe vanished before it was linked: "
                          "probing again", file=str(self.staging), attempt=attempt)  # fmt: skip
        raise StateError(
            f"the archive link probe in black.staging_dir {self.staging} vanished "
            f"{_PROBE_ATTEMPTS} times before it could be linked: something removes files "
            "there without taking its drop lock; stop it and start again"
        )

    def _probe_link(self) -> bool:
        """One probe: True if it linked, False if our own probe file vanished (retry)."""
        probe = self.temp_for(_PROBE_NAME)
        linked = tmp_path_for(self.archive / _PROBE_NAME)
        try:
            write_new_file(probe, b"", mode=FILE_MODE)
            os.link(probe, linked)
        except OSError as e:
            gone = e.errno == errno.ENOENT and not probe.exists()
            if gone and self.staging.is_dir() and self.archive.is_dir():
                return False  # our probe was removed under us (no verdict on links): again
            raise ConfigError(
                f'black.archive_mode = "link" needs hard links from black.staging_dir '
                f"{self.staging} into black.archive {self.archive}, and the file system refused "
                f"one ({e.strerror or e}): a hard link cannot cross file systems or bind mounts. "
                "Put the archive beside the outbox on its file system, or set "
                'black.archive_mode = "copy"'
            ) from None
        finally:
            probe.unlink(missing_ok=True)
            linked.unlink(missing_ok=True)
        return True

    # ---------------------------------------------------------------- temps

    def temp_for(self, name: str) -> Path:
        """A unique temp path for ``name`` in the staging dir (never visible in the outbox)."""
        return tmp_path_for(self.staging / name)

    def sweep_stale_temps(self) -> int:
        """Remove temp files a crash left behind (staging, archive, legacy ones in the outbox,
        archive link probes in the archive root).

        Only the black job calls this, at start-up, holding the state-dir run lock (so none
        of the temps is its own) and the drop lock exclusively (so none is a running
        re-drop's or ``archive_mode = "link"`` probe's). Returns how many files it removed.
        """
        removed = 0
        with exclusive_lock(
            self.lock_path,
            what="black: sweeping stale temp files",
            timeout=self.lock_wait,
            hint=_SWEEP_HINT,
        ):
            dirs = [self.staging, *(d for _, d in self._drop_dirs())]
            if self.archive.is_dir():
                dirs += [self.archive, *self._archive_folders()]
            for d in dirs:
                try:
                    removed += self._sweep(d)
                except OSError as e:  # housekeeping: never worth failing a start
                    log_event(log, 30, "stale temp files not swept (tried again at the next "
                              "start): give the user running black write access to the folder, "
                              "or remove them by hand", folder=str(d),
                              error=os_error_text(e))  # fmt: skip
        return removed

    def _sweep(self, d: Path) -> int:
        """Remove the crash temps in ``d``; OSError when ``d`` cannot be read or one cannot
        be removed (after removing the others)."""
        removed, refused = 0, None
        for entry in os.scandir(d):
            if not _TEMP_RE.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            if d == self.archive and not entry.name.startswith(_ROOT_PROBES):
                continue  # the archive root: channel folders, link and write probes
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # a mover took it
                continue
            except OSError as e:
                refused = e
                continue
            removed += 1
            log_event(log, 30, "removed a partial file left by a crash", file=entry.path)
        if refused is not None:
            raise refused
        return removed

    def _archive_folders(self) -> list[Path]:
        """The archive's channel folders (named as a channel can be: not ``lost+found`` or
        anything else put beside them)."""
        return [p for p in self.archive.iterdir() if CHANNEL_RE.fullmatch(p.name) and p.is_dir()]

    # ---------------------------------------------------------------- deliveries

    def _archive_dir(self, channel: str) -> Path:
        d = self.archive / channel
        if channel not in self._archive_dirs:
            durable_mkdir(d)
            self._archive_dirs.add(channel)
        return d

    def deliver(
        self,
        name: str,
        sealed: Path,
        *,
        channel: str,
        archive: bool = True,
        synced: bool = False,
    ) -> Path:
        """Archive ``sealed`` (a :meth:`temp_for` path) and rename it into the outbox as ``name``.

        Durable when it returns: the archive copy first (so recovery can re-drop it), then the
        outbox entry. The outbox file is never touched again (a mover may already have it).
        ``synced``: the caller already fsynced ``sealed`` (``Gpg.seal`` does), saving one fsync
        (~1 ms even on a clean file).
        """
        outbox = self.dir_for(channel)
        final = outbox / name
        try:
            fd = os.open(sealed, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fchmod(fd, FILE_MODE)
                if not synced:
                    os.fsync(fd)
                if archive:
                    # a copy by default: with a hard link, a mover that rewrote the outbox
                    # file in place would change the archived evidence too (archive_mode)
                    adir = self._archive_dir(channel)
                    tmp = tmp_path_for(adir / name)
                    try:
                        if self.archive_link:
                            os.link(sealed, tmp)  # the data is durable: only names are new
                        else:
                            _copy_to_new(fd, tmp)
                        os.replace(tmp, adir / name)
                    except BaseException:
                        tmp.unlink(missing_ok=True)
                        raise
                    fsync_dir(adir)
            finally:
                os.close(fd)
            os.replace(sealed, final)
            fsync_dir(outbox)
        except OSError as e:
            raise TransportError(
                f"cannot deliver {name} (channel {channel!r}) into {outbox}: {e}"
                f"{self._exdev_hint(e, final) or self._denied_hint(e, channel)}"
            ) from e
        return final

    def stage_bytes(self, name: str, data: bytes) -> Path:
        """Write ``data`` to a new temp file for ``name`` in the staging dir, fsynced."""
        tmp = self.temp_for(name)
        try:
            write_new_file(tmp, data, mode=FILE_MODE)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise TransportError(
                    f"cannot stage {name} in {self.staging}: {e}{self._denied_hint(e, None)}"
                ) from e
            raise
        return tmp

    def publish(self, staged: Path, name: str, *, channel: str) -> Path:
        """Rename a :meth:`stage_bytes` file of ``channel`` into its outbox as ``name`` and
        fsync that directory.

        If the rename fails the temp file is removed; if only the fsync fails, the file is
        already visible (and maybe taken): the TransportError says so.
        """
        outbox = self.dir_for(channel)
        final = outbox / name
        try:
            os.replace(staged, final)
        except OSError as e:
            staged.unlink(missing_ok=True)
            raise TransportError(
                f"cannot move {name} into {outbox}: {e}"
                f"{self._exdev_hint(e, final) or self._denied_hint(e, channel)}"
            ) from e
        try:
            fsync_dir(outbox)
        except OSError as e:
            raise TransportError(
                f"{name} is in {outbox} but the folder could not be fsynced: {e}"
            ) from e
        return final

    # ---------------------------------------------------------------- archive and resend

    def has_archived(self, channel: str, name: str) -> bool:
        """True when the sealed bundle ``name`` is (whole) in the archive."""
        return (self.archive / channel / name).is_file()

    def _redrop(self, src: Path, name: str, channel: str) -> int | None:
        """Copy ``src`` through the staging dir into ``channel``'s outbox as ``name``; its size,
        or None if ``src`` is gone (pruned). Holds the drop lock shared while its temp file
        exists."""
        outbox = self.dir_for(channel)
        with shared_lock(
            self.lock_path,
            what=f"re-drop of {name}",
            timeout=self.lock_wait,
            hint=_REDROP_HINT,
        ):
            try:
                sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            tmp = self.temp_for(name)
            try:
                try:
                    size = _copy_to_new(sfd, tmp)
                finally:
                    os.close(sfd)
                os.replace(tmp, outbox / name)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(outbox)
        return size

    def redrop(self, channel: str, name: str) -> int:
        """Copy the archived bundle ``name`` into the outbox again, atomically; returns its size."""
        try:
            size = self._redrop(self.archive / channel / name, name, channel)
        except OSError as e:
            hint = self._exdev_hint(e, self.dir_for(channel) / name)
            raise TransportError(
                f"cannot re-drop {name} of channel {channel!r}: {e}"
                f"{hint or self._denied_hint(e, channel)}"
            ) from e
        if size is None:
            raise TransportError(
                f"cannot re-drop {name} of channel {channel!r}: it is no longer in the archive "
                f"{self.archive / channel}"
            )
        return size

    def archived(self, channel: str) -> dict[int, Path]:
        """Archived bundles of ``channel`` by bundle seq."""
        out: dict[int, Path] = {}
        adir = self.archive / channel
        if not adir.is_dir():
            return out
        for p in adir.iterdir():
            try:
                bn = parse_bundle_name(p.name)
            except BundleNameError:
                continue
            if bn.channel == channel:
                out[bn.bundle_seq] = p
        return out

    def resend(self, channel: str, first: int, last: int) -> ResendReport:
        """Re-drop archived bundles ``first..last`` of ``channel`` unchanged into the outbox.

        Safe beside a running job and a mover; a bundle pruned meanwhile counts as missing.
        Lists the archive once and visits only the bundles it holds in the range, so the
        work and the report grow with the archive, not with the range (up to 10^12 seqs).
        """
        if last < first:
            raise TransportError(f"resend range {first}..{last} of channel {channel!r} is empty")
        if first < 1 or last > MAX_SEQ:
            raise TransportError(
                f"resend range {first}..{last} of channel {channel!r}: bundle seqs are 1..{MAX_SEQ}"
            )
        have = self.archived(channel)
        resent: list[str] = []
        missing: list[tuple[int, int]] = []
        after = first  # the lowest seq not yet re-dropped nor counted missing
        for seq in sorted(s for s in have if first <= s <= last):
            if self._resend_one(channel, seq, have[seq], first, len(resent)):
                resent.append(have[seq].name)
                if seq > after:
                    missing.append((after, seq - 1))
                after = seq + 1
        if after <= last:
            missing.append((after, last))
        return ResendReport(resent=resent, missing=missing)

    def _resend_one(self, channel: str, seq: int, src: Path, first: int, done: int) -> bool:
        """Re-drop one archived bundle for :meth:`resend`; False if it was pruned meanwhile."""
        try:
            size = self._redrop(src, src.name, channel)
        except (OSError, StateError) as e:
            hint = self._exdev_hint(e, self.dir_for(channel) / src.name)
            hint = hint or self._denied_hint(e, channel)
            stop = (
                f"resend of channel {channel!r} stopped at bundle seq {seq} ({src.name}): "
                f"{e}{hint}; {done} bundle(s) of {first}..{seq - 1} were re-dropped before"
            )
            if isinstance(e, StateError):
                raise StateError(stop) from None
            raise TransportError(stop) from e
        if size is None:
            log_event(log, 30, "bundle pruned from the archive during the resend",
                      channel=channel, bundle_seq=seq)  # fmt: skip
            return False
        log_event(log, 20, "bundle re-dropped", channel=channel, bundle_seq=seq, file=src.name)
        return True

    def prune_archive(self, *, now: float | None = None, keep: Collection[str] = ()) -> int:
        """Delete archived bundles older than the retention; returns how many.

        ``keep``: file names never deleted, however old: the bundles a channel's journal holds
        as pending (crash recovery re-drops a pending bundle from its archived copy; without
        it, it would re-seal the bundle under a seq red may already hold).
        """
        cutoff = (time.time() if now is None else now) - self.retention_seconds
        keep = frozenset(keep)
        removed = 0
        if not self.archive.is_dir():
            return 0
        refused: list[str] = []
        for adir in self._archive_folders():
            changed = False
            try:
                for p in adir.iterdir():
                    if p.name.startswith(".") or p.name in keep:
                        continue
                    try:
                        if p.stat().st_mtime < cutoff:
                            p.unlink()
                            removed += 1
                            changed = True
                    except FileNotFoundError:
                        continue
                    except OSError as e:  # this file (immutable?): the others go on
                        refused.append(f"{p}: {os_error_text(e)}")
            except OSError as e:  # a folder black may not read: the others are pruned
                refused.append(f"{adir}: {os_error_text(e)}")
            if changed:
                fsync_dir(adir)
        if refused:
            shown = "; ".join(refused[:5]) + (
                f"; +{len(refused) - 5} more" if len(refused) > 5 else ""
            )
            raise OSError(
                f"archive pruned except {shown}: give the user running black write access "
                "there, clear an immutable or append-only attribute (lsattr; chattr -i -a), "
                "or remove them by hand (a retired channel's folder restored under another "
                "owner?)"
            )
        return removed
