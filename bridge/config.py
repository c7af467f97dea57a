"""Both sides: typed configuration from ``conf/*.toml`` with ``DIODE__SECTION__KEY`` env overrides.

Layout of a config file (see ``conf/diode.example.toml``, every key commented there):

* ``[link]``: keys that must agree on both sides of the diode (bridge id, pinned signers);
* ``[[channels]]``: the routes, shared by both sides;
* ``[black]`` (with ``[black.bundle]``) and ``[red]``: one section per side.

Unknown keys are errors, and so are values of the wrong TOML type (``encrypt = "off"``,
``max_rows = "5000"``: never coerced). Relative paths are resolved against the config file's
folder. An override ``DIODE__SECTION__KEY`` takes its value as written for text keys (strings,
paths, secrets; a TOML string in double quotes is unquoted) and as a TOML value for the others
(``5000``, ``true``, ``["a", "b"]``); an error in an override names the variable. The
``[[channels]]`` entries cannot be overridden one by one (``DIODE__CHANNELS`` replaces the list).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from bridge.crypto.fingerprint import normalize_fingerprint
from bridge.errors import ConfigError, CryptoError
from bridge.protocol.exchange import check_exchange_name

__all__ = [
    "BlackConfig",
    "BundleConfig",
    "ChannelConfig",
    "Config",
    "LinkConfig",
    "RedConfig",
    "ReplayConfig",
    "UdpConfig",
    "UdpReceiveConfig",
    "UdpSendConfig",
    "load_config",
    "ENV_PREFIX",
]

ENV_PREFIX = "DIODE__"
NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _fingerprint(value: str, where: str) -> str:
    try:
        return normalize_fingerprint(value, what=where)
    except CryptoError as e:  # pydantic reports ValueErrors with the key's location
        raise ValueError(str(e)) from None


def _gpg_binary(value: str) -> str:
    """A ``<side>.gpg_binary`` as written: a name looked up on PATH or a path (a relative one was
    resolved against the config file's folder). Whether it runs GnuPG 2.2+ is checked where
    that side starts (``bridge.crypto.gpg.check_gpg_binary``), not here: both sides read one
    file, and each side's gpg exists on its own host only."""
    if not value.strip() or any(c in value for c in "\0\n\r"):
        raise ValueError(
            f'{value!r}: give the gpg to run, a name on PATH ("gpg", "gpg2") or a path '
            '("/opt/gnupg-2.4/bin/gpg"), on one line; or remove the key to run `gpg` from PATH'
        )
    return value


GpgBinary = Annotated[str, AfterValidator(_gpg_binary)]


class LinkConfig(_Strict):
    """Keys that must agree on both sides of the diode."""

    bridge_id: str = Field(default="diode-bridge", pattern=NAME_RE)
    """Name of this black bridge; travels in every manifest and heartbeat."""

    black_signers: list[str] = Field(default_factory=list)
    """Fingerprints of black signing keys; red accepts only bundles signed by one of these."""

    @model_validator(mode="after")
    def _check(self) -> LinkConfig:
        fprs = [_fingerprint(f, "link.black_signers") for f in self.black_signers]
        object.__setattr__(self, "black_signers", fprs)
        return self


class ChannelConfig(_Strict):
    """One configured route across the diode, with its own bundle sequence."""

    name: str = Field(pattern=NAME_RE)
    """Channel name: lowercase letters, digits, '-' and '_' (it appears in file names)."""

    exchanges: list[str] = Field(default_factory=lambda: ["*"])
    """Shell-style patterns (fnmatch) of black exchange names mirrored into this channel."""

    deny: list[str] = Field(default_factory=list)
    """Patterns never mirrored, on top of the built-in deny list (the default exchange, amq.*)."""

    direct_routing_keys: dict[str, list[str]] = Field(default_factory=dict)
    """Direct exchanges have no catch-all binding: exchange name -> routing keys to mirror."""

    recipients: list[str] = Field(default_factory=list)
    """Fingerprints of the red keys entitled to read this channel (encrypted to all of them)."""

    encrypt: bool = True
    """False ships signed plaintext: an explicit, logged opt-out."""

    transport: Literal["file", "udp"] = "file"
    """How this channel's files cross: "file" leaves them in the outbox for the diode vendor's
    mover; "udp" lets `diode udp send` carry them (needs the [udp] section)."""

    @model_validator(mode="after")
    def _check(self) -> ChannelConfig:
        fprs = [_fingerprint(f, f"channels[{self.name}].recipients") for f in self.recipients]
        object.__setattr__(self, "recipients", fprs)
        if self.encrypt and not fprs:
            raise ValueError(
                f"channel {self.name!r} is encrypted but has no recipients: add red key "
                "fingerprints to `recipients`, or set `encrypt = false` to ship signed plaintext"
            )
        return self


class BundleConfig(_Strict):
    """How black cuts rows into bundles. A bundle is also closed at every micro-batch."""

    max_rows: int = Field(default=200_000, ge=1)
    """Rotate after this many messages."""

    max_bytes: int = Field(default=64 * 1024 * 1024, ge=4096)
    """Rotate when the uncompressed message bytes (bodies + headers) would pass this."""

    max_age_seconds: float = Field(default=5.0, gt=0)
    """Continuous runs cut a bundle at the last trigger before its first message would have
    waited longer than this in the spool: a quiet channel still ships within this time, a busy
    one rotates by rows or bytes first. Equal to trigger_seconds: every trigger cuts (lowest
    latency, most bundles)."""

    max_file_bytes: int = Field(default=1024 * 1024 * 1024, ge=65536)
    """Hard ceiling of a file on the wire (vendor diodes impose one); never exceeded."""

    zstd_level: int = Field(default=3, ge=1, le=22)
    """Parquet zstd compression level of every column but the message bodies."""

    body_zstd_level: int = Field(default=1, ge=1, le=22)
    """zstd level of the body column (bodies are often compressed or encrypted already: a high
    level costs time for little)."""

    hide_recipients: bool = True
    """gpg --throw-keyids: nobody learns from a bundle who else can read it."""


class TapConfig(_Strict):
    """The tap: mirror queue -> spool, acked only after fsync."""

    prefetch: int = Field(default=2000, ge=1, le=65535)
    """Deliveries in flight (basic.qos prefetch): also the most a crash can redeliver."""

    group_messages: int = Field(default=500, ge=1)
    """fsync the spool and ack (multiple) after this many deliveries..."""

    group_seconds: float = Field(default=0.05, gt=0, le=10)
    """...or this long after the first delivery not yet durable, whichever comes first..."""

    group_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)
    """...or once this many bytes wait (large messages: bounds the tap's memory)."""

    @model_validator(mode="after")
    def _group_fits_window(self) -> TapConfig:
        if self.group_messages > self.prefetch:
            raise ValueError(
                f"black.tap.group_messages ({self.group_messages}) must not exceed "
                f"black.tap.prefetch ({self.prefetch}): a group could never fill"
            )
        return self


