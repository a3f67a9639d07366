"""Confidence of a token at an exit, from its exit logits (pluggable by name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from exitplan.kinds import ConfidenceKind

if TYPE_CHECKING:
    import torch


def max_probability(logits: torch.Tensor) -> torch.Tensor:
    """Largest softmax probability (HELIOS's default); ``... x vocab`` -> ``...``."""
    return logits.float().softmax(dim=-1).amax(dim=-1)


def margin(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the two largest softmax probabilities; ``... x vocab`` -> ``...``."""
    top = logits.float().softmax(dim=-1).topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def negative_entropy(logits: torch.Tensor) -> torch.Tensor:
    """1 - normalised entropy of the softmax (1 = certain, 0 = uniform); ``... x vocab`` -> ``...``."""
    import math

    log_p = logits.float().log_softmax(dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return 1.0 - entropy / math.log(logits.shape[-1])


CONFIDENCES: dict[ConfidenceKind, Callable[[torch.Tensor], torch.Tensor]] = {
    "max_prob": max_probability,
    "margin": margin,
    "entropy": negative_entropy,
}
"""Confidence measure (:data:`exitplan.kinds.ConfidenceKind`) -> function. Higher is more confident, each in [0, 1]."""


def confidence(logits: torch.Tensor, kind: str = "max_prob") -> torch.Tensor:
    """Confidence of each token under the measure ``kind`` (a key of :data:`CONFIDENCES`)."""
    try:
        return CONFIDENCES[kind](logits)  # type: ignore[index]
    except KeyError:
        from exitplan.errors import ExitplanError

        raise ExitplanError(f"unknown confidence '{kind}'; known: {sorted(CONFIDENCES)}") from None
