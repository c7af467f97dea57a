"""Crypto: seal/open and key setup against the real gpg binary (no mocks)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
import tomllib
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.config import config_from_dict
from bridge.crypto.gpg import OPEN_BYTES_PER_SECOND, Gpg, GpgTimeout, Opened
from bridge.crypto.keys import generate_key, init_keys
from bridge.crypto.passphrase import Passphrase
from bridge.errors import CryptoError, KeyMissingError, SignatureError

pytestmark = pytest.mark.gpg

ABSENT_FPR = "0123456789ABCDEF0123456789ABCDEF01234567"


@dataclass
class World:
    """A black home and two independent red sites, cross-imported like a real install."""

    root: Path
    black: Gpg
    b: str
    red1: Gpg
    r1: str
    red2: Gpg
    r2: str


def _gpg_cli(home: Path, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--no-tty", *args],
        input=data,
        stdin=None if data is not None else subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )


@pytest.fixture
def world(short_tmp: Path) -> World:
    black = Gpg(short_tmp / "b")
    b = generate_key(black, "test black", role="sign")
    red1, red2 = Gpg(short_tmp / "r1"), Gpg(short_tmp / "r2")
    r1 = generate_key(red1, "test red1", role="encrypt")
    r2 = generate_key(red2, "test red2", role="encrypt")
    black.import_keys(red1.export_public(r1))
    black.import_keys(red2.export_public(r2))
    for red in (red1, red2):
        red.import_keys(black.export_public(b))
    return World(short_tmp, black, b, red1, r1, red2, r2)


def _payload(root: Path, size: int = 300_000) -> Path:
    src = root / "bundle.parquet"
    src.write_bytes(os.urandom(size))
    return src


def _only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- round trips


def test_two_hidden_recipients_each_red_reads_alone(world: World) -> None:
    src = _payload(world.root)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1, world.r2])
    packets = _gpg_cli(world.root / "b", "--list-packets", str(sealed)).stdout.decode()
    assert packets.count("keyid 0000000000000000") == 2  # --throw-keyids: nobody is named
    assert "compressed packet" not in packets  # -z 0
    for i, red in enumerate((world.red1, world.red2)):
        out_dir = world.root / f"out{i}"
        out_dir.mkdir()
        opened = red.open(sealed, out_dir / "plain.parquet", pinned_signers=[world.b])
        assert (out_dir / "plain.parquet").read_bytes() == src.read_bytes()
        assert _only(out_dir) == ["plain.parquet"]
        assert opened.signer_fpr == world.b and opened.encrypted is True
        assert abs(opened.signed_at - datetime.now(UTC)) < timedelta(minutes=5)
        assert opened.signed_at.tzinfo is not None


def test_visible_recipients_name_the_subkeys(world: World) -> None:
    src = _payload(world.root, 1000)
    sealed = world.root / "x.dbundle"
    world.black.seal(
        src, sealed, signer=world.b, recipients=[world.r1, world.r2], hide_recipients=False
    )
    packets = _gpg_cli(world.root / "b", "--list-packets", str(sealed)).stdout.decode()
    assert "keyid 0000000000000000" not in packets
    assert packets.count(":pubkey enc packet:") == 2


def test_signed_only_round_trip(world: World) -> None:
    src = _payload(world.root, 50_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[], encrypt=False)
    raw = sealed.read_bytes()
    assert not raw.startswith(b"-----BEGIN")  # binary, not armored nor clearsigned
    assert src.read_bytes() in raw  # signed, not encrypted, not compressed
    dst = world.root / "plain"
    opened = world.red2.open(sealed, dst, pinned_signers=[world.b])
    assert dst.read_bytes() == src.read_bytes()
    assert opened == Opened(world.b, opened.signed_at, encrypted=False)


@pytest.mark.parametrize("encrypt", [True, False])
def test_plain_gpg_cli_reads_our_bundles(world: World, encrypt: bool) -> None:
    src = _payload(world.root, 20_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1], encrypt=encrypt)
    r = _gpg_cli(world.root / "r1", "--status-fd", "2", "--decrypt", str(sealed))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == src.read_bytes()
    assert f"VALIDSIG {world.b}".encode() in r.stderr


@pytest.mark.parametrize("memfd", [True, False])
def test_bytes_reach_gpg_by_memfd_or_by_a_pipe_where_there_is_none(
    world: World, monkeypatch: pytest.MonkeyPatch, memfd: bool
) -> None:
    data = os.urandom(3_000_000)  # far above a pipe's buffer: gpg must drain it as it is fed
    made: list[str] = []
    if memfd:
        real = os.memfd_create
        monkeypatch.setattr(
            os, "memfd_create", lambda name, flags=0: made.append(name) or real(name, flags)
        )
    else:
        monkeypatch.delattr(os, "memfd_create")  # a system without it: the pipe path, or nothing
    sealed = world.root / "x.dbundle"
    world.black.seal(memoryview(data), sealed, signer=world.b, recipients=[world.r1])
    assert made == (["diode-plaintext"] if memfd else [])
    dst = world.root / "plain"
    world.red1.open(sealed, dst, pinned_signers=[world.b])
    assert dst.read_bytes() == data


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # keys reused on purpose
)
@given(data=st.binary(max_size=4096), encrypt=st.booleans(), hide=st.booleans())
def test_bytes_round_trip(world: World, data: bytes, encrypt: bool, hide: bool) -> None:
    sealed = world.black.seal_bytes(
        data, signer=world.b, recipients=[world.r1], encrypt=encrypt, hide_recipients=hide
    )
    plain, opened = world.red1.open_bytes(sealed, pinned_signers=[world.b])
    assert plain == data
    assert opened.encrypted is encrypt and opened.signer_fpr == world.b


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
@pytest.mark.parametrize("encrypt", [True, False])
def test_tampered_bundle_leaves_no_output(world: World, where: str, encrypt: bool) -> None:
    src = _payload(world.root, 100_000)
    sealed = world.root / "in" / "x.dbundle"
    sealed.parent.mkdir()
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1], encrypt=encrypt)
    raw = bytearray(sealed.read_bytes())
    pos = {"head": 40, "middle": len(raw) // 2, "tail": len(raw) - 3}[where]
    raw[pos] ^= 0xFF
    sealed.write_bytes(bytes(raw))
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(CryptoError):
        world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    assert _only(out) == []  # not even the temp file: gpg had written it in full


def test_middle_flip_is_reported_as_bad_signature(world: World) -> None:
    src = _payload(world.root, 100_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1])
    raw = bytearray(sealed.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    with pytest.raises(SignatureError, match="BAD signature"):
        world.red1.open_bytes(bytes(raw), pinned_signers=[world.b])


def test_unpinned_signer_is_refused(world: World) -> None:
    rogue = Gpg(world.root / "x")
    x = generate_key(rogue, "second black", role="sign")
    rogue.import_keys(world.black.export_public(world.r1))
    world.red1.import_keys(rogue.export_public(x))  # known to red, but not pinned
    src = _payload(world.root, 10_000)
    sealed = world.root / "x.dbundle"
    rogue.seal(src, sealed, signer=x, recipients=[world.r1])
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(SignatureError, match=f"{x}.*NOT pinned"):
        world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    assert _only(out) == []
    # and the genuine key is refused too when it is not the pinned one
    good = world.root / "good.dbundle"
    world.black.seal(src, good, signer=world.b, recipients=[world.r1])
    with pytest.raises(SignatureError, match=world.b):
        world.red1.open(good, out / "plain", pinned_signers=[x])
    assert _only(out) == []


def test_unknown_signer_is_refused(world: World) -> None:
    rogue = Gpg(world.root / "x")
    x = generate_key(rogue, "stranger", role="sign")
    rogue.import_keys(world.black.export_public(world.r1))
    sealed = rogue.seal_bytes(b"hello", signer=x, recipients=[world.r1])
    with pytest.raises(SignatureError, match=f"unknown key {x}"):
        world.red1.open_bytes(sealed, pinned_signers=[world.b])


def test_revoked_signer_is_refused(world: World) -> None:
    sealed = world.black.seal_bytes(b"hello", signer=world.b, recipients=[world.r1])
    rev = (world.root / "b" / "openpgp-revocs.d" / f"{world.b}.rev").read_text()
    world.red1.import_keys(rev.replace("\n:-----", "\n-----"))  # gpg guards it with ':'
    with pytest.raises(SignatureError, match="revoked"):
        world.red1.open_bytes(sealed, pinned_signers=[world.b])
    with pytest.raises(CryptoError, match=f"{world.b} is revoked"):
        world.red1.require_keys([world.b], purpose="link.black_signers")


def test_not_a_recipient(world: World) -> None:
    src = _payload(world.root, 10_000)
    for hide in (True, False):
        sealed = world.root / f"x{hide}.dbundle"
        world.black.seal(src, sealed, signer=world.b, recipients=[world.r1], hide_recipients=hide)
        out = world.root / f"out{hide}"
        out.mkdir()
        with pytest.raises(CryptoError, match="not a recipient") as info:
            world.red2.open(sealed, out / "plain", pinned_signers=[world.b])
        assert not isinstance(info.value, SignatureError)
        assert _only(out) == []


def test_unsigned_message_is_refused(world: World) -> None:
    r = _gpg_cli(
        world.root / "b", "--trust-model", "always", "-r", world.r1, "--encrypt", data=b"hi"
    )
    assert r.returncode == 0
    with pytest.raises(SignatureError, match="no signature"):
        world.red1.open_bytes(r.stdout, pinned_signers=[world.b])


@pytest.mark.parametrize(
    "blob", [b"", b"garbage" * 100, os.urandom(5000), b"-----BEGIN PGP MESSAGE-----\n\n"]
)
def test_garbage_is_refused(world: World, blob: bytes) -> None:
    src = world.root / "in.dbundle"
    src.write_bytes(blob)
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(CryptoError):
        world.red1.open(src, out / "plain", pinned_signers=[world.b])
    assert _only(out) == []


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated_is_refused(world: World, encrypt: bool, keep: float) -> None:
    src = _payload(world.root, 100_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1], encrypt=encrypt)
    raw = sealed.read_bytes()
    sealed.write_bytes(raw[: int(len(raw) * keep)])
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(CryptoError):
        world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    assert _only(out) == []


def test_compression_bomb_is_capped(world: World) -> None:
    bomb_src = world.root / "zeros"
    bomb_src.write_bytes(bytes(20 * 1024 * 1024))
    sealed = world.root / "bomb.dbundle"
    r = _gpg_cli(
        world.root / "b",
        "-z",
        "9",
        "-u",
        world.b,
        "--output",
        str(sealed),
        "--sign",
        str(bomb_src),
    )
    assert r.returncode == 0 and sealed.stat().st_size < 1024 * 1024
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(CryptoError, match="max-output"):
        world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    assert _only(out) == []


def busy_message(gib: int, literal: bytes = b"hello") -> bytes:
    """A few KB that keep gpg busy for seconds per GiB, with no status line: a compressed
    packet holding a compressed packet that unpacks to a literal packet (``literal``, which gpg
    writes out at once) and then ``gib`` GiB of marker packets."""
    marker = b"\xa8\x03PGP"  # old-format marker packet, 3 bytes: "PGP"
    chunk = marker * (1 << 20)  # 5 MiB
    body = b"b\x00\x00\x00\x00\x00" + literal  # binary, no file name, time 0
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = co.compress(bytes([0xAC, len(body)]) + body + chunk) + co.flush(zlib.Z_SYNC_FLUSH)
    steady = co.compress(chunk) + co.flush(zlib.Z_SYNC_FLUSH)
    assert co.compress(chunk) + co.flush(zlib.Z_SYNC_FLUSH) == steady  # the same bytes repeat
    inner = bytes([0xA3, 1]) + first + steady * (gib * 1024 // 5 - 1) + co.flush()  # ZIP
    outer = zlib.compressobj(9)
    return bytes([0xA3, 2]) + outer.compress(inner) + outer.flush()  # ZLIB


def _gpg_processes_reading(path: Path) -> list[int]:
    """Pids whose command line names ``path`` (a gpg that was not killed)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmd.split(b"\0"):
            found.append(int(d.name))
    return found