class SpoolConfig(_Strict):
    """Black's spool on disk."""

    segment_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    """A segment file is closed once it reaches this size (released whole once shipped)."""

    segment_max_age_seconds: float = Field(default=300.0, gt=0)
    """...or once it is this old, so shipped data leaves the disk even when traffic is low."""

    max_bytes: int | None = Field(default=None, ge=16 * 1024 * 1024)
    """Quota of one channel's spool; at the quota the tap pauses (the backlog waits in the
    broker). Unset: only min_free_bytes limits it."""

    min_free_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    """The tap pauses while the spool's file system has less free space than this."""


class BlackConfig(_Strict):
    """The black (low) side: RabbitMQ -> Spark -> bundles in the outbox."""

    amqp_url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    """AMQP URL of the black broker and vhost (credentials never logged)."""

    management_url: str = "http://127.0.0.1:15672"
    """RabbitMQ management API, used to discover exchanges. No credentials in it: they go in
    management_user and management_password (a URL is shown in messages and status)."""

    @field_validator("management_url")
    @classmethod
    def _no_credentials_in_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                "carries credentials ('user:password@'): the URL is shown in messages and "
                "logs, and the API is asked with black.management_user / "
                "black.management_password anyway. Remove them from the URL and set those "
                "keys (the password also as DIODE__BLACK__MANAGEMENT_PASSWORD)"
            )
        return v

    management_user: str = "guest"
    """Management API user."""

    management_password: SecretStr = SecretStr("guest")
    """Management API password."""

    management_ca_file: Path | None = None
    """PEM bundle of the CA(s) that signed the certificate of an ``https://``
    management_url (a private CA). Unset: the system's CAs."""

    @field_validator("management_ca_file")
    @classmethod
    def _ca_file_usable(cls, v: Path | None) -> Path | None:
        if v is None:
            return v
        try:
            ssl.create_default_context(cafile=str(v))  # what requests will load
        except ssl.SSLError as e:  # an OSError too: first
            raise ValueError(
                f"CA file {v} holds no PEM certificate ({e.reason or e}): it must be the PEM "
                "bundle (-----BEGIN CERTIFICATE-----) of the CA that signed the management "
                "API's certificate"
            ) from None
        except OSError as e:  # missing, unreadable, a directory
            raise ValueError(
                f"CA file {v} cannot be read ({e.strerror or e}): point it at a readable PEM "
                "CA bundle, or remove the key to use the system's CAs"
            ) from None
        return v

    discover: bool = True
    """Discover exchanges through the management API (else only `direct_routing_keys` and
    exact names in `exchanges` are mirrored)."""

    discover_interval_seconds: float = Field(default=30.0, gt=0)
    """How often the running job looks for new exchanges."""

    mirror_prefix: str = Field(default="diode.mirror.", pattern=r"^[A-Za-z0-9_.:-]{1,200}$")
    """Mirror queues are named <mirror_prefix><channel>; their dead-letter queue
    <mirror_prefix><channel>.dead and the dead-letter exchange <mirror_prefix>dead-letter."""

    mirror_queue_type: Literal["classic", "quorum"] = "classic"
    """Mirror queue type. Both keep AMQP 0.9.1 messages unconverted; fixed at creation."""

    spool_dir: Path = Path("black/spool")
    """Black's durable spool: per channel, the deliveries the tap acknowledged, by position."""

    gnupg_home: Path = Path("keys/black")
    """GnuPG home holding the black signing key and the recipients' public keys."""

    gpg_binary: GpgBinary = "gpg"
    """The gpg black runs (every call, and gpgconf / gpg-connect-agent from beside it): a name
    looked up on PATH, or a path (relative: to the config file's folder). Checked at start to
    be GnuPG 2.2 or later when set."""

    signing_key: str = ""
    """Fingerprint of the black signing key (must be listed in link.black_signers)."""

    @field_validator("signing_key")
    @classmethod
    def _signing_fpr(cls, v: str) -> str:
        return _fingerprint(v, "black.signing_key") if v else v  # empty: `diode check` says so

    passphrase_file: Path | None = None
    """File (mode 0600, one line) holding the signing key's passphrase. Unset: the key has
    none, or the passphrase comes from the variable named by passphrase_env."""

    passphrase_env: str | None = Field(default="DIODE_BLACK_PASSPHRASE", pattern=ENV_NAME_RE)
    """Environment variable holding the signing key's passphrase, read when it is set."""

    outbox: Path = Path("black/outbox")
    """Where finished bundles appear (atomically) for the file diode's mover."""

    udp_outbox: Path | None = None
    """Where the files of "udp" channels appear for `diode udp send`. Unset: `outbox` (fine
    when every channel is "udp", or the mover takes only the "file" channels' names). Set it
    when channels of both transports share this black and the vendor's mover takes every
    file of `outbox`. On the outbox's file system (one staging dir serves both)."""

    archive: Path = Path("black/archive")
    """Copies of sent bundles, kept for `diode resend`."""

    archive_mode: Literal["copy", "link"] = "copy"
    """How a bundle enters the archive. "copy": a copy of its own (an in-kernel copy, a
    reflink where the file system has them), so nothing done to the outbox file can touch
    it. "link": a hard link to the outbox file, which saves writing and fsyncing every
    bundle a second time; only for movers that take files whole (read, then delete or
    rename) and never change one in place — contents, mode, owner or mtime are shared with
    the archived bundle, and outbox files show 2 links — and `archive` must be on the
    outbox's file system (a hard link is tried at start)."""

    staging_dir: Path | None = None
    """Where files are written before one rename makes them appear in `outbox` (a mover never
    sees a partial file). Must be on the outbox's file system, outside the outbox. Default:
    `.<outbox name>.staging` beside the outbox."""

    archive_retention_days: float = 14.0
    """Archived bundles older than this are pruned (never a bundle still pending in the
    journal). At least 1 hour (1/24 day): crash recovery re-drops a bundle from its archived
    copy, and a shorter retention would invite a prune racing the sealing of a bundle."""

    @field_validator("archive_retention_days")
    @classmethod
    def _retention_safe(cls, v: float) -> float:
        min_days = 1 / 24
        if not v >= min_days:  # NaN too
            raise ValueError(
                f"{v} days is below 1 hour: crash recovery re-drops an interrupted bundle "
                "from the archive, and a retention that short could prune it first (black "
                "would then re-seal it under a seq red may already hold). Set "
                "black.archive_retention_days to at least 0.042 (1 hour), and long enough for "
                "a resend request to come back (default 14)"
            )
        return v

    state_dir: Path = Path("black/state")
    """Black's durable journal (bundle sequence, hash chain, exchange catalog)."""

    checkpoint_dir: Path = Path("black/checkpoint")
    """Spark Structured Streaming checkpoint of the black job."""

    trigger_seconds: float = Field(default=5.0, gt=0)
    """Micro-batch interval of the continuous job; a bundle is never older than this."""

    max_messages_per_batch: int = Field(default=200_000, ge=1)
    """Read limit per micro-batch and channel (keeps memory flat under a backlog)."""

    max_batch_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    """Memory budget of one micro-batch (estimated from the average message size seen so far)."""

    heartbeat_seconds: float = Field(default=10.0, gt=0, le=86400)
    """A signed .dheartbeat per channel is written this often, even when idle (at most a day:
    the heartbeat's ``interval_seconds``, protocol §9)."""

    bundle: BundleConfig = Field(default_factory=BundleConfig)
    """Bundle rotation and size limits."""

    @model_validator(mode="after")
    def _age_vs_trigger(self) -> BlackConfig:
        if self.bundle.max_age_seconds < self.trigger_seconds:
            raise ValueError(
                f"black.bundle.max_age_seconds ({self.bundle.max_age_seconds}) is shorter than "
                f"black.trigger_seconds ({self.trigger_seconds}): bundles are only cut at a "
                "trigger, so it could not be honoured. Raise it, or lower trigger_seconds"
            )
        return self

    tap: TapConfig = Field(default_factory=TapConfig)
    """How the tap drains mirror queues into the spool."""

    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    """Spool segments and disk limits."""


