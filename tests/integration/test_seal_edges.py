"""Integration: sealer edge cases with real gpg, Parquet and a real spool — a sealing process
killed (SIGKILL) at the named crash points finishes its bundle at restart: rebuilt
byte-identically after ``seal.after_intent``, re-dropped from the archived copy (same
ciphertext, no re-encryption) after ``seal.after_deliver``, even when the mover already took it;
a single message that only exceeds the file ceiling once packed becomes an "oversize" gap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from bridge.black.chunking import row_size_estimate
from bridge.black.seal import BundleSealer, seal_overhead_bytes
from bridge.black.spool import SpoolWriter
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import Config, load_config
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import KeyInventory, init_keys
from bridge.diode.file_drop import Outbox
from bridge.faults import CRASH_ENV, MARK_ENV
from bridge.metrics import REGISTRY
from bridge.protocol.bundle import sha256_hex, unpack_bundle
from bridge.protocol.manifest import Manifest
from bridge.protocol.naming import bundle_name
from bridge.protocol.properties import Properties, encode_properties
from bridge.protocol.rows import RowBuilder
from tests.support import captured_logs

pytestmark = pytest.mark.gpg

REPO = Path(__file__).resolve().parents[2]

# The sealing process the tests kill: seals spool positions [0, end) of channel "c".
SEAL_SCRIPT = """
import sys
import pyarrow as pa
from bridge.black.seal import BundleSealer
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import load_config
from bridge.crypto.gpg import Gpg
from bridge.diode.file_drop import Outbox

cfg = load_config(sys.argv[1], environ={})
rows = read_rows(cfg.black.spool_dir, "c", 0, int(sys.argv[2]), {})
table = pa.Table.from_batches(list(rows), schema=source_schema())
outbox = Outbox.from_config(cfg)
sealer = BundleSealer(
    cfg, store=StateStore(cfg.black.state_dir), gpg=Gpg(cfg.black.gnupg_home), outbox=outbox
)
sealer.seal_rows(cfg.channels[0], table)
"""


def _setup(
    tmp: Path, archive_mode: str = "copy", **bundle: Any
) -> tuple[Config, KeyInventory, Path]:
    inv = init_keys(tmp / "keys")
    extra = "".join(f"{k} = {v}\n" for k, v in bundle.items())
    path = tmp / "d.toml"
    path.write_text(
        f'[link]\nblack_signers = ["{inv.black_fpr}"]\n'
        f'[[channels]]\nname = "c"\nrecipients = {json.dumps(list(inv.red_fprs.values()))}\n'
        f'[black]\ngnupg_home = "keys/black"\nsigning_key = "{inv.black_fpr}"\n'
        f'archive_mode = "{archive_mode}"\n'
        f"[black.bundle]\nmax_rows = 10\n{extra}"
    )
    path.chmod(0o600)
    return load_config(path, environ={}), inv, path


def _sealer(cfg: Config) -> BundleSealer:
    return BundleSealer(
        cfg,
        store=StateStore(cfg.black.state_dir),
        gpg=Gpg(cfg.black.gnupg_home),
        outbox=Outbox.from_config(cfg),
    )


def _props(i: int) -> bytes:
    return encode_properties(Properties(message_id=str(i)))


def _spool(cfg: Config, n: int) -> pa.Table:
    """``n`` deliveries into channel c's spool (positions 0..n-1), read back as the sink does."""
    with SpoolWriter.open(cfg.black.spool_dir, "c", min_free_bytes=0) as w:
        for i in range(n):
            w.append_one("x", "k", False, _props(i), b"%d" % i)
        w.sync(-1)
    return pa.Table.from_batches(
        list(read_rows(cfg.black.spool_dir, "c", 0, n, {})), schema=source_schema()
    )


def _rows(n: int, body: bytes | None = None) -> pa.Table:
    b = RowBuilder("c")
    for i in range(n):
        b.append(i, None, "x", "k", False, _props(i), body or b"%d" % i)
    return b.to_table()


def _journal(cfg: Config) -> dict[str, Any]:
    return json.loads((Path(cfg.black.state_dir) / "channel-c.json").read_text())


def _recovered(how: str) -> float:
    v = REGISTRY.get_sample_value(
        "bridge_black_bundles_recovered_total", {"channel": "c", "how": how}
    )
    return v or 0.0


def _open_all(cfg: Config, inv: KeyInventory) -> list[tuple[Manifest, pa.Table, str]]:
    """Every bundle in the outbox, opened with the red key: (manifest, rows, plaintext sha)."""
    red = Gpg(inv.red_home)
    out = []
    for p in sorted(cfg.black.outbox.glob("*.dbundle")):
        plain, _ = red.open_bytes(p.read_bytes(), pinned_signers=[inv.black_fpr])
        m, rows = unpack_bundle(plain)
        out.append((m, rows, sha256_hex(plain)))
    return out


