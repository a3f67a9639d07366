"""Deploying the champion plan: vLLM launch files for GPU hosts, and a fleet of local engine servers.

:func:`render` turns a plan into replicas - one per DP rank of each group - packed onto hosts of their GPU type
(``gpus_per_node`` from the catalog), each with its vLLM arguments (``--tensor-parallel-size``,
``--pipeline-parallel-size``, ``--max-num-seqs``, ... the knobs the simulator assumed) and its share of its model's
load. :func:`write_launch_files` writes one shell script per host, ``replicas.json`` and the coordinator's
``fleet.json``. :func:`start_local` starts our engine servers for the plan models that run here and the coordinator
(separate processes, ``python -m serving.server`` / ``python -m serving.coordinator_server``), waits for health and
sends a smoke request. Nothing here imports the serving code: the processes are its boundary.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

from exitplan.artifacts import ROUTER_FILE
from exitplan.catalog import Catalog
from exitplan.config import EngineParams, Params
from exitplan.errors import ExitplanError
from exitplan.planner.plan_file import Plan, parse_plan

CUDA_LOCK = "requirements-vllm-cuda.lock"
"""The pinned CUDA vLLM of GPU hosts (in the repository root), copied into every launch bundle."""


@dataclass
class ReplicaLaunch:
    """One replica of the plan.

    Attributes:
        model: Model (HF id).
        gpu: GPU type.
        host: Host name (``<gpu>-<n>``).
        devices: GPU indices on the host.
        port: Port of its OpenAI server.
        weight: Its share of its model's load.
        layers: Layers served (fewer than the model's: a partial early-exit replica).
        args: The ``vllm serve`` command line.
    """

    model: str
    gpu: str
    host: str
    devices: list[int]
    port: int
    weight: float
    layers: int
    args: list[str] = field(default_factory=list)


def vllm_args(model: str, tp: int, pp: int, port: int, engine: EngineParams, layers: int | None = None,
              num_layers: int | None = None, host: str = "127.0.0.1") -> list[str]:
    """The ``vllm serve`` command of one GPU replica, with the engine knobs the perf DB simulated (bound to
    ``host``; the API key comes from ``$VLLM_API_KEY``, set by the launch script, never from argv). A partial
    (early-exit) replica serves its truncated checkpoint from the bundle's ``models/`` folder under the model's
    name (vLLM cannot load a checkpoint with fewer layers through ``--hf-overrides``)."""
    from exitplan.vllm.flags import Platform, Replica, serve_flags
    from exitplan.vllm.truncate import partial_name

    source = model
    if layers is not None and num_layers is not None and layers < num_layers:
        source = f"models/{partial_name(model, layers)}"
    return ["vllm", "serve", source, *serve_flags(Platform.CUDA, Replica(model, host, port, tp, pp), engine)]


def render(plan: Plan, catalog: Catalog, engine: EngineParams, base_port: int,
           bind: str = "127.0.0.1") -> list[ReplicaLaunch]:
    """Replicas of every deployed model of ``plan``, packed onto hosts of their GPU type.

    Raises:
        ExitplanError: when the plan names a GPU the catalog lacks, or a replica needs more GPUs than a host has.
    """
    replicas: list[ReplicaLaunch] = []
    used: dict[str, list[int]] = {}  # gpu type -> GPUs used on each host so far
    port = base_port
    for entry in plan.served:
        weights = iter(entry.replica_weights)
        for group in entry.groups:
            gpu = catalog.gpu(group.gpu)
            size = group.tp * group.pp
            if size > gpu.gpus_per_node:
                raise ExitplanError(f"{entry.model}: tp x pp = {size} does not fit a {gpu.id} host of "
                                    f"{gpu.gpus_per_node} GPUs")
            for _ in range(group.dp):
                hosts = used.setdefault(gpu.id, [])
                host = next((i for i, n in enumerate(hosts) if n + size <= gpu.gpus_per_node), None)
                if host is None:
                    hosts.append(0)
                    host = len(hosts) - 1
                devices = list(range(hosts[host], hosts[host] + size))
                hosts[host] += size
                total = catalog.llm(entry.model).num_layers
                replicas.append(ReplicaLaunch(
                    entry.model, gpu.id, f"{gpu.id}-{host}", devices, port,
                    float(next(weights, 1.0 / group.dp)), group.layers or total,
                    vllm_args(entry.model, group.tp, group.pp, port, engine, group.layers, total, bind)))
                port += 1
    return replicas


def fleet_config(plan: Plan, replicas: list[ReplicaLaunch], params: Params, router: Path | None,
                 url_of: dict[int, str] | None = None) -> dict[str, Any]:
    """What the coordinator needs: models (smallest first), fractions, replicas with weights, the routing model."""
    section = params.deploy
    return {"fleet_name": section.fleet_name, "models": plan.model_ids,
            "fractions": [m.fraction for m in plan.models], "thresholds": plan.thresholds,
            "router": str(router) if router else None,
            "embedder": str(params.checkpoint_path(params.plan.embedder)),
            "replicas": [{"model": r.model, "url": (url_of or {}).get(r.port, f"http://{r.host}:{r.port}"),
                          "weight": r.weight} for r in replicas],
            "max_in_flight": section.max_in_flight, "request_timeout_s": section.request_timeout_s,
            "cooldown_s": section.cooldown_s, "routing_window": section.routing_window,
            "max_attempts": section.max_attempts, "failure_threshold": section.failure_threshold,
            "health_interval_s": section.health_interval_s, "drain_s": section.drain_s,
            "max_body_bytes": section.max_body_bytes}


def write_launch_files(out: Path, replicas: list[ReplicaLaunch], fleet: dict[str, Any], version: str,
                       api_key_env: str = "EXITPLAN_API_KEY", require_key: bool = True) -> list[Path]:
    """One ``launch-<host>.sh`` per GPU host, ``replicas.json`` and ``fleet.json`` (atomically).

    Each script refuses to start without ``$api_key_env`` (unless ``require_key`` is off) and hands it to vLLM as
    ``$VLLM_API_KEY``, so the key is never on a command line."""
    from exitplan.atomic import write_atomic, write_json

    written = []
    key = (f': "${{{api_key_env}:?set {api_key_env} to the API key the replicas require}}"'
           if require_key else f': "${{{api_key_env}:=}}"')
    for host in sorted({r.host for r in replicas}):
        lines = ["#!/usr/bin/env bash", f"# exitplan plan version {version}: vLLM replicas of host {host}",
                 "# vLLM runs in its own environment: pip install -r requirements-vllm-cuda.lock (beside this file);",
                 "# partial (early-exit) replicas serve the truncated checkpoints under models/. Logs: vllm-<port>.log",
                 "set -e", 'cd "$(dirname "$0")"', key, f'export VLLM_API_KEY="${{{api_key_env}}}"',
                 "export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1"]
        for r in (r for r in replicas if r.host == host):
            env = f"CUDA_VISIBLE_DEVICES={','.join(map(str, r.devices))}"
            lines.append(f"{env} nohup {shlex.join(r.args)} > vllm-{r.port}.log 2>&1 &")
        lines.append("wait")
        path, text = out / f"launch-{host}.sh", "\n".join(lines) + "\n"
        write_atomic(path, partial(_write_text, text=text))
        path.chmod(0o755)
        written.append(path)
    lock = Path(__file__).resolve().parent.parent / CUDA_LOCK
    if lock.is_file():
        written.append(write_atomic(out / CUDA_LOCK, partial(_write_text, text=lock.read_text())))
    written.append(write_json(out / "replicas.json", {"version": version, "replicas": [asdict(r) for r in replicas]}))
    written.append(write_json(out / "fleet.json", fleet))
    return written


def _write_text(path: Path, text: str) -> None:
    Path(path).write_text(text)


@dataclass
class LocalFleet:
    """Processes started here."""

    coordinator_url: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    replica_urls: dict[str, list[str]] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)
    """Process groups (vLLM replicas lead their own) killed at the end of :meth:`stop`."""

    def stop(self) -> None:
        """Stop every process (SIGTERM: they drain in-flight requests), then wait; what leads its own session (a
        vLLM replica and its engine processes) is killed as a group if it outlives the wait."""
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            proc.wait()
        if self.groups:
            from exitplan.vllm.replica import kill_group

            for group in self.groups:  # a replica's engine processes outlive it when its shutdown hangs
                kill_group(group)


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url``/health until it answers 200.

    Raises:
        ExitplanError: when the process exits or the time runs out.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ExitplanError(f"the server for {url} exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise ExitplanError(f"{url} was not healthy after {timeout_s:.0f} s")


def local_fleet(plan: Plan, local: list[str]) -> dict[str, Any]:
    """Routing over the plan models that run here: their fractions renormalised (a model that cannot run here
    hands its share to those that can, in the plan's proportions)."""
    shares = {m.model: m.fraction for m in plan.models if m.model in local}
    total = sum(shares.values())
    if total <= 0:
        return {"models": local, "fractions": [1.0 / len(local)] * len(local), "plan_models": list(shares)}
    return {"models": local, "fractions": [shares[m] / total for m in local],
            "plan_models": plan.model_ids}


def start_local(params: Params, plan: Plan, router: Path | None, out: Path) -> LocalFleet:
    """Start the replicas of the plan models that run here (``deploy.backend``: our engine servers or vLLM) and
    the coordinator in front of them; wait for health.

    Raises:
        ExitplanError: when no plan model runs here, or a server does not come up (the others are stopped).
    """
    section = params.deploy
    local = [m for m in plan.model_ids if (params.checkpoint_path(m) / "config.json").is_file()]
    if not local:
        raise ExitplanError("no model of the plan has a checkpoint here: nothing to start locally")
    fleet = LocalFleet(f"http://{section.host}:{section.coordinator_port}")
    try:
        if section.backend == "vllm":
            replicas = _start_vllm_replicas(params, plan, local, fleet, out)
        else:
            replicas = _start_engine_servers(params, local, fleet)
        held = [m for m in local if m in fleet.replica_urls]
        config = fleet_config(plan, replicas, params, router, {r.port: f"http://{section.host}:{r.port}"
                                                              for r in replicas})
        config.update(local_fleet(plan, held))
        from exitplan.atomic import write_json

        fleet_path = write_json(out / "fleet-local.json", config)
        cmd = [sys.executable, "-m", "serving.coordinator_server", "--fleet", str(fleet_path), "--host", section.host,
               "--port", str(section.coordinator_port), "--api-key-env", section.api_key_env]
        fleet.processes.append(subprocess.Popen(cmd, cwd=params.root, env=_project_env(params)))
        wait_healthy(fleet.coordinator_url, section.startup_timeout_s, fleet.processes[-1])
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _project_env(params: Params) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(params.root)}


def _start_engine_servers(params: Params, local: list[str], fleet: LocalFleet) -> list[ReplicaLaunch]:
    """Our engine servers: ``deploy.local_replicas_per_model`` per local model, one after another."""
    from exitplan.checkpoints import checkpoint_bytes

    section = params.deploy
    port, replicas = section.base_port, []
    for model in local:
        gib = checkpoint_bytes(params.checkpoint_path(model)) / 2**30 * 1.1 + section.local_kv_gib
        for _ in range(section.local_replicas_per_model):
            url = f"http://{section.host}:{port}"
            cmd = [sys.executable, "-m", "serving.server", "--model", model, "--host", section.host, "--port",
                   str(port), "--params", str(params.root / "params.yaml"), "--memory-gib", f"{gib:.2f}",
                   "--max-context", str(section.max_context), "--max-queue", str(section.max_queue),
                   "--request-timeout", str(section.request_timeout_s),
                   "--telemetry", str(params.path(params.reprofile.telemetry).parent / f"live-{port}.parquet")]
            fleet.processes.append(subprocess.Popen(cmd, cwd=params.root, env=_project_env(params)))
            wait_healthy(url, section.startup_timeout_s, fleet.processes[-1])
            fleet.replica_urls.setdefault(model, []).append(url)
            replicas.append(ReplicaLaunch(model, "local", section.host, [], port,
                                          1.0 / section.local_replicas_per_model, 0))
            port += 1
    return replicas


def plan_replica_counts(plan: Plan, models: list[str]) -> dict[str, int]:
    """Replicas the plan gives each of ``models`` that it routes a share to (its DP ranks over all groups; at least
    one); a model with no share gets none (a replica of it would take a core from one the plan does load)."""
    return {m.model: m.replicas for m in plan.models if m.model in models and m.serves}


def partial_path(params: Params, model: str, layers: int) -> Path:
    """Where ``partial_checkpoints`` writes ``model`` cut to ``layers`` layers (what a partial replica serves)."""
    from exitplan.vllm.truncate import partial_name

    return params.path(params.partial_checkpoints.output_dir) / partial_name(model, layers)


def replica_checkpoint(params: Params, plan: Plan, model: str) -> Path:
    """The checkpoint a local replica of ``model`` serves: the fetched one, or, when the plan holds fewer layers than
    the model (a partial early-exit replica), its cut from ``partial_checkpoints``.

    Raises:
        ExitplanError: when the cut is missing.
    """
    from exitplan.vllm.truncate import read_layers

    full = params.checkpoint_path(model)
    entry = plan.entry(model)
    layers = entry.layers if entry else None
    if layers is None or layers >= read_layers(full):
        return full
    cut = partial_path(params, model, layers)
    if not (cut / "config.json").is_file():
        raise ExitplanError(f"the plan serves {model} at {layers} layers but {cut} is missing: run "
                            "`dvc repro partial_checkpoints`")
    return cut


def bundle_partials(params: Params, replicas: list[ReplicaLaunch], out: Path,
                    num_layers: dict[str, int]) -> list[str]:
    """Link the cuts that the bundle's partial replicas serve into ``out/models/`` (hard links: no copy); returns
    the cuts this machine lacks (their models are not fetched here: cut them on the host with `exitplan
    truncate`)."""
    from exitplan.packages import replace_dir
    from exitplan.vllm.truncate import partial_name

    missing = []
    for model, layers in sorted({(r.model, r.layers) for r in replicas if r.layers < num_layers[r.model]}):
        name, cut = partial_name(model, layers), partial_path(params, model, layers)
        if not (cut / "config.json").is_file():
            missing.append(name)
            continue
        scratch = out / "models" / f".{Path(name).name}.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(cut, scratch, copy_function=_link_or_copy)
        replace_dir(scratch, out / "models" / name)
    return missing


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def replica_order(counts: dict[str, int]) -> list[str]:
    """Models in turn, each as often as its count: a machine that holds fewer replicas keeps every model first."""
    order, left = [], dict(counts)
    while any(left.values()):
        for model in counts:
            if left[model]:
                order.append(model)
                left[model] -= 1
    return order


def _start_vllm_replicas(params: Params, plan: Plan, local: list[str], fleet: LocalFleet,
                         out: Path) -> list[ReplicaLaunch]:
    """vLLM CPU replicas: one per plan replica of each local model, as many as this machine's cores and RAM
    hold, each on its own cores; all start at once (each compiles its model), then each is waited for.

    Raises:
        ExitplanError: when not one replica fits, or a replica does not come up (with the end of its log).
    """
    from exitplan.vllm import replica as vllm_replica

    section, settings = params.deploy, params.vllm
    wanted = replica_order(plan_replica_counts(plan, local))
    checkpoints = {m: replica_checkpoint(params, plan, m) for m in set(wanted)}
    gib = [vllm_replica.replica_gib(params, checkpoints[m]) for m in wanted]
    held = vllm_replica.capacity(params, gib)
    if held == 0:
        raise ExitplanError(f"this machine cannot hold one vLLM replica of {wanted[0]} ({gib[0]:.1f} GiB with a "
                            f"{settings.kv_cache_gib} GiB KV cache, {settings.threads_per_replica} core(s))")
    chosen = wanted[:held]
    cores = vllm_replica.cores(held, settings.threads_per_replica)
    started, replicas = [], []
    for i, model in enumerate(chosen):
        port = section.base_port + i
        spec = vllm_replica.cpu_replica(params, model, section.host, port)
        started.append(vllm_replica.start(params, checkpoints[model], spec, cores[i],
                                          out / f"vllm-{port}.log"))
        fleet.processes.append(started[-1].process)
        fleet.groups.append(started[-1].process.pid)
        replicas.append(ReplicaLaunch(model, "local", section.host, cores[i], port, 1.0 / chosen.count(model), 0,
                                      cast(list[str], started[-1].process.args)))
    for replica in started:
        vllm_replica.wait_ready(replica, settings.startup_timeout_s)
    for replica, launch in zip(started, replicas, strict=True):
        fleet.replica_urls.setdefault(launch.model, []).append(replica.url)
    return replicas


def smoke(url: str, model: str, api_key: str | None = None) -> dict[str, Any]:
    """One completion through ``url`` (the coordinator) with the ``openai`` client: the answer, the model that
    served it, the seconds.

    Raises:
        ExitplanError: when the coordinator does not answer it.
    """
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=300)
    started = time.perf_counter()
    try:
        raw = client.completions.with_raw_response.create(model=model, prompt="What is 2 + 3? Answer:", max_tokens=8)
    except openai.APIError as exc:
        raise ExitplanError(f"the smoke request through {url} failed: {exc}") from exc
    answer = raw.parse()
    return {"text": answer.choices[0].text, "served_by": raw.headers.get("x-exitplan-model", ""),
            "seconds": time.perf_counter() - started, "usage": answer.usage.model_dump() if answer.usage else {}}


