"""Test support, red: real keys, rows, sealed bundles, chains and heartbeats as black makes them.

Everything goes through the real codecs (``bridge.protocol``) and real gpg (``Gpg.seal``), so a
file made here is byte-for-byte what black would drop, unless a test asks for a forgery:

* ``RedKeys.create(root)``: black + red homes (red keys "red" and "audit") via ``init_keys``, and
  an independent *forger* signing key in its own home (not pinned, not known to red).
* ``make_rows``: rows of row schema v2 with real AMQP property bytes (headers of many types).
* ``make_bundle`` / ``make_chain`` / ``make_heartbeat``: sealed wire files, written under a
  hidden temp name then renamed (an inbox never sees half a file); ``inexact`` ranges in a
  bundle's manifest as black marks them. ``manifest_overrides`` /
  ``doc_overrides`` replace fields of the embedded JSON *after* validation, so a test can sign a
  manifest that lies (tampered name, unknown version, wrong counts).
* ``seal_as``: any plaintext sealed under any name (junk, bombs, hand-made Parquet).
* ``red_config``: a Config for one machine (both sides) with these keys.
* ``land_bundles``: bundles verified (real gpg) and landed as one micro-batch, no Spark.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from bridge.config import Config, config_from_dict, load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_keys
from bridge.protocol.bundle import manifest_for, pack_bundle, sha256_hex
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import MANIFEST_KEY, Gap, Manifest, format_utc
from bridge.protocol.naming import bundle_name, heartbeat_name
from bridge.protocol.properties import (
    ByteArray,
    Float32,
    Int8,
    Int16,
    Int64,
    LongString,
    Properties,
    Timestamp,
    UInt32,
    encode_properties,
    field_table,
)
from bridge.protocol.rows import build_rows
from bridge.protocol.schema import row_schema

if TYPE_CHECKING:
    from bridge.red.landing import LandingResult

__all__ = [
    "BundleMade",
    "HeartbeatMade",
    "RedKeys",
    "keyless_red_config",
    "kill_agents",
    "land_bundles",
    "make_bundle",
    "make_chain",
    "make_heartbeat",
    "make_rows",
    "red_config",
    "seal_as",
]

BRIDGE_ID = "diode-bridge"


# ---------------------------------------------------------------------------- keys


def kill_agents(root: Path) -> None:
    """Stop the gpg-agent of every GnuPG home under ``root`` (fixture teardown)."""
    for ring in Path(root).rglob("pubring.kbx"):
        subprocess.run(
            ["gpgconf", "--homedir", str(ring.parent), "--kill", "gpg-agent"],
            capture_output=True,
            check=False,
        )


@contextmanager
def temp_red_keys(prefix: str) -> Iterator[RedKeys]:
    """``RedKeys`` under a new short dir in /tmp (gpg-agent socket paths), its agents stopped and
    the dir removed afterwards: the body of a module-scoped ``keys`` fixture."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield RedKeys.create(root)
    finally:
        kill_agents(root)
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class RedKeys:
    """Key material of one test machine. Keep ``root`` short (gpg-agent socket paths)."""

    root: Path
    black_home: Path
    red_home: Path
    black_fpr: str
    red_fprs: dict[str, str]
    """Red key name -> fingerprint ("red", "audit")."""
    pub_dir: Path
    forger_home: Path
    forger_fpr: str
    """An independent signing key: not pinned, its public key NOT in ``red_home``."""
    _derived: dict[str, Path] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, root: Path, *, red_names: Sequence[str] = ("red", "audit")) -> RedKeys:
        root = Path(root)
        inv = init_keys(root / "keys", red_names=tuple(red_names), bridge_id=BRIDGE_ID)
        forger_home = root / "keys" / "forger"
        forger = Gpg(forger_home)
        forger_fpr = forger.quick_gen_key("forger <nobody@black>", algo="ed25519", usage="sign")
        for n in red_names:  # the forger can encrypt to red's real keys
            forger.import_keys((inv.pub_dir / f"{n}.asc").read_bytes())
        return cls(
            root=root,
            black_home=inv.black_home,
            red_home=inv.red_home,
            black_fpr=inv.black_fpr,
            red_fprs=dict(inv.red_fprs),
            pub_dir=inv.pub_dir,
            forger_home=forger_home,
            forger_fpr=forger_fpr,
        )

    @property
    def recipients(self) -> list[str]:
        """Every red key's fingerprint (a channel's ``recipients``)."""
        return list(self.red_fprs.values())

    def _derive(self, tag: str, red_names: Iterable[str], pubs: Iterable[bytes]) -> Path:
        """A red home holding only ``red_names``' secret keys plus ``pubs`` (cached)."""
        if tag in self._derived:
            return self._derived[tag]
        home = self.root / "keys" / tag
        gpg, src = Gpg(home), Gpg(self.red_home)
        for n in red_names:
            res = src._run(["--armor", "--export-secret-keys", "--", self.red_fprs[n]])
            assert res.rc == 0 and res.stdout, f"cannot export red key {n}: {res.reason()}"
            gpg.import_keys(res.stdout)
        gpg.import_keys((self.pub_dir / "black.asc").read_bytes())
        for pub in pubs:
            gpg.import_keys(pub)
        self._derived[tag] = home
        return home

    def home_with_only(self, red_name: str) -> Path:
        """A red home with ONE red secret key (and the black public key)."""
        return self._derive(f"only-{red_name}", [red_name], [])

    def home_knowing_forger(self) -> Path:
        """A red home with every red key, black's public key AND the forger's (unpinned)."""
        forger_pub = Gpg(self.forger_home).export_public(self.forger_fpr).encode("ascii")
        return self._derive("red-forger", list(self.red_fprs), [forger_pub])