def test_open_timeout_grows_with_the_size_up_to_the_cap(short_tmp: Path) -> None:
    g = Gpg(short_tmp / "h", timeout=900.0, open_base_seconds=60.0)
    assert g.open_timeout(0) == 60.0
    assert g.open_timeout(10 * OPEN_BYTES_PER_SECOND) == 70.0
    assert g.open_timeout(1024**3) == 60.0 + 1024**3 / OPEN_BYTES_PER_SECOND < 900.0  # 1 GiB
    assert g.open_timeout(10 * 1024**3) == 900.0
    assert Gpg(short_tmp / "h", timeout=5.0).open_timeout(0) == 5.0
    with pytest.raises(ValueError, match="positive"):
        Gpg(short_tmp / "h", open_base_seconds=0)


def test_a_message_that_keeps_gpg_busy_is_killed_in_time(world: World) -> None:
    """Gigabytes of marker packets in a few KB: gpg would run for many seconds (hours for a
    few hundred KB). It is killed at its (size-scaled) time with its process group, and the
    plaintext it had begun to write is deleted."""
    bomb = world.root / "busy.dbundle"
    bomb.write_bytes(busy_message(3))
    assert bomb.stat().st_size < 10_000
    quick = Gpg(world.red1.home, open_base_seconds=1.0)
    out = world.root / "out"
    out.mkdir()
    t0 = time.monotonic()
    with pytest.raises(GpgTimeout, match="did not finish within 1 s") as info:
        quick.open(bomb, out / "plain", pinned_signers=[world.b])
    assert info.value.seconds == quick.open_timeout(bomb.stat().st_size)
    assert f"`gpgconf --homedir {world.red1.home} --kill gpg-agent`" in str(info.value)
    assert time.monotonic() - t0 < 5
    assert _only(out) == [], "the plaintext gpg had begun is left behind"
    assert _gpg_processes_reading(bomb) == []
    t0 = time.monotonic()
    with pytest.raises(GpgTimeout):
        quick.open_bytes(bomb.read_bytes(), pinned_signers=[world.b])
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------- keys and failures