@pytest.mark.parametrize(
    ("point", "how", "mover_took_it", "archive_mode"),
    [
        ("seal.after_intent", "rebuilt", False, "copy"),
        ("seal.after_deliver", "redropped", False, "copy"),
        ("seal.after_deliver", "redropped", True, "copy"),
        ("seal.after_deliver", "redropped", False, "link"),
        ("seal.after_deliver", "redropped", True, "link"),
    ],
    ids=[
        "after-intent",
        "after-deliver",
        "after-deliver-mover-took-it",
        "after-deliver-archive-link",
        "after-deliver-mover-took-it-archive-link",
    ],
)
def test_killed_at_a_crash_point_finishes_the_bundle_at_restart(
    short_tmp: Path, point: str, how: str, mover_took_it: bool, archive_mode: str
) -> None:
    """Killed in the window the crash point names at the 2nd bundle; the restart finishes
    that bundle by the expected path, byte-identical. With ``archive_mode = "link"`` the
    killed delivery left the outbox file and its archive entry as one inode: the re-drop
    is a copy, so the archived evidence stays what was sealed whatever a mover does."""
    cfg, inv, path = _setup(short_tmp, archive_mode)
    table = _spool(cfg, 25)
    mark = short_tmp / "crash.mark"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIODE")}
    env.update(
        {CRASH_ENV: f"{point}:2", MARK_ENV: str(mark), "PYTHONPATH": str(REPO)},
    )
    r = subprocess.run(
        [sys.executable, "-c", SEAL_SCRIPT, str(path), "25"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        start_new_session=True,  # the crash point kills its whole group (gpg included)
    )
    # the process died by SIGKILL in the window the crash point names, at the 2nd bundle
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert mark.read_text().split() == [point]
    st = _journal(cfg)
    assert st["last_bundle_seq"] == 1 and st["pending"] is not None
    intent = Manifest.from_json(st["pending"]["manifest"].encode())
    assert (intent.bundle_seq, intent.first_seq, intent.last_seq) == (2, 10, 19)
    name = bundle_name("c", 2, intent.bundle_id)
    delivered = cfg.black.outbox / name
    assert delivered.exists() == (point == "seal.after_deliver")
    sealed_before = delivered.read_bytes() if delivered.exists() else None
    archived = cfg.black.archive / "c" / name
    if archive_mode == "link" and sealed_before is not None:  # the killed delivery linked it
        assert delivered.stat().st_ino == archived.stat().st_ino
    if mover_took_it:
        delivered.unlink()

    before = {h: _recovered(h) for h in ("redropped", "rebuilt", "resealed")}
    shipped = _sealer(cfg).seal_rows(cfg.channels[0], table)  # the restart, same batch
    after = {h: _recovered(h) for h in ("redropped", "rebuilt", "resealed")}
    assert {h: after[h] - before[h] for h in after} == {
        h: (1.0 if h == how else 0.0) for h in after
    }, "exactly the expected recovery path must have run"

    assert [b.bundle_seq for b in shipped] == [2, 3]
    assert shipped[0].bundle_id == intent.bundle_id
    assert shipped[0].sha256 == st["pending"]["sha256"], "bundle 2 must be byte-identical"
    if sealed_before is not None:
        again = delivered.read_bytes()
        assert again == sealed_before, "the archived ciphertext is re-dropped, not re-sealed"
        assert archived.read_bytes() == sealed_before
        # the re-drop is a copy: the archive entry is no longer shared with the outbox file
        assert delivered.stat().st_ino != archived.stat().st_ino
        assert archived.stat().st_nlink == 1
    if archive_mode == "link":  # bundle 3, delivered normally after the restart, is a link
        third = next(p for p in cfg.black.outbox.iterdir() if p.name.startswith("c.000000000003"))
        assert third.stat().st_ino == (cfg.black.archive / "c" / third.name).stat().st_ino
    st = _journal(cfg)
    assert (st["last_bundle_seq"], st["last_seq"], st["pending"]) == (3, 24, None)
    assert st["counters"] == {"bundles": 3, "messages": 25}

    prev = None
    seqs: list[int] = []
    for i, (m, rows, sha) in enumerate(_open_all(cfg, inv), start=1):
        assert m.bundle_seq == i and m.prev_sha256 == prev
        prev = sha
        seqs += rows.column("seq").to_pylist()
    assert seqs == list(range(25))


def test_single_message_over_the_ceiling_once_packed_is_an_oversize_gap(short_tmp: Path) -> None:
    cfg, inv, _ = _setup(short_tmp, max_file_bytes=65536)
    max_plain = 65536 - seal_overhead_bytes(2, 65536)
    # just under the estimate's per-row limit, but Parquet framing pushes it over the ceiling
    body = os.urandom(max_plain - 4096 - 256 - 40)
    table = pa.concat_tables([_rows(1), _rows(2, body).slice(1, 1), _rows(3).slice(2, 1)])
    # the case: the size estimate lets the big row through (it is not dropped before packing)
    assert int(row_size_estimate(table.slice(1, 1))[0]) <= max_plain - 4096
    with captured_logs("bridge.black.seal") as log:
        shipped = _sealer(cfg).seal_rows(cfg.channels[0], table)
    assert any("once packed" in r.getMessage() for r in log), log
    gaps = [g for b in shipped for g in b.gaps]
    rows = sum(b.rows for b in shipped)
    red = Gpg(inv.red_home)
    for p in cfg.black.outbox.glob("*.dbundle"):
        assert p.stat().st_size <= 65536
        plain, _ = red.open_bytes(p.read_bytes(), pinned_signers=[inv.black_fpr])
        unpack_bundle(plain)
    assert [(g.first_seq, g.last_seq, g.reason) for g in gaps] == [(1, 1, "oversize")]
    assert rows == 2
    assert _journal(cfg)["counters"]["lost_oversize"] == 1
