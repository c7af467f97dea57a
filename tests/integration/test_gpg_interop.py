"""Crypto (both sides): black and red on different GnuPG releases, 2.2 (the system's) and 2.4.

GnuPG 2.4 is the gpg named by DIODE_GPG24: the wrapper `bash scripts/gnupg-2.4.sh` installs and
prints (.ci/run sets it). Unset, every test here skips saying how to run them; set but broken,
they fail. A side runs on a release the way an operator picks one: `black.gpg_binary` /
`red.gpg_binary` name that release's gpg (gpgconf and gpg-connect-agent come from beside it), and
the key functions take it as ``binary``. `diode keys init/import` read no config: they run the
gpg first on PATH, so the CLI test puts 2.4 first on PATH.

Upstream GnuPG 2.4 (RHEL 10, Fedora, Arch, gpg4win...) gives new keys the AEAD feature and
encrypts with OCB when every recipient key has it. Debian's 2.4 build does neither unless told
``compliance gnupg``, so a gpg.conf with that line stands for an upstream build here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.cli import cli
from bridge.config import Config, config_from_dict
from bridge.crypto.gpg import KEY_PREFERENCES, Gpg
from bridge.crypto.keys import (
    SideKeys,
    decryption_gpg,
    import_public_keys,
    init_side,
    signing_gpg,
)
from bridge.errors import CryptoError

pytestmark = pytest.mark.gpg

ENV = "DIODE_GPG24"
UPSTREAM_24 = "compliance gnupg\n"
"""gpg.conf line that makes Debian's 2.4 build behave like upstream 2.4 (AEAD keys, OCB)."""
TOOLS = ("gpg", "gpgconf", "gpg-connect-agent", "gpg-agent")


def _version(gpg: Path | str) -> str:
    out = subprocess.run([str(gpg), "--version"], capture_output=True, text=True, timeout=30)
    first = out.stdout.splitlines()[0] if out.stdout else out.stderr.strip()
    return first.split()[-1] if out.returncode == 0 and first.startswith("gpg") else first


@dataclass(frozen=True)
class Releases:
    """The bin directory of each GnuPG release, first on PATH when a side runs on it."""

    bins: dict[str, Path]

    def path(self, release: str) -> str:
        return f"{self.bins[release]}{os.pathsep}{os.environ['PATH']}"

    def gpg(self, release: str) -> str:
        return str(self.bins[release] / "gpg")


@pytest.fixture(scope="module")
def releases() -> Releases:
    """2.2 from the system, 2.4 from DIODE_GPG24: skip if unset, FAIL if set but broken."""
    named = os.environ.get(ENV)
    if not named:
        pytest.skip(
            f"{ENV} is not set: run `bash scripts/gnupg-2.4.sh` (it installs Debian trixie's "
            f"GnuPG 2.4 under /opt/gnupg-2.4 and prints its gpg), then {ENV}=<that path>"
        )
    gpg24 = Path(named)
    missing = [t for t in TOOLS if not os.access(gpg24.with_name(t), os.X_OK)]
    if missing:
        pytest.fail(
            f"{ENV}={named}: {', '.join(missing)} missing or not executable beside it; "
            "re-run `bash scripts/gnupg-2.4.sh` (remove a broken /opt/gnupg-2.4 first)"
        )
    version = _version(gpg24)
    if not version.startswith("2.4."):
        pytest.fail(f"{ENV}={named} is not a working GnuPG 2.4 (`--version`: {version!r})")
    system = shutil.which("gpg")
    if system is None or not _version(system).startswith("2.2."):
        pytest.skip(f"the system gpg ({system}) is not GnuPG 2.2: no older release to cross")
    return Releases({"2.2": Path(system).parent, "2.4": gpg24.parent})


