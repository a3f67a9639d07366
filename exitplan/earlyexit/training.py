"""Fitting exit heads on cached hidden states, and measuring every exit against the final layer.

The backbone stays frozen: one pass over the token chunks caches the hidden state at each exit layer, the final
layer's hidden state, and the teacher's top-k next-token log-probabilities. Affine heads are then solved in closed
form; block heads are trained by distillation on the cached tensors (KL between the teacher's and the student's
distributions restricted to the teacher's top-k tokens, so the large vocabulary head stays cheap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exitplan.earlyexit.confidence import confidence
from exitplan.earlyexit.heads import AffineHead, BlockHead, make_head
from exitplan.earlyexit.partial_model import EarlyExitLM


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


@torch.no_grad()
def collect(model: EarlyExitLM, chunks: torch.Tensor, exit_layers: Sequence[int], top_k: int = 64,
            batch_size: int = 4) -> ExitCache:
    """Run the full model over ``chunks`` once and cache what fitting and evaluating the exits need."""
    hidden: dict[int, list[torch.Tensor]] = {e: [] for e in exit_layers}
    finals, indices, logprobs = [], [], []
    for start in range(0, len(chunks), batch_size):
        batch = chunks[start:start + batch_size]
        outputs = model.layer_outputs(batch)
        for e in exit_layers:
            hidden[e].append(outputs[e - 1])
        final = outputs[-1]
        finals.append(final)
        teacher = model.model.lm_head(model.model.model.norm(final)).float().log_softmax(-1)
        top = teacher.topk(top_k, dim=-1)
        indices.append(top.indices)
        logprobs.append(top.values)
    return ExitCache(chunks, {e: torch.cat(v) for e, v in hidden.items()}, torch.cat(finals), torch.cat(indices),
                     torch.cat(logprobs))


def fit_affine(cache: ExitCache, exit_layer: int, ridge: float = 1e-2) -> AffineHead:
    """Ridge-fit an affine head mapping the exit's hidden states onto the final layer's."""
    d = cache.final_hidden.shape[-1]
    return AffineHead(d).fit(cache.hidden[exit_layer].reshape(-1, d), cache.final_hidden.reshape(-1, d), ridge)


def topk_kl(model: EarlyExitLM, mapped: torch.Tensor, index: torch.Tensor, teacher_logprob: torch.Tensor) -> torch.Tensor:
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
    return F.kl_div(student.log_softmax(-1), teacher, log_target=True, reduction="batchmean")


def train_block(model: EarlyExitLM, cache: ExitCache, exit_layer: int, steps: int = 200, lr: float = 1e-4,
                batch_size: int = 4, seed: int = 0) -> tuple[BlockHead, list[float]]:
    """Train a block head for ``exit_layer`` by top-k distillation on the cached tensors.

    Returns:
        The trained head and the loss of each step.
    """
    torch.manual_seed(seed)
    head = make_head("block", model, exit_layer)
    assert isinstance(head, BlockHead)
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
        loss = topk_kl(model, head(inputs[pick]), cache.teacher_index[pick], cache.teacher_logprob[pick])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, losses


@torch.no_grad()
def evaluate_exit(model: EarlyExitLM, cache: ExitCache, exit_layer: int, head: torch.nn.Module | None,
                  thresholds: Sequence[float] = (0.5, 0.8, 0.9), confidence_kind: str = "max_prob",
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
        logits = model.model.lm_head(model.model.model.norm(mapped)).float()
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
