"""exitplan.fleet: a fleet file's validation, the perf DB it reuses or simulates, its overrides and its budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from exitplan import REPO_ROOT
from exitplan.config import Params, load_params
from exitplan.errors import ConfigError, ExitplanError
from exitplan.fleet import (
    Quiet,
    check_budget,
    coverage,
    fleet_perf_db,
    load_fleet,
    load_grid,
    model_lengths,
    own_lengths,
    with_overrides,
)

EXAMPLE = REPO_ROOT / "docs" / "your-fleet"
SMALL, LARGE = "meta-llama/Llama-2-7b-hf", "your-org/Coder-34B-Instruct"


@pytest.fixture()
def params(tmp_path: Path) -> Params:
    """The repo's params, rooted in an empty folder (no perf DB, no lengths trace), sweeping in this process."""
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "model_repository").mkdir()
    shutil.copy(REPO_ROOT / "model_repository" / "catalog.yaml", tmp_path / "model_repository" / "catalog.yaml")
    loaded = load_params(tmp_path / "params.yaml")
    return loaded.model_copy(update={"dask": loaded.dask.model_copy(update={"workers": 1})})


@pytest.fixture()
def example(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLE, tmp_path / "fleet")
    return tmp_path / "fleet"


def test_the_example_loads_with_its_new_gpu_model_and_labels(example: Path, params: Params) -> None:
    fleet = load_fleet(example / "fleet.yaml", params)
    assert fleet.catalog.gpu("l4").price_per_hour == 0.71 and fleet.catalog.llm(LARGE).num_layers == 48
    assert fleet.catalog.has_gpu("h100-sxm")  # the repo catalog's entries stay
    assert set(fleet.labels["model"]) == {SMALL, LARGE} and len(fleet.labels) == 96
    assert own_lengths(fleet) == {SMALL, LARGE}
    prompts, outputs = model_lengths(fleet, None, [LARGE])[LARGE]
    assert len(prompts) == 48 and outputs.min() >= 1


def test_an_added_gpu_the_catalog_already_holds_is_refused_by_name(example: Path, params: Params) -> None:
    text = (example / "fleet.yaml").read_text().replace("- id: l4\n", "- id: h100-sxm\n")
    (example / "clash.yaml").write_text(text.replace("l4: 16", "h100-sxm: 16").replace("h100-sxm: 8, ", ""))
    with pytest.raises(ConfigError, match=r"duplicate names \['h100-sxm'\]"):
        load_fleet(example / "clash.yaml", params)


def test_labels_for_a_catalog_model_the_scenario_does_not_plan_are_refused(example: Path, params: Params) -> None:
    labels = pd.read_csv(example / "labels.csv")
    labels.loc[labels["model"] == SMALL, "model"] = "meta-llama/Llama-2-13b-hf"
    labels.to_csv(example / "labels.csv", index=False)
    with pytest.raises(ExitplanError, match=r"labels for 'meta-llama/Llama-2-13b-hf', which scenario.models does"):
        load_fleet(example / "fleet.yaml", params)


def test_bad_token_lengths_are_named(example: Path, params: Params) -> None:
    labels = pd.read_csv(example / "labels.csv")
    labels.loc[3, "output_len"] = 0
    labels.to_csv(example / "labels.csv", index=False)
    fleet = load_fleet(example / "fleet.yaml", params)
    bad = labels.loc[3, "model"]
    with pytest.raises(ExitplanError, match="whole token counts >= 1"):
        model_lengths(fleet, None, [bad])


def test_a_model_without_lengths_and_no_trace_names_what_to_give(example: Path, params: Params) -> None:
    labels = pd.read_csv(example / "labels.csv").drop(columns=["prompt_len", "output_len"])
    labels.to_csv(example / "labels.csv", index=False)
    fleet = load_fleet(example / "fleet.yaml", params)
    assert own_lengths(fleet) == set()
    with pytest.raises(ExitplanError, match=r"Coder-34B-Instruct: no token lengths .* prompt_len and output_len"):
        model_lengths(fleet, None, [LARGE])
    trace = (np.array([10, 20]), np.array([5, 6]))
    assert model_lengths(fleet, trace, [LARGE])[LARGE] is trace


