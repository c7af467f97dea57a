"""Integration: channels keep their own recipients and sequences; the plaintext opt-out ships a
signed (not encrypted) OpenPGP message under the same name. Real gpg, real Parquet, no mocks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bridge.black.seal import BundleSealer
from bridge.black.state import StateStore
from bridge.config import config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_keys
from bridge.diode.file_drop import Outbox
from bridge.protocol.properties import Properties, encode_properties
from bridge.protocol.rows import build_rows

pytestmark = pytest.mark.gpg


def _rows(channel: str, n: int) -> pa.Table:
    """``n`` rows of row schema v2, seq = spool position 0..n-1."""
    props = [encode_properties(Properties(message_id=f"{channel}-{i}")) for i in range(n)]
    batch = build_rows(
        channel,
        range(n),
        ["x"] * n,
        ["k"] * n,
        [False] * n,
        props,
        [b"%d" % i for i in range(n)],
        {},
    )
    return pa.Table.from_batches([batch])


def _gpg(home: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--status-fd", "2", *args],
        capture_output=True,
        check=False,
    )


def test_recipients_per_channel_and_plaintext_opt_out(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "keys", red_names=("ops", "audit"))
    ops, audit = inv.red_fprs["ops"], inv.red_fprs["audit"]
    # one red home per recipient, as on two separate red hosts
    homes = {}
    for name, fpr in inv.red_fprs.items():
        g = Gpg(short_tmp / f"r-{name}")
        secret = subprocess.run(
            [
                "gpg",
                "--homedir",
                str(inv.red_home),
                "--batch",
                "--armor",
                "--export-secret-keys",
                fpr,
            ],
            capture_output=True,
            check=True,
        ).stdout
        g.import_keys(secret)
        g.import_keys(Gpg(inv.black_home).export_public(inv.black_fpr))
        homes[name] = g.home
    cfg = config_from_dict(
        {
            "link": {"black_signers": [inv.black_fpr]},
            "channels": [
                {"name": "ops", "recipients": [ops]},
                {"name": "both", "recipients": [ops, audit]},
                {"name": "public", "encrypt": False},
            ],
            "black": {"gnupg_home": str(inv.black_home), "signing_key": inv.black_fpr},
        },
        base=short_tmp,
        environ={},
    )
    gpg = Gpg(inv.black_home)
    outbox = Outbox(cfg.black.outbox, cfg.black.archive, retention_days=1)
    sealer = BundleSealer(cfg, store=StateStore(cfg.black.state_dir), gpg=gpg, outbox=outbox)
    for ch in cfg.channels:
        shipped = sealer.seal_rows(ch, _rows(ch.name, 5))
        assert [b.bundle_seq for b in shipped] == [1]  # each channel has its own sequence

    def can_read(home: Path, name: str) -> bool:
        f = next(cfg.black.outbox.glob(f"{name}.*.dbundle"))
        r = _gpg(home, "--output", str(short_tmp / "out.parquet"), "--yes", "--decrypt", str(f))
        ok = b"GOODSIG" in r.stderr and b"DECRYPTION_OKAY" in r.stderr
        if ok:
            m = json.loads(
                pq.ParquetFile(short_tmp / "out.parquet").metadata.metadata[b"diode.manifest"]
            )
            assert m["channel"] == name and m["rows"] == 5
            ids = pq.read_table(short_tmp / "out.parquet").column("message_id").to_pylist()
            assert ids == [f"{name}-{i}" for i in range(5)]
        return ok

    assert can_read(homes["ops"], "ops") and not can_read(homes["audit"], "ops")
    assert can_read(homes["ops"], "both") and can_read(homes["audit"], "both")

    # the opt-out: an OpenPGP *signed* message, readable by anyone, verified by the black key
    public = next(cfg.black.outbox.glob("public.*.dbundle"))
    pkts = subprocess.run(
        ["gpg", "--list-packets", str(public)], capture_output=True, text=True, check=False
    ).stdout
    # signed, not encrypted: no key packets, a one-pass signature (the signature packet
    # itself trails the partial-length literal data; the verification below checks it)
    assert ":pubkey enc packet:" not in pkts and ":onepass_sig packet:" in pkts
    r = _gpg(
        homes["audit"],
        "--output",
        str(short_tmp / "pub.parquet"),
        "--yes",
        "--decrypt",
        str(public),
    )
    assert b"GOODSIG" in r.stderr and b"VALIDSIG" in r.stderr and r.returncode == 0
    assert pq.read_table(short_tmp / "pub.parquet").num_rows == 5
