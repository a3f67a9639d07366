"""Stage ``import_labels``: per-query labels, prompts and real answer lengths of models that cannot run here.

Reads AlpacaEval annotation files (``import_labels.source_dir``): a GPT-4 judge's preferences between each Llama-2
*chat* model's answer and text-davinci-003's on the same 805 instructions (CC BY-NC 4.0, Li et al., 2023). They
label the catalog's ``meta-llama/Llama-2-{7b,13b,70b}-hf`` entries, which describe those architectures: the labels
are a judge's preferences on the chat fine-tunes, not a quality measured here. Token counts use the
``prepare_workload`` tokenizer (Qwen2.5's) as a proxy, since no Llama tokenizer is available offline; its
characters per token on these texts are reported. Every output is written only after every file has been read and
checked (each against its SHA-256 pin in params), so a malformed or changed file leaves the previous outputs as
they were. When the folder is absent the stage writes
empty tables and says so in one line; the scenarios that need the labels are then skipped.
"""

from __future__ import annotations

from typing import Any

from exitplan.artifacts import LABELS_FILE, LENGTHS_FILE, QUERIES_FILE, imported_path
from exitplan.atomic import write_json, write_parquet
from exitplan.catalog import load_catalog
from exitplan.config import Params
from exitplan.routing.alpaca_eval import Imported, LabelsMissing, import_annotations
from exitplan.stages.prepare_workload import load_tokenizer
from exitplan.tracking import log_stage_run
from exitplan.workload.trace import count_tokens

STAGE = "import_labels"
LENGTH_COLUMNS = ["model", "dataset", "query_id", "prompt_len", "output_len", "answer_chars"]


def _empty() -> Imported:
    import pandas as pd

    return Imported(pd.DataFrame(columns=["model", "dataset", "query_id", "metric", "quality", "reference_score"]),
                    pd.DataFrame(columns=["dataset", "query_id", "subset", "prompt", "reference", "prompt_len",
                                          "output_len"]),
                    pd.DataFrame(columns=["model", "dataset", "query_id", "answer"]))


def with_lengths(params: Params, imported: Imported) -> tuple[Any, Any, dict[str, float]]:
    """Token counts (the proxy tokenizer) of the prompts, references and answers.

    Returns:
        ``(queries with prompt_len and output_len, per-model lengths, characters per token)``.
    """
    tokenizer = load_tokenizer(params)
    queries = imported.queries.copy()
    queries["prompt_len"] = count_tokens(tokenizer, queries["prompt"].tolist())
    queries["output_len"] = count_tokens(tokenizer, queries["reference"].tolist())
    answers = imported.answers.merge(queries[["query_id", "prompt_len"]], on="query_id")
    answers["output_len"] = count_tokens(tokenizer, answers["answer"].tolist())
    answers["answer_chars"] = answers["answer"].str.len()
    prompt_chars = queries["prompt"].str.len().sum()
    ratios = {"prompts": float(prompt_chars / max(queries["prompt_len"].sum(), 1)),
              "answers": float(answers["answer_chars"].sum() / max(answers["output_len"].sum(), 1))}
    return queries, answers[LENGTH_COLUMNS], ratios


def summary(params: Params, imported: Imported, lengths: Any, ratios: dict[str, float]) -> dict[str, Any]:
    """Metrics: per model its labelled rows, mean label, left-out and draw counts, answer lengths; the proxy."""
    per_model = {}
    for model, rows in imported.labels.groupby("model"):
        own = lengths[lengths["model"] == model]["output_len"]
        per_model[model] = {"rows": int(len(rows)), "mean_quality": float(rows["quality"].mean()),
                            "no_verdict": imported.no_verdict[model], "draws": imported.draws[model],
                            "duplicates": imported.duplicates[model],
                            "output_len_median": float(own.median()), "output_len_p95": float(own.quantile(0.95))}
    return {"skipped": None, "models": per_model, "queries": int(len(imported.queries)),
            "tokenizer_proxy": params.prepare_workload.tokenizer_model, "chars_per_token": ratios}


def main(params: Params) -> dict[str, Any]:
    """Import the annotation files; write labels, queries, lengths and ``reports/import_labels/metrics.json``."""
    section = params.import_labels
    catalog = load_catalog(params.path(params.catalog))
    for model in section.files:
        catalog.model(model)  # a model the catalog does not hold is a named error before anything is read
    skipped: str | None
    try:
        imported = import_annotations(params.path(section.source_dir).resolve(),
                                      {m: f.name for m, f in section.files.items()},
                                      {m: f.sha256 for m, f in section.files.items()})
    except LabelsMissing as exc:
        imported, skipped = _empty(), str(exc)
        queries, lengths, metrics = imported.queries, imported.answers.reindex(columns=LENGTH_COLUMNS), {}
    else:
        skipped = None
        queries, lengths, ratios = with_lengths(params, imported)
        metrics = summary(params, imported, lengths, ratios)
    metrics["skipped"] = skipped
    write_parquet(imported_path(params, LABELS_FILE), imported.labels)
    write_parquet(imported_path(params, QUERIES_FILE), queries)
    write_parquet(imported_path(params, LENGTHS_FILE), lengths)
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), metrics, [report])
    return metrics