def test_require_keys(world: World) -> None:
    world.black.require_keys([world.b], secret=True, purpose="black.signing_key", capability="sign")
    world.black.require_keys([world.r1, world.r2], purpose="recipients", capability="encrypt")
    with pytest.raises(KeyMissingError) as info:
        world.black.require_keys([world.r1, ABSENT_FPR], purpose="channels[default].recipients")
    msg = str(info.value)
    assert ABSENT_FPR in msg and str(world.root / "b") in msg
    assert f"diode keys import --home {world.root / 'b'}" in msg  # a public key: import it
    assert world.r1 not in msg
    with pytest.raises(KeyMissingError, match=world.r1) as info:
        world.black.require_keys([world.r1], secret=True, purpose="decryption key")
    msg = str(info.value)  # a secret key is made where it is used, never copied across
    assert "diode keys init" in msg and "never copied" in msg
    assert "export-secret-keys" not in msg
    with pytest.raises(CryptoError, match="no usable encryption"):
        world.black.require_keys([world.b], purpose="recipients", capability="encrypt")
    with pytest.raises(CryptoError, match="cannot sign"):
        world.red1.require_keys([world.r1], purpose="signer", capability="sign")


def test_seal_failures_name_the_problem_and_leave_nothing(world: World) -> None:
    src = _payload(world.root, 1000)
    out = world.root / "out"
    out.mkdir()
    with pytest.raises(CryptoError, match=world.r1):  # public key only: cannot sign
        world.black.seal(src, out / "x", signer=world.r1, recipients=[world.r2])
    with pytest.raises(CryptoError, match="INV_RECP"):
        world.black.seal(src, out / "x", signer=world.b, recipients=[ABSENT_FPR])
    with pytest.raises(CryptoError, match="fingerprint"):
        world.black.seal(src, out / "x", signer=world.b, recipients=["--armor"])
    with pytest.raises(CryptoError, match="at least one recipient"):
        world.black.seal(src, out / "x", signer=world.b, recipients=[])
    assert _only(out) == []
    with pytest.raises(SignatureError, match="no pinned signers"):
        world.red1.open_bytes(b"x", pinned_signers=[])


