"""Both sides: Prometheus metrics, named bridge_<side>_<object>_<event>."""

from __future__ import annotations

import errno

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from bridge.errors import ConfigError

__all__ = ["REGISTRY", "BLACK", "RED", "UDP", "serve_metrics"]

REGISTRY = CollectorRegistry()


class _Black:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.messages_sealed = Counter(
            "bridge_black_messages_sealed",
            "Messages sealed into bundles",
            ["channel"],
            registry=reg,
        )
        self.bundles_sealed = Counter(
            "bridge_black_bundles_sealed", "Bundles sealed and delivered", ["channel"], registry=reg
        )
        self.bytes_sealed = Counter(
            "bridge_black_bytes_sealed",
            "Sealed bytes written to the outbox",
            ["channel"],
            registry=reg,
        )
        self.messages_lost = Counter(
            "bridge_black_messages_lost",
            "Messages known lost on black (gaps), by reason",
            ["channel", "reason"],
            registry=reg,
        )
        self.messages_inexact = Counter(
            "bridge_black_messages_inexact",
            "Messages carried but not byte-exact as published (e.g. quorum re-encoding), by reason",
            ["channel", "reason"],
            registry=reg,
        )
        self.messages_undecodable = Counter(
            "bridge_black_messages_undecodable",
            "Messages sealed whose property bytes do not decode (protocol 5): carried exact in "
            "properties_raw, their derived columns null",
            ["channel"],
            registry=reg,
        )
        self.heartbeats_sent = Counter(
            "bridge_black_heartbeats_sent", "Heartbeat files written", ["channel"], registry=reg
        )
        self.last_bundle_seq = Gauge(
            "bridge_black_bundle_seq_last", "Last bundle seq delivered", ["channel"], registry=reg
        )
        self.bundles_recovered = Counter(
            "bridge_black_bundles_recovered",
            "Bundles a crash interrupted, finished at restart: redropped, rebuilt or resealed",
            ["channel", "how"],
            registry=reg,
        )
        self.tap_events = Gauge(
            "bridge_black_tap_events",
            "What the channel's tap counted since it started, once durable (delivered, "
            "redelivered_skipped, dead_redelivered_skipped, dead_possible_duplicate, "
            "handed_back, reconnects, denied, release_refused, lost_<reason>, inexact_<reason>), "
            "from its status file",
            ["channel", "event"],
            registry=reg,
        )
        self.spool_end = Gauge(
            "bridge_black_spool_end",
            "Next spool position (= next message seq) of the channel: durable up to here",
            ["channel"],
            registry=reg,
        )
        self.tap_status_age = Gauge(
            "bridge_black_tap_status_age_seconds",
            "Seconds since the channel's tap last reported (alarm when it grows: tap dead)",
            ["channel"],
            registry=reg,
        )
        self.tap_paused = Gauge(
            "bridge_black_tap_paused",
            "1 while the tap is paused because the spool is full",
            ["channel"],
            registry=reg,
        )
        self.spool_bytes = Gauge(
            "bridge_black_spool_bytes", "Bytes in the channel's spool", ["channel"], registry=reg
        )
        self.exchanges_unbound = Gauge(
            "bridge_black_exchanges_unbound",
            "Direct exchanges matching a channel but without routing keys",
            ["channel"],
            registry=reg,
        )
        self.mirror_queue_messages = Gauge(
            "bridge_black_mirror_queue_messages",
            "Messages waiting in the channel's mirror queue (queue=mirror) or its dead queue "
            "(queue=dead) at the last mirror sync (every discover_interval_seconds): alarm on it "
            "growing",
            ["channel", "queue"],
            registry=reg,
        )
        self.mirror_refusing = Gauge(
            "bridge_black_mirror_queue_refusing",
            "1 when a policy makes the channel's mirror queue refuse messages at its length "
            "limit (overflow reject-publish): losses black cannot count",
            ["channel"],
            registry=reg,
        )
        self.dead_queue_limited = Gauge(
            "bridge_black_dead_queue_limited",
            "1 when a policy or argument limits the channel's dead queue (max-length, "
            "max-length-bytes, message-ttl, expires, delivery-limit): dead letters it drops "
            "vanish without a recorded gap",
            ["channel"],
            registry=reg,
        )


BLACK = _Black(REGISTRY)