class ReplayConfig(_Strict):
    """The replay publisher: red `messages` -> red RabbitMQ (approved exchanges only)."""

    amqp_url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    """AMQP URL of the red broker and vhost (credentials never logged)."""

    approved: list[str] = Field(default_factory=list)
    """Exchanges approved in the configuration (exact names; `diode approve` adds more at run
    time). Everything else stays landed for inspection and is not replayed."""

    in_flight: int = Field(default=1000, ge=1, le=65535)
    """Unconfirmed publishes allowed at once (publisher confirms)."""

    @field_validator("approved")
    @classmethod
    def _approved_names(cls, v: list[str]) -> list[str]:
        for name in v:
            try:
                check_exchange_name(name)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return v

    batch_rows: int = Field(default=20_000, ge=1)
    """Rows read from `messages` per step."""

    batch_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    """About how many bytes of rows (in memory) a step reads per exchange: a batch ends at
    `batch_rows` rows or at this size, whichever comes first (sized from the rows read before;
    an exchange's first batch is at most 1000 rows)."""

    poll_seconds: float = Field(default=1.0, gt=0)
    """How often the publisher looks for newly landed rows."""

    gap_hold_seconds: float = Field(default=30.0, ge=0, le=7 * 86400)
    """Hold-back: when bundles of a channel are missing (a transit gap), an exchange's rows
    above the gap wait up to this long after they landed for the gap to fill, so messages go
    out in seq order; then the exchange goes past the gap (audit `replay_gap_passed`) and the
    missing rows, if they come, are published when they land (`replayed_out_of_order`).
    0: never wait."""

    id_header: str = Field(default="", pattern=r"^(|[A-Za-z0-9_.:-]{1,128})$")
    """If set, every replayed message gets this extra header holding "<channel>:<seq>" (a
    stable id for consumers that de-duplicate). Empty (default): properties are replayed
    byte for byte, unchanged."""


