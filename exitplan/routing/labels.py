"""Per-query quality labels of candidate models, measured by running them (never synthesised).

Two measures, both a quality in [0, 1]:

- ``exact_match`` (GSM8K): the model answers the question (greedy, chat template); 1 if the last number of its
  answer equals the gold answer after ``####``, else 0.
- ``reference_score`` (any data set with a reference): the geometric-mean probability the model gives the reference
  answer's tokens, teacher-forced after the prompt: ``exp(-mean NLL)``. 1 means the model would write the reference
  itself; it is comparable across models that share a tokenizer.

Labels for models that cannot run here can be supplied as CSV (:func:`read_user_labels`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exitplan.errors import ExitplanError

USER_COLUMNS = ("model", "dataset", "query_id", "quality")
"""Columns of a user-supplied label CSV: model (HF id), data set, query id (as in the query table), quality in
[0, 1]."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer a GSM8K-style text ends with: what follows ``####`` if present, else its last number; commas
    and a trailing ``.0`` removed."""
    tail = text.split("####")[-1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    value = found[0] if "####" in text else found[-1]
    value = value.replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def exact_match(generated: str, reference: str) -> float:
    """1.0 if the generated answer's final number equals the reference's, else 0.0."""
    gold = final_number(reference)
    return float(gold is not None and final_number(generated) == gold)


def prompt_ids(tokenizer: Any, prompt: str, max_tokens: int) -> list[int]:
    """Chat-template token ids of a user prompt (the prompt text cut to ``max_tokens`` tokens first)."""
    text = tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False)[:max_tokens])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference_scores(model: Any, tokenizer: Any, prompts: Sequence[str], references: Sequence[str],
                     max_prompt: int = 128, max_reference: int = 64) -> list[float]:
    """``exp(-mean NLL)`` of each reference (first ``max_reference`` tokens) after its prompt, teacher-forced."""
    import torch
    import torch.nn.functional as F

    scores = []
    with torch.no_grad():
        for prompt, reference in zip(prompts, references, strict=True):
            head = prompt_ids(tokenizer, prompt, max_prompt)
            tail = tokenizer.encode(reference, add_special_tokens=False)[:max_reference]
            if not tail:
                raise ExitplanError("a reference with no tokens cannot be scored")
            logits = model(input_ids=torch.tensor([head + tail])).logits[0, len(head) - 1:-1].float()
            nll = F.cross_entropy(logits, torch.tensor(tail))
            scores.append(float(torch.exp(-nll)))
    return scores


def generate(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 8,
             max_prompt: int = 256) -> list[str]:
    """Greedy answers (chat template, left-padded batches) decoded to text."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        ids = [prompt_ids(tokenizer, p, max_prompt) for p in prompts[start:start + batch_size]]
        width = max(len(i) for i in ids)
        batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad():
            out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        answers.extend(tokenizer.decode(row[width:], skip_special_tokens=True) for row in out)
    return answers


def read_user_labels(path: Path) -> Any:
    """Per-query labels supplied as CSV (columns :data:`USER_COLUMNS`), validated.

    Raises:
        ExitplanError: naming the file and the problem (missing columns, qualities outside [0, 1], duplicates).
    """
    import pandas as pd

    from exitplan.files import read_table

    frame = read_table(path, "label file", USER_COLUMNS, hint=f"a label CSV has {list(USER_COLUMNS)}")
    frame["quality"] = pd.to_numeric(frame["quality"], errors="coerce")
    bad = frame[~frame["quality"].between(0, 1)]
    if len(bad):
        raise ExitplanError(f"{path}: quality must be in [0, 1]; row {int(bad.index[0]) + 2} has "
                            f"{bad['quality'].iloc[0]}")
    if frame.duplicated(["model", "dataset", "query_id"]).any():
        raise ExitplanError(f"{path}: a (model, dataset, query_id) appears twice")
    frame["query_id"] = frame["query_id"].astype(str)
    return frame.assign(metric="user")[[*USER_COLUMNS, "metric"]]


def below_full_depth(labels: Any) -> Any:
    """Which label rows are of a model cut below its deepest labelled depth (``label_quality.depths``): a boolean
    series; all false when the table has no ``layers`` column (labels imported or supplied), and for rows without
    a depth."""
    import pandas as pd

    if "layers" not in labels.columns:
        return pd.Series(False, index=labels.index)
    return labels["layers"] < labels.groupby("model")["layers"].transform("max")