# ---------------------------------------------------------------------------- rows


def _headers(seq: int) -> Any:
    """A header table using most AMQP field types (one per tag family)."""
    return field_table(
        {
            "str": f"value-{seq}",
            "int32": seq,
            "int64": Int64(2**40 + seq),
            "int8": Int8(-3),
            "int16": Int16(1234),
            "uint32": UInt32(4_000_000_000),
            "bool": seq % 2 == 0,
            "double": 1.5 + seq,
            "float": Float32(0.25),
            "bytes": ByteArray(b"\x00\xff\x10"),
            "decimal": decimal.Decimal("3.14"),
            "when": Timestamp(1_700_000_000 + seq),
            "nested": {"a": 1, "b": [1, "two", None]},
            "array": [1, 2.5, "x", True],
            "void": None,
            "long": LongString("ünïcødé"),
        }
    )


def make_properties(seq: int, *, headers: bool = True) -> bytes:
    """Real AMQP content-header property bytes for message ``seq``."""
    return encode_properties(
        Properties(
            content_type="application/json",
            content_encoding="utf-8",
            headers=_headers(seq) if headers else None,
            delivery_mode=2,
            priority=seq % 10,
            correlation_id=f"corr-{seq}",
            reply_to="replies",
            message_id=f"msg-{seq}",
            timestamp=1_700_000_000 + seq,
            type="order.created",
            app_id="factory",
        )
    )


