"""Fitting exit heads on cached hidden states, and measuring every exit against the final layer.

The backbone stays frozen: one pass over the token chunks caches the hidden state at each exit layer, the final
layer's hidden state, and the teacher's top-k next-token log-probabilities. Affine heads are then solved in closed
form; block heads are trained by distillation on the cached tensors (KL between the teacher's and the student's
distributions restricted to the teacher's top-k tokens, so the large vocabulary head stays cheap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from exitplan.earlyexit.confidence import confidence
from exitplan.earlyexit.heads import AffineHead, BlockHead, make_head
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.kinds import ConfidenceKind


@dataclass
class ExitCache:
    """Cached activations of a frozen model over token chunks.

    Attributes:
        tokens: The token chunks, ``n x T``.
        hidden: Exit layer (1-based) -> hidden states after it, ``n x T x d``.
        final_hidden: Hidden states after the last layer (before the final norm), ``n x T x d``.
        teacher_index: The teacher's top-k token ids per position, ``n x T x k``.
        teacher_logprob: The teacher's log-probabilities of those tokens, ``n x T x k``.
    """

    tokens: torch.Tensor
    hidden: dict[int, torch.Tensor]
    final_hidden: torch.Tensor
    teacher_index: torch.Tensor
    teacher_logprob: torch.Tensor


def chunk_tokens(token_ids: Sequence[int], length: int, max_chunks: int | None = None) -> torch.Tensor:
    """Cut a token stream into full chunks of ``length`` (the tail is dropped); ``chunks x length``."""
    n = len(token_ids) // length
    if max_chunks is not None:
        n = min(n, max_chunks)
    return torch.as_tensor(list(token_ids[: n * length]), dtype=torch.long).view(n, length)


def tokenize_chunks(tokenizer: Any, texts: Sequence[str], length: int, count: int) -> torch.Tensor:
    """``count`` chunks of ``length`` tokens cut from the concatenated texts (encoded only as far as needed).

    Raises:
        ExitplanError: if the texts hold fewer tokens than asked.
    """
    from exitplan.errors import ExitplanError

    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(stream) >= length * count:
            break
    chunks = chunk_tokens(stream, length, count)
    if len(chunks) < count:
        raise ExitplanError(f"only {len(chunks)} chunks of {length} tokens available, {count} asked")
    return chunks


@torch.no_grad()
def collect(model: EarlyExitLM, chunks: torch.Tensor, exit_layers: Sequence[int], top_k: int = 64,
            batch_size: int = 4) -> ExitCache:
    """Run the full model over ``chunks`` once and cache what fitting and evaluating the exits need (in float32,
    whatever the model's dtype)."""
    hidden: dict[int, list[torch.Tensor]] = {e: [] for e in exit_layers}
    finals, indices, logprobs = [], [], []
    for start in range(0, len(chunks), batch_size):
        batch = chunks[start:start + batch_size]
        outputs = model.layer_outputs(batch)
        for e in exit_layers:
            hidden[e].append(outputs[e - 1].float())
        final = outputs[-1]
        finals.append(final.float())
        teacher = model.logits(final).log_softmax(-1)
        top = teacher.topk(top_k, dim=-1)
        indices.append(top.indices)
        logprobs.append(top.values)
    return ExitCache(chunks, {e: torch.cat(v) for e, v in hidden.items()}, torch.cat(finals), torch.cat(indices),
                     torch.cat(logprobs))


def fit_affine(cache: ExitCache, exit_layer: int, ridge: float = 1e-2) -> AffineHead:
    """Ridge-fit an affine head mapping the exit's hidden states onto the final layer's."""
    d = cache.final_hidden.shape[-1]
    return AffineHead(d).fit(cache.hidden[exit_layer].reshape(-1, d), cache.final_hidden.reshape(-1, d), ridge)


def topk_kl(model: EarlyExitLM, mapped: torch.Tensor, index: torch.Tensor,
            teacher_logprob: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens (both renormalised on them); a scalar.

    Args:
        model: The early-exit LM (its final norm and LM head give the student's logits).
        mapped: The exit head's output, ``B x T x d``.
        index: Teacher's top-k ids, ``B x T x k``.
        teacher_logprob: Teacher's log-probabilities at those ids, ``B x T x k``.
    """
    normed = model.model.model.norm(mapped)
    rows = model.model.lm_head.weight[index]  # B x T x k x d: only k rows of the vocabulary head
    student = torch.einsum("btd,btkd->btk", normed, rows)
    if model.model.lm_head.bias is not None:
        student = student + model.model.lm_head.bias[index]
    teacher = teacher_logprob.log_softmax(-1)
    per_token = F.kl_div(student.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
    return per_token.mean()


def full_softmax_ce(model: EarlyExitLM, mapped: torch.Tensor, index: torch.Tensor,
                    teacher_logprob: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student's full-vocabulary distribution against the teacher's top-k (renormalised).

    Unlike :func:`topk_kl`, the student's softmax runs over the whole vocabulary, so probability mass that leaks to
    tokens outside the teacher's top-k is penalised; it equals KL(teacher || student) up to the teacher's entropy
    when the top-k holds the teacher's mass. Costs one vocabulary projection per token.
    """
    student = model.logits(mapped).log_softmax(-1).gather(-1, index)
    teacher = teacher_logprob.softmax(-1)
    return -(teacher * student).sum(-1).mean()


LOSSES = {"topk_kl": topk_kl, "full_ce": full_softmax_ce}
"""Distillation losses for block heads, by name."""


def train_block(model: EarlyExitLM, cache: ExitCache, exit_layer: int, steps: int = 200, lr: float = 1e-4,
                batch_size: int = 4, seed: int = 0, loss: str = "full_ce",
                positions_per_step: int | None = None) -> tuple[BlockHead, list[float]]:
    """Train a block head for ``exit_layer`` by distillation on the cached tensors (``loss``: a key of LOSSES).

    Warm start: the head's affine map is ridge-fitted onto the input of the last layer (the cache must hold the
    hidden states after layer ``num_layers - 1``) and its decoder layer is a copy of the last layer.

    ``positions_per_step`` limits the loss to that many random positions of each sequence (the head still sees the
    whole sequence): the vocabulary projection dominates the cost of a step, so this makes steps several times
    cheaper.

    Returns:
        The trained head and the loss of each step.
    """
    from exitplan.errors import ExitplanError

    torch.manual_seed(seed)
    if model.held_layers != model.num_layers:
        raise ExitplanError("block heads are trained on the whole model (its last layer seeds the head)")
    before_last = model.num_layers - 1
    if before_last not in cache.hidden:
        raise ExitplanError(f"the cache needs the hidden states after layer {before_last} to warm-start the head")
    head = make_head("block", model, exit_layer)
    assert isinstance(head, BlockHead)
    d = cache.final_hidden.shape[-1]
    head.affine.fit(cache.hidden[exit_layer].reshape(-1, d), cache.hidden[before_last].reshape(-1, d))
    head.train()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    optimiser = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    inputs = cache.hidden[exit_layer]
    losses = []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(len(inputs), (min(batch_size, len(inputs)),), generator=generator)
        mapped, index, logprob = head(inputs[pick]), cache.teacher_index[pick], cache.teacher_logprob[pick]
        if positions_per_step is not None and positions_per_step < mapped.shape[1]:
            where = torch.randperm(mapped.shape[1], generator=generator)[:positions_per_step]
            mapped, index, logprob = mapped[:, where], index[:, where], logprob[:, where]
        value = LOSSES[loss](model, mapped, index, logprob)
        optimiser.zero_grad()
        value.backward()
        optimiser.step()
        losses.append(float(value.detach()))
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, losses


@torch.no_grad()
def perplexity(model: EarlyExitLM, cache: ExitCache, batch_size: int = 4) -> float:
    """Perplexity of the full model (its last layer) on the cached chunks' next tokens."""
    nll = []
    for start in range(0, len(cache.tokens), batch_size):
        logits = model.logits(cache.final_hidden[start:start + batch_size])
        targets = cache.tokens[start:start + batch_size][:, 1:]
        nll.append(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="none"))
    return float(torch.cat(nll).mean().exp())


@torch.no_grad()
def evaluate_exit(model: EarlyExitLM, cache: ExitCache, exit_layer: int, head: torch.nn.Module | None,
                  thresholds: Sequence[float] = (0.5, 0.8, 0.9), confidence_kind: ConfidenceKind = "max_prob",
                  batch_size: int = 4) -> dict[str, float]:
    """How the exit after ``exit_layer`` (with ``head``, or none) compares with the final layer.

    Returns:
        ``agreement`` (top-1 equals the final layer's), ``kl`` (to the final layer's top-k distribution),
        ``perplexity`` (of the actual next tokens), and per threshold the share of confident tokens
        (``confident_share@t``) and their agreement (``confident_agreement@t``), plus the agreement of the
        tokens under the threshold (``low_conf_agreement@t``).
    """
    agree, conf, kls, nll = [], [], [], []
    for start in range(0, len(cache.tokens), batch_size):
        sl = slice(start, start + batch_size)
        hidden = cache.hidden[exit_layer][sl]
        mapped = head(hidden) if head is not None else hidden
        logits = model.logits(mapped)
        agree.append((logits.argmax(-1) == cache.teacher_index[sl][..., 0]).flatten())
        conf.append(confidence(logits, confidence_kind).flatten())
        kls.append(topk_kl(model, mapped, cache.teacher_index[sl], cache.teacher_logprob[sl]).reshape(1))
        targets = cache.tokens[sl][:, 1:]
        nll.append(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="none"))
    agreement, confident = torch.cat(agree).float(), torch.cat(conf)
    result = {"agreement": float(agreement.mean()), "kl": float(torch.cat(kls).mean()),
              "perplexity": float(torch.cat(nll).mean().exp())}
    for t in thresholds:
        above = confident >= t
        result[f"confident_share@{t}"] = float(above.float().mean())
        result[f"confident_agreement@{t}"] = float(agreement[above].mean()) if above.any() else float("nan")
        result[f"low_conf_agreement@{t}"] = float(agreement[~above].mean()) if (~above).any() else float("nan")
    return result
