"""Black, tap start: a spool segment still to be read that cannot be — damaged, of another
format, not a file, not readable by black's user — is found at start (the job's check,
``diode check``, the tap's open) naming the file, the positions it holds and the fix, not by
the sealer once the tap has drained more of the broker; a shipped one is released unread. An
error in the tap process before it runs (its config file edited since the job started)
reaches the job's error with its reason. Real files, real processes, a real vhost."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from bridge.black.job import check_black_writable
from bridge.black.spool import SpoolReader, SpoolWriter, segment_name, writer_settings
from bridge.black.state import ChannelState, StateStore
from bridge.black.taps import UntilEmptyTaps
from bridge.config import Config
from bridge.errors import BrokerError, ConfigError, DiodeError, SchemaVersionError, StateError
from tests.integration.test_tap import messages, publish_raw, setup_mirror, spooled, write_config
from tests.integration.test_tap_files_broker import _never_delivered
from tests.support import without_dac
from tests.unit.test_tap_files_spool import CHANNEL, _spool

REPO = Path(__file__).resolve().parents[2]


def _zeroed(seg: Path) -> None:
    """The disk damaged the header (its first 4 KiB read back as zeros)."""
    fd = os.open(seg, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(4096), 0)
    finally:
        os.close(fd)


def _other_format(seg: Path) -> None:
    """A segment some other Arrow writer made."""
    other = pa.schema([("pos", pa.int64())])
    seg.unlink()
    with pa.OSFile(str(seg), "wb") as f, pa.ipc.new_stream(f, other) as s:
        s.write_batch(pa.record_batch([pa.array([0])], schema=other))


def _not_a_file(seg: Path) -> None:
    """A directory where the segment was (restored wrongly): reading it is EISDIR."""
    seg.unlink()
    seg.mkdir()


DAMAGE: dict[str, tuple[Callable[[Path], None], type[DiodeError], str, bool]] = {
    # how, what the tap's open raises, what it says, whether the sealer's read says the same
    "zeroed": (_zeroed, StateError, "has no valid Arrow header", True),
    "other format": (_other_format, SchemaVersionError, "drain it with the black version", True),
    "not a file": (_not_a_file, StateError, "cannot be read (Is a directory (EISDIR))", False),
}


def _closed_segment(tmp_path: Path) -> tuple[Config, Path, Path]:
    """Channel f1's spool: seg-0 closed (positions 0..2), seg-3 the last (3..4)."""
    cfg, d = _spool(tmp_path)
    with SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0) as w:  # seg-0 closed, seg-3 made
        for i in range(3, 5):
            w.append_one("ev", "rk", False, b"", b"body-%d" % i)
        w.sync(4)
    assert sorted(p.name for p in d.glob("seg-*")) == [segment_name(0), segment_name(3)]
    return cfg, d, d / segment_name(0)