def make_rows(
    channel: str,
    seqs: Iterable[int],
    exchange: str = "orders",
    exchange_type: str = "topic",
    *,
    routing_key: str = "order.created",
    body_bytes: int | None = None,
    headers: bool = True,
    exchange_arguments: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Rows of row schema v2 for ``seqs`` (strictly increasing), one exchange.

    Bodies are small JSON documents, or ``body_bytes`` pseudo-random (incompressible) bytes.
    """
    seq_list = list(seqs)
    if body_bytes is None:
        bodies = [json.dumps({"channel": channel, "seq": s}).encode() for s in seq_list]
    else:
        bodies = [_noise(s, body_bytes) for s in seq_list]
    decl = ExchangeDecl(
        name=exchange,
        type=exchange_type,
        arguments=dict(exchange_arguments or {"alternate-exchange": "unrouted"}),
    )
    batch = build_rows(
        channel,
        seq_list,
        [exchange] * len(seq_list),
        [routing_key] * len(seq_list),
        [False] * len(seq_list),
        [make_properties(s, headers=headers) for s in seq_list],
        bodies,
        {exchange: decl},
    )
    return pa.Table.from_batches([batch])


def _noise(seed: int, n: int) -> bytes:
    """``n`` deterministic bytes that zstd cannot shrink."""
    import random

    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------------------- sealing


def _write_atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename into place: a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def seal_as(
    out_dir: Path,
    keys: RedKeys,
    name: str,
    plaintext: bytes,
    *,
    encrypt: bool = True,
    signer_home: Path | None = None,
    signer_fpr: str | None = None,
    recipients: Sequence[str] | None = None,
    hide_recipients: bool = True,
) -> Path:
    """Seal ``plaintext`` exactly as black does (sign, encrypt, -z 0) into ``out_dir/name``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpg = Gpg(signer_home or keys.black_home)
    path = out_dir / name
    _write_atomic(
        path,
        lambda tmp: gpg.seal(
            plaintext,
            tmp,
            signer=signer_fpr or keys.black_fpr,
            recipients=list(recipients) if recipients is not None else keys.recipients,
            encrypt=encrypt,
            hide_recipients=hide_recipients,
        ),
    )
    return path


def _pack_raw(table: pa.Table, manifest_json: bytes) -> bytes:
    """Parquet like ``pack_bundle`` but with any manifest bytes and no consistency check."""
    schema = row_schema()
    table = table.cast(schema).replace_schema_metadata(schema.metadata)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({MANIFEST_KEY: manifest_json})
    return bytes(sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class BundleMade:
    """One sealed bundle: where it is, its plaintext and what its manifest says."""

    path: Path
    name: str
    plaintext: bytes
    sha256: str
    """SHA-256 of the plaintext (the next bundle's ``prev_sha256``)."""
    manifest: Manifest
    """The valid manifest the rows call for (before any ``manifest_overrides``)."""
    manifest_json: bytes
    """The manifest bytes actually embedded (canonical JSON, overrides applied)."""
    rows: pa.Table


def make_bundle(
    out_dir: Path,
    keys: RedKeys,
    channel: str,
    bundle_seq: int,
    rows_table: pa.Table,
    prev_sha256: str | None,
    gaps: Iterable[Gap] = (),
    *,
    encrypt: bool = True,
    signer_home: Path | None = None,
    signer_fpr: str | None = None,
    bridge_id: str = BRIDGE_ID,
    manifest_overrides: Mapping[str, Any] | None = None,
    name_override: str | None = None,
    bundle_id: str | None = None,
    created_at: str | None = None,
    recipients: Sequence[str] | None = None,
    inexact: Iterable[Gap] = (),
) -> BundleMade:
    """Pack ``rows_table`` with its manifest and seal it as ``<channel>.<seq>.<id>.dbundle``.

    ``manifest_overrides`` replaces manifest fields (raw JSON values, unchecked) after the
    valid manifest is built; ``name_override`` writes the file under another name;
    ``inexact``: the manifest's inexact seq ranges with their reasons (validated).
    """
    manifest = manifest_for(
        rows_table,
        channel=channel,
        bundle_seq=bundle_seq,
        bundle_id=bundle_id or uuid.uuid4().hex,
        created_at=created_at or format_utc(dt.datetime.now(dt.UTC)),
        bridge_id=bridge_id,
        prev_sha256=prev_sha256,
        gaps=gaps,
    )
    manifest = dataclasses.replace(manifest, inexact=tuple(inexact))
    if manifest_overrides:
        doc = {**manifest.to_dict(), **manifest_overrides}
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        plaintext = _pack_raw(rows_table, raw)
    else:
        raw = manifest.to_json()
        plaintext = pack_bundle(rows_table, manifest)
    name = name_override or bundle_name(channel, bundle_seq, manifest.bundle_id)
    path = seal_as(
        out_dir, keys, name, plaintext, encrypt=encrypt, signer_home=signer_home,
        signer_fpr=signer_fpr, recipients=recipients,
    )  # fmt: skip
    return BundleMade(path, name, plaintext, sha256_hex(plaintext), manifest, raw, rows_table)


def make_chain(
    out_dir: Path,
    keys: RedKeys,
    channel: str,
    n_bundles: int,
    rows_per_bundle: int,
    *,
    first_bundle_seq: int = 1,
    prev_sha256: str | None = None,
    start_seq: int = 0,
    gap_every: int = 0,
    gap_size: int = 1,
    gap_reason: str = "maxlen",
    exchange: str = "orders",
    encrypt: bool = True,
    bridge_id: str = BRIDGE_ID,
    body_bytes: int | None = None,
) -> list[BundleMade]:
    """``n_bundles`` consecutive bundles of one channel: hash chain and coverage contiguous.

    Every ``gap_every``-th bundle (0: none) starts with a gap of ``gap_size`` lost seqs, so
    coverages stay contiguous with gaps inside them. A chain continuing an earlier one passes
    ``first_bundle_seq``, ``prev_sha256`` and ``start_seq`` (the next uncovered seq).
    """
    made: list[BundleMade] = []
    seq, prev = start_seq, prev_sha256
    for i in range(n_bundles):
        bseq = first_bundle_seq + i
        gaps: list[Gap] = []
        if gap_every and (i + 1) % gap_every == 0:
            gaps.append(Gap(seq, seq + gap_size - 1, gap_reason))
            seq += gap_size
        if rows_per_bundle == 0 and not gaps:
            raise ValueError("a zero-row bundle needs gaps to cover anything: set gap_every")
        rows = make_rows(
            channel, range(seq, seq + rows_per_bundle), exchange, body_bytes=body_bytes
        )
        seq += rows_per_bundle
        b = make_bundle(
            out_dir, keys, channel, bseq, rows, prev if bseq > 1 else None, gaps,
            encrypt=encrypt, bridge_id=bridge_id,
        )  # fmt: skip
        made.append(b)
        prev = b.sha256
    return made


@dataclass(frozen=True)
class HeartbeatMade:
    """One sealed heartbeat."""

    path: Path
    name: str
    plaintext: bytes
    heartbeat: Heartbeat | None
    """None when ``doc_overrides`` made it invalid."""


def make_heartbeat(
    out_dir: Path,
    keys: RedKeys,
    channel: str,
    heartbeat_seq: int,
    *,
    last_bundle_seq: int | None = None,
    last_seq: int | None = None,
    counters: Mapping[str, int] | None = None,
    interval_seconds: float = 10.0,
    encrypt: bool = True,
    bridge_id: str = BRIDGE_ID,
    black_time: str | None = None,
    signer_home: Path | None = None,
    signer_fpr: str | None = None,
    doc_overrides: Mapping[str, Any] | None = None,
    name_override: str | None = None,
) -> HeartbeatMade:
    """Seal a heartbeat (§9) as ``<channel>.<seq>.dheartbeat``."""
    hb = Heartbeat(
        channel=channel,
        bridge_id=bridge_id,
        heartbeat_seq=heartbeat_seq,
        last_bundle_seq=last_bundle_seq,
        last_seq=last_seq,
        black_time=black_time or format_utc(dt.datetime.now(dt.UTC)),
        interval_seconds=interval_seconds,
        counters=dict(counters or {"bundles": last_bundle_seq or 0}),
    )
    plaintext = hb.to_json()
    made: Heartbeat | None = hb
    if doc_overrides:
        doc = {**hb.to_dict(), **doc_overrides}
        plaintext = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        try:
            made = Heartbeat.from_json(plaintext)
        except Exception:
            made = None
    name = name_override or heartbeat_name(channel, heartbeat_seq)
    path = seal_as(
        out_dir, keys, name, plaintext, encrypt=encrypt, signer_home=signer_home,
        signer_fpr=signer_fpr,
    )  # fmt: skip
    return HeartbeatMade(path, name, plaintext, made)


def land_bundles(cfg: Config, bundles: Sequence[BundleMade]) -> list[LandingResult]:
    """Verify ``bundles`` (real gpg) and land them as one micro-batch, as the red job does
    without Spark: a landing opened on ``cfg`` (an interrupted landing finished first) and
    closed after. Returns the landings applied."""
    from bridge.red.job import open_landing  # imports Spark: only for the tests that land
    from bridge.red.verify import VerifyContext, verify_file

    landing = open_landing(cfg)
    ctx = VerifyContext.from_config(cfg, environ={})
    rows = []
    for ordinal, b in enumerate(bundles, start=landing.land_seq * 1000 + 1):
        src = landing.intake_dir / f"{ordinal:012d}.{b.name}"
        shutil.copyfile(b.path, src)
        v = verify_file(src, b.name, ctx)
        assert v.status == "ok", v
        rows.append({"ordinal": ordinal, **v.to_row()})
    landing.submit(rows)
    return landing.drain(close=True)


# ---------------------------------------------------------------------------- config


def red_config(
    root: Path,
    keys: RedKeys,
    channels: Mapping[str, bool] = {"orders": True},  # noqa: B006 (read only)
    *,
    bridge_id: str = BRIDGE_ID,
    red: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Config:
    """A one-machine Config: pinned black key, red dirs under ``root/red``, ``channels``
    (name -> encrypt) readable by every red key. ``red`` / ``extra`` override sections."""
    base = Path(root) / "red"
    data: dict[str, Any] = {
        "link": {"bridge_id": bridge_id, "black_signers": [keys.black_fpr]},
        "black": {"gnupg_home": str(keys.black_home), "signing_key": keys.black_fpr},
        "red": {
            "gnupg_home": str(keys.red_home),
            "inbox": str(base / "inbox"),
            "work_dir": str(base / "work"),
            "processed_dir": str(base / "processed"),
            "quarantine_dir": str(base / "quarantine"),
            "state_dir": str(base / "state"),
            "checkpoint_dir": str(base / "checkpoint"),
            "tables_dir": str(base / "tables"),
            **dict(red or {}),
        },
        "channels": [
            {"name": n, "recipients": keys.recipients, "encrypt": enc}
            for n, enc in channels.items()
        ],
        **dict(extra or {}),
    }
    return config_from_dict(data, base=Path(root), environ={})


RED_DIRS_TOML = """inbox = "red/inbox"
work_dir = "red/work"
processed_dir = "red/processed"
quarantine_dir = "red/quarantine"
state_dir = "red/state"
checkpoint_dir = "red/checkpoint"
tables_dir = "red/delta"
delta_engine = "delta-rs"
"""
"""The [red] keys of a test config: every red dir under ``red/``, delta-rs."""


def keyless_red_config(root: Path, bridge_id: str, channels: Sequence[str] = ("c1",)) -> Config:
    """A red config FILE under ``root`` for tests that land without verifying (the landing,
    its state and operator requests): signed-only channels, no keys, red dirs under ``root``."""
    chans = "".join(f'[[channels]]\nname = "{c}"\nencrypt = false\n\n' for c in channels)
    p = root / "diode.toml"
    p.write_text(f'[link]\nbridge_id = "{bridge_id}"\n\n{chans}[red]\n{RED_DIRS_TOML}')
    return load_config(p, environ={})


def write_red_toml(
    root: Path,
    keys: RedKeys,
    channels: Mapping[str, bool] = {"orders": True},  # noqa: B006 (read only)
    *,
    replay_url: str | None = None,
    replay_extra: str = "",
    red_extra: str = "",
) -> Path:
    """A red config FILE under ``root`` (the Spark source reads the config from disk): pinned
    black key, red dirs under ``root/red``, delta-rs, 0.2 s settle, mode 0600; ``red_extra``:
    more ``[red]`` lines."""
    chans = "\n".join(
        f'[[channels]]\nname = "{n}"\nencrypt = {str(enc).lower()}\n'
        f"recipients = {json.dumps(keys.recipients)}\n"
        for n, enc in channels.items()
    )
    replay = f'\n[red.replay]\namqp_url = "{replay_url}"\n{replay_extra}' if replay_url else ""
    text = f"""
[link]
bridge_id = "{BRIDGE_ID}"
black_signers = ["{keys.black_fpr}"]

{chans}
[red]
gnupg_home = "{keys.red_home}"
{RED_DIRS_TOML}settle_seconds = 0.2
{red_extra}{replay}"""
    root.mkdir(parents=True, exist_ok=True)
    p = root / "diode.toml"
    p.write_text(text)
    p.chmod(0o600)
    return p
