"""A paged KV cache allocated once: fixed-size blocks of token slots for every cached layer.

The pool holds keys and values for ``layers`` cached layers (the loaded decoder layers, plus one slot for an exit
block head when the exit has one) in two tensors allocated at construction; sequences take blocks when they are
admitted and give them back when they end. Nothing is allocated per step. The pool's size in bytes is what the
engine's memory budget charges for KV, so a partial model (fewer layers) fits more blocks in the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exitplan.errors import ExitplanError


@dataclass(frozen=True)
class KVShape:
    """Shape of one cached layer's KV per token.

    Attributes:
        kv_heads: Key/value heads.
        head_dim: Width of a head.
        dtype: Element type.
    """

    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def bytes_per_token(self, layers: int) -> int:
        """Bytes of keys and values of one token over ``layers`` cached layers."""
        return 2 * layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class KVPool:
    """Blocks of ``block_size`` token slots for ``layers`` cached layers; a free list hands them out.

    Args:
        shape: KV shape per token and layer.
        layers: Cached layers (layer slots).
        num_blocks: Blocks in the pool.
        block_size: Token slots per block.
    """

    def __init__(self, shape: KVShape, layers: int, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or layers < 1:
            raise ExitplanError(f"a KV pool needs at least one block and one layer (got {num_blocks}, {layers})")
        self.shape, self.layers, self.num_blocks, self.block_size = shape, layers, num_blocks, block_size
        size = (layers, num_blocks * block_size, shape.kv_heads, shape.head_dim)
        # Not zero-filled: a slot is always written before it is read (the runner reads only a sequence's own
        # context), so the OS commits the pool's pages as blocks are used instead of all at once.
        self.keys = torch.empty(size, dtype=shape.dtype)
        self.values = torch.empty(size, dtype=shape.dtype)
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's tensors."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks.

        Raises:
            ExitplanError: if fewer are free (nothing is taken then).
        """
        if count > len(self._free):
            raise ExitplanError(f"KV pool exhausted: {count} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        """Give blocks back to the pool."""
        self._free.extend(reversed(blocks))

    def slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat slot indices of token positions ``start..stop-1`` of a sequence holding ``blocks``."""
        positions = torch.arange(start, stop)
        table = torch.as_tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``n x kv_heads x head_dim`` keys and values of layer slot ``layer`` at ``slots``."""
        self.keys[layer, slots] = keys
        self.values[layer, slots] = values

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer slot ``layer`` at ``slots`` (any shape ``S``), each ``S x kv_heads x head_dim``.

        Through ``index_select`` on the flattened slots: 9x faster than advanced indexing for a decode batch's
        padded table (16 x 160 slots of 2 x 64 bfloat16: 37 us against 336 us here), the same values."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.shape.kv_heads, self.shape.head_dim)
        return (torch.index_select(self.keys[layer], 0, flat).view(shape),
                torch.index_select(self.values[layer], 0, flat).view(shape))