def test_import_export(world: World) -> None:
    with pytest.raises(CryptoError, match="no OpenPGP key"):
        world.black.import_keys("not a key")
    with pytest.raises(KeyMissingError, match=ABSENT_FPR):
        world.black.export_public(ABSENT_FPR)
    assert world.red1.import_keys(world.black.export_public(world.r2).encode()) == [world.r2]


def test_home_is_created_private(short_tmp: Path) -> None:
    home = short_tmp / "new" / "home"
    g = Gpg(home)
    assert home.stat().st_mode & 0o777 == 0o700
    assert g.fingerprints() == [] and g.fingerprints(secret=True) == []


@pytest.mark.parametrize("algo", ["ed25519", "rsa"])
def test_init_keys(short_tmp: Path, algo: str) -> None:
    inv = init_keys(short_tmp / "k", red_names=("alpha", "beta"), algo=algo)  # type: ignore[arg-type]
    assert set(inv.red_fprs) == {"alpha", "beta"}
    for home in (inv.black_home, inv.red_home):
        assert home.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in inv.pub_dir.iterdir()) == ["alpha.asc", "beta.asc", "black.asc"]
    black, red = Gpg(inv.black_home), Gpg(inv.red_home)
    assert black.fingerprints(secret=True) == [inv.black_fpr]  # black holds only its key
    assert sorted(red.fingerprints(secret=True)) == sorted(inv.red_fprs.values())
    assert red.fingerprints().count(inv.black_fpr) == 1
    black.require_keys(inv.red_fprs.values(), purpose="recipients", capability="encrypt")
    black.require_keys([inv.black_fpr], secret=True, purpose="signer", capability="sign")
    red.require_keys([inv.black_fpr], purpose="link.black_signers", capability="sign")
    src = _payload(short_tmp, 5000)
    sealed = short_tmp / "x.dbundle"
    black.seal(src, sealed, signer=inv.black_fpr, recipients=list(inv.red_fprs.values()))
    assert red.open(sealed, short_tmp / "plain", pinned_signers=[inv.black_fpr]).encrypted
    assert (short_tmp / "plain").read_bytes() == src.read_bytes()
    # the snippet is valid configuration
    cfg = config_from_dict(tomllib.loads(inv.to_toml_snippet()), base=short_tmp, environ={})
    assert cfg.link.black_signers == [inv.black_fpr]
    assert cfg.black.signing_key == inv.black_fpr
    assert cfg.channels[0].recipients == list(inv.red_fprs.values())


