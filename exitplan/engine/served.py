"""A candidate model in memory: its held layers, exit heads, KV pool sized by the memory budget, and runner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from torch import nn

from exitplan.earlyexit.fused import for_serving, fuse_layer
from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.packed import module_bytes
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, kv_shape
from exitplan.errors import ExitplanError
from exitplan.kinds import HeadKind


@dataclass(frozen=True)
class Candidate:
    """A model the engine may serve.

    Attributes:
        name: HF id.
        checkpoint: Checkpoint folder (``fetch_models``).
        exits_dir: Exit checkpoint folder (``train_exits``); ``None`` for full-depth serving only.
        head_kind: Exit-head kind to use.
        dtype: Element type of its weights, heads and KV cache (``float32`` or ``bfloat16``).
        pack_head: Hold a packed copy of the LM head where packing gains (``helios.pack_lm_head``).
        native: Run the C++ decode kernels where they apply (``helios.native_kernels``).
    """

    name: str
    checkpoint: Path
    exits_dir: Path | None = None
    head_kind: HeadKind = "block"
    dtype: str = "float32"
    pack_head: bool = True
    native: bool = True


@cache
def num_layers(checkpoint: Path) -> int:
    """Decoder layers of the model at ``checkpoint`` (from its config; read once per process)."""
    from transformers import AutoConfig

    from exitplan.checkpoints import require_checkpoint

    return int(AutoConfig.from_pretrained(str(require_checkpoint(checkpoint))).num_hidden_layers)


class ServedModel:
    """One candidate in memory, exiting after ``exit_layer`` (``num_layers``: the full model, no exit head).

    Args:
        candidate: What it is.
        model: Its early-exit LM (holding at least ``exit_layer`` layers).
        heads: Exit layer -> head kept in memory (only the exits it may use).
        exit_layer: Where every token of a step exits.
    """

    def __init__(self, candidate: Candidate, model: EarlyExitLM, heads: dict[int, nn.Module], exit_layer: int) -> None:
        self.candidate, self.model, self.heads, self.exit_layer = candidate, model, heads, exit_layer
        self._pool: KVPool | None = None
        self._runner: PagedRunner | None = None

    @classmethod
    def open(cls, candidate: Candidate, layers: int, exits: list[int] | None = None) -> tuple[ServedModel, float]:
        """Read the first ``layers`` layers and the heads of ``exits`` (default: the exit at ``layers``, if it has a
        head; deeper exits' heads wait for their layers); the serving exit is ``layers``. Returns the model and the
        seconds reading took.

        Raises:
            ExitplanError: if the serving exit (``exits`` not given) is not the last layer and has no head.
        """
        from exitplan.earlyexit.checkpoint import read_heads

        started = time.perf_counter()
        import torch

        model = for_serving(candidate.checkpoint, layers, getattr(torch, candidate.dtype), candidate.pack_head,
                            candidate.native)
        heads: dict[int, nn.Module] = {}
        if candidate.exits_dir is not None:
            _, available = read_heads(model, candidate.exits_dir, candidate.head_kind)
            wanted = exits if exits is not None else [layers]
            heads = {e: h for e, h in available.items() if e in wanted}
        if exits is None and layers < model.num_layers and layers not in heads:
            raise ExitplanError(f"{candidate.name} has no {candidate.head_kind} exit head after layer {layers}")
        return cls(candidate, model, heads, layers), time.perf_counter() - started

    def read_layers(self, upto: int) -> list[nn.Module]:
        """Layers ``held+1..upto`` from the checkpoint in the serving form, not attached (safe in a background
        thread: :meth:`EarlyExitLM.read_layers`)."""
        layers = self.model.read_layers(upto)
        return [fuse_layer(layer) for layer in layers] if self.model.packed else layers

    @property
    def name(self) -> str:
        """The candidate's HF id."""
        return self.candidate.name

    @property
    def has_pool(self) -> bool:
        """Whether its KV pool is allocated (:meth:`build_pool`)."""
        return self._pool is not None

    @property
    def pool(self) -> KVPool:
        """Its KV pool.

        Raises:
            ExitplanError: before :meth:`build_pool` (an engine bug).
        """
        if self._pool is None:
            raise ExitplanError(f"{self.name} has no KV pool yet (build_pool first)")
        return self._pool

    @property
    def runner(self) -> PagedRunner:
        """Its paged runner over the pool.

        Raises:
            ExitplanError: before :meth:`build_pool` (an engine bug).
        """
        if self._runner is None:
            raise ExitplanError(f"{self.name} has no runner yet (build_pool first)")
        return self._runner

    def drop_pool(self) -> None:
        """Free the KV pool and its runner (before a new pool is built)."""
        self._pool = self._runner = None

    @property
    def num_layers(self) -> int:
        """Layers of the full model."""
        return self.model.num_layers

    @property
    def head(self) -> nn.Module | None:
        """The serving exit's head (none at the last layer, or for a plain identity exit)."""
        return None if self.exit_layer == self.num_layers else self.heads.get(self.exit_layer)

    def exits(self, all_exits: bool = False) -> dict[int, nn.Module | None]:
        """Exit layer -> head for a pass: the serving exit, or every exit held (and the last layer if held)."""
        if not all_exits:
            return {self.exit_layer: self.head}
        held = self.model.held_layers
        found: dict[int, nn.Module | None] = {e: h for e, h in sorted(self.heads.items()) if e <= held}
        if self.model.held_layers == self.num_layers:
            found[self.num_layers] = None
        return found

    def weight_bytes(self) -> int:
        """Bytes of the held layers, embeddings, head and the exit heads kept."""
        heads = sum(module_bytes(h) for h in self.heads.values())
        return self.model.weight_bytes() + heads

    def cached_layers(self, all_exits: bool = False) -> int:
        """Layer slots of KV a pass needs: the held layers up to the exit, plus one per block head used."""
        from exitplan.earlyexit.heads import BlockHead

        upto = max(self.exits(all_exits))
        return min(upto, self.model.held_layers) + sum(isinstance(h, BlockHead) for h in self.exits(all_exits).values())

    def build_pool(self, kv_bytes: int, block_size: int, all_exits: bool = False,
                   max_blocks: int | None = None) -> KVPool:
        """Allocate the KV pool: as many blocks as ``kv_bytes`` holds (at most ``max_blocks``), once.

        Raises:
            ExitplanError: if not even one block fits.
        """
        self.drop_pool()
        layers = self.cached_layers(all_exits)
        per_block = kv_shape(self.model).bytes_per_token(layers) * block_size
        blocks = kv_bytes // per_block if max_blocks is None else min(kv_bytes // per_block, max_blocks)
        if blocks < 1:
            raise ExitplanError(f"memory budget leaves {kv_bytes / 2**20:.1f} MiB for KV after {self.name}'s "
                                f"weights: not one block of {block_size} tokens ({per_block} bytes) fits")
        self._pool = pool = KVPool(kv_shape(self.model), layers, int(blocks), block_size)
        self._runner = PagedRunner(self.model, pool)
        return pool
