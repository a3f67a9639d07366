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
