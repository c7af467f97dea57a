"""Black, seal: rows of a micro-batch -> manifests -> Parquet -> gpg -> outbox, journaled.

rows (one channel, any order; seq = spool position)
  -> drop seqs already shipped (a replayed micro-batch)
  -> finish the pending bundle a crash interrupted, from its rows read back from the spool
     (not from the micro-batch, which need not span it): byte-identically if they rebuild the
     same plaintext, else re-sealed under the same bundle seq and chain link (red never saw it)
  -> lost markers (the broker dropped those messages) become gaps with their reason
  -> chunk by rows / bytes / file ceiling
  -> per chunk: manifest, Parquet plaintext, sign+encrypt (gpg, in the background),
     journal intent, deliver, journal (counters: messages, gaps, inexact and undecodable rows)

Chunks are pipelined: chunk N+1 is packed while gpg seals chunk N, and gpg seals N+1 while N
is delivered and journaled. At most one gpg runs, and the journal keeps one pending bundle at
a time: N+1's intent is saved only after N is committed, and nothing reaches the outbox
before its intent (gpg writes to a temp name outside it, swept at start).

Determinism of a rebuild depends on: the spool records (kept until the bundle is shipped) and
the exchange catalog they are read with, the manifest recorded in the journal intent
(created_at and bundle id included), the zstd level and the pyarrow version (pinned by the
deployment; a change is handled by re-sealing) — not on how the rows were chunked when read
(``pack_bundle_buffer``).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections import Counter as Tally
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bridge.black.catalog import default_catalog_path, load_catalog
from bridge.black.chunking import BUNDLE_BASE_BYTES, plan_chunks, row_size_estimate
from bridge.black.gaplog import append_gaps
from bridge.black.spool_read import SpoolReader, list_segments
from bridge.black.spool_rows import (
    INEXACT_REASON,
    LOST_REASON,
    UNDECODABLE,
    source_schema,
    spool_batch_to_rows,
)
from bridge.black.state import ChannelState, StateStore
from bridge.config import ChannelConfig, Config
from bridge.crypto.gpg import Gpg
from bridge.diode.file_drop import Outbox
from bridge.errors import ManifestError, SpoolGapError, StateError
from bridge.faults import crash_point
from bridge.logs import get_logger, log_event
from bridge.metrics import BLACK
from bridge.protocol.bundle import pack_bundle_buffer, sha256_hex
from bridge.protocol.manifest import MAX_MANIFEST_BYTES, Gap, Manifest
from bridge.protocol.naming import bundle_name
from bridge.protocol.schema import ROW_SCHEMA_VERSION, row_schema

__all__ = ["BundleSealer", "ShippedBundle", "seal_overhead_bytes"]

log = get_logger("bridge.black.seal")

UNDECODABLE_LOG_S = 60.0
"""How often at most the sealer logs the undecodable messages it sealed (per channel)."""
UNDECODABLE_SEQS = 20
"""How many of those seqs a journal intent and a log line name (the count is complete)."""


def seal_overhead_bytes(recipients: int, max_file_bytes: int) -> int:
    """A safe upper bound of what OpenPGP adds to a plaintext: signature and key packets (fixed,
    per recipient) plus partial-length framing (~1 byte per 8 KiB; counted as 1 per 4 KiB)."""
    return 8192 + 1100 * max(recipients, 1) + max_file_bytes // 4096


@dataclass(frozen=True)
class ShippedBundle:
    """A bundle durably in the outbox."""

    channel: str
    bundle_seq: int
    bundle_id: str
    name: str
    rows: int
    first_seq: int | None
    last_seq: int | None
    gaps: tuple[Gap, ...]
    plaintext_bytes: int
    sealed_bytes: int
    sha256: str


@dataclass
class _Chain:
    """Where the next bundle packed links in: its bundle seq and the previous plaintext's hash."""

    bundle_seq: int
    prev_sha256: str | None


