"""Stage ``label_quality``: per-query quality labels of each candidate, measured by running it."""

from __future__ import annotations

import time
from typing import Any

from exitplan.artifacts import labels_path, queries_path
from exitplan.atomic import write_json, write_parquet
from exitplan.config import Params
from exitplan.cpu_features import torch_dtype
from exitplan.tracking import log_stage_run

STAGE = "label_quality"


def sample_queries(params: Params) -> Any:
    """The seeded sample of queries to label: ``queries_per_dataset`` of each data set."""
    import pandas as pd

    section = params.label_quality
    table = pd.read_parquet(queries_path(params))
    parts = []
    for dataset in section.datasets:
        mine = table[table["dataset"] == dataset]
        parts.append(mine.sample(n=min(section.queries_per_dataset, len(mine)), random_state=section.seed))
    return pd.concat(parts, ignore_index=True)


def label_model(params: Params, name: str, queries: Any, layers: int | None = None) -> Any:
    """Reference scores of every query, and exact match of generated answers on the first GSM8K ones; the model
    cut to ``layers`` (its own head at the cut) when given. A ``layers`` column holds the depth labelled."""
    import tempfile
    from pathlib import Path

    from exitplan.vllm.truncate import read_layers, truncate

    checkpoint = params.fetched(name)
    full = read_layers(checkpoint)
    if layers is None or layers >= full:
        return _label(params, name, checkpoint, queries).assign(layers=full)
    with tempfile.TemporaryDirectory() as tmp:
        cut = truncate(checkpoint, Path(tmp) / "cut", layers, params.label_quality.dtype)
        return _label(params, name, cut, queries).assign(layers=layers)


def _label(params: Params, name: str, checkpoint: Any, queries: Any) -> Any:
    """The labels of the checkpoint at ``checkpoint`` (see :func:`label_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exitplan.routing.labels import exact_match, generate, reference_scores

    section = params.label_quality
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch_dtype(section.dtype)).eval()
    frame = queries[["dataset", "query_id"]].copy()
    frame["model"] = name
    frame["reference_score"] = reference_scores(model, tokenizer, queries["prompt"].tolist(),
                                                queries["reference"].tolist(), section.max_prompt_tokens,
                                                section.max_reference_tokens)
    frame["metric"], frame["quality"] = "reference_score", frame["reference_score"]
    gsm = queries.index[queries["dataset"] == "gsm8k"][: section.gsm8k_generate]
    if len(gsm):
        answers = generate(model, tokenizer, queries.loc[gsm, "prompt"].tolist(), section.max_new_tokens,
                           section.batch_size, section.max_prompt_tokens)
        frame.loc[gsm, "quality"] = [exact_match(a, r) for a, r in zip(answers, queries.loc[gsm, "reference"],
                                                                        strict=True)]
        frame.loc[gsm, "metric"] = "exact_match"
    return frame


def main(params: Params) -> dict[str, Any]:
    """Label every model of ``label_quality.models`` (plus the user's CSV); write the labels and metrics."""
    import pandas as pd

    from exitplan.routing.labels import below_full_depth, read_user_labels

    section = params.label_quality
    started = time.perf_counter()
    queries = sample_queries(params)
    frames = [label_model(params, name, queries) for name in section.models]
    frames += [label_model(params, name, queries, layers) for name, depths in section.depths.items()
               for layers in depths if name in section.models]
    if section.user_labels:
        frames.append(read_user_labels(params.path(section.user_labels)))
    labels = pd.concat(frames, ignore_index=True)
    labels["query_id"] = labels["query_id"].astype(str)
    write_parquet(labels_path(params), labels)
    cut = below_full_depth(labels)  # a user's labels (no depth): whole
    summary = labels.assign(at=labels["model"].where(~cut, labels["model"] + "@" + labels["layers"].astype("Int64")
                                                     .astype(str))).groupby(["at", "metric"])["quality"].mean()
    metrics = {f"{m}.{metric}": float(v) for (m, metric), v in summary.items()}
    metrics["queries"] = len(queries)
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    seconds = time.perf_counter() - started
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), metrics, [report],
                  wall_s={"seconds": seconds})
    return {**metrics, "seconds": seconds}
