"""Stage ``online_profile``: HELIOS's online profiling of the candidates into the Performance History Table.

The engine profiles every candidate on the first requests of a sample (answered, not thrown away) and picks the best
candidate and exit depth. Then each candidate alone serves the sample from the finished PHT, as a fleet's engine
server does: those passes are the per-model *reference telemetry* that ``reprofile_fleet`` compares live traffic
with. The sample is the telemetry snapshot's
requests when ``reprofile_fleet`` wrote one on drift (so the PHT follows the traffic), else held-out workload
prompts (the embedded default).

Run by DVC: ``exitplan stage online-profile``.
"""

from __future__ import annotations

import gc
from typing import Any

import pandas as pd

from exitplan.artifacts import queries_path
from exitplan.atomic import write_json, write_parquet
from exitplan.config import Params
from exitplan.engine.engine import Engine
from exitplan.engine.factory import candidates, engine_config, requests, stop_ids
from exitplan.engine.telemetry import request_rows
from exitplan.profiling.pht import PerformanceHistoryTable
from exitplan.quality import chat_prompts, held_out_texts
from exitplan.tracking import log_stage_run

REPORT_DIR = "reports/online_profile"


def sample(params: Params, tokenizer: Any) -> tuple[str, list[list[int]], list[int]]:
    """The requests to profile on: ``(source, prompts, generation limits)``."""
    section, snapshot = params.online_profile, params.path(params.reprofile.snapshot)
    if snapshot.is_file():
        frame = pd.read_parquet(snapshot, columns=["prompt", "max_new_tokens"]).tail(section.requests)
        return str(snapshot), [list(map(int, p)) for p in frame["prompt"]], frame["max_new_tokens"].tolist()
    queries = queries_path(params)
    texts = held_out_texts(queries, params.train_exits.datasets, params.train_exits.seed, section.requests)
    prompts = chat_prompts(tokenizer, texts, section.max_prompt_tokens)
    return "held-out prompts", prompts, [section.max_new_tokens] * len(prompts)


def profile(params: Params) -> dict[str, Any]:
    """Profile the candidates on the sample; write the PHT and the reference telemetry; return the metrics."""
    from transformers import AutoTokenizer

    cands = candidates(params, params.helios.candidates)
    tokenizer = AutoTokenizer.from_pretrained(str(cands[0].checkpoint))
    source, prompts, limits = sample(params, tokenizer)
    stop = stop_ids(tokenizer)
    pht = PerformanceHistoryTable()  # profiled afresh: the traffic may have changed
    engine = Engine(cands, engine_config(params), pht)
    engine.run(requests(prompts, limits, stop, "profile-"))
    chosen, depth, telemetry = engine.served.name, engine.served.exit_layer, engine.telemetry
    del engine
    gc.collect()
    pht.path = params.path(params.helios.pht_path)
    pht.save()
    served, depths = [], {}
    for i, candidate in enumerate(cands):  # each alone, as an engine server of the fleet serves it
        reader = PerformanceHistoryTable(pht.path)
        reader.path = None  # read only
        alone = Engine([candidate], engine_config(params), reader)
        served += alone.run(requests(prompts, limits, stop, f"serve{i}-"))
        depths[candidate.name] = alone.served.exit_layer
        del alone
        gc.collect()
    write_parquet(params.path(params.online_profile.reference_telemetry), pd.DataFrame(request_rows(served)))
    return {"source": source, "requests": len(prompts), "served_model": chosen, "served_exit_layer": depth,
            "exit_layer_alone": depths, "loads": telemetry.count("load"), "switches": telemetry.count("switch"),
            "breach_rate": sum(r.breaches for r in served) / max(sum(len(r.output) for r in served), 1),
            "candidates": {m: {"perplexity": e.perplexity, "throughput_tok_s": e.throughput_tok_s,
                               "exit_distribution": {str(k): v for k, v in e.exit_distribution.items()}}
                           for m, e in pht.entries.items()}}


def main(params: Params) -> dict[str, Any]:
    """Run the stage: profile, then record the metrics (``reports/online_profile/metrics.json``) and the run."""
    metrics = profile(params)
    report = params.path(REPORT_DIR) / "metrics.json"
    write_json(report, metrics)
    log_stage_run("online_profile", params.tracking, params.root,
                  {"helios": params.helios.model_dump(), "online_profile": params.online_profile.model_dump()},
                  metrics, [report])
    return metrics

