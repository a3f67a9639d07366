from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from exitplan import REPO_ROOT
from exitplan.cli import app
from exitplan.config import load_params
from exitplan.errors import ConfigError


def _write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def tree() -> dict:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    return tree


def test_repo_params_are_valid() -> None:
    params = load_params(REPO_ROOT / "params.yaml")
    assert params.root == REPO_ROOT
    assert params.prepare_workload.tokenizer_model in params.fetch_models.models
    assert params.checkpoint_path("a/b") == REPO_ROOT / "model_repository" / "checkpoints" / "a" / "b"


def test_unknown_key_is_named_with_its_path_and_a_hint(tmp_path: Path, tree: dict) -> None:
    tree["fetch_models"]["dtpye"] = "float32"
    with pytest.raises(ConfigError) as err:
        load_params(_write(tmp_path, tree))
    assert "fetch_models.dtpye: unknown key (did you mean 'dtype'?)" in err.value.problems


def test_every_error_is_listed_with_its_key_path(tmp_path: Path, tree: dict) -> None:
    tree["prepare_workload"]["max_queries_per_dataset"] = 0
    tree["prepare_workload"]["traces"][0]["qps"] = "fast"
    tree["prepare_workload"]["datasets"].append("imagenet")
    with pytest.raises(ConfigError) as err:
        load_params(_write(tmp_path, tree))
    keys = [p.split(":")[0] for p in err.value.problems]
    assert keys == ["prepare_workload.datasets.5", "prepare_workload.max_queries_per_dataset",
                    "prepare_workload.traces.0.qps"]


def test_missing_section_and_duplicate_yaml_key(tmp_path: Path, tree: dict) -> None:
    del tree["fetch_models"]
    with pytest.raises(ConfigError, match="fetch_models: required key is missing"):
        load_params(_write(tmp_path, tree))
    dup = tmp_path / "dup.yaml"
    dup.write_text("tracking:\n  enabled: true\ntracking:\n  enabled: false\n")
    with pytest.raises(ConfigError, match="duplicate key 'tracking'"):
        load_params(dup)


def test_cross_field_rules(tmp_path: Path, tree: dict) -> None:
    tree["prepare_workload"]["traces"][0]["arrival"] = "replay"
    with pytest.raises(ConfigError, match="replay' needs timestamps_file"):
        load_params(_write(tmp_path, tree))
    tree["prepare_workload"]["traces"][0]["arrival"] = "poisson"
    tree["prepare_workload"]["datasets"] = ["gsm8k"]
    with pytest.raises(ConfigError, match=r"mix names data sets not in datasets: \['sharegpt'\]"):
        load_params(_write(tmp_path, tree))
    tree["prepare_workload"]["datasets"] = ["gsm8k", "sharegpt"]
    tree["profile_vllm"]["neighbour_batches"] = [4, 1, 16]
    with pytest.raises(ConfigError, match=r"profile_vllm.neighbour_batches must increase; got \[4, 1, 16\]"):
        load_params(_write(tmp_path, tree))


def test_models_are_checked_against_the_catalog(tmp_path: Path, tree: dict) -> None:
    tree["fetch_models"]["models"].append("nobody/unknown-7b")
    tree["fetch_models"]["models"].append("meta-llama/Llama-2-7b-hf")
    with pytest.raises(ConfigError) as err:
        load_params(_write(tmp_path, tree))
    assert err.value.problems == [
        "fetch_models.models.4: 'nobody/unknown-7b' is not in the catalog",
        "fetch_models.models.5: 'meta-llama/Llama-2-7b-hf' has no source to fetch (simulated only)",
    ]


def test_check_config_command(tmp_path: Path, tree: dict) -> None:
    runner = CliRunner()
    good = _write(tmp_path, tree)
    result = runner.invoke(app, ["check-config", "--params", str(good)])
    assert result.exit_code == 0 and "OK" in result.output
    tree["tracking"]["experiment"] = ""
    tree["bogus"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(tree))
    result = runner.invoke(app, ["check-config", "--params", str(bad)])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)
    assert "bogus: unknown key" in str(result.exception)
    assert "tracking.experiment" in str(result.exception)


