"""Exit heads: the learned module that maps a layer's hidden state before the shared final norm and LM head.

Kinds (:data:`exitplan.kinds.HeadKind`; the builders are :data:`HEADS`):

- ``identity``: nothing learned; the plain final norm + LM head on an intermediate layer (the baseline).
- ``affine``: ``h W + b`` fitted in closed form by ridge regression onto the final layer's hidden state (a
  "tuned lens"); cheap, but weak at shallow exits on Qwen.
- ``block``: an affine map then one decoder layer, followed like every head by the model's final RMS norm, trained
  with the backbone frozen by distillation from the final layer (EE-Tuning's recipe). Warm start (our change to
  EE-Tuning's "initialise from the next layer"): the affine map is ridge-fitted onto the *input* of the model's last
  layer and the decoder layer is a copy of that last layer, so the untrained head already approximates the final
  layer. Measured on SmolLM2 (held-out GSM8K, 60 steps): next-layer init reached 27.6% / 43.1% top-1 agreement at
  layers 10 / 20 of 30, the warm start 36.7% / 51.1% (affine alone: 35.9% / 42.3%).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from exitplan.kinds import HEAD_KINDS, HeadKind


class IdentityHead(nn.Module):
    """No mapping: the final norm and LM head see the layer's hidden state as it is."""

    kind = "identity"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``batch x seq x d`` -> the same."""
        return hidden


class AffineHead(nn.Module):
    """``h -> h W + b`` with ``W`` (``d x d``) and ``b`` fitted by ridge regression.

    Args:
        hidden_size: Model width ``d``.
    """

    kind = "affine"

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(hidden_size))
            self.linear.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``batch x seq x d`` -> ``batch x seq x d``."""
        return self.linear(hidden)

    @torch.no_grad()
    def fit(self, inputs: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-2) -> AffineHead:
        """Least squares with an L2 penalty towards the identity map.

        Args:
            inputs: Hidden states at the exit layer, ``n x d``.
            targets: Hidden states of the final layer for the same tokens, ``n x d``.
            ridge: Penalty, relative to the mean diagonal of the input covariance.
        """
        x = inputs.double()
        y = targets.double()
        x_mean, y_mean = x.mean(0), y.mean(0)
        xc, yc = x - x_mean, y - y_mean
        gram = xc.T @ xc
        lam = ridge * gram.diagonal().mean()
        eye = torch.eye(x.shape[1], dtype=torch.float64)
        # Shrink towards W = I (the identity head) rather than towards 0: argmin |XW - Y|^2 + lam |W - I|^2.
        weight = torch.linalg.solve(gram + lam * eye, xc.T @ yc + lam * eye)
        bias = y_mean - x_mean @ weight
        self.linear.weight.copy_(weight.T.to(self.linear.weight.dtype))
        self.linear.bias.copy_(bias.to(self.linear.bias.dtype))
        return self


class BlockHead(nn.Module):
    """An affine map, then one decoder layer over the whole sequence (the model's final norm follows).

    Args:
        layer: The decoder layer to copy (the model's last layer for the warm start).
        rotary: The model's rotary embedding module (shared, not trained).
        hidden_size: Model width ``d``.
    """

    kind = "block"

    def __init__(self, layer: nn.Module, rotary: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.affine = AffineHead(hidden_size)
        self.layer = copy.deepcopy(layer)
        self._rotary = [rotary]  # kept out of the module tree: not a parameter of the head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``batch x seq x d`` -> ``batch x seq x d`` (causal attention over the sequence, no padding)."""
        hidden = self.affine(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        cos_sin = self._rotary[0](hidden, positions)
        out = self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


def _identity(model: Any) -> nn.Module:
    return IdentityHead()


def _affine(model: Any) -> nn.Module:
    return AffineHead(model.full_config.hidden_size)


def _block(model: Any) -> nn.Module:
    inner = model.model.model
    # a packed layer holds no loadable weights: a head to load into gets a fresh layer of the same shape
    source = model.new_layer(model.held_layers - 1) if getattr(model, "packed", False) else inner.layers[-1]
    return BlockHead(source, inner.rotary_emb, model.full_config.hidden_size)


HEADS: dict[HeadKind, Callable[[Any], nn.Module]] = {"identity": _identity, "affine": _affine, "block": _block}
"""Exit-head kind (:data:`exitplan.kinds.HeadKind`) -> a builder of a new, untrained head for a model."""


def make_head(kind: str, model: Any, exit_layer: int) -> nn.Module:
    """A new, untrained head of ``kind`` for the exit after layer ``exit_layer`` (1-based) of ``model``.

    ``model`` is an :class:`exitplan.earlyexit.partial_model.EarlyExitLM`; a block head copies its last held layer
    (the model's last layer when the model is whole, as it is for training; for loading only the shape matters, and a
    packed model gives a fresh layer). Every head has the same shape whatever its exit layer.

    Raises:
        ExitplanError: ``kind`` is not one of :data:`exitplan.kinds.HEAD_KINDS`.
    """
    build = HEADS.get(kind)  # type: ignore[call-overload]
    if build is None:
        from exitplan.errors import ExitplanError

        raise ExitplanError(f"unknown exit head kind '{kind}'; known: {list(HEAD_KINDS)}")
    return build(model)
