"""Integration: the outbox is safe with any vendor mover (real gpg, real files, real threads).

A greedy mover (tests/mover.py: inotify + polling, takes every file the moment it appears,
dot-files included) runs on the outbox while bundles and heartbeats are delivered and
``diode resend`` re-drops from the archive: every file it took must be whole and valid. Fault
tests then hit each window deterministically — the file taken between the rename and the
fsync of the outbox, an archived bundle pruned between listing and copy, a failed staging
write — and assert that the window was really hit. The drop lock makes a start-up sweep wait
for a re-drop and for an ``archive_mode = "link"`` probe (a real sweeping process), and a
re-drop for a sweep; a probe a kill left in the archive root is swept; the staging dir must
share the outbox's file system.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.black.heartbeat import HeartbeatWriter
from bridge.black.report import channel_status
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory
from bridge.diode import file_drop
from bridge.diode.file_drop import DROP_LOCK, OUTBOX_DIR_MODE, Outbox, default_staging
from bridge.errors import ConfigError, StateError, TransportError
from bridge.fsutil import DIR_MODE, FILE_MODE, exclusive_lock, shared_lock
from bridge.protocol.bundle import manifest_for, pack_bundle, sha256_hex, unpack_bundle
from bridge.protocol.manifest import format_utc, new_bundle_id
from bridge.protocol.naming import bundle_name, heartbeat_name, parse_heartbeat_name
from bridge.protocol.schema import row_schema
from tests.mover import GreedyMover, greedy_mover  # noqa: F401 - the fixture
from tests.support import key_inventory

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def keys() -> Iterator[KeyInventory]:
    """One black signing key and one red key for the module (short path: gpg-agent sockets)."""
    with key_inventory("mover-test", prefix="dm") as inv:
        yield inv


@dataclass
class Rig:
    cfg: Config
    cfg_path: Path
    keys: KeyInventory
    outbox: Outbox
    gpg: Gpg
    heartbeats: HeartbeatWriter
    next_seq: dict[str, int] = field(default_factory=dict)
    last_sha: dict[str, str] = field(default_factory=dict)

    def bundle(self, channel: str) -> str:
        """Seal the channel's next (empty) bundle into the staging dir and deliver it."""
        seq = self.next_seq[channel] = self.next_seq.get(channel, 0) + 1
        table = row_schema().empty_table()
        bid = new_bundle_id()
        m = manifest_for(
            table,
            channel=channel,
            bundle_seq=seq,
            bundle_id=bid,
            created_at=format_utc(dt.datetime.now(dt.UTC)),
            bridge_id="mover-test",
            prev_sha256=self.last_sha.get(channel),
        )
        name = bundle_name(channel, seq, bid)
        ch = self.cfg.channel(channel)
        sealed = self.outbox.temp_for(name)
        plain = pack_bundle(table, m)
        self.last_sha[channel] = sha256_hex(plain)
        self.gpg.seal(
            plain,
            sealed,
            signer=self.keys.black_fpr,
            recipients=ch.recipients,
            encrypt=ch.encrypt,
        )
        self.outbox.deliver(name, sealed, channel=channel, synced=True)  # gpg fsynced it
        return name

    def red(self) -> Gpg:
        return Gpg(self.keys.red_home)


