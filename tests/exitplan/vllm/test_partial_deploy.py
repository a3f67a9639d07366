"""A plan that cuts a model to an exit, deployed as ``exitplan deploy`` deploys locally: a partial vLLM replica from
the truncated checkpoint of the chosen depth, answering through the coordinator."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from plan_factory import plan_of

from exitplan import REPO_ROOT
from exitplan.config import load_params
from exitplan.deploy import partial_path, render, start_local
from exitplan.ports import free_port
from exitplan.routing.router_file import RoutingModel, dump_router
from exitplan.routing.scores import EmbeddingScorer
from exitplan.vllm.truncate import truncate
from tests.conftest import fetched_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LARGE = "meta-llama/Llama-2-7b-hf"


def test_a_partial_replica_deployed_locally_answers_through_the_coordinator(smollm2_checkpoint: Path,
                                                                           tmp_path: Path, catalog) -> None:
    base = load_params(REPO_ROOT / "params.yaml")
    fetched = tmp_path / "checkpoints"
    for name, source in ((SMOLLM2, smollm2_checkpoint), (base.plan.embedder,
                                                         fetched_checkpoint(catalog, base.plan.embedder))):
        (fetched / name).parent.mkdir(parents=True, exist_ok=True)
        (fetched / name).symlink_to(source)
    params = base.model_copy(update={
        "fetch_models": base.fetch_models.model_copy(update={"checkpoint_dir": str(fetched)}),
        "partial_checkpoints": base.partial_checkpoints.model_copy(update={"output_dir": str(tmp_path / "cuts")}),
        "vllm": base.vllm.model_copy(update={"kv_cache_gib": 1, "max_model_len": 1024}),
        "deploy": base.deploy.model_copy(update={"backend": "vllm", "base_port": free_port(),
                                                 "coordinator_port": free_port()})})
    cut = truncate(smollm2_checkpoint, partial_path(params, SMOLLM2, 15), 15, dtype="bfloat16")
    plan = plan_of([{"model": SMOLLM2, "fraction": 1.0, "full_layers": 30, "quality_source": "test",
                     "groups": [{"gpu": "rtx-4090", "dp": 1, "layers": 15}]},
                    {"model": LARGE, "fraction": 0.0, "deployed": False}])  # not here: its share is none
    # rendered for GPU hosts: the launch line serves the cut, shipped under models/
    launches = render(plan, catalog, params.simulator.engine, 9000)
    assert [r.layers for r in launches] == [15]
    assert any(a.startswith("models/") and a.endswith("L15") for a in launches[0].args)
    router = tmp_path / "router.json"
    router.write_bytes(dump_router(RoutingModel(base.plan.embedder, [SMOLLM2, LARGE], EmbeddingScorer.from_weights(
        np.zeros((2, 384)), np.zeros(2)), np.linspace(0, 1, 16))))
    fleet = start_local(params, plan, router, tmp_path / "deploy")
    try:
        replica = fleet.replica_urls[SMOLLM2][0]
        served = httpx.get(f"{replica}/v1/models", timeout=30).json()["data"][0]["root"]
        assert Path(served).resolve() == cut.resolve()  # the replica holds only the first 15 layers
        reply = httpx.post(f"{fleet.coordinator_url}/v1/completions",
                           json={"model": SMOLLM2, "prompt": "The capital of France is", "max_tokens": 4},
                           timeout=120)
        assert reply.status_code == 200 and reply.headers["x-exitplan-model"] == SMOLLM2
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        fleet.stop()
