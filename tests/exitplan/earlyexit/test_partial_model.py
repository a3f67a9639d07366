"""The partial early-exit model: memory of held layers only, exact hidden states, exact growth to the full model."""

from __future__ import annotations

import pytest
import torch

from exitplan.earlyexit.confidence import confidence
from exitplan.earlyexit.packed import can_pack
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.errors import ExitplanError


def _ids(tokenizer) -> torch.Tensor:
    text = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
            "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # recursion!"]
    ids = [tokenizer.encode(t)[:20] for t in text]
    return torch.tensor(ids)


def test_a_partial_model_holds_only_its_layers(tiny_checkpoint) -> None:
    path, full = tiny_checkpoint
    partial = EarlyExitLM.from_pretrained(path, layers=2)
    names = [n for n, _ in partial.model.named_parameters()]
    assert not any(".layers.2." in n or ".layers.5." in n for n in names)
    layer_params = sum(p.numel() for p in full.model.layers[0].parameters())
    held = sum(p.numel() for p in partial.parameters())
    assert held == sum(p.numel() for p in full.parameters()) - 4 * layer_params
    assert partial.held_layers == 2 and partial.num_layers == 6


def test_hidden_states_equal_the_full_models_first_layers(tiny_checkpoint, smollm2_tokenizer) -> None:
    path, full = tiny_checkpoint
    ids = _ids(smollm2_tokenizer)
    partial = EarlyExitLM.from_pretrained(path, layers=3).layer_outputs(ids)
    whole = EarlyExitLM.from_pretrained(path).layer_outputs(ids)
    assert len(partial) == 3 and len(whole) == 6
    for a, b in zip(partial, whole[:3], strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        reference = full(ids, use_cache=False).logits
    model = EarlyExitLM.from_pretrained(path)
    assert torch.allclose(model.exit_logits(whole[-1], 6), reference, atol=1e-5)


def test_loading_the_remaining_layers_gives_exactly_the_full_model(tiny_checkpoint, smollm2_tokenizer) -> None:
    path, full = tiny_checkpoint
    ids = _ids(smollm2_tokenizer)
    model = EarlyExitLM.from_pretrained(path, layers=2)
    model.load_remaining_layers()
    assert model.held_layers == 6
    with torch.no_grad():
        assert torch.equal(model.model(ids, use_cache=False).logits, full(ids, use_cache=False).logits)


def test_bad_depth_is_refused(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    with pytest.raises(ExitplanError, match="layers must be in 1..6"):
        EarlyExitLM.from_pretrained(path, layers=7)


def test_confidence_measures() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert confidence(logits, "max_prob")[0] > 0.99 and confidence(logits, "max_prob")[1] == pytest.approx(1 / 3)
    assert confidence(logits, "margin")[1] == pytest.approx(0.0)
    assert confidence(logits, "entropy")[1] == pytest.approx(0.0, abs=1e-6)
    assert confidence(logits, "entropy")[0] > 0.9
    with pytest.raises(ExitplanError, match="unknown confidence"):
        confidence(logits, "vibes")


def test_logits_through_the_packed_vocabulary_match_the_lm_head_and_pass_gradients(tiny_checkpoint,
                                                                                    smollm2_tokenizer) -> None:
    """pack_vocab: mostly the same top tokens as the float32 LM head (a tiny random model has near ties), logits within
    bfloat16 rounding, and a gradient that reaches the exit's hidden state (block heads distil through it); where the
    CPU cannot pack, the LM head itself."""
    path, _ = tiny_checkpoint
    model = EarlyExitLM.from_pretrained(path)
    hidden = model.layer_outputs(_ids(smollm2_tokenizer))[2]
    exact = model.logits(hidden)
    model.pack_vocab()
    assert (model.vocab is not None) == can_pack(torch.bfloat16)  # a no-op on a CPU without bfloat16 kernels
    mine = hidden.clone().requires_grad_(True)
    fast = model.logits(mine)
    assert fast.dtype == torch.float32 and (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    assert torch.allclose(fast, exact, rtol=0.05, atol=0.05 * float(exact.abs().max()))
    fast.log_softmax(-1)[..., 0].sum().backward()
    assert mine.grad is not None and float(mine.grad.abs().sum()) > 0