@dataclass
class Hosts:
    """GnuPG homes made in a test; their daemons are stopped at its end (both releases)."""

    root: Path
    releases: Releases
    mp: pytest.MonkeyPatch
    homes: list[Path]

    def on(self, release: str) -> None:
        """From now on `gpg` on PATH is ``release``'s (the `diode keys` commands read no config)."""
        self.mp.setenv("PATH", self.releases.path(release))

    def home(self, name: str, *, gpg_conf: str = "", common_conf: str = "") -> Path:
        home = self.root / name / "keys"
        if gpg_conf or common_conf:
            home.mkdir(parents=True, mode=0o700)
            for file, text in (("gpg.conf", gpg_conf), ("common.conf", common_conf)):
                if text:
                    (home / file).write_text(text)
        self.homes.append(home)
        return home

    def black(self, release: str, **conf: str) -> SideKeys:
        """`diode keys init --side black` on a host running ``release``."""
        home = self.home(f"b{len(self.homes)}", **conf)
        return init_side("black", home, bridge_id="t", binary=self.releases.gpg(release))

    def red(self, release: str, name: str = "ops", **conf: str) -> SideKeys:
        """`diode keys init --side red` on a host running ``release``."""
        home = self.home(f"r{len(self.homes)}", **conf)
        return init_side("red", home, name=name, bridge_id="t", binary=self.releases.gpg(release))

    def exchange(self, black: tuple[SideKeys, str], *reds: tuple[SideKeys, str]) -> None:
        """`diode keys import` of the other side's .asc files, each host on its release."""
        keys, release = black
        gpg = self.releases.gpg
        import_public_keys(keys.home, [r.public_file for r, _ in reds], binary=gpg(release))
        for red, red_release in reds:
            import_public_keys(red.home, [keys.public_file], binary=gpg(red_release))

    def stop(self, home: Path) -> None:
        """Stop every daemon of ``home`` (gpg-agent, keyboxd), whichever release started it."""
        for release in ("2.4", "2.2"):
            subprocess.run(
                [str(self.releases.bins[release] / "gpgconf"), "--homedir", str(home)]
                + ["--kill", "all"],
                capture_output=True,
                check=False,
                timeout=60,
            )


@pytest.fixture
def hosts(short_tmp: Path, releases: Releases, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hosts]:
    h = Hosts(short_tmp, releases, monkeypatch, [])
    try:
        yield h
    finally:
        for home in h.homes:
            h.stop(home)


def _cfg(
    releases: Releases, black: tuple[SideKeys, str], *reds: SideKeys, encrypt: bool = True
) -> Config:
    """The config of ``black`` (keys, release: its gpg_binary) and ``reds`` (the first one's
    red section: ``_red_on`` points it at another)."""
    keys, release = black
    data = tomllib.loads(keys.to_toml_snippet() + reds[0].to_toml_snippet())
    data["channels"][0]["recipients"] = [r.fpr for r in reds]
    data["channels"][0]["encrypt"] = encrypt
    data["black"]["gpg_binary"] = releases.gpg(release)
    return config_from_dict(data, base=keys.home.parent, environ={})


def _red_on(cfg: Config, releases: Releases, red: SideKeys, release: str) -> Config:
    """``cfg`` with red's section for the host of ``red`` running ``release``."""
    update = {"gnupg_home": red.home, "gpg_binary": releases.gpg(release)}
    return cfg.model_copy(update={"red": cfg.red.model_copy(update=update)})


