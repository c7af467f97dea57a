"""Red, verify: docs/protocol.md §7 checks 1-7 on ONE wire file, on a Spark executor.

    name -> channel configured -> gpg (one good, pinned signature; integrity; output cap)
    -> encrypted iff the channel says so -> Parquet + manifest (or heartbeat JSON) valid and
    of a known version -> manifest = name, bridge_id expected -> rows = manifest

``verify_file`` returns a ``Verdict``; it never raises for hostile input, only for faults of
this host (gpg missing, a locked key or hung gpg-agent, a full disk, an unreadable intake
file), so the job stops instead of quarantining good bundles. Which one it is, gpg's words
never decide: its stderr quotes packet data (an unknown signer's user id is printed as
``issuer "..."``, and Python splits lines on characters gpg does not escape, so even status
lines can be forged), so a hostile file could say "no space left on device" and stop red
for good. The transcript only picks the reject reason and which host checks to run
(``_check_host``: a test decryption with every red key, the pinned keys in the keyring,
room for the plaintext in ``plain_dir``); the file stays in intake only when one of them
fails, and is rejected otherwise. gpg that does not finish in time (``Gpg.open_timeout``: a
base plus the file's size at a conservative rate) is killed, and all those host checks run:
a message built to keep gpg busy is rejected (``crypto``) instead of stopping red at every
start.

A bundle whose plaintext may need more room than ``plain_dir`` has free now (keeping
``PLAIN_RESERVE_BYTES``) is not opened: ``NoRoomNow`` (the Spark source leaves the file in
intake and plans it again once there is room; ``plain_need`` and ``plain_room`` are what it
plans with), so a file bigger than the free space never fills the disk.

Everything here is picklable: the ``VerifyContext`` carries paths, fingerprints and the
passphrase's *source*, never a secret or a live object; the ``Gpg`` is built inside each
call.

Reject reasons (``Verdict.reason``), in check order:

========================  ==================================================================
``bad_name``              the name is not a bundle or heartbeat name (§1); never opened
``unknown_channel``       the channel is not configured on red; never opened
``too_large``             bigger than a configured limit: a heartbeat file over 1 MiB, or a
                          bundle whose plaintext would exceed ``max_plain_bytes``; or a
                          bundle that needs more room than the whole file system of
                          ``plain_dir`` has beside the intake file itself when they share
                          it (it could never be verified here; one that only
                          needs more than is free now waits in intake: ``NoRoomNow``)
``signature``             bad, missing or several signatures, unknown key, wrong class, on
                          an intact envelope (signed-only, or decryption integrity-checked)
``unpinned_signer``       one valid signature, by a key that is not pinned
``crypto``                the envelope is broken: cannot decrypt (not a recipient, garbage,
                          truncated), integrity never confirmed (gpg stops at a BADSIG before
                          the MDC check, so damaged ciphertext lands here), no integrity
                          protection, plaintext length not as declared, the plaintext
                          exceeds the file size + 1 MiB (a compressed message: bundles are
                          sealed with -z 0, so this is a compression bomb), or gpg did not
                          finish within ``Gpg.open_timeout`` while this host checked out
                          (a message built to keep gpg busy)
``downgrade``             encryption differs from ``channels[].encrypt``: signed-only on an
                          encrypted channel, AND encrypted on a signed-only channel (§7.4 says
                          "iff"; a channel set to plaintext never receives ciphertext)
``malformed``             not Parquet, no/invalid manifest, rows unreadable, bad heartbeat
``unknown_version``       manifest/heartbeat ``format`` or ``schema_version`` not known (§10)
``name_mismatch``         manifest channel/bundle_seq/bundle_id, or heartbeat channel/seq,
                          differ from the file name
``wrong_bridge``          ``bridge_id`` is not the configured ``link.bridge_id``
``inconsistent``          rows disagree with the manifest (``check_rows``, footer row count)
========================  ==================================================================

An ok bundle leaves its verified plaintext at ``plaintext_path`` (the caller deletes or
moves it); a reject leaves nothing in ``plain_dir``. Plaintexts are read with pyarrow from a
memory map, never pandas.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from bridge.config import Config
from bridge.crypto.fingerprint import normalize_fingerprint
from bridge.crypto.gpg import OPEN_BASE_SECONDS, Gpg, GpgTimeout
from bridge.crypto.passphrase import Passphrase, resolve_passphrase
from bridge.crypto.verdict import Opened, Transcript
from bridge.errors import (
    BundleNameError,
    CryptoError,
    DiodeError,
    ManifestError,
    ProtocolError,
    SchemaVersionError,
    SignatureError,
)
from bridge.fsutil import durable_mkdir
from bridge.logs import get_logger, log_event
from bridge.protocol.bundle import unpack_bundle
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import MANIFEST_KEY, Manifest, format_utc
from bridge.protocol.naming import (
    BUNDLE_SUFFIX,
    HEARTBEAT_SUFFIX,
    BundleName,
    HeartbeatName,
    parse_bundle_name,
    parse_heartbeat_name,
)

__all__ = [
    "HEARTBEAT_MAX_FILE_BYTES",
    "OUTPUT_SLACK",
    "PLAIN_RESERVE_BYTES",
    "REASONS",
    "VERDICT_SCHEMA",
    "Verdict",
    "VerifyContext",
    "VerifyEnvironmentError",
    "NoRoomNow",
    "PlainRoom",
    "held_beside",
    "same_file_system",
    "plain_need",
    "plain_room",
    "sweep_plain_dir",
    "verify_file",
]

log = get_logger("bridge.red.verify")

OUTPUT_SLACK = 1024 * 1024
"""gpg's output cap is the file size plus this (§7.3); more means a compressed message."""
HEARTBEAT_MAX_FILE_BYTES = 1024 * 1024
"""A heartbeat (at most 1024 counters) is a few hundred KiB at worst; larger is refused
unread, so a hostile file never fills an executor's memory."""
PLAIN_RESERVE_BYTES = 64 * 1024 * 1024
"""Free space left alone in ``plain_dir``'s file system beyond a plaintext being written; at
most half of what the file system holds beyond that plaintext, so a file that fits the file
system can always be verified once enough has been freed."""
_PROBE_SECONDS = 120.0
"""Time of each gpg call of the host checks after a timeout (a test decryption is tiny)."""
_MAX_DETAIL = 2000
_PLAIN_SUFFIX = ".parquet"

