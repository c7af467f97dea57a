"""The relay's loss model (pure): random and burst loss at the configured rates and lengths."""

from __future__ import annotations

import random

import pytest

from bridge.diode.udp_relay import Impairment, LossModel


def _run(imp: Impairment, n: int = 200_000) -> tuple[float, float, dict[str, int]]:
    model = LossModel(imp, random.Random(imp.seed))
    counts: dict[str, int] = {}
    bursts: list[int] = []
    run = 0
    for _ in range(n):
        why = model.decide()
        if why is not None:
            counts[why] = counts.get(why, 0) + 1
        if why == "burst":
            run += 1
        elif run:
            bursts.append(run)
            run = 0
    lost = sum(counts.values()) / n
    return lost, (sum(bursts) / len(bursts) if bursts else 0.0), counts


def test_random_loss_rate() -> None:
    lost, _, counts = _run(Impairment(loss=0.05, seed=1))
    assert 0.045 < lost < 0.055 and set(counts) == {"random"}


def test_burst_loss_rate_and_mean_length() -> None:
    lost, mean, counts = _run(Impairment(burst_loss=0.05, burst_mean=4, seed=2))
    assert 0.04 < lost < 0.06 and set(counts) == {"burst"}
    assert 3.4 < mean < 4.6


def test_bursts_of_exactly_fifty() -> None:
    lost, mean, _ = _run(Impairment(burst_loss=0.05, burst_mean=50, burst_max=50, seed=3))
    assert 0.04 < lost < 0.06
    assert 45 < mean < 52  # exactly 50, but two bursts may touch now and then


def test_bad_impairments_are_refused() -> None:
    for bad in ({"loss": 1.0}, {"burst_mean": 0.5}, {"corrupt": -0.1}):
        with pytest.raises(ValueError):
            Impairment(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("mean", "most"), [(10, 5), (20, 4), (6, 12)])
def test_burst_loss_rate_holds_when_burst_max_caps_the_mean(mean: int, most: int) -> None:
    """burst_max below (or near) burst_mean shortens the bursts: the entry rate is taken from
    the mean length of the bursts as capped, so the loss stays at burst_loss."""
    lost, length, _ = _run(Impairment(burst_loss=0.05, burst_mean=mean, burst_max=most, seed=4))
    assert 0.045 < lost < 0.055, lost
    capped = most if mean >= most else (1 - (1 - 1 / mean) ** most) * mean  # E[min(G, most)]
    assert length <= most * 1.1 and abs(length - capped) < 0.15 * most


@pytest.mark.parametrize(
    "bad",
    [
        {"burst_mean": float("nan")},
        {"burst_mean": float("inf")},
        {"burst_max": 0},
        {"burst_max": -3},
        {"reorder_depth": 0},
        {"reorder_depth": 10**8},
        {"loss": float("nan")},
    ],
)
def test_impairments_that_would_misbehave_are_refused(bad: dict[str, float]) -> None:
    """A NaN or infinite burst_mean gave no bursts at all (the entry rate came out 0 or NaN)
    whatever burst_loss said; a burst_max below 1 made bursts the entry rate did not expect;
    a reorder_depth without bound let the relay hold back without bound."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        Impairment(**bad)  # type: ignore[arg-type]


def test_burst_max_one_gives_single_losses_at_the_configured_rate() -> None:
    lost, mean, counts = _run(Impairment(burst_loss=0.05, burst_mean=4, burst_max=1, seed=6))
    assert 0.045 < lost < 0.055 and set(counts) == {"burst"}
    assert mean < 1.1  # single losses, two touching now and then
