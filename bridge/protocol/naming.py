"""Protocol core (both sides): wire file names of bundles and heartbeats — hostile input on red.

    <channel>.<bundle seq, 12 digits>.<bundle id, 32 lowercase hex>.dbundle
    <channel>.<heartbeat seq, 12 digits>.dheartbeat

A name is accepted only if it matches exactly (ASCII, no path separator, no leading
dot, no temp suffix); anything else raises BundleNameError without echoing more than a
short, escaped prefix of the name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bridge.errors import BundleNameError

__all__ = [
    "BUNDLE_SUFFIX",
    "HEARTBEAT_SUFFIX",
    "CHANNEL_RE",
    "BUNDLE_ID_RE",
    "MAX_SEQ",
    "MAX_NAME",
    "BundleName",
    "HeartbeatName",
    "bundle_name",
    "parse_bundle_name",
    "heartbeat_name",
    "parse_heartbeat_name",
    "check_channel",
    "check_bundle_id",
]

BUNDLE_SUFFIX = ".dbundle"
HEARTBEAT_SUFFIX = ".dheartbeat"
CHANNEL_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
"""A channel name (also a bridge id): the same rule as the configuration's names."""
BUNDLE_ID_RE = re.compile(r"[0-9a-f]{32}")
MAX_SEQ = 10**12 - 1
"""Bundle and heartbeat seqs are 1..MAX_SEQ (12 digits on the wire)."""

MAX_NAME = 160
"""Longer than any valid file name of the protocol: refused before running a regex."""
_BUNDLE_RE = re.compile(r"([a-z0-9][a-z0-9_-]{0,62})\.([0-9]{12})\.([0-9a-f]{32})\.dbundle")
_HEARTBEAT_RE = re.compile(r"([a-z0-9][a-z0-9_-]{0,62})\.([0-9]{12})\.dheartbeat")


@dataclass(frozen=True, slots=True)
class BundleName:
    """The parts of a bundle's wire name."""

    channel: str
    bundle_seq: int
    bundle_id: str

    def __str__(self) -> str:
        return bundle_name(self.channel, self.bundle_seq, self.bundle_id)


@dataclass(frozen=True, slots=True)
class HeartbeatName:
    """The parts of a heartbeat's wire name."""

    channel: str
    heartbeat_seq: int

    def __str__(self) -> str:
        return heartbeat_name(self.channel, self.heartbeat_seq)


def _shown(name: object) -> str:
    return ascii(name if not isinstance(name, str) else name[:80])


def check_channel(channel: object) -> str:
    """``channel`` if it is a valid channel name, else BundleNameError."""
    if not isinstance(channel, str) or CHANNEL_RE.fullmatch(channel) is None:
        raise BundleNameError(
            f"channel {_shown(channel)} is not a channel name "
            "(1-63 of a-z 0-9 _ -, starting with a letter or digit)"
        )
    return channel


def check_bundle_id(bundle_id: object) -> str:
    """``bundle_id`` if it is 32 lowercase hex digits, else BundleNameError."""
    if not isinstance(bundle_id, str) or BUNDLE_ID_RE.fullmatch(bundle_id) is None:
        raise BundleNameError(f"bundle id {_shown(bundle_id)} is not 32 lowercase hex digits")
    return bundle_id


def _check_seq(seq: object, what: str) -> int:
    if not isinstance(seq, int) or isinstance(seq, bool) or not 1 <= seq <= MAX_SEQ:
        raise BundleNameError(f"{what} {seq!r} is not an integer in 1..{MAX_SEQ}")
    return seq


def bundle_name(channel: str, bundle_seq: int, bundle_id: str) -> str:
    """``<channel>.<seq:012d>.<bundle_id>.dbundle``."""
    check_channel(channel)
    _check_seq(bundle_seq, f"channel {channel!r}: bundle seq")
    check_bundle_id(bundle_id)
    return f"{channel}.{bundle_seq:012d}.{bundle_id}{BUNDLE_SUFFIX}"


def parse_bundle_name(name: str) -> BundleName:
    """The parts of a wire bundle name; BundleNameError for anything else."""
    m = _match(_BUNDLE_RE, name, "bundle")
    seq = int(m.group(2))
    if seq < 1:
        raise BundleNameError(f"bundle name {_shown(name)} has bundle seq 0")
    return BundleName(channel=m.group(1), bundle_seq=seq, bundle_id=m.group(3))


def heartbeat_name(channel: str, heartbeat_seq: int) -> str:
    """``<channel>.<seq:012d>.dheartbeat``."""
    check_channel(channel)
    _check_seq(heartbeat_seq, f"channel {channel!r}: heartbeat seq")
    return f"{channel}.{heartbeat_seq:012d}{HEARTBEAT_SUFFIX}"


def parse_heartbeat_name(name: str) -> HeartbeatName:
    """The parts of a wire heartbeat name; BundleNameError for anything else."""
    m = _match(_HEARTBEAT_RE, name, "heartbeat")
    seq = int(m.group(2))
    if seq < 1:
        raise BundleNameError(f"heartbeat name {_shown(name)} has heartbeat seq 0")
    return HeartbeatName(channel=m.group(1), heartbeat_seq=seq)


def _match(pattern: re.Pattern[str], name: object, what: str) -> re.Match[str]:
    if not isinstance(name, str):
        raise BundleNameError(f"{what} name must be str, not {type(name).__name__}")
    if len(name) > MAX_NAME or not name.isascii():
        raise BundleNameError(f"{what} name {_shown(name)} is overlong or not ASCII")
    m = pattern.fullmatch(name)
    if m is None:
        raise BundleNameError(f"{_shown(name)} is not a {what} name")
    return m
