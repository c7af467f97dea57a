"""Unit: the no-job warning of `diode red status` (bridge.views) names at most
``SILENT_NAMES_SHOWN`` silent channels, then ``+N more``; retired channels are never named."""

from __future__ import annotations

from typing import Any

from bridge import views


def _warning(n_silent: int, n_retired: int = 0) -> str:
    chans: dict[str, Any] = {f"c{i:02d}": {"silent_now": True} for i in range(n_silent)}
    chans |= {f"r{i:02d}": {"silent_now": True, "retired": {"at": "t"}} for i in range(n_retired)}
    return views._unwatched(chans).plain


def test_up_to_the_limit_every_name_is_shown() -> None:
    n = views.SILENT_NAMES_SHOWN
    text = _warning(n, n_retired=3)
    assert text.endswith("silent now: " + ", ".join(f"c{i:02d}" for i in range(n))), text
    assert "more" not in text and "r00" not in text, text


def test_above_it_the_rest_is_a_count() -> None:
    n = views.SILENT_NAMES_SHOWN
    text = _warning(n + 40)
    assert f"c{n - 1:02d} +40 more ({n + 40} in all: --json, channels.*.silent_now)" in text
    assert f"c{n:02d}" not in text, text
    assert "silent now" not in _warning(0)
