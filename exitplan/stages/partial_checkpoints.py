"""Stage ``partial_checkpoints``: the truncated checkpoints that partial (early-exit) vLLM replicas serve.

Every partial replica of the plans (a group holding fewer layers than its model, in ``plan.output_dir/*/plan.json``)
whose model is fetched here, and every entry of ``partial_checkpoints.cuts``, is written by
:func:`exitplan.vllm.truncate.truncate` (the first L layers, the final norm and the head, ``num_hidden_layers = L``,
in ``vllm.dtype``) to ``<output_dir>/<hf id>-L<layers>/``. ``exitplan deploy`` serves them: a local vLLM replica of
a partial group loads its cut, and the GPU bundle carries it under ``models/``.
"""

from __future__ import annotations

import time
from typing import Any

from exitplan.artifacts import plan_path
from exitplan.atomic import write_json
from exitplan.config import Params
from exitplan.tracking import log_stage_run

STAGE = "partial_checkpoints"


def wanted(params: Params) -> tuple[list[tuple[str, int]], list[str]]:
    """The cuts to write (the plans' partial replicas, then ``cuts``) and the plans' models not fetched here."""
    from exitplan.catalog import load_catalog
    from exitplan.planner.plan_file import read_plan
    from exitplan.vllm.truncate import plan_cuts

    catalog = load_catalog(params.path(params.catalog))
    cuts: list[tuple[str, int]] = []
    for scenario in params.plan.scenarios:
        path = plan_path(params, scenario.name)
        if path.is_file():
            cuts += plan_cuts(read_plan(path), lambda m: catalog.llm(m).num_layers)
    cuts += [(c.model, c.layers) for c in params.partial_checkpoints.cuts]
    unique = list(dict.fromkeys(cuts))
    here = [c for c in unique if (params.checkpoint_path(c[0]) / "config.json").is_file()]
    return here, sorted({m for m, _ in unique} - {m for m, _ in here})


def main(params: Params) -> dict[str, Any]:
    """Write every wanted cut; report what was written and which models were not here to cut."""
    from exitplan.checkpoints import checkpoint_bytes
    from exitplan.deploy import partial_path
    from exitplan.vllm.truncate import partial_name, truncate

    section = params.partial_checkpoints
    began = time.perf_counter()
    cuts, absent = wanted(params)
    params.path(section.output_dir).mkdir(parents=True, exist_ok=True)
    written = {}
    for model, layers in cuts:
        folder = truncate(params.checkpoint_path(model), partial_path(params, model, layers), layers,
                          params.vllm.dtype)
        written[partial_name(model, layers)] = checkpoint_bytes(folder)
    metrics: dict[str, Any] = {"cuts": len(written), "bytes": written, "not_fetched": absent}
    report = write_json(params.path("reports") / STAGE / "metrics.json", metrics)
    seconds = time.perf_counter() - began
    log_stage_run(STAGE, params.tracking, params.root, section.model_dump(), {"cuts": len(written)}, [report],
                  wall_s={"seconds": seconds})
    return {**metrics, "seconds": seconds}
