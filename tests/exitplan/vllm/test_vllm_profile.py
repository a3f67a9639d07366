"""How ``vllm.profile`` turns the event times of streams decoded together into one batch step."""

from __future__ import annotations

import numpy as np
import pytest

from exitplan.errors import ExitplanError
from exitplan.vllm.profile import batch_step_seconds


def test_only_gaps_after_the_last_prefill_time_the_batch() -> None:
    # stream 1 decodes alone (gaps of 0.1) until stream 2's prefill ends at 1.0; then both step every 0.3 s
    streams = [[0.0, 0.1, 0.2, 1.0, 1.3, 1.6], [1.0, 1.3, 1.6, 1.9]]
    assert batch_step_seconds(streams) == pytest.approx(0.3)


def test_merged_streams_are_refused_with_the_reason() -> None:
    # the slowest stream's 16 tokens arrived as one event, the others had finished before it started
    with pytest.raises(ExitplanError, match=r"no decode step to time.*events per stream: \[1, 4\].*merged"):
        batch_step_seconds([[0.0, 0.1, 0.2, 0.3], [5.0]])


def test_each_replicas_neighbour_grid_pairs_its_lone_steps_with_ones_beside_busy_neighbours(monkeypatch) -> None:
    from exitplan.vllm import profile

    # the machine slows down over the run (every pair 10% slower than the one before): alone and beside move
    # together, so each ratio is the neighbour's alone; replica a loses most at batch 1 beside a busy neighbour
    beside_over_alone = {("a", 1, 1): 1.2, ("a", 1, 4): 1.5, ("a", 4, 1): 1.0, ("a", 4, 4): 1.1,
                         ("b", 1, 1): 1.05, ("b", 1, 4): 1.3, ("b", 4, 1): 0.9, ("b", 4, 4): 1.2}
    calls = {"n": 0}

    async def alone(url, model, prompts, tokens):
        calls["n"] += 1
        return 0.1 * len(prompts) * 1.1 ** calls["n"]

    async def beside(url, model, prompts, tokens, others):
        assert {u for u, _, _ in others} == {u for u in ("a", "b") if u != url}  # every other replica is busy
        ratio = beside_over_alone[(url, len(prompts), len(others))]
        return 0.1 * len(prompts) * 1.1 ** calls["n"] * ratio

    monkeypatch.setattr(profile, "decode_step", alone)
    monkeypatch.setattr(profile, "decode_step_beside", beside)
    a, b = profile.neighbour_grids([("a", "m"), ("b", "n")], [1, 4], 16, 8, repeats=3)
    assert a.batches == b.batches == [1, 4]
    assert np.allclose(a.values, [[0.2, 0.5], [0.0, 0.1]])  # one neighbour: the ratio less 1
    assert np.allclose(b.values, [[0.05, 0.3], [0.0, 0.2]])  # never below 0
    assert calls["n"] == 2 * 2 * 2 * 4  # replicas x own batches x neighbour batches x (warm-up + 3 repeats)
    with pytest.raises(ExitplanError, match="two or more replicas"):
        profile.neighbour_grids([("a", "m")], [1], 16, 8, 1)