def test_exit_layers_every_n_plus_from_the_end(tmp_path: Path, tree: dict) -> None:
    tree["train_exits"].update(exit_every=4, exits_from_end=[2, 1])
    section = load_params(_write(tmp_path, tree)).train_exits
    assert section.exit_layers(24) == [4, 8, 12, 16, 20, 22, 23]
    assert section.exit_layers(28) == [4, 8, 12, 16, 20, 24, 26, 27]
    tree["train_exits"]["exits_from_end"] = [0]
    with pytest.raises(ConfigError, match="train_exits.exits_from_end"):
        load_params(_write(tmp_path, tree))


def _numeric_leaves(node, path=()):
    """Key paths of every number in a YAML tree (bools are not numbers here)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _numeric_leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numeric_leaves(value, (*path, i))
    elif isinstance(node, int | float) and not isinstance(node, bool):
        yield path


def _set(tree, path, value):
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


REPO_TREE = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
LEAVES = list(_numeric_leaves(REPO_TREE))
ALWAYS_WRONG = [float("nan"), float("inf"), float("-inf"), True, "3"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(leaf=st.sampled_from(LEAVES), value=st.sampled_from([*ALWAYS_WRONG, 0, -1, -1e9, 1e308, 2**70, 0.5]))
def test_a_hostile_number_anywhere_in_params_is_refused_by_name_or_accepted(tmp_path: Path, leaf: tuple,
                                                                          value: object) -> None:
    import copy

    tree = copy.deepcopy(REPO_TREE)
    tree["catalog"] = str(REPO_ROOT / "model_repository" / "catalog.yaml")
    _set(tree, leaf, value)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        load_params(path)
    except ConfigError as exc:
        keys = list(leaf)
        while isinstance(keys[-1], int):  # an element of a list: the error names the list (or the element)
            keys.pop()
        if len(keys) > 1 and keys[-2] == "mix":  # a weight of a mix: its sum may be what is wrong (all zero)
            keys.pop()
        assert ".".join(str(k) for k in leaf[:leaf.index(keys[-1]) + 1]) in str(exc), (leaf, value, str(exc))
        return
    assert value not in ALWAYS_WRONG and value == value, f"{leaf} accepted {value!r}"  # NaN != NaN


def test_numbers_are_counted_in_every_section() -> None:
    sections = {leaf[0] for leaf in LEAVES}
    assert len(LEAVES) > 40 and {"plan", "helios", "build_perf_db", "deploy"} <= sections


def test_a_published_agreement_outside_the_unit_interval_is_named(tmp_path: Path, tree: dict) -> None:
    scenario = next(s for s in tree["plan"]["scenarios"] if s["name"] == "llama2-layerskip")
    for bad in (1.5, float("nan"), -0.2):
        scenario["depth_agreement"] = {"meta-llama/Llama-2-7b-hf": {8: bad}}
        with pytest.raises(ConfigError, match=r"depth_agreement.meta-llama/Llama-2-7b-hf.8: "):
            load_params(_write(tmp_path, tree))


def test_a_scenarios_traffic_and_the_routed_shares_are_checked(tmp_path: Path, tree: dict) -> None:
    tree["plan"]["scenarios"][0]["traffic"] = "everything"
    tree["plan"]["routed_shares"] = [0.5, 0.0]
    tree["plan"]["workload_sample"] = 3
    with pytest.raises(ConfigError) as err:
        load_params(_write(tmp_path, tree))
    keys = sorted(p.split(":")[0] for p in err.value.problems)
    assert keys == ["plan.routed_shares", "plan.scenarios.0.traffic", "plan.workload_sample"]
    assert any(r"(0, 1]; got [0.0]" in p for p in err.value.problems)
