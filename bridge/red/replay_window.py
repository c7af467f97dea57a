"""Red, replay confirms (pure): one AMQP channel's publishes awaiting confirms, in order."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from bridge.red.replay_state import Key

__all__ = ["ConfirmWindow"]


class ConfirmWindow:
    """Publishes of one AMQP channel awaiting confirms, in publish order.

    ``sent(tag, key)`` records a publish (tags increase by one per publish on the channel);
    ``confirm`` applies a broker ack or nack (``multiple`` or not, in any order);
    ``pop_acked`` removes and returns the keys of the acknowledged prefix. A nacked publish
    stops the prefix: ``head_nacked`` tells the caller to rewind (``clear``) once ``pending``
    (publishes not yet settled) is 0. A publish may carry a *mark*, the progress key its
    confirmation allows (rows published out of key order, see
    :func:`bridge.red.holdback.publish_order`); without one the mark is its own key.
    """

    __slots__ = ("_q", "pending", "nacked", "_returned")

    def __init__(self) -> None:
        # [tag, key, state: None | True | False, mark, (routing key, body) or None]
        self._q: deque[list[Any]] = deque()
        self.pending = 0
        self.nacked = False
        self._returned = 0  # tag of the last publish matched to a basic.return

    def __len__(self) -> int:
        return len(self._q)

    def sent(self, tag: int, key: Key) -> None:
        q = self._q
        if q and tag != q[-1][0] + 1:
            raise ValueError(f"publish tag {tag} does not follow {q[-1][0]}")
        q.append([tag, key, None, key, None])
        self.pending += 1

    def sent_many(
        self,
        first_tag: int,
        keys: Sequence[Key],
        marks: Sequence[Key] | None = None,
        payloads: Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        """``sent`` for consecutive tags from ``first_tag`` (``marks``: one per key;
        ``payloads``: one ``(routing key, body)`` per key, to tell which publish a
        ``basic.return`` gives back, see :meth:`returned`)."""
        q = self._q
        if q and keys and first_tag != q[-1][0] + 1:
            raise ValueError(f"publish tag {first_tag} does not follow {q[-1][0]}")
        ms = keys if marks is None else marks
        ps: Sequence[Any] = [None] * len(keys) if payloads is None else payloads
        q.extend(
            [
                [first_tag + i, k, None, m, p]
                for i, (k, m, p) in enumerate(zip(keys, ms, ps, strict=True))
            ]
        )
        self.pending += len(keys)

    def returned(self, routing_key: str, body: bytes) -> Key | None:
        """The key of the publish a ``basic.return`` gave back, or None if none matches.

        The broker returns unroutable messages in publish order, each before its confirm; so
        (returns applied before the confirms that arrived with them) the message is the first
        publish after the previously returned one with the same routing key and body."""
        q = self._q
        if not q:
            return None
        base = q[0][0]
        for i in range(max(0, self._returned + 1 - base), len(q)):
            e = q[i]
            p = e[4]
            if p is not None and p[0] == routing_key and p[1] == body:
                self._returned = e[0]
                return e[1]  # type: ignore[no-any-return]
        return None

    def keys(self) -> list[Key]:
        """Keys of every publish in the window, in publish order."""
        return [e[1] for e in self._q]

    def confirm(self, tag: int, multiple: bool, ack: bool) -> int:
        """Apply one confirm; returns how many publishes it settled."""
        q = self._q
        if not q:
            return 0
        base = q[0][0]
        settled = 0
        if multiple:
            for i in range(min(tag - base, len(q) - 1) + 1):
                e = q[i]
                if e[2] is None:
                    e[2] = ack
                    settled += 1
        else:
            i = tag - base
            if 0 <= i < len(q) and q[i][2] is None:
                q[i][2] = ack
                settled = 1
        if settled and not ack:
            self.nacked = True
        self.pending -= settled
        return settled

    def pop_acked(self) -> list[Key]:
        """Keys of the acknowledged prefix, removed from the window, in publish order."""
        return self.pop_acked_marked()[0]

    def pop_acked_marked(self) -> tuple[list[Key], Key | None]:
        """``pop_acked``, and the mark of the last key popped (None when none was)."""
        q = self._q
        out = []
        mark = None
        while q and q[0][2] is True:
            e = q.popleft()
            out.append(e[1])
            mark = e[3]
        return out, mark

    @property
    def head_nacked(self) -> bool:
        return bool(self._q) and self._q[0][2] is False

    def clear(self) -> int:
        """Forget every publish (a rewind or a dead channel); returns how many were pending."""
        pending = self.pending
        self._q.clear()
        self.pending = 0
        self.nacked = False
        self._returned = 0
        return pending
