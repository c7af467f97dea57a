"""Black, mirror: the exchange catalog in the state dir (every exchange a spooled row may name).

The catalog maps exchange name -> :class:`ExchangeDecl` and is written atomically to
``<state_dir>/exchanges.json``. The mirror updates it *before* binding, so any message found in a
mirror queue has its exchange (type, flags, arguments) in the catalog. Entries are never removed:
rows of a deleted exchange may still sit in the spool. A re-declared exchange (other type, flags or
arguments) replaces its entry: the newest declaration wins.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bridge.config import BlackConfig
from bridge.errors import StateError
from bridge.fsutil import atomic_write_bytes
from bridge.protocol.exchange import ExchangeDecl

__all__ = [
    "CATALOG_FILE",
    "CATALOG_FORMAT",
    "default_catalog_path",
    "load_catalog",
    "merge_catalog",
    "save_catalog",
]

CATALOG_FILE = "exchanges.json"
CATALOG_FORMAT = 1


def default_catalog_path(black: BlackConfig) -> Path:
    """``<state_dir>/exchanges.json``."""
    return Path(black.state_dir) / CATALOG_FILE


def load_catalog(path: Path) -> dict[str, ExchangeDecl]:
    """Read the catalog; a missing file is an empty catalog, a damaged one a StateError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    fix = (
        "restore it from a backup, or move it aside to rebuild it from discovery (exchanges "
        "deleted since will then be missing for rows still in the spool)"
    )
    try:
        doc: Any = json.loads(raw)
    except ValueError as e:
        raise StateError(f"exchange catalog {path} is not valid JSON ({e}): {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != CATALOG_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise StateError(
            f"exchange catalog {path} has format {got!r}, this version reads "
            f"{CATALOG_FORMAT}: {fix}"
        )
    entries = doc.get("exchanges")
    if not isinstance(entries, dict):
        raise StateError(f"exchange catalog {path}: 'exchanges' is not an object: {fix}")
    try:
        return {name: ExchangeDecl.from_json(d) for name, d in entries.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(f"exchange catalog {path}: malformed entry ({e!r}): {fix}") from None


def save_catalog(path: Path, catalog: Mapping[str, ExchangeDecl]) -> None:
    """Write the catalog atomically (temp file, fsync, rename), names sorted."""
    doc = {
        "format": CATALOG_FORMAT,
        "exchanges": {name: catalog[name].to_json() for name in sorted(catalog)},
    }
    data = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n"
    atomic_write_bytes(Path(path), data)


def merge_catalog(
    old: Mapping[str, ExchangeDecl], seen: Iterable[ExchangeDecl]
) -> tuple[dict[str, ExchangeDecl], list[str]]:
    """Merge freshly seen declarations into ``old``; return (merged, names added or changed).

    Nothing is removed (deleted exchanges stay); a name seen with a different declaration is
    replaced by the new one.
    """
    merged = dict(old)
    changed: list[str] = []
    for decl in seen:
        if merged.get(decl.name) != decl:
            merged[decl.name] = decl
            changed.append(decl.name)
    return merged, sorted(set(changed))
