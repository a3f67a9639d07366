"""How ``vllm.profile`` turns the event times of streams decoded together into one batch step."""

from __future__ import annotations

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


def test_each_replicas_neighbour_slowdown_pairs_its_lone_steps_with_ones_beside_busy_neighbours(monkeypatch) -> None:
    from exitplan.vllm import profile

    # the machine slows down over the run (every pair 10% slower than the one before): alone and beside move
    # together, so each ratio is the neighbours' alone: replica a 1.2 at batch 1 and 1.1 at 4, replica b 1.0 and 1.3
    beside_over_alone = {("a", 1): 1.2, ("a", 4): 1.1, ("b", 1): 1.0, ("b", 4): 1.3}
    calls = {"n": 0}

    async def alone(url, model, prompts, tokens):
        calls["n"] += 1
        return 0.1 * len(prompts) * 1.1 ** calls["n"]

    async def beside(url, model, prompts, tokens, others):
        assert [u for u, _, _ in others] == [u for u in ("a", "b") if u != url]  # every other replica is busy
        return 0.1 * len(prompts) * 1.1 ** calls["n"] * beside_over_alone[(url, len(prompts))]

    monkeypatch.setattr(profile, "decode_step", alone)
    monkeypatch.setattr(profile, "decode_step_beside", beside)
    got = profile.neighbour_slowdowns([("a", "m"), ("b", "n")], [1, 4], 16, 8, repeats=3)
    assert got == pytest.approx([(1.2 + 1.1) / 2 - 1, (1.0 + 1.3) / 2 - 1])  # one neighbour each, per replica
    assert calls["n"] == 2 * 2 * 4  # replicas x batches x (warm-up + 3 repeats)
    with pytest.raises(ExitplanError, match="two or more replicas"):
        profile.neighbour_slowdowns([("a", "m")], [1], 16, 8, 1)