@dataclass
class Rendered:
    """The champion, rendered.

    Attributes:
        version: Champion version.
        plan: Its plan.
        router: Its routing model, written beside the launch files.
        replicas: Its replicas.
        files: Files written.
        missing_partials: Cuts its partial replicas serve that this machine could not put in the bundle (their
            models are not fetched here).
    """

    version: str
    plan: Plan
    router: Path | None
    replicas: list[ReplicaLaunch]
    files: list[Path]
    missing_partials: list[str] = field(default_factory=list)


def render_champion(params: Params) -> Rendered:
    """Read the ``champion`` plan (and its routing model) from the registry and write its launch files.

    Raises:
        ExitplanError: when there is no champion (promote one first).
    """
    from exitplan import tracking
    from exitplan.atomic import write_atomic
    from exitplan.catalog import load_catalog

    name = params.plan.registered_model
    champion = tracking.alias_version(params.tracking, params.root, name, "champion")
    if champion is None:
        raise ExitplanError(f"{name} has no 'champion': promote a plan first (`exitplan promote`)")
    version = champion["version"]
    plan = parse_plan(tracking.plan_artifact(params.tracking, params.root, name, version),
                      f"plan.json of {name} version {version}")
    out = params.path(params.deploy.output_dir)
    router: Path | None = None
    try:
        blob = tracking.plan_artifact(params.tracking, params.root, name, version, file_name=ROUTER_FILE)
        router = write_atomic(out / ROUTER_FILE, lambda tmp: Path(tmp).write_bytes(blob))
    except FileNotFoundError:
        router = None  # a plan registered before routing models travelled with plans
    catalog = load_catalog(params.path(params.catalog))
    replicas = render(plan, catalog, params.simulator.engine, params.deploy.base_port,
                      "0.0.0.0" if params.deploy.bind_all else "127.0.0.1")
    files = write_launch_files(out, replicas, fleet_config(plan, replicas, params, router), version,
                               params.deploy.api_key_env, params.deploy.require_api_key)
    missing = bundle_partials(params, replicas, out, {m: catalog.llm(m).num_layers for m in plan.model_ids})
    return Rendered(version, plan, router, replicas, files, missing)