Kind = Literal["bundle", "heartbeat", "other"]
Status = Literal["ok", "reject"]
REASONS = (
    "bad_name",
    "unknown_channel",
    "too_large",
    "signature",
    "unpinned_signer",
    "crypto",
    "downgrade",
    "malformed",
    "unknown_version",
    "name_mismatch",
    "wrong_bridge",
    "inconsistent",
)
"""Every ``Verdict.reason`` of a reject (machine codes, stable: they land in the audit)."""

_SIG_RESULTS = ("GOODSIG", "BADSIG", "EXPSIG", "EXPKEYSIG", "REVKEYSIG", "ERRSIG")
# gpg's diagnostic when --max-output stopped it (it has no status line). A hostile file can
# make it appear too; it only picks between two reject reasons, never a host fault.
_MAX_OUTPUT_MARKER = "max-output"


class VerifyEnvironmentError(DiodeError):
    """This host cannot verify files right now (disk full, key locked, agent down, ...).

    Not a verdict on the file: the job must stop (or retry) and leave the file in intake.
    """

    retryable = True


class NoRoomNow(VerifyEnvironmentError):
    """A bundle's plaintext may need more than ``plain_dir`` has free now: it was not opened.

    It fits the file system (else it is rejected ``too_large``), so it can wait in intake
    until there is room; the Spark source does not fail the job for it (bridge.red.source).
    """


# ---------------------------------------------------------------------------- context


@dataclass(frozen=True)
class VerifyContext:
    """Everything ``verify_file`` needs, picklable (paths and names, never a secret)."""

    gnupg_home: str
    pinned_signers: tuple[str, ...]
    channels: Mapping[str, bool]
    """Configured channel name -> ``encrypt``."""
    bridge_id: str
    plain_dir: str
    """Where verified plaintexts are written (``work_dir/plain``); swept at start."""
    passphrase_file: str | None = None
    """Red keys' passphrase file, or None; read on the executor."""
    passphrase_env: str | None = None
    """Variable holding red keys' passphrase (only when no file is set), or None."""
    max_plain_bytes: int | None = None
    """Extra cap on a bundle's plaintext (None: only file size + 1 MiB applies)."""
    gpg_binary: str = "gpg"
    """The gpg red runs (``red.gpg_binary``; its start checked it, ``decryption_gpg``)."""
    gpg_timeout: float = 900.0
    """Seconds one gpg call may take at most (``Gpg.timeout``)."""
    gpg_open_base_seconds: float = OPEN_BASE_SECONDS
    """Opening one file may take this plus its size at ``OPEN_BYTES_PER_SECOND``, at most
    ``gpg_timeout`` (``Gpg.open_timeout``)."""

    @classmethod
    def from_config(cls, cfg: Config, *, environ: Mapping[str, str] | None = None) -> VerifyContext:
        """The context of ``cfg``'s red side; ConfigError now if the passphrase is unusable."""
        r = cfg.red
        pp = resolve_passphrase(
            file=r.passphrase_file, env_name=r.passphrase_env, side="red", environ=environ
        )
        return cls(
            gnupg_home=str(Path(r.gnupg_home).absolute()),
            pinned_signers=tuple(cfg.link.black_signers),
            channels={c.name: bool(c.encrypt) for c in cfg.channels},
            bridge_id=cfg.link.bridge_id,
            plain_dir=str((Path(r.work_dir) / "plain").absolute()),
            passphrase_file=str(pp.path.absolute()) if pp and pp.path else None,
            passphrase_env=pp.env_name if pp and pp.path is None else None,
            max_plain_bytes=r.max_plain_bytes,
            gpg_binary=r.gpg_binary,
        )

    def passphrase(self) -> Passphrase | None:
        if self.passphrase_file:
            return Passphrase(path=Path(self.passphrase_file))
        if self.passphrase_env:
            return Passphrase(env_name=self.passphrase_env)
        return None

    def gpg(self, *, timeout: float | None = None) -> _RecordingGpg:
        """A Gpg of red's home; ``timeout`` lowers ``gpg_timeout`` (host checks)."""
        cap = self.gpg_timeout if timeout is None else min(timeout, self.gpg_timeout)
        return _RecordingGpg(
            Path(self.gnupg_home),
            binary=self.gpg_binary,
            passphrase=self.passphrase(),
            timeout=cap,
            open_base_seconds=self.gpg_open_base_seconds,
        )


