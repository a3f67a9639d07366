"""The coordinator's CPU per relayed token and per routed prompt, read from the real coordinator process in front of
real vLLM replicas; the fleet file it is started with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exitplan.config import Params, load_params
from exitplan.errors import ExitplanError
from exitplan.files import read_json
from exitplan.routing.router_file import load_router
from exitplan.vllm.coordinator_cost import fleet_file, measure_coordinator_cost
from tests.conftest import LARGE_VLLM, REPO_ROOT, SMALL_VLLM

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _params(tmp_path: Path, embedder: Path, base: Params | None = None) -> Params:
    """Params whose checkpoints folder (under ``tmp_path``) holds the embedder."""
    base = base or load_params(REPO_ROOT / "params.yaml")
    linked = tmp_path / "checkpoints" / MINILM
    linked.parent.mkdir(parents=True)
    linked.symlink_to(embedder, target_is_directory=True)
    fetch = base.fetch_models.model_copy(update={"checkpoint_dir": str(tmp_path / "checkpoints")})
    plan = base.plan.model_copy(update={"embedder": MINILM})
    return base.model_copy(update={"fetch_models": fetch, "plan": plan})


def test_the_fleet_file_routes_over_every_model_with_a_zero_weight_router(tmp_path: Path, checkpoint_of) -> None:
    params = _params(tmp_path, checkpoint_of(MINILM))
    replicas = [("http://a:1", "small"), ("http://b:2", "large"), ("http://c:3", "large")]
    fleet = read_json(fleet_file(params, replicas, tmp_path), "fleet")
    assert fleet["models"] == ["small", "large"] and len(fleet["replicas"]) == 3
    routing = load_router(Path(fleet["router"]).read_bytes(), "router")
    assert routing.models == ["small", "large"]
    assert routing.scorer.coef.shape == (2, 384) and not np.any(routing.scorer.coef)  # MiniLM's width


def test_the_cost_needs_two_models_and_prompts(tmp_path: Path) -> None:
    params = load_params(REPO_ROOT / "params.yaml")
    with pytest.raises(ExitplanError, match="two models"):
        measure_coordinator_cost(params, [("http://a:1", "m"), ("http://b:2", "m")], ["hi"], 8, tmp_path)
    with pytest.raises(ExitplanError, match="prompts"):
        measure_coordinator_cost(params, [("http://a:1", "m"), ("http://b:2", "n")], [], 8, tmp_path)


@pytest.mark.vllm
@pytest.mark.integration
def test_the_real_coordinator_costs_under_a_millisecond_a_token_and_an_embedder_pass_a_prompt(
        vllm_replicas, tmp_path: Path, checkpoint_of) -> None:
    params = _params(tmp_path, checkpoint_of(MINILM), vllm_replicas["params"])
    replicas = [(vllm_replicas["small"], SMALL_VLLM), (vllm_replicas["large"][0], LARGE_VLLM)]
    prompts = [f"Question {k}: " + "explain the tides and the moon " * (4 * k + 1) for k in range(6)]
    cost = measure_coordinator_cost(params, replicas, prompts, 16, tmp_path / "work")
    # relaying a server-sent event is a few hundred microseconds of Python; a score is a MiniLM pass (tens of ms)
    assert 1e-5 < cost.relay_cpu_s < 5e-3
    assert 1e-3 < cost.score_cpu_s < 1.0
    assert cost.score_cpu_s > 5 * cost.relay_cpu_s
