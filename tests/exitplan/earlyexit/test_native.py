"""The C++ decode kernels against the torch ops they replace (bfloat16): RMS norm, residual add + norm, silu-and-mul,
rotary + KV-cache write, decode attention over the paged pool; and the runner through them against the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from exitplan.earlyexit.fused import for_serving
from exitplan.earlyexit.native import kernels, supports
from exitplan.earlyexit.packed import can_pack
from exitplan.earlyexit.runner import attend_decode

BF = torch.bfloat16


@pytest.fixture(scope="module")
def native():
    built = kernels()
    assert built is not None, "the kernels did not build (is a C++ compiler installed?)"
    return built


def _mostly_equal(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal up to float32 summation order: within a bfloat16 step, and bit for bit almost everywhere."""
    torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-2, rtol=1e-2)
    assert (ours == theirs).float().mean() > 0.99


def test_rms_norm_and_the_fused_residual_add_equal_the_transformers_norm(native) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(37, 904, dtype=BF) * 3, torch.randn(37, 904, dtype=BF)  # 904: a tail past 16s
    norm = Qwen2RMSNorm(904, eps=1e-6).to(BF)
    norm.weight.data = (torch.rand(904) + 0.5).to(BF)
    _mostly_equal(native.rms_norm(x, norm.weight, 1e-6), norm(x))
    total, normed = native.add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(total, residual + x)
    _mostly_equal(normed, norm(residual + x))


def test_silu_and_mul_equals_the_gated_mlp_product(native) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(9, 2 * 200, dtype=BF) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps and zero
    gate, up = gate_up.chunk(2, dim=-1)
    _mostly_equal(native.silu_and_mul(gate_up), F.silu(gate) * up)


def _rope(n: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(n) * 7 + 3
    freqs = positions[:, None].float() / (1e6 ** (torch.arange(0, hd, 2).float() / hd))[None]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(BF)[None], angles.sin().to(BF)[None]


@pytest.mark.parametrize(("heads", "kv", "hd"), [(14, 2, 64), (4, 4, 128)])
def test_rotary_and_cache_write_equal_transformers_bit_for_bit(native, heads: int, kv: int, hd: int) -> None:
    torch.manual_seed(2)
    n = 9
    qkv = torch.randn(n, (heads + 2 * kv) * hd, dtype=BF)
    cos, sin = _rope(n, hd)
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
    q_ref, k_ref = apply_rotary_pos_emb(q.reshape(1, n, heads, hd).transpose(1, 2),
                                        k.reshape(1, n, kv, hd).transpose(1, 2), cos, sin)
    keys, values = torch.zeros(kv, 100, hd, dtype=BF), torch.zeros(kv, 100, hd, dtype=BF)
    slots = torch.randperm(100)[:n]
    native.rope_and_cache(qkv, cos, sin, keys, values, slots, heads)
    assert torch.equal(qkv[:, :heads * hd].view(n, heads, hd), q_ref[0].transpose(0, 1))
    assert torch.equal(keys[:, slots], k_ref[0])
    assert torch.equal(values[:, slots], v.reshape(n, kv, hd).transpose(0, 1))
    assert int((keys != 0).any(-1).sum()) == n * kv  # nothing written outside the tokens' slots


@pytest.mark.parametrize(("heads", "kv", "hd"), [(14, 2, 64), (4, 4, 128), (8, 2, 16)])
def test_decode_attention_over_the_pool_equals_the_torch_decode_attention(native, heads: int, kv: int,
                                                                          hd: int) -> None:
    torch.manual_seed(3)
    capacity = 2000
    keys, values = torch.randn(kv, capacity, hd, dtype=BF), torch.randn(kv, capacity, hd, dtype=BF)
    lengths = torch.tensor([1, 16, 17, 299, 40, 150])  # one slot, whole and part sixteens
    width = int(lengths.max())
    table = torch.stack([torch.cat([torch.randperm(capacity)[:n], torch.zeros(width - n, dtype=torch.long)])
                         for n in lengths.tolist()])
    qkv = torch.randn(len(lengths), (heads + 2 * kv) * hd, dtype=BF) * 2
    flat = table.reshape(-1)
    expected = attend_decode(qkv[:, :heads * hd].reshape(len(lengths), heads, hd),
                             torch.index_select(keys, 1, flat).view(kv, *table.shape, hd),
                             torch.index_select(values, 1, flat).view(kv, *table.shape, hd),
                             torch.arange(width)[None] < lengths[:, None], hd ** -0.5)
    _mostly_equal(native.decode_attention(qkv, keys, values, table, lengths, heads, hd ** -0.5), expected)


def test_bad_inputs_are_refused_by_name(native) -> None:
    keys = torch.zeros(2, 10, 64, dtype=BF)
    qkv = torch.zeros(1, 18 * 64, dtype=BF)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        native.rms_norm(torch.zeros(2, 64), torch.ones(64, dtype=BF), 1e-6)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        native.decode_attention(qkv, keys, keys.clone(), torch.tensor([[10]]), torch.tensor([1]), 14, 0.1)
    with pytest.raises(RuntimeError, match="context length"):
        native.decode_attention(qkv, keys, keys.clone(), torch.tensor([[0]]), torch.tensor([2]), 14, 0.1)
    two, angles = torch.randn(2, 18 * 64, dtype=BF), torch.rand(1, 2, 64, dtype=BF)
    before = two.clone()
    with pytest.raises(RuntimeError, match="slot out of the pool"):  # the second token's slot: nothing written
        native.rope_and_cache(two, angles, angles, keys, keys.clone(), torch.tensor([0, 10]), 14)
    assert torch.equal(two, before) and not keys.any()


def test_the_runner_through_the_kernels_gives_the_torch_paths_logits(tiny_checkpoint) -> None:
    from tests.exitplan.earlyexit.test_fused import _greedy

    path, _ = tiny_checkpoint
    if not can_pack(BF):
        return  # no serving form here: the kernels are not used (test_fused covers the model as loaded)
    fast, plain = for_serving(path, dtype=BF), for_serving(path, dtype=BF, native=False)
    assert fast.kernels is not None and plain.kernels is None
    for ours, theirs in zip(_greedy(fast), _greedy(plain), strict=True):
        torch.testing.assert_close(ours, theirs, atol=0.02, rtol=0.02)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_kernels_serve_bfloat16_heads_of_sixteens_only() -> None:
    assert supports(BF, 64) and supports(BF, 128)
    assert not supports(torch.float32, 64) and not supports(BF, 8) and not supports(BF, 96)
