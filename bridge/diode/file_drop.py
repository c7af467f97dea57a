"""Diode, file drop: atomic delivery into the outbox, an archive with retention, resend.

Black writes every sealed file under a hidden temporary name, fsyncs it and renames it into
``outbox/``: a vendor's mover never sees a partial file. Each bundle is also copied into
``archive/<channel>/`` so an operator can re-drop a range out of band with ``diode resend``;
red ignores exact duplicates.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from bridge.errors import BundleNameError, TransportError
from bridge.fsutil import durable_rename, fsync_dir, tmp_path_for
from bridge.logs import get_logger, log_event
from bridge.protocol.naming import MAX_SEQ, parse_bundle_name

__all__ = ["Outbox", "ResendReport"]

log = get_logger("bridge.diode.file_drop")
_TEMP_RE = re.compile(r"^\.[A-Za-z0-9._-]+\.[0-9a-f]{12}\.tmp$")


@dataclass
class ResendReport:
    """What a resend re-dropped and what it could not find in the archive."""

    resent: list[str]
    missing: list[int]


class Outbox:
    """The black outbox of a file diode, with its archive."""

    def __init__(self, outbox: Path, archive: Path, *, retention_days: float) -> None:
        self.outbox = Path(outbox)
        self.archive = Path(archive)
        self.retention_seconds = retention_days * 86400.0
        self.outbox.mkdir(parents=True, exist_ok=True)
        self.archive.mkdir(parents=True, exist_ok=True)

    def sweep_stale_temps(self) -> None:
        """Remove partial files a crash left behind (hidden ``.<name>.<id>.tmp``), never delivered.

        Only the black job calls this, while it holds the state lock: a temp file may belong
        to a running sealer otherwise.
        """
        for d in [self.outbox, *(p for p in self.archive.iterdir() if p.is_dir())]:
            for p in d.glob(".*.tmp"):
                if _TEMP_RE.match(p.name):
                    p.unlink(missing_ok=True)
                    log_event(log, 30, "removed a partial file left by a crash", file=str(p))

    def temp_for(self, name: str) -> Path:
        """A hidden temporary path inside the outbox (same file system: the rename is atomic)."""
        return tmp_path_for(self.outbox / name)

    def deliver(self, name: str, sealed: Path, *, channel: str, archive: bool = True) -> Path:
        """Archive ``sealed`` and move it into the outbox as ``name``; durable when it returns."""
        final = self.outbox / name
        try:
            if archive:
                adir = self.archive / channel
                adir.mkdir(parents=True, exist_ok=True)
                dst = adir / name
                tmp = tmp_path_for(dst)
                # a copy, not a hard link: a mover that rewrote the outbox file in place
                # would otherwise change the archived evidence too
                shutil.copyfile(sealed, tmp)
                durable_rename(tmp, dst)
            durable_rename(sealed, final)
        except OSError as e:
            raise TransportError(f"cannot deliver {name} into {self.outbox}: {e}") from e
        return final

    def has_archived(self, channel: str, name: str) -> bool:
        """True when the sealed bundle ``name`` is (whole) in the archive."""
        return (self.archive / channel / name).is_file()

    def redrop(self, channel: str, name: str) -> int:
        """Copy the archived bundle ``name`` into the outbox again, atomically; returns its size."""
        src = self.archive / channel / name
        final = self.outbox / name
        tmp = tmp_path_for(final)
        try:
            shutil.copyfile(src, tmp)
            durable_rename(tmp, final)
        except OSError as e:
            raise TransportError(f"cannot re-drop {name} of channel {channel!r}: {e}") from e
        return final.stat().st_size

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
        """Re-drop archived bundles ``first..last`` of ``channel`` unchanged into the outbox."""
        if last < first:
            raise TransportError(f"resend range {first}..{last} of channel {channel!r} is empty")
        if first < 1 or last > MAX_SEQ:
            raise TransportError(
                f"resend range {first}..{last} of channel {channel!r}: bundle seqs are 1..{MAX_SEQ}"
            )
        have = self.archived(channel)
        resent: list[str] = []
        missing: list[int] = []
        for seq in range(first, last + 1):
            src = have.get(seq)
            if src is None:
                missing.append(seq)
                continue
            self.redrop(channel, src.name)
            resent.append(src.name)
            log_event(log, 20, "bundle re-dropped", channel=channel, bundle_seq=seq, file=src.name)
        return ResendReport(resent=resent, missing=missing)

    def prune_archive(self, *, now: float | None = None) -> int:
        """Delete archived bundles older than the retention; returns how many."""
        cutoff = (time.time() if now is None else now) - self.retention_seconds
        removed = 0
        if not self.archive.is_dir():
            return 0
        for adir in self.archive.iterdir():
            if not adir.is_dir():
                continue
            changed = False
            for p in adir.iterdir():
                if p.name.startswith("."):
                    continue
                try:
                    if p.stat().st_mtime < cutoff:
                        p.unlink()
                        removed += 1
                        changed = True
                except FileNotFoundError:
                    continue
            if changed:
                fsync_dir(adir)
        return removed