def make_rig(
    work: Path,
    keys: KeyInventory,
    *,
    udp_outbox: str | None = None,
    archive_mode: str = "copy",
    archive: str = "black/archive",
) -> Rig:
    """Channels "ops" (encrypted) and "plain"; with ``udp_outbox``, "plain" is a UDP channel
    whose files go there."""
    red = next(iter(keys.red_fprs.values()))
    plain: dict[str, object] = {"name": "plain", "encrypt": False}
    data: dict[str, object] = {
        "link": {"bridge_id": "mover-test", "black_signers": [keys.black_fpr]},
        "channels": [{"name": "ops", "recipients": [red]}, plain],
        "black": {
            "gnupg_home": str(keys.black_home),
            "signing_key": keys.black_fpr,
            "outbox": "black/outbox",
            "archive": archive,
            "archive_mode": archive_mode,
            "state_dir": "black/state",
        },
    }
    if udp_outbox is not None:
        plain["transport"] = "udp"
        data["black"]["udp_outbox"] = udp_outbox  # type: ignore[index]
        data["udp"] = {"key_file": "udp.key"}
    cfg_path = work / "diode.toml"
    cfg_path.write_text(_toml(data))
    cfg = config_from_dict(data, base=work, environ={})
    outbox = Outbox.from_config(cfg)
    gpg = Gpg(keys.black_home)
    store = StateStore(Path(cfg.black.state_dir))
    hb = HeartbeatWriter(cfg, store=store, gpg=gpg, outbox=outbox)
    return Rig(cfg, cfg_path, keys, outbox, gpg, hb)


def _toml(data: dict[str, object]) -> str:
    """Just enough TOML for make_rig's config (strings, bools, lists of strings, tables)."""
    lines: list[str] = []

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v)

    for section in ("link", "black", "udp"):
        if section not in data:
            continue
        lines.append(f"[{section}]")
        for k, v in data[section].items():  # type: ignore[attr-defined]
            lines.append(f"{k} = {value(v)}")
    for ch in data["channels"]:  # type: ignore[attr-defined]
        lines.append("[[channels]]")
        lines += [f"{k} = {value(v)}" for k, v in ch.items()]
    return "\n".join(lines) + "\n"


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


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.fixture
def rig(short_tmp: Path, keys: KeyInventory) -> Rig:
    return make_rig(short_tmp, keys)


# ---------------------------------------------------------------------- the greedy mover


