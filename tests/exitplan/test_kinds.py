"""Each shared kind has one declaration (exitplan.kinds) and one implementation table that covers it exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exitplan.config import HeliosParams, TrainExitsParams
from exitplan.earlyexit.confidence import CONFIDENCES, confidence
from exitplan.earlyexit.heads import HEADS, make_head
from exitplan.errors import ExitplanError, WorkloadError
from exitplan.kinds import ARRIVAL_KINDS, CONFIDENCE_KINDS, HEAD_KINDS
from exitplan.workload.arrivals import ARRIVALS, make_arrivals


@pytest.mark.parametrize(("table", "kinds"), [(HEADS, HEAD_KINDS), (CONFIDENCES, CONFIDENCE_KINDS),
                                              (ARRIVALS, ARRIVAL_KINDS)])
def test_each_table_covers_its_kind_exactly(table: dict, kinds: tuple) -> None:
    assert sorted(table) == sorted(kinds)


def test_params_accept_every_kind_and_name_an_unknown_one() -> None:
    assert TrainExitsParams(models=["m"], head_kinds=list(HEAD_KINDS)).head_kinds == list(HEAD_KINDS)
    for kind in CONFIDENCE_KINDS:
        assert HeliosParams(candidates=["m"], confidence=kind).confidence == kind
    with pytest.raises(ValueError, match="head_kinds"):
        TrainExitsParams(models=["m"], head_kinds=["mlp"])
    with pytest.raises(ValueError, match="confidence"):
        HeliosParams(candidates=["m"], confidence="top2")


def test_every_confidence_is_in_unit_interval_and_unknown_is_named() -> None:
    logits = torch.randn(3, 50)
    for kind in CONFIDENCE_KINDS:
        values = confidence(logits, kind)
        assert values.shape == (3,) and bool(((values >= 0) & (values <= 1 + 1e-6)).all())
    with pytest.raises(ExitplanError, match="unknown confidence 'top2'"):
        confidence(logits, "top2")


def test_every_arrival_kind_gives_sorted_times_and_unknown_is_named() -> None:
    for kind in ARRIVAL_KINDS:
        times = make_arrivals(kind, 40, 4.0, np.random.default_rng(0), 2.0, timestamps=np.arange(5.0))
        assert len(times) == 40 and bool(np.all(np.diff(times) >= 0))
    with pytest.raises(WorkloadError, match="unknown arrival kind 'uniform'"):
        make_arrivals("uniform", 3, 1.0, np.random.default_rng(0))


def test_unknown_head_kind_is_named() -> None:
    with pytest.raises(ExitplanError, match="unknown exit head kind 'mlp'"):
        make_head("mlp", object(), 3)
