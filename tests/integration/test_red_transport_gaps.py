"""Integration: red audits the UDP receiver's gap records (real Delta tables, a real
gaps.jsonl as the receiver writes it): each record once, across ticks, torn lines, a replaced
spool and a crash between the audit append and the saved state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import Config, load_config
from bridge.red.job import open_landing
from bridge.red.landing import Landing
from tests.red_factory import RED_DIRS_TOML


def _config(root: Path) -> Config:
    text = f"""
[link]
bridge_id = "gaps-test"

[[channels]]
name = "u1"
encrypt = false
transport = "udp"

[red]
{RED_DIRS_TOML}
[udp]
key_file = "udp.key"

[udp.receive]
spool_dir = "red/udp-spool"
"""
    p = root / "diode.toml"
    p.write_text(text)
    return load_config(p, environ={})


def _record(seq: int, reason: str = "timeout", channel: str = "u1") -> dict[str, Any]:
    return {
        "epoch": 1795416026359094799, "object_id": seq, "channel": channel, "kind": "bundle",
        "seq": seq, "length": 4096, "digest": "ab" * 32, "blocks_total": 3, "blocks_done": 1,
        "symbols_received": 40, "reason": reason, "time": 1795416030.5 + seq,
    }  # fmt: skip


def _append(cfg: Config, *lines: str) -> Path:
    spool = Path(cfg.udp.receive.spool_dir)  # type: ignore[union-attr]
    spool.mkdir(parents=True, exist_ok=True)
    with open(spool / "gaps.jsonl", "a", encoding="utf-8") as f:
        f.write("".join(lines))
    return spool / "gaps.jsonl"


def _transport_rows(cfg: Config) -> list[dict[str, Any]]:
    dt = DeltaTable(str(Path(cfg.red.tables_dir) / "audit"))
    rows = dt.to_pyarrow_table().to_pylist()
    return sorted((r for r in rows if r["event"] == "transport_gap"), key=lambda r: r["event_id"])


def test_each_gap_record_is_audited_once(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    landing.tick()  # the first tick starts watching the channel (a state change: a landing)
    seq = landing.land_seq
    assert landing.tick().events == {}  # no gaps.jsonl yet: nothing, no landing
    assert landing.land_seq == seq

    path = _append(
        cfg,
        json.dumps(_record(5)) + "\n",
        json.dumps(_record(6, "spool_error") | {"error": "ENOSPC: No space left"}) + "\n",
        json.dumps(_record(7, channel="not-configured")) + "\n",
        '{"epoch": 1, "chan',  # torn: the receiver is writing it (or was killed mid-write)
    )
    assert landing.tick().events == {"transport_gap": 3}
    rows = _transport_rows(cfg)
    assert [(r["channel"], r["bundle_seq"], r["reason"]) for r in rows] == [
        ("u1", 5, "timeout"),
        ("u1", 6, "spool_error"),
        (None, None, "timeout"),  # a channel red does not know is not trusted as a column
    ]
    assert json.loads(rows[1]["detail"])["error"] == "ENOSPC: No space left"
    assert json.loads(rows[2]["detail"])["channel"] == "not-configured"
    assert rows[0]["at"].timestamp() == pytest.approx(1795416035.5)

    # nothing new: no landing, no row
    seq = landing.land_seq
    assert landing.tick().events == {}
    assert landing.land_seq == seq

    # the receiver finishes its line with a newline before its next record (as write_gaps does)
    _append(cfg, "\n", json.dumps(_record(8)) + "\n")
    assert landing.tick().events == {"transport_gap": 1}
    assert [r["bundle_seq"] for r in _transport_rows(cfg)] == [5, 6, None, 8]

    # a restart reads from the saved position, not from the start
    landing = open_landing(cfg)
    assert landing.tick().events == {}
    assert len(_transport_rows(cfg)) == 4

    # a new spool (the file replaced by a shorter one) is read from its start
    path.write_text(json.dumps(_record(9)) + "\n")
    assert landing.tick().events == {"transport_gap": 1}
    assert [r["bundle_seq"] for r in _transport_rows(cfg)] == [5, 6, None, 8, 9]


def test_a_crash_after_the_audit_append_neither_loses_nor_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    landing = open_landing(cfg)
    _append(cfg, json.dumps(_record(3)) + "\n")

    fired: list[int] = []

    def crash(self: Landing, land_seq: int, *_: Any) -> None:
        fired.append(land_seq)
        raise KeyboardInterrupt("killed between the audit append and the saved state")

    monkeypatch.setattr(Landing, "_save_state", crash)
    with pytest.raises(KeyboardInterrupt):
        landing.tick()
    monkeypatch.undo()
    assert fired == [1]  # the fault hit the window it names: audit written, state not saved
    assert len(_transport_rows(cfg)) == 1
    assert (Path(cfg.red.state_dir) / "landing" / "intent.json").exists()

    restarted = open_landing(cfg)  # finishes the interrupted landing from its intent
    assert restarted.land_seq == 1
    assert restarted.udp_gaps_offset > 0
    assert restarted.tick().events == {}
    assert len(_transport_rows(cfg)) == 1  # exactly once
