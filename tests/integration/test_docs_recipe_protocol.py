"""docs/protocol.md §11, the hand check of a bundle, run for real: its bash blocks, taken out of
the document, against bundles black's own sealer made (real keys, real gpg, two hidden
recipients each in a home of its own), and against altered copies that must be rejected."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from bridge.black.catalog import default_catalog_path, save_catalog
from bridge.black.seal import BundleSealer, ShippedBundle
from bridge.black.spool import SpoolWriter
from bridge.black.spool_rows import read_rows, source_schema
from bridge.black.state import StateStore
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import Gpg
from bridge.crypto.keys import SideKeys, import_public_keys, init_side
from bridge.diode.file_drop import Outbox
from bridge.protocol.exchange import ExchangeDecl
from tests.support import REPO

pytestmark = pytest.mark.gpg

DOC = REPO / "docs" / "protocol.md"
CATALOG = {"orders": ExchangeDecl("orders", "topic", durable=True)}
ROWS = 3


# ---------------------------------------------------------------------- the document's blocks
@dataclass(frozen=True)
class Recipe:
    """The §11 bash blocks, by what they do."""

    verify: str
    one_liner: str
    full_check: str


def _section_11(text: str) -> str:
    """Docs, protocol §11: its text, from its heading to the next section's."""
    m = re.search(r"^## 11\. .*?$(.*?)^## 12\. ", text, re.S | re.M)
    assert m, f"{DOC}: no '## 11. …' section followed by '## 12. …': the hand check moved?"
    return m.group(1)


def _fenced(section: str, lang: str) -> list[str]:
    """Docs: the bodies of the fenced blocks tagged ``lang`` ('' for untagged), read line by
    line (a closing fence is not the opening of the next block)."""
    blocks: list[tuple[str, list[str]]] = []
    open_block: list[str] | None = None
    for line in section.splitlines():
        if open_block is None and line.startswith("```"):
            open_block = []
            blocks.append((line[3:].strip(), open_block))
        elif open_block is not None and line.rstrip() == "```":
            open_block = None
        elif open_block is not None:
            open_block.append(line)
    assert open_block is None, f"{DOC} §11: a fenced block is never closed"
    return ["".join(ln + "\n" for ln in body) for tag, body in blocks if tag == lang]


def _one(blocks: list[str], what: str, pred: Callable[[str], bool]) -> str:
    found = [b for b in blocks if pred(b)]
    assert len(found) == 1, (
        f"{DOC} §11: expected exactly one {what} block, found {len(found)} among "
        f"{len(blocks)}; update this test's markers if the recipe was rewritten"
    )
    return found[0]


def recipe() -> Recipe:
    """Docs, protocol §11: its bash blocks, each found by its content (fails loudly if one
    is not)."""
    bash = _fenced(_section_11(DOC.read_text()), "bash")
    return Recipe(
        verify=_one(bash, "gpg verify", lambda b: "gpg --homedir" in b and "--decrypt" in b),
        one_liner=_one(bash, "python one-liner", lambda b: b.startswith("python3 -c ")),
        full_check=_one(bash, "full check", lambda b: "python3 - b.parquet \"$B\" <<'EOF'" in b),
    )


def samples() -> tuple[list[str], list[str]]:
    """Docs, protocol §11: the sample ``status.txt`` and ``diag.txt`` lines."""
    plain = _fenced(_section_11(DOC.read_text()), "")

    def lines_all(prefix: str) -> Callable[[str], bool]:
        return lambda b: bool(b.strip()) and all(ln.startswith(prefix) for ln in b.splitlines())

    status = _one(plain, "sample status.txt", lines_all("[GNUPG:] "))
    diag = _one(plain, "sample diag.txt", lines_all("gpg: "))
    return status.splitlines(), diag.splitlines()


def _set(script: str, var: str, value: str, *, required: bool = True) -> str:
    """The recipe with its ``VAR=…`` line set to ``value`` (the operator's edit)."""
    out, n = re.subn(rf"^{var}=.*$", f"{var}={value}", script, flags=re.M)
    assert n == 1 or (n == 0 and not required), (
        f"{DOC} §11: the verify block has {n} '{var}=' lines at line start; the recipe "
        "must start by setting it once"
    )
    return out


# ---------------------------------------------------------------------- real keys and bundles
@dataclass(frozen=True)
class Sealed:
    """Keys and bundles black made: ``default`` sealed to two hidden recipients, ``plain``
    signed only."""

    black: SideKeys
    reds: tuple[SideKeys, SideKeys]
    outbox: Path
    default: ShippedBundle
    plain: ShippedBundle


