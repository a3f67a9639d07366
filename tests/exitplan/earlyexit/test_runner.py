"""The paged runner: packed prompts and decode steps over the KV pool give transformers' own logits."""

from __future__ import annotations

import pytest
import torch

from exitplan.earlyexit.heads import make_head
from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, Work, cached_layers, kv_shape
from exitplan.errors import ExitplanError

PROMPTS = [[5, 17, 230, 99, 4, 1000, 7], [42, 8, 300], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                                                        27, 28]]


def _reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def _runner(path, layers=None, blocks=32, block_size=4, head=None, exit_layer=None) -> tuple[PagedRunner, KVPool]:
    model = EarlyExitLM.from_pretrained(path, layers)
    slots = cached_layers(exit_layer or model.held_layers, head)
    pool = KVPool(kv_shape(model), slots, blocks, block_size)
    return PagedRunner(model, pool), pool


def test_packed_prefill_and_decode_equal_transformers(tiny_checkpoint) -> None:
    path, reference = tiny_checkpoint
    runner, pool = _runner(path)
    pool.keys.fill_(float("nan"))  # a slot read before it is written (padding of the batched decode) shows up
    pool.values.fill_(float("nan"))
    blocks = [pool.allocate(pool.blocks_for(len(p) + 3)) for p in PROMPTS]
    logits = runner.forward([Work.span(p, 0, b) for p, b in zip(PROMPTS, blocks, strict=True)], 6)
    seqs = [list(p) for p in PROMPTS]
    for step in range(3):  # noqa: B007 (the loop's count is asserted after it)
        for i, seq in enumerate(seqs):
            expected = _reference(reference, seq)[-1]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)
            seq.append(int(expected.argmax()))
        logits = runner.forward([Work.span([s[-1]], len(s) - 1, b) for s, b in zip(seqs, blocks, strict=True)], 6)
    assert step == 2


def test_every_position_and_gaps_filled_later(tiny_checkpoint) -> None:
    """Positions can arrive out of order across passes (the per-token baseline's deep-KV recomputation)."""
    path, reference = tiny_checkpoint
    runner, pool = _runner(path)
    prompt = PROMPTS[0]
    blocks = pool.allocate(pool.blocks_for(len(prompt)))
    expected = _reference(reference, prompt)
    runner.forward([Work(prompt[:3], range(3), blocks)], 6)
    got = runner.forward([Work(prompt[3:], range(3, len(prompt)), blocks)], 6, all_positions=True)
    torch.testing.assert_close(got, expected[3:], atol=1e-4, rtol=1e-4)


def test_partial_model_exit_equals_its_exit_logits(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint
    full = EarlyExitLM.from_pretrained(path)
    head = make_head("block", full, 3)
    runner, pool = _runner(path, layers=3, head=head, exit_layer=3)
    assert pool.layers == 4  # three layers and the block head's own
    prompt = PROMPTS[2]
    blocks = pool.allocate(pool.blocks_for(len(prompt) + 1))
    got = runner.forward([Work.span(prompt[:-1], 0, blocks)], 3, head)
    nxt = runner.forward([Work.span(prompt[-1:], len(prompt) - 1, blocks)], 3, head)
    with torch.no_grad():
        outputs = full.layer_outputs(torch.tensor([prompt]))
        full.add_exit_head(3, head)
        expected = full.exit_logits(outputs[2], 3)[0]
    torch.testing.assert_close(got[0], expected[-2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(nxt[0], expected[-1], atol=1e-4, rtol=1e-4)


def test_pool_blocks_are_handed_out_and_back() -> None:
    from exitplan.earlyexit.kv_pool import KVShape

    pool = KVPool(KVShape(2, 8), layers=3, num_blocks=4, block_size=16)
    assert pool.nbytes == 2 * 3 * 4 * 16 * 2 * 8 * 4 == KVShape(2, 8).bytes_per_token(3) * 64
    a = pool.allocate(3)
    with pytest.raises(ExitplanError, match="exhausted: 2 blocks asked, 1 free"):
        pool.allocate(2)
    assert pool.free_blocks == 1
    pool.release(a)
    assert pool.free_blocks == 4 and pool.blocks_for(33) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_a_padded_table_equals_the_general_attention(dtype: torch.dtype) -> None:
    from exitplan.earlyexit.runner import attend, attend_decode

    torch.manual_seed(0)
    batch, heads, kv, width, hd = 3, 6, 2, 9, 8
    q = torch.randn(batch, heads, hd, dtype=dtype)
    k, v = torch.randn(kv, batch, width, hd, dtype=dtype), torch.randn(kv, batch, width, hd, dtype=dtype)
    valid = torch.arange(width)[None, :] < torch.tensor([9, 4, 1])[:, None]  # padded to the longest context
    expected = attend(q[:, :, None], k.transpose(0, 1), v.transpose(0, 1), valid[:, None, None, :], hd ** -0.5)
    got = attend_decode(q, k, v, valid, hd ** -0.5)
    assert got.shape == (batch, heads * hd)
    assert torch.equal(got, expected.reshape(batch, -1))


def test_pool_reads_what_was_written_and_moves_it_to_another_pool() -> None:
    from exitplan.earlyexit.kv_pool import KVShape

    torch.manual_seed(0)
    shape = KVShape(2, 4)
    pool = KVPool(shape, layers=2, num_blocks=3, block_size=4)
    slots = torch.tensor([5, 0, 11])
    keys, values = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    pool.write(1, slots, keys, values)
    read_k, read_v = pool.read(1, slots[None].expand(2, -1))  # a 2 x 3 table
    assert read_k.shape == (2, 2, 3, 4)  # kv_heads x table x head_dim
    assert torch.equal(read_k[:, 1], keys.transpose(0, 1)) and torch.equal(read_v[:, 0], values.transpose(0, 1))
    other = KVPool(shape, layers=2, num_blocks=3, block_size=4)
    other.scatter(torch.tensor([1, 2, 3]), *pool.gather(slots))
    assert torch.equal(other.read(1, torch.tensor([1, 2, 3]))[0], keys.transpose(0, 1))
