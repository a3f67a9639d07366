"""Exit checkpoints: the trained exit heads of one model, as safetensors per head kind plus a JSON index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from torch import nn

from exitplan.atomic import write_atomic, write_json
from exitplan.earlyexit.heads import make_head
from exitplan.earlyexit.packed import pack
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.errors import ExitplanError
from exitplan.files import as_model, read_json
from exitplan.kinds import HeadKind

INDEX = "exits.json"
"""The index of a model's exit checkpoint (:class:`ExitIndex`), beside its heads' safetensors."""


class ExitIndex(BaseModel):
    """``exits.json``: what a model's exit checkpoint holds (keys a later version adds are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    """The backbone's catalog id."""

    num_layers: int
    """Its decoder layers."""

    exit_layers: list[int]
    """Layers (1-based) with an exit after them."""

    kinds: list[HeadKind]
    """Head kinds saved (``identity`` has no weights)."""

    final_perplexity: float
    """The full model's perplexity on the held-out tokens."""

    train_tokens: int
    """Tokens the heads were fitted on."""

    eval_tokens: int
    """Held-out tokens they were measured on."""

    depth85: dict[str, float]
    """Per kind: the shallowest relative depth whose top-1 agreement reaches 85% (1.0: none does)."""

    exits: list[dict[str, Any]]
    """Per kind and exit layer: its held-out metrics (agreement, KL, perplexity, ...)."""


def save_heads(out_dir: Path, kind: str, heads: dict[int, nn.Module]) -> Path:
    """Write the heads of one kind (exit layer -> module) to ``<out_dir>/<kind>.safetensors``, atomically."""
    from safetensors.torch import save_file

    tensors = {f"{exit_layer}.{name}": t.detach().contiguous()
               for exit_layer, head in heads.items() for name, t in head.state_dict().items()}
    path = out_dir / f"{kind}.safetensors"
    if tensors:
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))
    return path


def write_index(out_dir: Path, index: ExitIndex) -> Path:
    """Write ``exits.json``: model, exit layers, head kinds and their held-out metrics."""
    return write_json(out_dir / INDEX, index.model_dump())


def read_index(exits_dir: Path) -> ExitIndex:
    """The index of the exit checkpoint in ``exits_dir``.

    Raises:
        ExitplanError: there is none (run train_exits), or it is not an exit index (re-run it).
    """
    path = exits_dir / INDEX
    if not path.is_file():
        raise ExitplanError(f"no exit checkpoint at {exits_dir}: run the train_exits stage first")
    hint = "re-run the train_exits stage"
    return as_model(read_json(path, "exit index", hint=hint), ExitIndex, str(path), "an exit index", hint=hint)


def read_heads(model: EarlyExitLM, exits_dir: Path, kind: str) -> tuple[list[int], dict[int, nn.Module]]:
    """The exit layers saved in ``exits_dir`` and the ``kind`` heads for them (none for ``identity``), unregistered.

    Raises:
        ExitplanError: if the folder has no exit checkpoint or no such kind.
    """
    from safetensors.torch import load_file

    index = read_index(exits_dir)
    if kind not in index.kinds:
        raise ExitplanError(f"{exits_dir} has no '{kind}' heads; it has {index.kinds}")
    exits = list(index.exit_layers)
    if kind == "identity":
        return exits, {}
    tensors = load_file(str(exits_dir / f"{kind}.safetensors"))
    heads: dict[int, nn.Module] = {}
    for exit_layer in exits:
        head = make_head(kind, model, exit_layer)
        prefix = f"{exit_layer}."
        head.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        heads[exit_layer] = head.to(dtype=next(model.parameters()).dtype).eval()  # the model's own dtype
        if model.packed:
            heads[exit_layer] = pack(heads[exit_layer])
    return exits, heads


def load_heads(model: EarlyExitLM, exits_dir: Path, kind: str) -> list[int]:
    """Register the ``kind`` heads saved in ``exits_dir`` on ``model``; returns their exit layers.

    Raises:
        ExitplanError: if the folder has no exit checkpoint or no such kind.
    """
    exits, heads = read_heads(model, exits_dir, kind)
    for exit_layer, head in heads.items():
        model.add_exit_head(exit_layer, head)
    return exits
