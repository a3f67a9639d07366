"""The routing model file: JSON round trip with the same scores; a pickle or a malformed file is refused by name."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from exitplan.errors import ExitplanError
from exitplan.routing.router_file import RoutingModel, dump_router, load_router
from exitplan.routing.scores import EmbeddingScorer


def _routing() -> RoutingModel:
    rng = np.random.default_rng(0)
    x, q = rng.normal(size=(60, 8)), rng.uniform(size=(60, 2))
    return RoutingModel("org/embedder", ["small", "large"], EmbeddingScorer(alpha=0.1).fit(x, q), rng.normal(size=30))


def test_the_file_round_trips_to_the_same_scores() -> None:
    routing = _routing()
    back = load_router(dump_router(routing), "router.json")
    x = np.random.default_rng(1).normal(size=(5, 8))
    assert back.embedder == routing.embedder and back.models == routing.models
    assert back.scorer.score(x) == pytest.approx(routing.scorer.score(x), abs=1e-12)
    assert np.array_equal(back.window, routing.window)


def test_a_pickled_router_is_refused_without_being_loaded() -> None:
    class Boom:
        def __reduce__(self):  # would run on unpickling
            return (pytest.fail, ("the pickle was loaded",))

    with pytest.raises(ExitplanError, match=r"old\.pkl is a pickle .*refused.*dvc repro plan"):
        load_router(pickle.dumps({"embedder": "x", "scorer": Boom()}), "old.pkl")


@pytest.mark.parametrize(("blob", "message"), [
    (b"{not json", "not an exitplan routing model"),
    (json.dumps({"format": "other"}).encode(), "format"),
    (json.dumps({"format": "exitplan-router/1", "embedder": "e", "models": ["a", "b"], "coef": [[1.0], [2.0]],
                 "intercept": [0.0], "window": [0.1]}).encode(), "intercept"),
    (b'{"format": "exitplan-router/1", "embedder": "e", "models": ["a", "b"], "coef": [[NaN], [2.0]], '
     b'"intercept": [0.0, 0.0], "window": [0.1]}', "not an exitplan routing model"),
])
def test_a_malformed_file_is_named(blob: bytes, message: str) -> None:
    with pytest.raises(ExitplanError, match=f"fleet/router.json.*{message}"):
        load_router(blob, "fleet/router.json")