@dataclass(frozen=True)
class _Packed:
    """A bundle's plaintext, packed but not journaled yet."""

    manifest: Manifest
    plain: pa.Buffer
    sha: str
    undecodable: dict[str, Any] = field(default_factory=dict)
    """Its rows whose property bytes do not decode, for the intent (``_undecodable_entry``)."""


@dataclass
class _Unlogged:
    """Undecodable messages of a channel sealed since its last log line."""

    logged_at: float | None = None
    count: int = 0
    seqs: list[int] = field(default_factory=list)


def _discard(sealing: Future[Path]) -> None:
    """Wait for a gpg run a failure made pointless and remove what it wrote."""
    try:
        sealing.result().unlink(missing_ok=True)
    except BaseException:  # noqa: BLE001 - the error that stopped the sealer is what counts
        pass


def _covered_last(manifest: Manifest, st: ChannelState) -> int:
    """Highest message seq a bundle accounts for (its rows or its gaps)."""
    covered = [g.last_seq for g in manifest.gaps]
    if manifest.last_seq is not None:
        covered.append(manifest.last_seq)
    return max([st.last_seq, *covered])


def _marked(table: pa.Table, column: str) -> dict[int, str]:
    """``{seq: value}`` of the rows where ``column`` is set (none: {})."""
    if column not in table.column_names or table.column(column).null_count == len(table):
        return {}
    m = table.filter(pc.is_valid(table.column(column)))
    return dict(zip(m.column("seq").to_pylist(), m.column(column).to_pylist(), strict=True))


def _flagged(table: pa.Table, column: str) -> np.ndarray:
    """Sorted seqs of the rows where the bool ``column`` is true (none, or no such column: [])."""
    if column not in table.column_names or table.column(column).null_count == len(table):
        return np.empty(0, np.int64)
    marked = table.filter(pc.fill_null(table.column(column), False))
    return np.sort(marked.column("seq").to_numpy())


def _undecodable_entry(seqs: np.ndarray, first: int | None, last: int | None) -> dict[str, Any]:
    """The journal intent's record of the undecodable rows among seqs ``first..last`` of the
    sorted ``seqs``: their count and the first few seqs ({} when there are none)."""
    if not len(seqs) or first is None or last is None:
        return {}
    lo, hi = np.searchsorted(seqs, first), np.searchsorted(seqs, last, side="right")
    if lo == hi:
        return {}
    sample = [int(q) for q in seqs[lo : min(hi, lo + UNDECODABLE_SEQS)]]
    return {"undecodable_rows": int(hi - lo), "undecodable_seqs": sample}


def _merge_gaps(gaps: list[Gap]) -> list[Gap]:
    out: list[Gap] = []
    for g in gaps:
        if out and out[-1].reason == g.reason and out[-1].last_seq + 1 == g.first_seq:
            out[-1] = Gap(out[-1].first_seq, g.last_seq, g.reason)
        else:
            out.append(g)
    return out


