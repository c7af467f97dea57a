"""Unit: black report — status from the journal, strict parsing of file names on disk."""

from __future__ import annotations

from pathlib import Path

from bridge.black.report import channel_status, files_table
from bridge.black.state import ChannelState, StateStore
from bridge.config import config_from_dict


def test_status_and_files(tmp_path: Path) -> None:
    cfg = config_from_dict(
        {"channels": [{"name": "c", "encrypt": False}]}, base=tmp_path, environ={}
    )
    StateStore(cfg.black.state_dir).save(
        ChannelState(channel="c", last_bundle_seq=2, last_seq=9, counters={"lost_maxlen": 3})
    )
    (cfg.black.archive / "c").mkdir(parents=True)
    (cfg.black.outbox).mkdir(parents=True)
    good = "c.000000000002." + "a" * 32 + ".dbundle"
    (cfg.black.archive / "c" / good).write_bytes(b"x" * 10)
    (cfg.black.outbox / good).write_bytes(b"x" * 10)
    (cfg.black.outbox / "c.000000000007.dheartbeat").write_bytes(b"h")
    (cfg.black.outbox / "../../evil.dbundle").resolve().write_bytes(b"")  # outside: never listed
    (cfg.black.outbox / "c.2.short.dbundle").write_bytes(b"")  # malformed: skipped
    st = channel_status(cfg)
    ch = st["channels"]["c"]
    assert (ch["last_bundle_seq"], ch["last_seq"], ch["lost"]) == (2, 9, {"maxlen": 3})
    assert ch["outbox_bundles"] == 1
    arch = files_table(cfg, where="archive").to_pylist()
    assert [(r["kind"], r["seq"], r["bytes"]) for r in arch] == [("bundle", 2, 10)]
    out = files_table(cfg, where="outbox").to_pylist()
    assert sorted((r["kind"], r["seq"]) for r in out) == [("bundle", 2), ("heartbeat", 7)]
