"""Red, verify: docs/protocol.md §7 checks 1-7 on real gpg-sealed files (bridge.red.verify).

Every reject also checks that nothing is left in plain_dir. Files come from tests/red_factory
(real keys, real codecs, real gpg), forgeries included.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import resource
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import init_side
from bridge.crypto.passphrase import Passphrase
from bridge.errors import ConfigError, CryptoError
from bridge.protocol.bundle import pack_bundle
from bridge.protocol.manifest import Gap, Manifest, parse_utc
from bridge.red.verify import (
    OUTPUT_SLACK,
    REASONS,
    VERDICT_SCHEMA,
    NoRoomNow,
    Verdict,
    VerifyContext,
    VerifyEnvironmentError,
    held_beside,
    plain_need,
    plain_room,
    sweep_plain_dir,
    verify_file,
)
from tests.integration.test_gpg import busy_message
from tests.red_factory import (
    RedKeys,
    make_bundle,
    make_chain,
    make_heartbeat,
    make_rows,
    red_config,
    seal_as,
    temp_red_keys,
)
from tests.support import small_tmpfs

CHANNELS = {"orders": True, "plain": False}


@pytest.fixture(scope="module")
def keys() -> Iterator[RedKeys]:
    with temp_red_keys("rv") as k:
        yield k


@pytest.fixture
def ctx(keys: RedKeys, short_tmp: Path) -> VerifyContext:
    return VerifyContext.from_config(red_config(short_tmp, keys, CHANNELS), environ={})


@pytest.fixture
def inbox(short_tmp: Path) -> Path:
    d = short_tmp / "inbox"
    d.mkdir()
    return d


def plain_left(ctx: VerifyContext) -> list[str]:
    d = Path(ctx.plain_dir)
    return sorted(os.listdir(d)) if d.exists() else []


def rejected(path: Path, name: str, ctx: VerifyContext, reason: str) -> Verdict:
    v = verify_file(path, name, ctx)
    assert (v.status, v.reason) == ("reject", reason), v
    assert v.plaintext_path is None and v.detail and name in v.detail
    assert plain_left(ctx) == [], "a reject left plaintext behind"
    return v


def flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------- good files


def test_hidden_recipients_opened_by_second_recipient_only(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(10)), None)
    assert keys.red_fprs["audit"] == keys.recipients[1]
    only_audit = dataclasses.replace(ctx, gnupg_home=str(keys.home_with_only("audit")))
    v = verify_file(b.path, b.name, only_audit)
    assert (v.status, v.kind, v.reason) == ("ok", "bundle", None), v.detail
    assert (v.channel, v.seq, v.bundle_id) == ("orders", 1, b.manifest.bundle_id)
    assert v.signer_fpr == keys.black_fpr and v.encrypted is True
    assert abs(parse_utc(v.signed_at or "").timestamp() - time.time()) < 120
    assert v.plaintext_path and Path(v.plaintext_path).parent == Path(ctx.plain_dir)
    assert Path(v.plaintext_path).read_bytes() == b.plaintext
    assert v.plaintext_sha256 == b.sha256 and v.plaintext_bytes == len(b.plaintext)
    assert v.manifest_json == b.manifest.to_json().decode()
    assert v.file_bytes == b.path.stat().st_size and v.heartbeat_json is None
    assert plain_left(ctx) == [Path(v.plaintext_path).name]


def test_first_recipient_home_opens_it_too(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None)
    v = verify_file(
        b.path, b.name, dataclasses.replace(ctx, gnupg_home=str(keys.home_with_only("red")))
    )
    assert v.ok, v.detail


def test_signed_only_channel(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "plain", 1, make_rows("plain", range(4)), None, encrypt=False)
    v = verify_file(b.path, b.name, ctx)
    assert v.ok and v.encrypted is False, v.detail
    assert v.plaintext_sha256 == b.sha256


def test_chain_with_gaps_and_zero_row_bundle(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    chain = make_chain(inbox, keys, "orders", 3, 4, gap_every=2, gap_size=3)
    zero = make_bundle(
        inbox, keys, "orders", 4, make_rows("orders", []), chain[-1].sha256,
        [Gap(15, 16, "expired")],
    )  # fmt: skip
    for b in [*chain, zero]:
        v = verify_file(b.path, b.name, ctx)
        assert v.ok and v.plaintext_sha256 == b.sha256, v.detail
        m = Manifest.from_json(v.manifest_json or "")
        assert m.bundle_seq == b.manifest.bundle_seq and m.gaps == b.manifest.gaps
    assert chain[1].manifest.prev_sha256 == chain[0].sha256
    assert chain[1].manifest.gaps == (Gap(4, 6, "maxlen"),)


def test_heartbeat_ok(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    hb = make_heartbeat(inbox, keys, "orders", 7, last_bundle_seq=3, last_seq=41)
    v = verify_file(hb.path, hb.name, ctx)
    assert (v.status, v.kind, v.channel, v.seq) == ("ok", "heartbeat", "orders", 7), v.detail
    assert v.heartbeat_json == hb.plaintext.decode() and v.plaintext_path is None
    assert v.encrypted is True and v.signer_fpr == keys.black_fpr
    assert plain_left(ctx) == []


# ---------------------------------------------------------------------------- checks 1-2


@pytest.mark.parametrize(
    "name",
    ["junk.txt", "orders.1.dbundle", "orders.000000000001.dbundle",
     "Orders.000000000001.dheartbeat", "orders.000000000000.dheartbeat",
     "orders.000000000001." + "A" * 32 + ".dbundle"],
)  # fmt: skip
def test_bad_name(ctx: VerifyContext, inbox: Path, name: str) -> None:
    p = inbox / "f"
    p.write_bytes(b"whatever")
    v = rejected(p, name, ctx, "bad_name")
    assert v.signer_fpr is None and v.file_bytes == 8


def test_unknown_channel_never_opened(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "nosuch", 1, make_rows("nosuch", range(2)), None)
    v = rejected(b.path, b.name, ctx, "unknown_channel")
    assert v.signer_fpr is None and v.channel == "nosuch" and v.seq == 1


# ---------------------------------------------------------------------------- check 3


def test_forged_signer_not_pinned(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(
        inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
        signer_home=keys.forger_home, signer_fpr=keys.forger_fpr,
    )  # fmt: skip
    knows = dataclasses.replace(ctx, gnupg_home=str(keys.home_knowing_forger()))
    v = rejected(b.path, b.name, knows, "unpinned_signer")
    assert keys.forger_fpr in (v.detail or "")
    # red without the forger's public key: an unknown key
    rejected(b.path, b.name, ctx, "signature")


def test_flipped_ciphertext_byte(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(50)), None)
    flip(b.path, b.path.stat().st_size // 2)
    rejected(b.path, b.name, ctx, "crypto")


def test_flipped_byte_of_signed_only_message(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    b = make_bundle(inbox, keys, "plain", 1, make_rows("plain", range(50)), None, encrypt=False)
    flip(b.path, b.path.stat().st_size // 2)
    rejected(b.path, b.name, ctx, "signature")


@pytest.mark.parametrize("keep", [100, 0.5, -10])
def test_truncated(keys: RedKeys, ctx: VerifyContext, inbox: Path, keep: float) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(50)), None)
    data = b.path.read_bytes()
    b.path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    rejected(b.path, b.name, ctx, "crypto")


def test_plain_junk(ctx: VerifyContext, inbox: Path) -> None:
    name = "orders.000000000001." + "c" * 32 + ".dbundle"
    # a first octet with bit 7 clear is no OpenPGP packet at all
    (inbox / name).write_bytes(b"\x00" + random.Random(5).randbytes(4999))
    rejected(inbox / name, name, ctx, "crypto")
    # random bytes now and then parse as packets that carry no good signature (a CI run met
    # one): rejected either way, as crypto or as signature, and nothing is left behind
    for seed in range(8):
        (inbox / name).write_bytes(random.Random(seed).randbytes(5000))
        v = verify_file(inbox / name, name, ctx)
        assert v.status == "reject" and v.reason in ("crypto", "signature"), (seed, v)
        assert v.plaintext_path is None and plain_left(ctx) == [], seed
    hb = "orders.000000000001.dheartbeat"
    (inbox / hb).write_bytes(b"\x00" * 100)
    rejected(inbox / hb, hb, ctx, "crypto")


def test_a_passphrase_encrypted_file_is_rejected_not_blamed_on_this_host(
    ctx: VerifyContext, inbox: Path, short_tmp: Path
) -> None:
    """A symmetric (passphrase) message makes gpg ask for a passphrase it cannot get in batch
    mode; 1 in a few thousand random junk files parses as one too. It is the file's fault (red
    is only ever encrypted to by public key), so it is rejected, never left in intake as a
    host error that would stall the job."""
    name = "orders.000000000001." + "d" * 32 + ".dbundle"
    home = short_tmp / "symhome"
    home.mkdir(mode=0o700)
    subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--yes", "--pinentry-mode", "loopback",
         "--passphrase", "not-red", "--symmetric", "--output", str(inbox / name)],
        input=b"x" * 2000, check=True, capture_output=True,
    )  # fmt: skip
    v = rejected(inbox / name, name, ctx, "crypto")
    assert "passphrase" in (v.detail or "")


def test_not_for_our_keys(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    """Encrypted to the audit key only; a red home holding only the red key cannot open it."""
    name = "orders.000000000001." + "d" * 32 + ".dbundle"
    p = seal_as(inbox, keys, name, b"secret", recipients=[keys.red_fprs["audit"]])
    rejected(
        p, name, dataclasses.replace(ctx, gnupg_home=str(keys.home_with_only("red"))), "crypto"
    )


def forged_signed_message(signer_uid: bytes) -> bytes:
    """A signed message by a key nobody has (id 1122334455667788), ~100 bytes, whose signature
    carries ``signer_uid`` as its Signer's User ID subpacket: gpg prints that text verbatim on
    stderr (``issuer "..."``), next to its own diagnostics and status lines."""

    def pkt(tag: int, body: bytes) -> bytes:
        n = len(body)
        if n < 192:
            return bytes([0xC0 | tag, n]) + body
        return bytes([0xC0 | tag, ((n - 192) >> 8) + 192, (n - 192) & 0xFF]) + body

    def sub(kind: int, data: bytes) -> bytes:
        return bytes([len(data) + 1, kind]) + data

    keyid, now = bytes.fromhex("1122334455667788"), struct.pack(">I", int(time.time()))
    hashed = sub(2, now) + sub(28, signer_uid)
    unhashed = sub(16, keyid)
    mpi = struct.pack(">H", 255) + b"\x80" + b"\x11" * 31  # EdDSA r and s, never valid
    sig = (bytes([4, 0, 22, 8]) + struct.pack(">H", len(hashed)) + hashed
           + struct.pack(">H", len(unhashed)) + unhashed + b"\x12\x34" + mpi + mpi)  # fmt: skip
    ops = pkt(4, bytes([3, 0, 8, 22]) + keyid + b"\x01")
    literal = pkt(11, b"b\x00" + now + b"hello")
    return ops + literal + pkt(2, sig)


@pytest.mark.parametrize(
    "uid",
    [b"no space left on device", b"Permission denied", b"bad passphrase",
     b"can't connect to the agent", b"error writing", b"Disk quota exceeded",
     # Python splits lines on U+2028 too, which gpg does not escape: forged status lines
     "x\u2028[GNUPG:] BAD_PASSPHRASE 1122334455667788\u2028[GNUPG:] MISSING_PASSPHRASE\u2028"
     "[GNUPG:] FAILURE decrypt 33554453\u2028[GNUPG:] ERROR write 33587249".encode()],
    ids=["nospace", "perm", "badpass", "agent", "write", "quota", "status"],
)  # fmt: skip
def test_forged_issuer_text_is_rejected_not_blamed_on_this_host(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, uid: bytes
) -> None:
    """The text of an unknown signer's user id reaches gpg's stderr; host-fault words in it
    must not stop red (VerifyEnvironmentError leaves the file in intake forever): the file is
    quarantined as a bad signature, on every channel kind and for heartbeats too."""
    data = forged_signed_message(uid)
    for name in ("orders.000000000001." + "7" * 32 + ".dbundle",
                 "plain.000000000001." + "7" * 32 + ".dbundle",
                 "orders.000000000001.dheartbeat"):  # fmt: skip
        (inbox / name).write_bytes(data)
        v = rejected(inbox / name, name, ctx, "signature")
        assert "1122334455667788" in (v.detail or ""), v.detail
    # the same file with a harmless user id, for comparison
    (inbox / "f").write_bytes(forged_signed_message(b"alice"))
    rejected(inbox / "f", "orders.000000000002." + "7" * 32 + ".dbundle", ctx, "signature")


@pytest.fixture(scope="module")
def bomb(keys: RedKeys) -> Path:
    """500 MB of zeros, signed by the PINNED key, compressed -z 9, encrypted to red."""
    out = keys.root / "bomb.gpg"
    zeros = subprocess.Popen(["head", "-c", str(500 * 2**20), "/dev/zero"], stdout=subprocess.PIPE)
    args = ["gpg", "--homedir", str(keys.black_home), "--batch", "--trust-model", "always",
            "-z", "9", "--throw-keyids", "--local-user", keys.black_fpr]  # fmt: skip
    for r in keys.recipients:
        args += ["--recipient", r]
    subprocess.run([*args, "--sign", "--encrypt", "--output", str(out)], stdin=zeros.stdout,
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    assert zeros.wait() == 0 and out.stat().st_size < 2 * 2**20
    return out


class PeakWatcher:
    """Samples the total size of plain_dir while a verification runs."""

    def __init__(self, d: Path) -> None:
        self.d, self.peak, self._stop = d, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                for e in os.scandir(self.d):
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        pass
            except FileNotFoundError:
                pass
            self.peak = max(self.peak, total)
            time.sleep(0.0005)

    def __enter__(self) -> PeakWatcher:
        self.d.mkdir(parents=True, exist_ok=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def test_compression_bomb_capped(ctx: VerifyContext, inbox: Path, bomb: Path) -> None:
    name = "orders.000000000001." + "e" * 32 + ".dbundle"
    p = inbox / name
    shutil.copyfile(bomb, p)
    cap = p.stat().st_size + OUTPUT_SLACK
    with PeakWatcher(Path(ctx.plain_dir)) as w:
        v = rejected(p, name, ctx, "crypto")
    assert "compression bomb" in (v.detail or "")
    assert 0 < w.peak <= cap, f"plain_dir peaked at {w.peak} bytes, cap {cap}"


def test_plaintext_over_configured_cap(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    rows = make_rows("orders", range(40), body_bytes=50_000)  # ~2 MB incompressible
    b = make_bundle(inbox, keys, "orders", 1, rows, None)
    capped = dataclasses.replace(ctx, max_plain_bytes=500_000)
    with PeakWatcher(Path(ctx.plain_dir)) as w:
        v = rejected(b.path, b.name, capped, "too_large")
    assert "max_plain_bytes" in (v.detail or "")
    assert w.peak <= 500_000
    # far too large on the wire: refused before gpg runs
    tiny = dataclasses.replace(ctx, max_plain_bytes=1000)
    with PeakWatcher(Path(ctx.plain_dir)) as w:
        rejected(b.path, b.name, tiny, "too_large")
    assert w.peak == 0
    assert verify_file(b.path, b.name, dataclasses.replace(ctx, max_plain_bytes=10**8)).ok


def test_heartbeat_file_too_large(ctx: VerifyContext, inbox: Path) -> None:
    name = "orders.000000000001.dheartbeat"
    with open(inbox / name, "wb") as f:
        f.truncate(2 * 2**20)
    rejected(inbox / name, name, ctx, "too_large")


# ---------------------------------------------------------------------------- check 4


def test_signed_only_on_encrypted_channel_is_downgrade(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None, encrypt=False)
    v = rejected(b.path, b.name, ctx, "downgrade")
    assert v.signer_fpr == keys.black_fpr and v.encrypted is False
    hb = make_heartbeat(inbox, keys, "orders", 1, encrypt=False)
    rejected(hb.path, hb.name, ctx, "downgrade")


def test_encrypted_on_signed_only_channel_is_rejected(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    b = make_bundle(inbox, keys, "plain", 1, make_rows("plain", range(3)), None, encrypt=True)
    rejected(b.path, b.name, ctx, "downgrade")


# ---------------------------------------------------------------------------- checks 5-7


def test_signed_junk_plaintext_is_malformed(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    name = "orders.000000000001." + "f" * 32 + ".dbundle"
    p = seal_as(inbox, keys, name, b"PAR1 not really parquet PAR1")
    v = rejected(p, name, ctx, "malformed")
    assert v.signer_fpr == keys.black_fpr and v.plaintext_sha256  # gpg was happy


def test_parquet_without_manifest_is_malformed(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    sink = pa.BufferOutputStream()
    import pyarrow.parquet as pq

    pq.write_table(make_rows("orders", range(3)), sink)
    name = "orders.000000000001." + "1" * 32 + ".dbundle"
    p = seal_as(inbox, keys, name, sink.getvalue().to_pybytes())
    rejected(p, name, ctx, "malformed")


@pytest.mark.parametrize(
    "override", [{"rows": -1}, {"created_at": "yesterday"}, {"prev_sha256": "00"}, {"gaps": 3}]
)
def test_invalid_manifest_is_malformed(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, override: dict[str, object]
) -> None:
    b = make_bundle(inbox, keys, "orders", 2, make_rows("orders", range(3)), "a" * 64,
                    manifest_overrides=override)  # fmt: skip
    rejected(b.path, b.name, ctx, "malformed")


@pytest.mark.parametrize("override", [{"schema_version": 99}, {"format": 2}, {"format": "1"}])
def test_unknown_version(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, override: dict[str, object]
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    manifest_overrides=override)  # fmt: skip
    rejected(b.path, b.name, ctx, "unknown_version")


@pytest.mark.parametrize(
    "override", [{"bundle_seq": 9, "prev_sha256": "b" * 64}, {"bundle_id": "0" * 32},
                 {"channel": "plain"}]
)  # fmt: skip
def test_signed_manifest_disagrees_with_name(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, override: dict[str, object]
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    manifest_overrides=override)  # fmt: skip
    v = rejected(b.path, b.name, ctx, "name_mismatch")
    assert v.signer_fpr == keys.black_fpr and v.manifest_json


def test_renamed_file_is_name_mismatch(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "orders", 3, make_rows("orders", range(3)), "c" * 64,
                    name_override="orders.000000000004." + "9" * 32 + ".dbundle")  # fmt: skip
    v = rejected(b.path, b.name, ctx, "name_mismatch")
    assert (v.seq, v.bundle_id) == (4, "9" * 32)  # ids of the NAME


def test_wrong_bridge(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    bridge_id="other-bridge")  # fmt: skip
    v = rejected(b.path, b.name, ctx, "wrong_bridge")
    assert "other-bridge" in (v.detail or "")
    hb = make_heartbeat(inbox, keys, "orders", 2, bridge_id="other-bridge")
    rejected(hb.path, hb.name, ctx, "wrong_bridge")


@pytest.mark.parametrize(
    "override",
    [{"exchanges": {"elsewhere": 3}}, {"first_seq": 1, "last_seq": 3},
     {"rows": 4, "last_seq": 3, "exchanges": {"orders": 4}}],
)  # fmt: skip
def test_rows_disagree_with_manifest(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, override: dict[str, object]
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    manifest_overrides=override)  # fmt: skip
    rejected(b.path, b.name, ctx, "inconsistent")


def test_row_inside_declared_gap_is_inconsistent(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    manifest_overrides={"gaps": [{"first_seq": 1, "last_seq": 1,
                                                  "reason": "maxlen"}]})  # fmt: skip
    rejected(b.path, b.name, ctx, "inconsistent")


@pytest.mark.parametrize(
    "kw",
    [{"name_override": "orders.000000000008.dheartbeat"},
     {"doc_overrides": {"channel": "plain"}}],
)  # fmt: skip
def test_heartbeat_name_mismatch(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, kw: dict[str, object]
) -> None:
    hb = make_heartbeat(inbox, keys, "orders", 5, **kw)  # type: ignore[arg-type]
    v = rejected(hb.path, hb.name, ctx, "name_mismatch")
    assert v.heartbeat_json and v.kind == "heartbeat"


@pytest.mark.parametrize(
    ("override", "reason"),
    [({"format": 2}, "unknown_version"), ({"interval_seconds": 0}, "malformed"),
     ({"counters": {"x": -1}}, "malformed")],
)  # fmt: skip
def test_heartbeat_bad_document(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, override: dict[str, object], reason: str
) -> None:
    hb = make_heartbeat(inbox, keys, "orders", 5, doc_overrides=override)
    rejected(hb.path, hb.name, ctx, reason)


# ---------------------------------------------------------------------------- host faults


def test_gpg_missing_raises(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None)
    broken = dataclasses.replace(ctx, gpg_binary="/nonexistent/gpg")
    with pytest.raises(CryptoError, match="not found"):
        verify_file(b.path, b.name, broken)
    assert plain_left(ctx) == []


def test_missing_intake_file_raises(ctx: VerifyContext, inbox: Path) -> None:
    with pytest.raises(FileNotFoundError):
        verify_file(inbox / "gone", "orders.000000000001.dheartbeat", ctx)


def test_locked_key_raises_instead_of_quarantining(
    keys: RedKeys, ctx: VerifyContext, short_tmp: Path, inbox: Path
) -> None:
    """A protected red key: wrong or missing passphrase is a host fault, never a reject."""
    right, wrong = short_tmp / "right", short_tmp / "wrong"
    for f, text in ((right, "open sesame\n"), (wrong, "nope\n")):
        f.write_text(text)
        f.chmod(0o600)
    locked = init_side("red", short_tmp / "lk", name="locked", pub_dir=short_tmp / "pub",
                       passphrase=Passphrase(path=right))  # fmt: skip
    Gpg(keys.black_home).import_keys(locked.public_file.read_bytes())
    Gpg(locked.home).import_keys((keys.pub_dir / "black.asc").read_bytes())
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None,
                    recipients=[locked.fpr])  # fmt: skip
    base = dataclasses.replace(ctx, gnupg_home=str(locked.home))
    for pp in (str(wrong), None):  # before the right one: gpg-agent would cache it
        with pytest.raises(VerifyEnvironmentError):
            verify_file(b.path, b.name, dataclasses.replace(base, passphrase_file=pp))
        assert plain_left(ctx) == []
    v = verify_file(b.path, b.name, dataclasses.replace(base, passphrase_file=str(right)))
    assert v.ok, v.detail


def test_plain_dir_that_cannot_hold_the_plaintext_raises(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    """gpg fails writing a good bundle's plaintext (here a file-size limit; a full disk or an
    exhausted quota alike): a fault of this host, found by trying to allocate the room."""
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(40), body_bytes=50_000),
                    None)  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    was = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, also in gpg
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
        with pytest.raises(VerifyEnvironmentError, match=b.name):
            verify_file(b.path, b.name, ctx)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, was)
    assert plain_left(ctx) == []
    assert verify_file(b.path, b.name, ctx).ok


def test_pinned_signer_missing_from_the_keyring_raises(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    """ "Unknown key" while a pinned signer is not in the keyring (unreadable, replaced): every
    good bundle by it would be quarantined, so this host is at fault."""
    name = "orders.000000000001." + "8" * 32 + ".dbundle"
    (inbox / name).write_bytes(forged_signed_message(b"alice"))
    lost = dataclasses.replace(ctx, pinned_signers=(keys.black_fpr, keys.forger_fpr))
    with pytest.raises(VerifyEnvironmentError, match=keys.forger_fpr):
        verify_file(inbox / name, name, lost)
    assert plain_left(ctx) == []


def test_bundle_larger_than_the_plain_file_system_is_rejected(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose plaintext can never fit where it is written would stall red forever as a
    host fault: rejected before gpg runs instead."""
    b = make_bundle(inbox, keys, "orders", 1, make_rows("orders", range(3)), None)
    size = b.path.stat().st_size
    tiny = SimpleNamespace(f_frsize=1, f_blocks=size - 1, f_bfree=size - 1, f_bavail=size - 1)
    monkeypatch.setattr(os, "statvfs", lambda _p: tiny)
    with PeakWatcher(Path(ctx.plain_dir)) as w:
        v = rejected(b.path, b.name, ctx, "too_large")
    assert "file system" in (v.detail or "") and w.peak == 0
    monkeypatch.undo()
    assert verify_file(b.path, b.name, ctx).ok


