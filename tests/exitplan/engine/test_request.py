"""Greedy tokens of a batch of logits: argmax's answer, ties included, whatever the vocabulary's width."""

from __future__ import annotations

import pytest
import torch

from exitplan.engine.request import ARGMAX_CHUNK, greedy_tokens


@pytest.mark.parametrize("vocab", [ARGMAX_CHUNK * 37, ARGMAX_CHUNK * 37 - 5, 1])
def test_greedy_tokens_are_the_rows_argmax(vocab: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, vocab)
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()


def test_among_tied_maxima_the_first_index_wins_across_chunks_and_within_one() -> None:
    logits = torch.zeros(3, ARGMAX_CHUNK * 4)
    logits[0, [ARGMAX_CHUNK + 5, 3 * ARGMAX_CHUNK]] = 2.0  # tied in two chunks: the earlier chunk's
    logits[1, [7, 9]] = 1.0  # tied within one chunk: the earlier index
    logits[2] = -1.0  # every entry tied: index 0
    assert greedy_tokens(logits) == [ARGMAX_CHUNK + 5, 7, 0]


def test_a_non_contiguous_batch_is_read_right() -> None:
    logits = torch.randn(ARGMAX_CHUNK * 2, 6).t()  # 6 rows, strided
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
