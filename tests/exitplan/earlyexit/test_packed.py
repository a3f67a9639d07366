"""Packed linear weights (oneDNN layout, bfloat16): the same outputs, the same bytes, on layers loaded later too;
on a CPU without native bfloat16 instructions (AVX2 only, AVX512 without BF16), refused by name and never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exitplan.earlyexit.heads import make_head
from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.packed import FrozenProjection, PackedLinear, can_pack, module_bytes, pack
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, Work, attend, kv_shape
from exitplan.errors import ExitplanError

PROMPTS = [[5, 17, 230, 99, 4, 1000, 7], [42, 8, 300]]

BF16_KERNELS = can_pack(torch.bfloat16)
"""Whether this CPU packs bfloat16 (the machines of this kind differ: AVX512 EPYCs do, AVX2-only ones do not)."""


def refused_here() -> bool:
    """On a CPU without the kernels: packing is refused by name (asserted here), and the packing test has nothing
    more to check. True when it was refused."""
    if BF16_KERNELS:
        return False
    with pytest.raises(ExitplanError, match="no oneDNN bfloat16 kernels"):
        pack(nn.Linear(8, 8).to(torch.bfloat16))
    return True


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return set(next(line for line in text.splitlines() if line.startswith("flags")).split(":", 1)[1].split())


def test_bfloat16_is_packed_exactly_where_the_cpu_has_onednn_kernels() -> None:
    """Packing needs a native bfloat16 instruction (emulated bfloat16 loses to float32); float32 is never packed."""
    flags = _cpu_flags()
    assert bool({"avx512_bf16", "amx_bf16", "avx_ne_convert"} & flags) == BF16_KERNELS
    assert not can_pack(torch.float32)


def test_packing_where_the_cpu_cannot_is_refused_by_name_and_for_inference_does_not_pack(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    model = EarlyExitLM.for_inference(path, dtype=torch.bfloat16)
    assert model.packed == BF16_KERNELS
    model.pack_vocab()
    assert (model.vocab is not None) == BF16_KERNELS
    refused_here()


def test_a_packed_linear_gives_the_same_bits_for_any_rows_and_counts_its_bytes() -> None:
    if refused_here():
        return
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    packed = pack(linear)
    assert isinstance(packed, PackedLinear) and module_bytes(packed) == module_bytes(linear)
    for shape in [(1, 96), (5, 96), (33, 96), (2, 7, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))


def test_a_frozen_projection_gives_the_linear_products_and_the_input_gradient() -> None:
    """Forward ``x @ W.T`` and backward ``g @ W`` through the two packed copies, equal to bfloat16 ``F.linear``'s
    (same kernels), with the gradient returned in the input's dtype and none for the frozen weight."""
    if refused_here():
        return
    torch.manual_seed(0)
    linear = nn.Linear(96, 500, bias=False)
    projection = FrozenProjection(linear)
    x = torch.randn(3, 7, 96, requires_grad=True)
    out = projection(x)
    weight = linear.weight.detach().to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x.detach().to(torch.bfloat16), weight))
    grad = torch.randn(3, 7, 500)
    out.float().backward(grad)
    assert x.grad is not None and x.grad.dtype == torch.float32
    expected = (grad.to(torch.bfloat16).reshape(-1, 500) @ weight).float().reshape(3, 7, 96)
    assert torch.allclose(x.grad, expected, rtol=2e-2, atol=2e-2)
    assert not any(p.requires_grad for p in projection.parameters())


def _logits(model: EarlyExitLM) -> list[torch.Tensor]:
    pool = KVPool(kv_shape(model), model.held_layers, 16, 4)
    blocks = [pool.allocate(pool.blocks_for(len(p))) for p in PROMPTS]
    runner = PagedRunner(model, pool)
    return [runner.forward([Work.span(p, 0, b)], model.held_layers, all_positions=True)
            for p, b in zip(PROMPTS, blocks, strict=True)]


def test_a_packed_model_grown_later_equals_the_unpacked_whole_and_weighs_the_same(tiny_checkpoint) -> None:
    if refused_here():
        return
    path, _ = tiny_checkpoint
    whole = EarlyExitLM.from_pretrained(path, dtype=torch.bfloat16)
    grown = EarlyExitLM.from_pretrained(path, 2, dtype=torch.bfloat16)
    grown.pack()
    grown.attach_layers(grown.read_layers(grown.num_layers))
    assert all(isinstance(m, PackedLinear) for layer in grown.model.model.layers
               for m in layer.modules() if isinstance(m, (nn.Linear, PackedLinear)))
    assert not any(isinstance(m, nn.Linear) for m in grown.model.model.layers.modules())
    assert grown.weight_bytes() == whole.weight_bytes()
    for ours, theirs in zip(_logits(grown), _logits(whole), strict=True):
        assert torch.equal(ours, theirs)


def test_a_block_head_loads_into_a_packed_model(tiny_checkpoint) -> None:
    if refused_here():
        return
    path, _ = tiny_checkpoint
    plain = EarlyExitLM.from_pretrained(path, 3, dtype=torch.bfloat16)
    trained = make_head("block", plain, 3)
    packed_model = EarlyExitLM.from_pretrained(path, 3, dtype=torch.bfloat16)
    packed_model.pack()
    head = make_head("block", packed_model, 3)
    head.load_state_dict(trained.state_dict())
    head = pack(head.to(torch.bfloat16))
    x = torch.randn(1, 5, plain.full_config.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(head(x), trained.to(torch.bfloat16)(x))


def test_grouped_attention_equals_torchs_with_masks_and_without() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8)
    batched = torch.rand(3, 1, 5, 9) > 0.3
    batched[..., 0] = True
    for mask in [batched, batched[0, 0], None]:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(attend(q, k, v, mask, 0.3), expected, atol=1e-5, rtol=1e-5)