def test_a_file_that_keeps_gpg_busy_is_rejected_once_this_host_checks_out(
    keys: RedKeys, ctx: VerifyContext, inbox: Path
) -> None:
    """A few KB of nested compressed packets keep gpg busy for hours (no output, no status
    line). Past its time (a base plus the size at a slow rate) gpg is killed; this host checks
    out (keys unlock, pinned keys present, room), so the file is quarantined instead of
    stopping red at every start. Bundles and heartbeats alike."""
    quick = dataclasses.replace(ctx, gpg_open_base_seconds=1.0)
    for name in ("orders.000000000001." + "b" * 32 + ".dbundle", "orders.000000000001.dheartbeat"):
        (inbox / name).write_bytes(busy_message(3))
        t0 = time.monotonic()
        v = rejected(inbox / name, name, quick, "crypto")
        assert "gpg did not finish within 1 s" in (v.detail or ""), v.detail
        assert time.monotonic() - t0 < 15
    # the host checks do run: a pinned key missing from the keyring stops red instead
    lost = dataclasses.replace(quick, pinned_signers=(keys.black_fpr, keys.forger_fpr))
    with pytest.raises(VerifyEnvironmentError, match=keys.forger_fpr):
        verify_file(inbox / name, name, lost)
    assert plain_left(ctx) == []


