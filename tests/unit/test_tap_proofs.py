"""Unit: black's tap — which spool positions count as proven acked (``AckProofs``), above all
for an AMQP channel *behind* (it may still redeliver records of an earlier connection): the
other channel's traffic, and its own acks before it caught up, prove nothing for it."""

from __future__ import annotations

from bridge.black.tap_proofs import AckProofs

MAIN, DEAD = 1, 2


def test_a_channel_with_nothing_unacked_owes_nothing_for_a_group() -> None:
    p = AckProofs(9, (MAIN, DEAD))
    p.sent(MAIN, 1, 19)
    p.nothing_owed(DEAD, 19)  # no dead letter in the group, none unproven before it
    assert p.through == 9 and p.owed
    p.answered(1)
    assert p.through == 19 and not p.owed


def test_the_other_channels_traffic_proves_nothing_for_a_channel_behind() -> None:
    """The interleaving of the double count: after a restart the lost record at 10 may still
    have its dead letter redelivered; the mirror queue's groups are acked and proven, the dead
    queue delivers nothing yet. Crediting it would record ``acked_through`` past 10, and the
    redelivery, after the next restart, would be recorded as a loss again."""
    p = AckProofs(9, (MAIN, DEAD), behind={DEAD})
    for token, end in ((1, 19), (2, 29)):
        p.sent(MAIN, token, end, caught_up=True)
        p.nothing_owed(DEAD, end)
        p.answered(token)
    assert p.proven == {MAIN: 29, DEAD: 9} and p.through == 9
    # the dead letter comes back, is recognised and acked: once proven, the channel caught up
    p.sent(DEAD, 3, 39, caught_up=True)
    p.sent(MAIN, 4, 39, caught_up=True)
    p.answered(4)
    assert p.through == 9
    p.answered(3)
    assert p.through == 39 and not p.behind
    p.nothing_owed(DEAD, 49)  # caught up: back to the plain rule
    assert p.proven[DEAD] == 49


def test_acks_sent_before_a_channel_caught_up_prove_nothing_for_it() -> None:
    """A channel acking redeliveries it recognised (not all of them yet) is still behind: a
    later one may still be on its way. Only a proof asked for once it caught up counts, and
    ``nothing_owed`` then waits for that proof."""
    p = AckProofs(4, (MAIN, DEAD), behind={MAIN})
    p.nothing_owed(DEAD, 14)
    p.sent(MAIN, 1, 14)  # skips only
    p.answered(1)
    assert p.through == 4 and p.behind == {MAIN}
    p.sent(MAIN, 2, 24, caught_up=True)
    p.nothing_owed(MAIN, 34)  # rides on the outstanding proof
    p.nothing_owed(DEAD, 34)
    assert p.through == 4
    p.answered(2)
    assert p.through == 34
