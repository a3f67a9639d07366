"""Building engines from params: the candidates, the engine knobs, the tokenizer's stop tokens, requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exitplan.config import Params
from exitplan.cpu_features import local_dtype
from exitplan.engine.engine import EngineConfig
from exitplan.engine.request import Request
from exitplan.engine.served import Candidate

GIB = 2**30


def candidates(params: Params, models: Sequence[str]) -> list[Candidate]:
    """Served candidates for ``models``: their checkpoints and, when ``train_exits`` made them, exit heads."""
    exits = params.path(params.train_exits.output_dir)
    return [Candidate(m, params.checkpoint_path(m), exits / m if m in params.train_exits.models else None,
                      params.helios.head_kind, local_dtype(params.helios.dtype), params.helios.pack_lm_head,
                      params.helios.native_kernels)
            for m in models]


def engine_config(params: Params, **overrides: Any) -> EngineConfig:
    """The engine knobs of the ``helios`` section (``overrides`` replace any of them)."""
    h = params.helios
    knobs: dict[str, Any] = {"memory_budget_bytes": int(h.memory_budget_gib * GIB), "max_num_seqs": h.max_num_seqs,
                             "block_size": h.block_size, "threshold": h.threshold, "confidence": h.confidence,
                             "cbc_window": h.cbc_window, "cbc_max": h.cbc_max,
                             "profile_requests": h.profile_requests, "reprofile_every": h.reprofile_every}
    return EngineConfig(**{**knobs, **overrides})


def stop_ids(tokenizer: Any) -> frozenset[int]:
    """Tokens that end a chat answer: EOS and, where the vocabulary has it, ``<|im_end|>``."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    return frozenset(ids | ({im_end} if im_end is not None else set()))


def requests(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], stop: frozenset[int],
             prefix: str = "q") -> list[Request]:
    """Greedy requests ``<prefix><i>`` for token-id prompts."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    return [Request(f"{prefix}{i}", list(p), int(n), stop_ids=stop)
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
