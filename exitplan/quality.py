"""Quality of generated outputs: held-out prompts, perplexity under a full model, ROUGE-2 against a reference run.

Used by the promotion gate (``exitplan.engine.served_quality``), HELIOS online profiling and the HELIOS benchmark.
Outputs are token ids; ROUGE-2 is computed over token ids as words, so it needs no detokenisation and is exact for
any vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exitplan.errors import ExitplanError


def held_out_texts(queries: Path, datasets: Sequence[str], split_seed: int, count: int, skip: int = 0) -> list[str]:
    """``count`` prompts the exit heads never trained on, round-robin over ``datasets``, after the first ``skip``.

    Two callers with disjoint ``[skip, skip + count)`` ranges get disjoint prompts.

    Raises:
        ExitplanError: when the held-out half has fewer than ``skip + count`` prompts.
    """
    from exitplan.workload.split import split_queries

    _, held_out = split_queries(queries, datasets, split_seed)
    by_set = [held_out[held_out["dataset"] == d]["prompt"].tolist() for d in datasets]
    order = [texts[i] for i in range(max(map(len, by_set), default=0)) for texts in by_set if i < len(texts)]
    if len(order) < skip + count:
        raise ExitplanError(f"{len(order)} held-out prompts in {list(datasets)}; {skip + count} are needed")
    return order[skip:skip + count]


def chat_prompts(tokenizer: Any, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Chat-template token ids of user prompts (each text cut to ``max_tokens`` tokens first)."""
    from exitplan.routing.labels import prompt_ids

    return [prompt_ids(tokenizer, text, max_tokens) for text in texts]


def load_scorer(checkpoint: Path) -> Any:
    """The full causal LM at ``checkpoint`` (fp32, eval mode), to score outputs with."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def perplexity(scorer: Path | Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """Perplexity of the outputs of ``(prompt, output)`` token-id pairs under a full model.

    Args:
        scorer: The model, or its checkpoint folder (loaded for this call).
        pairs: Prompt and output token ids.

    Raises:
        ExitplanError: when no pair has an output.
    """
    import torch
    import torch.nn.functional as F

    scored = [(list(p), list(o)) for p, o in pairs if o]
    if not scored:
        raise ExitplanError("no output to score")
    model = load_scorer(scorer) if isinstance(scorer, Path) else scorer
    nll, count = 0.0, 0
    with torch.no_grad():
        for prompt, output in scored:
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
            nll += float(F.cross_entropy(logits, torch.tensor(output), reduction="sum"))
            count += len(output)
    return float(torch.tensor(nll / count).exp())


def rouge2(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Mean ROUGE-2 F1 of each output against its reference (token ids as words)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge2"])
    scores = [scorer.score(" ".join(map(str, r)), " ".join(map(str, o)))["rouge2"].fmeasure
              for o, r in zip(outputs, references, strict=True)]
    return sum(scores) / len(scores) if scores else float("nan")