class RedConfig(_Strict):
    """The red (high) side: inbox -> verified Delta tables -> red RabbitMQ."""

    gnupg_home: Path = Path("keys/red")
    """GnuPG home holding the red decryption key(s) and the pinned black public key(s)."""

    gpg_binary: GpgBinary = "gpg"
    """The gpg red runs (every call, and gpgconf / gpg-connect-agent from beside it): a name
    looked up on PATH, or a path (relative: to the config file's folder). Checked at start to
    be GnuPG 2.2 or later when set."""

    passphrase_file: Path | None = None
    """File (mode 0600, one line) holding the red decryption keys' passphrase. Unset: the
    keys have none, or the passphrase comes from the variable named by passphrase_env."""

    passphrase_env: str | None = Field(default="DIODE_RED_PASSPHRASE", pattern=ENV_NAME_RE)
    """Environment variable holding the red decryption keys' passphrase, read when it is set."""

    inbox: Path = Path("red/inbox")
    """Where bundles arrive from the diode (a vendor mover or the UDP receiver writes here)."""

    work_dir: Path = Path("red/work")
    """Red's working area on the inbox's file system: taken files (intake/) and temporary
    plaintext (plain/, swept at start)."""

    processed_dir: Path = Path("red/processed")
    """Every file red handled, kept unchanged as evidence (by UTC date)."""

    quarantine_dir: Path = Path("red/quarantine")
    """Files red refused, each with a `<name>.reason.json` beside it. Never deleted by red."""

    state_dir: Path = Path("red/state")
    """Red's durable state: landing journal, sequence state, replay progress, approvals."""

    checkpoint_dir: Path = Path("red/checkpoint")
    """Spark Structured Streaming checkpoint of the red job."""

    tables_dir: Path = Path("red/tables")
    """Root of the Delta tables `messages`, `bundles` and `audit`."""

    delta_engine: Literal["auto", "spark", "delta-rs"] = "auto"
    """`spark`: format("delta") (needs the Delta jars on Spark's classpath); `delta-rs`: the
    deltalake package; `auto`: spark when the jars are there, else delta-rs."""

    trigger_seconds: float = Field(default=2.0, gt=0)
    """Continuous job: the inbox is listed at least this often; inotify events are acted on
    within 0.5 s (the query polls the source that often; an idle poll costs almost nothing)."""

    settle_seconds: float = Field(default=2.0, ge=0)
    """A file is taken when its writer closed it, or when its size and mtime have not
    changed for this long (a vendor mover may write in place). A file that is not valid by
    then is quarantined."""

    max_files_per_batch: int = Field(default=64, ge=1)
    """Files verified per micro-batch (bounds memory: plaintexts are read one at a time)."""

    max_batch_bytes: int = Field(default=256 * 1024 * 1024, ge=1024 * 1024)
    """Bytes of inbox files per micro-batch (at least one file): bounds the memory of one
    landing, whose Delta write holds its rows."""

    link_silent_seconds: float = Field(default=60.0, gt=0)
    """No heartbeat for this long: the link is reported silent (audit, metric, status)."""

    max_plain_bytes: int | None = Field(default=None, ge=1024)
    """Cap on one bundle's decrypted plaintext, refused (quarantine ``crypto``) above it. Unset:
    the file's size + 1 MiB (no compression bomb gets further; black seals with ``-z 0``)."""

    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    """Replay publisher."""


