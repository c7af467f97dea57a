"""Integration: black's heartbeat seqs stay above every seq red has heard (real gpg, real
files; red's sequence checks, pure logic, judge what red would make of them).

Given an idle channel (heartbeats only, no bundle) whose seq file is lost or damaged, Then
the next heartbeats still reach red as new, not replayed; a new install starts from the time
without a warning; and a heartbeat never takes the name of a file still in the outbox.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bridge.black.heartbeat import HeartbeatWriter
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import Outbox
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.naming import heartbeat_name, parse_heartbeat_name
from bridge.red import sequence as sq
from tests.support import captured_logs, key_inventory

pytestmark = pytest.mark.gpg

CH = "idle"


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    with key_inventory("hb-seq-test", prefix="dh") as inv:
        yield inv


@dataclass
class Black:
    cfg: Config
    keys: KeyInventory
    writer: HeartbeatWriter
    red: sq.SequenceState

    @property
    def outbox(self) -> Path:
        return Path(self.cfg.black.outbox)

    @property
    def seq_file(self) -> Path:
        return Path(self.cfg.black.state_dir) / f"heartbeat-{CH}.json"

    def beat(self) -> tuple[int, list[str]]:
        """One heartbeat, opened and checked as red does: (its seq, red's event kinds)."""
        name = self.writer.beat(self.cfg.channel(CH))
        plain, _ = Gpg(self.keys.red_home).open_bytes(
            (self.outbox / name).read_bytes(), pinned_signers=[self.keys.black_fpr]
        )
        hb = Heartbeat.from_json(plain)
        assert hb.heartbeat_seq == parse_heartbeat_name(name).heartbeat_seq
        facts = sq.HeartbeatFacts.from_heartbeat(hb)
        return hb.heartbeat_seq, [e.kind for e in sq.heartbeat(self.red, facts, datetime.now(UTC))]


@pytest.fixture
def black(short_tmp: Path, keys: KeyInventory) -> Black:
    red = next(iter(keys.red_fprs.values()))
    data = {
        "link": {"bridge_id": "hb-seq-test", "black_signers": [keys.black_fpr]},
        "channels": [{"name": CH, "recipients": [red]}],
        "black": {
            "gnupg_home": str(keys.black_home),
            "signing_key": keys.black_fpr,
            "outbox": "black/outbox",
            "archive": "black/archive",
            "state_dir": "black/state",
        },
    }
    cfg = config_from_dict(data, base=short_tmp, environ={})
    store = StateStore(Path(cfg.black.state_dir))
    writer = HeartbeatWriter(
        cfg, store=store, gpg=Gpg(keys.black_home), outbox=Outbox.from_config(cfg)
    )
    return Black(cfg, keys, writer, sq.SequenceState())


def _mark_ran(b: Black) -> None:
    """What a tap leaves in the state dir of an idle channel: its status file."""
    (Path(b.cfg.black.state_dir) / f"tap-{CH}.json").write_text("{}")


def test_a_new_install_starts_from_the_time_without_a_warning(black: Black) -> None:
    t0 = int(time.time() * 10)
    with captured_logs("bridge.black.heartbeat") as logs:
        first, events = black.beat()
    assert t0 <= first <= int(time.time() * 10) and events == []
    assert black.beat() == (first + 1, [])
    assert not [r for r in logs if r.levelno >= logging.WARNING]


def test_an_idle_channel_whose_seq_file_is_lost_is_still_heard(black: Black) -> None:
    """No bundle ever shipped on the channel: red had heard N seqs, the file is lost, and every
    heartbeat from 1 up to N was dropped as replayed (the link looked silent)."""
    _mark_ran(black)
    black.seq_file.write_text(json.dumps({"heartbeat_seq": 4}))  # an older install, from 1
    seqs = [black.beat() for _ in range(3)]
    assert seqs == [(5, []), (6, []), (7, [])]
    black.seq_file.unlink()  # the fault
    t0 = int(time.time() * 10)
    with captured_logs("bridge.black.heartbeat") as logs:
        seq, events = black.beat()
    assert seq >= t0 and events == [], "red must take it as new, not replayed"
    assert black.beat() == (seq + 1, [])
    warned = [r.getMessage() for r in logs if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "continue from the time" in warned[0]


@pytest.mark.parametrize("damage", [b"", b"{", b"null", b'{"heartbeat_seq": "7"}', b"[7]"])
def test_a_damaged_seq_file_continues_from_the_time(black: Black, damage: bytes) -> None:
    _mark_ran(black)
    black.seq_file.write_text(json.dumps({"heartbeat_seq": 6}))
    assert black.beat() == (7, [])
    black.seq_file.write_bytes(damage)  # the fault (a torn write, a hand edit)
    t0 = int(time.time() * 10)
    with captured_logs("bridge.black.heartbeat") as logs:
        seq, events = black.beat()
    assert seq >= t0 and events == []
    assert json.loads(black.seq_file.read_bytes()) == {"heartbeat_seq": seq}  # repaired
    warned = [r.getMessage() for r in logs if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(black.seq_file) in warned[0] and "unreadable" in warned[0]


def test_a_lost_seq_file_never_writes_over_a_heartbeat_still_in_the_outbox(black: Black) -> None:
    """The clock was stepped back since: the time gives a seq a heartbeat still waiting for
    the mover already has. The new one goes above it, and the old file stays as it was."""
    ahead = int(time.time() * 10) + 36_000  # an hour ahead
    waiting = black.outbox / heartbeat_name(CH, ahead)
    waiting.write_bytes(b"still waiting for the mover")
    seq, _ = black.beat()
    assert seq == ahead + 1
    assert waiting.read_bytes() == b"still waiting for the mover"


def test_a_seq_file_restored_from_an_old_backup_never_writes_over_the_outbox(
    black: Black,
) -> None:
    black.seq_file.write_text(json.dumps({"heartbeat_seq": 10}))
    first = [black.beat()[0] for _ in range(3)]
    assert first == [11, 12, 13]  # the mover is down: all three wait in the outbox
    names = [heartbeat_name(CH, s) for s in first]
    before = {n: (black.outbox / n).read_bytes() for n in names}
    black.seq_file.write_text(json.dumps({"heartbeat_seq": 10}))  # the old backup
    seq, events = black.beat()
    assert seq == 14 and events == []
    assert {n: (black.outbox / n).read_bytes() for n in before} == before


def test_a_heartbeat_that_never_reached_the_outbox_leaves_the_seq_file_as_it_was(
    black: Black,
) -> None:
    import shutil

    from bridge.errors import TransportError

    staging = black.writer.outbox.staging
    shutil.rmtree(staging)  # the staging write fails: nothing reaches the outbox
    with pytest.raises(TransportError, match="cannot stage"):
        black.writer.beat(black.cfg.channel(CH))
    assert not black.seq_file.exists()  # a new install stays one
    staging.mkdir()
    seq, events = black.beat()
    assert seq > 1_000_000_000 and events == []


def test_a_heartbeat_that_never_reached_the_outbox_gives_its_seq_back(black: Black) -> None:
    import shutil

    from bridge.errors import TransportError

    black.seq_file.write_text(json.dumps({"heartbeat_seq": 5}))
    staging = black.writer.outbox.staging
    shutil.rmtree(staging)
    with pytest.raises(TransportError, match="cannot stage"):
        black.writer.beat(black.cfg.channel(CH))
    assert json.loads(black.seq_file.read_bytes()) == {"heartbeat_seq": 5}
    staging.mkdir()
    assert black.beat() == (6, [])
