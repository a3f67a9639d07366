"""The plan's router: fitted on a share of the labelled queries, Q(f) measured on the rest, between random and
oracle routing."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.routing.trainer import train_router


def _labelled(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompts whose first embedding feature predicts how much the large model gains on them."""
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(n, 8))
    gain = 1 / (1 + np.exp(-2 * vectors[:, 0]))
    small = rng.uniform(0.2, 0.4, n)
    return vectors, np.stack([small, small + gain * 0.5], axis=1)


def test_router_is_fitted_on_its_share_and_scores_every_query() -> None:
    vectors, qualities = _labelled()
    trained = train_router(vectors, qualities, seed=3, train_share=0.6, fraction_steps=10)
    assert (trained.train, trained.held_out) == (180, 120)
    assert trained.window.shape == (300,)
    assert trained.grid.shape == (11, 2) and trained.values.shape == (11,)


def test_router_curve_lies_between_random_and_oracle() -> None:
    vectors, qualities = _labelled()
    trained = train_router(vectors, qualities, seed=3, train_share=0.6, fraction_steps=10)
    middle = int(np.argmin(np.abs(trained.grid[:, 1] - 0.5)))
    assert trained.random[middle] + 0.02 < trained.values[middle] <= trained.oracle[middle] + 1e-9
    assert trained.quality(np.array([0.5, 0.5])) == pytest.approx(trained.values[middle])


def test_same_seed_same_router_and_another_seed_another_split() -> None:
    vectors, qualities = _labelled()
    a = train_router(vectors, qualities, seed=3, train_share=0.6, fraction_steps=10)
    b = train_router(vectors, qualities, seed=3, train_share=0.6, fraction_steps=10)
    c = train_router(vectors, qualities, seed=4, train_share=0.6, fraction_steps=10)
    assert np.array_equal(a.window, b.window) and not np.array_equal(a.window, c.window)