class _RecordingGpg(Gpg):
    """A Gpg that keeps the transcript it judged: it names the reject reason and the host
    checks worth running (it may hold forged lines, so it never decides a host fault)."""

    last: Transcript | None = None
    pinned: set[str] = set()

    def _judge(self, res: Any, pinned: set[str], what: str) -> Opened:
        self.last, self.pinned = res, set(pinned)
        return super()._judge(res, pinned, what)


# ---------------------------------------------------------------------------- verdict

VERDICT_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reason", pa.string()),
        pa.field("detail", pa.string()),
        pa.field("channel", pa.string()),
        pa.field("seq", pa.int64()),
        pa.field("bundle_id", pa.string()),
        pa.field("signer_fpr", pa.string()),
        pa.field("signed_at", pa.string()),
        pa.field("encrypted", pa.bool_()),
        pa.field("plaintext_path", pa.string()),
        pa.field("plaintext_sha256", pa.string()),
        pa.field("plaintext_bytes", pa.int64()),
        pa.field("manifest_json", pa.string()),
        pa.field("heartbeat_json", pa.string()),
        pa.field("file_bytes", pa.int64(), nullable=False),
    ]
)
"""The Arrow schema of ``Verdict.to_row()`` (simple types only; Spark reads it as is)."""


@dataclass(frozen=True)
class Verdict:
    """What red concluded about one wire file (checks 1-7); one row per file.

    ``kind`` is "other" only for a ``bad_name`` reject whose suffix is neither. ``seq`` is
    the bundle seq or heartbeat seq of the name. ``manifest_json`` (canonical) is set for an
    ok bundle and for rejects found after the manifest parsed (name_mismatch, wrong_bridge,
    inconsistent); ``heartbeat_json`` likewise for heartbeats. ``plaintext_sha256`` /
    ``plaintext_bytes`` are set whenever gpg accepted the file; ``plaintext_path`` only for
    an ok bundle.
    """

    name: str
    kind: Kind
    status: Status
    file_bytes: int
    reason: str | None = None
    detail: str | None = None
    channel: str | None = None
    seq: int | None = None
    bundle_id: str | None = None
    signer_fpr: str | None = None
    signed_at: str | None = None
    encrypted: bool | None = None
    plaintext_path: str | None = None
    plaintext_sha256: str | None = None
    plaintext_bytes: int | None = None
    manifest_json: str | None = None
    heartbeat_json: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("bundle", "heartbeat", "other"):
            raise ValueError(f"file {self.name!r}: verdict kind {self.kind!r} is unknown")
        if self.status == "ok":
            if self.reason is not None:
                raise ValueError(f"file {self.name!r}: an ok verdict has no reason")
        elif self.status == "reject":
            if self.reason not in REASONS:
                raise ValueError(f"file {self.name!r}: reject reason {self.reason!r} unknown")
        else:
            raise ValueError(f"file {self.name!r}: verdict status {self.status!r} is unknown")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_row(self) -> dict[str, Any]:
        """A dict of ``VERDICT_SCHEMA`` (column order)."""
        d = asdict(self)
        return {f.name: d[f.name] for f in VERDICT_SCHEMA}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Verdict:
        """Back from ``to_row()`` (or a Spark Row's ``asDict()``); unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in row.items() if k in names}
        for k in ("seq", "file_bytes", "plaintext_bytes"):
            if kw.get(k) is not None:
                kw[k] = int(kw[k])
        if kw.get("encrypted") is not None:
            kw["encrypted"] = bool(kw["encrypted"])
        return cls(**kw)


class _Reject(Exception):
    """Internal: stop checking this file; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------- entry points


