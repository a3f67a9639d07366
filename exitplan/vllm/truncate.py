"""Partial-layer checkpoints: the first L decoder layers of a model, its final norm and head, as a model vLLM loads.

HELIOS loads only the layers the traffic needs. vLLM cannot drop layers of a checkpoint (``--hf-overrides
'{"num_hidden_layers": L}'`` fails at weight load: ``There is no module or parameter named 'layers.12'``), so the
partial replica gets a checkpoint of its own: every tensor but those of layers >= L, and ``num_hidden_layers = L``
in its config (``layer_types`` and ``max_window_layers`` cut to match). Its last hidden state then goes through the
model's own final norm and LM head: our engine's identity exit at layer L.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from exitplan.atomic import write_json
from exitplan.errors import ExitplanError
from exitplan.files import read_json
from exitplan.packages import replace_dir
from exitplan.planner.plan_file import Plan

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
          "special_tokens_map.json", "vocab.json", "merges.txt")
"""Files of the source checkpoint copied as they are (those present)."""


def plan_cuts(plan: Plan, num_layers: Callable[[str], int]) -> list[tuple[str, int]]:
    """``(model, layers)`` of every partial replica of ``plan``: a deployed group holding fewer layers than its model
    (``num_layers``: a model's layers, from the catalog)."""
    cuts = []
    for entry in plan.models:
        for group in entry.groups:
            layers = group.layers or num_layers(entry.model)
            if layers < num_layers(entry.model) and (entry.model, layers) not in cuts:
                cuts.append((entry.model, layers))
    return cuts


def partial_name(model: str, layers: int) -> str:
    """The folder name of ``model`` cut to ``layers`` layers (``Qwen/Qwen2.5-Coder-0.5B-Instruct-L12``)."""
    return f"{model}-L{layers}"


def truncate(source: Path, out: Path, layers: int, dtype: str | None = None) -> Path:
    """Write the checkpoint ``source`` cut to its first ``layers`` decoder layers into ``out`` (atomically).

    Args:
        source: A Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``).
        out: Folder to write.
        layers: Decoder layers kept (1 .. the model's).
        dtype: Store the tensors in this dtype (``bfloat16``, ``float16``, ``float32``; None: as they are).

    Raises:
        ExitplanError: when ``layers`` is out of range or the checkpoint has no safetensors.
    """
    import torch
    from safetensors.torch import save_file

    from exitplan.earlyexit.partial_model import layer_index, read_tensors, weight_files

    config = read_json(source / "config.json", f"config of {source}")
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ExitplanError(f"{source.name}: cannot keep {layers} of its {total} layers")
    weight_files(source)  # raises when there are none
    kept = read_tensors(source, lambda n: (i := layer_index(n)) is None or i < layers)  # the rest is never read
    if dtype:
        kept = {name: tensor.to(getattr(torch, dtype)) for name, tensor in kept.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(kept, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        write_json(scratch / "config.json", _cut_config(config, layers, dtype))
        for name in COPIED:
            if (source / name).is_file():
                shutil.copyfile(source / name, scratch / name)
        for path in (scratch, *scratch.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)  # mkdtemp and the atomic writes make them private
        replace_dir(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _cut_config(config: dict, layers: int, dtype: str | None) -> dict:
    cut = {**config, "num_hidden_layers": layers}
    if isinstance(cut.get("layer_types"), list):
        cut["layer_types"] = cut["layer_types"][:layers]
    if isinstance(cut.get("max_window_layers"), int):
        cut["max_window_layers"] = min(cut["max_window_layers"], layers)
    if dtype:
        cut["dtype"] = cut["torch_dtype"] = dtype
    return cut


def read_layers(checkpoint: Path) -> int:
    """Decoder layers of the checkpoint at ``checkpoint`` (its config's ``num_hidden_layers``)."""
    return int(read_json(checkpoint / "config.json", f"config of {checkpoint}")["num_hidden_layers"])
