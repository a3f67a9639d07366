"""The serving form of a model's weights: fewer, larger matrices, as vLLM lays them out.

Each decoder layer's query, key and value projections become one matrix (``qkv``) and the MLP's gate and up
projections another (``gate_up``): vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``. A decode step then
streams each layer's weights in four calls instead of seven; on this CPU a fused 9728 x 896 gate/up matrix takes
0.99 ms against 2 x 0.79 ms apart (one core, bfloat16, oneDNN packed). The vocabulary head gets a packed copy too
(vLLM's CPU backend does the same; tied to the embeddings it is then held twice): 35 ms a step instead of 45-48 ms.
Outputs equal the separate projections' (each output column is the same dot product). The runner reads either form
(:func:`projections`, :func:`mlp`); the transformers forward of a fused layer no longer exists, so only the engine
loads this form (the training and profiling stages keep :meth:`EarlyExitLM.for_inference`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from exitplan.earlyexit.native import kernels
from exitplan.earlyexit.packed import PackedLinear, can_pack
from exitplan.earlyexit.partial_model import EarlyExitLM


def concat(linears: list[nn.Linear]) -> PackedLinear:
    """One packed linear layer whose output is the outputs of ``linears`` side by side."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    joined = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        joined.bias = nn.Parameter(bias, requires_grad=False)
    return PackedLinear(joined)


def fuse_layer(layer: Any) -> Any:
    """Put a transformers Qwen2/Llama decoder layer in serving form, in place (returns it): ``self_attn.qkv`` with
    ``self_attn.qkv_sizes`` and ``mlp.gate_up``, those and the output and down projections packed."""
    attn, ffn = layer.self_attn, layer.mlp
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    attn.qkv, attn.qkv_sizes = concat(parts), [p.out_features for p in parts]
    ffn.gate_up = concat([ffn.gate_proj, ffn.up_proj])
    del attn.q_proj, attn.k_proj, attn.v_proj, ffn.gate_proj, ffn.up_proj
    attn.o_proj, ffn.down_proj = PackedLinear(attn.o_proj), PackedLinear(ffn.down_proj)
    return layer


def projections(attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of ``x`` (``N x width`` each) through a layer in either form."""
    if hasattr(attn, "qkv"):
        q, k, v = attn.qkv(x).split(attn.qkv_sizes, dim=-1)
        return q, k, v
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def mlp(ffn: Any, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP of a layer in either form."""
    if hasattr(ffn, "gate_up"):
        gate, up = ffn.gate_up(x).chunk(2, dim=-1)
        return ffn.down_proj(ffn.act_fn(gate) * up)
    return ffn(x)


def kv_heads(model: EarlyExitLM) -> int:
    """Key/value heads per layer of ``model`` (from its config: a fused layer has no ``k_proj``)."""
    config = model.full_config
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def for_serving(path: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32,
                pack_head: bool = True, native: bool = True) -> EarlyExitLM:
    """The first ``layers`` layers of the checkpoint at ``path`` in serving form where ``dtype`` gains from packing
    (:func:`~exitplan.earlyexit.packed.can_pack`): fused packed projections, with ``pack_head`` a packed LM head
    copy, and with ``native`` the C++ decode kernels for the runner (``model.kernels``, bfloat16 only:
    :mod:`~exitplan.earlyexit.native`); elsewhere as loaded (float32 runs through torch's own matmuls). Layers
    attached later to a packed model must be fused first (:func:`fuse_layer`); exit heads are packed as usual
    (``model.packed``)."""
    model = EarlyExitLM.from_pretrained(path, layers, dtype)
    if not can_pack(dtype):
        return model
    for layer in model.model.model.layers:
        fuse_layer(layer)
    model.packed = True
    if pack_head and model.model.lm_head.bias is None:
        model.vocab = PackedLinear(model.model.lm_head)
    if native and dtype == torch.bfloat16:
        model.kernels = kernels()
    return model