def verify_file(path: Path, name: str, ctx: VerifyContext) -> Verdict:
    """Checks 1-7 of docs/protocol.md §7 on the wire file ``path`` named ``name``.

    Never raises for hostile input (a reject ``Verdict`` instead). Raises
    VerifyEnvironmentError (NoRoomNow: not opened for lack of room now; the file may wait),
    CryptoError (gpg missing) or OSError for faults of this host; then nothing is left in
    ``ctx.plain_dir``.
    """
    path = Path(path)
    size = os.stat(path).st_size  # missing intake file: a fault of this host, raise
    facts: dict[str, Any] = {"name": name, "file_bytes": size, "kind": _kind_of(name)}
    plain: Path | None = None
    try:
        parsed = _parse_name(name)
        facts["channel"] = parsed.channel
        if isinstance(parsed, BundleName):
            facts.update(kind="bundle", seq=parsed.bundle_seq, bundle_id=parsed.bundle_id)
        else:
            facts.update(kind="heartbeat", seq=parsed.heartbeat_seq)
        _check_channel(parsed.channel, ctx)
        if isinstance(parsed, BundleName):
            plain = _plain_path(ctx, name)
            _verify_bundle(path, size, parsed, ctx, plain, facts)
        else:
            _verify_heartbeat(path, size, parsed, ctx, facts)
    except _Reject as r:
        if plain is not None:
            plain.unlink(missing_ok=True)
        detail = f"file {name}: {r.detail}"[:_MAX_DETAIL]
        log_event(log, logging.WARNING, "wire file rejected", file_name=name, reason=r.reason,
                  channel=facts.get("channel"), seq=facts.get("seq"), detail=detail)  # fmt: skip
        facts.pop("plaintext_path", None)
        return Verdict(status="reject", reason=r.reason, detail=detail, **facts)
    except BaseException:
        if plain is not None:
            plain.unlink(missing_ok=True)
        raise
    log_event(log, logging.DEBUG, "wire file verified", file_name=name, kind=facts["kind"],
              channel=facts.get("channel"), seq=facts.get("seq"))  # fmt: skip
    return Verdict(status="ok", **facts)


def sweep_plain_dir(plain_dir: Path | str) -> int:
    """Delete plaintexts a crash left in ``plain_dir`` (call before any executor runs).

    Removes regular files named ``*.parquet`` (verified plaintexts) and ``.*.tmp`` (gpg
    output in progress); returns how many. Other entries are left alone.
    """
    d = Path(plain_dir)
    if not d.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(d):
        n = entry.name
        if not entry.is_file(follow_symlinks=False):
            continue
        if n.endswith(_PLAIN_SUFFIX) or (n.startswith(".") and n.endswith(".tmp")):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed


# ---------------------------------------------------------------------------- checks


def _kind_of(name: str) -> Kind:
    if isinstance(name, str) and name.endswith(BUNDLE_SUFFIX):
        return "bundle"
    if isinstance(name, str) and name.endswith(HEARTBEAT_SUFFIX):
        return "heartbeat"
    return "other"


def _parse_name(name: str) -> BundleName | HeartbeatName:
    """Check 1: a bundle or heartbeat wire name."""
    try:
        if _kind_of(name) == "heartbeat":
            return parse_heartbeat_name(name)
        return parse_bundle_name(name)
    except BundleNameError as e:
        raise _Reject("bad_name", str(e)) from None


def _check_channel(channel: str, ctx: VerifyContext) -> None:
    """Check 2: the channel is configured on red."""
    if channel not in ctx.channels:
        raise _Reject(
            "unknown_channel",
            f"channel {channel!r} is not configured on red (configured: {sorted(ctx.channels)})",
        )


def _plain_path(ctx: VerifyContext, name: str) -> Path:
    d = Path(ctx.plain_dir)
    if not d.is_dir():
        durable_mkdir(d)
    return d / f"{name}.{uuid.uuid4().hex[:12]}{_PLAIN_SUFFIX}"


def _open_limit(size: int, ctx: VerifyContext) -> tuple[int, bool]:
    """gpg's output cap and whether it is the configured ``max_plain_bytes`` (tighter)."""
    natural = size + OUTPUT_SLACK
    if ctx.max_plain_bytes is not None and ctx.max_plain_bytes < natural:
        return ctx.max_plain_bytes, True
    return natural, False


