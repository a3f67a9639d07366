"""Training BOUTE's router for a plan: fit the embedding scorer on part of the labelled queries, measure Q(f) on
the rest.

The ``plan`` stage embeds the labelled prompts and calls :func:`train_router`; the plan's thresholds are quantiles
of :attr:`TrainedRouter.window` (the scores of every labelled query; the ``plan`` stage swaps in a workload sample's
for a ``traffic: workload`` scenario), and Q(f) is what the planner optimises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from exitplan.routing.fractions import quality_curve
from exitplan.routing.scores import EmbeddingScorer


@dataclass(frozen=True)
class TrainedRouter:
    """A router fitted on labelled queries and its quality curve measured on held-out ones.

    Attributes:
        scorer: The fitted scorer (prompt embedding -> routing score).
        quality: Q(f): load fractions (one per model) -> mean quality of the held-out queries so routed.
        grid: The fraction vectors Q(f) was measured at (``points x models``).
        values: Q at each grid point (the router's curve).
        oracle: The same curve routed by the true quality gap (an upper bound).
        random: The same curve routed at random (a lower bound).
        window: Routing scores of the traffic the plan is for (the plan's thresholds are its quantiles): every
            labelled query, or a sample of the workload (``window_lengths`` then holds their lengths).
        train: Queries the scorer was fitted on.
        held_out: Queries the curves were measured on.
        held_scores: Routing scores of the held-out queries (Q(f, depths) is measured on them too).
        held_qualities: Their quality on each model (``held_out x models``).
        held_rows: Their rows in the labelled queries given to :func:`train_router`.
        held_depth: (model, cut depth) -> their quality on the model cut there, where labels exist at that depth.
        window_lengths: Prompt and answer tokens of each query of ``window`` (``queries x 2``), when the window is a
            sample of the workload rather than the labelled queries (empty: not known).
    """

    scorer: EmbeddingScorer
    quality: Callable[[np.ndarray], float]
    grid: np.ndarray
    values: np.ndarray
    oracle: np.ndarray
    random: np.ndarray
    window: np.ndarray
    train: int
    held_out: int
    held_scores: np.ndarray = field(default_factory=lambda: np.zeros(0))
    held_qualities: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    held_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    held_depth: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    window_lengths: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=int))


def train_router(vectors: np.ndarray, qualities: np.ndarray, seed: int, train_share: float,
                 fraction_steps: int) -> TrainedRouter:
    """Fit the scorer on a random ``train_share`` of the queries and measure Q(f) on the others.

    Args:
        vectors: Prompt embeddings, ``queries x dim``.
        qualities: Each model's quality on each query, ``queries x models`` (models from small to large).
        seed: Seed of the split (and of the random reference curve).
        train_share: Share of the queries the scorer is fitted on (at least two are).
        fraction_steps: Grid steps of the load fractions.
    """
    from exitplan.planner.build import quality_function

    order = np.random.default_rng(seed).permutation(len(qualities))
    cut = max(2, int(len(qualities) * train_share))
    train, held = order[:cut], order[cut:]
    scorer = EmbeddingScorer().fit(vectors[train], qualities[train])
    held_scores = scorer.score(vectors[held])
    quality, grid, values = quality_function(held_scores, qualities[held], fraction_steps)
    oracle = quality_curve(qualities[held][:, -1] - qualities[held][:, 0], qualities[held], grid)
    random = quality_curve(np.random.default_rng(seed).normal(size=len(held)), qualities[held], grid)
    return TrainedRouter(scorer=scorer, quality=quality, grid=grid, values=values, oracle=oracle, random=random,
                         window=scorer.score(vectors), train=len(train), held_out=len(held),
                         held_scores=np.asarray(held_scores, float), held_qualities=qualities[held], held_rows=held)
