"""Red, the Spark source "diode_inbox" on the driver and executor side, without Spark: what it
plans (``latestOffset``, ``partitions``) and what ``read`` verifies, on real files, real gpg
and (for room) a real small file system. The landing is played by removing the files a batch
judged from intake, as the landing moves them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from bridge.config import load_config
from bridge.errors import ConfigError
from bridge.red.job import RedRun
from bridge.red.source import FileBatch, InboxStreamReader
from tests.integration.test_gpg import busy_message
from tests.red_factory import (
    RedKeys,
    make_bundle,
    make_heartbeat,
    make_rows,
    temp_red_keys,
    write_red_toml,
)
from tests.support import foreign_checkpoint, small_tmpfs

MiB = 2**20
ALL = ReadAllAvailable()


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("rs") as k:
        yield k


@pytest.fixture
def reader_at() -> Iterator[Callable[[Path, RedKeys], InboxStreamReader]]:
    made: list[InboxStreamReader] = []

    def make(root: Path, keys: RedKeys) -> InboxStreamReader:
        cfg = write_red_toml(root, keys)
        (root / "red" / "inbox").mkdir(parents=True, exist_ok=True)
        made.append(InboxStreamReader({"config": str(cfg)}))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def poll(r: InboxStreamReader, start: dict[str, int], until: Callable[[], bool]) -> dict[str, int]:
    """``latestOffset`` as Spark calls it, until ``until()`` (files take a settle time)."""
    deadline = time.monotonic() + 10
    while True:
        end = r.latestOffset(start, ALL)
        if until() or time.monotonic() > deadline:
            return end
        time.sleep(0.1)


def next_batch(r: InboxStreamReader, start: dict[str, int]) -> dict[str, int]:
    """Poll until a batch is planned (a file taken again waits a settle time first)."""
    deadline = time.monotonic() + 5
    while (end := r.latestOffset(start, ALL)) == start and time.monotonic() < deadline:
        time.sleep(0.2)
    return end


def planned(r: InboxStreamReader, start: dict[str, int], end: dict[str, int]) -> list[FileBatch]:
    parts = r.partitions(start, end)
    assert all(isinstance(p, FileBatch) for p in parts)
    return parts  # type: ignore[return-value]


def ordinals(parts: list[FileBatch]) -> list[tuple[int, str]]:
    return sorted((f[0], f[1]) for p in parts for f in p.files)


def rows(r: InboxStreamReader, parts: list[FileBatch]) -> list[dict[str, Any]]:
    return [row for p in parts for b in r.read(p) for row in b.to_pylist()]


def land(r: InboxStreamReader, judged: list[dict[str, Any]]) -> None:
    """What the landing does to intake: each judged file leaves it."""
    for row in judged:
        (r._get_intake().dir / f"{row['ordinal']:012d}.{row['name']}").unlink()


def test_a_lost_next_is_raised_to_sparks_committed_offset(
    keys: RedKeys, short_tmp: Path, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """work_dir/intake/NEXT lost while Spark's checkpoint is kept: ordinals would start again
    at 1, below the committed offset, and nothing would ever be planned. NEXT is raised to the
    offset first, so the new files land."""
    r = reader_at(short_tmp, keys)
    inbox = short_tmp / "red" / "inbox"
    start = {"next": 41}  # the checkpoint of 40 files landed before work_dir was lost
    for seq in (1, 2, 3):
        make_heartbeat(inbox, keys, "orders", seq, last_bundle_seq=None)
    end = poll(r, start, lambda: len(r._pending()) == 3)
    assert end == {"next": 44}, r._pending()
    parts = planned(r, start, end)
    assert [o for o, _ in ordinals(parts)] == [41, 42, 43]
    assert (r._get_intake().dir / "NEXT").read_text().strip() == "44"
    judged = rows(r, parts)
    assert sorted(x["seq"] for x in judged) == [1, 2, 3] and all(
        x["status"] == "ok" for x in judged
    )


def test_a_bundle_that_cannot_fit_now_waits_in_intake_while_others_land(
    keys: RedKeys, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """A bundle whose plaintext may need more than is free now (a hostile one bigger than the
    free space, or a good one on a full disk) is neither opened (gpg would fill the disk) nor
    quarantined nor a reason to stop: files behind it land, it waits, and it is judged once
    there is room. Also when the room goes between planning and reading."""
    with small_tmpfs("48m", "rsroom") as fs:
        r = reader_at(fs, keys)
        inbox = fs / "red" / "inbox"
        big = "orders.000000000001." + "f" * 32 + ".dbundle"
        (inbox / big).write_bytes(random.Random(1).randbytes(8 * MiB))
        make_heartbeat(inbox, keys, "orders", 1, last_bundle_seq=None)
        filler = fs / "filler"
        filler.write_bytes(bytes(20 * MiB))  # ~20 MiB free: not 8 MiB + the reserve (20 MiB)
        start = {"next": 1}
        end = poll(r, start, lambda: len(r._pending()) == 2)
        parts = planned(r, start, end)
        assert [n for _, n in ordinals(parts)] == ["orders.000000000001.dheartbeat"]
        judged = rows(r, parts)
        assert [(x["kind"], x["status"]) for x in judged] == [("heartbeat", "ok")]
        land(r, judged)
        # the bundle was moved behind the heartbeat, and waits
        assert [n for _, n in r._pending()] == [big]
        start = end
        assert r.latestOffset(start, ALL) == start
        filler.unlink()
        end = r.latestOffset(start, ALL)
        parts = planned(r, start, end)
        assert [n for _, n in ordinals(parts)] == [big]
        # the room goes again before the executor opens it: left in intake, nothing written
        filler.write_bytes(bytes(20 * MiB))
        assert rows(r, parts) == [] and [n for _, n in r._pending()] == [big]
        assert not any((fs / "red" / "work" / "plain").iterdir())
        start = end
        assert r.latestOffset(start, ALL) == start  # taken again; no room, still settling
        assert [o for o, _ in r._pending()] == [start["next"]]
        filler.unlink()
        end = next_batch(r, start)
        judged = rows(r, planned(r, start, end))
        assert [(x["name"], x["status"], x["reason"]) for x in judged] == [
            (big, "reject", "crypto")
        ]


def test_a_file_that_changes_after_it_was_taken_is_judged_once_complete(
    keys: RedKeys, short_tmp: Path, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """A mover writing in place that pauses past the settle time gets its file taken half
    written. If the file changed since it was planned it is not judged (quarantine would move
    the inode the mover still writes): it is taken again and judged once it stops changing.
    Likewise when it changes while gpg reads it and the verdict is a reject."""
    r = reader_at(short_tmp, keys)
    inbox = short_tmp / "red" / "inbox"
    scratch = short_tmp / "scratch"
    scratch.mkdir()
    b = make_bundle(scratch, keys, "orders", 1, make_rows("orders", range(200)), None)
    whole = b.path.read_bytes()
    third = len(whole) // 3
    (inbox / b.name).write_bytes(whole[:third])
    start = {"next": 1}
    end = poll(r, start, lambda: len(r._pending()) == 1)
    parts = planned(r, start, end)
    assert ordinals(parts) == [(1, b.name)]
    with open(r._get_intake().dir / f"{1:012d}.{b.name}", "ab") as f:  # the mover goes on
        f.write(whole[third : 2 * third])
    assert rows(r, parts) == []  # not "crypto": it is not complete, and still changing
    start = end
    assert r.latestOffset(start, ALL) == start  # taken again, waits until it stops changing
    (path,) = [t.path for t in r._get_intake().pending()]
    with open(path, "ab") as f:
        f.write(whole[2 * third :])
    end = next_batch(r, start)
    judged = rows(r, planned(r, start, end))
    assert [(x["name"], x["status"]) for x in judged] == [(b.name, "ok")], judged
    land(r, judged)

    # a reject while the file changes under gpg (here gpg is kept busy past its time)
    r.ctx = dataclasses.replace(r.ctx, gpg_open_base_seconds=1.0)
    name = "orders.000000000002." + "c" * 32 + ".dbundle"
    (inbox / name).write_bytes(busy_message(3))
    start = end
    end = poll(r, start, lambda: len(r._pending()) == 1)
    parts = planned(r, start, end)
    path = r._get_intake().dir / f"{end['next'] - 1:012d}.{name}"

    def mover() -> None:
        time.sleep(0.3)
        with open(path, "ab") as f:
            f.write(b"more")

    t = threading.Thread(target=mover)
    t.start()
    try:
        assert rows(r, parts) == []
    finally:
        t.join()
    assert [n for _, n in r._pending()] == [name]


def test_a_bundle_that_can_never_fit_beside_itself_is_planned_and_rejected(
    keys: RedKeys, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """Intake and plain_dir share a file system: a file bigger than half of it can never be
    opened, however much is freed. The source plans it at once (to be rejected ``too_large``
    before gpg) instead of leaving it waiting for room forever."""
    with small_tmpfs("16m", "rshalf") as fs:
        r = reader_at(fs, keys)
        inbox = fs / "red" / "inbox"
        big = "orders.000000000001." + "e" * 32 + ".dbundle"
        (inbox / big).write_bytes(random.Random(2).randbytes(9 * MiB))
        start = {"next": 1}
        end = poll(r, start, lambda: len(r._pending()) == 1)
        parts = planned(r, start, end)
        assert [n for _, n in ordinals(parts)] == [big]
        judged = rows(r, parts)
        assert [(x["name"], x["status"], x["reason"]) for x in judged] == [
            (big, "reject", "too_large")
        ]


def test_a_reader_in_a_fresh_worker_process_logs_its_rejections_with_their_ids(
    keys: RedKeys, short_tmp: Path, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """An executor gets the reader pickled into a Python worker that set up no logging: its
    ``wire file rejected`` printed bare (no file, reason, channel). ``read`` sets it up."""
    r = reader_at(short_tmp, keys)
    junk = "orders.000000000001." + "a" * 32 + ".dbundle"
    (short_tmp / "red" / "inbox" / junk).write_bytes(b"\x00not a gpg message" * 40)
    start = {"next": 1}
    parts = planned(r, start, poll(r, start, lambda: len(r._pending()) == 1))
    fresh = InboxStreamReader({"config": r.config_path})  # as Spark pickles it, unstarted
    blob = pickle.dumps((fresh, parts))
    worker = "import pickle, sys\nr, parts = pickle.load(sys.stdin.buffer)\n" + (
        "print(sum(b.num_rows for p in parts for b in r.read(p)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE_LOG")}
    got = subprocess.run(
        [sys.executable, "-c", worker], input=blob, capture_output=True, env=env, timeout=120
    )
    err = got.stderr.decode()
    assert got.returncode == 0 and got.stdout.strip() == b"1", err[-2000:]
    lines = [ln for ln in err.splitlines() if "wire file rejected" in ln]
    assert lines and all(junk in ln and '"reason"' in ln for ln in lines), err[-2000:]


def test_an_offset_of_another_query_is_a_configuration_error(
    tmp_path: Path, keys: RedKeys, reader_at: Callable[[Path, RedKeys], InboxStreamReader]
) -> None:
    """A checkpoint written by another query hands the source offsets of another shape (a rate
    source's ``0``, black's ``{"channel": seq}``): a ConfigError naming the key and the fix,
    not ``AttributeError: 'int' object has no attribute 'get'``."""
    r = reader_at(tmp_path, keys)
    ckpt = tmp_path / "red" / "checkpoint"
    for foreign in (0, {"orders": 5}, {"next": "5"}, [1]):
        with pytest.raises(ConfigError, match="holds another query's checkpoint") as e:
            r.latestOffset(foreign, ALL)  # type: ignore[arg-type]
        assert str(ckpt) in str(e.value) and "point red.checkpoint_dir at an empty" in str(e.value)
        with pytest.raises(ConfigError, match="holds another query's checkpoint"):
            r.partitions(foreign, {"next": 1})  # type: ignore[arg-type]
    assert r.latestOffset({"next": 0}, ALL) == {"next": 0}


@pytest.mark.spark
def test_the_red_job_on_another_querys_checkpoint_stops_with_a_config_error(
    spark: Any, tmp_path: Path, keys: RedKeys
) -> None:
    cfg = load_config(write_red_toml(tmp_path, keys))
    foreign_checkpoint(spark, cfg.red.checkpoint_dir)
    with pytest.raises(ConfigError, match=r"holds another query's checkpoint \(offset 0"):
        RedRun(cfg).run(spark, "available-now")