def _gpg_reject(
    gpg: _RecordingGpg,
    e: CryptoError,
    name: str,
    ctx: VerifyContext,
    limit: int,
    configured: bool,
    room: tuple[Path, int, Path] | None = None,
) -> _Reject:
    """Check 3 failed: which reject, or raise when this host is at fault.

    ``room`` is (intake file, bytes its plaintext may need, plaintext dir) for a bundle
    (gpg wrote to disk), None for a heartbeat (gpg wrote to memory).
    """
    if isinstance(e, GpgTimeout):
        # no transcript to go by: a hung gpg-agent or a stalled disk looks just like a
        # message built to keep gpg busy, so every host check runs
        _check_host_after_timeout(name, ctx, room)
        return _Reject(
            "crypto",
            f"gpg did not finish within {e.seconds:.0f} s and was killed (this host's keys, "
            "keyring and disk checked out): a message built to keep gpg busy, e.g. nested "
            "compressed packets (bundles are sealed uncompressed); refused",
        )
    res = gpg.last
    if res is None:  # gpg never judged anything: missing binary, unreadable input
        raise e
    _check_host(gpg, res, name, ctx, room)
    # this host is fine: the file is at fault; the transcript only picks the reason
    diag = " ".join(res.diag).lower()
    if _MAX_OUTPUT_MARKER in diag:
        if configured:
            return _Reject(
                "too_large",
                f"plaintext exceeds red.max_plain_bytes ({limit} bytes); gpg stopped at the cap",
            )
        return _Reject(
            "crypto",
            f"plaintext exceeds the file size + 1 MiB ({limit} bytes): a compressed message "
            "(bundles are sealed uncompressed), refused as a compression bomb",
        )
    if res.has("NEED_PASSPHRASE_SYM"):
        # a passphrase (symmetric) message: gpg asks for input it cannot get; red is only
        # ever encrypted to by public key (random junk parses as such a packet now and then)
        return _Reject("crypto", f"{e} (a passphrase-encrypted message: never a bundle)")
    if res.has("BEGIN_DECRYPTION") and not res.has("DECRYPTION_OKAY"):
        # gpg stops at the first failure: a BADSIG here came before the integrity check, so
        # the envelope itself is unverified (damaged or forged ciphertext)
        return _Reject("crypto", f"{e} (encrypted data not integrity-checked)")
    if isinstance(e, SignatureError):
        return _Reject("unpinned_signer" if _unpinned(res, gpg.pinned) else "signature", str(e))
    return _Reject("crypto", str(e))


def _check_host(
    gpg: Gpg,
    res: Transcript,
    name: str,
    ctx: VerifyContext,
    room: tuple[Path, int, Path] | None,
) -> None:
    """Raise (VerifyEnvironmentError, OSError) when this host could not verify ``name``.

    Direct checks only, never gpg's words. The transcript says which checks could matter
    (how far gpg got); a forged one costs at most a check that passes:

    - a recipient slot but no key of ours opened it: a locked red key or a dead gpg-agent
      looks exactly like a message for someone else (``_require_unlockable``);
    - no key to check the signature: every pinned signer must be in the keyring;
    - a bundle: its intake file must be readable; and once gpg began to write its plaintext,
      ``plain_dir`` must hold what that plaintext may need (``_require_room``).
    """
    if res.has("ENC_TO") and not res.has("DECRYPTION_KEY"):
        _require_unlockable(gpg, name)
    if res.has("ERRSIG") or res.has("NO_PUBKEY"):
        _require_pinned_keys(gpg, name, ctx)
    _require_intake_and_room(room, name, wrote=res.has("PLAINTEXT"))


def _check_host_after_timeout(
    name: str, ctx: VerifyContext, room: tuple[Path, int, Path] | None
) -> None:
    """Every direct check of ``_check_host``, after gpg was killed for taking too long.

    The checks use a short timeout of their own (``_PROBE_SECONDS``): a hung gpg-agent fails
    them, and this host then stops with its error instead of waiting again.
    """
    probe = ctx.gpg(timeout=_PROBE_SECONDS)
    _require_unlockable(probe, name)
    _require_pinned_keys(probe, name, ctx)
    _require_intake_and_room(room, name, wrote=True)


def _require_intake_and_room(
    room: tuple[Path, int, Path] | None, name: str, *, wrote: bool
) -> None:
    """For a bundle (``room``: intake file, bytes its plaintext may need, plaintext dir): its
    intake file readable (OSError, a fault of this host), and, if gpg may have ``wrote`` its
    plaintext, ``plain_dir`` room for it (``_require_room``)."""
    if room is None:
        return
    src, need, plain_dir = room
    with open(src, "rb") as f:
        f.read(1)
    if wrote:
        _require_room(plain_dir, need, name)


