"""The ``exitplan`` command line. Every command validates ``params.yaml`` before it does any work."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.console import Console
from rich.table import Table

from exitplan.config import DEFAULT_PARAMS, Params, load_params
from exitplan.errors import ExitplanError
from exitplan.kinds import SyntheticArrivalKind

ARRIVAL_HELP = " | ".join(get_args(SyntheticArrivalKind))
"""The arrival processes ``exitplan simulate`` draws."""

app = typer.Typer(help="Plan and serve fleets of LLMs: early exit (HELIOS) x heterogeneous GPUs (BOUTE).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
stage_app = typer.Typer(help="Run one pipeline stage (what dvc.yaml calls).", no_args_is_help=True)
app.add_typer(stage_app, name="stage")
infra_app = typer.Typer(help="The production profile: PostgreSQL, Prefect and MLflow servers, a work pool and a "
                             "worker, on 127.0.0.1.", no_args_is_help=True)
app.add_typer(infra_app, name="infra")
console = Console(width=None if sys.stdout.isatty() else 160)

ParamsOption = Annotated[Path, typer.Option("--params", "-p", help="The params file to validate and use.")]


def _params(path: Path) -> Params:
    """Load and validate params (and the models they name against the catalog) before any work."""
    return load_params(path)


def _run_stage(name: str, params_path: Path, *args: str) -> tuple[Params, Any]:
    """Validate params, then run ``exitplan.stages.<name>.main(params, *args)``; returns the params and its result."""
    import importlib

    from exitplan.runtime import use_model_threads

    loaded = _params(params_path)
    use_model_threads(loaded, name)
    return loaded, importlib.import_module(f"exitplan.stages.{name}").main(loaded, *args)


@app.command("check-config")
def check_config(
    params: ParamsOption = Path(DEFAULT_PARAMS),
    explain: Annotated[bool, typer.Option(help="Also print every key with its documentation.")] = False,
) -> None:
    """Validate params.yaml (and the catalog it names): print OK, or every error with its YAML key path."""
    loaded = _params(params)
    if explain:
        _explain(type(loaded))
    console.print(f"OK: {params} is valid")


def _explain(model: Any, prefix: str = "") -> None:
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        nested = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        console.print(f"[bold]{prefix}{name}[/bold]: {field.description or ''}")
        if nested is not None:
            _explain(nested, f"{prefix}{name}.")


@app.command("catalog")
def catalog(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Print the Model Repository catalog (GPUs, models, embedders) as tables."""
    from exitplan.catalog import GIB, load_catalog

    loaded = _params(params)
    cat = load_catalog(loaded.path(loaded.catalog))
    gpus = Table("id", "name", "BF16 TFLOPS", "mem BW GB/s", "memory GiB", "link", "GPUs/node", "$/h",
                 title="GPUs")
    for g in cat.gpus:
        gpus.add_row(g.id, g.name, f"{g.bf16_tflops:g}", f"{g.hbm_bandwidth_gbps:g}", f"{g.memory_gib:g}",
                     f"{g.link.kind} {g.link.bandwidth_gbps:g} GB/s", str(g.gpus_per_node), f"{g.price_per_hour:.2f}")
    models = Table("name", "layers", "d", "heads/kv", "params (B)", "weights GiB", "KV KiB/token", "embedded",
                   title="Models")
    for m in cat.models:
        models.add_row(m.name, str(m.num_layers), str(m.hidden_size), f"{m.num_attention_heads}/{m.num_kv_heads}",
                       f"{m.num_params() / 1e9:.3f}", f"{m.weight_bytes() / GIB:.2f}",
                       f"{m.kv_bytes_per_token() / 1024:.1f}", "yes" if m.source else "simulated")
    embedders = Table("name", "dim", "pooling", "size MB", title="Embedders")
    for e in cat.embedders:
        embedders.add_row(e.name, str(e.dim), e.pooling, f"{e.source.size_bytes / 1e6:.1f}")
    for table in (gpus, models, embedders):
        console.print(table)


