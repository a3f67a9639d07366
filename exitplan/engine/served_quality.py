"""The served-quality gate: the plan's models under HELIOS against themselves at full depth.

For every deployed plan model that runs here, the HELIOS engine serves held-out prompts at the exit depth its PHT
chooses (the breach counter acting as in production) and the same engine at full depth serves them again. Both
output sets are scored by the full largest plan model (perplexity) and compared token by token (ROUGE-2). Where
``label_quality`` measured GSM8K exact match for the model, the HELIOS engine answers those questions too.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from exitplan.artifacts import labels_path, queries_path
from exitplan.config import Params
from exitplan.engine.engine import Engine
from exitplan.engine.factory import candidates, engine_config, requests, stop_ids
from exitplan.engine.request import Request
from exitplan.engine.telemetry import request_rows
from exitplan.profiling.pht import PerformanceHistoryTable
from exitplan.quality import chat_prompts, held_out_texts, load_scorer, perplexity, rouge2


@dataclass
class Served:
    """One engine's answers to the held-out prompts."""

    requests: list[Request]
    exit_layer: int
    telemetry: list[dict[str, Any]]


def _serve(params: Params, model: str, prompts: list[list[int]], limit: int, stop: frozenset[int], mode: str,
           prefix: str) -> Served:
    pht = PerformanceHistoryTable(params.path(params.helios.pht_path))
    pht.path = None  # read, never written: the PHT is online_profile's output
    budget = int(params.gates.memory_budget_gib * 2**30)
    engine = Engine(candidates(params, [model]), engine_config(params, mode=mode, memory_budget_bytes=budget), pht)
    done = engine.run(requests(prompts, limit, stop, prefix))
    served = Served(done, engine.served.exit_layer, request_rows(done))
    del engine
    gc.collect()
    return served


def _gsm8k(params: Params, model: str, tokenizer: Any, stop: frozenset[int]) -> tuple[float, float]:
    """Exact match of HELIOS's answers and of the full-depth labels, on the labelled GSM8K questions."""
    from exitplan.routing.labels import exact_match, prompt_ids

    labels = pd.read_parquet(labels_path(params))
    mine = labels[(labels["model"] == model) & (labels["metric"] == "exact_match")].head(params.gates.gsm8k_queries)
    if mine.empty or params.gates.gsm8k_queries == 0:
        return float("nan"), float("nan")
    queries = pd.read_parquet(queries_path(params))
    gsm = queries[queries["dataset"] == "gsm8k"].set_index("query_id").loc[mine["query_id"]]
    prompts = [prompt_ids(tokenizer, p, params.label_quality.max_prompt_tokens) for p in gsm["prompt"]]
    served = _serve(params, model, prompts, params.gates.gsm8k_max_new_tokens, stop, "helios", "gsm8k-")
    answers = [tokenizer.decode(r.output, skip_special_tokens=True) for r in served.requests]
    helios = float(np.mean([exact_match(a, ref) for a, ref in zip(answers, gsm["reference"], strict=True)]))
    return helios, float(mine["quality"].mean())


def runnable(params: Params, models: list[str]) -> list[str]:
    """The models that have a fetched checkpoint here."""
    return [m for m in models if (params.checkpoint_path(m) / "config.json").is_file()]


def measure(params: Params, models: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Serve, score and compare each model; returns one row per model and the HELIOS runs' telemetry.

    Args:
        params: The params tree.
        models: Deployed plan models, smallest first (the last runnable one scores perplexity).
    """
    from transformers import AutoTokenizer

    here = runnable(params, models)
    gates = params.gates
    queries = queries_path(params)
    texts = held_out_texts(queries, params.train_exits.datasets, params.train_exits.seed, gates.requests,
                           skip=params.online_profile.requests)
    rows: list[dict[str, Any]] = []
    telemetry: list[dict[str, Any]] = []
    outputs: dict[str, tuple[Served, Served]] = {}
    for model in here:
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(params.checkpoint_path(model)))
        stop, prompts = stop_ids(tokenizer), chat_prompts(tokenizer, texts, gates.max_prompt_tokens)
        mode = "helios" if model in params.helios.candidates else "full"
        helios = _serve(params, model, prompts, gates.max_new_tokens, stop, mode, "gate-")
        full = _serve(params, model, prompts, gates.max_new_tokens, stop, "full", "full-")
        em_helios, em_full = _gsm8k(params, model, tokenizer, stop) if mode == "helios" else (np.nan, np.nan)
        outputs[model] = (helios, full)
        telemetry += helios.telemetry
        tokens = sum(len(r.output) for r in helios.requests)
        rows.append({"model": model, "mode": mode, "exit_layer": helios.exit_layer,
                     "breach_rate": sum(r.breaches for r in helios.requests) / max(tokens, 1),
                     "rouge2_vs_full": rouge2([r.output for r in helios.requests], [r.output for r in full.requests]),
                     "em_helios": em_helios, "em_full": em_full, "em_drop": em_full - em_helios,
                     "serve_seconds": time.perf_counter() - started})
    scorer = load_scorer(params.checkpoint_path(here[-1]))
    for row in rows:
        helios, full = outputs[row["model"]]
        row["ppl_helios"] = perplexity(scorer, [(r.prompt, r.output) for r in helios.requests])
        row["ppl_full"] = perplexity(scorer, [(r.prompt, r.output) for r in full.requests])
        row["ppl_increase_rel"] = row["ppl_helios"] / row["ppl_full"] - 1
        row["scorer"] = here[-1]
    return pd.DataFrame(rows), pd.DataFrame(telemetry)
