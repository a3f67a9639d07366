"""Stage ``exit_profile``: first confident exits of each model on held-out prompts, and HELIOS's observations."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from exitplan.artifacts import exit_curves_path, exit_profile_path, queries_path
from exitplan.atomic import write_atomic, write_json, write_parquet
from exitplan.config import Params
from exitplan.cpu_features import torch_dtype
from exitplan.tracking import log_stage_run

STAGE = "exit_profile"


def _held_out_chunks(params: Params, tokenizer: Any) -> tuple[Any, np.ndarray]:
    """Token chunks per data set from the queries ``train_exits`` held out, and the data set of each token."""
    import torch

    from exitplan.earlyexit.training import tokenize_chunks
    from exitplan.workload.split import split_queries

    section = params.exit_profile
    _, held_out = split_queries(queries_path(params),
                                params.train_exits.datasets, params.train_exits.seed)
    chunks, labels = [], []
    for dataset in section.datasets:
        texts = held_out[held_out["dataset"] == dataset]["text"].tolist()
        part = tokenize_chunks(tokenizer, texts, section.chunk_tokens, section.chunks_per_dataset)
        chunks.append(part)
        labels.extend([dataset] * part.numel())
    return torch.cat(chunks), np.asarray(labels)


def plot_distribution(rows: list[dict[str, Any]], threshold: float, path: Path) -> Path:
    """Bar charts of the first confident exit (share of tokens per exit depth), a panel per head kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [r for r in rows if r["threshold"] == threshold and r["dataset"] == "all" and r["kind"] == kind]
        for i, row in enumerate(mine):
            layers = sorted(row["first_exit_distribution"])
            depth = np.asarray(layers) / row["num_layers"]
            ax.bar(depth + (i - len(mine) / 2) * 0.02, [row["first_exit_distribution"][k] for k in layers],
                   width=0.02, label=row["model"].split("/")[-1])
        ax.set(xlabel="first confident exit (share of layers; 1.0 = none)", title=f"{kind} heads")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"share of tokens (confidence >= {threshold})")
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def plot_agreement(curves: list[dict[str, Any]], threshold: float, path: Path) -> Path:
    """Agreement with the final layer vs depth on all held-out tokens, a panel per model and a line per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in curves))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models, strict=True):
        for kind in dict.fromkeys(r["kind"] for r in curves):
            mine = [r for r in curves if r["model"] == model and r["kind"] == kind and r["dataset"] == "all"]
            line = ax.plot([r["depth"] for r in mine], [r["agreement"] for r in mine], marker="o", label=kind)
            ax.plot([r["depth"] for r in mine], [r[f"confident_agreement@{threshold}"] for r in mine],
                    linestyle="--", color=line[0].get_color(), label=f"{kind}, confidence >= {threshold}")
        ax.axhline(0.85, color="grey", linewidth=0.8)
        ax.set(xlabel="exit depth (share of layers)", ylim=(0, 1), title=model.split("/")[-1])
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("top-1 agreement with the final layer")
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return path


def trace_models(params: Params) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray], dict[str, bytes]]:
    """Per model: the held-out record of every head kind (one forward pass), each token's data set, its tokenizer."""
    from transformers import AutoTokenizer

    from exitplan.earlyexit.checkpoint import read_heads
    from exitplan.earlyexit.partial_model import EarlyExitLM
    from exitplan.earlyexit.profile import trace_kinds

    section = params.exit_profile
    traces, labels, tokenizers = {}, {}, {}
    for name in section.models:
        checkpoint = params.fetched(name)
        tokenizers[name] = (checkpoint / "tokenizer.json").read_bytes()
        chunks, labels[name] = _held_out_chunks(params, AutoTokenizer.from_pretrained(str(checkpoint)))
        # as the engine runs it
        model = EarlyExitLM.for_inference(checkpoint, dtype=torch_dtype(params.helios.dtype))
        model.pack_vocab()
        heads: dict[str, dict[int, Any]] = {}
        for kind in section.head_kinds:
            exit_layers, heads[kind] = read_heads(model, params.path(params.train_exits.output_dir) / name, kind)
        traces[name] = trace_kinds(model, chunks, exit_layers, heads, params.helios.confidence)
        del model, heads
    return traces, labels, tokenizers