def test_a_bundle_bigger_than_the_free_space_waits_without_filling_the_disk(
    keys: RedKeys, ctx: VerifyContext, inbox: Path, short_tmp: Path
) -> None:
    """gpg writes the plaintext before it checks the signature: a hostile file bigger than
    the free space (not than the file system) would fill the disk and stop red at every start.
    It is not opened while it cannot fit (a host condition the source waits out), and is judged
    once there is room."""
    name = "orders.000000000001." + "f" * 32 + ".dbundle"
    subprocess.run(
        ["gpg", "--homedir", str(keys.forger_home), "--batch", "-z", "0", "--store",
         "--output", str(inbox / name)],
        input=random.Random(3).randbytes(8 * 2**20), check=True, capture_output=True,
    )  # fmt: skip
    with small_tmpfs("48m", "rvroom") as fs:
        small = dataclasses.replace(ctx, plain_dir=str(fs / "plain"))
        filler = fs / "filler"
        filler.write_bytes(bytes(44 * 2**20))  # 4 MiB left: less than the 8 MiB plaintext
        with PeakWatcher(fs / "plain") as w, pytest.raises(NoRoomNow, match=name) as info:
            verify_file(inbox / name, name, small)
        assert w.peak == 0, f"gpg wrote {w.peak} bytes into a disk without room for them"
        assert "stays in intake" in str(info.value)
        filler.write_bytes(bytes(24 * 2**20))  # 24 MiB free: 8 MiB + the reserve do not fit
        with pytest.raises(NoRoomNow):
            verify_file(inbox / name, name, small)
        filler.unlink()
        v = rejected(inbox / name, name, small, "signature")  # judged once there is room
        assert "no signature" in (v.detail or "")