def test_init_keys_refuses_to_overwrite(short_tmp: Path) -> None:
    inv = init_keys(short_tmp / "k")
    with pytest.raises(CryptoError, match="refusing to overwrite") as info:
        init_keys(short_tmp / "k")
    assert not isinstance(info.value, KeyMissingError)
    assert str(inv.black_home) in str(info.value)
    assert Gpg(inv.black_home).fingerprints(secret=True) == [inv.black_fpr]  # untouched
    again = init_keys(short_tmp / "k", force=True)
    assert again.black_fpr != inv.black_fpr
    assert Gpg(again.black_home).fingerprints(secret=True) == [again.black_fpr]
    assert inv.black_fpr not in Gpg(again.red_home).fingerprints()


def test_init_keys_rejects_bad_names(short_tmp: Path) -> None:
    for names in ((), ("Red",), ("a", "a"), ("../x",)):
        with pytest.raises(CryptoError, match="red names"):
            init_keys(short_tmp / "k", red_names=names)
    assert not (short_tmp / "k").exists()


def test_plain_gpg_cli_second_hidden_recipient(world: World) -> None:
    """gpg exits 2 for a hidden recipient whose key is tried on another's slot first."""
    src = _payload(world.root, 20_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1, world.r2])
    for home in ("r1", "r2"):
        r = _gpg_cli(world.root / home, "--status-fd", "2", "--decrypt", str(sealed))
        assert r.returncode in (0, 2), r.stderr.decode()
        assert r.stdout == src.read_bytes()
        assert f"VALIDSIG {world.b}".encode() in r.stderr
        assert b"DECRYPTION_OKAY" in r.stderr