def _require_unlockable(gpg: Gpg, name: str) -> None:
    """Raise VerifyEnvironmentError unless every red decryption key here decrypts unattended.

    With ``--throw-keyids`` gpg reports a key it could not unlock (wrong or missing
    passphrase, gpg-agent unreachable) exactly like a message for someone else; a test
    decryption tells them apart.
    """
    usable = 0
    try:
        for fpr in gpg.fingerprints(secret=True):
            if gpg.keygrips(fpr, capability="encrypt"):
                gpg.check_unlock(fpr, capability="encrypt", purpose="red decryption key")
                usable += 1
    except CryptoError as e:
        raise VerifyEnvironmentError(
            f"file {name}: GnuPG home {gpg.home}: a red decryption key cannot be used: {e}; "
            "the file stays in intake"
        ) from None
    if not usable:
        raise VerifyEnvironmentError(
            f"file {name}: GnuPG home {gpg.home} holds no usable secret decryption key; the "
            "file stays in intake (run `diode keys check`)"
        )


def _require_pinned_keys(gpg: Gpg, name: str, ctx: VerifyContext) -> None:
    """Raise VerifyEnvironmentError unless every pinned signer is in the keyring.

    The job starts only when they all are (``decryption_gpg``); one missing now (keyring
    unreadable or replaced) would turn every good bundle into an "unknown key" reject.
    """
    try:
        have = set(gpg.fingerprints())
    except CryptoError as e:
        raise VerifyEnvironmentError(
            f"file {name}: cannot list the keys of GnuPG home {gpg.home}: {e}; the file stays "
            "in intake"
        ) from None
    missing = [f for f in ctx.pinned_signers if normalize_fingerprint(f) not in have]
    if missing:
        raise VerifyEnvironmentError(
            f"file {name}: pinned black signer(s) {', '.join(missing)} (link.black_signers) "
            f"not in GnuPG home {gpg.home} (keyring unreadable or replaced?); the file stays "
            "in intake (run `diode keys check`)"
        )


