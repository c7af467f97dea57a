"""Integration: `diode black heartbeat` (real CLI, real gpg, real files; no broker) writes the
heartbeat the black job writes while no job runs — red's verification accepts it, its seq
continues the job's counter and it names the last bundle the journal shipped — writes nothing
while another process holds black's run lock, beats at ``--every``'s period releasing the lock
between beats, stops on SIGTERM, and exits 2 on misconfiguration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bridge.black.heartbeat import HeartbeatWriter, read_heartbeat_seq
from bridge.black.state import LOCK_FILE, ChannelState, StateStore
from bridge.config import Config, load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode.file_drop import Outbox
from bridge.fsutil import exclusive_lock
from bridge.protocol.heartbeat import Heartbeat
from bridge.protocol.manifest import parse_utc
from bridge.protocol.naming import heartbeat_name, parse_heartbeat_name
from bridge.red import sequence as sq
from bridge.red.verify import VerifyContext, verify_file
from tests.integration.test_cli_failfast import DIODE, _run
from tests.support import key_inventory, wait_for
from tests.unit.test_state_lock import HOLD

pytestmark = pytest.mark.gpg

SHIPPED = {"ops": (5, 499), "plain": (2, 19)}
"""Per channel, (last bundle seq, last message seq) the journal holds as shipped."""


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    with key_inventory("hb-cmd-test", prefix="dq") as inv:
        yield inv


@dataclass
class Site:
    """One machine: a config file for both sides, black's journals (a job ran before), and
    the job's own heartbeat writer."""

    path: Path
    cfg: Config
    job: HeartbeatWriter

    @property
    def outbox(self) -> Path:
        return Path(self.cfg.black.outbox)

    @property
    def lock(self) -> Path:
        return Path(self.cfg.black.state_dir) / LOCK_FILE

    def heartbeats(self, channel: str) -> list[str]:
        """The channel's heartbeat files in the outbox (no mover takes them), by seq."""
        names = [n for n in os.listdir(self.outbox) if n.endswith(".dheartbeat")]
        mine = [n for n in names if parse_heartbeat_name(n).channel == channel]
        return sorted(mine, key=lambda n: parse_heartbeat_name(n).heartbeat_seq)

    def red_reads(self, name: str) -> Heartbeat:
        """Red's verification of the outbox file ``name``: accepted, and its heartbeat."""
        v = verify_file(self.outbox / name, name, VerifyContext.from_config(self.cfg, environ={}))
        assert v.ok and v.kind == "heartbeat", v
        assert v.encrypted is self.cfg.channel(v.channel or "").encrypt
        assert v.heartbeat_json is not None
        return Heartbeat.from_json(v.heartbeat_json.encode())


def _toml(
    keys: KeyInventory,
    *,
    state_dir: str = "black/state",
    home: str | None = None,
    signing_key: str | None = None,
) -> str:
    red = json.dumps(list(keys.red_fprs.values()))
    return (
        f'[link]\nbridge_id = "hb-cmd-test"\nblack_signers = ["{keys.black_fpr}"]\n\n'
        f'[[channels]]\nname = "ops"\nrecipients = {red}\n\n'
        f'[[channels]]\nname = "plain"\nrecipients = {red}\nencrypt = false\n\n'
        f'[black]\ngnupg_home = "{home or keys.black_home}"\n'
        f'signing_key = "{signing_key or keys.black_fpr}"\n'
        f'outbox = "black/outbox"\narchive = "black/archive"\nstate_dir = "{state_dir}"\n'
        f'spool_dir = "black/spool"\ncheckpoint_dir = "black/checkpoint"\n\n'
        f'[red]\ngnupg_home = "{keys.red_home}"\nwork_dir = "red/work"\n'
    )


def _write_cfg(root: Path, text: str) -> Path:
    p = root / "d.toml"
    p.write_text(text)
    p.chmod(0o600)
    return p


@pytest.fixture
def site(short_tmp: Path, keys: KeyInventory) -> Site:
    path = _write_cfg(short_tmp, _toml(keys))
    cfg = load_config(path, environ={})
    store = StateStore(Path(cfg.black.state_dir))
    for ch, (bundle, seq) in SHIPPED.items():  # what a job left after shipping bundles
        store.save(ChannelState(ch, last_bundle_seq=bundle, last_seq=seq, last_sha256="ab" * 32))
    gpg = Gpg(keys.black_home)
    job = HeartbeatWriter(cfg, store=store, gpg=gpg, outbox=Outbox.from_config(cfg))
    return Site(path, cfg, job)


