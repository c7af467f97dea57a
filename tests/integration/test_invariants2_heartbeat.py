"""Black heartbeats, real gpg (mutation review, wave 2): a heartbeat names the last bundle seq
and message seq the channel's journal shipped, exactly, so that red (its sequence checks)
sees a missing last bundle — and sees none when nothing is missing."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bridge.black.heartbeat import HeartbeatWriter
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import Outbox
from bridge.protocol.heartbeat import Heartbeat
from bridge.red import sequence as sq
from tests.support import key_inventory

pytestmark = pytest.mark.gpg

CH = "ops"


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    with key_inventory("hb-inv2-test", prefix="di") as inv:
        yield inv


def _landed(top: int) -> sq.SequenceState:
    """Red's sequence state after bundles 1..top of 100 messages each."""
    state = sq.SequenceState()
    for n in range(1, top + 1):
        facts = sq.BundleFacts(CH, n, f"id{n}", f"{n:064x}", None, 100, (n - 1) * 100, n * 100 - 1)
        sq.admit(state, facts, datetime.now(UTC))
    return state


def test_a_heartbeat_names_the_last_bundle_shipped_and_red_finds_it_missing(
    short_tmp: Path, keys: KeyInventory
) -> None:
    red = next(iter(keys.red_fprs.values()))
    data = {
        "link": {"bridge_id": "hb-inv2-test", "black_signers": [keys.black_fpr]},
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
    store.save(ChannelState(CH, last_bundle_seq=5, last_seq=499, last_sha256="ab" * 32))
    writer = HeartbeatWriter(
        cfg, store=store, gpg=Gpg(keys.black_home), outbox=Outbox.from_config(cfg)
    )

    def beat() -> Heartbeat:
        name = writer.beat(cfg.channel(CH))
        plain, _ = Gpg(keys.red_home).open_bytes(
            (Path(cfg.black.outbox) / name).read_bytes(), pinned_signers=[keys.black_fpr]
        )
        return Heartbeat.from_json(plain)

    hb = beat()
    assert (hb.last_bundle_seq, hb.last_seq) == (5, 499)
    facts = sq.HeartbeatFacts.from_heartbeat(hb)
    heard_all = _landed(5)  # red landed bundles 1..5: nothing is missing
    assert [e.kind for e in sq.heartbeat(heard_all, facts, datetime.now(UTC))] == []
    heard_four = _landed(4)  # red landed 1..4: bundle 5, the last, is missing
    kinds = [e.kind for e in sq.heartbeat(heard_four, facts, datetime.now(UTC))]
    assert "missing_last_bundle" in kinds
    store.save(ChannelState(CH, last_bundle_seq=6, last_seq=512, last_sha256="cd" * 32))
    nxt = beat()  # the next one follows the journal
    assert (nxt.last_bundle_seq, nxt.last_seq) == (6, 512)
    assert nxt.heartbeat_seq > hb.heartbeat_seq
