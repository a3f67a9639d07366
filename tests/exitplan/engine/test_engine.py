"""The HELIOS engine on tiny models: exactness, memory, breach reactions, no request lost across a switch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from exitplan.earlyexit.kv_pool import KVPool
from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.earlyexit.runner import PagedRunner, Work, kv_shape
from exitplan.engine.engine import Engine, EngineConfig
from exitplan.engine.per_token import PerTokenEngine
from exitplan.engine.request import Request
from exitplan.errors import ExitplanError
from exitplan.profiling.pht import PerformanceHistoryTable

MiB = 2**20


def _requests(n: int, new_tokens: int = 8, prefix: str = "r") -> list[Request]:
    g = torch.Generator().manual_seed(7)
    return [Request(f"{prefix}{i}", torch.randint(1, 500, (5 + 3 * i,), generator=g).tolist(), new_tokens)
            for i in range(n)]


def _greedy(candidate, prompt: list[int], new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(candidate.checkpoint)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_full_depth_and_never_early_equal_transformers_greedy(pair) -> None:
    """Early exit disabled (cbc_max 0: no breach tolerated, so the profile picks full depth) = greedy decoding."""
    a, _ = pair
    expected = [_greedy(a, r.prompt, 8) for r in _requests(4)]
    full = Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, mode="full")).run(_requests(4))
    assert [r.output for r in full] == expected
    engine = Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, cbc_max=0, profile_requests=2))
    never = engine.run(_requests(4))
    assert [r.output for r in never] == expected
    assert {s.exit_layer for s in engine.telemetry.steps} == {6}
    per_token = PerTokenEngine(a, 64 * MiB, threshold=1.01).run(_requests(4))
    assert [r.output for r in per_token] == expected


def test_per_token_exits_fill_the_deep_kv(pair) -> None:
    """Per-token exits at threshold 0 leave at the first exit; the riders' deep KV then equals a full run's."""
    a, _ = pair
    engine = PerTokenEngine(a, 64 * MiB, threshold=0.0)
    request = engine.run(_requests(1, new_tokens=5))[0]
    assert request.exit_layers[1:] == [2] * 4  # the first token comes from the full-depth prefill
    assert len(request.output) == 5


def test_memory_budget_bounds_the_batch_and_is_never_exceeded(pair) -> None:
    a, _ = pair
    large = Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, mode="full", block_size=4))
    per_block = large.served.pool.nbytes // large.served.pool.num_blocks
    budget = large.served.weight_bytes() + 30 * per_block + per_block // 2  # room for 30 blocks of KV
    small = Engine([a], EngineConfig(memory_budget_bytes=budget, mode="full", block_size=4))
    assert small.served.pool.num_blocks == 30
    small.run(_requests(12, new_tokens=6))
    assert small.telemetry.peak_memory() <= budget
    assert max(s.kv_blocks_used for s in small.telemetry.steps) <= 30
    large.run(_requests(12, new_tokens=6))
    assert small.telemetry.max_batch() < large.telemetry.max_batch() == 12
    with pytest.raises(ExitplanError, match="over the .* budget"):
        Engine([a], EngineConfig(memory_budget_bytes=1 * MiB, mode="full"))


def test_partial_model_holds_more_sequences_in_the_same_budget(pair) -> None:
    a, _ = pair
    pht = PerformanceHistoryTable()
    Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, profile_requests=2), pht).run(_requests(2))
    entry = pht["tiny/a"]
    entry.exit_distribution = {2: 0.9, 4: 0.05, 6: 0.05}  # nearly every token confident at layer 2
    partial = Engine([a], EngineConfig(memory_budget_bytes=3 * MiB, block_size=4), pht)
    full = Engine([a], EngineConfig(memory_budget_bytes=3 * MiB, block_size=4, mode="full"))
    assert partial.served.exit_layer == 2 and partial.served.model.held_layers == 2
    assert partial.served.pool.num_blocks > full.served.pool.num_blocks


def _tripping_engine(candidates, pht, **kw) -> Engine:
    """An engine serving tiny/a at exit 2 where every token is a breach and the counter trips after 2."""
    config = EngineConfig(memory_budget_bytes=64 * MiB, threshold=1.01, cbc_window=4, cbc_max=1, **kw)
    return Engine(list(candidates), config, pht)


def _profiled(pair) -> PerformanceHistoryTable:
    pht = PerformanceHistoryTable()
    for c in pair:
        Engine([c], EngineConfig(memory_budget_bytes=64 * MiB, profile_requests=2), pht).run(_requests(2, 4, "p"))
    for entry in pht.entries.values():
        entry.exit_distribution = {2: 0.8, 4: 0.1, 6: 0.1}
    return pht


def test_tripped_counter_loads_when_loading_is_cheaper_and_deep_kv_is_exact(pair) -> None:
    pht = _profiled(pair)
    pht["tiny/b"].load_s_base = 1e6  # switching would take forever
    pht["tiny/b"].decode_s = 1.0  # and b is the slower model, so a is served first
    engine = _tripping_engine(pair, pht)
    assert (engine.served.name, engine.served.exit_layer) == ("tiny/a", 2)
    for r in _requests(3, new_tokens=12):
        engine.add(r)
    while not any(e.kind == "load" for e in engine.telemetry.events):
        engine.step()
        engine.wait_for_loads() if engine._loading is not None else None
    engine.step()  # the re-prefill at full depth
    start = next(e for e in engine.telemetry.events if e.kind == "load_start")
    assert start.detail["options"][0]["action"] == "load"
    assert engine.served.model.held_layers == 6 and engine.served.exit_layer == 6
    request = engine.running[0]
    reference = EarlyExitLM.from_pretrained(pair[0].checkpoint)
    pool = KVPool(kv_shape(reference), 6, 16, engine.served.pool.block_size)
    blocks = pool.allocate(pool.blocks_for(request.cached))
    PagedRunner(reference, pool).forward([Work.span(request.context[:request.cached], 0, blocks)], 6)
    mine = engine.served.pool.slots(request.blocks, 0, request.cached)
    theirs = pool.slots(blocks, 0, request.cached)
    for ours, reference_kv in zip(engine.served.pool.gather(mine), pool.gather(theirs), strict=True):
        torch.testing.assert_close(ours, reference_kv, atol=1e-5, rtol=1e-5)
    while engine.has_work():
        engine.step()


def test_tripped_counter_switches_when_switching_is_cheaper_and_loses_no_request(pair) -> None:
    pht = _profiled(pair)
    pht["tiny/a"].load_s_per_layer = 1e6  # loading a's remaining layers would take forever
    pht["tiny/b"].decode_s = pht["tiny/a"].decode_s * 2  # a is served first
    engine = _tripping_engine(pair, pht)
    requests = _requests(5, new_tokens=10)
    engine.run(requests)
    switches = [e for e in engine.telemetry.events if e.kind == "switch"]
    assert switches and switches[0].model == "tiny/b"
    assert switches[0].detail["options"][0]["action"] == "switch"
    moved = set(switches[0].detail["requests"])
    assert moved and all("tiny/b" in r.served_by for r in requests if r.request_id in moved)
    ids = [r.request_id for r in engine.finished]
    assert sorted(ids) == sorted(r.request_id for r in requests) and len(ids) == len(set(ids))
    assert all(len(r.output) == 10 and r.finished for r in requests)


def test_profiling_requests_are_answered_and_fill_the_pht(pair, tmp_path) -> None:
    pht = PerformanceHistoryTable(tmp_path / "pht.json")
    engine = Engine(list(pair), EngineConfig(memory_budget_bytes=64 * MiB, profile_requests=2), pht)
    requests = engine.run(_requests(6, new_tokens=4))
    assert all(len(r.output) == 4 for r in requests)
    assert {r.served_by[0] for r in requests[:2]} == {"tiny/a"}
    assert {r.served_by[0] for r in requests[2:4]} == {"tiny/b"}
    stored = PerformanceHistoryTable(tmp_path / "pht.json")
    assert set(stored.entries) == {"tiny/a", "tiny/b"}
    entry = stored["tiny/a"]
    assert entry.decode_s > 0 and entry.prefill_s > 0 and entry.load_s_per_layer > 0 and entry.requests == 2
    assert sum(entry.exit_distribution.values()) == pytest.approx(1.0)
    assert (tmp_path / "pht.json").stat().st_size < 1024 * 2
    assert any(e.kind == "select" for e in engine.telemetry.events)


def test_bad_requests_are_refused(pair) -> None:
    a, _ = pair
    engine = Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, mode="full"))
    engine.add(Request("x", [1, 2], 2))
    with pytest.raises(ExitplanError, match="duplicate request id 'x'"):
        engine.add(Request("x", [1, 2], 2))
    with pytest.raises(ExitplanError, match="empty prompt"):
        Request("y", [], 2)
    with pytest.raises(ExitplanError, match="needs 1000002 KV slots"):
        engine.add(Request("z", [1, 2], 1_000_000))


def test_temperature_sampling_is_seeded_and_stop_tokens_end_requests(pair) -> None:
    a, _ = pair
    config = EngineConfig(memory_budget_bytes=64 * MiB, mode="full")

    def sampled(seed: int) -> list[int]:
        request = Request("t", [5, 6, 7, 8], 12, temperature=1.5, seed=seed)
        return Engine([a], config).run([request])[0].output

    assert sampled(1) == sampled(1) and sampled(1) != sampled(2)
    greedy = Engine([a], config).run([Request("g", [5, 6, 7, 8], 12)])[0].output
    stop = Request("s", [5, 6, 7, 8], 12, stop_ids=frozenset({greedy[3]}))
    Engine([a], config).run([stop])
    assert stop.output == greedy[:greedy.index(greedy[3]) + 1] and stop.finish_reason == "stop"


def test_timed_arrivals_are_served_as_they_come(pair) -> None:
    a, _ = pair
    engine = Engine([a], EngineConfig(memory_budget_bytes=64 * MiB, mode="full"))
    requests = _requests(3, new_tokens=3)
    engine.run_timed(requests, [0.0, 0.05, 0.1])
    assert all(r.finished for r in requests)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:], strict=False)]
    assert gaps == pytest.approx([0.05, 0.05], abs=1e-6)
    assert all(r.first_token_s >= r.arrival_s for r in requests)
