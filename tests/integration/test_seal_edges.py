"""Integration: sealer edge cases with real gpg and Parquet — a crash after delivery but before
the journal is finished from the archived copy (same ciphertext, no re-encryption); a single
message that only exceeds the file ceiling once packed becomes an "oversize" gap."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pika
import pyarrow as pa
import pytest

from bridge.black.seal import BundleSealer, seal_overhead_bytes
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_keys
from bridge.diode.file_drop import Outbox
from bridge.protocol.bundle import unpack_bundle
from bridge.protocol.rows import RowBuilder

pytestmark = pytest.mark.gpg


def _setup(tmp: Path, **bundle: Any) -> tuple[Config, Any]:
    inv = init_keys(tmp / "keys")
    cfg = config_from_dict(
        {
            "link": {"black_signers": [inv.black_fpr]},
            "channels": [{"name": "c", "recipients": list(inv.red_fprs.values())}],
            "black": {"gnupg_home": str(inv.black_home), "signing_key": inv.black_fpr,
                      "bundle": {"max_rows": 10, **bundle}},
        },
        base=tmp, environ={},
    )  # fmt: skip
    return cfg, inv


def _sealer(cfg: Config, cls: type[BundleSealer] = BundleSealer) -> BundleSealer:
    outbox = Outbox(cfg.black.outbox, cfg.black.archive, retention_days=1)
    return cls(
        cfg, store=StateStore(cfg.black.state_dir), gpg=Gpg(cfg.black.gnupg_home), outbox=outbox
    )


def _rows(n: int, body: bytes | None = None) -> pa.Table:
    b = RowBuilder("c")
    for i in range(n):
        b.append(i, None, "x", "k", pika.BasicProperties(message_id=str(i)), body or b"%d" % i)
    return b.to_table()


class Crash(BaseException):
    """A kill -9 stand-in: nothing after it runs."""


def test_crash_after_delivery_is_finished_from_the_archive(short_tmp: Path) -> None:
    cfg, _ = _setup(short_tmp)
    calls = {"n": 0}

    class CrashOnSecondCommit(BundleSealer):
        def _commit(self, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
            calls["n"] += 1
            if calls["n"] == 2:
                raise Crash()
            return super()._commit(*a, **kw)

    table = _rows(25)
    with pytest.raises(Crash):
        _sealer(cfg, CrashOnSecondCommit).seal_rows(
            cfg.channels[0], table, first_retained=lambda: 0
        )
    st = json.loads((Path(cfg.black.state_dir) / "channel-c.json").read_text())
    assert st["last_bundle_seq"] == 1 and st["pending"] is not None
    second = sorted(cfg.black.outbox.glob("c.000000000002.*.dbundle"))
    assert len(second) == 1, "bundle 2 was delivered before the crash"
    sealed_before = second[0].read_bytes()
    second[0].unlink()  # the mover took it already

    shipped = _sealer(cfg).seal_rows(cfg.channels[0], table, first_retained=lambda: 0)
    assert [b.bundle_seq for b in shipped] == [2, 3]
    again = sorted(cfg.black.outbox.glob("c.000000000002.*.dbundle"))
    assert len(again) == 1 and again[0].read_bytes() == sealed_before, "same ciphertext, re-dropped"
    st = json.loads((Path(cfg.black.state_dir) / "channel-c.json").read_text())
    assert (st["last_bundle_seq"], st["last_seq"], st["pending"]) == (3, 24, None)


def test_single_message_over_the_ceiling_once_packed_is_an_oversize_gap(short_tmp: Path) -> None:
    cfg, inv = _setup(short_tmp, max_file_bytes=65536)
    max_plain = 65536 - seal_overhead_bytes(2, 65536)
    # just under the estimate's per-row limit, but Parquet framing pushes it over the ceiling
    body = os.urandom(max_plain - 4096 - 256 - 40)
    table = pa.concat_tables([_rows(1), _rows(2, body).slice(1, 1), _rows(3).slice(2, 1)])
    shipped = _sealer(cfg).seal_rows(cfg.channels[0], table, first_retained=lambda: 0)
    gaps = [g for b in shipped for g in b.gaps]
    rows = sum(b.rows for b in shipped)
    red = Gpg(inv.red_home)
    for p in cfg.black.outbox.glob("*.dbundle"):
        assert p.stat().st_size <= 65536
        plain, _ = red.open_bytes(p.read_bytes(), pinned_signers=[inv.black_fpr])
        unpack_bundle(plain)
    # the estimate let it through, the packed size (~6 KB of Parquet framing) did not
    assert [(g.first_seq, g.last_seq, g.reason) for g in gaps] == [(1, 1, "oversize")]
    assert rows == 2