def test_passphrase_file(world: World) -> None:
    home = world.root / "p"
    secret = "correct horse battery"
    locked = Gpg(home)
    r = _gpg_cli(
        home,
        "--pinentry-mode",
        "loopback",
        "--passphrase",
        secret,
        "--status-fd",
        "1",
        "--quick-gen-key",
        "locked black",
        "ed25519",
        "sign",
        "never",
    )
    assert r.returncode == 0, r.stderr.decode()
    fpr = locked.fingerprints(secret=True)[0]
    with pytest.raises(CryptoError, match="passphrase") as info:
        locked.seal_bytes(b"x", signer=fpr, recipients=[], encrypt=False)
    assert secret not in str(info.value)
    pw = world.root / "pw"
    pw.write_text(secret + "\n")
    pw.chmod(0o600)
    unlocked = Gpg(home, passphrase=Passphrase(path=pw))
    sealed = unlocked.seal_bytes(b"x", signer=fpr, recipients=[], encrypt=False)
    world.red1.import_keys(locked.export_public(fpr))
    assert world.red1.open_bytes(sealed, pinned_signers=[fpr])[0] == b"x"


# ---------------------------------------------------------------- what gpg writes is private


@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_sealed_and_opened_files_are_0600_whatever_the_umask(world: World, umask: int) -> None:
    src = _payload(world.root, 50_000)
    out = world.root / "out"
    out.mkdir()
    stale = out / "stale.dbundle"
    stale.write_bytes(b"old")
    stale.chmod(0o666)
    old = os.umask(umask)
    try:
        world.black.seal(src, out / "file.dbundle", signer=world.b, recipients=[world.r1])
        world.black.seal(
            src.read_bytes(), out / "mem.dbundle", signer=world.b, recipients=[world.r1]
        )
        world.black.seal(src, out / "signed.dbundle", signer=world.b, recipients=[], encrypt=False)
        world.black.seal(src, stale, signer=world.b, recipients=[world.r1])  # replaced, 0600
        opened = [
            world.red1.open(out / f"{n}.dbundle", out / f"{n}.plain", pinned_signers=[world.b])
            for n in ("file", "mem", "signed", "stale")
        ]
    finally:
        os.umask(old)
    assert [o.encrypted for o in opened] == [True, True, False, True]
    for name in _only(out):
        assert (out / name).stat().st_mode & 0o777 == 0o600, name
        if name.endswith(".plain"):
            assert (out / name).read_bytes() == src.read_bytes()
    assert len(_only(out)) == 8  # no temp file left behind


def test_home_that_cannot_be_made_is_a_crypto_error_naming_it(short_tmp: Path) -> None:
    dangling = short_tmp / "home"
    dangling.symlink_to(short_tmp / "gone")
    with pytest.raises(CryptoError, match=f"{dangling} is a symlink to .*gone, which does not"):
        Gpg(dangling)
    assert dangling.is_symlink() and not (short_tmp / "gone").exists()
    (short_tmp / "afile").write_text("x")
    with pytest.raises(CryptoError, match=f"{short_tmp / 'afile'} exists and is not a directory"):
        Gpg(short_tmp / "afile" / "home")


def test_open_that_cannot_write_the_plaintext_fails_and_leaves_nothing(world: World) -> None:
    """gpg writes into the descriptor it was given: failing to write (here a file-size limit;
    a full disk alike) fails the open, and the 0600 temp file goes."""
    src = _payload(world.root, 400_000)
    sealed = world.root / "x.dbundle"
    world.black.seal(src, sealed, signer=world.b, recipients=[world.r1])
    out = world.root / "out"
    out.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    was = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # here; gpg gets the default: killed
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        with pytest.raises(CryptoError):
            world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, was)
    assert _only(out) == []
    world.red1.open(sealed, out / "plain", pinned_signers=[world.b])
    assert (out / "plain").read_bytes() == src.read_bytes()
