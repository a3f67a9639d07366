"""Real vLLM CPU replicas started with the rendered command: they serve, and a truncated checkpoint holds more KV
blocks in the same memory and gives our engine's identity exit."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from exitplan.cpu_features import local_dtype
from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, Work, kv_shape
from tests.conftest import LARGE_VLLM, SMALL_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]

REPLICA_DTYPE = local_dtype("bfloat16")
"""What the fixture's replicas run in here (``vllm.dtype`` is bfloat16)."""


def kv_blocks(url: str) -> int:
    """The replica's KV-cache blocks, from vLLM's ``cache_config_info`` metric."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info"))
    return int(re.search(r'num_gpu_blocks="(\d+)"', line).group(1))


def greedy(url: str, model: str, prompt: str, tokens: int) -> tuple[list[int], list[int]]:
    """vLLM's greedy answer: the prompt's token ids and the generated ones."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status().json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def test_the_rendered_cpu_command_serves(vllm_replicas) -> None:
    for url, name in ((vllm_replicas["small"], SMALL_VLLM), (vllm_replicas["large"][0], LARGE_VLLM)):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [name]
        _, tokens = greedy(url, name, "Hello", 4)
        assert len(tokens) == 4
    args = vllm_replicas["processes"][vllm_replicas["small"]].args
    assert args[args.index("--block-size") + 1] == "32" and args[args.index("--dtype") + 1] == REPLICA_DTYPE


def test_a_partial_replica_holds_twice_the_kv_blocks_in_the_same_memory(vllm_replicas) -> None:
    full, half = kv_blocks(vllm_replicas["large"][0]), kv_blocks(vllm_replicas["small"])
    assert half == pytest.approx(2 * full, rel=0.01)  # 15 of 30 layers: half the KV bytes per token


def test_partial_greedy_tokens_are_our_identity_exit(vllm_replicas, smollm2_checkpoint) -> None:
    """Our paged runner at exit 15 with no head (the identity exit), in vLLM's precision (bfloat16, or float32 on
    a CPU without bfloat16 kernels), teacher-forced on vLLM's greedy tokens: vLLM's token is our argmax, or within
    rounding of it on a near-tie."""
    layers, count = 15, 24
    model = EarlyExitLM.from_pretrained(smollm2_checkpoint, layers, dtype=getattr(torch, REPLICA_DTYPE))
    agree, total, worst = 0, 0, 0.0
    for prompt in PROMPTS:
        ids, theirs = greedy(vllm_replicas["small"], SMALL_VLLM, prompt, count)
        pool = KVPool(kv_shape(model), layers, 64, 16)
        blocks = pool.allocate(pool.blocks_for(len(ids) + count))
        with torch.no_grad():
            logits = PagedRunner(model, pool).forward([Work.span(ids + theirs[:-1], 0, blocks)], layers,
                                                      all_positions=True)[len(ids) - 1:].float()
        logprobs = torch.log_softmax(logits, -1)
        ours = logprobs.argmax(-1)
        agree += int((ours == torch.tensor(theirs)).sum())
        total += count
        gaps = logprobs.max(-1).values - logprobs[torch.arange(count), torch.tensor(theirs)]
        worst = max(worst, float(gaps.max()))
    assert agree / total >= 0.9 and worst <= 0.25, (agree, total, worst)
