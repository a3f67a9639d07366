"""Stage ``select_candidates``: HELIOS step 1, the Top-K candidates for the SLO on this device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exitplan.artifacts import exit_profile_path
from exitplan.atomic import write_json
from exitplan.config import Params
from exitplan.errors import ExitplanError
from exitplan.tracking import log_stage_run

if TYPE_CHECKING:
    from exitplan.profiling.candidates import Selection

STAGE = "select_candidates"


def main(params: Params) -> Selection:
    """Rank ``helios.candidates``; keep the Top-K that meet the SLO.

    Raises:
        ExitplanError: if no candidate fits the memory budget and meets the SLO (the best figures are named).
    """
    import numpy as np
    import pandas as pd

    from exitplan.earlyexit.checkpoint import read_index
    from exitplan.profiling.candidates import Selection, rank, write_selection
    from exitplan.stages.profile_device import catalog_model, load_device

    h, section = params.helios, params.select_candidates
    fitted = load_device(params)
    device, step, seq = fitted.gpu, fitted.step_overhead_s, fitted.seq_overhead_s
    profile = pd.read_parquet(exit_profile_path(params))
    mine = profile[(profile["kind"] == h.head_kind) & (profile["threshold"] == h.threshold)]
    trace = pd.read_parquet(params.path(params.prepare_workload.output_dir) / f"trace_{section.lengths_trace}.parquet")
    mean_tokens = float((trace["prompt_len"] + trace["output_len"]).mean())
    models, first, exits = {}, {}, {}
    for name in h.candidates:
        models[name] = catalog_model(params, name)
        first[name] = mine[mine["model"] == name]["first_exit"].to_numpy()
        exits[name] = list(read_index(params.path(params.train_exits.output_dir) / name).exit_layers)
        if len(first[name]) == 0:
            raise ExitplanError(f"the exit profile has no {h.head_kind} tokens of {name} at threshold {h.threshold}")
    ranked = rank(models, first, exits, device, step, seq, h.memory_budget_gib * 2**30, mean_tokens,
                  h.cbc_max / h.cbc_window, section.slo_tpot_ms, h.max_num_seqs)
    chosen = [r for r in ranked if r.meets_slo][: section.top_k]
    if not chosen:
        best = ranked[0]
        raise ExitplanError(f"no candidate meets the SLO of {section.slo_tpot_ms} ms per token within "
                            f"{h.memory_budget_gib} GiB: best is {best.model} at {best.tpot_ms:.0f} ms "
                            f"(batch {best.batch})")
    result = Selection(device=device.id, mean_tokens=mean_tokens, slo_tpot_ms=section.slo_tpot_ms,
                       candidates=[r.model for r in chosen], ranked=ranked)
    write_selection(params.path(section.output), result)
    report = write_json(params.path("reports") / STAGE / "metrics.json",
                        {"selected": len(chosen), **{f"{r.model}.{k}": v for r in ranked
                                                     for k, v in r.as_dict().items()
                                                     if isinstance(v, (int, float)) and np.isfinite(v)}})
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(),
                  {"selected": len(chosen), **{f"{r.model}.tpot_ms": r.tpot_ms for r in chosen}}, [report])
    return result
