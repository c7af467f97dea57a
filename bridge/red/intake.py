"""Red, intake: take settled wire files out of the inbox under durable, increasing ordinals.

    inbox/<name>  --settled, valid name-->  work_dir/intake/<ordinal:012d>.<name>
                  --anything else------->  quarantine/<day>/<safe name> (+ reason file)

Names in the inbox are hostile (docs/protocol.md §1, §7 step 1): the folder is listed with
bytes paths (a name need not be UTF-8) and ``lstat`` only, so a symlink is never followed.

* Hidden names (leading ``.``) are temporaries of whatever writes the inbox: ignored (until
  abandoned: unchanged for ``hidden_stale_seconds``, then quarantined as ``bad_name``).
* Anything but a regular file is quarantined at once, moved as it is (reason
  ``not_regular_file``).
* Left in place, counted (``left``): the file system's ``lost+found`` folder (the inbox is a
  mount point; one info line), and an entry the OS refuses to move (``evidence.Unmovable``:
  immutable, a folder of another owner, a mount point). The latter is logged once, with the
  fix, and tried again only once it changed (a new ctime: ``chattr -i``, ``chown``); nothing
  of the attempted quarantine is kept (no reason file, no audit record). Neither stops the
  files beside it from being taken.
* A regular file is *settled* once its (size, mtime, ctime, inode) stayed the same for
  ``settle_seconds`` across scans, or the inbox watcher saw it closed after writing and it is
  still the file that was closed (same inode, size, mtime: ``closed``), or ``settle_seconds``
  is 0. Settled files with a valid bundle or heartbeat name are renamed into
  ``work_dir/intake``; any other settled file is quarantined under a safe name (reason
  ``bad_name``). Either way the watcher forgets the name at once (its own events for the
  rename come late).

The reason file of an intake quarantine says where the file is (``stored_as``: a safe name,
or the wire name of a link or folder) and the name it arrived under: ``original_name`` and
``detail.raw_name`` as printable text (``evidence.shown_name``: bytes that are not UTF-8,
controls and bidi marks escaped), ``detail.raw_hex`` as its exact bytes.

Every quarantine of the intake leaves an audit record in ``work_dir/audit-pending/`` (named by
where the file was stored, so a retried quarantine writes the same record) before the inbox
entry is dropped; the landing turns the records into ``quarantined`` audit rows.

Ordinals come from ``work_dir/intake/NEXT`` (written temp + fsync + rename, folder fsynced)
*before* any file is renamed, so a crash may skip ordinals but never reuses one. Scans hold
``work_dir/intake.lock`` so two processes never hand out the same ordinal. A missing NEXT
restarts above the files in intake; the Spark source raises it to its committed offset
(``raise_next``) before it takes anything, so a NEXT lost with ``work_dir`` never hands out
ordinals Spark has already gone past.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bridge.errors import BundleNameError, ConfigError, StateError
from bridge.fsutil import atomic_write_bytes, durable_mkdir, exclusive_lock, fsync_dir
from bridge.logs import get_logger, log_event
from bridge.protocol.naming import (
    BUNDLE_SUFFIX,
    HEARTBEAT_SUFFIX,
    parse_bundle_name,
    parse_heartbeat_name,
)
from bridge.red.evidence import (
    Evidence,
    Unmovable,
    file_kind,
    move_error,
    move_id,
    rename_noreplace,
    safe_name,
    shown_name,
)
from bridge.red.layout import AUDIT_PENDING_DIR, INTAKE_DIR
from bridge.red.watch import ClosedFiles, CloseSig, close_sig

__all__ = [
    "Intake",
    "ScanResult",
    "Taken",
    "Quarantined",
    "REASON_BAD_NAME",
    "REASON_NOT_REGULAR",
    "intake_name",
    "wire_name",
]

log = get_logger("bridge.red.intake")

REASON_BAD_NAME = "bad_name"
REASON_NOT_REGULAR = "not_regular_file"
NEXT_FILE = "NEXT"
LOCK_FILE = "intake.lock"
LOCK_WAIT_SECONDS = 30.0
_INTAKE_RE = re.compile(rb"([0-9]{12})\.(.+)", re.DOTALL)
_LOCK_HINT = "another red process is taking files from this inbox; wait or stop it"
LOST_FOUND = b"lost+found"
"""The folder fsck keeps at the root of an ext2/3/4 file system: left alone in an inbox that
is a mount point."""


@dataclass(frozen=True, slots=True)
class Taken:
    """A wire file renamed into ``work_dir/intake`` under ``ordinal``."""

    ordinal: int
    name: str
    path: Path
    size: int
    received_at: datetime
    mtime_ns: int = 0
    """The file's mtime when listed: with ``size``, what tells a file changed since."""


