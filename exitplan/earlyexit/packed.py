"""Linear layers with their weights reordered once into oneDNN's blocked layout, for bfloat16 inference on CPU.

``torch.nn.functional.linear`` in bfloat16 on CPU calls oneDNN too, but reorders the weight on every call, so a
decode step reads each weight twice; reordered once at load, a step streams it once. Measured on this machine (one
core, 72 weights of 4864 x 896): 2.3x faster at one row, 1.8x at sixteen, bit-identical outputs. Inference only (no
gradients); used where the serving engine holds a bfloat16 model and the CPU has native bfloat16 instructions
(:func:`exitplan.cpu_features.bf16_kernels`: AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT); elsewhere (AVX2 only, or
AVX512 without BF16, where oneDNN emulates bfloat16 and packed rows of 16 ran 2.5x slower than float32) models run
unpacked, and packing is refused by name rather than run slow.
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 16
"""Rows oneDNN lays the weights out for (any row count runs; 16 measured as fast as 1 or 256 at every size)."""


def can_pack(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` gain from packing here: bfloat16 on a CPU with native bfloat16 instructions that
    torch's oneDNN supports."""
    from exitplan.cpu_features import bf16_kernels

    return (dtype == torch.bfloat16 and bf16_kernels() and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives in oneDNN's layout (same outputs, no gradient).

    Args:
        linear: The layer to pack (its weight is copied into the packed layout; the layer can then be dropped).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not can_pack(torch.bfloat16):
            from exitplan.errors import ExitplanError

            raise ExitplanError("this CPU has no oneDNN bfloat16 kernels (AVX512-BF16, AMX-BF16 or "
                                "AVX-NE-CONVERT): weights cannot be packed here; load the model with "
                                "EarlyExitLM.for_inference, which packs only where it gains")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight_bytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` over the last dimension of ``x``."""
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` (and ``module`` itself if it is one) by a
    :class:`PackedLinear`; returns the packed module."""
    if isinstance(module, nn.Linear):
        return PackedLinear(module)
    for name, child in module.named_children():
        setattr(module, name, pack(child))
    return module


def module_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights in memory: its parameters (a shared one counted once) and packed weights."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.nbytes
    return total + sum(m.weight_bytes for m in module.modules() if isinstance(m, PackedLinear))


class _Projection(torch.autograd.Function):
    """``x @ W.T`` through packed bfloat16 weights, differentiable in ``x`` only (``W`` is frozen)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, forward: PackedLinear, backward: PackedLinear) -> torch.Tensor:
        ctx.backward, ctx.dtype = backward, x.dtype  # type: ignore[attr-defined]
        return forward(x.to(torch.bfloat16))

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        back = ctx.backward(grad.to(torch.bfloat16))  # type: ignore[attr-defined]
        return back.to(ctx.dtype), None, None  # type: ignore[attr-defined]


class FrozenProjection(nn.Module):
    """A frozen ``nn.Linear`` (no bias) packed in bfloat16 both ways, so that gradients flow to its input at packed
    speed: the forward pass multiplies by ``W`` and the backward pass by ``W.T``, each reordered once (twice the
    layer's bfloat16 bytes). For distilling exit heads through a model's vocabulary head, the largest matmul of a
    training step. Returns bfloat16; the input's gradient comes back in the input's dtype.

    Args:
        linear: The layer (its weight is copied; it may be float32).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().to(torch.bfloat16)
        self.forward_packed = PackedLinear(_linear(weight))
        self.backward_packed = PackedLinear(_linear(weight.t().contiguous()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` (bfloat16), differentiable in ``x``."""
        return _Projection.apply(x, self.forward_packed, self.backward_packed)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer
