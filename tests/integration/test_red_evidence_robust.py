"""Red, evidence and intake: folders and entries red may not read or move (lost+found of a mount
point, an immutable folder) never stop red (bridge.red.evidence / intake). Real folders, real
permissions (as root: a child without CAP_DAC_OVERRIDE, chattr +i)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bridge.red.evidence import REASON_SUFFIX
from bridge.red.intake import REASON_NOT_REGULAR
from tests.integration.test_red_intake import Dirs, bundle
from tests.support import REPO, captured_logs, without_dac
from tests.unit.test_black_dirs import refused_dir

_MOVE_CHILD = """
import json, sys
from datetime import datetime
from pathlib import Path
from typing import Any
from bridge.logs import setup_logging
from bridge.red.evidence import Evidence
setup_logging(json_logs=True)
root, src, name, at = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
dst = Evidence(root / "processed", root / "quarantine").processed(
    src, name, datetime.fromisoformat(at)
)
print(json.dumps(str(dst)))
"""


def _move_in_child(
    root: Path, src: Path, name: str, at: datetime, prefix: list[str]
) -> tuple[Path, list[dict[str, Any]]]:
    """``Evidence.processed`` in a child (``prefix``): where it went, and its JSON log lines.
    It must return within 20 s."""
    try:
        r = subprocess.run(
            [*prefix, sys.executable, "-c", _MOVE_CHILD, str(root), str(src), name, at.isoformat()],
            cwd=REPO, capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the evidence move did not return within 20 s (a search that never ends)")
    assert r.returncode == 0, r.stderr[-3000:]
    logs = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    return Path(json.loads(r.stdout.strip().splitlines()[-1])), logs


def _evidence_root(tmp_path: Path) -> tuple[Path, Path]:
    """processed/ with a lost+found (mode 000) and a day folder red may not search, and an
    intake folder: the root and the intake."""
    root = tmp_path / "red"
    intake = root / "intake"
    for d in (intake, root / "quarantine", root / "processed" / "lost+found"):
        d.mkdir(parents=True)
    (root / "processed" / "2030-01-05").mkdir()
    (root / "processed" / "lost+found").chmod(0)
    (root / "processed" / "2030-01-05").chmod(0)
    return root, intake


def _readable_again(root: Path) -> None:
    for d in ("lost+found", "2030-01-05"):
        (root / "processed" / d).chmod(0o700)


def test_a_link_left_by_a_crash_is_found_beyond_an_unreadable_lost_and_found(
    tmp_path: Path,
) -> None:
    """A file in intake already linked into processed/<day> (a crash between link and unlink)
    is moved by finding that link: processed/ also holds ``lost+found`` (root, mode 000, the
    folder is a mount point) and a day folder red may not search. Neither is a day red can
    read: lost+found is no day folder at all, the unsearchable day is skipped with one
    warning, and the move returns (it used to search lost+found for a free name forever)."""
    root, intake = _evidence_root(tmp_path)
    name = bundle(7)
    src = intake / f"000000000007.{name}"
    src.write_bytes(b"sealed")
    earlier = root / "processed" / "2030-01-02" / name
    earlier.parent.mkdir()
    os.link(src, earlier)
    try:
        dst, logs = _move_in_child(root, src, name, datetime(2030, 1, 3, tzinfo=UTC), without_dac())
    finally:
        _readable_again(root)
    assert dst == earlier and earlier.read_bytes() == b"sealed" and earlier.stat().st_nlink == 1
    assert not src.exists() and not (root / "processed" / "2030-01-03" / name).exists()
    (said,) = [x for x in logs if x.get("msg") == "evidence day folder not searchable: skipped"]
    assert said["path"] == str(root / "processed" / "2030-01-05") and "chmod u+rx" in said["fix"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner needs root to chown")
def test_a_file_protected_hardlinks_refuses_is_renamed_beyond_an_unreadable_lost_and_found(
    tmp_path: Path,
) -> None:
    """The every-day case: the file belongs to the mover's user, so
    ``fs.protected_hardlinks`` refuses the link and the move is a rename, which first looks
    for an earlier reservation in every day folder; lost+found (mode 000) is not one."""
    if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "1":
        pytest.skip("fs.protected_hardlinks is off: the link would be allowed")
    root, intake = _evidence_root(tmp_path)
    name = bundle(8)
    src = intake / f"000000000008.{name}"
    src.write_bytes(b"sealed")
    src.chmod(0o600)
    os.chown(src, 54321, 54321)  # the mover's user: red neither owns nor may write it
    try:
        dst, _ = _move_in_child(
            root, src, name, datetime(2030, 1, 3, tzinfo=UTC), without_dac("fowner")
        )
    finally:
        _readable_again(root)
    assert dst == root / "processed" / "2030-01-03" / name
    assert dst.stat().st_uid == 54321 and not src.exists()


def test_an_inbox_entry_red_cannot_move_is_left_and_the_bundles_beside_it_are_taken(
    tmp_path: Path,
) -> None:
    """A folder in the inbox the OS will not let red move (immutable: ``chattr +i`` as root,
    else mode 0555) stopped every scan before it took anything. Now the bundle beside it is
    taken; the folder is left where it is, counted in ``left``, said once (not at every
    scan), with nothing of the refused quarantine kept (no reason file, no audit record); once
    it is fixed (a new ctime) the next scan quarantines it like any other folder."""
    dirs = Dirs(tmp_path)
    intake = dirs.intake()
    stray = dirs.inbox / "stray"
    stray.mkdir()
    (stray / "inside").write_bytes(b"x")
    dirs.put(bundle(1))
    with refused_dir(stray), captured_logs("bridge.red.intake") as logs:
        res = intake.scan(0.0)
        assert [t.name for t in res.taken] == [bundle(1)]
        assert (res.quarantined, res.left) == ([], 1)
        dirs.put(bundle(2))
        again = intake.scan(1.0)
        assert [t.name for t in again.taken] == [bundle(2)] and again.left == 1
        assert stray.is_dir() and (stray / "inside").read_bytes() == b"x"
        assert [p for p in dirs.quarantine.rglob("*") if not p.is_dir()] == []
        assert list((dirs.work / "audit-pending").iterdir()) == []
        said = [
            r
            for r in logs
            if r.getMessage() == "entry cannot be moved to quarantine: left in place"
        ]
        assert len(said) == 1, [r.getMessage() for r in logs]
        ids = vars(said[0])
        assert ids["path"] == ascii(str(stray)) and ids["errno"] in ("EPERM", "EACCES")
    fixed = intake.scan(2.0)
    assert fixed.left == 0 and not stray.exists()
    (q,) = fixed.quarantined
    assert q.raw_name == b"stray" and (q.stored_as / "inside").read_bytes() == b"x"
    reason = json.loads(q.stored_as.with_name(q.stored_as.name + REASON_SUFFIX).read_bytes())
    assert reason["reason"] == REASON_NOT_REGULAR and "pending_move" not in reason
    assert len(list((dirs.work / "audit-pending").iterdir())) == 1


def test_the_inbox_lost_and_found_is_left_alone_with_one_line(tmp_path: Path) -> None:
    """An inbox that is a mount point has the file system's ``lost+found``: never quarantined
    (fsck needs it where it is), counted in ``left``, said once."""
    dirs = Dirs(tmp_path)
    intake = dirs.intake()
    (dirs.inbox / "lost+found").mkdir(mode=0o700)
    dirs.put(bundle(1))
    with captured_logs("bridge.red.intake") as logs:
        res = intake.scan(0.0)
        again = intake.scan(1.0)
    assert (dirs.inbox / "lost+found").is_dir() and dirs.quarantined() == []
    assert [t.name for t in res.taken] == [bundle(1)] and res.quarantined == []
    assert res.left == again.left == 1
    assert sum("lost+found" in r.getMessage() for r in logs) == 1


def test_a_bundle_red_cannot_take_is_left_and_the_others_are_taken(tmp_path: Path) -> None:
    """A bundle in the inbox the OS will not let red rename (immutable; a mount point) raised
    out of every scan: it sorts first, so no bundle after it was ever taken, and each scan
    burnt ordinals. It is left where it is, said once, and taken once fixed."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root (CAP_LINUX_IMMUTABLE)")
    dirs = Dirs(tmp_path)
    intake = dirs.intake()
    dirs.put(bundle(1))
    dirs.put(bundle(2))
    stuck = dirs.inbox / bundle(1)
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        with captured_logs("bridge.red.intake") as logs:
            res = intake.scan(0.0)
            assert [t.name for t in res.taken] == [bundle(2)] and res.left == 1
            again = intake.scan(1.0)
            assert again.taken == [] and again.left == 1
        said = [r for r in logs if r.getMessage() == "inbox file cannot be taken: left in place"]
        assert len(said) == 1 and vars(said[0])["errno"] == "EPERM", [r.getMessage() for r in logs]
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    fixed = intake.scan(2.0)
    assert [t.name for t in fixed.taken] == [bundle(1)] and fixed.left == 0