# ---------------------------------------------------------------------------- context, rows


def test_a_bundle_that_can_never_fit_beside_itself_is_rejected_not_left_waiting(
    keys: RedKeys, ctx: VerifyContext
) -> None:
    """The intake file stays on disk while gpg writes its plaintext: where both share a file
    system, a file bigger than half of it could never be opened, however much is freed. It is
    rejected ``too_large`` before gpg runs, instead of waiting in intake forever."""
    name = "orders.000000000001." + "e" * 32 + ".dbundle"
    with small_tmpfs("16m", "rvhalf") as fs:
        (fs / "plain").mkdir()
        (fs / "intake").mkdir()
        path = fs / "intake" / name
        subprocess.run(
            ["gpg", "--homedir", str(keys.forger_home), "--batch", "-z", "0", "--store",
             "--output", str(path)],
            input=random.Random(4).randbytes(9 * 2**20), check=True, capture_output=True,
        )  # fmt: skip
        small = dataclasses.replace(ctx, plain_dir=str(fs / "plain"))
        room = plain_room(fs / "plain")
        assert path.stat().st_size < room.capacity < 2 * path.stat().st_size  # the case
        with PeakWatcher(fs / "plain") as w:
            v = rejected(path, name, small, "too_large")
        assert w.peak == 0 and "beside the file itself" in (v.detail or ""), v.detail
        held = held_beside(path, path.stat().st_size, fs / "plain")
        assert held == path.stat().st_size
        assert plain_need(name, held, small, room.beside(held)) == 0  # the source agrees
        assert plain_need(name, held, small, room) == held  # as it judged before