def _config(root: Path, black: SideKeys, reds: tuple[SideKeys, SideKeys]) -> Config:
    return config_from_dict(
        {
            "link": {"bridge_id": "site-a-black", "black_signers": [black.fpr]},
            "channels": [
                {"name": "default", "recipients": [r.fpr for r in reds]},
                {"name": "plain", "encrypt": False},
            ],
            "black": {
                "gnupg_home": str(black.home),
                "signing_key": black.fpr,
                "outbox": "outbox",
                "archive": "archive",
                "state_dir": "state",
                "checkpoint_dir": "checkpoint",
                "spool_dir": "spool",
            },
            "red": {"gnupg_home": str(reds[0].home), "inbox": "inbox"},
        },
        base=root,
        environ={},
    )


def _seal(cfg: Config, sealer: BundleSealer, channel: str) -> ShippedBundle:
    """Black, tap + sealer: ``ROWS`` messages spooled, then sealed into one bundle."""
    spool = Path(cfg.black.spool_dir)
    with SpoolWriter.open(spool, channel, min_free_bytes=0) as w:
        for i in range(ROWS):
            w.append_one("orders", "eu.new", False, b"\x00\x00", f"order {i}".encode())
        w.sync(ROWS - 1)
    rows = read_rows(spool, channel, 0, ROWS, CATALOG)
    table = pa.Table.from_batches(list(rows), schema=source_schema())
    (shipped,) = sealer.seal_rows(cfg.channel(channel), table)
    return shipped


