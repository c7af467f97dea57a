"""Integration: `diode resend` / `status` / `gaps` after a real black run, and archive pruning.

A black run (in-process Spark, available-now, small bundles) ships >= 4 bundles; the vendor's
mover then takes everything out of the outbox. The real CLI (a subprocess) re-drops a range
from the archive, byte for byte, through the staging dir; reports what the archive no longer
holds (exit 1, JSON); refuses an unknown channel (exit 2); and ``status`` / ``gaps`` tell where
black stands. Pruning removes archived bundles older than the retention and keeps the recent
ones.

Coordination (no Spark needed): ``resend`` never takes the job's run lock (``black.lock``), so
it works while a job runs; it waits, per re-drop, only for a starting job's sweep of the
staging dir (the drop lock), and says so clearly when that lasts longer than ``--wait``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pika
import pytest

from bridge.config import load_config
from bridge.crypto.keys import init_keys
from bridge.diode.file_drop import Outbox

REPO = Path(__file__).resolve().parents[2]
CHANNEL = "ops"
N = 50
MAX_ROWS = 10
DAY = 86400.0


def write_config(work: Path, amqp_url: str, mgmt: str, black_fpr: str, red_fpr: str) -> Path:
    p = work / "diode.toml"
    p.write_text(
        f"""
[link]
bridge_id = "resend-black"
black_signers = ["{black_fpr}"]

[[channels]]
name = "{CHANNEL}"
exchanges = ["ops.*"]
recipients = ["{red_fpr}"]

[black]
amqp_url = "{amqp_url}"
management_url = "{mgmt}"
gnupg_home = "keys/black"
signing_key = "{black_fpr}"
trigger_seconds = 1.0
heartbeat_seconds = 5.0
archive_retention_days = 7