def test_context_from_config_and_pickle(keys: RedKeys, short_tmp: Path) -> None:
    pp = short_tmp / "pp"
    pp.write_text("secret\n")
    pp.chmod(0o600)
    cfg = red_config(short_tmp, keys, CHANNELS, red={"passphrase_file": str(pp)})
    c = VerifyContext.from_config(cfg, environ={})
    assert c.passphrase_file == str(pp) and c.passphrase_env is None
    assert c.channels == CHANNELS and c.pinned_signers == (keys.black_fpr,)
    assert c.plain_dir == str(short_tmp / "red" / "work" / "plain")
    blob = pickle.dumps(c)
    assert b"secret" not in blob and pickle.loads(blob) == c
    env = VerifyContext.from_config(
        red_config(short_tmp, keys, CHANNELS), environ={"DIODE_RED_PASSPHRASE": "x"}
    )
    assert env.passphrase_env == "DIODE_RED_PASSPHRASE" and env.passphrase_file is None
    none = VerifyContext.from_config(red_config(short_tmp, keys, CHANNELS), environ={})
    assert none.passphrase() is None
    with pytest.raises(ConfigError):  # both sources at once is refused at startup
        VerifyContext.from_config(cfg, environ={"DIODE_RED_PASSPHRASE": "x"})
    pickle.loads(pickle.dumps(verify_file))


