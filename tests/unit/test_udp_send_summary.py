"""The UDP sender's summary (pure): a long-running sender keeps a count, not every name."""

from __future__ import annotations

from bridge.diode.udp_sender import RECENT_FILES, SendSummary


def test_files_sent_are_counted_and_only_recent_names_kept() -> None:
    s = SendSummary()
    n = 3 * RECENT_FILES + 7
    for i in range(n):
        s.sent(f"f{i}")
    assert s.files_sent == n and s.to_json()["files"] == n
    assert RECENT_FILES <= len(s.files) < 2 * RECENT_FILES  # bounded, the newest kept
    assert s.files[-1] == f"f{n - 1}" and s.files == [f"f{i}" for i in range(n - len(s.files), n)]