def _unspecified(host: str) -> bool:
    """True for any spelling of the all-interfaces address (``0.0.0.0``, ``0``, ``0.0``,
    ``::``, ``::0``, ``0:0::0``...), as the socket layer would read it."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)
    try:
        return socket.inet_aton(host) == bytes(4)  # the legacy numeric forms: "0", "0.0", "0x0"
    except OSError:
        return False  # a host name: resolved when the socket is bound


def _host_port(value: str, where: str) -> str:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{where} must be HOST:PORT (an IPv6 host in brackets), got {value!r}")
    if _unspecified(host):
        raise ValueError(
            f"{where} = {value!r} would use every interface: name the one address that faces "
            "the diode"
        )
    return value


class UdpSendConfig(_Strict):
    """Black: `diode udp send` carries the outbox files of "udp" channels as datagrams."""

    destination: str = "127.0.0.1:47100"
    """HOST:PORT datagrams are sent to (the diode's input, the relay, or the receiver)."""

    source: str = ""
    """Optional HOST:PORT to send from (the interface that faces the diode); empty: any."""

    rate_bytes_per_second: int = Field(default=100_000_000, ge=10_000)
    """Token-bucket pace of datagram bytes (UDP payload, repair symbols included). Never send
    faster than the diode and the receiver can take: loss follows the receiver's CPU."""

    burst_bytes: int = Field(default=256 * 1024, ge=65_536)
    """Token-bucket depth: the most sent back to back before pacing applies."""

    repair_overhead: float = Field(default=0.1, ge=0, le=4)
    """Repair symbols per block as a fraction of its source symbols: 0.1 for up to ~2% random
    loss (with 128-symbol blocks it loses ~1% of blocks at 5%); 0.25 for 5% or bursty links."""

    min_repair_symbols: int = Field(default=2, ge=0, le=1000)
    """At least this many repair symbols per block (small files are one small block)."""

    block_symbols: int = Field(default=128, ge=1, le=4096)
    """Source symbols per FEC block: larger blocks resist loss better and cost more memory.
    block_symbols x udp.mtu must stay within 8 MiB (RaptorQ keeps such a block whole)."""

    interleave_datagrams: int = Field(default=4096, ge=1, le=1_000_000)
    """Each block's symbols are spread over this many datagrams, so a burst of B lost
    datagrams takes about B * block size / this from any block."""

    gso: Literal["auto", "off"] = "auto"
    """"auto": datagrams of one size leave in one system call (UDP GSO), falling back to one
    call per datagram, with a warning, where the kernel or the device refuses it; "off": one
    call per datagram. The wire carries the same datagrams either way."""

    encode_workers: int = Field(default=1, ge=0, le=16)
    """Processes that make the RaptorQ repair symbols while the sender seals and sends (the
    encoder holds Python's lock: in the sender's process it takes about half of its time per
    datagram). 0: encode in the sender's process. The datagrams are the same either way."""

    copies: int = Field(default=1, ge=1, le=16)
    """Send every file this many times (later copies carry fresh repair symbols)."""

    heartbeat_seconds: float = Field(default=2.0, gt=0, le=3600)
    """A link heartbeat datagram (epoch, per channel last seq sent, counters) this often."""

    scan_seconds: float = Field(default=0.5, gt=0, le=60)
    """How often the outbox is listed when nothing woke the sender."""

    settle_seconds: float = Field(default=1.0, ge=0, le=3600)
    """A file is taken once unchanged (size, mtime) for this long, so one written in place
    under its final name (an operator's `cp`) is not sent half-written. 0: take files at once,
    for an outbox where files only ever appear by rename (black's own do)."""

    state_dir: Path = Path("black/udp-send")
    """Sender's durable state: the epoch and the journal of files sent."""

    @model_validator(mode="after")
    def _check(self) -> UdpSendConfig:
        _host_port(self.destination, "udp.send.destination")
        if self.source:
            _host_port(self.source, "udp.send.source")
        return self


UDP_MIN_HELD_BYTES = 32 * 1024**2
"""Red, UDP receive: the least ``udp.receive.max_held_bytes``: the largest FEC block the receiver
rebuilds (8 MiB, RaptorQ's limit; ~8.5 MiB held with the bookkeeping of its up to 4096 symbols)
nearly four times over, for the block being finished, the next ones the sender's interleaving
has under way and the repair symbols a decode may take beyond K: below it, an object of such
blocks could evict itself before its first block is rebuilt, and never complete."""


class UdpReceiveConfig(_Strict):
    """Red: `diode udp receive` reassembles datagrams into files in red's inbox."""

    bind: str = "127.0.0.1:47100"
    """HOST:PORT to receive on: one address, never every interface."""

    inbox: Path | None = None
    """Where completed files go; default: red.inbox."""

    spool_dir: Path = Path("red/udp-spool")
    """Durable reassembly spool (survives kill -9); on the inbox's file system."""

    expire_seconds: float = Field(default=120.0, gt=0)
    """An object with no new symbol for this long is expired: logged and recorded as a gap. Also
    the grace before an object id known to exist (a later id seen, or the sender's heartbeat)
    with no datagram of it at all is recorded as an ``unseen`` gap."""

    rcvbuf_bytes: int = Field(default=8 * 1024 * 1024, ge=65_536)
    """Socket receive buffer asked for (SO_RCVBUFFORCE as root, else capped by rmem_max)."""

    gro: Literal["auto", "off"] = "auto"
    """"auto": ask the kernel to hand over datagrams that arrive together as one buffer
    (UDP GRO, where the NIC or the kernel coalesces them), cut apart here; "off": one system
    call per datagram. The same datagrams are received either way."""

    max_object_bytes: int = Field(default=4 * 1024**3, ge=1024)
    """Objects announcing more than this are refused (counted, never spooled)."""

    max_open_objects: int = Field(default=256, ge=1)
    """Objects reassembled at once; beyond it the oldest incomplete one is expired."""

    max_held_bytes: int = 512 * 1024**2
    """Memory the decoders may hold: the symbols of the blocks not yet rebuilt, each with
    ~128 bytes of bookkeeping, across every open object. Beyond it the object idle longest is
    evicted (an ``evicted`` gap), at run time and when a restart reopens the spool. At least
    32 MiB (``UDP_MIN_HELD_BYTES``), and at least twice what the sender's interleaving keeps
    in flight: 2 x (udp.send.interleave_datagrams + udp.send.block_symbols) x udp.mtu (the
    receiver warns at start when it is not)."""

    @field_validator("max_held_bytes")
    @classmethod
    def _held_floor(cls, v: int) -> int:
        if v < UDP_MIN_HELD_BYTES:
            raise ValueError(
                f"{v} bytes is below {UDP_MIN_HELD_BYTES} ({UDP_MIN_HELD_BYTES >> 20} MiB): "
                "an FEC block the receiver rebuilds may be 8 MiB (~8.5 MiB held with its "
                "symbols' bookkeeping), and the sender has the next one under way before it "
                "completes; under a smaller cap an object of such blocks evicts itself and never "
                f"completes. Set udp.receive.max_held_bytes to at least {UDP_MIN_HELD_BYTES}"
            )
        return v

    decode_workers: int = Field(default=1, ge=0, le=16)
    """Processes that rebuild, with RaptorQ, the blocks that lost a source symbol while the
    receiver reads the socket (the decoder holds Python's lock: in the receiver's process it
    takes about a fifth of its time per datagram at 1% loss). 0: decode in the receiver's
    process. The files delivered are the same either way."""

    @model_validator(mode="after")
    def _check(self) -> UdpReceiveConfig:
        _host_port(self.bind, "udp.receive.bind")
        return self


class UdpConfig(_Strict):
    """The UDP transport (DESIGN.md 3.6); both sides need the same key_file and mtu."""

    key_file: Path = Path("keys/udp.key")
    """Pre-shared key authenticating every datagram: 64 hex digits, mode 0600, the same
    file on both sides (`diode udp keygen` makes one)."""

    mtu: int = Field(default=1500, ge=576, le=65535)
    """Link MTU; datagrams are sized to fit one IP packet (9000 for jumbo frames)."""

    send: UdpSendConfig = Field(default_factory=UdpSendConfig)
    """Black: the sender."""

    receive: UdpReceiveConfig = Field(default_factory=UdpReceiveConfig)
    """Red: the receiver."""

    @model_validator(mode="after")
    def _check_block(self) -> UdpConfig:
        from bridge.diode.udp_fec import MAX_BLOCK_BYTES

        most = MAX_BLOCK_BYTES // self.mtu
        if self.send.block_symbols > most:
            raise ValueError(
                f"udp.send.block_symbols = {self.send.block_symbols} at udp.mtu = {self.mtu} "
                f"makes FEC blocks of up to {self.send.block_symbols * self.mtu} bytes; RaptorQ "
                f"keeps a block whole only up to {MAX_BLOCK_BYTES} bytes: set block_symbols "
                f"<= {most}"
            )
        return self


class Config(_Strict):
    """The whole configuration; both sides read the same file."""

    link: LinkConfig = Field(default_factory=LinkConfig)
    """Keys that must agree across the diode."""

    channels: list[ChannelConfig] = Field(default_factory=list)
    """Configured routes."""

    black: BlackConfig = Field(default_factory=BlackConfig)
    """Black side."""

    red: RedConfig = Field(default_factory=RedConfig)
    """Red side."""

    udp: UdpConfig | None = None
    """UDP transport; required when a channel has transport = "udp"."""

    source: Path | None = None
    """The file this configuration was read from (set by load_config)."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        if not self.channels:
            raise ValueError("no [[channels]] configured: add at least one channel")
        names = [c.name for c in self.channels]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"channel names must be unique; repeated: {dupes}")
        udp = [c.name for c in self.channels if c.transport == "udp"]
        if udp and self.udp is None:
            raise ValueError(
                f'channels {udp} have transport = "udp" but there is no [udp] section: add one '
                '(see conf/diode.example.toml), or set transport = "file"'
            )
        b = self.black
        if b.udp_outbox is not None:
            if not udp:
                raise ValueError(
                    'black.udp_outbox is set but no channel has transport = "udp": remove it'
                )
            for key in ("outbox", "archive", "staging_dir"):
                other = getattr(b, key)
                if other is not None and _nested(Path(b.udp_outbox), Path(other)):
                    raise ValueError(
                        f"black.udp_outbox {b.udp_outbox} and black.{key} {other} overlap: "
                        "give the UDP channels' files a directory of their own beside the outbox"
                    )
        return self

    def udp_channels(self) -> list[str]:
        """Names of the channels whose files the UDP sender carries."""
        return [c.name for c in self.channels if c.transport == "udp"]

    def udp_outbox(self) -> Path:
        """Where the UDP sender takes its files (``black.udp_outbox``, else the outbox)."""
        return Path(self.black.udp_outbox or self.black.outbox)

    def outbox_dirs(self) -> dict[str, Path]:
        """The channels whose files go to ``black.udp_outbox`` rather than the outbox."""
        if self.black.udp_outbox is None:
            return {}
        return dict.fromkeys(self.udp_channels(), Path(self.black.udp_outbox))

    def channel(self, name: str) -> ChannelConfig:
        for ch in self.channels:
            if ch.name == name:
                return ch
        raise ConfigError(
            f"unknown channel {name!r}; configured: {[c.name for c in self.channels]}"
        )


_PATH_KEYS = {
    "black": (
        "gnupg_home",
        "outbox",
        "udp_outbox",
        "archive",
        "state_dir",
        "checkpoint_dir",
        "spool_dir",
        "passphrase_file",
        "management_ca_file",
    ),
    "red": (
        "gnupg_home",
        "inbox",
        "passphrase_file",
        "work_dir",
        "processed_dir",
        "quarantine_dir",
        "state_dir",
        "checkpoint_dir",
        "tables_dir",
    ),
}

_TOML_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: bool is an int in Python
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "an array"),
    (dict, "a table"),
    (datetime.datetime, "a date-time"),
    (datetime.date, "a date"),
    (datetime.time, "a time"),
)


def _toml_type(value: Any) -> str:
    """What a value read from TOML is, in TOML's words (never the value: it may be a secret)."""
    for t, words in _TOML_TYPES:
        if isinstance(value, t):
            return words
    return f"a {type(value).__name__}"


class _Origins:
    """Where each value came from: the config file, or an environment variable (by key path)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.env: dict[tuple[str, ...], str] = {}
        """Key path set by an environment override -> the variable's name."""

    def env_of(self, loc: tuple[str | int, ...]) -> str | None:
        """The variable that set ``loc`` or a table holding it, if one did."""
        for n in range(len(loc), 0, -1):
            var = self.env.get(tuple(str(p) for p in loc[:n]))
            if var is not None:
                return var
        return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field typed ``Model`` or ``Model | None`` (not a list of them)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for t in (annotation, *(typing.get_args(annotation) if union else ())):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _is_text(annotation: Any) -> bool:
    """Whether a field holds text (str, secret, path, a choice of words; optional or not): the
    value of an environment override is then taken as it is written."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return all(_is_text(a) for a in args)
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    return annotation in (str, SecretStr, Path)


def _env_target(key: str, path: list[str]) -> Any:
    """The annotation of the field an override names; ConfigError naming the variable if it
    names no key (a typo, a section, an entry of a list)."""
    model: type[BaseModel] = Config
    for i, part in enumerate(path):
        dotted = ".".join(path[: i + 1])
        field = None if (model is Config and part == "source") else model.model_fields.get(part)
        if field is None:
            raise ConfigError(
                f"environment variable {key}: {dotted} is not a configuration key (typo? every "
                "key is in conf/diode.example.toml): fix the variable's name or unset it"
            )
        ann = field.annotation
        sub = _model_in(ann)
        last = i == len(path) - 1
        if sub is not None and not last:
            model = sub
            continue
        if sub is not None:
            example = next(iter(sub.model_fields)).upper()
            raise ConfigError(
                f"environment variable {key}: [{dotted}] is a section, not a key: override its "
                f"keys one by one, e.g. {key}__{example}=..."
            )
        if not last:
            if typing.get_origin(ann) is list and _model_in(typing.get_args(ann)[0]):
                raise ConfigError(
                    f"environment variable {key}: the [[{dotted}]] entries cannot be overridden "
                    "one by one from the environment (they are a list, not named sections): "
                    f"edit them in the config file, or replace the whole list with "
                    f"{ENV_PREFIX}{dotted.upper()}='[{{ name = \"a\", ... }}, ...]' (a TOML "
                    "array of inline tables)"
                )
            raise ConfigError(
                f"environment variable {key}: {dotted} is a single value, it has no keys: set "
                f"{ENV_PREFIX}{'__'.join(path[: i + 1]).upper()} instead"
            )
        return ann
    raise AssertionError("unreachable")  # pragma: no cover


def _parse_env_value(key: str, dotted: str, raw: str, annotation: Any) -> Any:
    """An override's value: text fields take the text as written (a TOML string in quotes, as
    the runbook writes secrets, is unquoted); every other field takes a TOML value (``5000``,
    ``true``, ``["a", "b"]``), and a value that is not one is refused, naming the variable."""
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        doc = {}
    ok = set(doc) == {"v"}  # one value, no smuggled keys on further lines
    if _is_text(annotation):
        return doc["v"] if ok and isinstance(doc["v"], str) else raw
    if not ok:
        raise ConfigError(
            f"environment variable {key} = {raw!r} is not a TOML value for {dotted}: write it as "
            'in the config file (true / false, 5000, 2.5, ["a", "b"]; text in double quotes)'
        )
    return doc["v"]


def _table(data: dict[str, Any], dotted: list[str], origins: _Origins) -> dict[str, Any]:
    """The table at ``dotted`` in ``data`` (created if absent); ConfigError if it is a plain
    value, naming where that value came from."""
    node = data
    for i, part in enumerate(dotted):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            where = ".".join(dotted[: i + 1])
            var = origins.env_of(tuple(dotted[: i + 1]))
            src = f"environment variable {var}" if var else origins.source
            raise ConfigError(
                f"{src}: {where} must be a table ([{where}]), got {_toml_type(nxt)}: write its "
                f"keys under a [{where}] header"
            )
        node = nxt
    return node


def _apply_env(data: dict[str, Any], environ: dict[str, str], origins: _Origins) -> None:
    for key, raw in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        annotation = _env_target(key, path)
        node = _table(data, path[:-1], origins)
        node[path[-1]] = _parse_env_value(key, ".".join(path), raw, annotation)
        origins.env[tuple(path)] = key


def _nested(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are the same directory or one holds the other."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def _path(raw: Any, base: Path) -> Any:
    """A path value resolved against ``base``; anything else is left for validation to refuse
    with the key's name (a path must be a string)."""
    if not isinstance(raw, str | os.PathLike):
        return raw
    value = Path(raw)
    return value if value.is_absolute() else base / value


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    for section, keys in _PATH_KEYS.items():
        sect = data.setdefault(section, {})
        if not isinstance(sect, dict):
            continue  # refused by validation, naming the section
        model = BlackConfig if section == "black" else RedConfig
        for k in keys:
            raw = sect.get(k, model.model_fields[k].default)
            if raw is not None:  # None: an optional path, unset
                sect[k] = _path(raw, base)
        gpg = sect.get("gpg_binary")
        if isinstance(gpg, str) and os.sep in gpg:  # a path; a bare name is looked up on PATH
            sect["gpg_binary"] = str(_path(gpg, base))
    red, black = data["red"], data["black"]
    udp = data.get("udp")
    if isinstance(udp, dict):
        inbox = red.get("inbox") if isinstance(red, dict) else None
        _resolve_udp_paths(udp, base, inbox)
    if not isinstance(black, dict):
        return
    staging, outbox = black.get("staging_dir"), black.get("outbox")
    if staging is None and isinstance(outbox, Path):  # beside the outbox, on its file system
        black["staging_dir"] = outbox.parent / f".{outbox.name}.staging"
    elif staging is not None:
        black["staging_dir"] = _path(staging, base)


