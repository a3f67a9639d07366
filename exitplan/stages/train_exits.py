"""Stage ``train_exits``: exit heads for one model on a frozen backbone, with held-out metrics per exit and kind."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.artifacts import queries_path
from exitplan.atomic import write_atomic, write_json
from exitplan.config import Params
from exitplan.cpu_features import torch_dtype
from exitplan.errors import ConfigError
from exitplan.kinds import HeadKind
from exitplan.tracking import log_stage_run

STAGE = "train_exits"


def depth_at(rows: list[dict[str, Any]], kind: str, level: float, num_layers: int) -> float:
    """Shallowest exit (as a share of the layers) whose agreement reaches ``level``; 1.0 if none does."""
    depths = [r["exit_layer"] for r in rows if r["kind"] == kind and r["agreement"] >= level]
    return min(depths) / num_layers if depths else 1.0


def plot_agreement(rows: list[dict[str, Any]], model: str, path: Path) -> Path:
    """Agreement with the final layer vs depth, a line per head kind (all tokens, and confident tokens at 0.8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in sorted({r["kind"] for r in rows}):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["exit_layer"])
        depth = [r["depth"] for r in mine]
        ax.plot(depth, [r["agreement"] for r in mine], marker="o", label=f"{kind}: all tokens")
        ax.plot(depth, [r.get("confident_agreement@0.8", np.nan) for r in mine], linestyle="--",
                label=f"{kind}: confidence >= 0.8")
    ax.axhline(0.85, color="grey", linewidth=0.8)
    ax.set(xlabel="exit depth (share of layers)", ylabel="top-1 agreement with the final layer", ylim=(0, 1),
           title=model)
    ax.legend(fontsize=7)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def main(params: Params, model_name: str) -> dict[str, Any]:
    """Fit every head kind at every exit of ``model_name``; write the exit checkpoint, metrics and plot."""
    import torch
    from transformers import AutoTokenizer

    from exitplan.earlyexit.checkpoint import ExitIndex, save_heads, write_index
    from exitplan.earlyexit.partial_model import EarlyExitLM
    from exitplan.earlyexit.training import (
        collect,
        evaluate_exit,
        fit_affine,
        perplexity,
        tokenize_chunks,
        train_block,
    )
    from exitplan.workload.split import split_queries

    section = params.train_exits
    if model_name not in section.models:
        raise ConfigError("params", [f"train_exits.models: '{model_name}' is not listed; listed: {section.models}"])
    started = time.perf_counter()
    torch.manual_seed(section.seed)
    checkpoint = params.fetched(model_name)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    train_q, eval_q = split_queries(queries_path(params),
                                    section.datasets, section.seed)
    train = tokenize_chunks(tokenizer, train_q["text"].tolist(), section.chunk_tokens, section.train_chunks)
    held_out = tokenize_chunks(tokenizer, eval_q["text"].tolist(), section.chunk_tokens, section.eval_chunks)
    dtype = torch_dtype(section.dtype)  # float32 on a CPU without bfloat16 kernels
    served = EarlyExitLM.for_inference(checkpoint, dtype=dtype)  # the backbone's pass, as the engine runs it
    served.pack_vocab()
    exits = section.exit_layers(served.num_layers)
    cached = sorted({*exits, served.num_layers - 1})
    train_cache = collect(served, train, cached, section.top_k)
    eval_cache = collect(served, held_out, cached, section.top_k)
    del served
    collected_s = time.perf_counter() - started
    model = EarlyExitLM.from_pretrained(checkpoint)  # float32: the heads train against its norm, head, last layer
    if dtype != torch.float32:
        model.pack_vocab()
    rows: list[dict[str, Any]] = []
    out_dir = params.path(section.output_dir) / model_name
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind in dict.fromkeys(["identity", *section.head_kinds]):
        heads: dict[int, torch.nn.Module] = {}
        for exit_layer in exits:
            if kind == "affine":
                heads[exit_layer] = fit_affine(train_cache, exit_layer, section.ridge)
            elif kind == "block":
                heads[exit_layer], _ = train_block(model, train_cache, exit_layer, section.block_steps,
                                                   section.block_lr, section.block_batch, section.seed,
                                                   section.block_loss, section.block_positions)
            metrics = evaluate_exit(model, eval_cache, exit_layer, heads.get(exit_layer), section.thresholds)
            rows.append({"kind": kind, "exit_layer": exit_layer, "depth": exit_layer / model.num_layers, **metrics})
        if kind != "identity":
            save_heads(out_dir, kind, heads)
    final_perplexity = perplexity(model, eval_cache)
    kinds: list[HeadKind] = list(dict.fromkeys(["identity", *section.head_kinds]))
    index = ExitIndex(model=model_name, num_layers=model.num_layers, exit_layers=exits, kinds=kinds,
                      final_perplexity=final_perplexity, train_tokens=int(train.numel()),
                      eval_tokens=int(held_out.numel()),
                      depth85={k: depth_at(rows, k, 0.85, model.num_layers) for k in kinds}, exits=rows)
    write_index(out_dir, index)  # an output: what the heads are, never how long they took (same inputs, same bytes)
    summary: dict[str, Any] = index.model_dump()
    reports = params.path("reports") / STAGE
    report = write_json(reports / f"{model_name}.json", summary)
    plot = plot_agreement(rows, model_name, reports / f"{model_name}.png")
    flat = {f"{r['kind']}.L{r['exit_layer']}.{k}": v for r in rows for k, v in r.items()
            if isinstance(v, float) and k in ("agreement", "kl", "perplexity")}
    wall = {"collect_s": collected_s, "total_s": time.perf_counter() - started}
    log_stage_run(f"{STAGE}:{model_name}", params.tracking, params.root, section.model_dump(),
                  {**{k: v for k, v in summary.items() if isinstance(v, (int, float))}, **flat,
                   **{f"depth85.{k}": v for k, v in summary["depth85"].items()}}, [report, plot],
                  wall_s=wall)
    return {**summary, **wall}