def _state(d: Path) -> dict[str, Any]:
    return {p.name: (p.is_dir() or p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_closed_segment_that_cannot_be_read_is_refused_at_start(
    tmp_path: Path, damage: str
) -> None:
    """Only LOCK, TAIL and the last segment were probed at start: a damaged closed segment
    let the job and its taps start, the taps drained the broker into the spool, and the
    sealer failed once it reached that segment. Now the job's check (``diode check`` too)
    and the tap's open refuse before anything is consumed, with the error the sealer would
    give (the runbook's §7.1 words), the positions the file holds and the errno; nothing is
    changed. A segment already shipped is not read: the tap releases it."""
    cfg, d, seg = _closed_segment(tmp_path)
    make, kind, said, as_sealer = DAMAGE[damage]
    make(seg)
    before = _state(d)
    if as_sealer:  # the runbook's words (§7.1), as the sealer gives them
        with pytest.raises(kind) as read:
            list(SpoolReader(d.parent, CHANNEL).read(0, 5))
        assert said in str(read.value)
    with pytest.raises(ConfigError) as check:
        check_black_writable(cfg)
    with pytest.raises(kind) as opened:
        SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0, first_pos=0)  # nothing shipped
    for e in (check.value, opened.value):
        msg = str(e)
        assert str(seg) in msg and said in msg, msg
        assert f"It holds positions [0, 3) of channel '{CHANNEL}'" in msg, msg
    for e in (check.value, opened.value):  # the check reads the journal: none shipped
        assert f"of channel '{CHANNEL}', not shipped yet" in str(e), e
    assert _state(d) == before, "the checks change nothing"
    store = StateStore(Path(cfg.black.state_dir))
    store.save(dataclasses.replace(store.load(CHANNEL), last_seq=2))  # seg-0 shipped
    check_black_writable(cfg)  # the journal says so: the segment is not read
    with SpoolWriter.open(d.parent, CHANNEL, min_free_bytes=0, first_pos=3) as w:  # shipped
        assert w.durable_end == 5
        if seg.is_file():  # a directory in its place is the writer's to refuse (unlink)
            w.release_through(2)
            assert not os.path.lexists(seg), "a shipped segment is released unread"
    rows = [r["body"] for b in SpoolReader(d.parent, CHANNEL).read(3, 5) for r in b.to_pylist()]
    assert rows == [b"body-3", b"body-4"]


_UNREADABLE_CHILD = r"""
import json, sys
from pathlib import Path
from bridge.black.job import check_black_writable
from bridge.black.spool import SpoolWriter
from tests.unit.test_file_drop_places import config
out = {}
try:
    check_black_writable(config(Path(sys.argv[1])))
except Exception as e:
    out["check"] = [type(e).__name__, str(e)]
try:
    SpoolWriter.open(Path(sys.argv[2]), "f1", min_free_bytes=0).close()
except Exception as e:
    out["open"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def test_a_closed_segment_black_may_not_read_is_refused_at_start(tmp_path: Path) -> None:
    """Mode 0000 (a restore under another owner): the job's check and the tap's open name
    the file, EACCES and the fix, a ConfigError as for a file the tap may not write. As root,
    the check runs in a child without CAP_DAC_OVERRIDE (mode bits do not stop root)."""
    cfg, d, seg = _closed_segment(tmp_path)
    prefix = without_dac()
    seg.chmod(0)
    try:
        r = subprocess.run(
            [*prefix, sys.executable, "-c", _UNREADABLE_CHILD, str(tmp_path), str(d.parent)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        seg.chmod(0o600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"check", "open"}, out
    for what, (kind, msg) in out.items():
        assert kind == "ConfigError", (what, kind, msg)
        assert f"{seg}, in the spool of channel '{CHANNEL}', is not readable by" in msg, msg
        assert "; Permission denied (EACCES)): " in msg, msg
        assert f"`chown -R {os.getuid()} {d}`" in msg, msg
        assert f"It holds positions [0, 3) of channel '{CHANNEL}'" in msg, (what, msg)


@pytest.mark.broker
def test_a_damaged_closed_segment_stops_the_tap_before_it_consumes_and_the_job_says_why(
    black_vhost: Any, tmp_path: Path
) -> None:
    """The tap started on a spool whose closed segment was damaged, drained the broker into
    it (acked: the messages were the spool's now), and the run failed only when the sealer
    reached that segment. Now the tap refuses at its open, before it takes a message, and the
    job's error carries its reason; once black's journal covers the segment (shipped), the tap
    releases it unread and drains."""
    url = black_vhost.amqp_url
    cfg = write_config(tmp_path, url, group_messages=5, group_seconds=0.2)
    setup_mirror(cfg, url)
    publish_raw(url, messages(5))
    UntilEmptyTaps(cfg, timeout=60).finish()
    root = Path(cfg.black.spool_dir)
    SpoolWriter.open(root, "main", **writer_settings(cfg.black.spool)).close()  # seg-0 closed
    seg = root / "main" / segment_name(0)
    _zeroed(seg)
    publish_raw(url, messages(5))
    with pytest.raises(BrokerError) as e:  # a StateError in the tap: exit 1
        UntilEmptyTaps(cfg, timeout=60).finish()
    _never_delivered(url, 5)
    msg = str(e.value)
    assert "tap failed for channel(s) {'main': 1} (exit status): 'main': " in msg, msg
    assert f"spool segment {seg} has no valid Arrow header" in msg, msg
    assert "It holds positions [0, 5) of channel 'main', not shipped yet" in msg, msg
    StateStore(Path(cfg.black.state_dir)).save(ChannelState("main", last_bundle_seq=1, last_seq=4))
    UntilEmptyTaps(cfg, timeout=60).finish()
    assert not seg.exists(), "shipped: released unread"
    assert [r["pos"] for r in spooled(cfg)] == list(range(5, 10))


@pytest.mark.parametrize("edit", ["channel gone", "not TOML"])
def test_a_config_error_before_the_tap_runs_reaches_the_job_with_its_reason(
    tmp_path: Path, edit: str
) -> None:
    """The config file was edited after the job started (a tap restarted later reads it
    again): the tap failed before ``run_tap`` (the file no longer loads) or before its try
    (the channel is gone), wrote no reason, and the job said only ``its log above says
    why``. Now the job's ConfigError carries the tap's own words. No broker is reached."""
    cfg = write_config(tmp_path, "amqp://guest:guest@127.0.0.1:5672/%2F")
    assert cfg.source is not None
    text = cfg.source.read_text()
    if edit == "channel gone":
        cfg.source.write_text(text.replace('name = "main"', 'name = "renamed"'))
        why = "unknown channel 'main'; configured: ['renamed']"
    else:
        cfg.source.write_text(text.replace("[black]", "[black"))
        why = f"{cfg.source}: not valid TOML: "
    with pytest.raises(ConfigError) as e:
        UntilEmptyTaps(cfg, timeout=60).finish()
    msg = str(e.value)
    assert "tap failed for channel(s) {'main': 2} (exit status): 'main': " in msg, msg
    assert why in msg and "its log above says why" not in msg, msg
