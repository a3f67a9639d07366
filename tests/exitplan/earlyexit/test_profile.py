"""Exit-profile arithmetic on hand-made traces (where each answer can be checked by eye)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from exitplan.earlyexit.heads import AffineHead
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.profile import (
    TokenExits,
    complementarity,
    depth_reaching,
    exit_curve,
    first_confident_exit,
    profile_metrics,
    trace_kinds,
)


def _trace(conf: list[list[float]], top1: list[list[int]], final: list[int]) -> TokenExits:
    return TokenExits([2, 4, 6], 8, np.array(conf), np.array(top1), np.array(final))


SMALL = _trace(
    conf=[[0.9, 0.2, 0.3, 0.1], [0.9, 0.85, 0.4, 0.2], [0.95, 0.9, 0.5, 0.3]],
    top1=[[5, 7, 1, 9], [5, 6, 1, 9], [5, 6, 2, 9]],
    final=[5, 6, 2, 4],
)


def test_first_confident_exit_and_fallback_to_the_last_layer() -> None:
    assert first_confident_exit(SMALL, 0.8).tolist() == [2, 4, 8, 8]
    assert first_confident_exit(SMALL, 0.95).tolist() == [6, 8, 8, 8]


def test_profile_metrics() -> None:
    m = profile_metrics(SMALL, 0.8, early_depth=0.5)
    assert m["earliest_share"] == 0.25  # only token 0 is confident at layer 2
    assert m["early_share"] == 0.5      # tokens 0 and 1 by layer 4 of 8
    assert m["exited_agreement"] == 1.0  # token 0 says 5 (final 5), token 1 says 6 at layer 4 (final 6)
    # tokens 1, 2, 3 are under 0.8 at layer 2; their layer-2 tokens 7, 1, 9 vs final 6, 2, 4: none agree
    assert m["low_conf_agreement"] == 0.0
    assert m["first_exit_distribution"] == {2: 0.25, 4: 0.25, 8: 0.5}


def test_complementarity_is_the_union_of_early_exits() -> None:
    large = _trace(conf=[[0.1, 0.1, 0.9, 0.1], [0.1, 0.1, 0.9, 0.1], [0.1, 0.1, 0.9, 0.9]],
                   top1=SMALL.top1.tolist(), final=SMALL.final_top1.tolist())
    c = complementarity(SMALL, large, 0.8, early_depth=0.5)
    assert c == {"small_alone": 0.5, "large_alone": 0.25, "together": 0.75}
    with pytest.raises(ValueError, match="same number|same tokens"):
        complementarity(SMALL, _trace([[0.1]] * 3, [[1]] * 3, [1]), 0.8, 0.5)


def test_exit_curve_and_depth_reaching() -> None:
    curve = exit_curve(SMALL, thresholds=[0.8])
    assert [r["agreement"] for r in curve] == [0.25, 0.5, 0.75]
    assert curve[1]["confident_share@0.8"] == 0.5 and curve[1]["confident_agreement@0.8"] == 1.0
    assert depth_reaching(curve, 0.5) == 0.5  # layer 4 of 8
    assert depth_reaching(curve, 0.7) == 0.75  # layer 6 of 8
    assert depth_reaching(curve, 0.85) == 1.0  # no exit reaches it


def test_subset_keeps_the_chosen_tokens() -> None:
    sub = SMALL.subset(np.array([True, False, False, True]))
    assert len(sub) == 2 and sub.final_top1.tolist() == [5, 4] and sub.top1[:, 1].tolist() == [9, 9, 9]


def test_trace_kinds_shares_one_pass_and_matches_the_model(tiny_llama, tmp_path) -> None:
    torch.manual_seed(0)
    tiny_llama.save_pretrained(str(tmp_path))
    model = EarlyExitLM.from_pretrained(tmp_path)
    chunks = torch.randint(0, model.full_config.vocab_size, (3, 12))
    affine = AffineHead(model.full_config.hidden_size)
    with torch.no_grad():
        affine.linear.weight.mul_(0.5)
    traces = trace_kinds(model, chunks, [1, 2], {"identity": {}, "affine": {1: affine}}, batch_size=2)
    ident, aff = traces["identity"], traces["affine"]
    assert (ident.final_top1 == aff.final_top1).all()
    assert (ident.top1[1] == aff.top1[1]).all() and not np.allclose(ident.confidence[0], aff.confidence[0])
    with torch.no_grad():
        out = model.model(input_ids=chunks)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), chunks[:, 1:].reshape(-1))
    assert np.isnan(ident.final_nll.reshape(3, 12)[:, -1]).all()
    assert np.nanmean(ident.final_nll) == pytest.approx(float(expected), rel=1e-4)
    assert (ident.final_top1 == out.logits.argmax(-1).flatten().numpy()).all()


def test_bfloat16_autocast_trace_stays_close_to_float32(smollm2_checkpoint, smollm2_tokenizer) -> None:
    """exit_profile's bfloat16 mode (CPU autocast) on the real SmolLM2 and real text: the same final tokens almost
    everywhere and the same perplexity within 3%, while the confidences are those of a bfloat16 pass."""
    model = EarlyExitLM.from_pretrained(smollm2_checkpoint)
    text = ("The engine batches requests continuously: sequences join and leave the running batch at every step, "
            "and each step's tokens exit at the same layer. ") * 4
    ids = smollm2_tokenizer.encode(text)[:96]
    chunks = torch.as_tensor(ids).view(2, 48)
    exact = trace_kinds(model, chunks, [10, 20], {"identity": {}})["identity"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = trace_kinds(model, chunks, [10, 20], {"identity": {}})["identity"]
    assert np.mean(half.final_top1 == exact.final_top1) >= 0.9
    assert np.exp(np.nanmean(half.final_nll)) == pytest.approx(np.exp(np.nanmean(exact.final_nll)), rel=0.03)
    assert not np.array_equal(half.confidence, exact.confidence)  # the pass really ran in bfloat16
