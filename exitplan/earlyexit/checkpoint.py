"""Exit checkpoints: the trained exit heads of one model, as safetensors per head kind plus a JSON index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from exitplan.atomic import write_atomic, write_json
from exitplan.earlyexit.heads import make_head
from exitplan.earlyexit.packed import pack
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.errors import ExitplanError

INDEX = "exits.json"


def save_heads(out_dir: Path, kind: str, heads: dict[int, nn.Module]) -> Path:
    """Write the heads of one kind (exit layer -> module) to ``<out_dir>/<kind>.safetensors``, atomically."""
    from safetensors.torch import save_file

    tensors = {f"{exit_layer}.{name}": t.detach().contiguous()
               for exit_layer, head in heads.items() for name, t in head.state_dict().items()}
    path = out_dir / f"{kind}.safetensors"
    if tensors:
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))
    return path


def write_index(out_dir: Path, index: dict[str, Any]) -> Path:
    """Write ``exits.json``: model, exit layers, head kinds and their held-out metrics."""
    return write_json(out_dir / INDEX, index)


def read_heads(model: EarlyExitLM, exits_dir: Path, kind: str) -> tuple[list[int], dict[int, nn.Module]]:
    """The exit layers saved in ``exits_dir`` and the ``kind`` heads for them (none for ``identity``), unregistered.

    Raises:
        ExitplanError: if the folder has no exit checkpoint or no such kind.
    """
    from safetensors.torch import load_file

    index_path = exits_dir / INDEX
    if not index_path.is_file():
        raise ExitplanError(f"no exit checkpoint at {exits_dir}: run the train_exits stage first")
    index = json.loads(index_path.read_text())
    if kind not in index["kinds"]:
        raise ExitplanError(f"{exits_dir} has no '{kind}' heads; it has {index['kinds']}")
    exits = [int(e) for e in index["exit_layers"]]
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
