"""UDP sender pacing: the token bucket keeps the long-run rate and bounds bursts (fake clock)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bridge.diode.udp_pacing import TokenBucket


@given(
    st.integers(10_000, 10**9),
    st.integers(65_536, 4 << 20),
    st.lists(st.integers(64, 9000), min_size=50, max_size=400),
)
def test_rate_and_burst_are_honoured(rate: int, burst: int, sizes: list[int]) -> None:
    now = 0.0
    bucket = TokenBucket(rate, burst, now)
    sent = 0
    for n in sizes:
        wait = bucket.take(n, now)
        now += wait  # the sender sleeps, then sends
        sent += n
        assert sent <= burst + rate * now + 1e-6 * rate  # never ahead of the bucket
    if sum(sizes) > 2 * burst:
        assert now >= (sum(sizes) - burst) / rate - 1e-9  # the pace was really applied


def test_idle_time_refills_only_up_to_the_burst() -> None:
    bucket = TokenBucket(1000, 2000, 0.0)
    assert bucket.take(2000, 0.0) == 0.0
    assert bucket.take(1000, 0.0) == 1.0
    assert bucket.take(2000, 100.0) == 0.0  # a long idle spell: full again, not 100 000
    assert bucket.take(1, 100.0) > 0
