"""Parameters of the stage tests: the repository's, with the workload under a temporary folder and a short model
length (so which queries the vLLM replicas can serve is easy to see)."""

from __future__ import annotations

import pytest

from exitplan import REPO_ROOT
from exitplan.config import Params, load_params


@pytest.fixture
def params(tmp_path) -> Params:
    base = load_params(REPO_ROOT / "params.yaml")
    return base.model_copy(update={
        "prepare_workload": base.prepare_workload.model_copy(update={"output_dir": str(tmp_path)}),
        "vllm": base.vllm.model_copy(update={"max_model_len": 1000}),
        "build_perf_db": base.build_perf_db.model_copy(update={"vllm_max_output_len": 64})})
