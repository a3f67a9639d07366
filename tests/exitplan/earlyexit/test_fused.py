"""The serving form (fused q/k/v and gate/up, packed LM head): the same logits as the packed separate layers,
through prefill and batched decode, on a model grown later too; where packing does not gain, the model as loaded."""

from __future__ import annotations

import torch
from torch import nn

from exitplan.earlyexit.fused import for_serving, fuse_layer
from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.packed import PackedLinear, can_pack
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, Work, kv_shape

PROMPTS = [[5, 17, 230, 99, 4, 1000, 7], [42, 8, 300], [11, 12, 13, 14, 15]]


def _greedy(model: EarlyExitLM, steps: int = 4) -> list[torch.Tensor]:
    """Logits of a packed prefill of every prompt, then ``steps`` batched decode steps (greedy tokens)."""
    pool = KVPool(kv_shape(model), model.held_layers, 32, 4)
    runner = PagedRunner(model, pool)
    blocks = [pool.allocate(pool.blocks_for(len(p) + steps)) for p in PROMPTS]
    out = [runner.forward([Work.span(p, 0, b) for p, b in zip(PROMPTS, blocks, strict=True)], model.held_layers)]
    positions = [len(p) for p in PROMPTS]
    for _ in range(steps):
        tokens = out[-1].argmax(-1).tolist()
        out.append(runner.forward([Work([t], [p], b) for t, p, b in zip(tokens, positions, blocks, strict=True)],
                                  model.held_layers))
        positions = [p + 1 for p in positions]
    return out


def test_the_serving_form_gives_the_packed_models_logits(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    served = for_serving(path, dtype=torch.bfloat16)
    if not can_pack(torch.bfloat16):  # nothing to gain here: the model as from_pretrained loads it
        assert not served.packed and served.vocab is None
        assert all(isinstance(m, nn.Linear) for m in served.model.model.layers[0].self_attn.children()
                   if not isinstance(m, nn.Identity))
        return
    separate = EarlyExitLM.for_inference(path, dtype=torch.bfloat16)
    layer = served.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv, PackedLinear) and isinstance(layer.mlp.gate_up, PackedLinear)
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert isinstance(served.vocab, PackedLinear)
    assert served.weight_bytes() == separate.weight_bytes() + served.model.lm_head.weight.nbytes  # the head copy
    for ours, theirs in zip(_greedy(served), _greedy(separate), strict=True):
        torch.testing.assert_close(ours, theirs, atol=0.02, rtol=0.02)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_serving_model_grown_later_equals_one_loaded_whole(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    if not can_pack(torch.bfloat16):
        return  # for_serving is from_pretrained there: growing it is test_partial_model's
    whole = for_serving(path, dtype=torch.bfloat16)
    grown = for_serving(path, 2, dtype=torch.bfloat16)
    grown.attach_layers([fuse_layer(layer) for layer in grown.read_layers(grown.num_layers)])
    assert grown.weight_bytes() == whole.weight_bytes()
    for ours, theirs in zip(_greedy(grown), _greedy(whole), strict=True):
        assert torch.equal(ours, theirs)


def test_without_the_head_copy_the_lm_head_is_used_as_is(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    served = for_serving(path, dtype=torch.bfloat16, pack_head=False)
    assert served.vocab is None
    hidden = torch.randn(3, served.full_config.hidden_size, dtype=torch.bfloat16)
    expected = served.model.lm_head(served.model.model.norm(hidden)).float()
    assert torch.equal(served.logits(hidden), expected)
