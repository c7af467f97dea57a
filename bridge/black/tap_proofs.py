"""Black, tap: which spool positions the broker has proven acked, per AMQP channel (pure)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AckProofs"]


class AckProofs:
    """Which spool positions the broker has proven acked, per AMQP channel of a connection.

    A position counts as acked (``through``) once the acks of *both* channels (mirror queue,
    dead queue) covering it are proven: the broker applied every ack that channel sent before
    the answer to a sync (``request_sync``). A channel with nothing unacked when a group is
    acked owes nothing for it: its last sync (or none) covers the group's records too.

    Except a channel *behind*: records of an earlier connection (after ``start``) may still
    come back on it, and no proof counts for it until one sent once it had caught up (every
    such redelivery arrived: ``Tap._caught_up`` in ``bridge.black.tap``). The two channels'
    deliveries are not ordered with each other, so the other channel's traffic proves nothing
    for it: crediting it would let ``acked_through`` pass a record whose redelivery is still
    to come, and after the next restart that redelivery would no longer be recognised (a loss
    counted twice, a message spooled twice).
    """

    def __init__(self, start: int, channels: tuple[int, ...], behind: Iterable[int] = ()) -> None:
        self.proven = dict.fromkeys(channels, start)
        self.behind = set(behind)
        # token -> (channel, position it proves, sent once the channel had caught up)
        self.tokens: dict[int, tuple[int, int, bool]] = {}
        self.latest: dict[int, int] = {}  # channel -> its newest unanswered token

    @property
    def through(self) -> int:
        return min(self.proven.values())

    @property
    def owed(self) -> bool:
        return bool(self.tokens)

    def sent(self, channel: int, token: int, pos: int, *, caught_up: bool = False) -> None:
        """``channel`` acked what it holds through ``pos`` and asked for the proof ``token``;
        ``caught_up``: every redelivery it was behind on had arrived (and is acked by now)."""
        self.tokens[token] = (channel, pos, caught_up)
        self.latest[channel] = token

    def nothing_owed(self, channel: int, pos: int) -> None:
        """``channel`` has nothing unacked: once its last sync is answered, ``pos`` is proven
        (if it is not behind)."""
        token = self.latest.get(channel)
        if token is not None:
            _, old, caught_up = self.tokens[token]
            self.tokens[token] = (channel, max(pos, old), caught_up)
        elif channel not in self.behind:
            self.proven[channel] = max(self.proven[channel], pos)

    def answered(self, token: int) -> None:
        got = self.tokens.pop(token, None)
        if got is None:
            return
        channel, pos, caught_up = got
        if self.latest.get(channel) == token:
            del self.latest[channel]
        if caught_up:
            self.behind.discard(channel)
        if channel not in self.behind:
            self.proven[channel] = max(self.proven[channel], pos)
