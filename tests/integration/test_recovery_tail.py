"""Integration: black's start-up recovery after a power loss that left the spool's TAIL wrong.

TAIL is rewritten in place and never fsynced, so a power loss can leave it behind positions
Spark already committed (the records are durable in the segments), or ahead of what the
segments still hold (the disk lost fsynced data). Recovery runs before any tap, and only the
spool's writer repairs TAIL: recovery must run that repair itself, or every start fails the
same way. And it must leave a spool alone whose LOCK a running tap holds.

Real gpg (``init_keys``), real spool files, a real process holding the LOCK, and the
checkpoint's ``offsets``/``commits`` files as Spark writes them; no broker, no Spark: the
pass is called as ``BlackRun`` calls it, before the taps start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.black.catalog import save_catalog
from bridge.black.gaplog import read_gaps
from bridge.black.recovery import recover_committed
from bridge.black.seal import BundleSealer
from bridge.black.spool import SpoolReader, SpoolWriter
from bridge.black.spool_read import read_tail, scan_segment, segment_name
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import Outbox
from bridge.errors import SpoolGapError
from bridge.protocol.bundle import unpack_bundle
from bridge.protocol.exchange import ExchangeDecl
from bridge.protocol.properties import NO_PROPERTIES
from tests.support import captured_logs, key_inventory

pytestmark = pytest.mark.gpg

REPO = Path(__file__).resolve().parents[2]
CH = "c1"


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    with key_inventory("tail-test", prefix="dr") as inv:
        yield inv


def make_cfg(keys: KeyInventory, base: Path) -> Config:
    data = {
        "link": {"bridge_id": "tail-test", "black_signers": [keys.black_fpr]},
        "channels": [{"name": CH, "recipients": list(keys.red_fprs.values())}],
        "black": {
            "gnupg_home": str(keys.black_home),
            "signing_key": keys.black_fpr,
            "outbox": "outbox",
            "archive": "archive",
            "state_dir": "state",
            "checkpoint_dir": "checkpoint",
            "spool_dir": "spool",
            "spool": {"min_free_bytes": 0},
        },
        "red": {"gnupg_home": str(keys.red_home), "inbox": "inbox"},
    }
    cfg = config_from_dict(data, base=base, environ={})
    Path(cfg.black.state_dir).mkdir(parents=True)
    save_catalog(
        Path(cfg.black.state_dir) / "exchanges.json",
        {"events": ExchangeDecl("events", "fanout", durable=True)},
    )
    return cfg


def spool_messages(cfg: Config, groups: list[int]) -> Path:
    """One durable batch per group of messages ``m<pos>``; returns the channel's spool dir."""
    with SpoolWriter.open(Path(cfg.black.spool_dir), CH, min_free_bytes=0) as w:
        for n in groups:
            for _ in range(n):
                w.append_one("events", "", False, NO_PROPERTIES, b"m%d" % w.next_pos)
            w.sync(w.next_pos - 1)
    return Path(cfg.black.spool_dir) / CH


def set_tail(spool: Path, value: int) -> None:
    (spool / "TAIL").write_bytes(b"%020d\n" % value)  # what the disk kept of the rewrite