def test_sweep_plain_dir(short_tmp: Path) -> None:
    d = short_tmp / "plain"
    d.mkdir()
    for n in ("a.dbundle.0123456789ab.parquet", ".a.dbundle.x.parquet.0123456789ab.tmp"):
        (d / n).write_bytes(b"p")
    (d / "keep.txt").write_bytes(b"k")
    (d / "sub.parquet").mkdir()
    assert sweep_plain_dir(d) == 2
    assert sorted(os.listdir(d)) == ["keep.txt", "sub.parquet"]
    assert sweep_plain_dir(short_tmp / "absent") == 0


_opt_str = st.none() | st.text(max_size=40)
_opt_int = st.none() | st.integers(-(2**63), 2**63 - 1)
verdicts = st.builds(
    Verdict,
    name=st.text(min_size=1, max_size=80),
    kind=st.sampled_from(["bundle", "heartbeat", "other"]),
    status=st.just("reject"),
    file_bytes=st.integers(0, 2**62),
    reason=st.sampled_from(REASONS),
    detail=_opt_str,
    channel=_opt_str,
    seq=_opt_int,
    bundle_id=_opt_str,
    signer_fpr=_opt_str,
    signed_at=_opt_str,
    encrypted=st.none() | st.booleans(),
    plaintext_sha256=_opt_str,
    plaintext_bytes=_opt_int,
    manifest_json=_opt_str,
    heartbeat_json=_opt_str,
) | st.builds(
    Verdict,
    name=st.text(min_size=1, max_size=80),
    kind=st.sampled_from(["bundle", "heartbeat"]),
    status=st.just("ok"),
    file_bytes=st.integers(0, 2**62),
    plaintext_path=_opt_str,
    seq=_opt_int,
)


