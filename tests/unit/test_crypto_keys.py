"""Crypto: the config lines the keys commands print are valid config that pins what they say."""

from __future__ import annotations

import tomllib
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from bridge.config import config_from_dict
from bridge.crypto.keys import ImportedKey, SideKeys, import_snippet
from bridge.crypto.passphrase import Passphrase

fprs = st.text(alphabet="0123456789ABCDEF", min_size=40, max_size=40)
segment = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\0/"),
    min_size=1,
    max_size=30,
).filter(lambda s: s not in (".", ".."))


@given(
    black_fpr=fprs,
    red_fpr=fprs,
    bhome=segment,
    rhome=segment,
    name=st.sampled_from(["a", "ops-1"]),
    pw=st.none() | segment | st.just("ENV"),
)
def test_side_snippets_round_trip(
    black_fpr: str, red_fpr: str, bhome: str, rhome: str, name: str, pw: str | None
) -> None:
    pp = None
    if pw == "ENV":
        pp = Passphrase(env_name="MY_PW")
    elif pw is not None:
        pp = Passphrase(path=Path("/pw") / pw)
    black = SideKeys("black", "black", Path("/b") / bhome, black_fpr, Path("/p/black.asc"), pp)
    red = SideKeys("red", name, Path("/r") / rhome, red_fpr, Path(f"/p/{name}.asc"))
    data = tomllib.loads(black.to_toml_snippet() + "\n" + red.to_toml_snippet())
    cfg = config_from_dict(data, base=Path("/"), environ={})
    assert cfg.link.black_signers == [black_fpr]
    assert cfg.black.signing_key == black_fpr
    assert cfg.black.gnupg_home == Path("/b") / bhome
    assert cfg.red.gnupg_home == Path("/r") / rhome
    assert cfg.channels[0].recipients == [red_fpr]
    if pw == "ENV":
        assert cfg.black.passphrase_env == "MY_PW" and cfg.black.passphrase_file is None
    elif pw is not None:
        assert cfg.black.passphrase_file == Path("/pw") / pw
    else:
        assert cfg.black.passphrase_file is None
        assert cfg.black.passphrase_env == "DIODE_BLACK_PASSPHRASE"


@given(keys=st.lists(st.tuples(fprs, st.sampled_from(["scSC", "cC", "eE", "cEC", "scESC"]),
                               st.sampled_from(["-", "u", "r", "e"])), max_size=6))  # fmt: skip
def test_import_snippet_pins_by_role(keys: list[tuple[str, str, str]]) -> None:
    found = [ImportedKey(f, ("uid",), caps, v, Path("k.asc")) for f, caps, v in keys]
    data = tomllib.loads(import_snippet(found))
    usable = [(f, caps) for f, caps, v in keys if v not in ("r", "e")]
    signers = [f for f, caps in usable if "S" in caps and "E" not in caps]
    recipients = [f for f, caps in usable if "E" in caps]
    assert data.get("link", {}).get("black_signers", []) == signers
    assert (data["channels"][0]["recipients"] if recipients else []) == recipients
    assert "channels" in data or not recipients