def _require_room(plain_dir: Path, need: int, name: str) -> None:
    """Raise VerifyEnvironmentError unless ``plain_dir`` can take ``need`` more bytes now.

    Allocates them for real in a probe file (``.*.tmp``: swept after a crash), so a full
    disk, an exhausted quota, a read-only or unwritable directory and a file-size limit all
    show, whatever gpg said. Where there is no ``posix_fallocate``, free space is compared.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".room.", suffix=".tmp", dir=plain_dir)
    except OSError as e:
        raise VerifyEnvironmentError(
            f"file {name}: cannot create files in {plain_dir}: {e.strerror}; fix this host "
            "and restart: the file stays in intake"
        ) from None
    try:
        if not hasattr(os, "posix_fallocate"):
            st = os.statvfs(plain_dir)
            if st.f_bavail * st.f_frsize < need:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif need > 0:
            os.posix_fallocate(fd, 0, need)
    except OSError as e:
        raise VerifyEnvironmentError(
            f"file {name}: {plain_dir} has no room for its plaintext (up to {need} bytes): "
            f"{e.strerror}; free space (or lower red.max_plain_bytes) and restart: the file "
            "stays in intake"
        ) from None
    finally:
        os.close(fd)
        Path(probe).unlink(missing_ok=True)


@dataclass(frozen=True)
class PlainRoom:
    """Room in ``plain_dir``'s file system, in bytes for unprivileged files."""

    free: int
    """Free now."""
    capacity: int
    """Free when the file system is empty (used + free)."""

    def reserve(self, need: int) -> int:
        """What is kept free beyond a plaintext of ``need`` bytes."""
        return min(PLAIN_RESERVE_BYTES, max(0, self.capacity - need) // 2)

    def fits(self, need: int, *, planned: int = 0) -> bool:
        """Whether a plaintext of ``need`` bytes fits now beside ``planned`` more bytes."""
        return need <= 0 or planned + need + self.reserve(need) <= self.free

    def beside(self, held: int) -> PlainRoom:
        """This room for a plaintext written while ``held`` bytes (the intake file itself, on
        the same file system) stay used: the most that can ever be free is then less."""
        return PlainRoom(free=self.free, capacity=max(0, self.capacity - held))


def plain_room(plain_dir: Path | str) -> PlainRoom:
    """The room in the file system of ``plain_dir`` (OSError if it cannot be asked)."""
    st = os.statvfs(plain_dir)
    return PlainRoom(
        free=st.f_bavail * st.f_frsize,
        capacity=(st.f_blocks - st.f_bfree + st.f_bavail) * st.f_frsize,
    )


def same_file_system(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` lie in one file system (False if either cannot be asked)."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def held_beside(path: Path, size: int, plain_dir: Path) -> int:
    """``size`` if the intake file at ``path`` lies in ``plain_dir``'s file system (it stays
    there while its plaintext is written), else 0; 0 too if either cannot be asked."""
    return size if same_file_system(path, plain_dir) else 0


def plain_need(name: str, size: int, ctx: VerifyContext, room: PlainRoom) -> int:
    """Bytes gpg may write to ``plain_dir`` for the intake file ``name`` of ``size`` bytes:
    0 for a heartbeat (opened in memory) and for a bundle refused before gpg runs. ``room``
    is that of the file (``PlainRoom.beside`` its own size when they share a file system)."""
    if _kind_of(name) != "bundle":
        return 0
    limit, configured = _open_limit(size, ctx)
    if configured and size > limit + OUTPUT_SLACK:
        return 0  # too_large before gpg
    need = min(size, limit)
    return 0 if need > room.capacity else need  # > capacity: too_large before gpg


def _unpinned(res: Transcript, pinned: set[str]) -> bool:
    """One GOOD signature with a VALIDSIG whose primary key is not pinned."""
    sigs = [k for k, _ in res.status if k in _SIG_RESULTS]
    valid = res.first("VALIDSIG")
    return (
        sigs == ["GOODSIG"]
        and valid is not None
        and len(valid) >= 10
        and valid[9].upper() not in pinned
    )


def _check_encryption(encrypted: bool, channel: str, ctx: VerifyContext) -> None:
    """Check 4: encrypted iff the channel is configured so."""
    want = ctx.channels[channel]
    if encrypted and not want:
        raise _Reject(
            "downgrade",
            f"channel {channel!r} is configured signed-only (encrypt = false) but the file is "
            "encrypted: the two sides disagree on channels[].encrypt",
        )
    if want and not encrypted:
        raise _Reject(
            "downgrade",
            f"channel {channel!r} is encrypted but the file is signed plaintext: refused as a "
            "downgrade (someone sent it in the clear)",
        )


def _gpg_facts(opened: Opened, facts: dict[str, Any]) -> None:
    facts.update(
        signer_fpr=opened.signer_fpr,
        signed_at=format_utc(opened.signed_at),
        encrypted=opened.encrypted,
    )


def _verify_bundle(
    path: Path,
    size: int,
    parsed: BundleName,
    ctx: VerifyContext,
    plain: Path,
    facts: dict[str, Any],
) -> None:
    """Checks 3-7 of a bundle into ``facts``; the plaintext stays at ``plain`` on success."""
    limit, configured = _open_limit(size, ctx)
    if configured and size > limit + OUTPUT_SLACK:
        raise _Reject(
            "too_large",
            f"{size} bytes on the wire, more than red.max_plain_bytes ({limit}) allows",
        )
    # bundles are sealed uncompressed: an honest plaintext is never larger than its file
    need = min(size, limit)
    held = held_beside(path, size, plain.parent)
    room = plain_room(plain.parent).beside(held)
    if need > room.capacity:  # could never be verified here: a host fault forever, so reject
        also = f" beside the file itself ({held} bytes)" if held else ""
        raise _Reject(
            "too_large",
            f"{size} bytes on the wire: its plaintext may need {need} bytes, more than the "
            f"whole file system of {plain.parent} holds{also} ({room.capacity} bytes left); "
            "set red.max_plain_bytes or give red.work_dir more room",
        )
    if not room.fits(need):
        # gpg writes the plaintext before it checks the signature: a file bigger than the
        # free space (hostile or not) would fill the disk; it waits for room instead
        raise NoRoomNow(
            f"file {parsed}: its plaintext may need up to {need} bytes, but {plain.parent} has "
            f"{room.free} bytes free and keeps {room.reserve(need)} in reserve: not opened "
            "now; the file stays in intake and is verified once there is room (free space "
            "in red.work_dir's file system, or lower red.max_plain_bytes)"
        )
    gpg = ctx.gpg()
    try:
        opened = gpg.open(path, plain, pinned_signers=ctx.pinned_signers, max_output=limit)
    except CryptoError as e:
        raise _gpg_reject(
            gpg, e, str(parsed), ctx, limit, configured, (path, need, plain.parent)
        ) from None
    _gpg_facts(opened, facts)
    _check_plaintext(plain, parsed, ctx, facts)
    facts["plaintext_path"] = str(plain)


def _check_plaintext(
    plain: Path, parsed: BundleName, ctx: VerifyContext, facts: dict[str, Any]
) -> None:
    """Checks 5-7 on the plaintext Parquet file (memory-mapped, read once)."""
    with pa.memory_map(str(plain), "r") as mm:
        buf = mm.read_buffer()
        facts["plaintext_bytes"] = buf.size
        facts["plaintext_sha256"] = hashlib.sha256(memoryview(buf)).hexdigest()
        _check_encryption(facts["encrypted"], parsed.channel, ctx)
        manifest = _parse_manifest(buf)
        facts["manifest_json"] = manifest.to_json().decode("utf-8")
        _check_bundle_ids(manifest, parsed, ctx)
        _check_rows(buf, manifest)
        del buf


def _parse_manifest(buf: pa.Buffer) -> Manifest:
    """Check 5: a readable Parquet footer holding a valid manifest of a known version."""
    try:
        meta = pq.read_metadata(pa.BufferReader(buf))
        kv = meta.metadata or {}
    except Exception as e:  # pyarrow raises many kinds on garbage
        raise _Reject(
            "malformed", f"plaintext is not a readable Parquet file: {type(e).__name__}"
        ) from None
    raw = kv.get(MANIFEST_KEY)
    if raw is None:
        raise _Reject("malformed", "Parquet file has no diode.manifest metadata")
    try:
        return Manifest.from_json(raw)
    except SchemaVersionError as e:
        raise _Reject("unknown_version", str(e)) from None
    except ProtocolError as e:
        raise _Reject("malformed", str(e)) from None


def _check_bundle_ids(m: Manifest, parsed: BundleName, ctx: VerifyContext) -> None:
    """Check 6: the manifest names this file, and comes from the expected black bridge."""
    diffs = [
        f"{k} {got!r} (name says {want!r})"
        for k, got, want in (
            ("channel", m.channel, parsed.channel),
            ("bundle_seq", m.bundle_seq, parsed.bundle_seq),
            ("bundle_id", m.bundle_id, parsed.bundle_id),
        )
        if got != want
    ]
    if diffs:
        raise _Reject(
            "name_mismatch",
            f"signed manifest disagrees with the file name: {', '.join(diffs)} (renamed file?)",
        )
    if m.bridge_id != ctx.bridge_id:
        raise _Reject(
            "wrong_bridge",
            f"channel {m.channel!r} bundle_seq {m.bundle_seq}: bridge_id {m.bridge_id!r}, "
            f"expected {ctx.bridge_id!r} (link.bridge_id)",
        )


def _check_rows(buf: pa.Buffer, m: Manifest) -> None:
    """Check 7: the rows are exactly what the manifest describes."""
    try:
        table = unpack_bundle(buf)[1]
    except SchemaVersionError as e:
        raise _Reject("unknown_version", str(e)) from None
    except ManifestError as e:
        raise _Reject("inconsistent", str(e)) from None
    except ProtocolError as e:
        raise _Reject("malformed", f"{m.where}: {e}") from None
    del table


def _verify_heartbeat(
    path: Path, size: int, parsed: HeartbeatName, ctx: VerifyContext, facts: dict[str, Any]
) -> None:
    """Checks 3-6 of a heartbeat (§9) into ``facts``, in memory."""
    if size > HEARTBEAT_MAX_FILE_BYTES:
        raise _Reject(
            "too_large",
            f"{size} bytes for a heartbeat (at most {HEARTBEAT_MAX_FILE_BYTES}); not opened",
        )
    data = _read_small(path, HEARTBEAT_MAX_FILE_BYTES)
    gpg = ctx.gpg()
    limit = len(data) + OUTPUT_SLACK
    try:
        plaintext, opened = gpg.open_bytes(
            data, pinned_signers=ctx.pinned_signers, max_output=limit
        )
    except CryptoError as e:
        raise _gpg_reject(gpg, e, str(parsed), ctx, limit, False) from None
    _gpg_facts(opened, facts)
    facts["plaintext_bytes"] = len(plaintext)
    facts["plaintext_sha256"] = hashlib.sha256(plaintext).hexdigest()
    _check_encryption(opened.encrypted, parsed.channel, ctx)
    try:
        hb = Heartbeat.from_json(plaintext)
    except SchemaVersionError as e:
        raise _Reject("unknown_version", str(e)) from None
    except ProtocolError as e:
        raise _Reject("malformed", str(e)) from None
    facts["heartbeat_json"] = hb.to_json().decode("utf-8")
    diffs = [
        f"{k} {got!r} (name says {want!r})"
        for k, got, want in (
            ("channel", hb.channel, parsed.channel),
            ("heartbeat_seq", hb.heartbeat_seq, parsed.heartbeat_seq),
        )
        if got != want
    ]
    if diffs:
        raise _Reject(
            "name_mismatch", f"signed heartbeat disagrees with the file name: {', '.join(diffs)}"
        )
    if hb.bridge_id != ctx.bridge_id:
        raise _Reject(
            "wrong_bridge",
            f"heartbeat channel {hb.channel!r} seq {hb.heartbeat_seq}: bridge_id "
            f"{hb.bridge_id!r}, expected {ctx.bridge_id!r} (link.bridge_id)",
        )


def _read_small(path: Path, cap: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:  # grew since stat: intake files must not change
        raise OSError(errno.EFBIG, f"intake file {path} grew past {cap} bytes while read")
    return data
