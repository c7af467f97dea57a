"""Black, seal: journaled sealing survives a crash between intent and delivery (real gpg, Parquet).

No Spark, no broker: deliveries (and lost markers, as the tap writes for dead-lettered
messages) go into a real spool with ``SpoolWriter`` and are read back as the sink reads them
(``spool_rows.read_rows``: ``seq`` = spool position), sealed with the real GnuPG homes of
``init_keys``, and every bundle in the outbox is opened with the red key and unpacked. Proves:
bundle seqs gapless from 1, message seqs gapless, the hash chain links each bundle to the
previous plaintext, the property bytes travel as spooled; an interrupted bundle is finished by
a fresh sealer from its records in the spool, whatever micro-batch the restart hands over (one
that does not span the bundle, or one wholly at or below the journal) — rebuilt
byte-identically (same manifest, same plaintext sha) when its rows rebuild the same plaintext,
else re-sealed under the same bundle seq and chain link (new bundle id, records the spool no
longer has as ``unrecoverable`` gaps, counted); a replay ships nothing; lost markers,
unexplained holes and oversize messages become manifest gaps with their reason; no sealed file
passes ``max_file_bytes``.

The crashes here are simulated in-process (an exception nothing may catch, raised when the
outbox is asked to deliver a bundle gpg sealed and the journal recorded; or inside gpg, before
any intent) and each test asserts the crash fired and what the journal holds; sealing is
pipelined (chunk N+1 packed while gpg seals N), and a test proves the overlap happened.
``test_seal_edges.py`` kills a real process at the named crash points.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import string
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from bridge.black.catalog import default_catalog_path, save_catalog
from bridge.black.chunking import plan_chunks, row_size_estimate
from bridge.black.gaplog import read_gaps
from bridge.black.report import channel_status
from bridge.black.seal import BundleSealer, seal_overhead_bytes
from bridge.black.spool import SpoolWriter, segment_name
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import DROP_LOCK, Outbox
from bridge.errors import SpoolGapError
from bridge.metrics import REGISTRY
from bridge.protocol.bundle import sha256_hex, unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.manifest import Gap, Manifest
from bridge.protocol.naming import parse_bundle_name
from bridge.protocol.properties import (
    NO_PROPERTIES,
    Float32,
    Properties,
    decode_properties,
    encode_properties,
    field_table,
)
from bridge.protocol.rows import RowBuilder
from tests.support import captured_logs, key_inventory

pytestmark = pytest.mark.gpg

CHANNEL = "c1"
SENSORS = ExchangeDecl("sensors", "topic", durable=True)
EVENTS = ExchangeDecl("events", "fanout", durable=True)
CATALOG = {"sensors": SENSORS, "events": EVENTS}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    """One black signer and two red recipients for the whole module (key generation is slow)."""
    with key_inventory("seal-test", red_names=("red", "red-audit")) as inv:
        yield inv


@dataclass
class Rig:
    cfg: Config
    keys: KeyInventory
    base: Path

    @property
    def channel(self) -> Any:
        return self.cfg.channel(CHANNEL)

    @property
    def state_dir(self) -> Path:
        return Path(self.cfg.black.state_dir)

    @property
    def outbox_dir(self) -> Path:
        return Path(self.cfg.black.outbox)

    @property
    def spool_dir(self) -> Path:
        return Path(self.cfg.black.spool_dir)

    def sealer(self, gpg: Gpg | None = None, outbox: Outbox | None = None) -> BundleSealer:
        """A fresh sealer, as a restarted process builds it (new store, outbox, gpg objects)."""
        return BundleSealer(
            self.cfg,
            store=StateStore(self.state_dir),
            gpg=gpg or Gpg(self.keys.black_home),
            outbox=outbox or Outbox.from_config(self.cfg),
        )

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / f"channel-{CHANNEL}.json").read_text())


def make_rig(keys: KeyInventory, base: Path, archive_mode: str = "copy", **bundle: Any) -> Rig:
    data = {
        "link": {"bridge_id": "seal-test", "black_signers": [keys.black_fpr]},
        "channels": [{"name": CHANNEL, "recipients": list(keys.red_fprs.values())}],
        "black": {
            "gnupg_home": str(keys.black_home),
            "signing_key": keys.black_fpr,
            "outbox": "outbox",
            "archive": "archive",
            "archive_mode": archive_mode,
            "state_dir": "state",
            "checkpoint_dir": "checkpoint",
            "spool_dir": "spool",
            "bundle": {"max_rows": 50, **bundle},
        },
        "red": {"gnupg_home": str(keys.red_home), "inbox": "inbox"},
    }
    cfg = config_from_dict(data, base=base, environ={})  # no DIODE__ overrides from the shell
    assert len(cfg.channel(CHANNEL).recipients) == 2
    # the exchange catalog, as the mirror keeps it: the sealer reads an interrupted bundle's
    # rows back from the spool with it
    save_catalog(default_catalog_path(cfg.black), CATALOG)
    return Rig(cfg=cfg, keys=keys, base=base)


@pytest.fixture
def rig(keys: KeyInventory, short_tmp: Path) -> Rig:
    return make_rig(keys, short_tmp)


@pytest.fixture(params=["copy", "link"])
def crash_rig(request: pytest.FixtureRequest, keys: KeyInventory, short_tmp: Path) -> Rig:
    """A rig in either archive mode: the crash windows must hold for both."""
    return make_rig(keys, short_tmp, archive_mode=request.param)


def check_archive(rig: Rig) -> None:
    """Every bundle in the outbox is in the archive: the same inode in link mode (the link
    path ran), a copy of the same bytes in copy mode."""
    archive = Path(rig.cfg.black.archive) / CHANNEL
    for p in rig.outbox_dir.glob("*.dbundle"):
        a = archive / p.name
        assert a.read_bytes() == p.read_bytes(), f"{p.name}: archive differs"
        same = a.stat().st_ino == p.stat().st_ino
        assert same == (rig.cfg.black.archive_mode == "link"), f"{p.name}: archive mode not used"


# --------------------------------------------------------------------------- helpers

Body = Callable[[int], bytes]


def delivery(pos: int, body: Body | None = None) -> tuple[str, str, bool, bytes, bytes]:
    """(exchange, routing key, redelivered, property bytes, body) of the message at ``pos``."""
    data = body(pos) if body else json.dumps({"pos": pos}).encode()
    if pos % 3 == 2:
        return "events", "", False, NO_PROPERTIES, data
    props = Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=f"m-{pos}",
        headers=field_table({"n": pos, "s": "x", "f": Float32(1.5)}),
    )
    return "sensors", f"site{pos % 2}.temp", pos % 5 == 0, encode_properties(props), data


def spool_append(rig: Rig, layout: Sequence[str | None], *, body: Body | None = None) -> range:
    """Append one durable spool record per ``layout`` entry — None: a delivery (``delivery``),
    a string: a lost marker with that reason — and return their positions."""
    with SpoolWriter.open(rig.spool_dir, CHANNEL, min_free_bytes=0) as w:
        start = w.next_pos
        for k, reason in enumerate(layout):
            if reason is None:
                w.append_one(*delivery(start + k, body))
            else:
                w.append_lost("sensors", "site0.temp", reason)
        assert w.sync(-1) == start + len(layout)
    return range(start, start + len(layout))


def read_spool(rig: Rig, start: int, end: int) -> pa.Table:
    """Spool positions ``[start, end)`` as the sink hands them to the sealer."""
    batches = list(read_rows(rig.spool_dir, CHANNEL, start, end, CATALOG))
    return pa.Table.from_batches(batches, schema=source_schema())


def spooled(rig: Rig, layout: Sequence[str | None], *, body: Body | None = None) -> pa.Table:
    """``spool_append`` then ``read_spool`` of what was appended."""
    r = spool_append(rig, layout, body=body)
    return read_spool(rig, r.start, r.stop)


def messages(n: int) -> list[str | None]:
    return [None] * n


def without(table: pa.Table, seqs: set[int]) -> pa.Table:
    """``table`` minus the rows of ``seqs`` (records a damaged spool no longer yields)."""
    return table.filter(pc.invert(pc.is_in(table.column("seq"), pa.array(sorted(seqs)))))


def recovered(how: str) -> float:
    """BLACK.bundles_recovered of this channel (process-wide: compare before and after)."""
    v = REGISTRY.get_sample_value(
        "bridge_black_bundles_recovered_total", {"channel": CHANNEL, "how": how}
    )
    return v or 0.0


def recovery_counts() -> dict[str, float]:
    return {how: recovered(how) for how in ("redropped", "rebuilt", "resealed")}


def seal_log() -> contextlib.AbstractContextManager[list[logging.LogRecord]]:
    """The records the sealer logs meanwhile (whatever the logging setup of the process)."""
    return captured_logs("bridge.black.seal")


def messages_logged(records: list[logging.LogRecord], part: str) -> list[logging.LogRecord]:
    return [r for r in records if part in r.getMessage()]


@dataclass
class Opened:
    name: str
    manifest: Manifest
    rows: pa.Table
    sha256: str
    sealed_bytes: int


def open_outbox(rig: Rig) -> list[Opened]:
    """Every bundle in the outbox, decrypted with the red key and unpacked, by bundle seq."""
    red = Gpg(rig.keys.red_home)
    out: list[Opened] = []
    for p in sorted(rig.outbox_dir.glob("*.dbundle")):
        plain, opened = red.open_bytes(p.read_bytes(), pinned_signers=[rig.keys.black_fpr])
        assert opened.encrypted and opened.signer_fpr == rig.keys.black_fpr
        manifest, rows = unpack_bundle(plain)
        bn = parse_bundle_name(p.name)
        assert (bn.channel, bn.bundle_seq, bn.bundle_id) == (
            manifest.channel,
            manifest.bundle_seq,
            manifest.bundle_id,
        ), "the wire name must agree with the authenticated manifest"
        out.append(Opened(p.name, manifest, rows, sha256_hex(plain), p.stat().st_size))
    out.sort(key=lambda o: o.manifest.bundle_seq)
    return out


def check_chain(bundles: list[Opened]) -> None:
    """Bundle seqs 1..N, hash chain intact, message coverage contiguous from seq 0."""
    assert [b.manifest.bundle_seq for b in bundles] == list(range(1, len(bundles) + 1))
    prev_sha: str | None = None
    expected_seq = 0
    for b in bundles:
        m = b.manifest
        assert m.prev_sha256 == prev_sha, f"hash chain broken at bundle {m.bundle_seq}"
        prev_sha = b.sha256
        # coverage of this bundle: its rows and its gaps, contiguous after the previous one
        covered = sorted(
            [(s, s) for s in b.rows.column("seq").to_pylist()]
            + [(g.first_seq, g.last_seq) for g in m.gaps]
        )
        for lo, hi in covered:
            assert lo == expected_seq, f"bundle {m.bundle_seq}: seq {expected_seq} not covered"
            expected_seq = hi + 1


def all_rows(bundles: list[Opened]) -> pa.Table:
    return pa.concat_tables([b.rows for b in bundles])


class SimulatedCrash(BaseException):
    """Like a kill: no ``except Exception`` of the product code may swallow it."""


class CrashingOutbox(Outbox):
    """The real outbox, except that the ``crash_on``-th ``deliver`` dies before it moves a file.

    That is the latest point of the crash window: gpg wrote the sealed temp file (staging dir),
    the journal holds ``pending``, nothing is in the outbox yet.
    """

    def __init__(self, cfg: Config, crash_on: int) -> None:
        b = cfg.black
        super().__init__(
            Path(b.outbox), Path(b.archive), retention_days=b.archive_retention_days,
            staging=b.staging_dir, channel_dirs=cfg.outbox_dirs(),
            archive_link=b.archive_mode == "link",
        )  # fmt: skip
        self.crash_on = crash_on
        self.calls = 0

    def deliver(self, name: str, sealed: Path, **kw: Any) -> Path:  # type: ignore[override]
        self.calls += 1
        if self.calls == self.crash_on:
            assert sealed.exists(), "gpg must have written the sealed file before delivery"
            raise SimulatedCrash("simulated crash after gpg and the intent, before delivery")
        return super().deliver(name, sealed, **kw)


class CrashingGpg(Gpg):
    """The real Gpg, except that the ``crash_on``-th ``seal`` dies after gpg wrote its output
    (a crash while gpg seals: no intent is journaled for that bundle yet)."""

    def __init__(self, home: Path, crash_on: int) -> None:
        super().__init__(home)
        self.crash_on = crash_on
        self.calls = 0

    def seal(self, src: Path | bytes, dst: Path, **kw: Any) -> None:  # type: ignore[override]
        self.calls += 1
        super().seal(src, dst, **kw)
        if self.calls == self.crash_on:
            raise SimulatedCrash("simulated crash inside gpg sealing")


def crash_on_bundle(rig: Rig, table: pa.Table, n: int) -> dict[str, Any]:
    """Seal ``table`` with a crash before the ``n``-th bundle's delivery; returns the journal's
    pending entry (asserting the crash fired and the intent was journaled first)."""
    crashing = CrashingOutbox(rig.cfg, crash_on=n)
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        rig.sealer(outbox=crashing).seal_rows(rig.channel, table)
    assert crashing.calls == n, "the crash must have hit the n-th delivery"
    st = rig.state()
    assert st["pending"] is not None, "the intent must be journaled before delivery"
    assert st["last_bundle_seq"] == n - 1
    delivered = [parse_bundle_name(p.name).bundle_seq for p in rig.outbox_dir.glob("*.dbundle")]
    assert sorted(delivered) == list(range(1, n)), "the crashed bundle must not be delivered"
    pending: dict[str, Any] = st["pending"]
    return pending


# --------------------------------------------------------------------------- (a) normal sealing


def test_seal_rows_ships_gapless_chained_bundles(rig: Rig) -> None:
    table = spooled(rig, messages(120))
    shipped = rig.sealer().seal_rows(rig.channel, table)

    assert [s.bundle_seq for s in shipped] == [1, 2, 3]
    assert [s.rows for s in shipped] == [50, 50, 20]
    assert [(s.first_seq, s.last_seq) for s in shipped] == [(0, 49), (50, 99), (100, 119)]
    assert all(not s.gaps for s in shipped)

    bundles = open_outbox(rig)
    assert [b.name for b in bundles] == [s.name for s in shipped]
    check_chain(bundles)
    assert [b.sha256 for b in bundles] == [s.sha256 for s in shipped]
    rows = all_rows(bundles)
    assert rows.column("seq").to_pylist() == list(range(120))
    # what the tap spooled travels unchanged: property bytes, flags, routing, body
    want = [delivery(p) for p in range(120)]
    assert rows.column("exchange").to_pylist() == [w[0] for w in want]
    assert rows.column("routing_key").to_pylist() == [w[1] for w in want]
    assert rows.column("redelivered").to_pylist() == [w[2] for w in want]
    assert rows.column("properties_raw").to_pylist() == [w[3] for w in want]
    assert rows.column("body").to_pylist() == [w[4] for w in want]
    assert rows.column("exchange_type").to_pylist()[:3] == ["topic", "topic", "fanout"]
    m0 = rows.slice(0, 1).to_pylist()[0]
    assert m0["message_id"] == "m-0" and m0["delivery_mode"] == 2
    assert decode_properties(m0["properties_raw"]).headers == field_table(
        {"n": 0, "s": "x", "f": Float32(1.5)}
    )
    for b in bundles:
        assert b.manifest.bridge_id == "seal-test" and b.manifest.channel == CHANNEL
        assert b.manifest.gaps == () and b.manifest.schema_version == 2

    st = rig.state()
    assert (st["last_bundle_seq"], st["last_seq"]) == (3, 119)
    assert st["last_sha256"] == bundles[-1].sha256
    assert st["pending"] is None
    assert st["counters"] == {"bundles": 3, "messages": 120}
    # nothing left behind: no temporary file in the outbox or the staging dir, and no
    # plaintext on disk (it is piped to gpg): the state dir holds the journal only
    assert [p.name for p in rig.outbox_dir.iterdir() if p.name.startswith(".")] == []
    staging = Outbox.from_config(rig.cfg).staging
    assert [p.name for p in staging.iterdir() if p.name != DROP_LOCK] == []
    assert sorted(p.name for p in rig.state_dir.rglob("*")) == [
        f"channel-{CHANNEL}.json",
        "exchanges.json",
    ]
    # every bundle is archived for `diode resend`
    archived = sorted(p.name for p in (Path(rig.cfg.black.archive) / CHANNEL).iterdir())
    assert archived == sorted(s.name for s in shipped)


# --------------------------------------------------------------------------- (b) crash + resume


def test_crash_between_intent_and_delivery_recreates_the_same_bundle(crash_rig: Rig) -> None:
    rig = crash_rig
    table = spooled(rig, messages(120))
    pending = crash_on_bundle(rig, table, 2)

    st = rig.state()
    assert (st["last_bundle_seq"], st["last_seq"]) == (1, 49)
    intent = Manifest.from_json(pending["manifest"].encode())
    assert (intent.bundle_seq, intent.first_seq, intent.last_seq, intent.rows) == (2, 50, 99, 50)
    assert intent.prev_sha256 == st["last_sha256"]

    # restart: a fresh sealer with the real gpg, replaying the SAME micro-batch
    before = recovery_counts()
    with seal_log() as log:
        shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, 120))
    after = recovery_counts()
    assert after["rebuilt"] - before["rebuilt"] == 1, "the rebuilt path must have run"
    assert (after["resealed"], after["redropped"]) == (before["resealed"], before["redropped"])
    assert messages_logged(log, "byte-identical")
    assert [s.bundle_seq for s in shipped] == [2, 3]
    assert shipped[0].bundle_id == intent.bundle_id
    assert shipped[0].sha256 == pending["sha256"], "the interrupted bundle must be byte-identical"
    assert (shipped[1].first_seq, shipped[1].last_seq) == (100, 119)

    bundles = open_outbox(rig)
    check_chain(bundles)
    assert [b.manifest.bundle_seq for b in bundles] == [1, 2, 3]
    b2 = bundles[1]
    assert b2.manifest.to_json() == intent.to_json()  # same bundle_id, created_at, everything
    assert b2.sha256 == pending["sha256"]
    assert all_rows(bundles).column("seq").to_pylist() == list(range(120))

    st = rig.state()
    assert st["pending"] is None
    assert (st["last_bundle_seq"], st["last_seq"]) == (3, 119)
    assert st["counters"] == {"bundles": 3, "messages": 120}  # nothing re-sealed

    # (c) replaying the same micro-batch once more ships nothing and changes nothing
    before_names = sorted(p.name for p in rig.outbox_dir.glob("*.dbundle"))
    assert rig.sealer().seal_rows(rig.channel, table) == []
    assert sorted(p.name for p in rig.outbox_dir.glob("*.dbundle")) == before_names
    assert rig.state() == st
    check_archive(rig)


def test_crash_at_the_intent_rebuilds_byte_identically_after_spool_batches_over_8192_rows(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """A tap tuned with group_messages > 8192 writes spool batches longer than the sink's
    8192-row read slices: the sink cuts bundle 2 (seqs 5000..9999) from a table chunked at 8192
    (slices counted from the micro-batch start), the rebuild reads it in one slice from its
    first seq. The plaintext must not depend on that: rebuilt byte-identically, not re-sealed."""
    rig = make_rig(keys, short_tmp, max_rows=5000)
    n = 12_000
    # one spool batch of 12 000 records (one tap group), bodies incompressible: every column
    # of a bundle crosses the Parquet writer's page limits
    table = spooled(rig, messages(n), body=lambda pos: random.Random(pos).randbytes(1000))
    assert [len(c) for c in table.column("body").chunks] == [8192, n - 8192]
    pending = crash_on_bundle(rig, table, 2)
    intent = Manifest.from_json(pending["manifest"].encode())
    assert (intent.first_seq, intent.last_seq) == (5000, 9999)

    before = recovery_counts()
    with seal_log() as log:
        shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, n))
    after = recovery_counts()
    assert not messages_logged(log, "does not rebuild"), "the interrupted bundle was re-sealed"
    assert after["rebuilt"] - before["rebuilt"] == 1
    assert after["resealed"] == before["resealed"]
    assert [s.bundle_seq for s in shipped] == [2, 3]
    assert (shipped[0].bundle_id, shipped[0].sha256) == (intent.bundle_id, pending["sha256"])

    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[1].manifest.to_json() == intent.to_json()
    assert all_rows(bundles).column("seq").to_pylist() == list(range(n))
    assert "bundles_resealed" not in rig.state()["counters"]


def undecodable_metric() -> float:
    v = REGISTRY.get_sample_value("bridge_black_messages_undecodable_total", {"channel": CHANNEL})
    return v or 0.0


def test_undecodable_properties_travel_exact_and_are_counted_once(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """Rows whose property bytes do not decode (protocol §5) ship like any other, and black
    counts each once when its bundle ships (journal counter, metric, a rate-limited warning
    naming the seqs) — also across a crash that rebuilds the bundle at restart."""
    bad_props = b"\x20\x00" + b"\x00\x00\x00\x05" + b"\x01a" + b"Z"  # an unknown field type
    bad = {7, 8, 63, 64, 65, 110}
    rig = make_rig(keys, short_tmp)  # bundles of 50 rows: 2, 3 and 1 of them per bundle
    with SpoolWriter.open(rig.spool_dir, CHANNEL, min_free_bytes=0) as w:
        for pos in range(120):
            ex, rk, redelivered, props, body = delivery(pos)
            w.append_one(ex, rk, redelivered, bad_props if pos in bad else props, body)
        w.sync(-1)
    metric = undecodable_metric()

    with seal_log() as log:
        pending = crash_on_bundle(rig, read_spool(rig, 0, 120), 2)
    assert (pending["undecodable_rows"], pending["undecodable_seqs"]) == (3, [63, 64, 65])
    assert rig.state()["counters"]["undecodable"] == 2
    (line,) = messages_logged(log, "do not decode")
    ids = vars(line)
    assert (line.levelno, ids["channel"], ids["count"], ids["seqs"]) == (30, CHANNEL, 2, [7, 8])

    with seal_log() as log:
        rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, 120))
    assert rig.state()["counters"] == {"bundles": 3, "messages": 120, "undecodable": 6}
    assert undecodable_metric() - metric == 6
    assert channel_status(rig.cfg)["channels"][CHANNEL]["undecodable"] == 6  # diode status
    # bundle 2 (rebuilt) is logged; bundle 3, within the minute, only counted
    (line,) = messages_logged(log, "do not decode")
    ids = vars(line)
    assert (ids["bundle_seq"], ids["count"], ids["seqs"]) == (2, 3, [63, 64, 65])

    rows = all_rows(open_outbox(rig))
    assert rows.column("seq").to_pylist() == list(range(120))
    for r in rows.to_pylist():
        if r["seq"] in bad:
            assert r["properties_raw"] == bad_props and r["headers_typed"] is None
            assert r["message_id"] is None and r["exchange"] == delivery(r["seq"])[0]
        else:
            assert r["properties_raw"] == delivery(r["seq"])[3]


def test_crash_on_the_first_bundle_and_a_longer_replayed_batch(crash_rig: Rig) -> None:
    """The pending bundle is the first one (prev_sha256 null); the replay brings more rows."""
    rig = crash_rig
    pending = crash_on_bundle(rig, spooled(rig, messages(30)), 1)
    assert rig.state()["last_bundle_seq"] == 0

    # the restarted source reads the same range plus what the tap spooled since
    spool_append(rig, messages(60))
    before = recovered("rebuilt")
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, 90))
    assert recovered("rebuilt") - before == 1
    assert [s.bundle_seq for s in shipped] == [1, 2, 3]
    assert shipped[0].sha256 == pending["sha256"] and shipped[0].rows == 30
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[0].manifest.prev_sha256 is None
    assert all_rows(bundles).column("seq").to_pylist() == list(range(90))
    check_archive(rig)


def test_crash_while_gpg_seals_leaves_no_intent_and_the_replay_seals_afresh(crash_rig: Rig) -> None:
    """gpg seals bundle N before N's intent is journaled (pipelining): a crash there leaves the
    journal at N-1 with nothing pending and a stray temp file in staging (swept at start), and
    the replay seals N anew; nothing is rebuilt or re-sealed, the chain stays intact."""
    rig = crash_rig
    table = spooled(rig, messages(120))
    crashing = CrashingGpg(rig.keys.black_home, crash_on=2)
    with pytest.raises(SimulatedCrash, match="inside gpg"):
        rig.sealer(crashing).seal_rows(rig.channel, table)
    assert crashing.calls == 2, "the crash must have hit the 2nd gpg run"
    st = rig.state()
    assert st["pending"] is None, "no intent may be journaled before its gpg run ended"
    assert (st["last_bundle_seq"], st["last_seq"]) == (1, 49)
    assert [p.name for p in rig.outbox_dir.glob("*.dbundle")] == [
        p.name for p in open_outbox(rig)[:1]
    ]
    outbox = Outbox.from_config(rig.cfg)
    assert any(p.name != DROP_LOCK for p in outbox.staging.iterdir()), "gpg's output is left"
    outbox.sweep_stale_temps()  # what the job does at start

    before = recovery_counts()
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, 120))
    assert recovery_counts() == before, "nothing was pending: no recovery path may run"
    assert [(s.bundle_seq, s.first_seq, s.last_seq) for s in shipped] == [
        (2, 50, 99),
        (3, 100, 119),
    ]
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert all_rows(bundles).column("seq").to_pylist() == list(range(120))
    assert [p.name for p in outbox.staging.iterdir() if p.name != DROP_LOCK] == []
    check_archive(rig)


def test_next_bundle_is_packed_while_gpg_seals_the_previous_one(rig: Rig) -> None:
    """The pipeline's point: gpg's first run is held until the sealer has packed the second
    bundle, which it can only do if packing does not wait for gpg."""
    packed_second = threading.Event()
    overlapped: list[bool] = []

    class GatedGpg(Gpg):
        def seal(self, src: Path | bytes, dst: Path, **kw: Any) -> None:  # type: ignore[override]
            if not overlapped:
                overlapped.append(packed_second.wait(30))
            super().seal(src, dst, **kw)

    sealer = rig.sealer(GatedGpg(rig.keys.black_home))
    pack = sealer._pack
    calls = 0

    def counting_pack(rows: pa.Table, manifest: Manifest) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            packed_second.set()
        return pack(rows, manifest)

    sealer._pack = counting_pack  # type: ignore[method-assign]
    shipped = sealer.seal_rows(rig.channel, spooled(rig, messages(120)))
    assert overlapped == [True], "bundle 2 was not packed while gpg sealed bundle 1"
    assert [s.bundle_seq for s in shipped] == [1, 2, 3]
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert all_rows(bundles).column("seq").to_pylist() == list(range(120))


def test_replay_after_everything_shipped_ships_nothing(rig: Rig) -> None:
    table = spooled(rig, messages(120))
    rig.sealer().seal_rows(rig.channel, table)
    st = rig.state()
    names = sorted(p.name for p in rig.outbox_dir.glob("*.dbundle"))
    for a, b in ((0, 120), (0, 60), (60, 120), (119, 120)):
        assert rig.sealer().seal_rows(rig.channel, read_spool(rig, a, b)) == []
    assert sorted(p.name for p in rig.outbox_dir.glob("*.dbundle")) == names
    assert rig.state() == st
    # an overlapping batch ships only the new rows, continuing the numbering
    spool_append(rig, messages(10))
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, 100, 130))
    assert [(s.bundle_seq, s.first_seq, s.last_seq) for s in shipped] == [(4, 120, 129)]
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert all_rows(bundles).column("seq").to_pylist() == list(range(130))


# --------------------------------------------------------------------------- (c) pending re-sealed


def test_pending_bundle_resealed_when_the_plaintext_no_longer_rebuilds(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """Same rows, but the zstd level changed between the crash and the restart (as a pyarrow
    upgrade could): the bundle never reached the outbox, so it is re-sealed under the same bundle
    seq and chain link, with a new bundle id, and counted."""
    rig = make_rig(keys, short_tmp)
    table = spooled(rig, messages(120))
    pending = crash_on_bundle(rig, table, 2)
    intent = Manifest.from_json(pending["manifest"].encode())
    chain_before = rig.state()["last_sha256"]

    restarted = make_rig(keys, short_tmp, zstd_level=9)
    before = recovery_counts()
    with seal_log() as log:
        shipped = restarted.sealer().seal_rows(restarted.channel, table)
    after = recovery_counts()
    assert after["resealed"] - before["resealed"] == 1, "the re-seal path must have run"
    assert after["rebuilt"] == before["rebuilt"]
    assert messages_logged(log, "re-sealed")

    assert [s.bundle_seq for s in shipped] == [2, 3]
    assert shipped[0].bundle_id != intent.bundle_id and shipped[0].sha256 != pending["sha256"]
    bundles = open_outbox(rig)
    check_chain(bundles)
    b2 = bundles[1].manifest
    assert (b2.bundle_seq, b2.prev_sha256) == (2, intent.prev_sha256)
    assert b2.prev_sha256 == chain_before
    assert (b2.first_seq, b2.last_seq, b2.rows, b2.gaps) == (50, 99, 50, ())
    assert bundles[2].manifest.prev_sha256 == bundles[1].sha256
    assert all_rows(bundles).column("seq").to_pylist() == list(range(120))
    # one file per bundle seq: the intent's bundle id never appears on the wire
    assert len(list(rig.outbox_dir.glob("c1.000000000002.*.dbundle"))) == 1
    assert not list(rig.outbox_dir.glob(f"*.{intent.bundle_id}.dbundle"))
    st = rig.state()
    assert st["pending"] is None and st["last_seq"] == 119
    assert st["counters"]["bundles_resealed"] == 1
    assert st["counters"]["messages"] == 120


@pytest.mark.parametrize(
    ("segments", "gone", "rows", "gaps"),
    [
        pytest.param(
            (60, 2, 13, 1, 44),
            {60, 61, 75},
            47,
            [Gap(60, 61, "unrecoverable"), Gap(75, 75, "unrecoverable")],
        ),
        pytest.param((50, 50, 20), set(range(50, 100)), 0, [Gap(50, 99, "unrecoverable")]),
    ],
    ids=["some-rows", "every-row"],
)
def test_pending_bundle_resealed_with_missing_rows_as_unrecoverable_gaps(
    rig: Rig, segments: tuple[int, ...], gone: set[int], rows: int, gaps: list[Gap]
) -> None:
    """Records of the interrupted bundle are gone from the spool at restart (segments of a
    damaged spool deleted): the bundle is re-sealed under its seq and chain link with every
    record the spool still has, and only the missing seqs are gaps, never a refusal."""
    table = pa.concat_tables([spooled(rig, messages(n)) for n in segments])  # a segment each
    firsts = [sum(segments[:k]) for k in range(len(segments))]
    pending = crash_on_bundle(rig, table, 2)
    intent = Manifest.from_json(pending["manifest"].encode())
    assert (intent.first_seq, intent.last_seq) == (50, 99)
    for k, first in enumerate(firsts):
        if set(range(first, first + segments[k])) <= gone:
            (rig.spool_dir / CHANNEL / segment_name(first)).unlink()
    # the case: exactly ``gone`` is no longer in the spool
    with pytest.raises(SpoolGapError):
        read_spool(rig, 50, 100)
    for first, n in zip(firsts, segments, strict=True):
        if not set(range(first, first + n)) & gone:
            assert len(read_spool(rig, first, first + n)) == n

    before = recovered("resealed")
    with seal_log() as log:  # the batch as read before the damage, less what is gone
        shipped = rig.sealer().seal_rows(rig.channel, without(table, gone))
    assert recovered("resealed") - before == 1
    assert messages_logged(log, "are missing")
    assert [s.bundle_seq for s in shipped] == [2, 3]

    bundles = open_outbox(rig)
    check_chain(bundles)  # coverage stays contiguous: the missing rows are declared
    b2 = bundles[1].manifest
    assert (b2.bundle_seq, b2.prev_sha256, b2.rows) == (2, intent.prev_sha256, rows)
    assert list(b2.gaps) == gaps
    assert b2.bundle_id != intent.bundle_id
    assert all_rows(bundles).column("seq").to_pylist() == sorted(set(range(120)) - gone)
    st = rig.state()
    assert st["pending"] is None and (st["last_bundle_seq"], st["last_seq"]) == (3, 119)
    assert st["counters"]["bundles_resealed"] == 1
    assert st["counters"]["lost_unrecoverable"] == len(gone)
    logged = [
        (g["first_seq"], g["last_seq"], g["reason"], g["bundle_seq"])
        for g in read_gaps(rig.state_dir, CHANNEL)
    ]
    assert logged == [(g.first_seq, g.last_seq, g.reason, 2) for g in gaps]


@pytest.mark.parametrize(
    ("restart", "first_batch"),
    [
        # checkpoint deleted (runbook §3): the first batch starts at the journal, and its read
        # limit (from the read hint) is smaller than the pending bundle
        pytest.param("checkpoint-deleted", (50, 60)),
        # a power loss rolled Spark's un-fsynced checkpoint back: it replays an older batch,
        # wholly at or below the journal, which the sealer drops (nothing left of it)
        pytest.param("checkpoint-rolled-back", (0, 50)),
    ],
)
def test_pending_bundle_rebuilt_from_the_spool_when_the_batch_does_not_span_it(
    crash_rig: Rig, restart: str, first_batch: tuple[int, int]
) -> None:
    """The restart's first micro-batch does not hold the interrupted bundle's rows; the spool
    does (nothing the journal does not cover is released): the bundle is rebuilt
    byte-identically from the spool, every row ships, and no seq is declared lost."""
    rig = crash_rig
    table = spooled(rig, messages(120))
    pending = crash_on_bundle(rig, table, 2)
    intent = Manifest.from_json(pending["manifest"].encode())
    assert (intent.bundle_seq, intent.first_seq, intent.last_seq, intent.rows) == (2, 50, 99, 50)
    journal = rig.state()["last_seq"]
    assert journal == 49

    batch = read_spool(rig, *first_batch)
    # the case: the batch given does not span the pending bundle
    seqs = set(batch.column("seq").to_pylist())
    assert not set(range(50, 100)) <= seqs
    if restart == "checkpoint-rolled-back":
        assert max(seqs) <= journal  # nothing of it is fresh: the sealer is left no rows

    before = recovery_counts()
    with seal_log() as log:
        shipped = rig.sealer().seal_rows(rig.channel, batch)
    after = recovery_counts()
    assert after["rebuilt"] - before["rebuilt"] == 1, "the rebuilt path must have run"
    assert after["resealed"] == before["resealed"]
    assert messages_logged(log, "byte-identical") and not messages_logged(log, "gap:")
    assert [(s.bundle_seq, s.bundle_id, s.rows, s.gaps) for s in shipped] == [
        (2, intent.bundle_id, 50, ())
    ]
    assert shipped[0].sha256 == pending["sha256"], "the interrupted bundle must be byte-identical"
    st = rig.state()
    assert st["pending"] is None and (st["last_bundle_seq"], st["last_seq"]) == (2, 99)
    assert st["counters"] == {"bundles": 2, "messages": 100}  # nothing lost, nothing re-sealed
    assert read_gaps(rig.state_dir, CHANNEL) == []

    # the next batch goes on from where the first one ended
    shipped = rig.sealer().seal_rows(rig.channel, read_spool(rig, first_batch[1], 120))
    assert [(s.bundle_seq, s.first_seq, s.last_seq) for s in shipped] == [(3, 100, 119)]
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[1].manifest.to_json() == intent.to_json()
    assert all(b.manifest.gaps == () for b in bundles)
    assert all_rows(bundles).column("seq").to_pylist() == list(range(120))
    check_archive(rig)


# --------------------------------------------------------------------------- (d) gaps


def test_lost_markers_become_gaps_with_their_reason(rig: Rig) -> None:
    # positions 0..9 delivered, 10..23 dropped by a queue length limit, 24..25 expired,
    # 26..35 delivered: the dead-lettered ones are lost markers in the spool
    layout = messages(10) + ["maxlen"] * 14 + ["expired"] * 2 + messages(10)
    shipped = rig.sealer().seal_rows(rig.channel, spooled(rig, layout))
    assert len(shipped) == 1
    bundles = open_outbox(rig)
    check_chain(bundles)
    m = bundles[0].manifest
    assert list(m.gaps) == [Gap(10, 23, "maxlen"), Gap(24, 25, "expired")]
    assert (m.first_seq, m.last_seq, m.rows) == (0, 35, 20)
    assert bundles[0].rows.column("seq").to_pylist() == list(range(10)) + list(range(26, 36))
    st = rig.state()
    assert st["last_seq"] == 35
    assert (st["counters"]["lost_maxlen"], st["counters"]["lost_expired"]) == (14, 2)
    logged = [(g["first_seq"], g["last_seq"], g["reason"]) for g in read_gaps(rig.state_dir, "c1")]
    assert logged == [(10, 23, "maxlen"), (24, 25, "expired")]


def test_loss_before_the_first_message_is_a_gap(rig: Rig) -> None:
    shipped = rig.sealer().seal_rows(rig.channel, spooled(rig, ["expired"] * 99 + messages(10)))
    assert len(shipped) == 1
    m = open_outbox(rig)[0].manifest
    assert list(m.gaps) == [Gap(0, 98, "expired")]
    assert (m.first_seq, m.last_seq, m.rows) == (99, 108, 10)


def test_loss_after_the_last_message_ships_in_a_zero_row_bundle(rig: Rig) -> None:
    """Lost markers at the end of a batch are declared now, not when the next message comes."""
    shipped = rig.sealer().seal_rows(rig.channel, spooled(rig, messages(5) + ["maxlen"] * 5))
    assert [(s.rows, s.gaps) for s in shipped] == [(5, ()), (0, (Gap(5, 9, "maxlen"),))]
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert (bundles[1].manifest.first_seq, bundles[1].manifest.last_seq) == (None, None)
    assert rig.state()["last_seq"] == 9
    # a batch of lost markers only
    shipped = rig.sealer().seal_rows(rig.channel, spooled(rig, ["maxlen"] * 3))
    assert [(s.bundle_seq, s.rows, s.gaps) for s in shipped] == [(3, 0, (Gap(10, 12, "maxlen"),))]
    check_chain(open_outbox(rig))


def test_seqs_missing_without_a_marker_are_a_gap(rig: Rig) -> None:
    """The spool has no holes; rows that skip seqs anyway (no lost marker, no reason) do not
    renumber anything: the missing seqs are a gap of reason ``missing``."""
    b = RowBuilder(CHANNEL)
    for pos in [*range(10), *range(15, 25)]:
        ex, rk, redelivered, props, body = delivery(pos)
        b.append(pos, CATALOG[ex], ex, rk, redelivered, props, body)
    shipped = rig.sealer().seal_rows(rig.channel, b.to_table())
    assert len(shipped) == 1 and shipped[0].gaps == (Gap(10, 14, "missing"),)
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[0].rows.column("seq").to_pylist() == [*range(10), *range(15, 25)]
    assert rig.state()["counters"]["lost_missing"] == 5


# --------------------------------------------------------------------------- (e) file ceiling


def test_oversize_message_is_a_gap_and_no_file_passes_the_ceiling(
    keys: KeyInventory, short_tmp: Path
) -> None:
    ceiling = 65536
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=ceiling)
    big = {7: 200_000, 20: 70_000, 29: 48_000}  # 7, 20: over the ceiling; 29: one just under

    def body(pos: int) -> bytes:
        return os.urandom(big.get(pos, 6000))  # incompressible: the size estimate is honest

    table = spooled(rig, messages(30), body=body)
    shipped = rig.sealer().seal_rows(rig.channel, table)
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert [s.name for s in shipped] == [b.name for b in bundles]
    for b in bundles:
        assert b.sealed_bytes <= ceiling, f"{b.name} is {b.sealed_bytes} bytes"
    for p in rig.outbox_dir.iterdir():
        assert p.stat().st_size <= ceiling
    gaps = [g for b in bundles for g in b.manifest.gaps]
    assert gaps == [Gap(7, 7, "oversize"), Gap(20, 20, "oversize")]
    rows = all_rows(bundles)
    assert rows.column("seq").to_pylist() == [s for s in range(30) if s not in (7, 20)]
    assert len(bundles) > 3  # ~6 KB rows under a ~55 KB plaintext budget: many bundles
    # the message just under the ceiling travels, alone or nearly so, and intact
    b29 = next(b for b in bundles if 29 in b.rows.column("seq").to_pylist())
    assert b29.sealed_bytes <= ceiling
    want29 = table.filter(pc.equal(table.column("seq"), 29)).column("body")[0].as_py()
    got29 = b29.rows.filter(pc.equal(b29.rows.column("seq"), 29)).column("body")[0].as_py()
    assert got29 == want29
    st = rig.state()
    assert st["last_seq"] == 29
    assert st["counters"]["lost_oversize"] == 2


def test_oversize_last_message_rides_in_a_zero_row_bundle(
    keys: KeyInventory, short_tmp: Path
) -> None:
    rig = make_rig(keys, short_tmp, max_file_bytes=65536)

    def body(pos: int) -> bytes:
        return os.urandom(100_000) if pos == 4 else b"small"

    rig.sealer().seal_rows(rig.channel, spooled(rig, messages(5), body=body))
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert [b.manifest.rows for b in bundles] == [4, 0]
    assert list(bundles[1].manifest.gaps) == [Gap(4, 4, "oversize")]
    assert rig.state()["last_seq"] == 4  # the dropped message is not read again


# --------------------------------------------------------------------------- split + gap + crash


def test_split_bundle_with_an_inner_gap_survives_a_crash(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """A chunk the size estimate got wrong is split in two; its inner gap must stay in order.

    The estimate counts each decoded property once, but a row stores the property bytes twice
    (``properties_raw`` and the decoded columns), so rows whose short-string properties are long
    and incompressible pack far bigger than estimated and the sealer splits the chunk. A gap
    (lost markers) between the rows of the second half must ride with the second half: coverage
    stays contiguous, and the journal's ``last_seq`` after the first half must not skip rows of
    the second half (else a crash there loses them).
    """
    rnd = random.Random(5)

    def text(n: int) -> str:
        return "".join(rnd.choice(string.ascii_letters) for _ in range(n))

    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=65536)
    layout = messages(20) + ["maxlen"] * 14 + messages(5)  # positions 20..33 lost
    with SpoolWriter.open(rig.spool_dir, CHANNEL, min_free_bytes=0) as w:
        for reason in layout:
            if reason is not None:
                w.append_lost("sensors", "", reason)
                continue
            fields: dict[str, Any] = {
                name: text(250)
                for name in (
                    "content_type", "content_encoding", "correlation_id", "reply_to",
                    "expiration", "message_id", "type", "user_id", "app_id", "cluster_id",
                )
            }  # fmt: skip
            w.append_one("sensors", text(250), False, encode_properties(Properties(**fields)), b"x")
        w.sync(-1)
    table = read_spool(rig, 0, len(layout))

    # the case: the planner (which works from the estimate) cuts fewer chunks than get sealed
    bundle = rig.cfg.black.bundle
    max_plain = bundle.max_file_bytes - seal_overhead_bytes(2, bundle.max_file_bytes)
    messages_only = table.filter(pc.is_null(table.column("lost_reason")))
    planned, _ = plan_chunks(
        messages_only.column("seq").to_numpy(),
        row_size_estimate(messages_only),
        last_seq=-1,
        max_rows=bundle.max_rows,
        max_bytes=min(bundle.max_bytes, max_plain),
        max_row_bytes=max_plain - 4096,
        gap_reasons={s: "maxlen" for s in range(20, 34)},
    )

    crash_on_bundle(rig, table, 2)
    before = recovered("rebuilt")
    rig.sealer().seal_rows(rig.channel, read_spool(rig, 0, len(layout)))
    assert recovered("rebuilt") - before == 1

    bundles = open_outbox(rig)
    assert len(bundles) > len(planned), "the chunk was expected to be split"
    check_chain(bundles)
    assert [g for x in bundles for g in x.manifest.gaps] == [Gap(20, 33, "maxlen")]
    assert all_rows(bundles).column("seq").to_pylist() == list(range(20)) + list(range(34, 39))
    for x in bundles:
        assert x.sealed_bytes <= 65536
