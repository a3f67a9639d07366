"""Stage ``exit_profile``: first confident exits of each model on held-out prompts, and HELIOS's observations."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.atomic import write_atomic, write_json, write_parquet
from exitplan.config import Params
from exitplan.tracking import log_stage_run

STAGE = "exit_profile"


def _held_out_chunks(params: Params, tokenizer: Any) -> tuple[Any, np.ndarray]:
    """Token chunks per data set from the queries ``train_exits`` held out, and the data set of each token."""
    import torch

    from exitplan.earlyexit.training import tokenize_chunks
    from exitplan.workload.split import split_queries

    section = params.exit_profile
    _, held_out = split_queries(params.path(params.prepare_workload.output_dir) / "queries.parquet",
                                params.train_exits.datasets, params.train_exits.seed)
    chunks, labels = [], []
    for dataset in section.datasets:
        texts = held_out[held_out["dataset"] == dataset]["text"].tolist()
        part = tokenize_chunks(tokenizer, texts, section.chunk_tokens, section.chunks_per_dataset)
        chunks.append(part)
        labels.extend([dataset] * part.numel())
    return torch.cat(chunks), np.asarray(labels)


def plot_distribution(rows: list[dict[str, Any]], threshold: float, path: Path) -> Path:
    """Bar chart of the first confident exit (share of tokens per exit depth), one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mine = [r for r in rows if r["threshold"] == threshold and r["dataset"] == "all"]
    width = 0.8 / max(len(mine), 1)
    for i, row in enumerate(mine):
        layers = sorted(row["first_exit_distribution"])
        depth = np.asarray(layers) / row["num_layers"]
        ax.bar(depth + (i - len(mine) / 2) * width / 4, [row["first_exit_distribution"][k] for k in layers],
               width=width / 4, label=row["model"])
    ax.set(xlabel="first confident exit (share of layers; 1.0 = no exit)", ylabel="share of tokens",
           title=f"first exit with confidence >= {threshold}")
    ax.legend(fontsize=7)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def main(params: Params) -> dict[str, Any]:
    """Profile every model of ``exit_profile.models``; write the per-token profile, metrics, table and plot."""
    import pandas as pd
    from transformers import AutoTokenizer

    from exitplan.earlyexit.checkpoint import load_heads
    from exitplan.earlyexit.partial_model import EarlyExitLM
    from exitplan.earlyexit.profile import complementarity, first_confident_exit, profile_metrics, trace_exits

    section = params.exit_profile
    started = time.perf_counter()
    traces, tokenizers, labels = {}, {}, {}
    for name in section.models:
        checkpoint = params.checkpoint_path(name)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        tokenizers[name] = (checkpoint / "tokenizer.json").read_bytes()
        chunks, labels[name] = _held_out_chunks(params, tokenizer)
        model = EarlyExitLM.from_pretrained(checkpoint)
        exits = load_heads(model, params.path(params.train_exits.output_dir) / name, section.head_kind)
        traces[name] = trace_exits(model, chunks, exits, section.confidence)
        del model
    rows, per_token = [], []
    for name, trace in traces.items():
        for t in section.thresholds:
            for dataset in ["all", *section.datasets]:
                keep = np.ones(len(trace), bool) if dataset == "all" else labels[name] == dataset
                sub = type(trace)(trace.exit_layers, trace.num_layers, trace.confidence[:, keep], trace.top1[:, keep],
                                  trace.final_top1[keep])
                rows.append({"model": name, "threshold": t, "dataset": dataset, "num_layers": trace.num_layers,
                             **profile_metrics(sub, t, section.early_depth)})
            per_token.append(pd.DataFrame({"model": name, "dataset": labels[name], "threshold": t,
                                           "first_exit": first_confident_exit(trace, t)}))
    pairs = {}
    names = list(traces)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if tokenizers[a] == tokenizers[b]:
                pairs[f"{a} + {b}"] = {str(t): complementarity(traces[a], traces[b], t, section.early_depth)
                                       for t in section.thresholds}
    out_dir = params.path(section.output_dir)
    write_parquet(out_dir / "profile.parquet", pd.concat(per_token, ignore_index=True))
    reports = params.path("reports") / STAGE
    table = pd.DataFrame([{k: v for k, v in r.items() if k != "first_exit_distribution"} for r in rows])
    write_atomic(reports / "table.csv", lambda tmp: table.to_csv(tmp, index=False))
    plot = plot_distribution(rows, section.thresholds[len(section.thresholds) // 2], reports / "first_exit.png")
    summary = {"head_kind": section.head_kind, "early_depth": section.early_depth, "profiles": rows,
               "complementarity": pairs, "seconds": time.perf_counter() - started}
    report = write_json(reports / "metrics.json", summary)
    flat = {f"{r['model']}:{r['threshold']}:{r['dataset']}.{k}": v for r in rows for k, v in r.items()
            if k in ("earliest_share", "early_share", "low_conf_agreement", "exited_agreement")}
    flat.update({f"complementarity:{p}:{t}.{k}": v for p, by_t in pairs.items() for t, c in by_t.items()
                 for k, v in c.items()})
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), flat, [report, plot])
    return summary
