"""How shallow early exit gets on the real Qwen pair, per exit-head kind and workload, and HELIOS's observations.

Reads the exit checkpoints of the ``train_exits`` stage (run ``make run`` first) and measures, with the
``exit_profile`` stage's own code, on held-out prompts (queries never used for training): top-1 agreement with the
final layer at every exit for every head kind, the shallowest depth reaching 85% agreement (HELIOS's trained models:
85% at 28% depth), perplexity at each exit vs the full model, the share of tokens confident at the earliest exit,
the complementarity of the two models, and the agreement of low-confidence early tokens - per workload. One forward
pass per model serves every head kind.

Usage:
    python benchmarks/exit_heads.py --quick   # 1 sequence of 64 tokens per data set per model (~1.5 min)
    python benchmarks/exit_heads.py           # the stage's depth (params: exit_profile.chunks_per_dataset)

Last line: ``RESULT depth85=... earliest_exit_share=... complementarity=... low_conf_agreement=...`` (depth85: the
shallowest over kinds for the small model, as a share of its layers; the other keys at threshold 0.8 with the kind
that reaches the best depth85 (block on ties), over all workloads).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import start  # benchmarks/ is the script's folder, so on sys.path

from exitplan.earlyexit.checkpoint import INDEX
from exitplan.kinds import HEAD_KINDS
from exitplan.stages.exit_profile import observe, trace_models

THRESHOLD = 0.8
KINDS = list(HEAD_KINDS)


def print_curves(curves: list[dict], depth85: list[dict]) -> None:
    """Agreement per exit (columns) for each model and kind on all tokens, with perplexity and depth85."""
    best = {(r["model"], r["kind"]): r["depth85"] for r in depth85 if r["dataset"] == "all"}
    for model in dict.fromkeys(r["model"] for r in curves):
        mine = [r for r in curves if r["model"] == model and r["dataset"] == "all"]
        layers = sorted({r["exit_layer"] for r in mine})
        print(f"\n{model}: top-1 agreement with the final layer (all held-out tokens) / perplexity at each exit "
              f"(full model: {mine[0]['final_perplexity']:.2f})")
        print(f"{'kind':<10}" + "".join(f"{'L' + str(e):>8}" for e in layers) + f"{'depth85':>9}")
        for kind in KINDS:
            row = {r["exit_layer"]: r for r in mine if r["kind"] == kind}
            print(f"{kind:<10}" + "".join(f"{row[e]['agreement']:>8.2f}" for e in layers)
                  + f"{best[(model, kind)]:>9.2f}")
            print(f"{'  ppl':<10}" + "".join(f"{row[e]['perplexity']:>8.1f}" for e in layers))
            print(f"{'  conf.':<10}" + "".join(f"{row[e][f'confident_agreement@{THRESHOLD}']:>8.2f}" for e in layers)
                  + f"   (agreement of tokens with confidence >= {THRESHOLD})")
            print(f"{'  share':<10}" + "".join(f"{row[e][f'confident_share@{THRESHOLD}']:>8.2f}" for e in layers)
                  + "   (share of tokens they are)")


def print_workloads(observations: list[dict], pairs: list[dict]) -> None:
    """HELIOS's observations per workload and kind at THRESHOLD."""
    print(f"\nper workload at confidence >= {THRESHOLD} (early = first confident exit by half depth):")
    print(f"{'model':<28}{'kind':<10}{'dataset':<11}{'earliest':>9}{'early':>7}{'low-conf agr':>14}{'tokens':>8}")
    for r in observations:
        if r["threshold"] == THRESHOLD:
            print(f"{r['model'][-27:]:<28}{r['kind']:<10}{r['dataset']:<11}{r['earliest_share']:>9.3f}"
                  f"{r['early_share']:>7.3f}{r['low_conf_agreement']:>14.3f}{r['tokens']:>8}")
    print("\ncomplementarity (early in small / large / either; HELIOS: 0.74 / 0.77 / 0.92):")
    for r in pairs:
        if r["threshold"] == THRESHOLD:
            print(f"  {r['kind']:<10}{r['dataset']:<11}{r['small_alone']:>7.3f}{r['large_alone']:>7.3f}"
                  f"{r['together']:>7.3f}")


def main() -> None:
    args, params = start(__doc__)
    quick = {"chunks_per_dataset": 1, "chunk_tokens": 64} if args.quick else {}
    section = params.exit_profile.model_copy(update={"head_kinds": KINDS, "thresholds": [0.5, THRESHOLD, 0.9],
                                                     **quick})
    params = params.model_copy(update={"exit_profile": section})
    for name in section.models:
        if not (params.path(params.train_exits.output_dir) / name / INDEX).is_file():
            sys.exit(f"no exit checkpoint for {name}: run `make run` (stage train_exits) first")
    started = time.perf_counter()
    tables = observe(params, *trace_models(params))
    print_curves(tables["curves"], tables["depth85"])
    print_workloads(tables["observations"], tables["complementarity"])
    small = section.models[0]
    depth = {r["kind"]: r["depth85"] for r in tables["depth85"] if r["model"] == small and r["dataset"] == "all"}
    kind = min(reversed(KINDS), key=lambda k: depth[k])
    obs = next(r for r in tables["observations"] if r["model"] == small and r["kind"] == kind
               and r["dataset"] == "all" and r["threshold"] == THRESHOLD)
    pair = next(r for r in tables["complementarity"] if r["kind"] == kind and r["dataset"] == "all"
                and r["threshold"] == THRESHOLD)
    print(f"\nseconds: {time.perf_counter() - started:.0f}; RESULT shares use the {kind} heads")
    print(f"RESULT depth85={depth[kind]:.3f} earliest_exit_share={obs['earliest_share']:.3f} "
          f"complementarity={pair['together']:.3f} low_conf_agreement={obs['low_conf_agreement']:.3f}")


if __name__ == "__main__":
    main()