[black.bundle]
max_rows = {MAX_ROWS}
"""
    )
    return p


def diode(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("DIODE_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "bridge.cli", "--log-format", "json", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def bundle_seq(name: str) -> int:
    return int(name.split(".")[1])


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.mark.broker
@pytest.mark.gpg
@pytest.mark.spark
def test_resend_status_gaps_after_a_black_run(black_vhost: Any, short_tmp: Path, spark) -> None:  # type: ignore[no-untyped-def]
    from bridge.black.job import BlackRun  # Spark and the whole job: only this test

    inv = init_keys(short_tmp / "keys", red_names=("red",), bridge_id="resend-black")
    cfg_path = write_config(
        short_tmp,
        black_vhost.amqp_url,
        black_vhost.management_url,
        inv.black_fpr,
        next(iter(inv.red_fprs.values())),
    )
    cfg = load_config(cfg_path, environ={})
    conn = pika.BlockingConnection(pika.URLParameters(black_vhost.amqp_url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare("ops.events", "fanout", durable=True)
    run = BlackRun(cfg)
    run.mirror.sync()  # the stream exists before anything is published
    for i in range(N):
        ch.basic_publish("ops.events", "", f"event-{i}".encode())
    conn.close()
    deadline = time.monotonic() + 60
    summary = run.run(spark, "available-now", timeout=240)
    while summary.messages < N and time.monotonic() < deadline:  # the stream may lag a little
        summary.messages += BlackRun(cfg).run(spark, "available-now", timeout=120).messages
    assert summary.messages == N and summary.lost == 0

    outbox, archive = Path(cfg.black.outbox), Path(cfg.black.archive) / CHANNEL
    archived = {bundle_seq(n): archive / n for n in files(archive)}
    top = max(archived)
    assert top >= 4 and sorted(archived) == list(range(1, top + 1)), sorted(archived)
    shipped = sorted(p.name for p in outbox.glob("*.dbundle"))
    assert shipped == sorted(p.name for p in archived.values()), "archive != what was shipped"

    # the vendor's mover takes everything (bundles and heartbeats)
    for p in outbox.iterdir():
        p.unlink()
    assert files(outbox) == []

    # ---- resend 2..3: exactly those two, byte-identical to the archive
    r = diode("resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "2", "--to", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"resent": [archived[2].name, archived[3].name], "missing": []}
    assert files(outbox) == [archived[2].name, archived[3].name], "hidden temps or extra files"
    assert cfg.black.staging_dir is not None
    assert files(cfg.black.staging_dir) == [".drop.lock"], "no temp left in staging"
    for seq in (2, 3):
        assert (outbox / archived[seq].name).read_bytes() == archived[seq].read_bytes()
        assert not (outbox / archived[seq].name).samefile(archived[seq]), (
            "the re-dropped file must be a copy: a mover deleting or rewriting it must never "
            "touch the archive"
        )

    # ---- resend 1..99: everything archived is re-dropped, the rest reported missing, exit 1
    r = diode(
        "resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "1", "--to", "99"
    )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    out = json.loads(r.stdout)
    assert out["missing"] == [[top + 1, 99]]  # seq ranges, inclusive
    assert out["resent"] == [archived[s].name for s in range(1, top + 1)]
    assert f"warning: {99 - top} bundle(s) not in the archive (pruned?): {top + 1}-99" in r.stderr
    assert files(outbox) == sorted(p.name for p in archived.values())
    for p in archived.values():
        assert (outbox / p.name).read_bytes() == p.read_bytes()

    # ---- an unknown channel: exit 2, a clear message naming it and the configured ones
    r = diode("resend", "--config", str(cfg_path), "--channel", "nope", "--from", "1", "--to", "2")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "unknown channel 'nope'" in r.stderr and CHANNEL in r.stderr
    assert r.stdout == ""
    assert "Traceback" not in r.stderr

    # ---- an empty range is refused (not a silent no-op)
    r = diode("resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "3", "--to", "2")
    assert r.returncode != 0 and "empty" in r.stderr, (r.returncode, r.stderr)

    # ---- status and gaps
    r = diode("status", "--config", str(cfg_path), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["bridge_id"] == "resend-black"
    c = st["channels"][CHANNEL]
    assert c["last_bundle_seq"] == top and c["last_seq"] == N - 1
    assert c["lost"] == {} and c["pending"] is False
    assert c["outbox_bundles"] == top
    r = diode("gaps", "--config", str(cfg_path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {CHANNEL: {"lost": {}, "inexact": {}, "ranges": []}}

    # ---- pruning the real archive: bundles 1..2 aged past the retention go, the rest stay
    now = time.time()
    for seq in (1, 2):
        os.utime(archived[seq], (now - 8 * DAY, now - 8 * DAY))
    os.utime(archived[3], (now - 6 * DAY, now - 6 * DAY))  # inside the 7-day retention
    ob = Outbox(outbox, Path(cfg.black.archive), retention_days=cfg.black.archive_retention_days)
    assert ob.prune_archive() == 2
    assert sorted(ob.archived(CHANNEL)) == list(range(3, top + 1))
    r = diode("resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "1", "--to", "3")
    assert r.returncode == 1 and json.loads(r.stdout)["missing"] == [[1, 2]], r.stdout


def test_prune_archive_removes_old_keeps_recent(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=2)
    now = time.time()
    ages = {1: 30 * DAY, 2: 2 * DAY + 60, 3: 2 * DAY - 60, 4: 0.0}  # seconds old
    paths = {}
    for ch in ("a", "b"):
        d = tmp_path / "archive" / ch
        d.mkdir(parents=True)
        for seq, age in ages.items():
            p = d / f"{ch}.{seq:012d}.{seq:032x}.dbundle"
            p.write_bytes(b"x" * seq)
            os.utime(p, (now - age, now - age))
            paths[ch, seq] = p
    hidden = tmp_path / "archive" / "a" / ".keep"
    hidden.write_bytes(b"")
    os.utime(hidden, (now - 90 * DAY, now - 90 * DAY))

    assert ob.prune_archive(now=now) == 4  # seqs 1 and 2 of both channels
    for (_ch, seq), p in paths.items():
        assert p.exists() == (seq >= 3), p.name
    assert hidden.exists(), "hidden files (temps in flight, dot files) are not the pruner's"
    assert sorted(ob.archived("a")) == [3, 4]
    assert ob.prune_archive(now=now) == 0  # idempotent
    # a later clock: everything is past the retention
    assert ob.prune_archive(now=now + 3 * DAY) == 4
    assert ob.archived("a") == {} and ob.archived("b") == {}


def test_a_folder_black_may_not_change_neither_stops_the_prune_nor_the_sweep(
    tmp_path: Path,
) -> None:
    """The archive's prune stopped at the first folder it could not change (a retired
    channel's, restored immutable or under another owner), leaving every channel after it
    unpruned for good; the start's sweep of crash temps raised there and failed every run.
    The others are pruned (the prune then names that folder) and swept; a folder that is no
    channel's (lost+found on a mount) is not black's to touch."""
    from tests.unit.test_black_dirs import refused_dir

    ob = Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)
    old = time.time() - 30 * DAY
    bundles = {}
    for ch in ("a-retired", "b", "lost+found"):
        d = tmp_path / "archive" / ch
        d.mkdir(parents=True)
        p = bundles[ch] = d / f"{ch}.000000000001.{1:032x}.dbundle"
        p.write_bytes(b"x")
        os.utime(p, (old, old))
        (d / f".{ch}.000000000002.{2:032x}.dbundle.0123456789ab.tmp").write_bytes(b"partial")
    staged = ob.staging / f".b.000000000003.{3:032x}.dbundle.0123456789ab.tmp"
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(b"partial")
    with refused_dir(tmp_path / "archive" / "a-retired"):
        with pytest.raises(OSError, match=r"archive pruned except .*a-retired"):
            ob.prune_archive()
        assert bundles["a-retired"].exists()  # the case: refused there
        assert not bundles["b"].exists(), "the channels after it are pruned"
        assert bundles["lost+found"].exists(), "not a channel's folder: not black's"
        assert ob.sweep_stale_temps() == 2  # staging's and b's; a-retired's is logged
    assert not staged.exists() and not list((tmp_path / "archive" / "b").glob(".*.tmp"))
    assert list((tmp_path / "archive" / "lost+found").glob(".*.tmp"))


def _pending_journal(store: Any, channel: str, seq: int) -> str:
    """Journal bundle ``seq`` of ``channel`` as pending (archived, not yet committed: the
    window a crash can leave); returns its file name."""
    from bridge.black.state import ChannelState
    from bridge.protocol.bundle import manifest_for
    from bridge.protocol.manifest import new_bundle_id
    from bridge.protocol.naming import bundle_name
    from bridge.protocol.schema import row_schema

    bid = new_bundle_id()
    m = manifest_for(
        row_schema().empty_table(),
        channel=channel,
        bundle_seq=seq,
        bundle_id=bid,
        created_at="2020-01-01T00:00:00.000000Z",
        bridge_id="prune-test",
        prev_sha256="0" * 64,
    )
    pending = {"manifest": m.to_json().decode(), "sha256": "1" * 64, "plaintext_bytes": 0}
    store.save(ChannelState(channel=channel, last_bundle_seq=seq - 1, pending=pending))
    return bundle_name(channel, seq, bid)


def test_prune_never_deletes_a_bundle_a_journal_holds_as_pending(tmp_path: Path) -> None:
    """Crash recovery re-drops a pending bundle from its archived copy and re-seals it when
    the copy is gone, under a seq red may hold: the pruner must leave it, however old."""
    from bridge.black.heartbeat import prune_unless_pending
    from bridge.black.state import ChannelState, StateStore

    ob = Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)
    store = StateStore(tmp_path / "state")
    now = time.time()
    pending = _pending_journal(store, "a", 2)
    old = {
        "a": [f"a.{1:012d}.{1:032x}.dbundle", pending],
        "b": [f"b.{1:012d}.{1:032x}.dbundle"],
    }
    for ch, names in old.items():
        (tmp_path / "archive" / ch).mkdir(parents=True)
        for name in names:
            p = tmp_path / "archive" / ch / name
            p.write_bytes(b"x")
            os.utime(p, (now - 30 * DAY, now - 30 * DAY))
    # the outbox on its own keeps what it is told to keep
    assert ob.prune_archive(now=now, keep={pending, old["b"][0]}) == 1
    assert [p.name for p in (tmp_path / "archive" / "a").iterdir()] == [pending]
    # the black job's pruning reads the pending bundles from the journals
    assert prune_unless_pending(ob, store, now=now) == 1  # b's bundle 1 only
    assert (tmp_path / "archive" / "a" / pending).exists()
    # once committed (pending cleared), the bundle ages out like any other
    store.save(ChannelState(channel="a", last_bundle_seq=2))
    assert prune_unless_pending(ob, store, now=now) == 1
    assert ob.archived("a") == {}


def test_a_slow_archive_prune_never_delays_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning a very large archive takes long: heartbeats keep their period meanwhile, and
    the hourly prune leaves the pending bundle alone."""
    import threading

    from bridge.black import heartbeat as hb
    from bridge.black.state import StateStore

    started, release = threading.Event(), threading.Event()
    kept: list[set[str]] = []

    class SlowOutbox(Outbox):
        def prune_archive(self, *, now: float | None = None, keep: Any = ()) -> int:
            kept.append(set(keep))
            started.set()
            release.wait(10)
            return 0

    class Writer:  # counts beats; the journal is the pruner's source of pending bundles
        def __init__(self) -> None:
            self.store = StateStore(tmp_path / "state")
            self.beats: list[float] = []

        def beat_all(self) -> None:
            self.beats.append(time.monotonic())

    writer = Writer()
    pending = _pending_journal(writer.store, "a", 7)
    ob = SlowOutbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)
    monkeypatch.setattr(hb, "PRUNE_EVERY_SECONDS", 0.0)
    loop = hb.HeartbeatLoop(writer, 0.02, ob)  # type: ignore[arg-type]
    loop.start()
    try:
        assert started.wait(5), "the hourly prune never ran"
        before = len(writer.beats)
        time.sleep(0.5)  # the prune is stuck all this time
        during = len(writer.beats) - before
    finally:
        release.set()
        loop.stop()
    assert during >= 5, f"only {during} heartbeat(s) in 0.5 s at a 0.02 s period during a prune"
    assert kept and all(pending in k for k in kept), kept