def _packets(releases: Releases, path: Path) -> str:
    """``gpg --list-packets`` of a message, by 2.4 (it names OCB packets), no key needed."""
    out = subprocess.run(
        [releases.gpg("2.4"), "--homedir", str(path.parent / ".lp"), "--batch"]
        + ["--list-packets", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout


def _mode(releases: Releases, path: Path) -> str:
    """How a message is protected: 'ocb', 'mdc' or 'signed' (no encryption)."""
    listing = _packets(releases, path)
    if "aead encrypted packet" in listing:
        return "ocb"
    return "mdc" if "mdc_method: 2" in listing else "signed"


def _features(releases: Releases, key: SideKeys) -> int:
    """The Features subpacket of a public key file (0x01 MDC, 0x02 AEAD, 0x04 v5 keys)."""
    out = subprocess.run(
        [releases.gpg("2.4"), "--batch", "--homedir", str(key.home.parent / ".lp")]
        + ["--list-packets"],
        input=key.public_file.read_bytes(),
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    flags = [ln.split("features: ")[1].rstrip(")") for ln in out.splitlines() if "features:" in ln]
    assert flags, f"no Features subpacket in {key.public_file}"
    return int(flags[-1], 16)


def _agent_version(releases: Releases, release: str, home: Path) -> str:
    out = subprocess.run(
        [str(releases.bins[release] / "gpg-connect-agent"), "--homedir", str(home)]
        + ["--no-autostart", "GETINFO version", "/bye"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return next((ln[2:] for ln in out.splitlines() if ln.startswith("D ")), "")


def _keyboxd_of(home: Path) -> list[int]:
    """Pids of live keyboxd daemons serving ``home``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"keyboxd") and str(home).encode() in argv:
            pids.append(int(proc.name))
    return pids


def _round_trip(
    hosts: Hosts, black: tuple[SideKeys, str], reds: list[tuple[SideKeys, str]], *, encrypt: bool
) -> str:
    """Black seals a bundle and a heartbeat the way its job does (keys opened by the startup
    checks); every red opens both the way its job does. Returns how the bundle is protected."""
    keys, release = black
    cfg = _cfg(hosts.releases, black, *(r for r, _ in reds), encrypt=encrypt)
    payload = os.urandom(200_000)
    src = hosts.root / "plain.parquet"
    src.write_bytes(payload)
    sealed = hosts.root / f"default.000000000001.{'e' if encrypt else 's'}.dbundle"
    sealer = signing_gpg(cfg)
    recipients = [r.fpr for r, _ in reds]
    sealer.seal(src, sealed, signer=keys.fpr, recipients=recipients, encrypt=encrypt)
    beat = sealer.seal_bytes(b'{"hb": 1}', signer=keys.fpr, recipients=recipients, encrypt=encrypt)
    for red, red_release in reds:
        opener = decryption_gpg(_red_on(cfg, hosts.releases, red, red_release))
        out = hosts.root / f"out-{red.name}.parquet"
        opened = opener.open(sealed, out, pinned_signers=[keys.fpr])
        assert out.read_bytes() == payload, f"{release} -> {red_release}"
        assert opened.signer_fpr == keys.fpr and opened.encrypted is encrypt
        plain, hb = opener.open_bytes(beat, pinned_signers=[keys.fpr])
        assert plain == b'{"hb": 1}' and hb.encrypted is encrypt
    return _mode(hosts.releases, sealed)


# ---------------------------------------------------------------- the 2.4 install itself


def test_gpg24_runs_its_own_agent(hosts: Hosts) -> None:
    """gpg 2.4 starts the gpg-agent of its own release (gpgconf.ctl), not /usr/bin's 2.2."""
    red = hosts.red("2.4")
    gpg = Gpg(red.home, binary=hosts.releases.gpg("2.4"))
    assert gpg.needs_passphrase(red.fpr, capability="encrypt") is False  # starts the agent
    assert _agent_version(hosts.releases, "2.4", red.home).startswith("2.4.")


# ---------------------------------------------------------------- bundles across releases


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "signed-only"])
@pytest.mark.parametrize(
    ("black_release", "red_release"), [("2.4", "2.2"), ("2.2", "2.4"), ("2.4", "2.4")]
)
def test_bundle_round_trip_across_releases(
    hosts: Hosts, black_release: str, red_release: str, encrypt: bool
) -> None:
    """Keys made by each host's own release, public keys carried across and imported."""
    black = hosts.black(black_release)
    red = hosts.red(red_release)
    hosts.exchange((black, black_release), (red, red_release))
    mode = _round_trip(hosts, (black, black_release), [(red, red_release)], encrypt=encrypt)
    assert mode == ("mdc" if encrypt else "signed")


@pytest.mark.parametrize("black_release", ["2.2", "2.4"])
def test_hidden_recipients_on_both_releases_read_one_bundle(
    hosts: Hosts, black_release: str
) -> None:
    """Two red sites, one per release: each holds one hidden recipient's key (2.2 exits 2 on
    the other slot's ECDH miss, 2.4 exits 0), both land the bundle."""
    black = hosts.black(black_release)
    reds = [(hosts.red("2.4", name="new"), "2.4"), (hosts.red("2.2", name="old"), "2.2")]
    hosts.exchange((black, black_release), *reds)
    assert _round_trip(hosts, (black, black_release), reds, encrypt=True) == "mdc"
    assert (
        _packets(hosts.releases, next(hosts.root.glob("*.e.dbundle"))).count(
            "keyid 0000000000000000"
        )
        == 2
    )


def test_homes_made_by_22_work_after_an_upgrade_to_24(hosts: Hosts) -> None:
    """Debian 12 -> 13: both homes made by 2.2, then both hosts run 2.4."""
    black, red = hosts.black("2.2"), hosts.red("2.2")
    hosts.exchange((black, "2.2"), (red, "2.2"))
    for home in (black.home, red.home):
        hosts.stop(home)  # the upgrade stops the 2.2 agents
    assert _round_trip(hosts, (black, "2.4"), [(red, "2.4")], encrypt=True) == "mdc"


# ---------------------------------------------------------------- AEAD (OCB) and 2.2


def test_keys_never_advertise_aead_so_black_24_writes_mdc_that_22_reads(hosts: Hosts) -> None:
    """Upstream 2.4 defaults on both hosts: `diode keys init` still makes keys without the AEAD
    feature, so black 2.4 encrypts with MDC, and red's home restored on 2.2 reads it."""
    black = hosts.black("2.4", gpg_conf=UPSTREAM_24)
    red = hosts.red("2.4", gpg_conf=UPSTREAM_24)
    assert not _features(hosts.releases, red) & 0x02, "the red key advertises AEAD"
    assert not _features(hosts.releases, black) & 0x02, "the black key advertises AEAD"
    hosts.exchange((black, "2.4"), (red, "2.4"))
    assert _round_trip(hosts, (black, "2.4"), [(red, "2.4")], encrypt=True) == "mdc"
    hosts.stop(red.home)  # red's home restored on a Debian 12 host
    assert _round_trip(hosts, (black, "2.4"), [(red, "2.2")], encrypt=True) == "mdc"


def _aead_red(hosts: Hosts) -> SideKeys:
    """A red key made by hand with upstream 2.4 defaults (not by `diode keys init`): it
    advertises AEAD."""
    home = hosts.home("hand", gpg_conf=UPSTREAM_24)
    gpg = Gpg(home, binary=hosts.releases.gpg("2.4"))
    fpr = gpg._run(["--passphrase", "", "--quick-gen-key", "t red ops", "ed25519", "cert"])
    created = fpr.first("KEY_CREATED")
    assert created, fpr.reason()
    gpg.quick_add_key(created[1], algo="cv25519", usage="encr")
    public = home.parent / "ops.asc"
    public.write_text(gpg.export_public(created[1]))
    keys = SideKeys("red", "ops", home, created[1], public)
    assert _features(hosts.releases, keys) & 0x02, "upstream 2.4 defaults should advertise AEAD"
    return keys


def test_black_24_refuses_a_recipient_key_advertising_aead_until_red_fixes_it(
    hosts: Hosts,
) -> None:
    black = hosts.black("2.4", gpg_conf=UPSTREAM_24)
    red = _aead_red(hosts)
    hosts.exchange((black, "2.4"), (red, "2.4"))
    cfg = _cfg(hosts.releases, (black, "2.4"), red)
    with pytest.raises(CryptoError, match="advertises the AEAD feature") as refused:
        signing_gpg(cfg)  # diode check, diode keys check --side black, the black job's start
    assert red.fpr in str(refused.value) and "--quick-update-pref" in str(refused.value)
    sealed = hosts.root / "x.dbundle"
    sealer = Gpg(black.home, binary=cfg.black.gpg_binary)
    with pytest.raises(CryptoError, match="AEAD algorithm 2"):  # a key swapped while running
        sealer.seal(b"rows", sealed, signer=black.fpr, recipients=[red.fpr])
    assert not sealed.exists()
    # the fix the message gives, on red, then the key carried across again
    fix = Gpg(red.home, binary=hosts.releases.gpg("2.4"))
    res = fix._run(["--default-preference-list", KEY_PREFERENCES, "--quick-update-pref", red.fpr])
    assert res.rc == 0, res.reason()
    red.public_file.write_text(fix.export_public(red.fpr))
    assert not _features(hosts.releases, red) & 0x02
    import_public_keys(black.home, [red.public_file], binary=cfg.black.gpg_binary)
    assert _round_trip(hosts, (black, "2.4"), [(red, "2.4")], encrypt=True) == "mdc"


def test_ocb_bundle_is_landed_by_red_24_and_named_by_red_22(hosts: Hosts) -> None:
    """What an older black on upstream 2.4 wrote for AEAD keys (OCB): valid for red on 2.4
    (DECRYPTION_INFO names the AEAD algorithm); red on 2.2 decrypts it but its status lines do
    not confirm the integrity protection, so it is rejected, saying why."""
    black, red = hosts.black("2.2"), hosts.red("2.2")
    hosts.exchange((black, "2.2"), (red, "2.2"))
    src = hosts.root / "plain.parquet"
    src.write_bytes(os.urandom(50_000))
    sealed = hosts.root / "ocb.dbundle"
    made = subprocess.run(
        [hosts.releases.gpg("2.4"), "--homedir", str(black.home), "--batch", "--no-tty"]
        + ["--trust-model", "always", "-z", "0", "--force-ocb", "--throw-keyids"]
        + ["--local-user", black.fpr, "--recipient", red.fpr, "--sign", "--encrypt"]
        + ["--output", str(sealed), str(src)],
        capture_output=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert _mode(hosts.releases, sealed) == "ocb"
    red22 = Gpg(red.home, binary=hosts.releases.gpg("2.2"))
    with pytest.raises(CryptoError, match=r"OCB \(LibrePGP AEAD\).*GnuPG 2\.2"):
        red22.open(sealed, hosts.root / "out22", pinned_signers=[black.fpr])
    assert not (hosts.root / "out22").exists()
    hosts.stop(red.home)
    red24 = Gpg(red.home, binary=hosts.releases.gpg("2.4"))
    opened = red24.open(sealed, hosts.root / "out24", pinned_signers=[black.fpr])
    assert opened.encrypted and (hosts.root / "out24").read_bytes() == src.read_bytes()


# ---------------------------------------------------------------- keyboxd and `diode keys`


def test_keyboxd_home_works_and_one_shot_commands_stop_keyboxd(hosts: Hosts) -> None:
    """A home with `use-keyboxd` (upstream 2.4.1+ writes it into a ~/.gnupg it creates): keys
    live in public-keys.d/pubring.db, served by a keyboxd that `diode keys` must stop too."""
    red = hosts.red("2.4", common_conf="use-keyboxd\n")
    assert (red.home / "public-keys.d" / "pubring.db").is_file()
    assert not (red.home / "pubring.kbx").exists()
    assert _keyboxd_of(red.home) == [], "diode keys init left keyboxd running"
    black = hosts.black("2.2")
    hosts.exchange((black, "2.2"), (red, "2.4"))
    assert _keyboxd_of(red.home) == [], "diode keys import left keyboxd running"
    assert _round_trip(hosts, (black, "2.2"), [(red, "2.4")], encrypt=True) == "mdc"


def test_diode_keys_cli_on_24_homes(hosts: Hosts) -> None:
    """`diode keys init / import / check` with GnuPG 2.4 first on PATH; red's key protected."""
    root = hosts.root
    hosts.on("2.4")
    pw = root / "red.pass"
    pw.write_text("correct horse\n")
    pw.chmod(0o600)
    bh, rh = hosts.home("bh"), hosts.home("rh")
    runner = CliRunner()
    steps = [
        ["keys", "init", "--side", "black", "--home", str(bh)],
        ["keys", "init", "--side", "red", "--name", "ops", "--home", str(rh)]
        + ["--passphrase-file", str(pw)],
        ["keys", "import", "--home", str(bh), str(root / "rh" / "pub" / "ops.asc")],
        ["keys", "import", "--home", str(rh), str(root / "bh" / "pub" / "black.asc")],
    ]
    outputs = []
    for argv in steps:
        r = runner.invoke(cli, argv)
        assert r.exit_code == 0, f"{argv}: {r.output}"
        outputs.append(r.output.split("# paste into your diode TOML:\n")[-1])
    cfg = root / "diode.toml"
    cfg.write_text(outputs[0] + outputs[1])
    cfg.chmod(0o600)
    for side in ("black", "red"):
        ok = runner.invoke(cli, ["keys", "check", "--side", side, "--config", str(cfg)])
        assert ok.exit_code == 0, ok.output
    assert "passphrase from" in ok.output
    assert _agent_version(hosts.releases, "2.4", rh) == ""  # the one-shot check stopped it