@given(st.lists(verdicts, max_size=5))
def test_verdict_rows_round_trip_through_arrow(vs: list[Verdict]) -> None:
    table = pa.Table.from_pylist([v.to_row() for v in vs], schema=VERDICT_SCHEMA)
    assert table.schema.equals(VERDICT_SCHEMA)
    assert [Verdict.from_row(r) for r in table.to_pylist()] == vs


def test_verdict_refuses_unknown_codes() -> None:
    with pytest.raises(ValueError):
        Verdict(name="n", kind="bundle", status="reject", file_bytes=0, reason="nope")
    with pytest.raises(ValueError):
        Verdict(name="n", kind="bundle", status="ok", file_bytes=0, reason="crypto")
    with pytest.raises(ValueError):
        Verdict(name="n", kind="parcel", status="ok", file_bytes=0)  # type: ignore[arg-type]


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(max_size=200) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_any_name_without_gpg_never_raises(ctx: VerifyContext, inbox: Path, name: str) -> None:
    """Names that fail checks 1-2 are rejected without running gpg (a missing binary proves it)."""
    p = inbox / "file"
    p.write_bytes(b"x")
    no_gpg = dataclasses.replace(ctx, gpg_binary="/nonexistent/gpg")
    try:
        v = verify_file(p, name, no_gpg)
    except CryptoError:  # it got past checks 1-2: a real, configured channel name
        assert name.split(".")[0] in CHANNELS
        return
    assert v.status == "reject" and v.reason in ("bad_name", "unknown_channel")
    assert Verdict.from_row(pa.Table.from_pylist([v.to_row()], VERDICT_SCHEMA).to_pylist()[0]) == v