# ---------------------------------------------------------------------- coordination (no Spark)
HOLD = """
import sys, time
from pathlib import Path
from bridge.fsutil import exclusive_lock
with exclusive_lock(Path(sys.argv[1]), what="holder"):
    print("held", flush=True)
    time.sleep(120)
"""


def _plain_config(work: Path) -> Path:
    p = work / "diode.toml"
    p.write_text(f'[[channels]]\nname = "{CHANNEL}"\nencrypt = false\n')
    return p


def _archive(work: Path, seqs: Iterable[int]) -> list[str]:
    """Archived bundles (their bytes do not matter to resend: it copies them unchanged)."""
    adir = work / "black" / "archive" / CHANNEL
    adir.mkdir(parents=True)
    names = []
    for seq in seqs:
        name = f"{CHANNEL}.{seq:012d}.{seq:032x}.dbundle"
        (adir / name).write_bytes(b"sealed %d" % seq)
        names.append(name)
    return names


def _hold(lock: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_resend_runs_beside_a_running_job(tmp_path: Path) -> None:
    """A job holds the run lock for its whole run: resend does not need it."""
    cfg_path = _plain_config(tmp_path)
    names = _archive(tmp_path, range(1, 4))
    job = _hold(tmp_path / "black" / "state" / "black.lock")
    try:
        r = diode("resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "1",
                  "--to", "3")  # fmt: skip
    finally:
        job.kill()
        job.wait()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"resent": names, "missing": []}
    assert files(tmp_path / "black" / "outbox") == names
    assert files(tmp_path / "black" / ".outbox.staging") == [".drop.lock"]