def _resolve_udp_paths(udp: dict[str, Any], base: Path, red_inbox: Any) -> None:
    udp["key_file"] = _path(udp.get("key_file", UdpConfig.model_fields["key_file"].default), base)
    send = udp.setdefault("send", {})
    if isinstance(send, dict):
        default_state = UdpSendConfig.model_fields["state_dir"].default
        send["state_dir"] = _path(send.get("state_dir", default_state), base)
    recv = udp.setdefault("receive", {})
    if isinstance(recv, dict):
        default_spool = UdpReceiveConfig.model_fields["spool_dir"].default
        recv["spool_dir"] = _path(recv.get("spool_dir", default_spool), base)
        inbox = recv.get("inbox")
        recv["inbox"] = _path(inbox, base) if inbox not in (None, "") else red_inbox


def _key_places(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(key name, where to write it) for every key of ``model`` and its sub-tables:
    ``("max_rows", "black.bundle.max_rows")``, ``("recipients", "recipients in a
    [[channels]] table")``."""
    out = []
    for name, info in model.model_fields.items():
        if not prefix and name == "source":  # set by the loader, never written
            continue
        out.append((name, f"{prefix}{name}"))
        ann = info.annotation
        sub = _model_in(ann)
        if sub is not None:
            out += _key_places(sub, f"{prefix}{name}.")
        elif typing.get_origin(ann) is list and (item := _model_in(typing.get_args(ann)[0])):
            table = f"{prefix}{name}"
            out += [(k, f"{where} in a [[{table}]] table") for k, where in _key_places(item)]
    return out


def _elsewhere(loc: tuple[Any, ...]) -> list[str]:
    """Where else the unknown key at ``loc`` is a known key (at most 3 places): a key put in
    the wrong section (``max_rows`` under ``[black]``, not ``[black.bundle]``)."""
    if not loc or not isinstance(loc[-1], str):
        return []
    return [where for k, where in _key_places(Config) if k == loc[-1]][:3]


def _explain(e: Any) -> str:
    """A validation error in the operator's words (the TOML type that is wrong, the one
    expected); never the value, which may be a secret."""
    kind, got = e["type"], _toml_type(e.get("input"))
    wanted = {
        "bool_type": "a boolean (true or false, without quotes)",
        "int_type": "an integer (without quotes)",
        "float_type": "a number (without quotes)",
        "string_type": "a string (in double quotes)",
        "list_type": "an array ([...])",
        "dict_type": "a table",
        "model_type": "a table (a [section] header, or { ... })",
    }
    if kind == "extra_forbidden":
        places = _elsewhere(tuple(e["loc"]))
        if places:
            return f"unknown key here: did you mean {' or '.join(places)}?"
        return "unknown key (typo? see conf/diode.example.toml for every key)"
    if kind == "is_instance_of" and e.get("ctx", {}).get("class") == "Path":
        return f"must be a path (a string in double quotes), got {got}"
    if kind in wanted:
        return f"must be {wanted[kind]}, got {got}"
    return str(e["msg"])


def _format_validation(err: ValidationError, origins: _Origins) -> str:
    lines, from_file = [], False
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        var = origins.env_of(e["loc"])
        from_file = from_file or var is None
        where = f" (from environment variable {var})" if var else ""
        lines.append(f"  - {loc}{where}: {_explain(e)}")
    if not from_file:
        head = f"invalid configuration from the environment (config file {origins.source}):"
    else:
        head = f"invalid configuration in {origins.source}:"
        if origins.env:
            names = ", ".join(sorted(origins.env.values()))
            lines.append(f"  (environment overrides in effect: {names})")
    return "\n".join([head, *lines])


def config_from_dict(
    data: dict[str, Any],
    *,
    base: Path,
    source: str = "<dict>",
    environ: dict[str, str] | None = None,
) -> Config:
    """Validate a raw mapping (as read from TOML) into a Config; env overrides applied first.

    Types are strict: a value of the wrong TOML type (``encrypt = "off"``, ``max_rows =
    "5000"``) is refused, never coerced. Override values are parsed as TOML where the key is
    not text (``DIODE__BLACK__BUNDLE__MAX_ROWS=5000``, ``...__DISCOVER=false``)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    if "source" in data:
        raise ConfigError(
            f"{source}: unknown key 'source' at the top level (the file a config was read "
            "from is set by the loader, never written in it): remove it"
        )
    origins = _Origins(source)
    _apply_env(data, dict(os.environ) if environ is None else environ, origins)
    _resolve_paths(data, base)
    try:
        cfg = Config.model_validate(data, strict=True)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, origins)) from None
    fpr = cfg.black.signing_key  # a full fingerprint (validated) or empty
    if fpr and cfg.link.black_signers and fpr not in cfg.link.black_signers:
        raise ConfigError(
            f"{source}: black.signing_key {fpr} is not listed in link.black_signers "
            f"({', '.join(cfg.link.black_signers)}); red would reject every bundle. Check "
            "black.signing_key (a typo?), or if it is right add it to link.black_signers on "
            "both sides"
        )
    return cfg


def load_config(path: str | Path | None = None, *, environ: dict[str, str] | None = None) -> Config:
    """Read a TOML config (``path``, else $DIODE_CONFIG, else conf/diode.toml)."""
    env = dict(os.environ) if environ is None else environ
    p = Path(path or env.get("DIODE_CONFIG") or "conf/diode.toml")
    if p.exists() and not p.is_file():
        raise ConfigError(
            f"config file {p} is not a regular file (a directory?): pass the TOML file itself "
            "with --config or DIODE_CONFIG"
        )
    if not p.is_file():
        raise ConfigError(
            f"config file {p} not found: pass --config, set DIODE_CONFIG, or copy "
            "conf/diode.example.toml to conf/diode.toml"
        )
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): TOML "
            f"files are UTF-8; convert it, e.g. `iconv -f LATIN1 -t UTF-8 {p} > {p}.new` and "
            "move it back"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"cannot read config file {p}: {e.strerror or e}; make it readable by the user "
            "running diode (chmod 600, owned by that user)"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = config_from_dict(data, base=p.resolve().parent, source=str(p), environ=env)
    return cfg.model_copy(update={"source": p.resolve()})
