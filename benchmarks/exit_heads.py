"""How shallow early exit gets on the real Qwen pair, per exit-head kind, and HELIOS's observations.

Reads the exit checkpoints of the ``train_exits`` stage (run ``make run`` first) and measures on held-out prompts
(queries never used for training): top-1 agreement with the final layer at every exit for every head kind, the
shallowest depth reaching 85% agreement (HELIOS's trained models: 85% at 28% depth), the share of tokens confident
at the earliest exit, the complementarity of the two models, and the agreement of low-confidence early tokens.

Usage:
    python benchmarks/exit_heads.py --quick   # 1 sequence of 128 tokens per data set per model (~2 min)
    python benchmarks/exit_heads.py           # 4 sequences per data set

Last line: ``RESULT depth85=... earliest_exit_share=... complementarity=... low_conf_agreement=...`` (depth85: the
shallowest over kinds, for the small model, as a share of its layers; shares at threshold 0.8 with the
``exit_profile.head_kind`` heads).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from exitplan import REPO_ROOT  # noqa: E402
from exitplan.config import load_params  # noqa: E402
from exitplan.earlyexit.checkpoint import INDEX, load_heads  # noqa: E402
from exitplan.earlyexit.partial_model import EarlyExitLM  # noqa: E402
from exitplan.earlyexit.profile import complementarity, profile_metrics, trace_exits  # noqa: E402
from exitplan.earlyexit.training import tokenize_chunks  # noqa: E402
from exitplan.workload.split import split_queries  # noqa: E402

THRESHOLD = 0.8


def held_out_chunks(params, tokenizer, per_dataset: int) -> torch.Tensor:
    """Held-out token chunks, ``per_dataset`` sequences from each profiled data set."""
    section = params.exit_profile
    _, held_out = split_queries(params.path(params.prepare_workload.output_dir) / "queries.parquet",
                                params.train_exits.datasets, params.train_exits.seed)
    return torch.cat([tokenize_chunks(tokenizer, held_out[held_out["dataset"] == d]["text"].tolist(),
                                      section.chunk_tokens, per_dataset) for d in section.datasets])


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = load_params(REPO_ROOT / "params.yaml")
    models = params.exit_profile.models
    for name in models:
        if not (params.path(params.train_exits.output_dir) / name / INDEX).is_file():
            sys.exit(f"no exit checkpoint for {name}: run `make run` (stage train_exits) first")
    started = time.perf_counter()
    print(f"{'model':<36}{'kind':<10}" + "".join(f"{'L' + str(e):>7}" for e in range(4, 29, 4)) + "   depth85")
    traces, depth85 = {}, {}
    for name in models:
        checkpoint = params.checkpoint_path(name)
        chunks = held_out_chunks(params, AutoTokenizer.from_pretrained(str(checkpoint)), 1 if args.quick else 4)
        for kind in ("identity", "affine", "block"):
            model = EarlyExitLM.from_pretrained(checkpoint)
            exits = load_heads(model, params.path(params.train_exits.output_dir) / name, kind)
            trace = trace_exits(model, chunks, exits, params.exit_profile.confidence)
            agreement = (trace.top1 == trace.final_top1).mean(axis=1)
            reached = [e / model.num_layers for e, a in zip(exits, agreement, strict=True) if a >= 0.85]
            depth = min(reached) if reached else 1.0
            depth85[(name, kind)] = depth
            if kind == params.exit_profile.head_kind:
                traces[name] = trace
            cells = {e: a for e, a in zip(exits, agreement, strict=True)}
            print(f"{name[-35:]:<36}{kind:<10}" + "".join(f"{cells[e]:>7.2f}" if e in cells else f"{'':>7}"
                                                           for e in range(4, 29, 4)) + f"{depth:>10.2f}")
    small, large = models[0], models[-1]
    profile = profile_metrics(traces[small], THRESHOLD, params.exit_profile.early_depth)
    pair = complementarity(traces[small], traces[large], THRESHOLD, params.exit_profile.early_depth)
    print(f"\nat confidence >= {THRESHOLD}, early = by {params.exit_profile.early_depth:.0%} depth "
          f"({params.exit_profile.head_kind} heads, {len(traces[small])} tokens per model):")
    print(f"  {small}: earliest-exit share {profile['earliest_share']:.3f}, early share "
          f"{profile['early_share']:.3f}, low-confidence agreement {profile['low_conf_agreement']:.3f}")
    print(f"  complementarity: small {pair['small_alone']:.3f}, large {pair['large_alone']:.3f}, "
          f"together {pair['together']:.3f}   (HELIOS: 0.74 / 0.77 / 0.92)")
    print(f"  seconds: {time.perf_counter() - started:.0f}")
    best = min(depth85[(small, k)] for k in ("identity", "affine", "block"))
    print(f"RESULT depth85={best:.3f} earliest_exit_share={profile['earliest_share']:.3f} "
          f"complementarity={pair['together']:.3f} low_conf_agreement={profile['low_conf_agreement']:.3f}")


if __name__ == "__main__":
    main()
