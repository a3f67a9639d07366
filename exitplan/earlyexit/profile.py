"""Exit profiles: where tokens first become confident, and HELIOS's observations measured on them.

Observation 1 (complementarity): a token that does not exit early in one model often does in another; the union of
two models' early exits covers more tokens than either alone (HELIOS: 74% / 77% alone, 92% together).
Observation 2: most low-confidence early tokens still equal the final layer's token (HELIOS: 85%).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exitplan.earlyexit.confidence import confidence as confidence_of


@dataclass
class TokenExits:
    """Per token and exit: confidence and top-1 token; per token: the final layer's top-1.

    Attributes:
        exit_layers: Exit layers (1-based), increasing; ``E`` of them.
        num_layers: Layers of the full model.
        confidence: ``E x n`` confidences.
        top1: ``E x n`` top-1 token ids at each exit.
        final_top1: ``n`` top-1 token ids of the final layer.
    """

    exit_layers: list[int]
    num_layers: int
    confidence: np.ndarray
    top1: np.ndarray
    final_top1: np.ndarray

    def __len__(self) -> int:
        return len(self.final_top1)


def trace_exits(model: Any, chunks: Any, exit_layers: Sequence[int], kind: str = "max_prob",
                batch_size: int = 4) -> TokenExits:
    """Run ``model`` (an EarlyExitLM with its exit heads registered) over token chunks and record every exit."""
    import torch

    conf: list[list[np.ndarray]] = [[] for _ in exit_layers]
    top: list[list[np.ndarray]] = [[] for _ in exit_layers]
    final: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, len(chunks), batch_size):
            outputs = model.layer_outputs(chunks[start:start + batch_size])
            for i, e in enumerate(exit_layers):
                logits = model.exit_logits(outputs[e - 1], e).float()
                conf[i].append(confidence_of(logits, kind).flatten().numpy())
                top[i].append(logits.argmax(-1).flatten().numpy())
            last = model.model.lm_head(model.model.model.norm(outputs[-1]))
            final.append(last.argmax(-1).flatten().numpy())
    return TokenExits(list(exit_layers), model.num_layers, np.stack([np.concatenate(c) for c in conf]),
                      np.stack([np.concatenate(t) for t in top]), np.concatenate(final))


def first_confident_exit(exits: TokenExits, threshold: float) -> np.ndarray:
    """Per token, the first exit layer whose confidence reaches ``threshold`` (``num_layers`` if none); shape ``n``."""
    confident = exits.confidence >= threshold
    layers = np.asarray(exits.exit_layers)
    first = np.argmax(confident, axis=0)
    return np.where(confident.any(axis=0), layers[first], exits.num_layers)


def exits_early(exits: TokenExits, threshold: float, early_depth: float) -> np.ndarray:
    """Per token, whether it is confident at an exit no deeper than ``early_depth`` of the layers; shape ``n``."""
    return first_confident_exit(exits, threshold) <= early_depth * exits.num_layers


def profile_metrics(exits: TokenExits, threshold: float, early_depth: float) -> dict[str, Any]:
    """HELIOS's per-model observations at one threshold.

    Returns:
        ``earliest_share`` (confident at the earliest exit), ``early_share`` (confident by ``early_depth``),
        ``exited_agreement`` (tokens that exit before the last layer: their exit token equals the final one),
        ``low_conf_agreement`` (tokens under the threshold at the earliest exit whose token there still equals the
        final layer's: Observation 2), ``mean_exit_depth`` and the distribution of first confident exits.
    """
    first = first_confident_exit(exits, threshold)
    index = {layer: i for i, layer in enumerate(exits.exit_layers)}
    exited = first < exits.num_layers
    exit_top1 = np.array([exits.top1[index[layer], t] if layer in index else exits.final_top1[t]
                          for t, layer in enumerate(first)])
    low = exits.confidence[0] < threshold
    agree0 = exits.top1[0] == exits.final_top1
    layers, counts = np.unique(first, return_counts=True)
    return {
        "tokens": int(len(exits)),
        "earliest_share": float(np.mean(~low)),
        "early_share": float(np.mean(first <= early_depth * exits.num_layers)),
        "exited_share": float(np.mean(exited)),
        "exited_agreement": float(np.mean(exit_top1[exited] == exits.final_top1[exited])) if exited.any() else
        float("nan"),
        "low_conf_agreement": float(np.mean(agree0[low])) if low.any() else float("nan"),
        "mean_exit_depth": float(np.mean(first / exits.num_layers)),
        "first_exit_distribution": {int(k): float(v / len(first)) for k, v in zip(layers, counts, strict=True)},
    }


def complementarity(small: TokenExits, large: TokenExits, threshold: float, early_depth: float) -> dict[str, float]:
    """Share of tokens that exit early in the small model, in the large one, and in either (same tokens in both).

    Raises:
        ValueError: if the two traces do not cover the same number of tokens.
    """
    if len(small) != len(large):
        raise ValueError("complementarity needs the same tokens in both models (a shared tokenizer)")
    a = exits_early(small, threshold, early_depth)
    b = exits_early(large, threshold, early_depth)
    return {"small_alone": float(a.mean()), "large_alone": float(b.mean()), "together": float((a | b).mean())}
