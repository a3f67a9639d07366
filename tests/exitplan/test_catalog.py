from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from exitplan import REPO_ROOT
from exitplan.catalog import Catalog, load_catalog
from exitplan.cli import app
from exitplan.errors import CatalogError

GPU_IDS = {"h100-sxm", "h200", "a100-80g", "l40s", "rtx-pro-6000", "rtx-5090", "rtx-4090"}


def test_catalog_has_the_gpus_and_models(catalog: Catalog) -> None:
    assert {g.id for g in catalog.gpus} >= GPU_IDS
    names = {m.name for m in catalog.models}
    for needed in ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf", "meta-llama/Meta-Llama-3-8B",
                   "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct",
                   "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                   "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert needed in names
    assert catalog.gpu("rtx-5090").price_per_hour == 0.89
    assert catalog.gpu("rtx-4090").max_tensor_parallel == 4
    assert catalog.gpu("h100-sxm").max_tensor_parallel == 8


@pytest.mark.parametrize(("name", "params_b"), [
    ("meta-llama/Llama-2-7b-hf", 6.74), ("meta-llama/Llama-2-13b-hf", 13.02), ("meta-llama/Llama-2-70b-hf", 68.98),
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03), ("meta-llama/Llama-3.1-70B-Instruct", 70.55),
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", 0.630), ("Qwen/Qwen2.5-Coder-1.5B-Instruct", 1.777),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", 0.1345),
])
def test_parameter_counts_match_published_sizes(catalog: Catalog, name: str, params_b: float) -> None:
    assert catalog.model(name).num_params() / 1e9 == pytest.approx(params_b, rel=2e-3)


def test_kv_and_weight_bytes_scale_with_held_layers(catalog: Catalog) -> None:
    llama = catalog.model("meta-llama/Llama-2-7b-hf")
    assert llama.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2  # 512 KiB per token, the well-known figure
    assert llama.kv_bytes_per_token(layers=8) == llama.kv_bytes_per_token() // 4
    partial, full = llama.weight_bytes(layers=16), llama.weight_bytes()
    embeddings = 2 * 32000 * 4096 * 2
    assert partial - embeddings == pytest.approx((full - embeddings) / 2, rel=1e-3)
    assert llama.flops_per_token(context_len=1000) > llama.flops_per_token(context_len=0)


def _catalog_tree() -> dict:
    return yaml.safe_load((REPO_ROOT / "model_repository" / "catalog.yaml").read_text())


def _load(tmp_path: Path, tree: dict) -> Catalog:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_catalog(path)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda t: t["gpus"][0].update(price_per_hour=-1.0), "gpus.0.price_per_hour: Input should be greater than 0"),
    (lambda t: t["gpus"][1]["link"].update(bandwidth_gbps=0), "gpus.1.link.bandwidth_gbps: Input should be greater"),
    (lambda t: t["gpus"].append(dict(t["gpus"][0])), "duplicate names ['h100-sxm']"),
    (lambda t: t["models"][0].update(num_attention_heads=30), "num_attention_heads (30) must divide hidden_size"),
    (lambda t: t["models"][3].update(num_kv_heads=5), "num_kv_heads (5) must divide num_attention_heads (32)"),
    (lambda t: t["models"][6]["source"]["parts"][0].update(sha256="xyz"), "models.6.source.parts.0.sha256"),
    (lambda t: t["gpus"][0].update(tflops=1.0), "gpus.0.tflops: unknown key"),
    (lambda t: t["gpus"][0].update(model_slowdowns={"m": -0.1}), "gpus.0.model_slowdowns.m: Input should be greater"),
    (lambda t: t["gpus"][0].update(model_slowdowns={"m": float("nan")}), "gpus.0.model_slowdowns.m"),
    (lambda t: t["gpus"][0].update(slowdown_grids={"m": {"batches": [4, 1], "values": [[0, 0], [0, 0]]}}),
     "batches must increase; got [4, 1]"),
    (lambda t: t["gpus"][0].update(slowdown_grids={"m": {"batches": [1, 4], "values": [[0.1, 0.2]]}}),
     "values must be 2 x 2"),
    (lambda t: t["gpus"][0].update(slowdown_grids={"m": {"batches": [1], "values": [[float("inf")]]}}),
     "gpus.0.slowdown_grids.m.values.0.0"),
])
def test_invalid_catalogs_are_rejected_with_the_key(tmp_path: Path, mutate, message: str) -> None:
    tree = _catalog_tree()
    mutate(tree)
    with pytest.raises(CatalogError) as err:
        _load(tmp_path, tree)
    assert message in str(err.value)


def test_unknown_gpu_and_model_lookups_name_the_known_ones(catalog: Catalog) -> None:
    with pytest.raises(CatalogError, match=r"unknown GPU 'v100'; known: \['a100-40g', 'a100-80g'"):
        catalog.gpu("v100")
    with pytest.raises(CatalogError, match="unknown model 'x/y'"):
        catalog.model("x/y")


def test_catalog_command_prints_every_gpu() -> None:
    result = CliRunner().invoke(app, ["catalog", "--params", str(REPO_ROOT / "params.yaml")])
    assert result.exit_code == 0, result.output
    for gpu_id in GPU_IDS:
        assert gpu_id in result.output
    assert "Llama-3.1-70B-Instruct" in result.output and "simulated" in result.output


def test_help_lists_the_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("check-config", "catalog", "stage"):
        assert command in result.output