def _landed(channel: str, top: int) -> sq.SequenceState:
    """Red's sequence state after bundles 1..top of ``channel``."""
    state = sq.SequenceState()
    for n in range(1, top + 1):
        facts = sq.BundleFacts(channel, n, f"id{n}", f"{n:064x}", None, 10, (n - 1) * 10, n * 10)
        sq.admit(state, facts, datetime.now(UTC))
    return state


def _json_line(out: str) -> dict[str, object]:
    line = next(x for x in out.splitlines() if x.startswith("{"))
    return dict(json.loads(line))


def test_one_round_continues_the_jobs_heartbeats_and_red_accepts_them(site: Site) -> None:
    red = {ch: _landed(ch, bundle) for ch, (bundle, _) in SHIPPED.items()}
    job_seq = {}
    for ch in SHIPPED:  # the last run's heartbeats, heard by red
        hb = site.red_reads(site.job.beat(site.cfg.channel(ch)))
        job_seq[ch] = hb.heartbeat_seq
        assert sq.heartbeat(red[ch], sq.HeartbeatFacts.from_heartbeat(hb), datetime.now(UTC)) == []

    code, out = _run("black", "heartbeat", "--config", str(site.path))
    assert code == 0, out
    done = _json_line(out)
    want = {ch: heartbeat_name(ch, job_seq[ch] + 1) for ch in SHIPPED}
    assert done == {"written": want, "failed": {}, "skipped": None}, out
    for ch, (bundle, seq) in SHIPPED.items():
        hb = site.red_reads(want[ch])
        assert (hb.heartbeat_seq, hb.last_bundle_seq, hb.last_seq) == (job_seq[ch] + 1, bundle, seq)
        assert hb.interval_seconds == site.cfg.black.heartbeat_seconds
        assert hb.bridge_id == "hb-cmd-test"
        # red takes it as new (not replayed) and finds no last bundle missing
        assert sq.heartbeat(red[ch], sq.HeartbeatFacts.from_heartbeat(hb), datetime.now(UTC)) == []
        assert read_heartbeat_seq(Path(site.cfg.black.state_dir), ch) == job_seq[ch] + 1
    # and the next job run continues the command's counter
    assert site.job.beat(site.cfg.channel("ops")) == heartbeat_name("ops", job_seq["ops"] + 2)