def _now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class BundleSealer:
    """Turns one channel's rows into sealed bundles in the outbox, exactly once per seq."""

    def __init__(self, cfg: Config, *, store: StateStore, gpg: Gpg, outbox: Outbox) -> None:
        self.cfg = cfg
        self.store = store
        self.gpg = gpg
        self.outbox = outbox
        self.schema = row_schema(ROW_SCHEMA_VERSION)
        self._inexact: dict[int, str] = {}  # seq -> why its row is not byte-exact (this call)
        self._undecodable = np.empty(0, np.int64)  # seqs whose properties do not decode (same)
        self._unlogged: dict[str, _Unlogged] = {}

    # -- public -----------------------------------------------------------------------------
    def seal_rows(self, channel: ChannelConfig, table: pa.Table) -> list[ShippedBundle]:
        """Seal every row of ``table`` (one channel) that no shipped bundle covers yet.

        ``seq`` is the spool position. Rows with ``lost_reason`` set are lost markers: their
        seqs become gaps. Returns the bundles shipped, in order.
        """
        with self.store.lock(channel.name):
            st = self.store.load(channel.name)
            table = self._fresh(table, st)
            shipped: list[ShippedBundle] = []
            if st.pending is not None:
                shipped.append(self._finish_pending(channel, st))
                table = table.filter(pc.greater(table.column("seq"), st.last_seq))
            if len(table) == 0:
                return shipped
            through = int(pc.max(table.column("seq")).as_py())
            reasons: dict[int, str] = {}
            if LOST_REASON in table.column_names:
                lost = pc.is_valid(table.column(LOST_REASON))
                if bool(pc.any(lost).as_py()):
                    marked = table.filter(lost)
                    reasons = dict(
                        zip(
                            marked.column("seq").to_pylist(),
                            marked.column(LOST_REASON).to_pylist(),
                            strict=True,
                        )
                    )
                    table = table.filter(pc.invert(lost))
            self._inexact = _marked(table, INEXACT_REASON)
            self._undecodable = _flagged(table, UNDECODABLE)
            table = table.select(self.schema.names).cast(self.schema)
            bundle = self.cfg.black.bundle
            max_plain = self._max_plain(channel)
            seqs = table.column("seq").to_numpy()
            sizes = row_size_estimate(table)
            chunks, dropped = plan_chunks(
                seqs,
                sizes,
                last_seq=st.last_seq,
                max_rows=bundle.max_rows,
                max_bytes=min(bundle.max_bytes, max_plain),
                max_row_bytes=max_plain - 4096,
                gap_reasons=reasons,
                through_seq=through,
                # a bundle of gaps only: an empty Parquet file and a manifest, whose size red
                # caps (half of that for gaps, the rest for the exchanges and inexact ranges)
                max_gap_bytes=min(max_plain, MAX_MANIFEST_BYTES // 2) - BUNDLE_BASE_BYTES,
            )
            for i in dropped:
                log_event(
                    log,
                    40,
                    "message larger than the file ceiling: recorded as a gap",
                    channel=channel.name,
                    seq=int(seqs[i]),
                    bytes=int(sizes[i]),
                    max_file_bytes=bundle.max_file_bytes,
                )
            chain = _Chain(st.last_bundle_seq + 1, st.last_sha256)
            # one worker: at most one gpg runs, and bundle N+1 is packed while it seals N
            flight: tuple[_Packed, Future[Path]] | None = None
            with ThreadPoolExecutor(1, thread_name_prefix="diode-gpg") as gpg_worker:

                def encrypt(p: _Packed) -> tuple[_Packed, Future[Path]]:
                    return p, gpg_worker.submit(self._encrypt, channel, p.manifest, p.plain)

                try:
                    for ch in chunks:
                        rows = table.slice(ch.start, ch.rows)
                        for packed in self._pack_chunk(channel, chain, rows, ch.gaps, max_plain):
                            if flight is None:
                                flight = encrypt(packed)
                                continue
                            (prev, sealing), flight = flight, None
                            sealed = sealing.result()  # N's gpg error raises before N+1's runs
                            flight = encrypt(packed)
                            shipped.append(self._land(channel, st, prev, sealed))  # meanwhile
                    if flight is not None:
                        (prev, sealing), flight = flight, None
                        shipped.append(self._land(channel, st, prev, sealing.result()))
                except BaseException:
                    if flight is not None:  # its intent was never saved: as if never started
                        _discard(flight[1])
                    raise
            return shipped

    @staticmethod
    def _fresh(table: pa.Table, st: ChannelState) -> pa.Table:
        """Rows not shipped yet, sorted by seq (partitions arrive in order as a rule)."""
        if not len(table):
            return table
        seqs = table.column("seq")
        if int(pc.min(seqs).as_py()) <= st.last_seq:
            table = table.filter(pc.greater(seqs, st.last_seq))
            seqs = table.column("seq")
        arr = seqs.to_numpy(zero_copy_only=False)
        if len(arr) > 1 and not bool(np.all(arr[1:] > arr[:-1])):
            table = table.sort_by("seq")
        return table

    # -- internals --------------------------------------------------------------------------
    def _max_plain(self, channel: ChannelConfig) -> int:
        """The largest plaintext that seals within the file ceiling (``max_file_bytes``)."""
        ceiling = self.cfg.black.bundle.max_file_bytes
        return ceiling - seal_overhead_bytes(len(channel.recipients), ceiling)

    def _pack(self, rows: pa.Table, manifest: Manifest) -> pa.Buffer:
        b = self.cfg.black.bundle
        return pack_bundle_buffer(
            rows, manifest, zstd_level=b.zstd_level, body_zstd_level=b.body_zstd_level
        )

    def _manifest(self, channel: str, chain: _Chain, rows: pa.Table, gaps: list[Gap]) -> Manifest:
        seqs = rows.column("seq")
        n = len(rows)
        inexact: list[Gap] = []
        if self._inexact and n:
            for q in seqs.to_pylist():
                why = self._inexact.get(q)
                if why is not None:
                    inexact.append(Gap(q, q, why))
        return Manifest(
            format=1,
            channel=channel,
            bundle_seq=chain.bundle_seq,
            bundle_id=uuid.uuid4().hex,
            first_seq=int(pc.min(seqs).as_py()) if n else None,
            last_seq=int(pc.max(seqs).as_py()) if n else None,
            rows=n,
            exchanges=dict(sorted(Tally(rows.column("exchange").to_pylist()).items())),
            created_at=_now_rfc3339(),
            bridge_id=self.cfg.link.bridge_id,
            schema_version=ROW_SCHEMA_VERSION,
            prev_sha256=chain.prev_sha256,
            gaps=tuple(gaps),
            inexact=tuple(_merge_gaps(inexact)),
        )

    def _pack_chunk(
        self,
        channel: ChannelConfig,
        chain: _Chain,
        rows: pa.Table,
        gaps: list[Gap],
        max_plain: int,
    ) -> list[_Packed]:
        """The plaintext bundle(s) of one chunk, linked from ``chain`` (advanced past them).

        Every bundle returned is within ``max_plain`` and its manifest within what red reads:
        one that is not is split here, before gpg or the journal sees it — rows in halves (a
        gap goes with the half whose rows it precedes), a single row apart from the gaps before
        it, a zero-row bundle's gaps in halves. Only a row that is too big alone, without any
        gap, is lost as ``oversize``. StateError if a bundle of a single gap does not fit
        (a ceiling too small for any bundle): nothing is journaled, and nothing shipped.
        """
        manifest = self._manifest(channel.name, chain, rows, gaps)
        plain = self._pack(rows, manifest)
        if len(plain) <= max_plain and len(manifest.to_json()) <= MAX_MANIFEST_BYTES:
            sha = sha256_hex(plain)
            chain.bundle_seq, chain.prev_sha256 = manifest.bundle_seq + 1, sha
            bad = _undecodable_entry(self._undecodable, manifest.first_seq, manifest.last_seq)
            return [_Packed(manifest, plain, sha, bad)]
        n = len(rows)
        parts: list[tuple[pa.Table, list[Gap]]]
        if n > 1:
            # the estimate was off (incompressible data, many gaps): split in two and try again
            head, tail = rows.slice(0, n // 2), rows.slice(n // 2)
            head_last = int(head.column("seq")[-1].as_py())  # no gap contains a row's seq
            parts = [
                (head, [g for g in gaps if g.last_seq < head_last]),
                (tail, [g for g in gaps if g.first_seq > head_last]),
            ]
        elif n == 1 and gaps:
            # the gaps (all before the row) go first, in zero-row bundles: the row is packed
            # alone, so that it is never taken for oversize because of them
            parts = [(rows.slice(0, 0), gaps), (rows, [])]
        elif n == 1:
            # one message that does not fit the file ceiling once packed, alone: it is lost
            # on black, and a zero-row bundle says so (the estimate let it through)
            seq = int(rows.column("seq")[0].as_py())
            log_event(
                log, 40, "message larger than the file ceiling once packed: recorded as a gap",
                channel=channel.name, seq=seq, plaintext_bytes=len(plain), max_plain=max_plain,
            )  # fmt: skip
            parts = [(rows.slice(0, 0), [Gap(seq, seq, "oversize")])]
        elif len(gaps) > 1:
            parts = [(rows, gaps[: len(gaps) // 2]), (rows, gaps[len(gaps) // 2 :])]
        else:
            raise StateError(
                f"channel {channel.name!r}: a bundle of {len(gaps)} gap(s) and no row packs to "
                f"{len(plain)} bytes, over the {max_plain} a sealed file of max_file_bytes "
                f"{self.cfg.black.bundle.max_file_bytes} leaves for the plaintext "
                f"({len(channel.recipients)} recipients): raise max_file_bytes to go on"
            )
        return [p for r, g in parts for p in self._pack_chunk(channel, chain, r, g, max_plain)]

    def _land(
        self, channel: ChannelConfig, st: ChannelState, packed: _Packed, sealed: Path
    ) -> ShippedBundle:
        """Journal the intent of a bundle gpg has sealed, then deliver and commit it."""
        manifest = packed.manifest
        if st.last_bundle_seq + 1 != manifest.bundle_seq or st.last_sha256 != (
            manifest.prev_sha256
        ):
            sealed.unlink(missing_ok=True)
            raise StateError(
                f"channel {channel.name!r} bundle {manifest.bundle_seq} was packed to follow "
                f"bundle {manifest.bundle_seq - 1}, but the journal's last is "
                f"{st.last_bundle_seq}: a bug in the sealing pipeline"
            )
        # checked before the intent: a bundle over the ceiling is never journaled, so no
        # restart rebuilds it (the next run plans afresh)
        size = self._within_ceiling(channel, manifest, sealed, len(packed.plain))
        st.pending = {
            "manifest": manifest.to_json().decode(),
            "sha256": packed.sha,
            "plaintext_bytes": len(packed.plain),
            **packed.undecodable,
        }
        self.store.save(st)  # intent: a crash from here on re-creates exactly this plaintext
        crash_point("seal.after_intent")
        return self._deliver(channel, st, manifest, sealed, size, packed.sha, len(packed.plain))

    def _within_ceiling(
        self,
        channel: ChannelConfig,
        manifest: Manifest,
        sealed: Path,
        plain_bytes: int | None = None,
    ) -> int:
        """The sealed file's size, checked against the file ceiling; with ``plain_bytes``
        (before the intent) its plaintext's too. A journaled bundle is judged by its sealed
        size alone: a stricter check there could stop every restart. StateError (the sealed
        file removed) when over."""
        size = sealed.stat().st_size
        ceiling = self.cfg.black.bundle.max_file_bytes
        over_plain = plain_bytes is not None and plain_bytes > self._max_plain(channel)
        if over_plain or size > ceiling:
            sealed.unlink(missing_ok=True)
            raise StateError(
                f"channel {channel.name!r} bundle {manifest.bundle_seq} is {plain_bytes} bytes "
                f"of plaintext, {size} sealed, over max_file_bytes {ceiling} (less the seal "
                "overhead): a bug in the size bounds (seal_overhead_bytes); raise the ceiling "
                "to go on"
            )
        return size

    def _finish_pending(self, channel: ChannelConfig, st: ChannelState) -> ShippedBundle:
        """Finish a bundle a crash interrupted.

        * sealed and archived before the crash: red may hold it, so re-drop exactly those bytes;
        * else, rebuilt from its rows read back from the spool (``_spool_rows``; never from the
          micro-batch at hand, which need not span the bundle: a deleted checkpoint starts at
          the journal with a smaller read limit, a rolled-back one replays an older batch):
          byte-identical in the normal case;
        * else (records the spool no longer has, or pyarrow / zstd output changed since): it
          never reached the outbox, so red has not seen it: re-seal it under the same bundle
          seq and chain link with what the spool gives now, seqs without a row recorded as
          ``unrecoverable`` gaps.
        """
        assert st.pending is not None
        manifest = Manifest.from_json(st.pending["manifest"].encode())
        want = st.pending["sha256"]
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        if self.outbox.has_archived(channel.name, name):
            size = self.outbox.redrop(channel.name, name)
            log_event(
                log, 30, "re-dropping the archived copy of a bundle interrupted by a crash",
                channel=channel.name, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
            )  # fmt: skip
            BLACK.bundles_recovered.labels(channel.name, "redropped").inc()
            plain_bytes = int(st.pending.get("plaintext_bytes", 0))
            return self._commit(channel, st, manifest, want, size, plain_bytes)
        rows, undecodable = self._rows_of(channel.name, manifest)
        try:
            plain = self._pack(rows, manifest)
            sha: str | None = sha256_hex(plain)
        except ManifestError:  # rows missing or changed: it cannot rebuild, so re-seal
            sha = None
        if sha == want:
            log_event(
                log, 30, "re-creating a bundle interrupted by a crash (byte-identical)",
                channel=channel.name, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
            )  # fmt: skip
            BLACK.bundles_recovered.labels(channel.name, "rebuilt").inc()
            for k in ("undecodable_rows", "undecodable_seqs"):  # as the rows read back say
                st.pending.pop(k, None)
            st.pending.update(
                _undecodable_entry(undecodable, manifest.first_seq, manifest.last_seq)
            )
            return self._ship(channel, st, manifest, plain, want)
        manifest = self._reseal_manifest(manifest, rows)
        plain = self._pack(rows, manifest)
        sha = sha256_hex(plain)
        log_event(
            log, 40, "bundle interrupted by a crash does not rebuild byte-identically: re-sealed "
            "under its bundle seq (it never reached the outbox)",
            channel=channel.name, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
            rows=len(rows), gaps=[g.to_dict() for g in manifest.gaps],
        )  # fmt: skip
        BLACK.bundles_recovered.labels(channel.name, "resealed").inc()
        st.bump("bundles_resealed")
        st.pending = {
            "manifest": manifest.to_json().decode(),
            "sha256": sha,
            "plaintext_bytes": len(plain),
            **_undecodable_entry(undecodable, manifest.first_seq, manifest.last_seq),
        }
        self.store.save(st)
        return self._ship(channel, st, manifest, plain, sha)

    def _rows_of(self, channel: str, manifest: Manifest) -> tuple[pa.Table, np.ndarray]:
        """The message rows of a pending bundle, read back from the spool: its positions
        ``first_seq`` to ``last_seq``, lost markers left out; and the sorted seqs of those
        whose property bytes do not decode."""
        if not manifest.rows or manifest.first_seq is None or manifest.last_seq is None:
            return self.schema.empty_table(), np.empty(0, np.int64)
        rows = self._spool_rows(channel, manifest.first_seq, manifest.last_seq + 1)
        rows = rows.filter(pc.is_null(rows.column(LOST_REASON)))
        return rows.select(self.schema.names).cast(self.schema), _flagged(rows, UNDECODABLE)

    def _spool_rows(self, channel: str, first: int, end: int) -> pa.Table:
        """Spool positions ``[first, end)`` of a pending bundle as source rows: every record the
        spool still holds, in order. The tap releases none of them while the bundle is pending
        (the journal's ``last_seq`` is below them), so a hole is damage (a segment deleted or
        unreadable): it is skipped to the next segment and its seqs stay out, to become gaps.

        SpoolGapError if ``end`` is past the spool's durable end: after a power loss TAIL may
        lag what the segments hold until the channel's tap reopens the spool (which restores
        it, or records positions the disk lost as lost markers), so nothing is declared lost.
        """
        reader = SpoolReader(Path(self.cfg.black.spool_dir), channel)
        durable = reader.durable_end()
        if end > durable:
            raise SpoolGapError(
                f"channel {channel!r}: the bundle a crash interrupted covers spool positions up "
                f"to {end - 1}, but {reader.directory} holds durable records only before "
                f"position {durable}: nothing is declared lost. Once the channel's tap has opened "
                "the spool (it rewrites TAIL, or records positions the disk lost as lost "
                "markers), sealing can go on (docs/runbook.md §7.1 if the spool was lost)"
            )
        catalog = load_catalog(default_catalog_path(self.cfg.black))
        batches: list[pa.RecordBatch] = []
        pos = first
        while pos < end:
            try:
                for batch in reader.read(pos, end):
                    batches.append(spool_batch_to_rows(channel, batch, catalog))
                    pos += batch.num_rows
            except SpoolGapError as e:
                nxt = [s for s in list_segments(reader.directory) if pos < s < end]
                log_event(
                    log, 40, "spool records of a bundle interrupted by a crash are missing",
                    channel=channel, first_pos=pos, last_pos=(nxt[0] if nxt else end) - 1,
                    error=str(e),
                )  # fmt: skip
                if not nxt:
                    break
                pos = nxt[0]
        return pa.Table.from_batches(batches, schema=source_schema())

    @staticmethod
    def _reseal_manifest(old: Manifest, rows: pa.Table) -> Manifest:
        """Same bundle seq, chain link and coverage; a new id; missing rows become gaps; the
        inexact ranges keep exactly the seqs still rows (a range split where rows are gone)."""
        have = set(rows.column("seq").to_pylist())
        gaps = list(old.gaps)
        if old.first_seq is not None and old.last_seq is not None:
            gaps += [
                Gap(s, s, "unrecoverable")
                for s in range(old.first_seq, old.last_seq + 1)
                if s not in have and not any(g.first_seq <= s <= g.last_seq for g in old.gaps)
            ]
        gaps.sort(key=lambda g: g.first_seq)
        n = len(rows)
        return Manifest(
            format=1,
            channel=old.channel,
            bundle_seq=old.bundle_seq,
            bundle_id=uuid.uuid4().hex,
            first_seq=int(pc.min(rows.column("seq")).as_py()) if n else None,
            last_seq=int(pc.max(rows.column("seq")).as_py()) if n else None,
            rows=n,
            exchanges=dict(sorted(Tally(rows.column("exchange").to_pylist()).items())),
            created_at=_now_rfc3339(),
            bridge_id=old.bridge_id,
            schema_version=ROW_SCHEMA_VERSION,
            prev_sha256=old.prev_sha256,
            gaps=tuple(_merge_gaps(gaps)),
            inexact=tuple(
                _merge_gaps(
                    [
                        Gap(q, q, r.reason)
                        for r in old.inexact
                        for q in range(r.first_seq, r.last_seq + 1)
                        if q in have
                    ]
                )
            ),
        )

    def _ship(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        manifest: Manifest,
        plain: pa.Buffer,
        sha: str,
    ) -> ShippedBundle:
        """Seal, deliver and commit a bundle whose intent is already journaled (recovery)."""
        sealed = self._encrypt(channel, manifest, plain)
        size = self._within_ceiling(channel, manifest, sealed)
        return self._deliver(channel, st, manifest, sealed, size, sha, len(plain))

    def _encrypt(self, channel: ChannelConfig, manifest: Manifest, plain: pa.Buffer) -> Path:
        """gpg signs (and encrypts) ``plain`` into a fsynced temp file outside the outbox."""
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        sealed = self.outbox.temp_for(name)
        self.gpg.seal(  # plaintext handed to gpg in memory: it never touches the disk
            memoryview(plain),
            sealed,
            signer=self.cfg.black.signing_key,
            recipients=channel.recipients,
            encrypt=channel.encrypt,
            hide_recipients=self.cfg.black.bundle.hide_recipients,
        )
        return sealed

    def _deliver(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        manifest: Manifest,
        sealed: Path,
        size: int,
        sha: str,
        plain_bytes: int,
    ) -> ShippedBundle:
        """Deliver a sealed bundle of ``size`` bytes (checked: ``_within_ceiling``), commit it."""
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        self.outbox.deliver(name, sealed, channel=channel.name, synced=True)  # gpg fsynced it
        crash_point("seal.after_deliver")
        return self._commit(channel, st, manifest, sha, size, plain_bytes)

    def _commit(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        manifest: Manifest,
        sha: str,
        size: int,
        plain_bytes: int,
    ) -> ShippedBundle:
        """The bundle is durably in the outbox: advance the chain and the journal."""
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        undecodable = int((st.pending or {}).get("undecodable_rows", 0))
        undecodable_seqs = list((st.pending or {}).get("undecodable_seqs", []))
        st.last_bundle_seq = manifest.bundle_seq
        st.last_seq = _covered_last(manifest, st)
        st.last_sha256 = sha
        st.pending = None
        st.bump("bundles")
        st.bump("messages", manifest.rows)
        append_gaps(self.store.dir, manifest.channel, manifest.bundle_seq, manifest.gaps)
        append_gaps(
            self.store.dir, manifest.channel, manifest.bundle_seq, manifest.inexact, kind="inexact"
        )
        for r in manifest.inexact:
            n_inexact = r.last_seq - r.first_seq + 1
            st.bump(f"inexact_{r.reason}", n_inexact)
            BLACK.messages_inexact.labels(manifest.channel, r.reason).inc(n_inexact)
        for g in manifest.gaps:
            st.bump(f"lost_{g.reason}", g.last_seq - g.first_seq + 1)
            BLACK.messages_lost.labels(manifest.channel, g.reason).inc(g.last_seq - g.first_seq + 1)
            log_event(
                log, 40, "gap: messages lost on black",
                channel=manifest.channel, bundle_seq=manifest.bundle_seq,
                first_seq=g.first_seq, last_seq=g.last_seq, reason=g.reason,
            )  # fmt: skip
        if undecodable:
            st.bump("undecodable", undecodable)
        self.store.save(st)
        if undecodable:
            BLACK.messages_undecodable.labels(manifest.channel).inc(undecodable)
            self._log_undecodable(manifest, undecodable, undecodable_seqs)
        BLACK.bundles_sealed.labels(manifest.channel).inc()
        BLACK.messages_sealed.labels(manifest.channel).inc(manifest.rows)
        BLACK.bytes_sealed.labels(manifest.channel).inc(size)
        BLACK.last_bundle_seq.labels(manifest.channel).set(manifest.bundle_seq)
        log_event(
            log, 20, "bundle sealed",
            channel=manifest.channel, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
            rows=manifest.rows, plaintext_bytes=plain_bytes, sealed_bytes=size,
            encrypted=channel.encrypt,
        )  # fmt: skip
        return ShippedBundle(
            channel=manifest.channel,
            bundle_seq=manifest.bundle_seq,
            bundle_id=manifest.bundle_id,
            name=name,
            rows=manifest.rows,
            first_seq=manifest.first_seq,
            last_seq=manifest.last_seq,
            gaps=tuple(manifest.gaps),
            plaintext_bytes=plain_bytes,
            sealed_bytes=size,
            sha256=sha,
        )

    def _log_undecodable(self, manifest: Manifest, count: int, seqs: list[int]) -> None:
        """Warn of the undecodable messages sealed since the last warning of the channel, at
        most every ``UNDECODABLE_LOG_S`` (the counter and the metric count every one)."""
        u = self._unlogged.setdefault(manifest.channel, _Unlogged())
        u.count += count
        u.seqs = (u.seqs + seqs)[:UNDECODABLE_SEQS]
        now = time.monotonic()
        if u.logged_at is not None and now - u.logged_at < UNDECODABLE_LOG_S:
            return
        log_event(
            log, 30, "messages whose property bytes do not decode were sealed: carried exact "
            "in properties_raw, their derived columns null (protocol §5)",
            channel=manifest.channel, bundle_seq=manifest.bundle_seq, count=u.count,
            seqs=u.seqs,
        )  # fmt: skip
        self._unlogged[manifest.channel] = _Unlogged(logged_at=now)
