"""HELIOS vs its baselines on the real Qwen pair: same prompts, same memory budget, one process.

Systems (all in this repo's engine, on this CPU):
  - ``helios``: online profiling of the candidates, greedy partial load at the chosen exit, breach counter, load or
    switch by the PHT's measured costs;
  - ``full``: full-depth continuous batching of each candidate;
  - ``per-token EE``: single-model early exit per token, EE-LLM style (batch 1, deep KV recomputed);
  - ``transformers generate`` at batch 8 vs ``full`` capped at batch 8 (is this engine's full depth slower?).

Prompts: held-out ShareGPT / GSM8K / HumanEval queries (chat template), capped; greedy decoding. Memory budget for
every system: the (largest) candidate's full-depth weights + KV for 8 sequences of the prompt set's mean reserved
length (prompt + output cap). The per-token baseline runs at batch 1, so it serves the first 8 prompts only (4 with
``--quick``). The per-token baseline also holds every exit head; it gets their bytes on top (noted).
Quality: perplexity of each system's outputs scored by the full large model, and ROUGE-2 and token agreement against
the full-depth outputs of the same model.

Usage:
    python benchmarks/helios.py --quick   # 16 prompts x 8 tokens, the small candidate alone, its budget
    python benchmarks/helios.py           # 48 prompts x 32 tokens, both candidates, the large one's budget

Last line: ``RESULT throughput_vs_single_ee=... batch_vs_full=... ppl_delta_rel=...`` (against the baselines on the
model HELIOS served most tokens with).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from functools import cache

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.artifacts import queries_path
from exitplan.earlyexit.checkpoint import INDEX
from exitplan.engine.engine import Engine, EngineConfig
from exitplan.engine.per_token import PerTokenEngine
from exitplan.engine.request import Request
from exitplan.engine.served import Candidate, ServedModel
from exitplan.engine.telemetry import Telemetry
from exitplan.quality import load_scorer, perplexity, rouge2
from exitplan.workload.split import split_queries

MIX = ("sharegpt", "gsm8k", "humaneval")


@dataclass
class Outcome:
    """One system's run."""

    system: str
    model: str
    requests: list[Request]
    seconds: float
    max_batch: int
    num_layers: int
    loads: int = 0
    switches: int = 0
    telemetry: Telemetry | None = None

    @property
    def tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds

    @property
    def tpot(self) -> float:
        gaps = [(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in self.requests if len(r.output) > 1]
        return sum(gaps) / len(gaps)


def prompts(params, tokenizer, count: int, max_prompt: int) -> list[list[int]]:
    """``count`` held-out prompts, cycling over the data sets of MIX, as chat-template token ids (capped)."""
    _, held_out = split_queries(queries_path(params),
                                params.train_exits.datasets, params.train_exits.seed)
    by_set = {d: held_out[held_out["dataset"] == d]["prompt"].tolist() for d in MIX}
    out = []
    for i in range(count):
        text = by_set[MIX[i % len(MIX)]][i // len(MIX)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(list(ids[:max_prompt - 8]) + list(ids[-8:]) if len(ids) > max_prompt else list(ids))
    return out


def make_requests(batch: list[list[int]], new_tokens: int, stop: frozenset[int]) -> list[Request]:
    return [Request(f"q{i}", p, new_tokens, stop_ids=stop) for i, p in enumerate(batch)]


@cache
def footprint(candidate: Candidate) -> tuple[int, int]:
    """Full-depth weight bytes of ``candidate`` and its KV bytes per token, measured from its tensors (one
    1-layer open per candidate)."""
    from exitplan.earlyexit.runner import kv_shape

    one, _ = ServedModel.open(candidate, 1, exits=[])
    layer = sum(p.nbytes for p in one.model.model.model.layers[0].parameters())
    return one.model.weight_bytes() + layer * (one.num_layers - 1), kv_shape(one.model).bytes_per_token(
        one.num_layers)


def budget_for(candidate: Candidate, tokens: float) -> int:
    """Full-depth weights of ``candidate`` + KV for 8 sequences of ``tokens`` each."""
    weights, kv_per_token = footprint(candidate)
    return int(weights + kv_per_token * tokens * 8)


def run_engine(system: str, candidates: list[Candidate], config: EngineConfig, batch, new_tokens, stop) -> Outcome:
    engine = Engine(candidates, config)
    requests = make_requests(batch, new_tokens, stop)
    started = time.perf_counter()
    engine.run(requests)
    seconds = time.perf_counter() - started
    return Outcome(system, engine.served.name, requests, seconds, engine.telemetry.max_batch(),
                   engine.served.num_layers, engine.telemetry.count("load"), engine.telemetry.count("switch"),
                   engine.telemetry)


def run_per_token(candidate: Candidate, budget: int, threshold: float, batch, new_tokens, stop) -> Outcome:
    from exitplan.earlyexit.checkpoint import read_heads

    probe, _ = ServedModel.open(candidate, 1, exits=[])
    heads = read_heads(probe.model, candidate.exits_dir, candidate.head_kind)[1]
    extra = len(heads) * max(sum(p.nbytes for p in h.parameters()) for h in heads.values())
    del probe, heads
    engine = PerTokenEngine(candidate, budget + extra, threshold)
    requests = make_requests(batch, new_tokens, stop)
    started = time.perf_counter()
    engine.run(requests)
    return Outcome("per-token EE", candidate.name, requests, time.perf_counter() - started, 1, engine.served.num_layers)


def run_generate(candidate: Candidate, batch, new_tokens, stop) -> tuple[float, int]:
    """transformers ``generate`` (greedy, left-padded batch): seconds and tokens generated."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(candidate.checkpoint), dtype=torch.float32).eval()
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=sorted(stop), pad_token_id=0)
    seconds = time.perf_counter() - started
    generated = out[:, width:]
    tokens = sum(int(next((j + 1 for j, t in enumerate(row.tolist()) if t in stop), len(row))) for row in generated)
    return seconds, tokens


def score(large: Candidate, outcomes: list[Outcome]) -> dict[str, float]:
    """Perplexity of each system's outputs under the full large model (a pair two systems share is scored once)."""
    import math

    model = load_scorer(large.checkpoint)
    nll: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
    out = {}
    for o in outcomes:
        pairs = [(tuple(r.prompt), tuple(r.output)) for r in o.requests if r.output]
        for pair in pairs:
            if pair not in nll:
                nll[pair] = math.log(perplexity(model, [pair])) * len(pair[1])
        out[f"{o.system}|{o.model}"] = math.exp(sum(nll[p] for p in pairs) / sum(len(p[1]) for p in pairs))
    return out


def agreement(a: list[Request], b: list[Request]) -> tuple[float, float]:
    """Mean ROUGE-2 F1 (over token ids as words) and positional token agreement of two runs of the same prompts."""
    reference = {r.request_id: r for r in b}
    pairs = [(x, reference[x.request_id]) for x in a]
    agree = [sum(p == q for p, q in zip(x.output, y.output, strict=False)) / max(len(x.output), len(y.output))
             for x, y in pairs]
    return rouge2([x.output for x, _ in pairs], [y.output for _, y in pairs]), sum(agree) / len(agree)


def main() -> None:
    from transformers import AutoTokenizer

    args, params = start(__doc__)
    h = params.helios
    exits = params.path(params.train_exits.output_dir)
    cands = [Candidate(m, params.checkpoint_path(m), exits / m, h.head_kind) for m in h.candidates]
    for c in cands:
        if not (c.exits_dir / INDEX).is_file():
            sys.exit(f"no exit checkpoint for {c.name}: run `make run` first")
    small, large = cands[0], cands[-1]
    count, new_tokens, max_prompt = (16, 8, 48) if args.quick else (48, 32, 128)
    alone = 4 if args.quick else 8  # prompts the batch-1 per-token baseline serves
    tokenizer = AutoTokenizer.from_pretrained(str(small.checkpoint))
    batch = prompts(params, tokenizer, count, max_prompt)
    stop = frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    mean = sum(len(p) for p in batch) / len(batch) + new_tokens
    helios_cands = [small] if args.quick else cands
    budget = budget_for(helios_cands[-1], mean)
    print(f"{count} prompts (mean {mean - new_tokens:.0f} tokens) x {new_tokens} new tokens; memory budget "
          f"{budget / 2**30:.2f} GiB = {helios_cands[-1].name.split('/')[-1]} full weights + KV for 8 x {mean:.0f} "
          f"tokens")
    base = {"memory_budget_bytes": budget, "block_size": h.block_size, "threshold": h.threshold,
            "confidence": h.confidence, "cbc_window": h.cbc_window, "cbc_max": h.cbc_max,
            "profile_requests": min(h.profile_requests, max(count // 3, 1)), "reprofile_every": h.reprofile_every}
    phases, mark = {}, time.perf_counter()
    outcomes = [run_engine("helios", helios_cands, EngineConfig(**base), batch, new_tokens, stop)]
    phases["helios"], mark = time.perf_counter() - mark, time.perf_counter()
    gc.collect()
    served = max({r.model for r in outcomes[0].requests},
                 key=lambda m: sum(len(r.output) for r in outcomes[0].requests if r.model == m))
    same = next(c for c in cands if c.name == served)
    for c in dict.fromkeys([same, *([] if args.quick else cands)]):
        outcomes.append(run_engine("full", [c], EngineConfig(**base, mode="full"), batch, new_tokens, stop))
        gc.collect()
        # batch 1: its throughput does not depend on how many requests it serves, so it gets the first few
        outcomes.append(run_per_token(c, budget, h.threshold, batch[:alone], new_tokens, stop))
        gc.collect()
    phases["baselines"], mark = time.perf_counter() - mark, time.perf_counter()
    # generate holds all 8 at once, so the engine gets room for 8 of the longest (each reserves whole KV blocks)
    room = budget_for(small, max(len(p) for p in batch[:8]) + new_tokens + h.block_size)
    capped = run_engine("full@8", [small], EngineConfig(**{**base, "memory_budget_bytes": room}, mode="full",
                                                        max_num_seqs=8), batch[:8], new_tokens, stop)
    gen_s, gen_tokens = run_generate(small, batch[:8], new_tokens, stop)
    gc.collect()
    phases["batch-8 vs generate"], mark = time.perf_counter() - mark, time.perf_counter()
    ppl = score(large, outcomes)
    phases["scoring"] = time.perf_counter() - mark
    helios = outcomes[0]
    print(f"\n{'system':<14}{'model':<28}{'tok/s':>8}{'TPOT ms':>9}{'max batch':>10}{'loads':>6}{'switch':>7}"
          f"{'ppl(large)':>11}{'ROUGE-2':>9}{'agree':>7}")
    full_of = {o.model: o for o in outcomes if o.system == "full"}
    for o in outcomes:
        rouge, agree = agreement(o.requests, full_of[o.model].requests) if o.model in full_of else (float("nan"),) * 2
        print(f"{o.system:<14}{o.model.split('/')[-1]:<28}{o.throughput:>8.2f}{o.tpot * 1e3:>9.1f}{o.max_batch:>10}"
              f"{o.loads:>6}{o.switches:>7}{ppl[f'{o.system}|{o.model}']:>11.3f}{rouge:>9.3f}{agree:>7.3f}")
    steps = helios.telemetry.steps
    serving = [s for s in steps if s.phase == "serving"]
    exits = [r.exit_layers for r in helios.requests]
    flat = [e for xs in exits for e in xs]
    early = sum(e < helios.num_layers for e in flat) / len(flat)
    print(f"\nHELIOS: {len(steps)} steps ({len(serving)} serving), exit layers used "
          f"{sorted({s.exit_layer for s in serving})}, share of tokens exited early {early:.3f}, events: "
          + ", ".join(f"{e.kind}:{e.model.split('/')[-1]}" for e in helios.telemetry.events))
    ee = next(o for o in outcomes if o.system == "per-token EE" and o.model == served)
    full = full_of[served]
    ppl_delta = ppl[f"helios|{helios.model}"] / ppl[f"full|{served}"] - 1
    print("seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"full depth in this engine at batch {capped.max_batch}: {capped.throughput:.2f} tok/s; transformers "
          f"generate at batch 8: "
          f"{gen_tokens / gen_s:.2f} tok/s; ratio {capped.throughput / (gen_tokens / gen_s):.2f}")
    print(f"ratios vs {served}: throughput vs per-token EE {helios.throughput / ee.throughput:.2f} (target 1.48), "
          f"vs full {helios.throughput / full.throughput:.2f}; batch vs full {helios.max_batch / full.max_batch:.2f} "
          f"(target 4); ppl delta {ppl_delta:+.4f} (target <= +0.01)")
    print(f"RESULT throughput_vs_single_ee={helios.throughput / ee.throughput:.3f} "
          f"batch_vs_full={helios.max_batch / full.max_batch:.3f} ppl_delta_rel={ppl_delta:.4f}")


if __name__ == "__main__":
    main()