def test_a_held_run_lock_writes_nothing_and_says_so(site: Site) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(site.lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, out = _run("black", "heartbeat", "--config", str(site.path))
    finally:
        holder.kill()
        holder.wait()
    assert code == 0, out
    done = _json_line(out)
    assert done["written"] == {} and done["failed"] == {}, out
    assert "nothing written" in out and str(site.lock) in out and "black job" in out, out
    assert not [n for n in os.listdir(site.outbox) if n.endswith(".dheartbeat")]
    assert all(read_heartbeat_seq(Path(site.cfg.black.state_dir), ch) is None for ch in SHIPPED)


def _seqs(site: Site, channel: str) -> list[int]:
    return [parse_heartbeat_name(n).heartbeat_seq for n in site.heartbeats(channel)]


def test_every_beats_at_the_period_gives_way_to_a_job_and_stops_on_sigterm(site: Site) -> None:
    period = 1.0  # the least --every takes
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}
    cmd = [*DIODE, "--log-format", "json", "black", "heartbeat", "--every", str(period)]
    proc = subprocess.Popen(
        [*cmd, "--config", str(site.path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(site.heartbeats("ops")) >= 3, 60, "three heartbeats of ops")
        beats = [site.red_reads(n) for n in site.heartbeats("ops")[:3]]
        assert [b.heartbeat_seq for b in beats] == list(
            range(beats[0].heartbeat_seq, beats[0].heartbeat_seq + 3)
        )
        assert all(b.interval_seconds == period and b.last_bundle_seq == 5 for b in beats)
        times = [parse_utc(b.black_time) for b in beats]
        mean = (times[-1] - times[0]).total_seconds() / (len(times) - 1)
        assert 0.7 * period <= mean <= 1.6 * period, f"mean spacing {mean:.3f}s, period {period}s"

        t0 = time.monotonic()  # a job starting now gets the lock at once (between two beats)
        with exclusive_lock(site.lock, what="black run", timeout=10):
            waited = time.monotonic() - t0
            before = {ch: _seqs(site, ch) for ch in SHIPPED}
            job_names = [site.job.beat(site.cfg.channel(ch)) for ch in SHIPPED]  # it beats itself
            time.sleep(2.5 * period)
            after = {ch: _seqs(site, ch) for ch in SHIPPED}
        assert waited < 5, f"a starting job waited {waited:.1f}s for the lock"
        for ch, name in zip(SHIPPED, job_names, strict=True):  # the job was the only writer
            job = parse_heartbeat_name(name).heartbeat_seq
            assert job == before[ch][-1] + 1 and after[ch] == [*before[ch], job], (ch, after)
        top = after["ops"][-1]
        wait_for(lambda: _seqs(site, "ops")[-1] > top, 30, "the command to beat again")
        assert _seqs(site, "ops")[-1] == top + 1  # it continues the job's counter
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    totals = json.loads(out.strip().splitlines()[-1])
    assert totals["skipped_rounds"] >= 2 and totals["failed"] == 0, totals
    ended = {ch: _seqs(site, ch) for ch in SHIPPED}
    written = sum(len(v) for v in ended.values()) - len(job_names)  # the rest are the command's
    assert totals["heartbeats"] == written, (totals, ended)
    assert "heartbeats paused" in err and "heartbeats resumed" in err, err
    time.sleep(1.5 * period)
    assert {ch: _seqs(site, ch) for ch in SHIPPED} == ended, "it beat after SIGTERM"


def test_misconfiguration_exits_2_with_the_fix(short_tmp: Path, keys: KeyInventory) -> None:
    missing = _write_cfg(short_tmp, _toml(keys, state_dir="black/stat"))
    code, out = _run("black", "heartbeat", "--config", str(missing))
    assert code == 2 and "black.state_dir" in out and "does not exist" in out, out
    assert "diode black run" in out, out
    assert not (short_tmp / "black" / "stat").exists(), "a state dir was made"

    (short_tmp / "black" / "state").mkdir(parents=True)
    no_home = _write_cfg(short_tmp, _toml(keys, home=str(short_tmp / "nohome")))
    code, out = _run("black", "heartbeat", "--config", str(no_home))
    assert code == 2 and "black.gnupg_home" in out and "diode keys init" in out, out
    assert not (short_tmp / "nohome").exists(), "a GnuPG home was made"

    stranger = "ABCDEF0123456789ABCDEF0123456789ABCDEF01"
    wrong = _write_cfg(short_tmp, _toml(keys, signing_key=stranger))
    code, out = _run("black", "heartbeat", "--config", str(wrong))
    assert code == 2 and stranger in out, out

    good = _write_cfg(short_tmp, _toml(keys))
    for every in ("0", "0.5", "-1", "x"):  # under 1 s: seqs outrun the clock they restart from
        code, out = _run("black", "heartbeat", "--every", every, "--config", str(good))
        assert code == 2 and "--every" in out, out
    assert not (short_tmp / "black" / "outbox").exists(), "it got as far as the outbox"


def test_a_job_waiting_for_the_lock_gets_it_after_the_beat_in_progress(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command let go of the run lock and took it again at once, for the next channel and
    the next round: a job polling for it (every 50 ms at most) almost never got in, and with
    rounds that run late (slow gpg, many channels) it waited its 40 s and was refused. The
    lock stays free a moment between two beats."""
    from bridge.black.beat_cmd import HeartbeatCommand

    real = HeartbeatWriter.beat

    def slow(self: HeartbeatWriter, channel: Any) -> str:
        time.sleep(0.6)  # a slow gpg: rounds of two channels take longer than --every
        return real(self, channel)

    monkeypatch.setattr(HeartbeatWriter, "beat", slow)
    cmd = HeartbeatCommand(site.cfg, interval=1.0)
    stop = threading.Event()
    th = threading.Thread(target=cmd.run, args=(1.0, stop), daemon=True)
    th.start()
    try:
        wait_for(lambda: len(site.heartbeats("ops")) >= 2, 30, "rounds under way")
        t0 = time.monotonic()
        with exclusive_lock(site.lock, what="black run", timeout=5):  # the job starting
            waited = time.monotonic() - t0
    finally:
        stop.set()
        th.join(30)
    assert waited < 1.5, f"the job waited {waited:.1f}s: more than the beat in progress"