@pytest.mark.gpg
def test_udp_channels_files_go_to_black_udp_outbox_never_past_the_mover(
    short_tmp: Path, keys: KeyInventory
) -> None:
    rig = make_rig(short_tmp, keys, udp_outbox="black/udp-outbox")
    outbox, udp = Path(rig.cfg.black.outbox), Path(rig.cfg.black.udp_outbox or "")
    assert udp == short_tmp / "black" / "udp-outbox" and rig.cfg.udp_outbox() == udp
    ops = [rig.bundle("ops"), rig.heartbeats.beat(rig.cfg.channel("ops"))]
    plain = [rig.bundle("plain"), rig.heartbeats.beat(rig.cfg.channel("plain"))]
    assert listing(outbox) == sorted(ops)  # all a mover of the outbox can ever take
    assert listing(udp) == sorted(plain)
    for p in plain:
        (udp / p).unlink()  # the UDP sender took them
    r = diode("resend", "--config", str(rig.cfg_path), "--channel", "plain", "--from", "1",
              "--to", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert listing(udp) == [plain[0]] and listing(outbox) == sorted(ops)
    st = channel_status(rig.cfg)
    assert (st["outbox_files"], st["udp_outbox_files"]) == (2, 1)
    assert st["channels"]["plain"]["outbox_bundles"] == 1


def test_udp_outbox_that_overlaps_or_serves_no_udp_channel_is_refused(tmp_path: Path) -> None:
    base: dict[str, object] = {
        "channels": [{"name": "u", "encrypt": False, "transport": "udp"}],
        "udp": {"key_file": "udp.key"},
    }
    for where in ("black/outbox", "black/outbox/udp", "black/archive"):
        with pytest.raises(ConfigError, match=r"black.udp_outbox .* overlap"):
            config_from_dict({**base, "black": {"udp_outbox": where}}, base=tmp_path, environ={})
    only_file = {"channels": [{"name": "f", "encrypt": False}], "black": {"udp_outbox": "u"}}
    with pytest.raises(ConfigError, match='no channel has transport = "udp": remove it'):
        config_from_dict(only_file, base=tmp_path, environ={})


@pytest.mark.gpg
def test_greedy_mover_only_ever_sees_whole_bundles_and_heartbeats(
    rig: Rig,
    greedy_mover: Callable[..., GreedyMover],  # noqa: F811 - the fixture from tests.mover
) -> None:
    mover = greedy_mover(rig.cfg.black.outbox)
    delivered: list[str] = []
    beats: list[str] = []
    for i in range(40):
        delivered.append(rig.bundle("ops" if i % 3 else "plain"))
        if i % 5 == 0:
            beats.append(rig.heartbeats.beat(rig.cfg.channel("ops")))
            beats.append(rig.heartbeats.beat(rig.cfg.channel("plain")))
    rep = rig.outbox.resend("ops", 1, 10)
    assert rep.missing == [] and len(rep.resent) == 10
    mover.wait_for(len(delivered) + len(beats) + 10)
    mover.stop()

    report = mover.validate(rig.red(), [rig.keys.black_fpr])
    assert sorted(report.bundles) == sorted(delivered + rep.resent)
    assert sorted(report.heartbeats) == sorted(beats)
    assert listing(rig.cfg.black.outbox) == [], "the mover took everything"
    assert listing(rig.outbox.staging) == [DROP_LOCK], "no temp file left in staging"
    for ch in ("ops", "plain"):  # archived copies are whole, private, kept
        archived = rig.outbox.archived(ch)
        assert sorted(p.name for p in archived.values()) == sorted(
            n for n in delivered if n.startswith(f"{ch}.")
        )
        assert all(stat.S_IMODE(p.stat().st_mode) == FILE_MODE for p in archived.values())
    for d in (rig.cfg.black.archive, rig.outbox.staging):
        assert stat.S_IMODE(Path(d).stat().st_mode) == DIR_MODE, d
    # the outbox is shared with the mover's group, which must be able to take files
    assert stat.S_IMODE(Path(rig.cfg.black.outbox).stat().st_mode) == OUTBOX_DIR_MODE


@pytest.mark.gpg
def test_deleting_mover_beside_a_real_diode_resend(
    rig: Rig,
    greedy_mover: Callable[..., GreedyMover],  # noqa: F811 - the fixture from tests.mover
) -> None:
    """A mover that deletes files (after reading them) while `diode resend` re-drops them."""
    delivered = [rig.bundle("ops") for _ in range(12)]
    mover = greedy_mover(rig.cfg.black.outbox, delete=True)
    mover.wait_for(12)
    done = threading.Event()
    more: list[str] = []

    def keep_delivering() -> None:  # the job keeps going during the resend
        while not done.is_set() and len(more) < 20:
            more.append(rig.bundle("plain"))

    t = threading.Thread(target=keep_delivering)
    t.start()
    try:
        r = diode(
            "resend", "--config", str(rig.cfg_path), "--channel", "ops", "--from", "1", "--to", "12"
        )
    finally:
        done.set()
        t.join()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"resent": delivered, "missing": []}
    assert "Traceback" not in r.stderr
    mover.wait_for(12 + 12 + len(more))
    mover.stop()
    report = mover.validate(rig.red(), [rig.keys.black_fpr])
    assert sorted(report.bundles) == sorted(delivered * 2 + more)
    assert listing(rig.cfg.black.outbox) == []
    assert listing(rig.outbox.staging) == [DROP_LOCK]


