"""Integration: the red job end to end (real gpg, real local Spark, real Delta tables):
bundles dropped into the inbox out of order, with holes, duplicates, hostile files and
heartbeats, land exactly once; every file ends in processed/ or quarantine/ and is audited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from bridge.config import Config, load_config
from bridge.errors import DiodeError
from bridge.fsutil import exclusive_lock
from bridge.metrics import REGISTRY
from bridge.protocol.manifest import parse_utc
from bridge.red.evidence import Evidence
from bridge.red.job import RedRun, open_tables
from bridge.red.landing import LOCK_FILE, Landing, LandingError
from bridge.red.quarantine import list_quarantined, quarantine_summary, show_quarantined
from bridge.red.report import red_gaps, red_status
from bridge.red.tables import RedTables
from tests.red_factory import (
    RedKeys,
    kill_agents,
    make_bundle,
    make_chain,
    make_heartbeat,
    make_rows,
    write_red_toml,
)

pytestmark = [pytest.mark.gpg, pytest.mark.spark, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = Path(os.path.realpath("/tmp")) / f"rp{os.getpid()}"
    root.mkdir(exist_ok=True)
    k = RedKeys.create(root)
    yield k
    kill_agents(root)


def write_config(root: Path, keys: RedKeys, channels: dict[str, bool]) -> Config:
    return load_config(write_red_toml(root, keys, channels))


def table(cfg: Config, name: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    dt = DeltaTable(str(Path(cfg.red.tables_dir) / name))
    return dt.to_pyarrow_table(columns=columns).to_pylist()


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    """``bridge_red_<name>`` in this process's registry (0 before its first sample)."""
    return REGISTRY.get_sample_value(f"bridge_red_{name}", labels or {}) or 0.0


