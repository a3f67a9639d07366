"""Batched forward passes of an early-exit LM over a paged KV pool: prompts and decode tokens of many sequences.

Tokens of all sequences in a step are packed into one ``N x d`` tensor: the projections and MLPs run once over all
of them; every new token's keys and values are written to the :class:`KVPool` first (so a sequence's new tokens see
each other causally), then attention reads each sequence's context: one padded batched call per layer when every
sequence brings one token (decode), per sequence otherwise. Where each token reads and writes is worked out once per
pass, not per layer. A sequence's new tokens need not be contiguous positions: the
per-token early-exit baseline sends earlier tokens that exited shallower along with the current one, to fill their
deep KV (EE-LLM's recomputation). The layer maths is the transformers Qwen2/Llama decoder layer's (RMS norm, rotary
attention with grouped KV heads, gated MLP), reusing the layer's own modules, so outputs equal transformers' own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exitplan.earlyexit.fused import kv_heads, mlp, projections
from exitplan.earlyexit.heads import BlockHead
from exitplan.earlyexit.kv_pool import KVPool, KVShape
from exitplan.earlyexit.native import supports
from exitplan.earlyexit.partial_model import EarlyExitLM


@dataclass
class Work:
    """New tokens of one sequence for one pass.

    Attributes:
        tokens: Token ids to run.
        positions: Their positions in the sequence (increasing; earlier positions are already cached).
        blocks: The sequence's KV blocks (covering every position up to the last one here).
    """

    tokens: Sequence[int]
    positions: Sequence[int]
    blocks: Sequence[int]

    @classmethod
    def span(cls, tokens: Sequence[int], start: int, blocks: Sequence[int]) -> Work:
        """Work for ``tokens`` at contiguous positions from ``start``."""
        return cls(tokens, range(start, start + len(tokens)), blocks)


def kv_shape(model: EarlyExitLM) -> KVShape:
    """KV shape per token and layer of ``model``."""
    dtype = next(model.parameters()).dtype
    return KVShape(kv_heads(model), model.model.model.layers[0].self_attn.head_dim, dtype)


def cached_layers(exit_layer: int, head: nn.Module | None) -> int:
    """Layer slots a pool needs to exit after ``exit_layer`` with ``head`` (a block head caches one more layer)."""
    return exit_layer + (1 if isinstance(head, BlockHead) else 0)


@dataclass
class Timings:
    """Seconds the runner spent, per kind of pass (``prefill``: any pass with more tokens than sequences).

    Attributes:
        layer_s: Kind -> seconds in decoder layers (embedding included).
        layer_token_layers: Kind -> tokens x layers run.
        head_s: Kind -> seconds in exits (exit head, final norm, LM head).
        head_tokens: Kind -> token-exits computed.
    """

    layer_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    layer_token_layers: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    head_s: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})
    head_tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    def add(self, kind: str, tokens: int, layers: int, layer_s: float, head_tokens: int, head_s: float) -> None:
        """Account one pass."""
        self.layer_s[kind] += layer_s
        self.layer_token_layers[kind] += tokens * max(layers, 1)
        self.head_s[kind] += head_s
        self.head_tokens[kind] += head_tokens

    def per_token_layer(self, kind: str) -> float:
        """Measured seconds per token per layer (0 before any pass of that kind)."""
        return self.layer_s[kind] / self.layer_token_layers[kind] if self.layer_token_layers[kind] else 0.0

    def per_head_token(self) -> float:
        """Measured seconds per token-exit of the exits, over both kinds of pass."""
        tokens = sum(self.head_tokens.values())
        return sum(self.head_s.values()) / tokens if tokens else 0.0


@dataclass
class Pass:
    """Where one pass's tokens live, computed once for all its layers.

    Attributes:
        positions: Position of each new token (``N``).
        rows: Per work, its tokens' row indices in the packed batch.
        rope: Rotary cos/sin of the new tokens.
        write: Pool slot of each new token's keys and values (``N``).
        tables: Per work, the slots of its whole context.
        masks: Per work, its causal mask over the context (``None``: the one new token sees everything); empty
            for a pure decode pass.
        padded: Pure decode (one new token per work): the context slots padded to the longest (``B x C``; padding
            repeats the sequence's first slot, always written, so masked reads stay finite), else ``None``.
        valid: Pure decode: which padded slots are the context (``B x C``).
        lengths: Pure decode: each work's context length (``B``).
    """

    positions: torch.Tensor
    rows: list[torch.Tensor]
    rope: tuple[torch.Tensor, torch.Tensor]
    write: torch.Tensor
    tables: list[torch.Tensor]
    masks: list[torch.Tensor | None]
    padded: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Grouped-query attention: ``q`` ``B x H x L x hd`` over ``k``/``v`` ``B x KV x C x hd`` (query head ``h``
    reads KV head ``h // (H / KV)``), ``mask`` (true = visible) ``B x 1 x L x C``, ``L x C`` or ``None``.

    Scores and softmax are float32, the products in the inputs' dtype. Hand-written because torch's CPU
    ``scaled_dot_product_attention`` takes a slow path for bfloat16 (15x this at decode, measured).
    """
    b, heads, length, hd = q.shape
    kv = k.shape[1]
    grouped = q.reshape(b, kv, heads // kv * length, hd)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float().mul_(scale).view(b, kv, heads // kv, length, -1)
    if mask is not None:
        scores.masked_fill_(~(mask[:, :, None] if mask.dim() == 4 else mask), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, kv, heads // kv * length, -1)
    return torch.matmul(probs, v).view(b, heads, length, hd)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Grouped-query attention of one new token per sequence: ``q`` ``B x H x hd`` over ``k``/``v``
    ``KV x B x C x hd`` as :meth:`KVPool.read` returns a padded table, ``valid`` (true = context) ``B x C``; returns
    ``B x H*hd``. The matmuls batch over ``KV x B`` (query head ``h`` reads KV head ``h // (H / KV)``), so the
    context is never copied; scores and softmax float32 as in :func:`attend`, whose results it equals."""
    b, heads, hd = q.shape
    kv = k.shape[0]
    grouped = q.view(b, kv, heads // kv, hd).transpose(0, 1)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float().mul_(scale)
    scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).permute(1, 0, 2, 3).reshape(b, heads * hd)


class PagedRunner:
    """Runs packed tokens of several sequences through the first layers of ``model`` and an exit, caching KV.

    Args:
        model: The early-exit LM (its held layers are the ones that can run).
        pool: KV pool with a slot per cached layer (see :func:`cached_layers`).
    """

    def __init__(self, model: EarlyExitLM, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.inner: Any = model.model.model
        self.timings = Timings()
        self.kernels: Any = model.kernels if supports(pool.shape.dtype, pool.shape.head_dim) else None

    # --- pieces ----------------------------------------------------------------------------------------------------
    def embed(self, works: Sequence[Work]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Embeddings ``N x d`` of all new tokens, their positions ``N``, and each work's row indices."""
        ids = torch.as_tensor([t for w in works for t in w.tokens], dtype=torch.long)
        positions = torch.as_tensor([p for w in works for p in w.positions], dtype=torch.long)
        rows, start = [], 0
        for w in works:
            rows.append(torch.arange(start, start + len(w.tokens)))
            start += len(w.tokens)
        return self.inner.embed_tokens(ids), positions, rows

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos/sin for ``positions``, each ``1 x N x head_dim``."""
        return self.inner.rotary_emb(x[None], positions[None])

    def plan(self, works: Sequence[Work], positions: torch.Tensor, rows: list[torch.Tensor],
             rope: tuple[torch.Tensor, torch.Tensor]) -> Pass:
        """Where a pass's tokens read and write KV, computed once for all its layers."""
        tables = [self.pool.slots(list(w.blocks), 0, int(positions[r[-1]]) + 1) for w, r in zip(works, rows,
                                                                                              strict=True)]
        write = torch.cat([t[positions[r]] for t, r in zip(tables, rows, strict=True)])
        if all(len(r) == 1 for r in rows):  # pure decode: one padded batch, one attention call per layer
            width = max(len(t) for t in tables)
            padded = torch.stack([F.pad(t, (0, width - len(t)), value=int(t[0])) for t in tables])
            lengths = torch.as_tensor([len(t) for t in tables])
            valid = torch.arange(width)[None, :] < lengths[:, None]
            return Pass(positions, rows, rope, write, tables, [], padded, valid, lengths)
        masks = []
        for table, r in zip(tables, rows, strict=True):
            mine = positions[r]
            causal = len(r) > 1 or len(table) != int(mine[0]) + 1
            masks.append(torch.arange(len(table))[None, :] <= mine[:, None] if causal else None)
        return Pass(positions, rows, rope, write, tables, masks)

    def layer(self, slot: int, layer: Any, x: torch.Tensor, step: Pass) -> torch.Tensor:
        """One decoder layer over packed tokens; their keys and values go to the pool's layer slot ``slot``."""
        if self.kernels is not None and hasattr(layer.self_attn, "qkv"):
            return self._native_layer(slot, layer, x, step)
        residual = x
        h = layer.input_layernorm(x)
        h = self._attention(slot, layer.self_attn, h, step)
        x = residual + h
        return x + mlp(layer.mlp, layer.post_attention_layernorm(x))

    def _native_layer(self, slot: int, layer: Any, x: torch.Tensor, step: Pass) -> torch.Tensor:
        """:meth:`layer` of a serving-form layer through the C++ kernels (:mod:`~exitplan.earlyexit.native`): the
        same maths and roundings, five calls around the four matmuls instead of ~40 torch ops."""
        kernels, attn, ffn = self.kernels, layer.self_attn, layer.mlp
        norm, post = layer.input_layernorm, layer.post_attention_layernorm
        heads = attn.qkv_sizes[0] // attn.head_dim
        keys, values = self.pool.keys[slot], self.pool.values[slot]
        qkv = attn.qkv(kernels.rms_norm(x, norm.weight, norm.variance_epsilon))
        kernels.rope_and_cache(qkv, *step.rope, keys, values, step.write, heads)  # queries rotated in place
        if step.padded is not None and step.lengths is not None:
            out = kernels.decode_attention(qkv, keys, values, step.padded, step.lengths, heads, attn.scaling)
        else:
            queries = qkv[:, :heads * attn.head_dim].view(len(x), heads, attn.head_dim)
            out = self._attend_each(slot, queries, step, attn.scaling).reshape(len(x), -1)
        x, h = kernels.add_rms_norm(attn.o_proj(out), x, post.weight, post.variance_epsilon)
        return x + ffn.down_proj(kernels.silu_and_mul(ffn.gate_up(h)))

    def _attention(self, slot: int, attn: Any, x: torch.Tensor, step: Pass) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        n, hd = x.shape[0], attn.head_dim
        q, k, v = projections(attn, x)
        q = q.reshape(1, n, -1, hd).transpose(1, 2)
        k = k.reshape(1, n, -1, hd).transpose(1, 2)
        v = v.reshape(n, -1, hd)
        q, k = apply_rotary_pos_emb(q, k, *step.rope)
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # n x heads x hd
        self.pool.write(slot, step.write, k, v)  # every new token first, so a sequence's new tokens see each other
        if step.padded is not None and step.valid is not None:
            keys, values = self.pool.read(slot, step.padded)  # kv_heads x B x C x hd
            return attn.o_proj(attend_decode(q, keys, values, step.valid, attn.scaling))
        return attn.o_proj(self._attend_each(slot, q, step, attn.scaling).reshape(n, -1))

    def _attend_each(self, slot: int, q: torch.Tensor, step: Pass, scale: float) -> torch.Tensor:
        """Each work's new tokens (``q`` ``n x heads x hd``) over its own context in layer slot ``slot``."""
        out = torch.empty(q.shape, dtype=q.dtype)
        for index, table, mask in zip(step.rows, step.tables, step.masks, strict=True):
            keys, values = self.pool.read(slot, table)  # kv_heads x C x hd
            out[index] = attend(q[index].transpose(0, 1)[None], keys[None], values[None], mask,
                                scale)[0].transpose(0, 1)
        return out

    # --- whole passes ----------------------------------------------------------------------------------------------
    def exit_hidden(self, x: torch.Tensor, slot: int, head: nn.Module | None, step: Pass) -> torch.Tensor:
        """An exit head's output for hidden states ``x`` (a block head caches its KV in layer slot ``slot``)."""
        if head is None:
            return x
        if isinstance(head, BlockHead):
            return self.layer(slot, head.layer, head.affine(x), step)
        return head(x)

    def logits(self, mapped: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (:meth:`EarlyExitLM.logits`)."""
        return self.model.logits(mapped)

    @torch.no_grad()
    def forward_exits(self, works: Sequence[Work], upto: int, exits: Mapping[int, nn.Module | None],
                      all_positions: bool = False) -> dict[int, torch.Tensor]:
        """Run the new tokens through layers 1..``upto`` and the given exits (exit layer -> head, all <= ``upto``).

        Block heads cache KV in the slots after the layers', in the order of ``exits``. Returns exit layer -> logits
        of each work's last token (``B x vocab``), or of every new token (``N x vocab``) with ``all_positions``.
        Time spent in the layers and in the heads is added to :attr:`timings`.
        """
        started = time.perf_counter()
        x, positions, rows = self.embed(works)
        step = self.plan(works, positions, rows, self.rope(x, positions))
        last = torch.as_tensor([int(r[-1]) for r in rows])
        slots = {e: upto + i for i, e in enumerate(e for e, h in exits.items() if isinstance(h, BlockHead))}
        out: dict[int, torch.Tensor] = {}
        layer_s = 0.0
        for i in range(upto + 1):
            if i in exits:
                mark = time.perf_counter()
                head = exits[i]
                if isinstance(head, BlockHead) or all_positions:
                    mapped = self.exit_hidden(x, slots.get(i, 0), head, step)
                    out[i] = self.logits(mapped if all_positions else mapped[last])
                else:
                    out[i] = self.logits(self.exit_hidden(x[last], 0, head, step))
                layer_s -= time.perf_counter() - mark
            if i < upto:
                x = self.layer(i, self.inner.layers[i], x, step)
        total = time.perf_counter() - started
        kind = "prefill" if len(positions) > len(works) else "decode"
        exited = (len(positions) if all_positions else len(works)) * len(exits)
        self.timings.add(kind, len(positions), upto, total + layer_s, exited, -layer_s)
        return out

    def forward(self, works: Sequence[Work], exit_layer: int, head: nn.Module | None = None,
                all_positions: bool = False) -> torch.Tensor:
        """Logits at one exit (see :meth:`forward_exits`)."""
        return self.forward_exits(works, exit_layer, {exit_layer: head}, all_positions)[exit_layer]
