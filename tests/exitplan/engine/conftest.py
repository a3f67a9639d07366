"""Tiny random Qwen2 models with block exit heads, saved as a checkpoint + exit checkpoint pair for engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from exitplan.earlyexit.checkpoint import ExitIndex, save_heads, write_index
from exitplan.earlyexit.heads import make_head
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.engine.served import Candidate

EXITS = [2, 4]


def make_candidate(root: Path, name: str, seed: int, layers: int = 6) -> Candidate:
    """A tiny Qwen2 (``layers`` layers, d=64, vocab 512) with block heads after layers 2 and 4."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    checkpoint, exits = root / name / "checkpoint", root / name / "exits"
    Qwen2ForCausalLM(config).eval().save_pretrained(str(checkpoint))
    model = EarlyExitLM.from_pretrained(checkpoint)
    heads = {e: make_head("block", model, e) for e in EXITS}
    exits.mkdir(parents=True)
    save_heads(exits, "block", heads)
    write_index(exits, ExitIndex(model=name, num_layers=layers, exit_layers=EXITS, kinds=["identity", "block"],
                                 final_perplexity=float("nan"), train_tokens=0, eval_tokens=0, depth85={}, exits=[]))
    return Candidate(name, checkpoint, exits, "block")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Candidate, Candidate]:
    """Two tiny candidates (different weights, same vocabulary)."""
    root = tmp_path_factory.mktemp("candidates")
    return make_candidate(root, "tiny/a", 0), make_candidate(root, "tiny/b", 1)
