"""Building the problem from pipeline outputs: labels joined per query, Q(f) from held-out scores."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from exitplan.errors import ExitplanError
from exitplan.planner.build import depth_labels, quality_function, quality_table


def test_quality_table_keeps_queries_labelled_for_every_model_and_names_missing_ones() -> None:
    labels = pd.DataFrame({"model": ["s"] * 5 + ["l"] * 4, "dataset": ["g"] * 9,
                           "query_id": ["1", "2", "3", "4", "5", "1", "2", "3", "4"],
                           "quality": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]})
    wide = quality_table(labels, ["s", "l"])
    assert list(wide.columns) == ["s", "l"] and len(wide) == 4
    assert wide.loc[("g", "2")].tolist() == [0.2, 0.7]
    with pytest.raises(ExitplanError, match=r"no quality labels for \['x'\].*user_labels"):
        quality_table(labels, ["s", "x"])


def test_quality_function_interpolates_the_measured_curve() -> None:
    rng = np.random.default_rng(0)
    gain = rng.uniform(size=200)
    q = np.stack([0.5 - gain / 2, 0.5 + gain / 2], axis=1)
    quality, grid, values = quality_function(gain, q, steps=10)
    assert len(grid) == 11 and quality(np.array([1.0, 0.0])) == pytest.approx(q[:, 0].mean())
    assert quality(np.array([0.0, 1.0])) == pytest.approx(q[:, 1].mean())
    between = (values[grid[:, 1] == 0.4][0] + values[grid[:, 1] == 0.5][0]) / 2
    assert quality(np.array([0.55, 0.45])) == pytest.approx(between)
    assert values[grid[:, 1] == 1.0][0] > values[grid[:, 1] == 0.5][0] > values[grid[:, 1] == 0.0][0]


def test_quality_table_ignores_other_models_labelled_on_other_queries() -> None:
    labels = pd.DataFrame({"model": ["s"] * 4 + ["l"] * 4 + ["x"] * 2, "dataset": ["d"] * 8 + ["e"] * 2,
                           "query_id": list("abcd") * 2 + ["p", "q"], "quality": [0, 1, 0, 1, 1, 1, 1, 0, 1, 0.5]})
    wide = quality_table(labels, ["s", "l"])
    assert list(wide.columns) == ["s", "l"] and len(wide) == 4  # "x" labels other queries: no effect


def test_labels_at_a_cut_depth_stay_out_of_q_f_and_come_back_per_query_for_that_depth() -> None:
    rows = [("s", q, 24, 0.5 + i / 10) for i, q in enumerate("abcd")]
    rows += [("s", q, 20, 0.1 * i) for i, q in enumerate("abcd")]  # the small model cut to 20 layers
    rows += [("s", q, 16, 0.0) for q in "abc"]  # a depth labelled on part of the queries only
    rows += [("l", q, 28, 1.0) for q in "abcd"]
    labels = pd.DataFrame(rows, columns=["model", "query_id", "layers", "quality"]).assign(dataset="d")
    wide = quality_table(labels, ["s", "l"])
    assert wide["s"].tolist() == pytest.approx([0.5, 0.6, 0.7, 0.8])  # full depth only, not averaged with cuts
    found = depth_labels(labels, ["s", "l"], wide.index[::-1])
    assert list(found) == [("s", 20)] and found[("s", 20)] == pytest.approx([0.3, 0.2, 0.1, 0.0])
    assert depth_labels(labels.drop(columns="layers"), ["s"], wide.index) == {}
