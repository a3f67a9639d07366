"""Exit heads fitted on real text with the real SmolLM2: they must beat the plain final norm + LM head."""

from __future__ import annotations

import pytest
import torch

from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.training import chunk_tokens, collect, evaluate_exit, fit_affine, train_block
from exitplan.workload.sources import read_queries

MIDDLE = 15  # of SmolLM2's 30 layers


@pytest.fixture(scope="module")
def caches(smollm2_checkpoint, smollm2_tokenizer):
    """Train and held-out caches of SmolLM2 over real GSM8K solutions (disjoint questions)."""
    torch.set_num_threads(1)
    model = EarlyExitLM.from_pretrained(smollm2_checkpoint)
    queries = read_queries("gsm8k")
    def stream(rows):
        return [t for q in rows for t in smollm2_tokenizer.encode(q.prompt + "\n" + q.reference)]
    train = chunk_tokens(stream(queries[:300]), 128, max_chunks=28)
    held_out = chunk_tokens(stream(queries[1000:1100]), 128, max_chunks=8)
    exits = [MIDDLE, 24, 29]
    return model, collect(model, train, exits, top_k=32), collect(model, held_out, exits, top_k=32)


def test_affine_map_beats_the_plain_head_at_a_middle_layer(caches) -> None:
    model, train, held_out = caches
    plain = evaluate_exit(model, held_out, MIDDLE, None)
    affine = evaluate_exit(model, held_out, MIDDLE, fit_affine(train, MIDDLE))
    assert affine["agreement"] > plain["agreement"] + 0.05
    assert affine["kl"] < plain["kl"]
    deeper = evaluate_exit(model, held_out, 24, fit_affine(train, 24))
    assert deeper["agreement"] > affine["agreement"]  # agreement grows with depth
    assert 0 <= deeper["low_conf_agreement@0.8"] <= 1


def test_block_head_distillation_lowers_the_loss_and_beats_the_affine_map(caches) -> None:
    model, train, held_out = caches
    head, losses = train_block(model, train, 24, steps=30, lr=1e-4, batch_size=2)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    plain = evaluate_exit(model, held_out, 24, None)
    affine = evaluate_exit(model, held_out, 24, fit_affine(train, 24))
    block = evaluate_exit(model, held_out, 24, head)
    assert block["kl"] < affine["kl"] < plain["kl"]
    assert block["perplexity"] < affine["perplexity"]
    assert not any(p.requires_grad for p in model.parameters())


def test_exit_checkpoint_round_trip(caches, smollm2_checkpoint, tmp_path) -> None:
    from exitplan.earlyexit.checkpoint import ExitIndex, load_heads, read_index, save_heads, write_index

    model, train, held_out = caches
    affine = {MIDDLE: fit_affine(train, MIDDLE)}
    block, _ = train_block(model, train, 24, steps=2, batch_size=1)
    save_heads(tmp_path, "affine", affine)
    save_heads(tmp_path, "block", {24: block})
    index = ExitIndex(model="smollm2", num_layers=model.num_layers, exit_layers=[MIDDLE], kinds=["identity", "affine"],
                      final_perplexity=9.5, train_tokens=64, eval_tokens=32, depth85={"affine": 1.0}, exits=[])
    write_index(tmp_path, index)
    assert read_index(tmp_path) == index
    fresh = EarlyExitLM.from_pretrained(smollm2_checkpoint, layers=MIDDLE)
    assert load_heads(fresh, tmp_path, "affine") == [MIDDLE]
    hidden = held_out.hidden[MIDDLE][:1]
    with torch.no_grad():
        expected = model.model.lm_head(model.model.model.norm(affine[MIDDLE](hidden)))
        assert torch.allclose(fresh.exit_logits(hidden, MIDDLE), expected, atol=1e-5)