def test_resend_waits_for_a_sweep_and_says_so_when_it_lasts(tmp_path: Path) -> None:
    cfg_path = _plain_config(tmp_path)
    _archive(tmp_path, range(1, 3))
    lock = tmp_path / "black" / ".outbox.staging" / ".drop.lock"
    sweep = _hold(lock)  # a starting job sweeping the staging dir (stuck, for the test)
    try:
        r = diode("resend", "--config", str(cfg_path), "--channel", CHANNEL, "--from", "1",
                  "--to", "2", "--wait", "0.2")  # fmt: skip
    finally:
        sweep.kill()
        sweep.wait()
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert "re-drop of" in r.stderr and "waited 0.2s for a shared lock" in r.stderr
    assert "stopped at bundle seq 1" in r.stderr
    assert str(lock) in r.stderr and "sweeps stale temp files at start-up" in r.stderr
    assert files(tmp_path / "black" / "outbox") == []


RESEND_LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB: a per-seq walk dies here
from bridge.cli import main
sys.argv = ["diode", *sys.argv[1:]]
main()
"""


def test_resend_of_the_whole_seq_space_visits_only_the_archived_bundles(tmp_path: Path) -> None:
    """``--to`` may be 10^12 - 1: the work, the memory and the report follow what the archive
    holds, not the range; missing bundles are reported as seq ranges (JSON and warning)."""
    from bridge.protocol.naming import MAX_SEQ

    cfg_path = _plain_config(tmp_path)
    names = _archive(tmp_path, [3, 5, 6, 10])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DIODE_CONFIG", None)
    try:
        r = subprocess.run(
            [sys.executable, "-c", RESEND_LIMITED, "resend", "--config", str(cfg_path),
             "--channel", CHANNEL, "--from", "1", "--to", str(MAX_SEQ)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("resend 1..MAX_SEQ over 4 archived bundles still ran after 60 s")
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert json.loads(r.stdout) == {
        "resent": names,
        "missing": [[1, 2], [4, 4], [7, 9], [11, MAX_SEQ]],
    }
    assert (
        f"warning: {MAX_SEQ - 4} bundle(s) not in the archive (pruned?): 1-2, 4, 7-9, 11-{MAX_SEQ}"
        in r.stderr
    ), r.stderr
    assert files(tmp_path / "black" / "outbox") == names


def test_resend_reports_missing_bundles_as_merged_ranges(tmp_path: Path) -> None:
    """Gaps in the archive, the range's ends, and a bundle pruned during the resend all fold
    into ascending, non-overlapping ranges; a long report is cut after 20 ranges."""
    black = tmp_path / "black"
    ob = Outbox(black / "outbox", black / "archive", retention_days=1)
    names = _archive(tmp_path, [2, 3, 4, 8])
    adir = black / "archive" / CHANNEL
    (adir / f"other.{5:012d}.{5:032x}.dbundle").write_bytes(b"another channel's")
    (adir / f".{names[2]}.0123456789ab.tmp").write_bytes(b"a temp")
    real = ob.archived

    def archived_then_pruned(channel: str) -> dict[int, Path]:
        have = real(channel)
        have[4].unlink()  # pruned right after resend listed the archive
        return have

    ob.archived = archived_then_pruned  # type: ignore[method-assign]
    rep = ob.resend(CHANNEL, 1, 9)
    assert rep.resent == [names[0], names[1], names[3]]
    assert rep.missing == [(1, 1), (4, 7), (9, 9)]
    ob.archived = real  # type: ignore[method-assign]
    assert ob.resend(CHANNEL, 3, 3).missing == []
    assert ob.resend(CHANNEL, 5, 7).missing == [(5, 7)] and ob.resend(CHANNEL, 5, 7).resent == []
    from bridge.cli import _seq_ranges_text

    assert _seq_ranges_text([(1, 1), (4, 7)]) == "1, 4-7"
    many = [(s, s) for s in range(1, 50, 2)]
    assert _seq_ranges_text(many) == ", ".join(str(s) for s in range(1, 40, 2)) + (
        " and 5 more range(s)"
    )


def test_one_bundle_black_may_not_delete_does_not_keep_its_folder_unpruned(tmp_path: Path) -> None:
    """An EPERM on one old bundle (immutable) ended its folder's prune, at the same file every
    time: the channel's archive was never pruned, and the message blamed the folder."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root (CAP_LINUX_IMMUTABLE)")
    ob = Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1)
    d = tmp_path / "archive" / "c1"
    d.mkdir(parents=True)
    old = time.time() - 30 * DAY
    paths = []
    for seq in range(1, 6):
        p = d / f"c1.{seq:012d}.{seq:032x}.dbundle"
        p.write_bytes(b"x")
        os.utime(p, (old, old))
        paths.append(p)
    stuck = paths[0]
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        with pytest.raises(OSError, match=f"archive pruned except {stuck}: ") as e:
            ob.prune_archive()
        assert "chattr -i -a" in str(e.value)
        assert [p.exists() for p in paths] == [True, False, False, False, False]
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert ob.prune_archive() == 1 and not stuck.exists()