def test_a_workload_traffic_in_a_fleet_file_is_refused_by_name(example: Path, params: Params) -> None:
    text = (example / "fleet.yaml").read_text().replace("scenario:\n", "scenario:\n  traffic: workload\n", 1)
    (example / "traffic.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"scenario.traffic: 'workload' is the pipeline's"):
        load_fleet(example / "traffic.yaml", params)


def test_overrides_replace_the_scenario_and_name_a_bad_flag(example: Path, params: Params) -> None:
    spec = load_fleet(example / "fleet.yaml", params).spec
    changed = with_overrides(spec, budget=12.5, qps=None, quality_floor=0.6, max_p95=None)
    assert (changed.scenario.budget_per_hour, changed.scenario.min_quality) == (12.5, 0.6)
    assert changed.scenario.load_qps == spec.scenario.load_qps
    for flag, value, why in (("budget", float("nan"), "--budget: must be a finite number"),
                             ("qps", -1.0, "--qps: Input should be greater than 0"),
                             ("quality_floor", 1.5, "--quality-floor: Input should be less than or equal to 1")):
        with pytest.raises(ConfigError, match=why):
            with_overrides(spec, **{flag: value})


def test_the_budget_check_names_the_model_whose_cheapest_replica_is_dearer(example: Path, params: Params) -> None:
    fleet = load_fleet(example / "fleet.yaml", params)
    check_budget(fleet, params)  # $30/h: one H100 ($2.69/h) holds either model
    poor = type(fleet)(with_overrides(fleet.spec, budget=2.0), fleet.catalog, fleet.labels, fleet.path)
    with pytest.raises(ExitplanError, match=r"\$2.0/h fits no plan: the cheapest replica of your-org/Coder-34B"):
        check_budget(poor, params)


def test_the_perf_db_is_reused_where_it_covers_a_pair_and_the_model_has_no_lengths_of_its_own() -> None:
    db = pd.DataFrame({"model": [SMALL, SMALL, LARGE], "gpu": ["h100-sxm", "l4", "h100-sxm"]})
    reused, missing = coverage(db, [SMALL, LARGE], ["h100-sxm", "l4"], own_lengths=set())
    assert reused == [(SMALL, "h100-sxm"), (SMALL, "l4"), (LARGE, "h100-sxm")] and missing == [(LARGE, "l4")]
    reused, missing = coverage(db, [SMALL, LARGE], ["h100-sxm", "l4"], own_lengths={SMALL})
    assert reused == [(LARGE, "h100-sxm")] and len(missing) == 3
    assert coverage(None, [SMALL], ["l4"], set()) == ([], [(SMALL, "l4")])


def test_the_fleet_perf_db_simulates_only_what_the_pipelines_lacks(example: Path, params: Params) -> None:
    """A pipeline perf DB holding the 7B on H100 (marked rows) is reused for it; the 34B and the L4 are simulated."""
    labels = pd.read_csv(example / "labels.csv")
    labels.loc[labels["model"] == SMALL, ["prompt_len", "output_len"]] = np.nan
    labels.to_csv(example / "labels.csv", index=False)
    text = (example / "fleet.yaml").read_text().replace("labels: [labels.csv]", "labels: [labels.csv]\nqps: [1, 4]\n"
                                                       "requests_per_point: 50")
    (example / "fleet.yaml").write_text(text.replace("gpus: {h100-sxm: 8, l4: 16}", "gpus: {h100-sxm: 2, l4: 4}"))
    fleet = load_fleet(example / "fleet.yaml", params)
    marker = pd.DataFrame({"model": [SMALL], "gpu": ["h100-sxm"], "tp": [1], "pp": [1], "layers": [32],
                           "qps": [1.0], "e2e_p95_s": [123.0], "saturated": [False]})
    pipeline_db = params.path(params.build_perf_db.output_dir) / "perf_db.parquet"
    pipeline_db.parent.mkdir(parents=True)
    marker.to_parquet(pipeline_db)
    trace = params.path(params.prepare_workload.output_dir) / f"trace_{params.build_perf_db.lengths_trace}.parquet"
    trace.parent.mkdir(parents=True)
    pd.DataFrame({"prompt_len": [100, 200], "output_len": [50, 80]}).to_parquet(trace)
    db, pairs = fleet_perf_db(fleet, params, Quiet())
    assert pairs["reused"] == [f"{SMALL} on h100-sxm"]
    assert pairs["simulated"] == [f"{SMALL} on l4", f"{LARGE} on h100-sxm", f"{LARGE} on l4"]
    assert db[(db["model"] == SMALL) & (db["gpu"] == "h100-sxm")]["e2e_p95_s"].tolist() == [123.0]
    simulated = db[db["gpu"] == "l4"]
    assert set(simulated["model"]) == {SMALL, LARGE} and set(simulated["qps"]) == {1.0, 4.0}
    assert simulated[simulated["model"] == LARGE]["num_gpus"].min() == 4  # 67 GB of weights need 4 x 24 GB


def test_the_default_load_grid_reaches_twice_the_load(example: Path, params: Params) -> None:
    spec = load_fleet(example / "fleet.yaml", params).spec
    grid = load_grid(spec)
    assert len(grid) == 12 and grid[-1] == pytest.approx(32) and grid[0] == pytest.approx(32 / 50)
