"""A causal LM that holds only its first ``layers`` decoder layers, exits at any of them, and loads the rest later.

Built from a transformers checkpoint folder (safetensors + config, as ``fetch_models`` writes them). Only the tensors
of the held layers (and the embeddings, final norm and LM head) are read from disk, so a partial model costs memory
in proportion to its depth: HELIOS's greedy partial load. The final norm and LM head are shared by every exit; a
per-exit module (see :mod:`exitplan.earlyexit.heads`) maps a layer's hidden state before them.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exitplan.errors import ExitplanError

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint at ``path``.

    Raises:
        ExitplanError: when it has none.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ExitplanError(f"no safetensors weights in {path}")
    return files


def read_tensors(path: Path, keep: Any) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint at ``path`` whose name passes ``keep`` (others are never read)."""
    from safetensors import safe_open

    tensors = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep(name):
                    tensors[name] = handle.get_tensor(name)
    return tensors


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (``model.layers.12.mlp...`` -> 12), None for the rest."""
    match = LAYER_KEY.match(name)
    return int(match.group(1)) if match else None


def _truncated_config(config: Any, layers: int) -> Any:
    partial = copy.deepcopy(config)
    partial.num_hidden_layers = layers
    if getattr(partial, "layer_types", None) is not None:
        partial.layer_types = list(config.layer_types)[:layers]
    return partial


class EarlyExitLM(nn.Module):
    """A decoder-only LM holding its first ``held_layers`` layers, with exits after any of them.

    Args:
        model: A transformers causal LM whose ``model.layers`` are the held layers.
        full_config: Config of the whole model (all layers).
        checkpoint: Folder the weights came from (to load the remaining layers later), if any.
    """

    def __init__(self, model: nn.Module, full_config: Any, checkpoint: Path | None = None) -> None:
        super().__init__()
        self.model: Any = model  # a transformers causal LM: its structure (model.layers, norm, lm_head) is dynamic
        self.full_config = full_config
        self.checkpoint = checkpoint
        self.exit_heads = nn.ModuleDict()
        self.packed = False
        self.vocab: nn.Module | None = None
        self.kernels: Any = None  # the C++ decode kernels the runner uses, set by fused.for_serving (native.py)

    # --- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, layers: int | None = None,
                        dtype: torch.dtype = torch.float32) -> EarlyExitLM:
        """Load the first ``layers`` layers (all by default) of the checkpoint at ``path``.

        Raises:
            ExitplanError: if ``layers`` is outside 1..num_hidden_layers or the folder has no weights.
        """
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        from exitplan.checkpoints import require_checkpoint

        path = require_checkpoint(Path(path))
        config = AutoConfig.from_pretrained(str(path))
        total = config.num_hidden_layers
        layers = total if layers is None else layers
        if not 1 <= layers <= total:
            raise ExitplanError(f"layers must be in 1..{total} for {path} (got {layers})")
        partial = _truncated_config(config, layers)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(partial, dtype=dtype)
        state = read_tensors(path, lambda n: (i := layer_index(n)) is None or i < layers)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = getattr(config, "tie_word_embeddings", False)
        if unexpected or [k for k in missing if not (tied and k == "lm_head.weight")]:
            raise ExitplanError(f"{path}: checkpoint does not match its config (missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]})")
        if tied:
            model.tie_weights()
        return cls(model.eval().to(dtype), config, path)

    @classmethod
    def for_inference(cls, path: str | Path, layers: int | None = None,
                      dtype: torch.dtype = torch.float32) -> EarlyExitLM:
        """:meth:`from_pretrained`, then :meth:`pack` where ``dtype`` gains from it (bfloat16 on a CPU with oneDNN's
        bfloat16 kernels): how the engine and the stages that only run the model forward load it."""
        from exitplan.earlyexit.packed import can_pack

        model = cls.from_pretrained(path, layers, dtype)
        if can_pack(dtype):
            model.pack()
        return model

    def pack(self) -> None:
        """Reorder the held layers' linear weights once for oneDNN (inference only; see
        :mod:`exitplan.earlyexit.packed`); layers attached later are packed too. The LM head stays: tied to the
        embeddings, a packed copy would hold its bytes twice."""
        from exitplan.earlyexit.packed import pack

        for layer in self.model.model.layers:
            pack(layer)
        self.packed = True

    def pack_vocab(self) -> None:
        """Project onto the vocabulary through bfloat16 copies of the LM head packed for oneDNN, both ways
        (:class:`~exitplan.earlyexit.packed.FrozenProjection`: gradients still reach the exits' hidden states), for
        the stages that score or distil many exits of many tokens and can hold the copies (a 1.5B model: 0.93 GB).
        Their largest matmul then runs several times faster. A no-op where bfloat16 does not gain
        (:func:`~exitplan.earlyexit.packed.can_pack`) or the head has a bias. The engine does not use it (the LM head
        is tied to the embeddings there, and memory is what HELIOS frees)."""
        from exitplan.earlyexit.packed import FrozenProjection, can_pack

        if can_pack(torch.bfloat16) and self.model.lm_head.bias is None:
            self.vocab = FrozenProjection(self.model.lm_head)

    # --- shape ---------------------------------------------------------------------------------------------------
    @property
    def held_layers(self) -> int:
        """Decoder layers in memory."""
        return len(self.model.model.layers)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the full model."""
        return int(self.full_config.num_hidden_layers)

    def load_remaining_layers(self) -> None:
        """Read the layers not yet held from the checkpoint and append them, making the model whole.

        Raises:
            ExitplanError: if the model was not built from a checkpoint folder.
        """
        self.attach_layers(self.read_layers(self.num_layers))

    def read_layers(self, upto: int) -> list[nn.Module]:
        """Build layers ``held_layers+1..upto`` from the checkpoint, without attaching them (safe to run in a
        background thread while the held layers keep serving: nothing the model uses is touched).

        Raises:
            ExitplanError: if the model was not built from a checkpoint folder, or ``upto`` is out of range.
        """
        start = self.held_layers
        if not start <= upto <= self.num_layers:
            raise ExitplanError(f"cannot grow {start} held layers to {upto} (the model has {self.num_layers})")
        if upto == start:
            return []
        if self.checkpoint is None:
            raise ExitplanError("this model was not loaded from a checkpoint; cannot load its remaining layers")
        reference = next(self.model.parameters())
        state = read_tensors(self.checkpoint, lambda n: (i := layer_index(n)) is not None and start <= i < upto)
        layers = []
        for index in range(start, upto):
            layer = self.new_layer(index)
            prefix = f"model.layers.{index}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            layers.append(layer.to(dtype=reference.dtype).eval())
        return layers

    def new_layer(self, index: int) -> nn.Module:
        """An unloaded decoder layer at 0-based ``index``, of the held layers' class and config (not packed)."""
        # The running model's config carries the attention implementation chosen at load; widen it to all layers.
        whole = _truncated_config(self.model.config, self.held_layers)
        whole.num_hidden_layers = self.num_layers
        if getattr(self.full_config, "layer_types", None) is not None:
            whole.layer_types = list(self.full_config.layer_types)
        return type(self.model.model.layers[0])(whole, layer_idx=index)

    def attach_layers(self, layers: list[Any]) -> None:
        """Append layers built by :meth:`read_layers` (they must continue the held stack)."""
        held = self.held_layers
        for offset, layer in enumerate(layers):
            if layer.self_attn.layer_idx != held + offset:
                raise ExitplanError(f"layer {layer.self_attn.layer_idx} does not follow the {held} held layers")
        if self.packed:
            from exitplan.earlyexit.packed import pack

            layers = [pack(layer) for layer in layers]
        for layer in layers:
            self.model.model.layers.append(layer)
        self.model.config.num_hidden_layers = self.held_layers
        if getattr(self.full_config, "layer_types", None) is not None:
            self.model.config.layer_types = list(self.full_config.layer_types)[: self.held_layers]

    def weight_bytes(self) -> int:
        """Bytes of the weights in memory (a tied LM head counted once, packed weights included), exit heads
        included."""
        from exitplan.earlyexit.packed import module_bytes

        return module_bytes(self)

    # --- forward -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def layer_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Hidden state after each held layer (before the final norm); each ``batch x seq x d``."""
        captured: list[torch.Tensor] = []

        def grab(_module: nn.Module, _inputs: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        hooks = [layer.register_forward_hook(grab) for layer in self.model.model.layers]
        try:
            self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        return captured

    def logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """The exit operation: ``head`` (if any) maps an exit's hidden state, then the final norm and the LM head
        give float32 logits over the vocabulary (through the packed copies of :meth:`pack_vocab` if it was called)."""
        mapped = head(hidden) if head is not None else hidden
        normed = self.model.model.norm(mapped)
        if self.vocab is not None:
            return self.vocab(normed).float()
        return self.model.lm_head(normed).float()

    def exit_logits(self, hidden: torch.Tensor, exit_layer: int) -> torch.Tensor:
        """Logits at the exit after layer ``exit_layer`` (1-based) from that layer's hidden state, through the head
        registered for that layer if any (the last layer of the full model needs none); see :meth:`logits`."""
        head = self.exit_heads[str(exit_layer)] if str(exit_layer) in self.exit_heads else None  # noqa: SIM401
        return self.logits(hidden, head)  # (nn.ModuleDict has no .get)

    def add_exit_head(self, exit_layer: int, head: nn.Module) -> None:
        """Register the exit head used after layer ``exit_layer`` (1-based)."""
        if not 1 <= exit_layer <= self.num_layers:
            raise ExitplanError(f"exit layer {exit_layer} outside 1..{self.num_layers}")
        self.exit_heads[str(exit_layer)] = head