@pytest.fixture(scope="module")
def sealed() -> Iterator[Sealed]:
    root = Path(tempfile.mkdtemp(prefix="drc", dir="/tmp"))  # short: gpg-agent socket paths
    homes = [root / "b" / "keys", root / "r1" / "keys", root / "r2" / "keys"]
    try:
        black = init_side("black", homes[0])
        reds = (
            init_side("red", homes[1], name="ops"),
            init_side("red", homes[2], name="audit"),
        )
        import_public_keys(black.home, [r.public_file for r in reds])
        for r in reds:  # each red home: its own secret key only, and black's public key
            import_public_keys(r.home, [black.public_file])
        cfg = _config(root, black, reds)
        save_catalog(default_catalog_path(cfg.black), CATALOG)
        sealer = BundleSealer(
            cfg,
            store=StateStore(Path(cfg.black.state_dir)),
            gpg=Gpg(black.home),
            outbox=Outbox.from_config(cfg),
        )
        default, plain = _seal(cfg, sealer, "default"), _seal(cfg, sealer, "plain")
        yield Sealed(black, reds, Path(cfg.black.outbox), default, plain)
    finally:
        for home in homes:
            subprocess.run(
                ["gpgconf", "--homedir", str(home), "--kill", "all"],
                capture_output=True,
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------- running the blocks
@dataclass(frozen=True)
class Run:
    rc: int
    out: str
    err: str
    folder: Path

    @property
    def last(self) -> str:
        lines = self.out.strip().splitlines()
        return lines[-1] if lines else ""

    def show(self) -> str:
        files = sorted(p.name for p in self.folder.iterdir())
        status = (self.folder / "status.txt").read_text() if "status.txt" in files else ""
        return f"exit {self.rc}\nstdout:\n{self.out}\nstderr:\n{self.err}\nstatus:\n{status}"


def _bash(script: str, folder: Path, **env: str) -> Run:
    """Run a §11 block with bash in ``folder``; ``python3`` is this interpreter (pyarrow)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    r = subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return Run(r.returncode, r.stdout, r.stderr, folder)


def _workdir(tmp_path: Path, bundle: Path, alter: str | None = None) -> Path:
    """An empty folder holding a copy of ``bundle`` (altered: ``flip`` a byte, ``truncate``)."""
    folder = tmp_path / "hand"
    folder.mkdir(parents=True)
    copy = folder / bundle.name
    data = bytearray(bundle.read_bytes())
    if alter == "flip":
        data[len(data) // 2] ^= 0x01
    elif alter == "truncate":
        del data[-100:]
    copy.write_bytes(bytes(data))
    return folder


def _verify(
    s: Sealed, tmp_path: Path, bundle: ShippedBundle, home: Path, *,
    pinned: str | None = None, encrypt: str = "true", alter: str | None = None,
) -> Run:  # fmt: skip
    """The §11 verify block, its first lines set as an operator would."""
    script = recipe().verify
    script = _set(script, "B", bundle.name)
    script = _set(script, "PINNED", pinned or s.black.fpr)
    script = _set(script, "HOME_RED", str(home))
    script = _set(script, "ENCRYPT", encrypt, required=False)
    return _bash(script, _workdir(tmp_path, s.outbox / bundle.name, alter))


# ---------------------------------------------------------------------- the tests
def test_section_11_blocks_are_found() -> None:
    recipe()
    status, _ = samples()
    assert "PLAINTEXT_LENGTH" not in "\n".join(status), (
        "the sample status.txt shows PLAINTEXT_LENGTH, which gpg never prints for a bundle"
    )


@pytest.mark.parametrize("which", [0, 1], ids=["first-recipient", "second-recipient"])
def test_recipe_accepts_a_real_bundle_opened_by_either_hidden_recipient(
    sealed: Sealed, tmp_path: Path, which: int
) -> None:
    """The first recipient's home: gpg exits 0; the second's: gpg exits 2 (its key is tried on
    the first slot first). Both bundles are good, and the recipe must say so."""
    b = sealed.default
    run = _verify(sealed, tmp_path, b, sealed.reds[which].home)
    assert run.rc == 0 and run.last.startswith("ACCEPT"), run.show()
    assert f"gpg exit {2 if which else 0}" in run.out, run.show()
    status = (run.folder / "status.txt").read_text()
    assert "PLAINTEXT_LENGTH" not in status  # black streams: the case the old recipe refused
    assert (run.folder / "b.parquet").stat().st_size == b.plaintext_bytes

    # then the plaintext: the one-liner, and the full check of §4 and §7
    one = _bash(recipe().one_liner, run.folder)
    assert one.rc == 0 and one.last == str(ROWS), f"one-liner: {one.out}\n{one.err}"
    full = _bash(recipe().full_check, run.folder, B=b.name)
    want = f"coverage {b.first_seq} {b.last_seq} | plaintext sha256 {b.sha256}"
    assert full.rc == 0 and full.last == want, f"full check: {full.out}\n{full.err}"


@pytest.mark.parametrize("alter", ["flip", "truncate"])
def test_recipe_rejects_an_altered_copy_and_removes_its_plaintext(
    sealed: Sealed, tmp_path: Path, alter: str
) -> None:
    run = _verify(sealed, tmp_path, sealed.default, sealed.reds[1].home, alter=alter)
    assert run.rc != 0 and run.last.startswith("REJECT"), run.show()
    assert not (run.folder / "b.parquet").exists(), "a rejected bundle's plaintext was left"


def test_recipe_rejects_a_signer_that_is_not_pinned(sealed: Sealed, tmp_path: Path) -> None:
    other = sealed.reds[0].fpr  # any fingerprint but black's
    run = _verify(sealed, tmp_path, sealed.default, sealed.reds[0].home, pinned=other)
    assert run.rc != 0 and run.last.startswith("REJECT: signer"), run.show()


def test_recipe_takes_signed_only_only_where_the_channel_opted_out(
    sealed: Sealed, tmp_path: Path
) -> None:
    assert re.search(r"^ENCRYPT=", recipe().verify, re.M), "the recipe ignores channel.encrypt"
    ok = _verify(sealed, tmp_path / "a", sealed.plain, sealed.reds[0].home, encrypt="false")
    assert ok.rc == 0 and ok.last.startswith("ACCEPT"), ok.show()
    assert "encrypted=false" in ok.last
    down = _verify(sealed, tmp_path / "b", sealed.plain, sealed.reds[0].home, encrypt="true")
    assert down.rc != 0 and down.last.startswith("REJECT"), down.show()  # a downgrade


def _shape(lines: list[str]) -> list[str]:
    """Transcript lines with what differs between key sets, runs and hosts left out:
    fingerprints, key ids, times, signature ids blanked; smart-card lines (``CARDCTRL``, the
    ``scdaemon`` notice: a host with a card daemon prints others) dropped."""
    out = []
    for ln in lines:
        if "scdaemon" in ln or ln.startswith("[GNUPG:] CARDCTRL"):
            continue
        ln = re.sub(r"\b[0-9A-F]{16,40}\b", "X", ln.rstrip())
        ln = re.sub(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{9,10}\b", "T", ln)
        ln = re.sub(r"^(\[GNUPG:\] SIG_ID) \S+", r"\1 S", ln)
        ln = re.sub(r"^(gpg: Signature made) .*", r"\1 T", ln)
        out.append(ln)
    return out


def test_the_sample_transcript_is_what_gpg_prints(sealed: Sealed, tmp_path: Path) -> None:
    """The §11 samples (second recipient) against a real run, ids and times aside; they were
    taken with GnuPG 2.2, whose lines other releases change."""
    version = subprocess.run(["gpg", "--version"], capture_output=True, text=True, check=True)
    if not version.stdout.startswith("gpg (GnuPG) 2.2."):
        pytest.skip(f"the samples are GnuPG 2.2's; this is {version.stdout.splitlines()[0]}")
    run = _verify(sealed, tmp_path, sealed.default, sealed.reds[1].home)
    assert run.rc == 0, run.show()
    real_status = (run.folder / "status.txt").read_text().splitlines()
    real_diag = (run.folder / "diag.txt").read_text().splitlines()
    status, diag = samples()
    assert _shape(status) == _shape(real_status)
    assert _shape(diag) == _shape(real_diag)