def spark_committed(cfg: Config, end: int) -> None:
    """Spark's checkpoint after it committed micro-batch 0, spool positions ``[0, end)``."""
    ck = Path(cfg.black.checkpoint_dir)
    (ck / "offsets").mkdir(parents=True)
    (ck / "commits").mkdir()
    meta = '{"batchWatermarkMs":0,"batchTimestampMs":0,"conf":{}}'
    (ck / "offsets" / "0").write_text(f"v1\n{meta}\n{json.dumps({CH: end})}\n")
    (ck / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def start(cfg: Config, keys: KeyInventory) -> int:
    """Black's start-up recovery pass, with the objects a fresh ``BlackRun`` builds; the
    number of bundles it shipped."""
    store = StateStore(Path(cfg.black.state_dir))
    sealer = BundleSealer(
        cfg, store=store, gpg=Gpg(keys.black_home), outbox=Outbox.from_config(cfg)
    )
    return len(recover_committed(cfg, sealer, store))


def shipped(cfg: Config, keys: KeyInventory) -> list[tuple[int, list[int], list[bytes]]]:
    """(bundle seq, row seqs, bodies) of every bundle in the outbox, opened with the red key."""
    red = Gpg(keys.red_home)
    out = []
    for p in sorted(Path(cfg.black.outbox).glob("*.dbundle")):
        plain, _ = red.open_bytes(p.read_bytes(), pinned_signers=[keys.black_fpr])
        m, rows = unpack_bundle(plain)
        out.append((m.bundle_seq, rows.column("seq").to_pylist(), rows.column("body").to_pylist()))
    return sorted(out)


def test_a_tail_behind_what_spark_committed_is_repaired_before_recovery(
    keys: KeyInventory, short_tmp: Path
) -> None:
    cfg = make_cfg(keys, short_tmp)
    spool = spool_messages(cfg, [4, 6])
    set_tail(spool, 4)  # the power loss: the segment was fsynced, TAIL's rewrite was not
    spark_committed(cfg, 10)
    with pytest.raises(SpoolGapError, match=r"\[0, 10\).*only before position 4"):
        list(SpoolReader(Path(cfg.black.spool_dir), CH).read(0, 10))  # what failed every start
    with captured_logs("bridge.black.recovery") as log:
        assert start(cfg, keys) == 1
    assert any("TAIL was behind its segments" in r.getMessage() for r in log)
    assert read_tail(spool) == 10
    assert shipped(cfg, keys) == [(1, list(range(10)), [b"m%d" % i for i in range(10)])]
    assert StateStore(Path(cfg.black.state_dir)).load(CH).last_seq == 9
    assert start(cfg, keys) == 0  # the next start: nothing left to recover
    with SpoolWriter.open(Path(cfg.black.spool_dir), CH, min_free_bytes=0) as w:
        assert (w.durable_end, w.damaged, w.repaired_bytes) == (10, 0, 0)  # the tap agrees


def test_positions_the_disk_lost_behind_tail_ship_as_a_spool_damaged_gap(
    keys: KeyInventory, short_tmp: Path
) -> None:
    cfg = make_cfg(keys, short_tmp)
    spool = spool_messages(cfg, [4, 6])
    seg = spool / segment_name(0)
    end, first_batch_end, _ = scan_segment(seg, 0, 4)
    assert end == 4 and seg.stat().st_size > first_batch_end and read_tail(spool) == 10
    os.truncate(seg, first_batch_end + 10)  # the disk lost the fsynced 2nd batch; TAIL says 10
    spark_committed(cfg, 10)  # Spark had read and committed it before
    with pytest.raises(SpoolGapError, match=r"\[4, 10\) are missing .*although TAIL says"):
        list(SpoolReader(Path(cfg.black.spool_dir), CH).read(0, 10))  # what failed every start
    assert start(cfg, keys) == 2  # the loss after the last message rides in a 0-row bundle
    assert shipped(cfg, keys) == [(1, [0, 1, 2, 3], [b"m0", b"m1", b"m2", b"m3"]), (2, [], [])]
    gaps = read_gaps(Path(cfg.black.state_dir), CH)
    assert [(g["first_seq"], g["last_seq"], g["reason"]) for g in gaps] == [(4, 9, "spool_damaged")]
    assert read_tail(spool) == 10 and start(cfg, keys) == 0


HOLDER = r"""
import sys, time
from pathlib import Path
from bridge.black.spool import SpoolWriter
w = SpoolWriter.open(Path(sys.argv[1]), sys.argv[2], min_free_bytes=0)
print("held", w.durable_end, flush=True)
time.sleep(120)
"""


def test_a_spool_a_running_tap_holds_is_left_to_it(keys: KeyInventory, short_tmp: Path) -> None:
    """A tap left over from a killed job holds the LOCK: it repaired TAIL when it opened the
    spool; recovery neither fails on the lock nor writes the spool, and reads what it holds."""
    cfg = make_cfg(keys, short_tmp)
    spool = spool_messages(cfg, [10])
    set_tail(spool, 4)
    spark_committed(cfg, 10)
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(cfg.black.spool_dir), CH],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["held", "10"]
        files = sorted((q.name, q.stat().st_size) for q in spool.iterdir())
        with captured_logs("bridge.black.recovery") as log:
            assert start(cfg, keys) == 1
        assert not any("TAIL was behind" in r.getMessage() for r in log)
        assert sorted((q.name, q.stat().st_size) for q in spool.iterdir()) == files
        assert p.poll() is None, "the tap still holds its spool"
    finally:
        p.kill()
        p.wait()
    assert [s for _, s, _ in shipped(cfg, keys)] == [list(range(10))]
