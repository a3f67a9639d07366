"""Fractions <-> thresholds: held-out queries are split in the asked proportions; routing by a good score helps."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.errors import ExitplanError
from exitplan.routing.fractions import quality_curve, route, thresholds
from exitplan.routing.scores import EmbeddingScorer


def test_thresholds_reproduce_the_fractions_on_held_out_scores() -> None:
    rng = np.random.default_rng(0)
    window, held_out = rng.normal(size=5000), rng.normal(size=5000)
    for fractions in ([0.3, 0.7], [0.2, 0.5, 0.3], [1.0, 0.0]):
        shares = np.bincount(route(held_out, thresholds(window, fractions)), minlength=len(fractions)) / 5000
        assert shares == pytest.approx(fractions, abs=0.02)
    with pytest.raises(ExitplanError, match="sum to 1"):
        thresholds(window, [0.5, 0.6])


def test_quality_curve_rises_with_the_large_share_and_a_good_score_beats_a_random_one() -> None:
    rng = np.random.default_rng(1)
    gain = rng.uniform(0, 1, 400)
    q = np.stack([0.5 - gain / 2, 0.5 + gain / 2], axis=1)
    grid = np.array([[1 - f, f] for f in (0.0, 0.25, 0.5, 1.0)])
    good, noise = quality_curve(gain, q, grid), quality_curve(rng.normal(size=400), q, grid)
    assert np.all(np.diff(good) > 0) and good[0] == pytest.approx(q[:, 0].mean())
    assert good[1] > noise[1] + 0.05 and good[-1] == pytest.approx(noise[-1])


def test_embedding_scorer_learns_which_queries_gain() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 8))
    q = np.stack([np.clip(0.5 - x[:, 0] / 4, 0, 1), np.full(300, 0.6)], axis=1)
    scorer = EmbeddingScorer(alpha=0.1).fit(x[:200], q[:200])
    held = scorer.score(x[200:])
    assert np.corrcoef(held, q[200:, 1] - q[200:, 0])[0, 1] > 0.9


def test_three_models_get_three_score_intervals_in_order_and_back() -> None:
    rng = np.random.default_rng(3)
    window = rng.normal(size=6000)
    for fractions in ([0.5, 0.3, 0.2], [0.0, 0.6, 0.4], [0.3, 0.0, 0.7], [0.0, 0.0, 1.0]):
        cuts = thresholds(window, fractions)
        assert len(cuts) == 2 and cuts[0] <= cuts[1]
        chosen = route(window, cuts)
        shares = np.bincount(chosen, minlength=3) / len(window)
        assert shares == pytest.approx(fractions, abs=0.005)  # and back: the intervals hold the fractions
        order = np.argsort(window)
        assert np.all(np.diff(chosen[order]) >= 0)  # low scores to the smallest model, high to the largest
    # K = 3 quality: each query scored by the model its interval routes it to
    q = np.stack([np.zeros(6000), np.full(6000, 0.5), np.ones(6000)], axis=1)
    grid = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    assert quality_curve(window, q, grid) == pytest.approx([0.0, 0.65, 1.0], abs=0.005)
