"""Exit profiles: where tokens first become confident, and HELIOS's observations measured on them.

Observation 1 (complementarity): a token that does not exit early in one model often does in another; the union of
two models' early exits covers more tokens than either alone (HELIOS: 74% / 77% alone, 92% together).
Observation 2: most low-confidence early tokens still equal the final layer's token (HELIOS: 85%).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exitplan.earlyexit.confidence import confidence as confidence_of
from exitplan.kinds import ConfidenceKind


@dataclass
class TokenExits:
    """Per token and exit: confidence, top-1 token and loss on the next token; per token: the final layer's.

    Attributes:
        exit_layers: Exit layers (1-based), increasing; ``E`` of them.
        num_layers: Layers of the full model.
        confidence: ``E x n`` confidences.
        top1: ``E x n`` top-1 token ids at each exit.
        final_top1: ``n`` top-1 token ids of the final layer.
        nll: ``E x n`` negative log-likelihood of the actual next token at each exit (NaN where a chunk ends).
        final_nll: ``n`` the same at the final layer.
    """

    exit_layers: list[int]
    num_layers: int
    confidence: np.ndarray
    top1: np.ndarray
    final_top1: np.ndarray
    nll: np.ndarray | None = None
    final_nll: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.final_top1)

    def subset(self, keep: np.ndarray) -> TokenExits:
        """The same record restricted to the tokens where ``keep`` (a boolean mask of length ``n``) is true."""
        return TokenExits(self.exit_layers, self.num_layers, self.confidence[:, keep], self.top1[:, keep],
                          self.final_top1[keep], None if self.nll is None else self.nll[:, keep],
                          None if self.final_nll is None else self.final_nll[keep])


def _next_token_nll(logits: Any, tokens: Any) -> np.ndarray:
    """NLL of each position's next token, flattened; NaN at each chunk's last position (no next token there)."""
    import torch

    logprob = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    nll = torch.full(tokens.shape, float("nan"))
    nll[:, :-1] = -logprob
    return nll.flatten().numpy()


def trace_kinds(model: Any, chunks: Any, exit_layers: Sequence[int], heads: Mapping[str, Mapping[int, Any]],
                kind: ConfidenceKind = "max_prob", batch_size: int = 4) -> dict[str, TokenExits]:
    """Run ``model`` (an EarlyExitLM) once over token chunks and record every exit under every set of heads.

    Args:
        model: The early-exit LM (whole: the final layer is the reference).
        chunks: Token chunks, ``chunks x T``.
        exit_layers: Exit layers to record.
        heads: Head kind -> exit layer -> head module; an exit with no module applies the final norm directly.
        kind: Confidence measure (a key of :data:`exitplan.earlyexit.confidence.CONFIDENCES`).
        batch_size: Chunks per forward pass.

    Returns:
        Head kind -> its record; all kinds share the forward pass and the final layer's tokens.
    """
    import torch

    per_kind: dict[str, dict[str, list[tuple[int, np.ndarray]]]] = {name: {"conf": [], "top": [], "nll": []}
                                                                    for name in heads}
    final, final_nll = [], []
    with torch.no_grad():
        for start in range(0, len(chunks), batch_size):
            batch = chunks[start:start + batch_size]
            outputs = model.layer_outputs(batch)
            for name, mine in heads.items():
                rec = per_kind[name]
                for i, e in enumerate(exit_layers):
                    hidden = outputs[e - 1]
                    head = mine.get(e)
                    logits = model.logits(hidden, head)
                    for key, value in (("conf", confidence_of(logits, kind).flatten().numpy()),
                                       ("top", logits.argmax(-1).flatten().numpy()),
                                       ("nll", _next_token_nll(logits, batch))):
                        rec[key].append((i, value))
            last = model.logits(outputs[-1])
            final.append(last.argmax(-1).flatten().numpy())
            final_nll.append(_next_token_nll(last, batch))

    def stack(pairs: list[tuple[int, np.ndarray]]) -> np.ndarray:
        return np.stack([np.concatenate([v for j, v in pairs if j == i]) for i in range(len(exit_layers))])

    return {name: TokenExits(list(exit_layers), model.num_layers, stack(rec["conf"]), stack(rec["top"]),
                             np.concatenate(final), stack(rec["nll"]), np.concatenate(final_nll))
            for name, rec in per_kind.items()}


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
        "tokens": len(exits),
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


def exit_curve(exits: TokenExits, thresholds: Sequence[float]) -> list[dict[str, float]]:
    """Per exit: agreement with the final layer (all tokens, and confident tokens with the share they cover), and
    perplexity of the next tokens at the exit and at the final layer (needs ``nll``)."""
    agree = exits.top1 == exits.final_top1
    rows = []
    for i, layer in enumerate(exits.exit_layers):
        row = {"exit_layer": int(layer), "depth": layer / exits.num_layers, "agreement": float(agree[i].mean())}
        if exits.nll is not None and exits.final_nll is not None:
            row["perplexity"] = float(np.exp(np.nanmean(exits.nll[i])))
            row["final_perplexity"] = float(np.exp(np.nanmean(exits.final_nll)))
        for t in thresholds:
            above = exits.confidence[i] >= t
            row[f"confident_share@{t}"] = float(above.mean())
            row[f"confident_agreement@{t}"] = float(agree[i][above].mean()) if above.any() else float("nan")
        rows.append(row)
    return rows


def depth_reaching(curve: Sequence[Mapping[str, float]], level: float = 0.85) -> float:
    """Shallowest exit depth (share of layers) whose all-token agreement reaches ``level``; 1.0 if none does."""
    depths = [row["depth"] for row in curve if row["agreement"] >= level]
    return min(depths) if depths else 1.0
