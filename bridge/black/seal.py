"""Black, seal: rows of a micro-batch -> manifests -> Parquet -> gpg -> outbox, journaled.

rows (one channel, any order)
  -> drop seqs already shipped (a replayed micro-batch)
  -> finish the pending bundle byte-identically, if a crash interrupted it
  -> chunk by rows / bytes / file ceiling, gaps from missing seqs
  -> per chunk: manifest, Parquet plaintext, journal intent, sign+encrypt, deliver, journal
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bridge.black.chunking import plan_chunks, row_size_estimate
from bridge.black.numbering import assign_seqs
from bridge.black.state import ChannelState, StateStore
from bridge.config import ChannelConfig, Config
from bridge.crypto.gpg import Gpg
from bridge.diode.file_drop import Outbox
from bridge.errors import StateError
from bridge.logs import get_logger, log_event
from bridge.metrics import BLACK
from bridge.protocol.bundle import pack_bundle, sha256_hex
from bridge.protocol.manifest import Gap, Manifest
from bridge.protocol.naming import bundle_name
from bridge.protocol.schema import ROW_SCHEMA_VERSION, row_schema

__all__ = ["BundleSealer", "ShippedBundle", "seal_overhead_bytes"]

log = get_logger("bridge.black.seal")


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


def _covered_last(manifest: Manifest, st: ChannelState) -> int:
    """Highest message seq a bundle accounts for (its rows or its gaps)."""
    covered = [g.last_seq for g in manifest.gaps]
    if manifest.last_seq is not None:
        covered.append(manifest.last_seq)
    return max([st.last_seq, *covered])


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

    # -- public -----------------------------------------------------------------------------
    def seal_rows(
        self, channel: ChannelConfig, table: pa.Table, *, first_retained: Callable[[], int]
    ) -> list[ShippedBundle]:
        """Seal every row of ``table`` (one channel) that no shipped bundle covers yet.

        Rows are identified by ``stream_offset``; their ``seq`` is assigned here, gapless,
        continuing black's journal. ``first_retained`` returns the stream's first retained
        message offset (asked only when offsets jump, to tell holes from retention loss).
        """
        with self.store.lock(channel.name):
            st = self.store.load(channel.name)
            table, offsets = self._number(table, st, first_retained)
            shipped: list[ShippedBundle] = []
            if st.pending is not None:
                shipped.append(self._finish_pending(channel, st, table))
                keep = pc.greater(table.column("seq"), st.last_seq)
                table, offsets = table.filter(keep), offsets[keep.to_numpy(zero_copy_only=False)]
            if len(table) == 0:
                return shipped
            bundle = self.cfg.black.bundle
            max_plain = bundle.max_file_bytes - seal_overhead_bytes(
                len(channel.recipients), bundle.max_file_bytes
            )
            seqs = table.column("seq").to_numpy()
            sizes = row_size_estimate(table)
            chunks, dropped = plan_chunks(
                seqs,
                sizes,
                last_seq=st.last_seq,
                max_rows=bundle.max_rows,
                max_bytes=min(bundle.max_bytes, max_plain),
                max_row_bytes=max_plain - 4096,
            )
            for i in dropped:
                log_event(
                    log,
                    40,
                    "message larger than the file ceiling: recorded as a gap",
                    channel=channel.name,
                    seq=int(seqs[i]),
                    stream_offset=int(offsets[i]),
                    bytes=int(sizes[i]),
                    max_file_bytes=bundle.max_file_bytes,
                )
            for ch in chunks:
                rows = table.slice(ch.start, ch.rows)
                shipped.extend(
                    self._seal_chunk(channel, st, rows, ch.gaps, max_plain, seqs, offsets)
                )
            return shipped

    def _number(
        self, table: pa.Table, st: ChannelState, first_retained: Callable[[], int]
    ) -> tuple[pa.Table, np.ndarray]:
        """Drop rows already shipped, sort by offset, assign seqs; returns (rows, offsets)."""
        if len(table):
            offs = table.column("stream_offset").to_numpy(zero_copy_only=False)
            if offs.min() <= st.last_offset:
                table = table.filter(pc.greater(table.column("stream_offset"), st.last_offset))
                offs = table.column("stream_offset").to_numpy(zero_copy_only=False)
            if len(offs) > 1 and not bool(np.all(offs[1:] > offs[:-1])):
                table = table.sort_by("stream_offset")  # partitions arrive in order as a rule
        offsets = table.column("stream_offset").to_numpy(zero_copy_only=False).astype(np.int64)
        seqs, _lost = assign_seqs(
            offsets, last_offset=st.last_offset, last_seq=st.last_seq, first_retained=first_retained
        )
        idx = table.schema.get_field_index("seq")
        table = table.set_column(idx, self.schema.field("seq"), pa.array(seqs, pa.int64()))
        return table.select(self.schema.names).cast(self.schema), offsets

    @staticmethod
    def _offset_covering(seqs: np.ndarray, offsets: np.ndarray, seq: int, default: int) -> int:
        """Stream offset of the last row with seq <= ``seq`` (rows dropped as gaps included)."""
        i = int(np.searchsorted(seqs, seq, side="right")) - 1
        return int(offsets[i]) if i >= 0 else default

    # -- internals --------------------------------------------------------------------------
    def _manifest(
        self, channel: str, st: ChannelState, rows: pa.Table, gaps: list[Gap]
    ) -> Manifest:
        seqs = rows.column("seq")
        n = len(rows)
        return Manifest(
            format=1,
            channel=channel,
            bundle_seq=st.last_bundle_seq + 1,
            bundle_id=uuid.uuid4().hex,
            first_seq=int(pc.min(seqs).as_py()) if n else None,
            last_seq=int(pc.max(seqs).as_py()) if n else None,
            rows=n,
            exchanges=dict(sorted(Tally(rows.column("exchange").to_pylist()).items())),
            created_at=_now_rfc3339(),
            bridge_id=self.cfg.link.bridge_id,
            schema_version=ROW_SCHEMA_VERSION,
            prev_sha256=st.last_sha256,
            gaps=tuple(gaps),
        )

    def _seal_chunk(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        rows: pa.Table,
        gaps: list[Gap],
        max_plain: int,
        seqs: np.ndarray,
        offsets: np.ndarray,
    ) -> list[ShippedBundle]:
        manifest = self._manifest(channel.name, st, rows, gaps)
        plain = pack_bundle(rows, manifest, zstd_level=self.cfg.black.bundle.zstd_level)
        if len(plain) > max_plain and len(rows) == 1:
            # one message that does not fit the file ceiling once packed: it is lost on black,
            # and the bundle says so (the estimate let it through)
            seq = int(rows.column("seq")[0].as_py())
            log_event(
                log, 40, "message larger than the file ceiling once packed: recorded as a gap",
                channel=channel.name, seq=seq, plaintext_bytes=len(plain), max_plain=max_plain,
            )  # fmt: skip
            rows = rows.slice(0, 0)
            manifest = self._manifest(channel.name, st, rows, [*gaps, Gap(seq, seq, "oversize")])
            plain = pack_bundle(rows, manifest, zstd_level=self.cfg.black.bundle.zstd_level)
        if len(plain) > max_plain and len(rows) > 1:
            # the estimate was off (incompressible data): split in two and try again
            head, tail = rows.slice(0, len(rows) // 2), rows.slice(len(rows) // 2)
            cut = int(tail.column("seq")[0].as_py())  # no gap contains a row's seq
            a = self._seal_chunk(
                channel, st, head, [g for g in gaps if g.last_seq < cut], max_plain, seqs, offsets
            )
            return a + self._seal_chunk(
                channel, st, tail, [g for g in gaps if g.first_seq > cut], max_plain, seqs, offsets
            )
        sha = sha256_hex(plain)
        last_offset = self._offset_covering(
            seqs, offsets, _covered_last(manifest, st), st.last_offset
        )
        st.pending = {
            "manifest": manifest.to_json().decode(),
            "sha256": sha,
            "last_offset": last_offset,
            "plaintext_bytes": len(plain),
        }
        self.store.save(st)  # intent: a crash from here on re-creates exactly this plaintext
        return [self._ship(channel, st, manifest, plain, sha, last_offset)]

    def _finish_pending(
        self, channel: ChannelConfig, st: ChannelState, table: pa.Table
    ) -> ShippedBundle:
        """Finish a bundle a crash interrupted: re-drop its sealed copy if it was archived,
        else re-create it byte-identically from the replayed rows."""
        assert st.pending is not None
        manifest = Manifest.from_json(st.pending["manifest"].encode())
        want = st.pending["sha256"]
        last_offset = int(st.pending["last_offset"])
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        if self.outbox.has_archived(channel.name, name):
            # sealed and archived (renamed whole) before the crash: red may already hold it,
            # so send exactly those bytes again rather than a new encryption of them
            size = self.outbox.redrop(channel.name, name)
            log_event(
                log, 30, "re-dropping the archived copy of a bundle interrupted by a crash",
                channel=channel.name, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
            )  # fmt: skip
            plain_bytes = int(st.pending.get("plaintext_bytes", 0))
            return self._commit(channel, st, manifest, want, size, plain_bytes, last_offset)
        if manifest.rows:
            mask = pc.and_(
                pc.greater_equal(table.column("seq"), manifest.first_seq),
                pc.less_equal(table.column("seq"), manifest.last_seq),
            )
            rows = table.filter(mask)
        else:
            rows = table.slice(0, 0)
        plain = pack_bundle(rows, manifest, zstd_level=self.cfg.black.bundle.zstd_level)
        sha = sha256_hex(plain)
        if sha != want:
            raise StateError(
                f"channel {channel.name!r} bundle {manifest.bundle_seq} ({manifest.bundle_id}) was "
                f"interrupted before delivery and its rows no longer rebuild the same plaintext "
                f"(sha {sha[:12]} != {want[:12]}, {len(rows)} of {manifest.rows} rows): the "
                "stream lost messages between the crash and the restart, or pyarrow changed. "
                "It never reached the outbox (no archived copy), so red has not seen it: inspect "
                "the stream retention, then clear `pending` in the channel state to go on"
            )
        log_event(
            log, 30, "re-creating a bundle interrupted by a crash",
            channel=channel.name, bundle_seq=manifest.bundle_seq, bundle_id=manifest.bundle_id,
        )  # fmt: skip
        return self._ship(channel, st, manifest, plain, sha, last_offset)

    def _ship(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        manifest: Manifest,
        plain: bytes,
        sha: str,
        last_offset: int,
    ) -> ShippedBundle:
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        sealed = self.outbox.temp_for(name)
        self.gpg.seal(  # plaintext piped to gpg: it never touches the disk
            plain,
            sealed,
            signer=self.cfg.black.signing_key,
            recipients=channel.recipients,
            encrypt=channel.encrypt,
            hide_recipients=self.cfg.black.bundle.hide_recipients,
        )
        size = sealed.stat().st_size
        if size > self.cfg.black.bundle.max_file_bytes:
            sealed.unlink(missing_ok=True)
            raise StateError(
                f"channel {channel.name!r} bundle {manifest.bundle_seq} sealed to {size} bytes, "
                f"over max_file_bytes {self.cfg.black.bundle.max_file_bytes}: a bug in the "
                "overhead bound (seal_overhead_bytes); raise the ceiling to go on"
            )
        self.outbox.deliver(name, sealed, channel=channel.name)
        return self._commit(channel, st, manifest, sha, size, len(plain), last_offset)

    def _commit(
        self,
        channel: ChannelConfig,
        st: ChannelState,
        manifest: Manifest,
        sha: str,
        size: int,
        plain_bytes: int,
        last_offset: int,
    ) -> ShippedBundle:
        """The bundle is durably in the outbox: advance the chain and the journal."""
        name = bundle_name(manifest.channel, manifest.bundle_seq, manifest.bundle_id)
        st.last_bundle_seq = manifest.bundle_seq
        st.last_seq = _covered_last(manifest, st)
        st.last_offset = max(st.last_offset, last_offset)
        st.last_sha256 = sha
        st.pending = None
        st.bump("bundles")
        st.bump("messages", manifest.rows)
        for g in manifest.gaps:
            st.bump(f"lost_{g.reason}", g.last_seq - g.first_seq + 1)
            BLACK.messages_lost.labels(manifest.channel, g.reason).inc(g.last_seq - g.first_seq + 1)
            log_event(
                log, 40, "gap: messages lost on black",
                channel=manifest.channel, bundle_seq=manifest.bundle_seq,
                first_seq=g.first_seq, last_seq=g.last_seq, reason=g.reason,
            )  # fmt: skip
        self.store.save(st)
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