def observe(params: Params, traces: dict[str, dict[str, Any]], labels: dict[str, np.ndarray],
            tokenizers: dict[str, bytes]) -> dict[str, list[dict[str, Any]]]:
    """Every observation per model, head kind and data set ("all" too): HELIOS's observations per threshold
    (``observations``), the agreement/perplexity curve per exit (``curves``), and the complementarity of each pair
    of models sharing a tokenizer (``complementarity``)."""
    from exitplan.earlyexit.profile import complementarity, depth_reaching, exit_curve, profile_metrics

    section = params.exit_profile
    out: dict[str, list[dict[str, Any]]] = {"observations": [], "curves": [], "complementarity": [], "depth85": []}
    for name, by_kind in traces.items():
        for kind, trace in by_kind.items():
            for dataset in ["all", *section.datasets]:
                sub = trace.subset(np.ones(len(trace), bool) if dataset == "all" else labels[name] == dataset)
                key = {"model": name, "kind": kind, "dataset": dataset}
                curve = exit_curve(sub, section.thresholds)
                out["curves"].extend({**key, **row} for row in curve)
                out["depth85"].append({**key, "depth85": depth_reaching(curve, 0.85)})
                out["observations"].extend(
                    {**key, "threshold": t, "num_layers": trace.num_layers,
                     **profile_metrics(sub, t, section.early_depth)} for t in section.thresholds)
    names = list(traces)
    for i, a in enumerate(names):
        for b in (b for b in names[i + 1:] if tokenizers[a] == tokenizers[b]):
            for kind in section.head_kinds:
                for dataset in ["all", *section.datasets]:
                    keep = np.ones(len(labels[a]), bool) if dataset == "all" else labels[a] == dataset
                    out["complementarity"].extend(
                        {"small": a, "large": b, "kind": kind, "dataset": dataset, "threshold": t,
                         **complementarity(traces[a][kind].subset(keep), traces[b][kind].subset(keep), t,
                                           section.early_depth)} for t in section.thresholds)
    return out


def main(params: Params) -> dict[str, Any]:
    """Profile every model of ``exit_profile.models`` under every head kind; write the per-token profile, the
    tables (observations, curves, complementarity), plots and metrics."""
    import pandas as pd

    from exitplan.earlyexit.profile import first_confident_exit

    section = params.exit_profile
    started = time.perf_counter()
    traces, labels, tokenizers = trace_models(params)
    tables = observe(params, traces, labels, tokenizers)
    per_token = [pd.DataFrame({"model": name, "kind": kind, "dataset": labels[name], "threshold": t,
                               "first_exit": first_confident_exit(trace, t)})
                 for name, by_kind in traces.items() for kind, trace in by_kind.items() for t in section.thresholds]
    write_parquet(exit_profile_path(params), pd.concat(per_token, ignore_index=True))
    write_parquet(exit_curves_path(params), pd.DataFrame(tables["curves"]))
    reports = params.path("reports") / STAGE
    for table, rows in tables.items():
        frame = pd.DataFrame([{k: v for k, v in r.items() if k != "first_exit_distribution"} for r in rows])
        write_atomic(reports / f"{table}.csv", lambda tmp, frame=frame: frame.to_csv(tmp, index=False))  # type: ignore[misc]
    middle = section.thresholds[len(section.thresholds) // 2]
    plots = [plot_distribution(tables["observations"], middle, reports / "first_exit.png"),
             plot_agreement(tables["curves"], middle, reports / "agreement.png")]
    summary = {"head_kinds": section.head_kinds, "early_depth": section.early_depth, **tables}
    report = write_json(reports / "metrics.json", summary)
    flat = {f"{r['model']}:{r['kind']}:{r['threshold']}:{r['dataset']}.{k}": v for r in tables["observations"]
            for k, v in r.items() if k in ("earliest_share", "early_share", "low_conf_agreement", "exited_agreement")}
    flat.update({f"complementarity:{r['kind']}:{r['threshold']}:{r['dataset']}.{k}": r[k]
                 for r in tables["complementarity"] for k in ("small_alone", "large_alone", "together")})
    flat.update({f"depth85:{r['model']}:{r['kind']}:{r['dataset']}": r["depth85"] for r in tables["depth85"]})
    seconds = time.perf_counter() - started
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), flat, [report, *plots],
                  wall_s={"seconds": seconds})
    return {**summary, "seconds": seconds}