class _Red:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.files_processed = Counter(
            "bridge_red_files_processed", "Inbox files judged (any verdict)", registry=reg
        )
        self.files_rejected = Counter(
            "bridge_red_files_rejected",
            "Inbox files quarantined, by reason (signature, downgrade, bad_name, ...)",
            ["reason"],
            registry=reg,
        )
        self.bundles_landed = Counter(
            "bridge_red_bundles_landed", "Bundles landed in Delta", registry=reg
        )
        self.messages_landed = Counter(
            "bridge_red_messages_landed", "Message rows landed in Delta", registry=reg
        )
        self.duplicates = Counter(
            "bridge_red_bundles_duplicate", "Exact duplicate bundles ignored", registry=reg
        )
        self.conflicts = Counter(
            "bridge_red_bundles_conflict",
            "ALARM: a different bundle under an already landed (channel, bundle seq)",
            ["channel"],
            registry=reg,
        )
        self.events = Counter(
            "bridge_red_events",
            "Audit events by kind (gap_opened, chain_broken, link_silent, ...)",
            ["event"],
            registry=reg,
        )
        self.open_gaps = Gauge(
            "bridge_red_open_gaps",
            "Bundle seq ranges missing in transit, still open",
            ["channel"],
            registry=reg,
        )
        self.land_seq = Gauge("bridge_red_land_seq", "Last landing committed", registry=reg)
        self.contiguous_bundle_seq = Gauge(
            "bridge_red_contiguous_bundle_seq",
            "Highest bundle seq landed with every earlier one landed or written off",
            ["channel"],
            registry=reg,
        )
        self.known_bundle_seq = Gauge(
            "bridge_red_known_bundle_seq",
            "Highest bundle seq known to exist (landed, or announced by a heartbeat); minus the "
            "contiguous one: the bundles red still waits for",
            ["channel"],
            registry=reg,
        )
        self.heartbeat_received = Gauge(
            "bridge_red_heartbeat_received_timestamp_seconds",
            "Unix time red received the channel's last heartbeat file (age: time() - this)",
            ["channel"],
            registry=reg,
        )
        self.link_silent = Gauge(
            "bridge_red_link_silent",
            "ALARM when 1: no bundle or heartbeat of the channel for red.link_silent_seconds",
            ["channel"],
            registry=reg,
        )


RED = _Red(REGISTRY)


class _Udp:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.datagrams_sent = Counter(
            "bridge_udp_datagrams_sent",
            "Datagrams sent, by type (source, repair, heartbeat)",
            ["type"],
            registry=reg,
        )
        self.bytes_sent = Counter(
            "bridge_udp_bytes_sent",
            "UDP payload bytes sent (headers and repair included)",
            registry=reg,
        )
        self.objects_sent = Counter(
            "bridge_udp_objects_sent",
            "Files sent whole (once per file, whatever udp.send.copies)",
            ["channel"],
            registry=reg,
        )
        self.sender_state_errors = Counter(
            "bridge_udp_sender_state_errors",
            "Writes udp.send.state_dir refused (journal: no file starts until written; status, "
            "compaction: tried again)",
            ["what"],
            registry=reg,
        )
        self.sent_undeletable = Counter(
            "bridge_udp_sent_undeletable",
            "Tries to remove a sent file from the outbox that the OS refused (left, never sent "
            "again)",
            registry=reg,
        )
        self.datagrams_received = Counter(
            "bridge_udp_datagrams_received", "Datagrams read from the socket", registry=reg
        )
        self.datagrams_dropped = Counter(
            "bridge_udp_datagrams_dropped",
            "Datagrams dropped, by reason (short, magic, version, type, tag, malformed, "
            "duplicate, surplus, late, expired, too_large, spool_error, stale_epoch, replayed; "
            "socket_overflow: dropped by the kernel, the receive buffer full)",
            ["reason"],
            registry=reg,
        )
        self.objects_completed = Counter(
            "bridge_udp_objects_completed",
            "Files reassembled, digest checked and delivered to the inbox",
            ["channel"],
            registry=reg,
        )
        self.objects_expired = Counter(
            "bridge_udp_objects_expired",
            "Files given up (timeout, undecodable block, digest mismatch): recorded as gaps",
            ["channel", "reason"],
            registry=reg,
        )
        self.repair_symbols_used = Counter(
            "bridge_udp_repair_symbols_used",
            "Repair symbols that stood in for lost source symbols",
            registry=reg,
        )
        self.goodput_bytes = Counter(
            "bridge_udp_goodput_bytes", "Bytes of files delivered intact", registry=reg
        )
        self.heartbeat_age = Gauge(
            "bridge_udp_heartbeat_age_seconds",
            "Seconds since the last link heartbeat datagram, or since the receiver started while "
            "none came (alarm when it grows)",
            registry=reg,
        )
        self.sender_epoch = Gauge(
            "bridge_udp_sender_epoch", "Epoch of the sender session last heard", registry=reg
        )
        self.open_objects = Gauge(
            "bridge_udp_open_objects", "Objects being reassembled", registry=reg
        )


UDP = _Udp(REGISTRY)


def serve_metrics(port: int, addr: str = "127.0.0.1", *, option: str = "--metrics-port") -> None:
    """Expose /metrics on addr:port (loopback by default: nothing listens on all interfaces).

    A port outside 1..65535, or one that cannot be bound (in use, privileged), is a
    ConfigError naming ``option`` and the port."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"{option} {port!r} is not a TCP port: use 1..65535")
    try:
        start_http_server(port, addr=addr, registry=REGISTRY)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = (
                f"another process listens there (`ss -ltnp 'sport = :{port}'` shows which); "
                f"pick a free port for {option}"
            )
        elif e.errno == errno.EACCES:
            why = f"ports below 1024 need privileges; use {option} 1024 or above"
        else:
            why = f"pick another port for {option}"
        raise ConfigError(
            f"{option} {port}: cannot serve /metrics on {addr}:{port} ({e.strerror or e}): {why}"
        ) from None