def drop(cfg: Config, *files: Path) -> None:
    inbox = Path(cfg.red.inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    for f in files:
        os.replace(f, inbox / f.name)


def run(cfg: Config, spark: Any) -> dict[str, Any]:
    return RedRun(cfg).run(spark, "available-now").to_json()


def test_out_of_order_holes_duplicates_land_exactly_once(
    spark: Any, keys: RedKeys, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, keys, {"orders": True})
    made = tmp_path / "made"
    made.mkdir()
    chain = make_chain(made, keys, "orders", 6, 40, gap_every=3, gap_size=2)
    counters = ("bundles_landed_total", "messages_landed_total", "bundles_duplicate_total",
                "files_processed_total")  # fmt: skip
    before = {m: metric(m) for m in counters}
    hb = make_heartbeat(made, keys, "orders", 1, last_bundle_seq=6, last_seq=None)
    # first delivery: 1, 2, 4, 6 and a heartbeat naming 6 as the last bundle
    drop(cfg, *(chain[i].path for i in (5, 3, 0, 1)), hb.path)
    s1 = run(cfg, spark)
    assert s1["bundles_landed"] == 4 and s1["messages_landed"] == 160, s1
    assert s1["rejected"] == 0 and s1["heartbeats"] == 1
    gaps = red_gaps(cfg)["open_transit_gaps"]
    assert sorted((g["first_bundle_seq"], g["last_bundle_seq"]) for g in gaps) == [(3, 3), (5, 5)]
    # second delivery: the missing ones, plus a byte-identical resend of bundle 2
    dup = made / "dup"
    dup.mkdir()
    copy = dup / chain[1].name
    copy.write_bytes(
        (Path(cfg.red.processed_dir).glob(f"*/{chain[1].name}").__next__()).read_bytes()
    )
    # ... and a heartbeat saying bundle 7 was shipped: it has not arrived (missing last bundle)
    hb2 = make_heartbeat(made, keys, "orders", 2, last_bundle_seq=7, last_seq=400)
    drop(cfg, chain[2].path, chain[4].path, copy, hb2.path)
    s2 = run(cfg, spark)
    assert s2["bundles_landed"] == 2 and s2["duplicates"] == 1, s2
    gaps = red_gaps(cfg)["open_transit_gaps"]
    assert [(g["first_bundle_seq"], g["last_bundle_seq"]) for g in gaps] == [(7, 7)]
    # the job's Prometheus metrics say the same (counters of this process: by difference)
    got = {m: metric(m) - v for m, v in before.items()}
    assert got == {"bundles_landed_total": 6, "messages_landed_total": 240,
                   "bundles_duplicate_total": 1, "files_processed_total": 9}, got  # fmt: skip
    ch = {"channel": "orders"}
    assert metric("open_gaps", ch) == 1 and metric("link_silent", ch) == 0
    assert (metric("contiguous_bundle_seq", ch), metric("known_bundle_seq", ch)) == (6, 7)
    hb_at = red_status(cfg)["channels"]["orders"]["last_heartbeat"]["received_at"]
    assert metric("heartbeat_received_timestamp_seconds", ch) == parse_utc(hb_at).timestamp()

    msgs = table(cfg, "messages", ["channel", "seq", "bundle_seq", "land_seq"])
    keys_ = [(m["channel"], m["seq"]) for m in msgs]
    expected = sorted(s for b in chain for s in b.rows.column("seq").to_pylist())
    assert sorted(s for _, s in keys_) == expected and len(set(keys_)) == len(keys_) == 240
    ledger = table(cfg, "bundles")
    landed = {r["bundle_seq"]: r for r in ledger if r["status"] == "landed"}
    assert sorted(landed) == [1, 2, 3, 4, 5, 6]
    assert {r["chain_status"] for r in landed.values() if r["bundle_seq"] > 1} == {"verified"}
    assert landed[1]["chain_status"] == "first"
    assert [r["bundle_seq"] for r in ledger if r["status"] == "duplicate"] == [2]
    events = [a["event"] for a in table(cfg, "audit", ["event"])]
    for kind in (
        "gap_opened", "gap_closed", "gap_declared", "chain_verified", "duplicate",
        "missing_last_bundle", "heartbeat",
    ):  # fmt: skip
        assert kind in events, (kind, sorted(set(events)))
    assert events.count("chain_verified") == 5
    assert events.count("gap_declared") == 2  # bundles 3 and 6 carry black's declared gaps
    # every file is evidence in processed/, nothing left behind, nothing quarantined
    processed = sorted(p.name for p in Path(cfg.red.processed_dir).rglob("*") if p.is_file())
    assert len(processed) == 9 and f"{chain[1].name}.1" in processed
    assert not list(Path(cfg.red.inbox).iterdir())
    assert not [p for p in (Path(cfg.red.work_dir) / "intake").iterdir() if p.name != "NEXT"]
    assert not list(Path(cfg.red.quarantine_dir).rglob("*.dbundle"))
    st = red_status(cfg)
    assert st["interrupted_landing"] is False and st["channels"]["orders"]["contig"] == 6
    declared = red_gaps(cfg)["declared_by_black"]
    assert [(g["seq_first"], g["seq_last"], g["reason"]) for g in declared] == [
        (80, 81, "maxlen"),
        (202, 203, "maxlen"),
    ]

    # a state restored from an old backup is refused: it would reuse landing numbers
    state_file = Path(cfg.red.state_dir) / "red-state.json"
    doc = json.loads(state_file.read_text())
    doc["land_seq"] = 1
    state_file.write_text(json.dumps(doc))
    landing = Landing(
        cfg, open_tables(cfg), Evidence(cfg.red.processed_dir, cfg.red.quarantine_dir)
    )
    with pytest.raises(LandingError, match="older than the tables"):
        landing.recover()


def test_a_heartbeat_period_too_long_for_red_link_silent_seconds_is_warned_once(
    spark: Any, keys: RedKeys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Black declares a 45 s heartbeat period, red calls a link silent after 60 s: red
    warns, naming both keys and the fix, once however many such heartbeats land; a period
    that leaves room is not warned about."""
    cfg = write_config(tmp_path, keys, {"orders": True})
    made = tmp_path / "made"
    made.mkdir()
    two = [make_heartbeat(made, keys, "orders", n, interval_seconds=45.0) for n in (1, 2)]
    drop(cfg, *(h.path for h in two))
    with caplog.at_level("WARNING", logger="bridge.red.landing"):
        assert run(cfg, spark)["heartbeats"] == 2
    said = [r.getMessage() for r in caplog.records if "link_silent_seconds" in r.getMessage()]
    assert len(said) == 1, said  # once, not per heartbeat
    assert "every 45 s" in said[0] and "is 60 s" in said[0] and "to 135 or more" in said[0]
    quiet = make_heartbeat(made, keys, "orders", 3, interval_seconds=10.0)
    drop(cfg, quiet.path)
    caplog.clear()
    with caplog.at_level("WARNING", logger="bridge.red.landing"):
        assert run(cfg, spark)["heartbeats"] == 1
    assert not [r for r in caplog.records if "link_silent_seconds" in r.getMessage()]


def test_a_failed_background_landing_stops_the_job_and_its_restart_finishes_it(
    spark: Any, keys: RedKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Landings are applied in the background while Spark verifies the next batch. When the
    messages append of landing 2 fails (a fault: the append raises), the job stops with that
    error; landing 2's intent is still the journal's (nothing was judged on top of it), and the
    next run finishes it and lands the rest exactly once."""
    cfg = load_config(write_red_toml(tmp_path, keys, {"orders": True},
                                     red_extra="max_files_per_batch = 2\n"))  # fmt: skip
    made = tmp_path / "made"
    made.mkdir()
    chain = make_chain(made, keys, "orders", 6, 20)
    drop(cfg, *(b.path for b in chain))
    real_append = RedTables.append
    fired: list[int] = []

    def failing_append(self: RedTables, name: str, data: Any, **kw: Any) -> bool:
        if name == "messages" and kw.get("version") == 2:
            fired.append(2)
            raise OSError(28, "No space left on device (injected)")
        return real_append(self, name, data, **kw)

    monkeypatch.setattr(RedTables, "append", failing_append)
    with pytest.raises(DiodeError, match=r"landing 2 failed: OSError.*injected"):
        run(cfg, spark)
    assert fired == [2], "the fault did not fire"
    intent = json.loads((Path(cfg.red.state_dir) / "landing" / "intent.json").read_bytes())
    assert intent["land_seq"] == 2, intent["land_seq"]
    saved = json.loads((Path(cfg.red.state_dir) / "red-state.json").read_bytes())
    assert saved["land_seq"] == 1
    assert len(table(cfg, "messages", ["seq"])) == 40  # landing 1 only
    st = red_status(cfg)
    assert st["interrupted_landing"] is True and st["landing_running"] is False, st
    with exclusive_lock(Path(cfg.red.state_dir) / LOCK_FILE, what="a stand-in red job"):
        st = red_status(cfg)  # an intent beside a running lander is work in progress
        assert st["interrupted_landing"] is False and st["landing_running"] is True, st

    monkeypatch.setattr(RedTables, "append", real_append)
    s = run(cfg, spark)
    assert s["recovered_landings"] == 1 and s["bundles_landed"] == 2, s  # 5 and 6
    msgs = table(cfg, "messages", ["channel", "seq"])
    assert len(msgs) == 120 and len({(m["channel"], m["seq"]) for m in msgs}) == 120
    landed = [r["bundle_seq"] for r in table(cfg, "bundles") if r["status"] == "landed"]
    assert sorted(landed) == [1, 2, 3, 4, 5, 6]


SLOW_WRITER = """
import sys, time
from pathlib import Path
data, dst, done = Path(sys.argv[1]).read_bytes(), sys.argv[2], Path(sys.argv[3])
i, last = 0, len(data) - 1
with open(dst, "wb", buffering=0) as f:  # in place, as a vendor's mover may write
    while i < last and not done.exists():
        f.write(data[i : min(i + 2, last)])
        i = min(i + 2, last)
        time.sleep(0.1)
    while not done.exists():
        time.sleep(0.05)
    f.write(data[i:])
"""
"""Writes a file into the inbox 2 bytes every 0.1 s (never its last byte) until the ``done``
file appears, then the rest and the close: a transfer still going on."""


def make_bomb(out: Path, keys: RedKeys, zeros: int) -> Path:
    """``zeros`` bytes of zeros signed by the PINNED black key, compressed -z 9, encrypted to
    red: a small file that would decrypt to far more than its size."""
    args = ["gpg", "--homedir", str(keys.black_home), "--batch", "--trust-model", "always",
            "-z", "9", "--throw-keyids", "--local-user", keys.black_fpr]  # fmt: skip
    for r in keys.recipients:
        args += ["--recipient", r]
    subprocess.run([*args, "--sign", "--encrypt", "--output", str(out)], input=bytes(zeros),
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    assert out.stat().st_size < zeros // 100
    return out


def test_hostile_files_are_quarantined_and_good_ones_land(
    spark: Any, keys: RedKeys, tmp_path: Path
) -> None:
    """Each hostile file is quarantined with its reason and audited, nothing of it lands, and the
    good bundles beside it land in the same run; a file still being written is left alone until
    complete, then lands in the next run."""
    toml = write_red_toml(tmp_path, keys, {"orders": True, "plain": False})
    # a settle time well above the slow writer's 0.1 s between writes, even on a loaded host
    toml.write_text(toml.read_text().replace("settle_seconds = 0.2", "settle_seconds = 2.0"))
    cfg = load_config(toml)
    made = tmp_path / "made"
    made.mkdir()
    good = make_chain(made, keys, "orders", 2, 25)
    bad: dict[str, Path] = {}
    forged_dir = made / "forged"
    forged_dir.mkdir()
    bad["forged"] = make_bundle(
        forged_dir, keys, "orders", 3, make_rows("orders", range(50, 60)), good[1].sha256,
        signer_home=keys.forger_home, signer_fpr=keys.forger_fpr,
    ).path  # fmt: skip
    mism = make_bundle(
        made, keys, "orders", 4, make_rows("orders", range(60, 70)), "a" * 64,
        manifest_overrides={"bundle_seq": 9},
    )  # fmt: skip
    bad["name_mismatch"] = mism.path
    downgrade = make_bundle(
        made, keys, "orders", 5, make_rows("orders", range(70, 80)), "b" * 64, encrypt=False
    )
    bad["downgrade"] = downgrade.path
    junk = made / "orders.000000000006.0123456789abcdef0123456789abcdef.dbundle"
    junk.write_bytes(b"\x00not a gpg message at all" * 40)
    bad["junk"] = junk
    conflict_dir = made / "conflict"
    conflict_dir.mkdir()
    conflict = make_bundle(
        conflict_dir, keys, "orders", 1, make_rows("orders", range(0, 3)), None
    )  # same seq as good[0], other plaintext
    truncated = made / "trunc"
    truncated.mkdir()
    t = make_bundle(truncated, keys, "orders", 7, make_rows("orders", range(90, 99)), "c" * 64)
    t.path.write_bytes(t.path.read_bytes()[: t.path.stat().st_size // 2])
    bad["truncated"] = t.path
    flipped = make_bundle(made, keys, "orders", 8, make_rows("orders", range(100, 110)), "e" * 64)
    data = bytearray(flipped.path.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.path.write_bytes(bytes(data))
    bad["flipped"] = flipped.path
    for seq, override in ((10, {"format": 2}), (11, {"schema_version": 99})):
        vdir = made / f"version{seq}"
        vdir.mkdir()
        rows = make_rows("orders", range(seq * 10, seq * 10 + 5))
        v = make_bundle(vdir, keys, "orders", seq, rows, "f" * 64, manifest_overrides=override)
        bad[f"unknown_version{seq}"] = v.path
    lying = make_bundle(made, keys, "orders", 12, make_rows("orders", range(120, 125)), "0" * 64,
                        manifest_overrides={"exchanges": {"elsewhere": 5}})  # fmt: skip
    bad["inconsistent"] = lying.path
    bad["bomb"] = make_bomb(
        made / "orders.000000000013.0123456789abcdef0123456789abcdef.dbundle", keys, 24 * 2**20
    )
    slow = make_bundle(made / "slow", keys, "orders", 14, make_rows("orders", range(140, 150)),
                       "1" * 64)  # fmt: skip
    done = tmp_path / "slow.done"
    writer = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(slow.path), str(Path(cfg.red.inbox) / slow.name),
         str(done)]
    )  # fmt: skip
    odd = made / "odd"
    odd.mkdir()
    (odd / "..orders.dbundle").write_bytes(b"x")  # hidden: ignored, never opened
    (odd / "evil;rm -rf.dbundle").write_bytes(b"x")
    (odd / "caf\u00e9.000000000001.dheartbeat").write_bytes(b"x")
    drop(cfg, good[0].path, good[1].path, *bad.values())
    for f in list(odd.iterdir()):
        os.replace(f, Path(cfg.red.inbox) / f.name)
    try:
        s1 = run(cfg, spark)
        partial = Path(cfg.red.inbox) / slow.name
        assert writer.poll() is None, "the slow writer ended before the run did"
        # still growing when the run ended (short of its last byte is where the writer stalls)
        assert 0 < partial.stat().st_size < slow.path.stat().st_size - 1, "not being written"
        done.touch()
        assert writer.wait(timeout=60) == 0
    finally:
        done.touch()
        writer.wait(timeout=60)
    assert s1["bundles_landed"] == 2 and s1["messages_landed"] == 50, s1
    assert s1["rejected"] == len(bad) + 2 and s1["quarantined_at_intake"] == 2, s1  # 2 bad names
    drop(cfg, conflict.path)
    s2 = run(cfg, spark)  # the job goes on: the finished transfer lands, the conflict does not
    assert s2["conflicts"] == 1 and s2["bundles_landed"] == 1, s2

    msgs = table(cfg, "messages", ["seq"])
    want = [*range(50), *range(140, 150)]
    assert sorted(m["seq"] for m in msgs) == want, "nothing hostile landed"
    reasons = {}
    for rf in Path(cfg.red.quarantine_dir).rglob("*.reason.json"):
        doc = json.loads(rf.read_text())
        reasons[doc["original_name"]] = doc["reason"]
    assert reasons[bad["forged"].name] in ("signature", "unpinned_signer")
    assert reasons[mism.name] == "name_mismatch"
    assert reasons[downgrade.name] == "downgrade"
    assert reasons[junk.name] in ("crypto", "malformed")
    assert reasons[t.path.name] in ("crypto", "malformed")
    assert reasons[conflict.name] == "conflict"
    assert reasons[flipped.name] in ("crypto", "signature")
    assert reasons[bad["unknown_version10"].name] == "unknown_version"
    assert reasons[bad["unknown_version11"].name] == "unknown_version"
    assert reasons[lying.name] == "inconsistent"
    assert reasons[bad["bomb"].name] == "crypto"
    bomb_doc = next(
        json.loads(r.read_text())
        for r in Path(cfg.red.quarantine_dir).rglob("*.reason.json")
        if json.loads(r.read_text())["original_name"] == bad["bomb"].name
    )
    assert "compression bomb" in json.dumps(bomb_doc), bomb_doc
    assert slow.name not in reasons, "the file being written was judged before it was complete"
    assert sum(1 for r in reasons.values() if r == "bad_name") == 2
    audit = table(cfg, "audit", ["event", "reason", "file_name"])
    rejected = {a["file_name"] for a in audit if a["event"] == "rejected"}
    assert {p.name for p in bad.values()} <= rejected
    assert sum(1 for a in audit if a["event"] == "quarantined" and a["reason"] == "bad_name") == 2
    assert any(a["event"] == "conflict" for a in audit)
    ledger = table(cfg, "bundles", ["bundle_seq", "status"])
    assert sorted(r["bundle_seq"] for r in ledger if r["status"] == "landed") == [1, 2, 14]
    assert (Path(cfg.red.inbox) / "..orders.dbundle").exists(), "hidden names are left alone"
    quarantine_commands_show_the_same_evidence(cfg, reasons, conflict.name, junk.name)


def quarantine_commands_show_the_same_evidence(
    cfg: Config, reasons: dict[str, str], conflict: str, junk: str
) -> None:
    """`diode quarantine list / show` over what the red job quarantined above."""
    entries = list_quarantined(cfg)
    assert {e["original_name"]: e["reason"] for e in entries} == reasons
    assert quarantine_summary(entries)["by_reason"] == dict(
        sorted(Counter(reasons.values()).items())
    )
    shown = show_quarantined(cfg, conflict)
    assert shown["reason"] == "conflict" and shown["unchanged"] is True
    assert shown["record"]["original_name"] == conflict
    assert "conflict" in {a["event"] for a in shown["audit"]}  # its trail in the audit table
    stored = Path(shown["path"])
    stored.write_bytes(stored.read_bytes()[:-1] + b"?")  # evidence changed after the fact
    assert show_quarantined(cfg, conflict, audit=False)["unchanged"] is False
    lost = next(e for e in entries if e["original_name"] == junk)
    Path(lost["path"] + ".reason.json").unlink()  # a reason file gone: still listed
    assert {e["reason"] for e in list_quarantined(cfg) if e["stored_as"] == junk} == {
        "no_reason_file"
    }
    cli = [sys.executable, "-m", "bridge.cli", "--log-level", "WARNING", "quarantine"]
    r = subprocess.run(
        [*cli, "list", "--config", str(cfg.source), "--json", "--reason", "downgrade"],
        capture_output=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    doc = json.loads(r.stdout)
    assert doc["summary"] == {"total": 1, "by_reason": {"downgrade": 1}}
    r = subprocess.run(
        [*cli, "show", "--config", str(cfg.source), "no-such-file.dbundle"],
        capture_output=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 1 and b"is not in the quarantine" in r.stderr


@pytest.mark.broker
def test_replay_holds_for_a_missing_bundle_landed_by_the_red_job(
    spark: Any, keys: RedKeys, tmp_path: Path, red_vhost: Any
) -> None:
    """The replay's hold-back on what the real landing saved: bundle 2 missing, bundle 3's rows
    wait; once the job lands bundle 2, its rows go out before bundle 3's, in seq order."""
    from bridge.amqp.client import Connection
    from bridge.red.replay import Replayer

    url = red_vhost.amqp_url
    extra = 'approved = ["orders"]\npoll_seconds = 0.05\ngap_hold_seconds = 300\n'
    cfg = load_config(write_red_toml(tmp_path, keys, replay_url=url, replay_extra=extra))
    made = tmp_path / "made"
    made.mkdir()
    chain = make_chain(made, keys, "orders", 3, 30)
    drop(cfg, chain[0].path, chain[2].path)
    assert run(cfg, spark)["bundles_landed"] == 2
    with Connection.open(url) as conn, Replayer(cfg) as replayer:
        first = replayer.step()
        assert (first.confirmed, first.held) == (30, 1), first  # bundle 1 only: 3 waits
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).queue
        ch.queue_bind(q, "orders", "#")
        ch.basic_consume(q, no_ack=True)
        assert replayer.step().published == 0
        drop(cfg, chain[1].path)
        assert run(cfg, spark)["bundles_landed"] == 1
        for _ in range(50):
            if replayer.step().caught_up:
                break
        got: list[int] = []
        for _ in range(100):
            got += [json.loads(d.body)["seq"] for d in conn.poll(0.1).deliveries]
            if len(got) >= 60:
                break
    want = [s for b in chain[1:] for s in b.rows.column("seq").to_pylist()]
    assert got == want  # bundle 2's rows, then bundle 3's: seq order kept across the gap
    events = {a["event"] for a in table(cfg, "audit", ["event"])}
    assert "gap_opened" in events and "gap_closed" in events