@dataclass(frozen=True, slots=True)
class Quarantined:
    """An inbox entry moved to quarantine by the intake itself."""

    raw_name: bytes
    stored_as: Path
    reason: str


@dataclass(slots=True)
class ScanResult:
    """What one :meth:`Intake.scan` did: taken and quarantined files, files still settling
    (``waiting``), hidden names ignored, and entries ``left`` where they are (``lost+found``,
    entries the OS refuses to move)."""

    taken: list[Taken] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    waiting: int = 0
    hidden: int = 0
    left: int = 0


def wire_name(raw: bytes) -> tuple[str | None, str]:
    """``(name, "")`` if ``raw`` is a valid bundle or heartbeat name, else ``(None, why)``."""
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        return None, "not ASCII"
    try:
        if name.endswith(BUNDLE_SUFFIX):
            parse_bundle_name(name)
        elif name.endswith(HEARTBEAT_SUFFIX):
            parse_heartbeat_name(name)
        else:
            return None, "unknown suffix (not .dbundle / .dheartbeat)"
    except BundleNameError as e:
        return None, str(e)
    return name, ""


def intake_name(ordinal: int, name: str) -> str:
    """The file name of wire file ``name`` in ``work_dir/intake``."""
    return f"{ordinal:012d}.{name}"


def _raw_detail(raw: bytes) -> dict[str, str]:
    """What a reason file's ``detail`` says of a name the intake refused: ``raw_name`` (the
    name as it arrived, printable: :func:`shown_name`) and ``raw_hex`` (its exact bytes)."""
    return {"raw_name": shown_name(raw), "raw_hex": raw.hex()}


HIDDEN_STALE_SECONDS = 3600.0
"""A hidden inbox file (a mover's temporary) unchanged this long is quarantined (``bad_name``)."""