@app.command("simulate")
def simulate(
    model: Annotated[str, typer.Option(help="Hugging Face id of a catalog model.")],
    gpu: Annotated[str, typer.Option(help="GPU id from the catalog.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel degree.")] = 1,
    replicas: Annotated[int, typer.Option(help="Data-parallel replicas (round-robin dispatch).")] = 1,
    qps: Annotated[float, typer.Option(help="Mean arrival rate, requests per second.")] = 1.0,
    requests: Annotated[int, typer.Option(help="Number of requests (with --trace: at most this many).")] = 1000,
    prompt_len: Annotated[int, typer.Option(help="Prompt tokens of every request.")] = 512,
    output_len: Annotated[int, typer.Option(help="Output tokens of every request.")] = 128,
    seed: Annotated[int, typer.Option(help="Seed of the arrival process.")] = 0,
    arrival: Annotated[str, typer.Option(help=f"{ARRIVAL_HELP} (burst: all at t=0).")] = "poisson",
    burstiness: Annotated[float, typer.Option(help="Gamma shape for --arrival gamma (1 = Poisson).")] = 1.0,
    layers: Annotated[int | None, typer.Option(help="Layers held (a partial early-exit model).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="vLLM max_num_seqs.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="vLLM max_num_batched_tokens.")] = None,
    block_size: Annotated[int | None, typer.Option(help="vLLM block_size.")] = None,
    chunked_prefill: Annotated[bool, typer.Option(help="Enable chunked prefill.")] = False,
    trace: Annotated[Path | None, typer.Option(help="Trace file (arrival_s, prompt_len, output_len).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    params: ParamsOption = Path(DEFAULT_PARAMS),
) -> None:
    """Simulate one model on TP x PP GPUs (x replicas) under a load; print TTFT, TPOT, E2E and throughput."""
    import json

    from exitplan.catalog import load_catalog
    from exitplan.simulator.cluster import simulate_cluster
    from exitplan.simulator.cost_model import ReplicaSpec
    from exitplan.simulator.metrics import summarize
    from exitplan.simulator.options import check_options, engine_with
    from exitplan.simulator.replica import ReplicaSimulator
    from exitplan.simulator.requests import generate_requests, read_trace

    loaded = _params(params)
    opts = check_options({"tp": tp, "pp": pp, "replicas": replicas, "qps": qps, "requests": requests,
                          "prompt_len": prompt_len, "output_len": output_len, "seed": seed, "arrival": arrival,
                          "burstiness": burstiness, "layers": layers})
    cat = load_catalog(loaded.path(loaded.catalog))
    spec = ReplicaSpec(cat.llm(model), cat.gpu(gpu), opts.tp, opts.pp, opts.layers)
    overrides = {k: v for k, v in {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                                   "block_size": block_size}.items() if v is not None}
    engine = engine_with(loaded.simulator.engine, {**overrides, "enable_chunked_prefill": chunked_prefill})
    offered = (read_trace(trace, opts.requests) if trace else
               generate_requests(opts.requests, opts.qps, opts.prompt_len, opts.output_len, opts.seed, opts.arrival,
                                 opts.burstiness))
    results = simulate_cluster(offered, [ReplicaSimulator(spec, engine) for _ in range(opts.replicas)])
    metrics = summarize(results)
    if as_json:
        print(json.dumps(metrics))
        return
    console.print_json(json.dumps(metrics))


@app.command("calibrate")
def calibrate(
    device: Annotated[str, typer.Option(help="Whose device: vllm (profile_vllm) or engine (profile_device).")] = "vllm",
    params: ParamsOption = Path(DEFAULT_PARAMS),
) -> None:
    """Re-run the profiled device's reference probe (seconds) and record the machine's drift since profiling; the
    simulator's checks against the real engines rescale the device by it."""
    from exitplan.artifacts import calibration_path
    from exitplan.catalog import load_catalog
    from exitplan.profiling.calibration import Stage, device_of, read_calibration, standing
    from exitplan.profiling.calibration import calibrate as run_calibration

    stages: dict[str, Stage] = {"vllm": "profile_vllm", "engine": "profile_device"}
    if device not in stages:
        raise ExitplanError(f"--device {device!r}: expected one of {', '.join(stages)}")
    loaded, stage = _params(params), stages[device]
    previous = standing(device_of(loaded, stage), read_calibration(calibration_path(loaded, stage)),
                        loaded.calibrate.max_age_h)
    console.print(f"before: {previous.line()}")
    done = run_calibration(loaded, stage, load_catalog(loaded.path(loaded.catalog)))
    drift = done.drift
    console.print(f"probe {done.probe.model} ({done.probe.dtype}, {done.probe.threads} thread(s)): prefill "
                  f"{done.probe.prefill_s * 1e3:.1f} ms (profiled {done.reference.prefill_s * 1e3:.1f}), decode "
                  f"{done.probe.decode_s * 1e3:.1f} ms (profiled {done.reference.decode_s * 1e3:.1f})")
    console.print(f"drift since profiling: prefill x{drift.prefill:.3f}, decode x{drift.decode:.3f}; written "
                  f"{calibration_path(loaded, stage)}")


@app.command("plan")
def plan_fleet(
    fleet: Annotated[Path, typer.Argument(help="The fleet file (docs/your-fleet.md says what it holds).")],
    budget: Annotated[float | None, typer.Option(help="US$/h cap (overrides the file's).")] = None,
    qps: Annotated[float | None, typer.Option(help="Requests per second to serve (overrides the file's).")] = None,
    quality_floor: Annotated[float | None, typer.Option(help="Minimum quality in [0, 1] (overrides).")] = None,
    max_p95: Annotated[float | None, typer.Option(help="P95 latency cap in seconds (overrides).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default data/fleets/<scenario name>).")] = None,
    params: ParamsOption = Path(DEFAULT_PARAMS),
) -> None:
    """Plan a fleet of your own GPUs and models: reuse the perf DB where it covers them, simulate the rest, route
    and deploy by BOUTE's co-optimisation; print the chosen plan (its P95, quality and cost)."""
    import dataclasses
    import warnings

    from exitplan.fleet import load_fleet, plan_fleet, with_overrides

    # GPyTorch's note that it added jitter to a Cholesky factor: a numerical detail of MOBO, not the user's concern.
    warnings.filterwarnings("ignore", message="A not p.d., added jitter")
    loaded = _params(params)
    found = load_fleet(fleet, loaded)
    found = dataclasses.replace(found, spec=with_overrides(found.spec, budget=budget, qps=qps,
                                                           quality_floor=quality_floor, max_p95=max_p95))
    folder = out or Path("data/fleets") / found.spec.scenario.name
    result = plan_fleet(found, loaded, folder, RichReporter(console))
    _print_fleet_plan(result, folder)


class RichReporter:
    """:class:`exitplan.fleet.Reporter` on the console: a line per part, a progress bar over the perf-DB sweep."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self.started = time.perf_counter()

    def stage(self, line: str) -> None:
        """A part of the work starts: one line with the seconds since the command started."""
        elapsed = time.perf_counter() - self.started
        self.out.print(f"[{elapsed:6.1f} s] {line}", highlight=False)

    @contextmanager
    def sweep(self, total: int) -> Iterator[Any]:
        """A rich progress bar over the ``total`` layouts of the sweep."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.stage(f"simulating {total} layouts")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.out, transient=not self.out.is_terminal) as bar:
            task = bar.add_task("perf DB", total=total)
            yield lambda line: bar.update(task, advance=1, description=line[:60])


def _print_fleet_plan(result: dict[str, Any], folder: Path) -> None:
    """The chosen plan of a fleet: one row per model, then its totals and where its files are."""
    plan = result["plan"]
    table = Table(title=f"{plan.scenario}: {plan.load_qps} req/s within ${plan.budget_per_hour}/h")
    for column in ("model", "share", "GPUs", "P95 (s)", "$/h"):
        table.add_column(column)
    for m in plan.models:
        gpus = ", ".join(f"{g.dp} x {g.gpu} tp{g.tp} pp{g.pp}" for g in m.groups) or "-"
        table.add_row(m.model, f"{m.fraction:.2f}", gpus, "-" if m.predicted_p95_s is None else
                      f"{m.predicted_p95_s:.3f}", "-" if m.cost_per_hour is None else f"{m.cost_per_hour:.2f}")
    console.print(table)
    console.print(f"P95 {plan.predicted_p95_s:.3f} s, quality {plan.predicted_quality:.3f}, "
                  f"${plan.cost_per_hour:.2f}/h (found by {plan.found_by}); perf DB: "
                  f"{len(result['perf_db']['reused'])} pairs reused, {len(result['perf_db']['simulated'])} "
                  f"simulated", highlight=False)
    console.print(f"wrote {folder}/: plan.json, front.parquet, front.png, router.json, perf_db.parquet",
                  highlight=False)


@stage_app.command("fetch-models")
def stage_fetch_models(
    model: Annotated[str, typer.Option(help="Hugging Face id of the model to fetch (one of fetch_models.models).")],
    params: ParamsOption = Path(DEFAULT_PARAMS),
) -> None:
    """Assemble one model from its packages, verify its SHA-256 and save a safetensors checkpoint."""
    loaded, metrics = _run_stage("fetch_models", params, model)
    console.print(f"fetched {model} -> {loaded.checkpoint_path(model)} ({metrics['fetch_s']:.1f} s)")


@stage_app.command("prepare-workload")
def stage_prepare_workload(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Build the query table and the request traces from the packaged data sets."""
    loaded, metrics = _run_stage("prepare_workload", params)
    console.print(f"prepared {metrics['num_queries']} queries and {len(metrics['traces'])} traces "
                  f"in {loaded.path(loaded.prepare_workload.output_dir)}")


@stage_app.command("build-perf-db")
def stage_build_perf_db(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Simulate every feasible deployment of the scenario models at every load of the grid."""
    loaded, metrics = _run_stage("build_perf_db", params)
    console.print(f"perf DB: {metrics['rows']} rows, {metrics['deployments']} deployments "
                  f"in {metrics['build_s']:.1f} s -> {loaded.path(loaded.build_perf_db.output_dir)}")


@stage_app.command("train-exits")
def stage_train_exits(
    model: Annotated[str, typer.Option(help="Hugging Face id of the model (one of train_exits.models).")],
    params: ParamsOption = Path(DEFAULT_PARAMS),
) -> None:
    """Fit exit heads of every kind at every exit of one model; write the exit checkpoint and metrics."""
    _, summary = _run_stage("train_exits", params, model)
    console.print(f"exit heads of {model}: depth of 85% agreement {summary['depth85']} "
                  f"({summary['total_s']:.0f} s)")


@stage_app.command("exit-profile")
def stage_exit_profile(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Profile the first confident exits of each model on held-out prompts (HELIOS's observations)."""
    loaded, summary = _run_stage("exit_profile", params)
    console.print(f"exit profile of {len(loaded.exit_profile.models)} models x {len(summary['head_kinds'])} head "
                  f"kinds in {summary['seconds']:.0f} s -> reports/exit_profile/")


@stage_app.command("profile-device")
def stage_profile_device(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Time the candidates on this machine with the engine's runner; fit the simulator's device to the times."""
    _print_device(_run_stage("profile_device", params)[1])


@stage_app.command("profile-vllm")
def stage_profile_vllm(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Time vLLM's CPU replicas of the models on this machine through their API; fit the simulator's device."""
    _print_device(_run_stage("profile_vllm", params)[1])


@stage_app.command("partial-checkpoints")
def stage_partial_checkpoints(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Write the truncated checkpoints of the plans' partial vLLM replicas and of ``partial_checkpoints.cuts``."""
    result = _run_stage("partial_checkpoints", params)[1]
    for name, size in result["bytes"].items():
        console.print(f"{name}: {size / 2**30:.2f} GiB")
    if result["not_fetched"]:
        console.print(f"not fetched here, not cut: {', '.join(result['not_fetched'])} (cut them on their hosts with "
                      "`exitplan truncate`)")


def _print_device(m: dict[str, Any]) -> None:
    console.print(f"{m['device']}: {m['flops_per_s'] / 1e9:.1f} GFLOP/s, {m['bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"overheads {m['step_overhead_s'] * 1e3:.2f} ms/step + {m['seq_overhead_s'] * 1e3:.2f} ms/seq + "
                  f"{m['prompt_overhead_s'] * 1e3:.1f} ms/request; attention at {m['attention_rate']:.2f}x the "
                  f"GEMMs, KV reads at {m['kv_read_rate']:.2f}x the weights; "
                  f"fit error median {m['median_rel_err']:.1%}, max {m['max_rel_err']:.1%} over {m['points']} points")


@stage_app.command("select-candidates")
def stage_select_candidates(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """HELIOS step 1: the Top-K candidates for the SLO on this device."""
    loaded, result = _run_stage("select_candidates", params)
    for r in result.ranked:
        console.print(f"{r.model}: exit {r.exit_layer} (breach rate {r.breach_rate:.2f}), batch "
                      f"{r.batch}, {r.tpot_ms:.0f} ms/token, {r.tokens_per_s:.1f} tok/s"
                      f"{'' if r.meets_slo else '  (misses the SLO)'}")
    console.print(f"selected: {result.candidates} -> {loaded.select_candidates.output}")


@stage_app.command("label-quality")
def stage_label_quality(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Measure per-query quality labels of the candidates by running them."""
    _, m = _run_stage("label_quality", params)
    console.print(", ".join(f"{k}: {v:.3f}" for k, v in m.items() if k not in ("queries", "seconds"))
                  + f" ({m['queries']} queries, {m['seconds']:.0f} s)")


@stage_app.command("import-labels")
def stage_import_labels(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Import per-query labels, prompts and answer lengths from AlpacaEval annotation files (a judge's
    preferences)."""
    loaded, m = _run_stage("import_labels", params)
    if m["skipped"]:
        console.print(f"import_labels: skipped - {m['skipped']}")
        return
    for model, row in m["models"].items():
        console.print(f"{model}: {row['rows']} labels, mean {row['mean_quality']:.3f} ({row['no_verdict']} without "
                      f"a verdict, {row['draws']} draws), answers median {row['output_len_median']:.0f} tokens")
    console.print(f"tokens counted with {m['tokenizer_proxy']} (proxy): {m['chars_per_token']['prompts']:.2f} "
                  f"chars/token on prompts, {m['chars_per_token']['answers']:.2f} on answers -> "
                  f"{loaded.import_labels.output_dir}")


@stage_app.command("plan")
def stage_plan(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Co-optimise routing and deployment per scenario (BOUTE); register the first scenario's plan."""
    loaded, result = _run_stage("plan", params)
    for name, plan in result["plans"].items():
        console.print(f"{name}: P95 {plan.predicted_p95_s:.3f} s, quality {plan.predicted_quality:.3f}, "
                      f"${plan.cost_per_hour:.2f}/h, fractions {[round(m.fraction, 2) for m in plan.models]} "
                      f"({plan.evaluations} evaluations, {result['times'][name]['mobo_seconds']:.0f} s)")
    for name, why in result["skipped"].items():
        console.print(f"{name}: skipped - {why}")
    for name, version in result.get("versions", {}).items():
        if version:
            console.print(f"{name}: registered as {loaded.plan.registered_name(name)} version {version} (alias "
                          f"challenger)")


@stage_app.command("online-profile")
def stage_online_profile(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """HELIOS online profiling of the candidates into the PHT, and the reference telemetry."""
    result = _run_stage("online_profile", params)[1]
    console.print(f"online_profile: serving {result['served_model']} at exit {result['served_exit_layer']} "
                  f"(breach rate {result['breach_rate']:.3f}) on {result['requests']} requests from "
                  f"{result['source']}")


@stage_app.command("gate")
def stage_gate(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Every expectation the challenger plan must meet before promotion, in one report (never fails on a failed
    gate: ``exitplan promote`` reads the report)."""
    from exitplan.stages.gate import describe

    console.print(describe(_run_stage("gate", params)[1]), highlight=False)


@app.command("promote")
def promote(
    params: ParamsOption = Path(DEFAULT_PARAMS),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; change nothing.")] = False,
) -> None:
    """Move the MLflow alias ``champion`` to the ``challenger`` plan if its gate report passed (else exit 2 with
    every failed expectation; the champion stays)."""
    from exitplan.promotion import promote as run_promotion

    result = run_promotion(_params(params), dry_run=dry_run)
    console.print(f"challenger v{result.challenger}; champion before: "
                  f"{'v' + result.champion_before if result.champion_before else 'none'}")
    for line in result.changes:
        console.print(("(dry run) " if dry_run else "") + line)
    for failure in result.failures:
        console.print(f"  - {failure}", highlight=False)


@app.command("rollback")
def rollback(
    params: ParamsOption = Path(DEFAULT_PARAMS),
    to: Annotated[str | None, typer.Option(help="Version to make champion (default: the one promoted before).")] = None,
) -> None:
    """Point ``champion`` back at an earlier plan version."""
    from exitplan.promotion import rollback as run_rollback

    result = run_rollback(_params(params), to)
    console.print(result.changes[0])


@app.command("truncate")
def truncate_checkpoint(
    source: Annotated[Path, typer.Argument(help="A Hugging Face checkpoint folder (config.json + safetensors).")],
    out: Annotated[Path, typer.Argument(help="Folder to write the cut to (replaced atomically).")],
    layers: Annotated[int, typer.Option("--layers", min=1, help="Decoder layers to keep.")],
    dtype: Annotated[str | None, typer.Option(help="Store the tensors as bfloat16, float16 or float32 "
                                                   "(default: as they are).")] = None,
) -> None:
    """Cut a checkpoint to its first layers, final norm and head, as a model vLLM serves (a partial replica); for
    GPU hosts that hold weights this machine lacks (``partial_checkpoints`` cuts the fetched ones)."""
    from exitplan.vllm.truncate import truncate

    if dtype not in (None, "bfloat16", "float16", "float32"):
        raise ExitplanError(f"--dtype must be bfloat16, float16 or float32 (got {dtype!r})")
    console.print(f"wrote {truncate(source, out, layers, dtype)}")


@app.command("deploy")
def deploy(
    params: ParamsOption = Path(DEFAULT_PARAMS),
    render_only: Annotated[bool, typer.Option("--render-only", help="Write the launch files; start nothing.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the local fleet running (Ctrl-C stops it).")] = False,
    backend: Annotated[str | None, typer.Option("--backend", help="Local replicas: exitplan (our engine servers) "
                                                "or vllm (vLLM's CPU build); default deploy.backend.")] = None,
) -> None:
    """Render the champion plan as vLLM launch files per GPU host (the bundle, with the CUDA vLLM lock); start a
    local fleet (replicas of the plan models that run here, on our engine or on vLLM, + the coordinator, on
    loopback), wait for health, send a smoke request through the coordinator with the ``openai`` client."""
    from exitplan.deploy import render_champion
    from exitplan.local_fleet import serve

    loaded = _params(params)
    if backend is not None:
        loaded = _with_backend(loaded, backend)
    rendered = render_champion(loaded)
    table = Table("model", "host", "GPUs", "weight", "vllm serve ...", title=f"champion v{rendered.version}")
    for r in rendered.replicas:
        table.add_row(r.model, r.host, ",".join(map(str, r.devices)), f"{r.weight:.2f}", " ".join(r.args[3:]))
    console.print(table)
    console.print(f"launch files: {', '.join(str(f) for f in rendered.files)}")
    for name in rendered.missing_partials:
        console.print(f"partial replica {name}: its model is not fetched here; on its host run `exitplan truncate "
                      f"<checkpoint> models/{name} --layers {name.rsplit('-L', 1)[1]}` beside the launch file")
    if not render_only:
        serve(loaded, rendered, keep, lambda fleet, answer: console.print(
            f"coordinator {fleet.coordinator_url}; replicas {fleet.replica_urls}\n"
            f"smoke request: served by {answer['served_by']} in {answer['seconds']:.2f} s: {answer['text']!r}"))


def _with_backend(params: Any, backend: str) -> Any:
    """``params`` with ``deploy.backend`` replaced (checked like params.yaml's value)."""
    from pydantic import ValidationError

    from exitplan.config import DeployParams
    from exitplan.errors import ConfigError

    try:
        section = DeployParams.model_validate({**params.deploy.model_dump(), "backend": backend})
    except ValidationError as exc:
        raise ConfigError("--backend", [f"{backend!r}: must be 'exitplan' or 'vllm'"]) from exc
    return params.model_copy(update={"deploy": section})


def _print_status(rows: list[Any]) -> None:
    table = Table("service", "state", "address", "pid", title="production profile")
    for row in rows:
        state = "healthy" if row.healthy else "running, not healthy" if row.running else "stopped"
        table.add_row(row.name, state, row.address, str(row.pid or ""))
    console.print(table)


@infra_app.command("up")
def infra_up(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Start PostgreSQL, the Prefect server, the MLflow server, the work pool and one worker (each health-checked);
    what already runs is left as it is."""
    from exitplan.infra.profile import client_env, up

    loaded = _params(params)
    _print_status(up(loaded))
    console.print("clients of the profile set (`eval \"$(exitplan infra env)\"`):")
    for key, value in client_env(loaded).items():
        console.print(f"  {key}={value}")


@infra_app.command("down")
def infra_down(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Stop every service of the profile (the worker's flow runs included); the data stays for the next `up`."""
    from exitplan.infra.profile import down

    stopped = down(_params(params))
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@infra_app.command("status")
def infra_status(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Say what runs (process and health check of each service); exit 1 unless everything is healthy."""
    from exitplan.infra.profile import status

    rows = status(_params(params))
    _print_status(rows)
    if not all(r.healthy for r in rows):
        raise typer.Exit(1)


@infra_app.command("env")
def infra_env(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Print `export` lines that point a shell (or a worker on another machine) at the profile's servers."""
    from exitplan.infra.profile import client_env

    for key, value in client_env(_params(params)).items():
        typer.echo(f"export {key}={value}")


@infra_app.command("deploy")
def infra_deploy(params: ParamsOption = Path(DEFAULT_PARAMS)) -> None:
    """Register prefect.yaml's deployments on the profile's Prefect server (checkout root, tracking URI and the
    offline environment as job variables)."""
    from exitplan.infra.profile import deploy

    console.print(deploy(_params(params)))


def _preload_allocator(args: list[str]) -> None:
    """``exitplan stage <model stage>`` re-executes itself with tcmalloc first (:func:`exitplan.runtime.
    preload_tcmalloc`); any other command, or params that do not load (the command then reports them), go on."""
    from exitplan.runtime import preload_tcmalloc

    if len(args) < 2 or args[0] != "stage":
        return
    path = Path(args[args.index("--params") + 1]) if "--params" in args[:-1] else Path(DEFAULT_PARAMS)
    try:
        params = load_params(path)
    except ExitplanError:
        return
    preload_tcmalloc(params, args[1].replace("-", "_"))


def main() -> None:
    """Console-script entry point: run the app, turning an :class:`ExitplanError` into a message and exit 2."""
    _preload_allocator(sys.argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "distributed"):  # a line per HTTP request, per Dask connection
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        app()
    except ExitplanError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
