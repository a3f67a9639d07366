"""Routing scores: how much a query needs a larger model, from its prompt alone.

- :class:`EmbeddingScorer`: BOUTE's learned router - MiniLM sentence embeddings of the prompt, and a ridge regression
  per model predicting its quality label; the score of routing up from model ``i`` to ``j`` is the predicted gain.
  For K models the score is the predicted gain of the largest over the smallest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


class Embedder:
    """A sentence embedder held in memory: mean-pooled, L2-normalised embeddings (MiniLM's recipe).

    Args:
        checkpoint: The embedder's checkpoint folder.
        max_tokens: Tokens kept per text.
    """

    def __init__(self, checkpoint: Path, max_tokens: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        from exitplan.checkpoints import require_checkpoint

        self.tokenizer = AutoTokenizer.from_pretrained(str(require_checkpoint(checkpoint)))
        self.model = AutoModel.from_pretrained(str(checkpoint)).eval()
        self.max_tokens = max_tokens

    def __call__(self, texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
        """Embeddings of ``texts``, ``n x d``."""
        import torch

        out = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                batch = self.tokenizer(list(texts[start:start + batch_size]), padding=True, truncation=True,
                                       max_length=self.max_tokens, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].float()
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(out)


def embed(checkpoint: Path, texts: Sequence[str], batch_size: int = 16, max_tokens: int = 256) -> np.ndarray:
    """Mean-pooled, L2-normalised sentence embeddings (MiniLM's recipe) of ``texts``; ``n x d``."""
    return Embedder(checkpoint, max_tokens)(texts, batch_size)


class EmbeddingScorer:
    """Ridge regressions from prompt embeddings to each model's quality; score = predicted gain of the last model
    over the first.

    Args:
        alpha: Ridge penalty.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = alpha
        self.coef = np.zeros((0, 0))
        """Ridge weights, ``K x d`` (one row per model)."""
        self.intercept = np.zeros(0)
        """Ridge intercepts, ``K``."""

    def fit(self, embeddings: np.ndarray, qualities: np.ndarray) -> EmbeddingScorer:
        """Fit on ``n x d`` embeddings and ``n x K`` quality labels (models from smallest to largest)."""
        from sklearn.linear_model import Ridge

        fits = [Ridge(alpha=self.alpha).fit(embeddings, qualities[:, k]) for k in range(qualities.shape[1])]
        self.coef = np.stack([f.coef_ for f in fits])
        self.intercept = np.asarray([f.intercept_ for f in fits], float)
        return self

    @classmethod
    def from_weights(cls, coef: np.ndarray, intercept: np.ndarray) -> EmbeddingScorer:
        """A fitted scorer from its weights (as :mod:`exitplan.routing.router_file` stores them)."""
        scorer = cls()
        scorer.coef, scorer.intercept = np.asarray(coef, float), np.asarray(intercept, float)
        return scorer

    def predict_quality(self, embeddings: np.ndarray) -> np.ndarray:
        """Predicted quality of each model, ``n x K``."""
        return np.asarray(embeddings, float) @ self.coef.T + self.intercept

    def score(self, embeddings: np.ndarray) -> np.ndarray:
        """Predicted gain of the largest model over the smallest, ``n``."""
        q = self.predict_quality(embeddings)
        return q[:, -1] - q[:, 0]