class Intake:
    """Moves settled inbox files into ``work_dir/intake`` (or quarantine)."""

    def __init__(
        self,
        inbox: Path,
        work_dir: Path,
        evidence: Evidence,
        settle_seconds: float,
        *,
        hidden_stale_seconds: float = HIDDEN_STALE_SECONDS,
    ) -> None:
        self.inbox = Path(inbox)
        self.work_dir = Path(work_dir)
        self.dir = self.work_dir / INTAKE_DIR
        self.pending_audit_dir = self.work_dir / AUDIT_PENDING_DIR
        self.evidence = evidence
        self.settle_seconds = float(settle_seconds)
        self.hidden_stale_seconds = max(float(hidden_stale_seconds), self.settle_seconds)
        self._seen: dict[bytes, tuple[tuple[int, int, int, int], float]] = {}
        self._unmovable: dict[bytes, str] = {}
        """Entries the OS refused to move (path -> ``move_id``): not tried again unchanged."""
        self._lost_found_said = False
        durable_mkdir(self.inbox)
        durable_mkdir(self.dir)
        durable_mkdir(self.pending_audit_dir)
        evidence.ensure_dirs()
        self._check_same_fs()

    # -- public ---------------------------------------------------------------------------
    def scan(self, now: float, closed: Mapping[str, CloseSig] | None = None) -> ScanResult:
        """List the inbox once: take settled wire files, quarantine the rest, count the others.

        ``now`` is any clock in seconds (the same one on every call); ``closed`` holds the
        files the watcher saw closed after writing, with what each was then
        (``InboxWatcher.closed_names``); the names this scan takes or quarantines are
        forgotten there."""
        closed = {} if closed is None else closed
        res = ScanResult()
        with exclusive_lock(
            self.work_dir / LOCK_FILE, what="red intake", timeout=LOCK_WAIT_SECONDS,
            hint=_LOCK_HINT,
        ):  # fmt: skip
            takes: list[tuple[str, bytes, os.stat_result]] = []
            bad: list[tuple[bytes, str]] = []
            stale: list[bytes] = []
            gone: list[tuple[str, CloseSig]] = []  # settled: leave the inbox now
            seen: dict[bytes, tuple[tuple[int, int, int, int], float]] = {}
            for raw, st in self._list_inbox():
                if self._left_alone(self.inbox, raw, st):
                    res.left += 1
                elif raw.startswith(b"."):
                    # a mover's temporary: left alone, unless unchanged for so long that it
                    # was abandoned (a crashed transfer); then it becomes evidence
                    if stat.S_ISREG(st.st_mode) and self._unchanged_for(
                        raw, st, now, seen, self.hidden_stale_seconds
                    ):
                        stale.append(raw)
                    else:
                        res.hidden += 1
                elif not stat.S_ISREG(st.st_mode):
                    self._quarantine_odd(self.inbox, raw, st, res)
                elif not self._settled(raw, st, now, closed, seen):
                    res.waiting += 1
                else:
                    gone.append((os.fsdecode(raw), close_sig(st)))
                    name, why = wire_name(raw)
                    if name is None:
                        bad.append((raw, why))
                    else:
                        takes.append((name, raw, st))
            self._seen = seen
            self._take(takes, res)
            for raw, why in bad:
                self._quarantine_bad_name(raw, why, res)
            if isinstance(closed, ClosedFiles):
                closed.forget(gone)
            for raw in stale:
                why = (
                    f"hidden name, unchanged for {self.hidden_stale_seconds:.0f} s: a mover's "
                    "abandoned temporary file?"
                )
                self._quarantine_bad_name(raw, why, res)
        return res

    def pending(self) -> list[Taken]:
        """Files in ``work_dir/intake`` (taken, not yet landed), by ordinal."""
        out: list[Taken] = []
        with os.scandir(os.fsencode(self.dir)) as it:
            for entry in it:
                m = _INTAKE_RE.fullmatch(entry.name)
                if m is None:
                    continue  # NEXT, temporaries
                name, _ = wire_name(m.group(2))
                if name is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # landed meanwhile
                path = self.dir / os.fsdecode(entry.name)
                if self._left_alone(self.dir, entry.name, st):
                    continue
                if not stat.S_ISREG(st.st_mode):  # only after a crash inside _take
                    self._quarantine_odd(self.dir, entry.name, st, ScanResult(), wire=name)
                    continue
                out.append(_taken(int(m.group(1)), name, path, st))
        out.sort(key=lambda t: t.ordinal)
        return out

    def next_ordinal(self) -> int:
        """The ordinal the next taken file gets (at least)."""
        return self._read_next()

    def raise_next(self, at_least: int) -> int | None:
        """Make the next ordinal at least ``at_least`` (written durably); the one it was when
        that raised it, else None. Ordinals below what Spark has committed are never planned
        again, so a NEXT lost (or restored from an old copy) must not hand them out."""
        with exclusive_lock(
            self.work_dir / LOCK_FILE, what="red intake", timeout=LOCK_WAIT_SECONDS,
            hint=_LOCK_HINT,
        ):  # fmt: skip
            was = self._read_next()
            if was >= at_least:
                return None
            self._write_next(at_least)
            return was

    def renumber(self, files: Iterable[Taken]) -> list[Taken]:
        """Give intake files new ordinals at the end (reserved durably first, then renamed):
        files a landing journal no longer holds, below what Spark has committed, are taken
        again this way. A file gone meanwhile is skipped."""
        files = sorted(files, key=lambda t: t.ordinal)
        out: list[Taken] = []
        if not files:
            return out
        with exclusive_lock(
            self.work_dir / LOCK_FILE, what="red intake", timeout=LOCK_WAIT_SECONDS,
            hint=_LOCK_HINT,
        ):  # fmt: skip
            for ordinal, t in enumerate(files, start=self._reserve(len(files))):
                dst = self._move_in(t.path, ordinal, t.name)
                if dst is None:
                    continue
                st = os.lstat(dst)
                out.append(_taken(ordinal, t.name, dst, st))
                log_event(log, 30, "intake file renumbered", file_name=t.name,
                          old_ordinal=t.ordinal, ordinal=ordinal)  # fmt: skip
            fsync_dir(self.dir)
        return out

    # -- settling -------------------------------------------------------------------------
    def _settled(
        self,
        raw: bytes,
        st: os.stat_result,
        now: float,
        closed: Mapping[str, CloseSig],
        seen: dict[bytes, tuple[tuple[int, int, int, int], float]],
    ) -> bool:
        """Whether ``raw`` may be taken: unchanged for ``settle_seconds``, or still the very
        file the watcher saw closed (a new copy under that name is not)."""
        closed_now = self.settle_seconds <= 0 or closed.get(os.fsdecode(raw)) == close_sig(st)
        return self._unchanged_for(raw, st, now, seen, 0.0 if closed_now else self.settle_seconds)

    def _unchanged_for(
        self,
        raw: bytes,
        st: os.stat_result,
        now: float,
        seen: dict[bytes, tuple[tuple[int, int, int, int], float]],
        seconds: float,
    ) -> bool:
        """Record ``raw``'s signature in ``seen``; True once it has not changed for
        ``seconds`` (across scans)."""
        sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        prev = self._seen.get(raw)
        since = prev[1] if prev is not None and prev[0] == sig else now
        seen[raw] = (sig, since)
        return now - since >= seconds

    # -- taking ---------------------------------------------------------------------------
    def _take(self, takes: list[tuple[str, bytes, os.stat_result]], res: ScanResult) -> None:
        """Reserve ordinals for ``takes`` durably, then rename each into the intake folder."""
        if not takes:
            return
        takes.sort(key=lambda t: (t[0].endswith(HEARTBEAT_SUFFIX), t[0]))
        moved = False
        for ordinal, (name, raw, _st) in enumerate(takes, start=self._reserve(len(takes))):
            try:
                dst = self._move_in(self.inbox / os.fsdecode(raw), ordinal, name)
            except Unmovable as e:  # left in place, said once: the files beside it go on
                self._seen.pop(raw, None)
                self._unmovable_entry(e.path, "taken", e, res)
                continue
            if dst is None:
                self._seen.pop(raw, None)
                continue  # the mover took it back: the ordinal stays unused
            moved = True
            self._seen.pop(raw, None)
            st = os.lstat(dst)
            if not stat.S_ISREG(st.st_mode):  # swapped for a link/dir after it was listed
                self._quarantine_odd(self.dir, os.fsencode(dst.name), st, res, wire=name)
                continue
            res.taken.append(_taken(ordinal, name, dst, st))
            log_event(log, 10, "file taken", file_name=name, ordinal=ordinal, size=st.st_size)
        if moved:
            fsync_dir(self.dir)
            fsync_dir(self.inbox)

    def _reserve(self, n: int) -> int:
        """Reserve ``n`` ordinals durably (before any file takes one); the first of them."""
        first = self._read_next()
        self._write_next(first + n)
        return first

    def _move_in(self, src: Path, ordinal: int, name: str) -> Path | None:
        """Rename ``src`` into the intake folder under ``ordinal``; None if it is gone.
        StateError if the ordinal is taken already (NEXT went backwards)."""
        dst = self.dir / intake_name(ordinal, name)
        try:
            rename_noreplace(src, dst)
        except FileNotFoundError:
            return None
        except FileExistsError:
            raise StateError(
                f"intake ordinal {ordinal} ({name}) is in use already: "
                f"{self.dir / NEXT_FILE} went backwards; restore it above the highest "
                f"ordinal in {self.dir}"
            ) from None
        except OSError as e:  # Unmovable: the file's own trouble (immutable, a mount point)
            raise move_error(src, dst, e) from None
        return dst

    def _read_next(self) -> int:
        path = self.dir / NEXT_FILE
        try:
            text = path.read_text("ascii").strip()
        except FileNotFoundError:
            return max((t.ordinal for t in self.pending()), default=0) + 1
        except (OSError, UnicodeDecodeError) as e:
            raise StateError(f"intake counter {path} is unreadable: {e}") from None
        if not text.isdigit() or int(text) < 1:
            raise StateError(
                f"intake counter {path} holds {text[:40]!r}, not a positive integer; write the "
                f"highest ordinal ever used (see {self.dir}, processed/ and the Spark checkpoint "
                "offsets) plus one"
            )
        return int(text)

    def _write_next(self, value: int) -> None:
        atomic_write_bytes(self.dir / NEXT_FILE, f"{value}\n".encode("ascii"))

    # -- quarantine -----------------------------------------------------------------------
    def _quarantine(
        self,
        src: Path,
        raw: bytes,
        stored: str,
        reason: str,
        detail: dict[str, str],
        res: ScanResult,
        *,
        arrived_as: str | None = None,
    ) -> None:
        """Quarantine ``src`` under ``stored`` with an audit record written before the inbox
        entry goes (into ``res``); the reason file's ``original_name`` is ``arrived_as`` (the
        wire name of a file met in the intake folder), else the raw name as it arrived,
        printable. An entry the OS refuses to move is left where it is
        (:meth:`_unmovable_entry`)."""
        at = datetime.now(UTC)

        def record(dst: Path) -> None:
            self._record_for_audit(Quarantined(raw, dst, reason), at)

        def unrecord(dst: Path) -> None:  # the move was refused: nothing to audit
            self._audit_record_path(dst).unlink(missing_ok=True)
            fsync_dir(self.pending_audit_dir)

        original = shown_name(raw) if arrived_as is None else arrived_as
        try:
            dst = self.evidence.quarantine(
                src, stored, reason, detail, at, placed=record, unplaced=unrecord,
                original_name=original,
            )  # fmt: skip
        except Unmovable as e:
            self._unmovable_entry(src, reason, e, res)
            return
        if dst is not None:
            res.quarantined.append(Quarantined(raw, dst, reason))

    def _unmovable_entry(self, src: Path, reason: str, e: Unmovable, res: ScanResult) -> None:
        """``src`` cannot be moved: logged once, counted, and not tried again while it stays
        the entry it is (same device, inode, ctime)."""
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return  # gone meanwhile
        self._unmovable[os.fsencode(src)] = move_id(st)
        res.left += 1
        msg = (
            "inbox file cannot be taken: left in place"
            if reason == "taken"
            else "entry cannot be moved to quarantine: left in place"
        )
        log_event(
            log, 30, msg, path=ascii(str(src)), would_be=reason, file_type=file_kind(st.st_mode),
            uid=st.st_uid, errno=errno.errorcode.get(e.errno, str(e.errno)), error=str(e),
        )  # fmt: skip

    def _left_alone(self, folder: Path, raw: bytes, st: os.stat_result) -> bool:
        """Whether entry ``raw`` of ``folder`` stays where it is: the inbox's ``lost+found``
        folder (said once), or an entry the OS refused to move, unchanged since."""
        if raw == LOST_FOUND and folder == self.inbox and stat.S_ISDIR(st.st_mode):
            if not self._lost_found_said:
                self._lost_found_said = True
                log_event(log, 20, "inbox lost+found left alone (the inbox is a mount point)",
                          path=str(folder / "lost+found"))  # fmt: skip
            return True
        path = os.fsencode(folder / os.fsdecode(raw))
        mark = self._unmovable.get(path)
        if mark is None:
            return False
        if mark == move_id(st):
            return True
        del self._unmovable[path]  # changed (fixed?): tried again
        return False

    def _audit_record_path(self, stored_as: Path) -> Path:
        key = hashlib.sha256(os.fsencode(stored_as)).hexdigest()[:32]
        return self.pending_audit_dir / f"{key}.json"

    def _record_for_audit(self, q: Quarantined, at: datetime) -> None:
        doc = {
            "raw_name_hex": q.raw_name.hex(),
            "raw_name": shown_name(q.raw_name),
            "stored_as": str(q.stored_as),
            "reason": q.reason,
            "at": at.isoformat(),
        }
        atomic_write_bytes(self._audit_record_path(q.stored_as), json.dumps(doc).encode())

    def _quarantine_bad_name(self, raw: bytes, why: str, res: ScanResult) -> None:
        src = self.inbox / os.fsdecode(raw)
        detail = {**_raw_detail(raw), "why": why}
        self._quarantine(src, raw, safe_name(raw), REASON_BAD_NAME, detail, res)
        self._seen.pop(raw, None)

    def _quarantine_odd(
        self,
        folder: Path,
        raw: bytes,
        st: os.stat_result,
        res: ScanResult,
        *,
        wire: str | None = None,
    ) -> None:
        """Quarantine a non-regular entry as it is (a symlink's target is never touched)."""
        if wire is None:
            wire, _ = wire_name(raw)
        src = folder / os.fsdecode(raw)
        detail = {**_raw_detail(raw), "file_type": file_kind(st.st_mode)}
        stored = wire if wire is not None else safe_name(raw)
        self._quarantine(src, raw, stored, REASON_NOT_REGULAR, detail, res, arrived_as=wire)

    # -- listing and checks ---------------------------------------------------------------
    def _list_inbox(self) -> list[tuple[bytes, os.stat_result]]:
        out: list[tuple[bytes, os.stat_result]] = []
        with os.scandir(os.fsencode(self.inbox)) as it:
            for entry in it:
                try:
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        return out

    def _check_same_fs(self) -> None:
        """Refuse folders on another file system than the inbox: moves must be renames."""
        base = os.stat(self.inbox).st_dev
        for key, path in (
            ("red.work_dir", self.dir),
            ("red.processed_dir", self.evidence.processed_dir),
            ("red.quarantine_dir", self.evidence.quarantine_dir),
        ):
            if os.stat(path).st_dev != base:
                raise ConfigError(
                    f"{key} ({path}) is on another file system than red.inbox ({self.inbox}); "
                    "files are moved by atomic rename, so put it on the inbox's file system "
                    "(e.g. both under one mount)"
                )


def _taken(ordinal: int, name: str, path: Path, st: os.stat_result) -> Taken:
    at = datetime.fromtimestamp(st.st_ctime, UTC)
    return Taken(
        ordinal=ordinal,
        name=name,
        path=path,
        size=st.st_size,
        received_at=at,
        mtime_ns=st.st_mtime_ns,
    )