# ---------------------------------------------------------------------------- throughput


@pytest.mark.skipif(not os.environ.get("DIODE_BENCH"), reason="set DIODE_BENCH=1 to measure")
def test_throughput_100mb(keys: RedKeys, ctx: VerifyContext, inbox: Path) -> None:
    rows = make_rows("orders", range(100), body_bytes=1_000_000)  # ~100 MB incompressible
    b = make_bundle(inbox, keys, "orders", 1, rows, None)
    mb = len(b.plaintext) / 1e6
    t0 = time.perf_counter()
    r = subprocess.run(["gpg", "--homedir", str(keys.red_home), "--batch", "--yes",
                        "--output", str(inbox / "raw.out"), "--decrypt", str(b.path)],
                       capture_output=True, check=False)  # fmt: skip
    raw = time.perf_counter() - t0
    assert r.returncode in (0, 2) and (inbox / "raw.out").stat().st_size == len(b.plaintext)
    t0 = time.perf_counter()
    v = verify_file(b.path, b.name, ctx)
    ours = time.perf_counter() - t0
    assert v.ok, v.detail
    print(f"\n{mb:.1f} MB plaintext: raw gpg --decrypt {mb / raw:.0f} MB/s ({raw:.2f} s), "
          f"verify_file {mb / ours:.0f} MB/s ({ours:.2f} s)")  # fmt: skip


def test_pack_bundle_is_what_factory_embeds(keys: RedKeys, inbox: Path) -> None:
    rows = make_rows("orders", range(5))
    b = make_bundle(inbox, keys, "orders", 1, rows, None)
    assert b.plaintext == pack_bundle(rows, b.manifest) and b.manifest_json == b.manifest.to_json()
