"""Black, heartbeat: a signed sequence manifest per channel every N seconds, even when idle.

Red uses it to notice a missing *last* bundle (the heartbeat names the last bundle seq
shipped) and a dead link (heartbeats stop). Heartbeats are protected like the channel's
bundles (signed, and encrypted unless the channel opted out) and dropped into the same
outbox under ``<channel>.<heartbeat seq>.dheartbeat``; they are not archived.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

from bridge.black.state import StateStore
from bridge.config import ChannelConfig, Config
from bridge.crypto.gpg import Gpg
from bridge.diode.file_drop import Outbox
from bridge.fsutil import durable_rename
from bridge.logs import get_logger, log_event
from bridge.metrics import BLACK
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.naming import heartbeat_name

__all__ = ["HeartbeatWriter", "HeartbeatLoop"]

log = get_logger("bridge.black.heartbeat")
PRUNE_EVERY_SECONDS = 3600.0


class HeartbeatWriter:
    """Writes one heartbeat file for a channel."""

    def __init__(self, cfg: Config, *, store: StateStore, gpg: Gpg, outbox: Outbox) -> None:
        self.cfg, self.store, self.gpg, self.outbox = cfg, store, gpg, outbox

    def beat(self, channel: ChannelConfig) -> str:
        """Write the next heartbeat of ``channel``; its seq is given back if writing fails.

        (A kill -9 between saving the seq and the rename can still skip one heartbeat seq:
        never a reused one.)
        """
        with self.store.lock(channel.name):
            st = self.store.load(channel.name)
            st.heartbeat_seq += 1
            hb = Heartbeat(
                format=1,
                channel=channel.name,
                bridge_id=self.cfg.link.bridge_id,
                heartbeat_seq=st.heartbeat_seq,
                last_bundle_seq=st.last_bundle_seq or None,
                last_seq=st.last_seq if st.last_seq >= 0 else None,
                black_time=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                interval_seconds=float(self.cfg.black.heartbeat_seconds),
                counters=dict(st.counters),
            )
            self.store.save(st)
            name = heartbeat_name(channel.name, hb.heartbeat_seq)
            try:
                data = self.gpg.seal_bytes(
                    hb.to_json(),
                    signer=self.cfg.black.signing_key,
                    recipients=channel.recipients,
                    encrypt=channel.encrypt,
                    hide_recipients=self.cfg.black.bundle.hide_recipients,
                )
                tmp = self.outbox.temp_for(name)
                with open(tmp, "wb") as f:
                    f.write(data)
                durable_rename(tmp, self.outbox.outbox / name)
            except BaseException:
                if not (self.outbox.outbox / name).exists():  # never hand back a seq in use
                    st.heartbeat_seq -= 1
                    self.store.save(st)
                raise
        BLACK.heartbeats_sent.labels(channel.name).inc()
        log_event(
            log,
            10,
            "heartbeat",
            channel=channel.name,
            heartbeat_seq=hb.heartbeat_seq,
            last_bundle_seq=hb.last_bundle_seq,
        )
        return name

    def beat_all(self) -> None:
        for ch in self.cfg.channels:
            try:
                self.beat(ch)
            except Exception as e:  # noqa: BLE001 - a failed heartbeat is logged, never fatal
                log_event(log, 40, f"heartbeat failed: {e}", channel=ch.name)


class HeartbeatLoop(threading.Thread):
    """Daemon thread: ``beat_all`` every ``heartbeat_seconds`` until stopped."""

    def __init__(
        self, writer: HeartbeatWriter, interval: float, outbox: Outbox | None = None
    ) -> None:
        super().__init__(name="diode-heartbeat", daemon=True)
        self.writer, self.interval, self.outbox = writer, interval, outbox
        self._stop_event = threading.Event()

    def run(self) -> None:
        pruned_at = time.monotonic()
        while not self._stop_event.is_set():
            self.writer.beat_all()
            if self.outbox is not None and time.monotonic() - pruned_at >= PRUNE_EVERY_SECONDS:
                pruned_at = time.monotonic()
                try:  # a continuous job keeps the archive within its retention
                    self.outbox.prune_archive()
                except OSError as e:
                    log_event(log, 40, f"archive pruning failed: {e}")
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
