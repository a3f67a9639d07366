"""Fixtures of the library tests: tiny random models of each supported family, saved as checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


@pytest.fixture(params=sorted(FAMILIES))
def tiny_checkpoint(request: pytest.FixtureRequest, tmp_path: Path, smollm2_tokenizer) -> tuple[Path, torch.nn.Module]:
    """A tiny random model of each family over SmolLM2's real vocabulary, saved as a safetensors checkpoint."""
    config_cls, model_cls = FAMILIES[request.param]
    torch.manual_seed(0)
    config = config_cls(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=False)
    model = model_cls(config).eval()
    model.save_pretrained(str(tmp_path))
    return tmp_path, model