@pytest.mark.gpg
@pytest.mark.parametrize("delete", [False, True], ids=["moving", "deleting"])
def test_greedy_mover_catches_what_an_unsafe_writer_exposes(
    rig: Rig,
    greedy_mover: Callable[..., GreedyMover],  # noqa: F811 - the fixture from tests.mover
    delete: bool,
) -> None:
    """The check has teeth: a bundle written in place and a hidden temp are both caught."""
    name = rig.bundle("ops")  # a whole one, taken from the archive copy below
    whole = (Path(rig.cfg.black.archive) / "ops" / name).read_bytes()
    (Path(rig.cfg.black.outbox) / name).unlink()
    mover = greedy_mover(rig.cfg.black.outbox, delete=delete)
    with open(Path(rig.cfg.black.outbox) / name, "wb") as f:  # the unsafe way: in place
        f.write(whole[: len(whole) // 2])
        f.flush()
        mover.wait_for(1)  # the mover took the half-written file
        f.write(whole[len(whole) // 2 :])
    temp = Path(rig.cfg.black.outbox) / f".{name}.0123456789ab.tmp"
    temp.write_bytes(whole)
    mover.wait_for(2)
    mover.stop()
    with pytest.raises(AssertionError) as e:
        mover.validate(rig.red(), [rig.keys.black_fpr], expect_mode=None)
    msg = str(e.value)
    assert "took 2 bad file(s)" in msg
    assert f".{name}.0123456789ab.tmp" in msg and "neither a bundle nor a heartbeat" in msg
    partial = "changed after the mover took it" if not delete else "CryptoError"
    assert partial in msg, msg


# ---------------------------------------------------------------------- each window, on purpose


class TakeBeforeFsync:
    """Wraps ``file_drop.fsync_dir``: before the outbox is fsynced, a mover takes (or deletes)
    every file in it — the window between black's rename and its fsync. Records what it took."""

    def __init__(self, outbox: Path, dst: Path | None = None) -> None:
        self.outbox, self.dst = Path(outbox), dst
        self.taken: list[str] = []
        self.real = file_drop.fsync_dir

    def __call__(self, path: Path) -> None:
        if Path(path) == self.outbox:
            for name in os.listdir(self.outbox):
                if self.dst is None:
                    os.unlink(self.outbox / name)
                else:
                    os.rename(self.outbox / name, self.dst / f"{len(self.taken)}.{name}")
                self.taken.append(name)
        self.real(path)


@pytest.mark.gpg
def test_file_taken_between_rename_and_fsync_is_a_success(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    race = TakeBeforeFsync(rig.cfg.black.outbox, tmp_path)
    monkeypatch.setattr(file_drop, "fsync_dir", race)

    name = rig.bundle("ops")  # deliver
    assert race.taken == [name], "the mover did take the bundle inside the window"
    assert rig.outbox.has_archived("ops", name)

    size = rig.outbox.redrop("ops", name)  # crash recovery's re-drop: no stat after the rename
    assert race.taken == [name, name]
    assert size == (tmp_path / f"1.{name}").stat().st_size

    rep = rig.outbox.resend("ops", 1, 1)
    assert rep.resent == [name] and race.taken == [name] * 3

    hb = rig.heartbeats.beat(rig.cfg.channel("ops"))  # heartbeat: the seq is not given back
    assert race.taken[-1] == hb
    first = parse_heartbeat_name(hb).heartbeat_seq  # a new install: from the time
    assert rig.heartbeats.beat(rig.cfg.channel("ops")) == heartbeat_name("ops", first + 1)
    assert rig.heartbeats.last_seq("ops") == first + 1
    assert listing(rig.cfg.black.outbox) == [] and listing(rig.outbox.staging) == [DROP_LOCK]
    for i, n in enumerate(race.taken):  # every file taken in the window was whole
        assert (tmp_path / f"{i}.{n}").stat().st_size > 0


@pytest.mark.gpg
def test_deleting_mover_in_the_window_never_fails_a_resend(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [rig.bundle("plain") for _ in range(3)]
    for n in names:  # shipped long ago
        (Path(rig.cfg.black.outbox) / n).unlink()
    race = TakeBeforeFsync(rig.cfg.black.outbox)  # deletes
    monkeypatch.setattr(file_drop, "fsync_dir", race)
    rep = rig.outbox.resend("plain", 1, 3)
    assert rep.resent == names and rep.missing == []
    assert race.taken == names


@pytest.mark.gpg
def test_archive_mode_link_archives_the_outbox_file_itself_and_survives_the_mover(
    short_tmp: Path, keys: KeyInventory
) -> None:
    rig = make_rig(short_tmp, keys, archive_mode="link")
    outbox = Path(rig.cfg.black.outbox)
    names = [rig.bundle("ops") for _ in range(3)]
    archived = rig.outbox.archived("ops")
    for seq, name in enumerate(names, 1):  # one inode, two names: written and fsynced once
        o, a = (outbox / name).stat(), archived[seq].stat()
        assert (o.st_ino, o.st_dev) == (a.st_ino, a.st_dev) and a.st_nlink == 2
        assert stat.S_IMODE(a.st_mode) == FILE_MODE
    sealed = {n: (outbox / n).read_bytes() for n in names}
    for n in names:  # the mover takes every file (reads it, then deletes it)
        (outbox / n).unlink()
    assert all(p.stat().st_nlink == 1 for p in archived.values())
    rep = rig.outbox.resend("ops", 1, 3)
    assert rep.resent == names and rep.missing == []
    for seq, n in enumerate(names, 1):  # a re-drop is a copy: the archive keeps its own name
        assert (outbox / n).read_bytes() == sealed[n] == archived[seq].read_bytes()
        assert (outbox / n).stat().st_ino != archived[seq].stat().st_ino
        plain, _ = rig.red().open_bytes(
            archived[seq].read_bytes(), pinned_signers=[rig.keys.black_fpr]
        )
        assert unpack_bundle(plain)[0].bundle_seq == seq
    assert listing(rig.outbox.staging) == [DROP_LOCK]
    # the default keeps a copy of its own
    (short_tmp / "copy").mkdir()
    copy = make_rig(short_tmp / "copy", keys)
    name = copy.bundle("ops")
    assert (Path(copy.cfg.black.outbox) / name).stat().st_nlink == 1
    assert copy.outbox.archived("ops")[1].stat().st_nlink == 1


def test_archive_mode_link_across_file_systems_is_refused_at_start(
    short_tmp: Path, keys: KeyInventory
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(short_tmp).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    other = Path(tempfile.mkdtemp(prefix="diode-archive-", dir=shm))
    try:
        with pytest.raises(ConfigError, match=r'archive_mode = "link" needs hard links .*'
                           r'refused one \(Invalid cross-device link\).*'
                           r'set black.archive_mode = "copy"'):  # fmt: skip
            make_rig(short_tmp, keys, archive_mode="link", archive=str(other))
        assert not list(other.rglob("*probe*"))  # the probe is gone
        staging = default_staging(short_tmp / "black" / "outbox")
        assert not [p for p in staging.iterdir() if "probe" in p.name]
        make_rig(short_tmp, keys, archive=str(other))  # a copy may cross file systems
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.gpg
def test_bundle_pruned_between_listing_and_copy_is_reported_missing(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [rig.bundle("ops") for _ in range(3)]
    real = rig.outbox.archived
    pruned: list[str] = []

    def archived_then_pruned(channel: str) -> dict[int, Path]:
        have = real(channel)
        have[2].unlink()  # the job's hourly pruning, right after resend listed the archive
        pruned.append(have[2].name)
        return have

    monkeypatch.setattr(rig.outbox, "archived", archived_then_pruned)
    for p in Path(rig.cfg.black.outbox).iterdir():
        p.unlink()
    rep = rig.outbox.resend("ops", 1, 3)
    assert pruned == [names[1]]
    assert rep.resent == [names[0], names[2]] and rep.missing == [(2, 2)]
    assert listing(rig.cfg.black.outbox) == sorted([names[0], names[2]])
    assert listing(rig.outbox.staging) == [DROP_LOCK]
    with pytest.raises(TransportError, match="no longer in the archive"):
        rig.outbox.redrop("ops", names[1])


@pytest.mark.gpg
def test_heartbeat_that_never_reached_the_outbox_gives_its_seq_back(rig: Rig) -> None:
    ops = rig.cfg.channel("ops")
    shutil.rmtree(rig.outbox.staging)  # staging write fails: nothing can reach the outbox
    with pytest.raises(TransportError, match="cannot stage"):
        rig.heartbeats.beat(ops)
    assert rig.heartbeats.last_seq("ops") == 0
    assert listing(rig.cfg.black.outbox) == []
    rig.outbox.staging.mkdir()
    t0 = int(time.time() * 10)
    seq = parse_heartbeat_name(rig.heartbeats.beat(ops)).heartbeat_seq
    assert seq >= t0 and rig.heartbeats.last_seq("ops") == seq


@pytest.mark.gpg
def test_a_lost_heartbeat_seq_file_continues_above_every_earlier_seq(rig: Rig) -> None:
    """heartbeat-<C>.json lost while the journal shows shipped bundles: red has heard seqs
    above 1, and took every new heartbeat from 1 as replayed (the link looked silent). Seqs
    continue from the time in tenths of a second, then count on."""
    import time

    from bridge.black.state import ChannelState
    from bridge.protocol.naming import parse_heartbeat_name as parse_name

    ops = rig.cfg.channel("ops")
    (rig.heartbeats.store.dir / "heartbeat-ops.json").write_text('{"heartbeat_seq": 0}')
    first = parse_name(rig.heartbeats.beat(ops)).heartbeat_seq  # a seq file says 0: then 1
    assert first == 1
    rig.heartbeats.store.save(ChannelState("ops", last_bundle_seq=5, last_seq=49))
    (rig.heartbeats.store.dir / "heartbeat-ops.json").unlink()  # the fault
    t0 = int(time.time() * 10)
    seq = parse_name(rig.heartbeats.beat(ops)).heartbeat_seq
    assert t0 <= seq <= int(time.time() * 10) and seq > 1_000_000_000
    assert parse_name(rig.heartbeats.beat(ops)).heartbeat_seq == seq + 1


@pytest.mark.gpg
def test_delivery_whose_temp_vanished_fails_cleanly(rig: Rig) -> None:
    name = "ops.000000000001." + "a" * 32 + ".dbundle"
    sealed = rig.outbox.temp_for(name)  # never written (or swept): the delivery cannot happen
    with pytest.raises(TransportError, match=r"cannot deliver ops\.000000000001.*'ops'"):
        rig.outbox.deliver(name, sealed, channel="ops")
    assert listing(rig.cfg.black.outbox) == []


# ---------------------------------------------------------------------- the drop lock


def test_sweep_waits_for_a_redrop_then_removes_only_stale_temps(short_tmp: Path) -> None:
    ob = Outbox(short_tmp / "outbox", short_tmp / "archive", retention_days=1, lock_wait=0.05)
    (short_tmp / "archive" / "c").mkdir()
    stale = [
        ob.temp_for("c.000000000001." + "b" * 32 + ".dbundle"),
        short_tmp / "outbox" / ".legacy.dbundle.0123456789ab.tmp",
        short_tmp / "archive" / "c" / ".c.000000000001.x.dbundle.ba9876543210.tmp",
    ]
    keep = [ob.staging / "operator-notes.txt", short_tmp / "archive" / "c" / ".keep"]
    for p in stale + keep:
        p.write_bytes(b"partial")
    with shared_lock(ob.lock_path, what="a resend's re-drop"):
        with pytest.raises(StateError) as e:
            ob.sweep_stale_temps()
    msg = str(e.value)
    assert "sweeping stale temp files" in msg and str(ob.lock_path) in msg
    assert "diode resend" in msg and "waited 0.05s" in msg
    assert all(p.exists() for p in stale), "nothing swept while a re-drop held the lock"
    assert ob.sweep_stale_temps() == 3
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
    assert ob.lock_path.exists()


def test_redrop_waits_for_a_sweep(short_tmp: Path) -> None:
    ob = Outbox(short_tmp / "outbox", short_tmp / "archive", retention_days=1, lock_wait=0.05)
    name = "c.000000000001." + "c" * 32 + ".dbundle"
    (short_tmp / "archive" / "c").mkdir()
    (short_tmp / "archive" / "c" / name).write_bytes(b"sealed bytes")
    with exclusive_lock(ob.lock_path, what="a start-up sweep"):
        with pytest.raises(StateError, match="sweeps stale temp files at start-up"):
            ob.resend("c", 1, 1)
        assert listing(ob.outbox) == [] and listing(ob.staging) == [DROP_LOCK]
        ob.lock_wait = 60.0
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(ob.resend("c", 1, 1)))
        t.start()
        t.join(0.2)
        assert t.is_alive() and listing(ob.outbox) == [], "the re-drop waits for the sweep"
    t.join()
    assert listing(ob.outbox) == [name]
    assert (ob.outbox / name).read_bytes() == b"sealed bytes"


SWEEPER = r"""
import sys
from pathlib import Path
from bridge.diode.file_drop import Outbox

ob = Outbox(Path(sys.argv[1]), Path(sys.argv[2]), retention_days=1, lock_wait=60)
print("sweeping", flush=True)
print("removed", ob.sweep_stale_temps(), flush=True)
"""


def _probes(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith(".archive-link-probe."))


def test_a_start_up_sweep_waits_for_the_archive_link_probe(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Outbox in link mode (``diode resend``'s, beside a starting job) probes under the
    drop lock: a sweep in another process, started between the probe's creation and its
    link, waits instead of removing it (which failed the check with a bogus ConfigError)."""
    outbox, archive = short_tmp / "outbox", short_tmp / "archive"
    Outbox(outbox, archive, retention_days=1)  # the folders, as a running job made them
    staging = default_staging(outbox)
    real_link = os.link
    seen: dict[str, object] = {}

    def link_after_a_sweep_started(src: str | Path, dst: str | Path) -> None:
        seen["probe"] = _probes(staging)
        p = subprocess.Popen(
            [sys.executable, "-c", SWEEPER, str(outbox), str(archive)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        seen["sweeper"] = p
        assert p.stdout is not None and p.stdout.readline().strip() == "sweeping"
        try:
            p.wait(2.0)  # a sweep takes milliseconds: this one is done, or it waits for us
        except subprocess.TimeoutExpired:
            pass
        seen["waiting"] = p.poll() is None
        real_link(src, dst)

    monkeypatch.setattr(file_drop.os, "link", link_after_a_sweep_started)
    ob = Outbox(outbox, archive, retention_days=1, archive_link=True)
    monkeypatch.undo()
    assert ob.archive_link and len(seen["probe"]) == 1  # type: ignore[arg-type]
    assert seen["waiting"], "the sweep must wait for the probe's shared drop lock"
    p = seen["sweeper"]
    assert isinstance(p, subprocess.Popen)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out.split() == ["removed", "0"]  # the probe cleaned up itself
    assert _probes(staging) == [] and _probes(archive) == []


def test_an_archive_link_probe_removed_under_it_is_probed_again(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something that ignores the drop lock removed the probe before its link: ENOENT of our
    own probe is no verdict on the file system, so the check probes again; it gives up with a
    StateError (not a ConfigError about hard links) if that keeps happening."""
    outbox, archive = short_tmp / "outbox", short_tmp / "archive"
    real_link = os.link
    calls: list[str] = []

    def link(src: str | Path, dst: str | Path) -> None:
        calls.append(Path(src).name)
        if len(calls) == 1 or always:
            os.unlink(src)  # removed between its creation and the link
        real_link(src, dst)

    always = False
    monkeypatch.setattr(file_drop.os, "link", link)
    ob = Outbox(outbox, archive, retention_days=1, archive_link=True)
    assert ob.archive_link and len(calls) == 2 and calls[0] != calls[1]
    calls.clear()
    always = True
    with pytest.raises(StateError, match="archive link probe .* vanished 3 times"):
        Outbox(outbox, archive, retention_days=1, archive_link=True)
    monkeypatch.undo()
    assert len(calls) == 3
    assert _probes(ob.staging) == [] and _probes(archive) == []


KILLED_PROBE = r"""
import os, signal, sys
from pathlib import Path
from bridge.diode.file_drop import Outbox

real_link = os.link

def link(src, dst):
    real_link(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)  # between the link and the probe's clean-up

os.link = link
Outbox(Path(sys.argv[1]), Path(sys.argv[2]), retention_days=1, archive_link=True)
"""


def test_the_sweep_removes_archive_link_probes_a_kill_left_in_the_archive_root(
    short_tmp: Path,
) -> None:
    outbox, archive = short_tmp / "outbox", short_tmp / "archive"
    r = subprocess.run(
        [sys.executable, "-c", KILLED_PROBE, str(outbox), str(archive)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == -9, r.stderr
    staging = default_staging(outbox)
    assert len(_probes(staging)) == 1 and len(_probes(archive)) == 1  # the kill left both
    (archive / "c").mkdir()
    other = archive / ".operator.0123456789ab.tmp"  # not black's: the archive root is not swept
    other.write_bytes(b"x")
    ob = Outbox(outbox, archive, retention_days=1)
    assert ob.sweep_stale_temps() == 2
    assert _probes(staging) == [] and _probes(archive) == []
    assert other.exists() and (archive / "c").is_dir()


# ---------------------------------------------------------------------- the kernel copy


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=300_000), cross=st.booleans())
def test_copy_fd_round_trip_same_and_cross_file_system(data: bytes, cross: bool) -> None:
    """copy_file_range within a file system; its sendfile fallback across (EXDEV)."""
    src_dir = "/dev/shm" if cross and os.path.isdir("/dev/shm") else "/tmp"
    with (
        tempfile.NamedTemporaryFile(dir=src_dir) as src,
        tempfile.NamedTemporaryFile(dir="/tmp") as dst,
    ):
        src.write(data)
        src.flush()
        if src_dir == "/dev/shm" and data:  # the fallback is really needed here
            with pytest.raises(OSError) as e:
                os.copy_file_range(src.fileno(), dst.fileno(), len(data), 0, 0)
            assert e.value.errno == errno.EXDEV
        assert file_drop._copy_fd(src.fileno(), dst.fileno()) == len(data)
        assert Path(dst.name).read_bytes() == data


# ---------------------------------------------------------------------- configuration


def test_staging_dir_defaults_beside_the_outbox_and_resolves_relative(tmp_path: Path) -> None:
    base = {"channels": [{"name": "a", "encrypt": False}]}
    cfg = config_from_dict({**base, "black": {"outbox": "x/out"}}, base=tmp_path, environ={})
    assert cfg.black.staging_dir == tmp_path / "x" / ".out.staging"
    assert cfg.black.staging_dir == default_staging(tmp_path / "x" / "out")
    cfg = config_from_dict({**base, "black": {"staging_dir": "st"}}, base=tmp_path, environ={})
    assert cfg.black.staging_dir == tmp_path / "st"
    cfg = config_from_dict(
        base, base=tmp_path, environ={"DIODE__BLACK__STAGING_DIR": str(tmp_path / "env")}
    )
    assert cfg.black.staging_dir == tmp_path / "env"
    ob = Outbox.from_config(cfg)
    assert ob.staging == tmp_path / "env" and ob.lock_path == tmp_path / "env" / DROP_LOCK


def test_staging_on_another_file_system_is_refused_with_the_fix(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm)")
    staging = Path(tempfile.mkdtemp(prefix="diode-staging-", dir=shm))
    try:
        with pytest.raises(ConfigError) as e:
            Outbox(tmp_path / "outbox", tmp_path / "archive", retention_days=1, staging=staging)
    finally:
        shutil.rmtree(staging)
    msg = str(e.value)
    assert "black.staging_dir" in msg and "not on the file system of black.outbox" in msg
    assert str(default_staging(tmp_path / "outbox")) in msg and "mount" in msg


def test_staging_inside_the_outbox_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="inside black.outbox"):
        Outbox(
            tmp_path / "outbox",
            tmp_path / "archive",
            retention_days=1,
            staging=tmp_path / "outbox" / ".staging",
        )
