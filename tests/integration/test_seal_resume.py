"""Black, seal: journaled sealing survives a crash between intent and delivery (real gpg, Parquet).

No Spark, no broker: rows are built with RowBuilder as the stream source would (``seq`` =
``stream_offset`` on the way in, renumbered gaplessly by the sealer), sealed with the real
GnuPG homes of ``init_keys``, and every bundle in the outbox is opened with the red key and
unpacked. Proves: bundle seqs gapless from 1, message seqs gapless, the hash chain links each
bundle to the previous plaintext, an interrupted bundle is re-created byte-identically (same
manifest, same plaintext sha) by a fresh sealer, a replay ships nothing, retention loss and
oversize messages become manifest gaps, and no sealed file passes ``max_file_bytes``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pika.spec import BasicProperties

from bridge.black.seal import BundleSealer
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory, init_keys
from bridge.diode.file_drop import Outbox
from bridge.protocol.bundle import sha256_hex, unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.manifest import Gap, Manifest
from bridge.protocol.naming import parse_bundle_name
from bridge.protocol.rows import RowBuilder

pytestmark = pytest.mark.gpg

CHANNEL = "c1"
SENSORS = ExchangeDecl("sensors", "topic", durable=True)
EVENTS = ExchangeDecl("events", "fanout", durable=True)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    """One black signer and two red recipients for the whole module (key generation is slow)."""
    import shutil
    import subprocess
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dk", dir="/tmp"))  # short: gpg-agent socket paths
    try:
        yield init_keys(d / "keys", red_names=("red", "red-audit"), bridge_id="seal-test")
    finally:
        for home in ("black", "red"):
            subprocess.run(
                ["gpgconf", "--homedir", str(d / "keys" / home), "--kill", "gpg-agent"],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(d, ignore_errors=True)


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

    def sealer(self, gpg: Gpg | None = None) -> BundleSealer:
        """A fresh sealer, as a restarted process builds it (new store, outbox, gpg objects)."""
        return BundleSealer(
            self.cfg,
            store=StateStore(self.state_dir),
            gpg=gpg or Gpg(self.keys.black_home),
            outbox=Outbox(self.outbox_dir, Path(self.cfg.black.archive), retention_days=14),
        )

    def state(self) -> dict[str, Any]:
        return json.loads((self.state_dir / f"channel-{CHANNEL}.json").read_text())


def make_rig(keys: KeyInventory, base: Path, **bundle: Any) -> Rig:
    data = {
        "link": {"bridge_id": "seal-test", "black_signers": [keys.black_fpr]},
        "channels": [{"name": CHANNEL, "recipients": list(keys.red_fprs.values())}],
        "black": {
            "gnupg_home": str(keys.black_home),
            "signing_key": keys.black_fpr,
            "outbox": "outbox",
            "archive": "archive",
            "state_dir": "state",
            "checkpoint_dir": "checkpoint",
            "bundle": {"max_rows": 50, **bundle},
        },
        "red": {"gnupg_home": str(keys.red_home), "inbox": "inbox"},
    }
    cfg = config_from_dict(data, base=base, environ={})  # no DIODE__ overrides from the shell
    assert len(cfg.channel(CHANNEL).recipients) == 2
    return Rig(cfg=cfg, keys=keys, base=base)


@pytest.fixture
def rig(keys: KeyInventory, short_tmp: Path) -> Rig:
    return make_rig(keys, short_tmp)


# --------------------------------------------------------------------------- helpers


def make_rows(offsets: list[int], *, body: Callable[[int], bytes] | None = None) -> pa.Table:
    """Rows as the stream source yields them: seq = stream_offset (the sealer renumbers)."""
    b = RowBuilder(CHANNEL)
    for off in offsets:
        if off % 3 == 2:
            decl, rk = EVENTS, ""
            props = BasicProperties()
        else:
            decl, rk = SENSORS, f"site{off % 2}.temp"
            props = BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                message_id=f"m-{off}",
                headers={"n": off, "s": "x"},
            )
        data = body(off) if body else json.dumps({"offset": off}).encode()
        b.append(off, decl, decl.name, rk, props, data, stream_offset=off)
    return b.to_table()


def never_called() -> int:
    raise AssertionError("first_retained must not be asked when offsets are contiguous")


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
    plain_dir = rig.base / "plain"
    plain_dir.mkdir(exist_ok=True)
    out: list[Opened] = []
    for p in sorted(rig.outbox_dir.glob("*.dbundle")):
        dst = plain_dir / (p.name + ".parquet")
        opened = red.open(p, dst, pinned_signers=[rig.keys.black_fpr])
        assert opened.encrypted and opened.signer_fpr == rig.keys.black_fpr
        plain = dst.read_bytes()
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


# --------------------------------------------------------------------------- (a) normal sealing


def test_seal_rows_ships_gapless_chained_bundles(rig: Rig) -> None:
    table = make_rows(list(range(120)))
    shipped = rig.sealer().seal_rows(rig.channel, table, first_retained=never_called)

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
    assert rows.column("stream_offset").to_pylist() == list(range(120))
    assert rows.column("body").to_pylist() == table.column("body").to_pylist()
    for b in bundles:
        assert b.manifest.bridge_id == "seal-test" and b.manifest.channel == CHANNEL
        assert b.manifest.gaps == ()

    st = rig.state()
    assert (st["last_bundle_seq"], st["last_seq"], st["last_offset"]) == (3, 119, 119)
    assert st["last_sha256"] == bundles[-1].sha256
    assert st["pending"] is None
    # nothing left behind: no temporary sealed file in the outbox, and no plaintext on disk
    # (it is piped to gpg): the state dir holds the journal only
    assert [p.name for p in rig.outbox_dir.iterdir() if p.name.startswith(".")] == []
    assert sorted(p.name for p in rig.state_dir.rglob("*")) == [f"channel-{CHANNEL}.json"]
    # every bundle is archived for `diode resend`
    archived = sorted(p.name for p in (Path(rig.cfg.black.archive) / CHANNEL).iterdir())
    assert archived == sorted(s.name for s in shipped)


# --------------------------------------------------------------------------- (b) crash + resume


class SimulatedCrash(BaseException):
    """Like a kill: no ``except Exception`` of the product code may swallow it."""


class CrashingGpg(Gpg):
    """The real Gpg, except that the ``crash_on``-th ``seal`` dies after gpg wrote its output.

    That is the latest point of the crash window (sealed temp file on disk, not yet renamed
    into the outbox, journal still holding ``pending``).
    """

    def __init__(self, home: Path, crash_on: int) -> None:
        super().__init__(home)
        self.crash_on = crash_on
        self.calls = 0

    def seal(self, src: Path, dst: Path, **kw: Any) -> None:  # type: ignore[override]
        self.calls += 1
        super().seal(src, dst, **kw)
        if self.calls == self.crash_on:
            raise SimulatedCrash("simulated crash after gpg, before delivery")


def test_crash_between_intent_and_delivery_recreates_the_same_bundle(rig: Rig) -> None:
    table = make_rows(list(range(120)))
    crashing = CrashingGpg(rig.keys.black_home, crash_on=2)
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        rig.sealer(crashing).seal_rows(rig.channel, table, first_retained=never_called)
    assert crashing.calls == 2

    st = rig.state()
    assert (st["last_bundle_seq"], st["last_seq"], st["last_offset"]) == (1, 49, 49)
    pending = st["pending"]
    assert pending is not None, "the intent must be journaled before sealing"
    intent = Manifest.from_json(pending["manifest"].encode())
    assert (intent.bundle_seq, intent.first_seq, intent.last_seq, intent.rows) == (2, 50, 99, 50)
    assert intent.prev_sha256 == st["last_sha256"]
    assert pending["last_offset"] == 99
    # only bundle 1 reached the outbox; bundle 2 is at most a hidden temp file
    assert [parse_bundle_name(p.name).bundle_seq for p in rig.outbox_dir.glob("*.dbundle")] == [1]

    # restart: a fresh sealer with the real gpg, replaying the SAME micro-batch
    shipped = rig.sealer().seal_rows(rig.channel, table, first_retained=never_called)
    assert [s.bundle_seq for s in shipped] == [2, 3]
    assert shipped[0].bundle_id == intent.bundle_id
    assert shipped[0].sha256 == pending["sha256"], "the interrupted bundle must be byte-identical"
    assert (shipped[1].first_seq, shipped[1].last_seq) == (100, 119)

    bundles = open_outbox(rig)
    check_chain(bundles)
    assert [b.manifest.bundle_seq for b in bundles] == [1, 2, 3]
    b2 = bundles[1]
    assert b2.manifest.to_json() == intent.to_json()  # same bundle_id, created_at, everything
    assert (b2.manifest.bundle_id, b2.manifest.created_at) == (intent.bundle_id, intent.created_at)
    assert b2.sha256 == pending["sha256"]
    rows = all_rows(bundles)
    assert rows.column("seq").to_pylist() == list(range(120))
    assert rows.column("stream_offset").to_pylist() == list(range(120))

    st = rig.state()
    assert st["pending"] is None
    assert (st["last_bundle_seq"], st["last_seq"], st["last_offset"]) == (3, 119, 119)
    assert st["counters"]["messages"] == 120 and st["counters"]["bundles"] == 3

    # (c) replaying the same micro-batch once more ships nothing and changes nothing
    before = sorted(p.name for p in rig.outbox_dir.glob("*.dbundle"))
    assert rig.sealer().seal_rows(rig.channel, table, first_retained=never_called) == []
    assert sorted(p.name for p in rig.outbox_dir.glob("*.dbundle")) == before
    assert rig.state() == st


def test_crash_on_the_first_bundle_and_a_longer_replayed_batch(rig: Rig) -> None:
    """The pending bundle is the first one (prev_sha256 null); the replay brings more rows."""
    first = make_rows(list(range(30)))
    crashing = CrashingGpg(rig.keys.black_home, crash_on=1)
    with pytest.raises(SimulatedCrash):
        rig.sealer(crashing).seal_rows(rig.channel, first, first_retained=never_called)
    pending = rig.state()["pending"]
    assert pending is not None and rig.state()["last_bundle_seq"] == 0
    assert list(rig.outbox_dir.glob("*.dbundle")) == []

    # the restarted source reads the same range plus what arrived since (a wider batch)
    wider = make_rows(list(range(90)))
    shipped = rig.sealer().seal_rows(rig.channel, wider, first_retained=never_called)
    assert [s.bundle_seq for s in shipped] == [1, 2, 3]
    assert shipped[0].sha256 == pending["sha256"] and shipped[0].rows == 30
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[0].manifest.prev_sha256 is None
    assert all_rows(bundles).column("seq").to_pylist() == list(range(90))


def test_replay_after_everything_shipped_ships_nothing(rig: Rig) -> None:
    table = make_rows(list(range(120)))
    rig.sealer().seal_rows(rig.channel, table, first_retained=never_called)
    st = rig.state()
    names = sorted(p.name for p in rig.outbox_dir.glob("*.dbundle"))
    for part in (table, table.slice(0, 60), table.slice(60), table.slice(119)):
        assert rig.sealer().seal_rows(rig.channel, part, first_retained=never_called) == []
    assert sorted(p.name for p in rig.outbox_dir.glob("*.dbundle")) == names
    assert rig.state() == st
    # an overlapping batch ships only the new rows, continuing the numbering
    more = make_rows(list(range(100, 130)))
    shipped = rig.sealer().seal_rows(rig.channel, more, first_retained=never_called)
    assert [(s.bundle_seq, s.first_seq, s.last_seq) for s in shipped] == [(4, 120, 129)]
    bundles = open_outbox(rig)
    check_chain(bundles)
    rows = all_rows(bundles)
    assert rows.column("seq").to_pylist() == list(range(130))
    assert rows.column("stream_offset").to_pylist() == list(range(130))


# --------------------------------------------------------------------------- (d) gaps


def test_offset_jump_from_retention_is_a_gap(rig: Rig) -> None:
    # offsets 0..9 read, 10..29 missing, then 30..39; the stream now starts at offset 25:
    # offsets 10..23 were dropped by retention (lost), 24 (= F-1, a segment's tracking chunk)
    # and 25..29 are holes
    offsets = list(range(10)) + list(range(30, 40))
    asked: list[int] = []

    def first_retained() -> int:
        asked.append(1)
        return 25

    shipped = rig.sealer().seal_rows(rig.channel, make_rows(offsets), first_retained=first_retained)
    assert asked, "an offset jump must ask for the first retained offset"
    assert len(shipped) == 1
    bundles = open_outbox(rig)
    check_chain(bundles)
    m = bundles[0].manifest
    assert list(m.gaps) == [Gap(10, 23, "retention")]
    assert (m.first_seq, m.last_seq, m.rows) == (0, 33, 20)
    rows = bundles[0].rows
    assert rows.column("seq").to_pylist() == list(range(10)) + list(range(24, 34))
    assert rows.column("stream_offset").to_pylist() == offsets
    st = rig.state()
    assert (st["last_seq"], st["last_offset"]) == (33, 39)
    assert st["counters"]["lost_retention"] == 14


def test_retention_loss_before_the_first_read_is_a_gap(rig: Rig) -> None:
    # nothing read yet; the stream now starts at 100: offsets 0..98 were lost, 99 is a hole
    shipped = rig.sealer().seal_rows(
        rig.channel, make_rows(list(range(100, 110))), first_retained=lambda: 100
    )
    assert len(shipped) == 1
    m = open_outbox(rig)[0].manifest
    assert list(m.gaps) == [Gap(0, 98, "retention")]
    assert (m.first_seq, m.last_seq) == (99, 108)


def test_offset_hole_is_not_a_gap(rig: Rig) -> None:
    # offsets 10..14 missing but still at/after the first retained offset: segment holes
    offsets = list(range(10)) + list(range(15, 25))
    shipped = rig.sealer().seal_rows(rig.channel, make_rows(offsets), first_retained=lambda: 0)
    assert len(shipped) == 1 and shipped[0].gaps == ()
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert bundles[0].manifest.gaps == ()
    assert bundles[0].rows.column("seq").to_pylist() == list(range(20))
    assert bundles[0].rows.column("stream_offset").to_pylist() == offsets
    assert rig.state()["last_offset"] == 24


# --------------------------------------------------------------------------- (e) file ceiling


def test_oversize_message_is_a_gap_and_no_file_passes_the_ceiling(
    keys: KeyInventory, short_tmp: Path
) -> None:
    ceiling = 65536
    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=ceiling)
    big = {7: 200_000, 20: 70_000, 29: 48_000}  # 7, 20: over the ceiling; 29: one just under

    def body(off: int) -> bytes:
        return os.urandom(big.get(off, 6000))  # incompressible: the size estimate is honest

    shipped = rig.sealer().seal_rows(
        rig.channel, make_rows(list(range(30)), body=body), first_retained=never_called
    )
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
    assert rows.column("stream_offset").to_pylist() == [s for s in range(30) if s not in (7, 20)]
    assert len(bundles) > 3  # ~6 KB rows under a ~55 KB plaintext budget: many bundles
    # the message just under the ceiling travels, alone or nearly so, and intact
    b29 = next(b for b in bundles if 29 in b.rows.column("seq").to_pylist())
    assert b29.sealed_bytes <= ceiling
    st = rig.state()
    assert st["last_seq"] == 29 and st["last_offset"] == 29
    assert st["counters"]["lost_oversize"] == 2


def test_oversize_last_message_rides_in_a_zero_row_bundle(
    keys: KeyInventory, short_tmp: Path
) -> None:
    rig = make_rig(keys, short_tmp, max_file_bytes=65536)

    def body(off: int) -> bytes:
        return os.urandom(100_000) if off == 4 else b"small"

    rig.sealer().seal_rows(
        rig.channel, make_rows(list(range(5)), body=body), first_retained=never_called
    )
    bundles = open_outbox(rig)
    check_chain(bundles)
    assert [b.manifest.rows for b in bundles] == [4, 0]
    assert list(bundles[1].manifest.gaps) == [Gap(4, 4, "oversize")]
    assert rig.state()["last_offset"] == 4  # the dropped message is not read again


# --------------------------------------------------------------------------- split + gap + crash


def test_split_bundle_with_an_inner_retention_gap_survives_a_crash(
    keys: KeyInventory, short_tmp: Path
) -> None:
    """A chunk the size estimate got wrong is split in two; its inner gap must stay in order.

    The estimate counts body + headers + 256 bytes per row, so rows whose short-string
    properties are long and incompressible pack far bigger than estimated and the sealer
    splits the chunk. A retention gap between the rows of the second half must ride with the
    second half: coverage stays contiguous, and the journal's ``last_offset`` after the
    first half must not skip rows of the second half (else a crash there loses them).
    """
    import random
    import string

    rnd = random.Random(5)

    def text(n: int) -> str:
        return "".join(rnd.choice(string.ascii_letters) for _ in range(n))

    rig = make_rig(keys, short_tmp, max_rows=1000, max_file_bytes=65536)
    b = RowBuilder(CHANNEL)
    offsets = list(range(20)) + list(range(40, 45))  # 20..39 missing, stream now starts at 35
    for off in offsets:
        props = BasicProperties(
            content_type=text(250),
            content_encoding=text(250),
            correlation_id=text(250),
            reply_to=text(250),
            expiration=text(250),
            message_id=text(250),
            type=text(250),
            user_id=text(250),
            app_id=text(250),
            cluster_id=text(250),
        )
        b.append(off, SENSORS, "sensors", text(250), props, b"x", stream_offset=off)
    table = b.to_table()

    crashing = CrashingGpg(rig.keys.black_home, crash_on=2)
    with pytest.raises(SimulatedCrash):
        rig.sealer(crashing).seal_rows(rig.channel, table, first_retained=lambda: 35)
    # offsets 20..33 lost to retention (seqs 20..33), 34..39 holes; offsets 40..44 = seqs 34..38
    rig.sealer().seal_rows(rig.channel, table, first_retained=lambda: 35)

    bundles = open_outbox(rig)
    assert len(bundles) >= 2, "the chunk was expected to be split"
    check_chain(bundles)
    assert [g for x in bundles for g in x.manifest.gaps] == [Gap(20, 33, "retention")]
    rows = all_rows(bundles)
    assert rows.column("stream_offset").to_pylist() == offsets
    assert rows.column("seq").to_pylist() == list(range(20)) + list(range(34, 39))
    for x in bundles:
        assert x.sealed_bytes <= 65536
