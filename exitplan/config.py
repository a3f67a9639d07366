"""The typed configuration tree, loaded once from ``params.yaml``.

One section per stage. Every field has a docstring (shown by ``exitplan check-config --explain``) and declared
bounds. Paths are relative to the folder that holds ``params.yaml``. No other module reads ``params.yaml``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from exitplan.errors import ConfigError
from exitplan.kinds import ArrivalKind, ConfidenceKind, HeadKind
from exitplan.yaml_model import StrictModel, load_yaml_model

if TYPE_CHECKING:
    from exitplan.catalog import Catalog

DatasetName = Literal["sharegpt", "gsm8k", "mtbench", "humaneval", "aclsum"]
"""The packaged real data sets a workload can draw from (see ``exitplan.workload.sources``)."""


DEFAULT_PARAMS = "params.yaml"

Probability = Annotated[float, Field(ge=0, le=1)]
"""A share or a confidence threshold, in [0, 1]."""


class TrackingParams(StrictModel):
    """Where and how stage runs are recorded (MLflow)."""

    enabled: bool = True
    """Log each stage run (params, metrics, small artifacts) to MLflow. Off only for quick local experiments."""

    experiment: str = Field(default="exitplan", min_length=1)
    """MLflow experiment the stage runs are logged under."""

    tracking_uri: str | None = None
    """MLflow tracking URI. Empty: ``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///mlflow.db`` in the repo."""


class RuntimeParams(StrictModel):
    """How the stages that run the real models use this machine. Execution settings, not pipeline inputs: no stage
    lists them as a DVC parameter, so changing them never re-runs anything."""

    model_threads: int = Field(default=1, ge=1, le=256)
    """torch threads for the stages that run real models (``MODEL_STAGES`` in ``exitplan.runtime``: train_exits,
    exit_profile, label_quality, online_profile, gate). Everything else, the tests and the benchmarks keep one
    thread (``OMP_NUM_THREADS=1``): BoTorch's small ops were 3-10x slower on two threads here, while a Qwen-1.5B
    forward of 256 tokens was 1.5x faster (9.4 s -> 6.1 s) and a batch-8 decode step 1.2x. profile_device keeps one
    thread on purpose: it calibrates the simulator for the engine as the benchmarks run it."""

    parallel_stages: int = Field(default=2, ge=1, le=256)
    """How many pipeline stages the ``plan_fleet`` flow runs at once where dvc.yaml's DAG allows (each its own
    ``dvc repro``; ``exitplan.stage_schedule``). The stages that time the engines, and build_perf_db, still run
    alone (``SOLO_STAGES`` in ``exitplan.runtime``); a model stage run beside others takes ``model_threads //
    parallel_stages`` torch threads (at least one). 1: one stage after the other. Memory: the two largest model
    stages side by side (train_exits of the 1.5B and label_quality) must fit."""

    preload_tcmalloc: bool = True
    """Run those stages with tcmalloc preloaded (``exitplan.runtime.TCMALLOC``, where installed; the process
    re-executes itself once with ``LD_PRELOAD``). glibc hands every allocation over 32 MB back to the kernel when
    it is freed, so each vocabulary-sized logits tensor (512 tokens x 151,936 floats: 311 MB) was faulted in page by
    page again: exit_profile took 212 s, 2 min 42 s of it in the kernel, and 101 s with tcmalloc (18 s in the
    kernel), same outputs."""


class DaskParams(StrictModel):
    """Where the embarrassingly parallel sweeps (the perf DB) run: ``dask.distributed`` workers. Execution settings,
    not pipeline inputs: no stage lists them as a DVC parameter, and the results do not depend on them."""

    scheduler_address: str | None = None
    """A running Dask scheduler to send the sweeps to (``tcp://host:8786``; workers on other machines attach to it
    with ``dask worker tcp://host:8786``). Null: a local cluster of ``workers`` processes, started per sweep."""

    workers: int | None = Field(default=None, ge=1, le=256)
    """Worker processes of the local cluster. Null: one per core of this machine. 1 (and no scheduler): the sweep
    runs in the stage's own process, with no cluster."""

    threads_per_worker: int = Field(default=1, ge=1, le=64)
    """Threads of each local worker. The simulator is pure Python (it holds the GIL): more processes, not threads."""

    dashboard_address: str = Field(default="127.0.0.1:8787", pattern=r"^[\w.\-\[\]:]*:\d+$")
    """Where the local cluster's dashboard listens (``host:port``; port 0 picks a free one). Loopback by default:
    Dask's ``--no-dashboard`` still listens on every interface, so the address is always given."""


class FetchModelsParams(StrictModel):
    """Stage ``fetch_models``: assemble embedded models from their packages into safetensors checkpoints."""

    models: list[str] = Field(min_length=1)
    """Hugging Face ids of catalog models (or embedders) that have a ``source``; one checkpoint each."""

    checkpoint_dir: str = "model_repository/checkpoints"
    """Folder of the checkpoints: ``<checkpoint_dir>/<hf id>/`` (a DVC output, never in git)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the dequantised GGUF weights are saved in. float32 keeps the dequantised values exactly."""

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[str]) -> list[str]:
        duplicates = sorted({m for m in models if models.count(m) > 1})
        if duplicates:
            raise ValueError(f"listed more than once: {duplicates}")
        return models


class TraceParams(StrictModel):
    """One request set: which queries, how many, and when they arrive."""

    name: str
    """File stem of the trace (``<output_dir>/trace_<name>.parquet``): lower-case letters, digits, ``_`` or ``-``."""

    arrival: ArrivalKind = "poisson"
    """Arrival process of the requests."""

    qps: float = Field(default=4.0, gt=0, le=100_000)
    """Mean arrival rate in requests per second (for ``replay``: timestamps are rescaled to it)."""

    num_requests: int = Field(default=1000, ge=1, le=1_000_000)
    """Number of requests in the trace. Cost: a row each, no model call."""

    burstiness: float = Field(default=1.0, gt=0, le=1000)
    """Gamma shape factor (vLLM's ``--burstiness``): 1 is Poisson, < 1 burstier, > 1 more regular."""

    timestamps_file: str | None = None
    """For ``replay``: a CSV or Parquet file with an ``arrival_s`` column of arrival times in seconds."""

    mix: dict[DatasetName, NonNegativeFloat] = Field(default_factory=lambda: {"sharegpt": 1.0})  # type: ignore[arg-type]
    """Share of requests drawn from each data set (weights, normalised to sum 1)."""

    @field_validator("name")
    @classmethod
    def _name_is_a_file_stem(cls, name: str) -> str:
        if not re.fullmatch(r"[a-z0-9_-]+", name):
            raise ValueError("use lower-case letters, digits, '_' or '-'")
        return name

    @field_validator("mix")
    @classmethod
    def _weights(cls, mix: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError("weights must be >= 0 with a positive sum")
        return mix

    @model_validator(mode="after")
    def _replay_needs_timestamps(self) -> TraceParams:
        if self.arrival == "replay" and not self.timestamps_file:
            raise ValueError("arrival 'replay' needs timestamps_file")
        return self


class PrepareWorkloadParams(StrictModel):
    """Stage ``prepare_workload``: real query sets with token lengths, and request traces from them."""

    tokenizer_model: str = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    """Catalog model whose fetched tokenizer counts the tokens (its checkpoint must be in ``fetch_models``)."""

    datasets: list[DatasetName] = Field(min_length=1)
    """Data sets to read from their packages."""

    max_queries_per_dataset: int = Field(default=2000, ge=1, le=1_000_000)
    """At most this many queries per data set (a seeded sample when the set is larger). Cost: tokenising them."""

    max_prompt_tokens: int = Field(default=4096, ge=1)
    """Traces draw only queries whose prompt has at most this many tokens (the query table keeps all)."""

    max_output_tokens: int = Field(default=4096, ge=1)
    """Traces draw only queries whose reference output has at most this many tokens."""

    seed: int = Field(default=0, ge=0)
    """Seed of the query sampling and of every arrival process."""

    traces: list[TraceParams] = Field(min_length=1)
    """The request sets to build."""

    output_dir: str = "data/workload"
    """Folder of the Parquet outputs (a DVC output)."""

    @model_validator(mode="after")
    def _traces_use_loaded_datasets(self) -> PrepareWorkloadParams:
        for i, trace in enumerate(self.traces):
            missing = sorted(set(trace.mix) - set(self.datasets))
            if missing:
                raise ValueError(f"traces.{i}.mix names data sets not in datasets: {missing}")
        names = [t.name for t in self.traces]
        if len(set(names)) != len(names):
            raise ValueError(f"trace names must be unique: {names}")
        return self


class EngineParams(StrictModel):
    """Knobs of a vLLM-style serving engine (vLLM's names and defaults), as the simulator models them."""

    max_num_seqs: int = Field(default=256, ge=1, le=65_536)
    """Most sequences in one running batch (vLLM ``max_num_seqs``)."""

    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Most tokens in one iteration. Empty: 2048 with chunked prefill, else max(max_model_len, 2048) (vLLM V0)."""

    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV-cache block (vLLM ``block_size``)."""

    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Share of GPU memory the engine may use; KV capacity = this x memory - weights (per GPU)."""

    enable_chunked_prefill: bool = False
    """Split prompts into chunks that share iterations with decodes (else prefill-first, vLLM V0's default)."""

    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt + output accepted. Empty: the model's ``max_position_embeddings``."""

    step_overhead_s: float = Field(default=1e-3, ge=0, le=1)
    """Fixed engine cost per iteration in seconds (scheduling, sampling, kernel launches)."""

    seq_overhead_s: float = Field(default=0.0, ge=0, le=1)
    """Engine cost per sequence per iteration in seconds (0 for vLLM's fused kernels; this repo's CPU engine loops
    over sequences for attention and sampling, and ``profile_device`` fits its value)."""

    prompt_overhead_s: float = Field(default=0.0, ge=0, le=1)
    """Engine cost per request in seconds, paid in the iteration that starts its prompt (a vLLM CPU replica's API
    server works on each request on the engine's own core; ``profile_vllm`` fits it from its single prefills)."""

    watermark: float = Field(default=0.01, ge=0, lt=1)
    """Share of KV blocks kept free when admitting a prompt (vLLM's block-manager watermark)."""

    def batched_tokens(self, max_model_len: int) -> int:
        """The token budget of one iteration in force."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)


class SimulatorParams(StrictModel):
    """The inference simulator's engine defaults (used by ``exitplan simulate`` and ``build_perf_db``)."""

    engine: EngineParams = Field(default_factory=EngineParams)
    """vLLM-style engine knobs."""


class BuildPerfDbParams(StrictModel):
    """Stage ``build_perf_db``: simulate every feasible deployment of the scenario models at every load."""

    models: list[str] = Field(min_length=1)
    """Catalog models of the scenarios (not the whole catalog)."""

    gpus: list[str] = Field(min_length=1)
    """Catalog GPU types to deploy them on."""

    qps: list[float] = Field(default_factory=lambda: [float(q) for q in range(2, 41, 2)], min_length=1)
    """Load grid in requests per second (BOUTE: 2, 4, ..., 40)."""

    requests_per_point: int = Field(default=1000, ge=50, le=1_000_000)
    """Requests simulated at each grid point: enough for a stable P99. Cost: about 0.1 s per point."""

    lengths_trace: str = "gsm8k-100qps"
    """Trace of ``prepare_workload.traces`` whose (prompt, output) lengths the requests are drawn from (for the
    models ``model_lengths`` does not cover, on the catalog GPUs; the local vLLM sweep takes the workload's)."""

    model_lengths: str | None = "data/imported_labels/lengths.parquet"
    """Per-model (prompt, output) lengths (``import_labels``' real answer lengths): a model with rows there is
    simulated with its own lengths instead of ``lengths_trace``'s (null: ``lengths_trace`` for every model)."""

    max_gpus_per_replica: int = Field(default=8, ge=1, le=64)
    """Largest TP x PP of one replica."""

    layer_fractions: list[float] = Field(default_factory=lambda: [1.0], min_length=1)
    """Shares of the layers a replica holds (1.0 = full model; below 1: partial early-exit replicas)."""

    partial_layers: dict[str, list[PositiveInt]] = Field(default_factory=dict)
    """Model -> layer counts of partial replicas swept besides ``layer_fractions``: the exits a plan may cut the
    model to (a scenario with ``depths`` plans over them)."""

    seed: int = Field(default=0, ge=0)
    """Seed of the sampled lengths and arrivals."""

    vllm_device: bool = True
    """Also sweep the vLLM replicas of this machine: ``profile_vllm``'s fitted device (``profile_vllm.device_id``)
    for the models of ``profile_vllm.models`` that are in ``models``, with the engine knobs they ran with, on
    ``vllm_qps``, with the workload's own prompt and answer lengths (``queries.parquet``: what the local fleet is
    sent), so a scenario can plan for the vLLM fleet that runs here."""

    vllm_qps: list[float] = Field(default_factory=lambda: [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0],
                                  min_length=1)
    """Load grid of the local vLLM device in requests per second (a CPU serves well under 1 req/s)."""

    vllm_max_output_len: int = Field(default=64, ge=1, le=4096)
    """Answers of the local vLLM sweep are cut to this many tokens (the local plan's answers; fleet_vs_plan
    replays the same cut)."""

    output_dir: str = "data/perf_db"
    """Folder of ``perf_db.parquet`` (a DVC output)."""

    @field_validator("qps", "layer_fractions", "vllm_qps")
    @classmethod
    def _positive(cls, values: list[float]) -> list[float]:
        if any(v <= 0 for v in values):
            raise ValueError("every value must be > 0")
        return values

    @field_validator("layer_fractions")
    @classmethod
    def _at_most_one(cls, values: list[float]) -> list[float]:
        if any(v > 1 for v in values):
            raise ValueError("layer fractions are at most 1.0")
        return values


class TrainExitsParams(StrictModel):
    """Stage ``train_exits``: fit exit heads on a frozen backbone, per candidate model (DVC ``foreach``)."""

    models: list[str] = Field(min_length=1)
    """Fetched models to give exit heads (each a ``fetch_models`` checkpoint)."""

    exit_every: int = Field(default=4, ge=1)
    """An exit after every this many layers (the last layer needs none)."""

    exits_from_end: list[int] = Field(default_factory=list)
    """Extra exits counted back from the last layer (2: after layer L-2), where agreement climbs fastest."""

    head_kinds: list[HeadKind] = Field(default_factory=lambda: ["affine", "block"])  # type: ignore[arg-type]
    """Exit-head kinds to fit and compare (``identity`` = the plain final norm + LM head, the baseline)."""

    datasets: list[DatasetName] = Field(default_factory=lambda: ["sharegpt", "gsm8k", "humaneval", "aclsum"])  # type: ignore[arg-type]
    """Data sets of the query table whose prompt + reference texts are the training and held-out tokens."""

    chunk_tokens: int = Field(default=128, ge=8, le=4096)
    """Tokens per training sequence."""

    train_chunks: int = Field(default=32, ge=1)
    """Training sequences (train tokens = chunk_tokens x train_chunks). Cost: one forward pass of the model."""

    eval_chunks: int = Field(default=16, ge=1)
    """Held-out sequences, from queries disjoint from the training ones."""

    top_k: int = Field(default=64, ge=2, le=4096)
    """Teacher tokens kept per position for distillation and KL."""

    ridge: float = Field(default=0.01, gt=0)
    """Ridge penalty of the affine heads (relative to the mean input variance)."""

    block_steps: int = Field(default=100, ge=0)
    """Optimiser steps per block head. Cost: roughly one layer's forward + backward on 2 sequences per step."""

    block_lr: float = Field(default=3e-4, gt=0)
    """Learning rate of the block heads (AdamW)."""

    block_loss: Literal["full_ce", "topk_kl"] = "full_ce"
    """Distillation loss: cross-entropy of the full-vocabulary student on the teacher's top-k (penalises leaked
    mass), or KL restricted to the top-k (cheaper, but leaves the rest of the vocabulary unconstrained)."""

    block_batch: int = Field(default=2, ge=1)
    """Sequences per block-head step."""

    block_positions: int | None = Field(default=32, ge=1)
    """Positions per sequence that enter the loss of a step (empty: all). The vocabulary projection dominates a
    step's cost, so fewer positions make steps cheaper while the head still attends over the whole sequence."""

    thresholds: list[Probability] = Field(default_factory=lambda: [0.5, 0.8, 0.9], min_length=1)
    """Confidence thresholds at which confident shares and agreements are reported."""

    seed: int = Field(default=0, ge=0)
    """Seed of the query split and of training."""

    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Precision of the frozen backbone's passes: the forward pass that caches the hidden states and the teacher's
    distributions, and the vocabulary projection of the held-out evaluation. ``bfloat16`` runs them as the engine
    serves the model (packed for oneDNN where the CPU has bfloat16 kernels), so the heads learn the served model's
    final layer; the heads themselves always train and are saved in float32. A half precision runs as float32 on a CPU
    without bfloat16 kernels (AVX2, or AVX512 without BF16; :mod:`exitplan.cpu_features`)."""

    output_dir: str = "model_repository/exits"
    """Folder of the exit checkpoints: ``<output_dir>/<hf id>/`` (a DVC output)."""

    @field_validator("exits_from_end")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("exits_from_end counts layers back from the last one: each must be >= 1")
        return values

    def exit_layers(self, num_layers: int) -> list[int]:
        """The exit layers (1-based, increasing, all below ``num_layers``) of a model with ``num_layers`` layers."""
        every = range(self.exit_every, num_layers, self.exit_every)
        back = (num_layers - k for k in self.exits_from_end if num_layers - k >= 1)
        return sorted({*every, *back})


class ExitProfileParams(StrictModel):
    """Stage ``exit_profile``: HELIOS's observations on held-out prompts, per model and confidence threshold.

    The exits are observed as the engine serves them: in ``helios.dtype``, under ``helios.confidence``.
    """

    models: list[str] = Field(min_length=1)
    """Models with exit checkpoints (from ``train_exits``); two sharing a tokenizer give complementarity."""

    head_kinds: list[HeadKind] = Field(
        default_factory=lambda: ["identity", "affine", "block"], min_length=1)  # type: ignore[arg-type]
    """Exit-head kinds to profile (each must have been trained by ``train_exits``); one forward pass serves all.
    Cost: one vocabulary projection per exit per token per kind."""

    datasets: list[DatasetName] = Field(default_factory=lambda: ["sharegpt", "gsm8k", "humaneval", "aclsum"])  # type: ignore[arg-type]
    """Held-out prompts come from these data sets (queries never used for training the heads)."""

    chunk_tokens: int = Field(default=128, ge=8, le=4096)
    """Tokens per profiled sequence."""

    chunks_per_dataset: int = Field(default=4, ge=1)
    """Sequences per data set. Cost: one forward pass plus one vocabulary projection per exit per token."""

    thresholds: list[float] = Field(default_factory=lambda: [0.5, 0.7, 0.8, 0.9], min_length=1)
    """Confidence thresholds to profile."""

    early_depth: float = Field(default=0.5, gt=0, le=1)
    """A token "exits early" when it is confident at an exit no deeper than this share of the layers."""

    output_dir: str = "data/exit_profile"
    """Folder of ``profile.parquet`` (per token: model, data set, first confident exit per threshold)."""

    @field_validator("thresholds")
    @classmethod
    def _probabilities(cls, values: list[float]) -> list[float]:
        if any(not 0 < v < 1 for v in values):
            raise ValueError("thresholds are confidences strictly between 0 and 1")
        return values


class ProfileDeviceParams(StrictModel):
    """Stage ``profile_device``: step times of the candidates on this machine, and the simulator's device fitted."""

    models: list[str] = Field(min_length=1)
    """Fetched models to time (the HELIOS candidates)."""

    device_id: str = Field(default="local-cpu", pattern=r"^[a-z0-9-]+$")
    """Id of the fitted device entry (written next to the catalog's GPUs, in the stage's output)."""

    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    """Decode batch sizes timed."""

    contexts: list[PositiveInt] = Field(default_factory=lambda: [64, 256], min_length=1)
    """Cached context per sequence of the timed decode steps."""

    prefill_lengths: list[PositiveInt] = Field(default_factory=lambda: [16, 64, 256], min_length=1)
    """Prompt lengths of the timed prefill passes."""

    partial_depth: float | None = Field(default=0.5, gt=0, lt=1)
    """Also time decode steps of a partial model holding this share of the layers (empty: full depth only)."""

    repeats: int = Field(default=3, ge=1)
    """Timed repetitions per point (the median is kept)."""

    memory_gib: float | None = Field(default=None, gt=0)
    """Memory the device offers (empty: this machine's RAM)."""

    price_per_hour: float = Field(default=0.10, gt=0)
    """Rental price of this device in US$/h (a 2-vCPU cloud VM is about $0.10/h)."""

    output_dir: str = "data/device_profile"
    """Folder of ``steps.parquet`` (measured points) and ``device.yaml`` (the fitted entry)."""


class ProfileVllmParams(StrictModel):
    """Stage ``profile_vllm``: vLLM's step times on this machine (CPU replicas as ``exitplan deploy`` starts them,
    one core each), and the simulator's device fitted to them, so that plans for vLLM here can be simulated."""

    models: list[str] = Field(min_length=1)
    """Fetched models to serve and time (each on its own vLLM replica)."""

    device_id: str = Field(default="vllm-cpu", pattern=r"^[a-z0-9-]+$")
    """Id of the fitted device entry."""

    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 4, 8, 16], min_length=1)
    """Decode batch sizes timed (concurrent streams; at most ``vllm.max_num_seqs``)."""

    contexts: list[PositiveInt] = Field(default_factory=lambda: [64, 256, 1024], min_length=1)
    """Prompt tokens of each stream of the timed decode steps (a long one sets the KV reads' rate,
    ``Efficiency.kv_memory``)."""

    prefill_lengths: list[PositiveInt] = Field(default_factory=lambda: [32, 128, 512, 1024, 2048], min_length=1)
    """Prompt lengths of the timed single-request prefills (long ones set attention's rate,
    ``Efficiency.attention``)."""

    tokens: int = Field(default=16, ge=4, le=1024)
    """Output tokens of each decode stream (its events are the timed steps)."""

    repeats: int = Field(default=2, ge=1, le=20)
    """Timed repetitions per point, after one warm-up (the median is kept)."""

    neighbour_batches: list[PositiveInt] = Field(default_factory=lambda: [1, 4, 16], min_length=1, max_length=8)
    """Batch sizes of the neighbour-slowdown grid, increasing: each replica timed at each, beside every other
    replica decoding each (what a replica loses to a busy neighbour depends on both batches)."""

    neighbour_repeats: int = Field(default=3, ge=1, le=20)
    """Alone/beside pairs per cell of the neighbour grid, after one warm-up pair (the mean ratio is kept: the
    neighbour's effect comes and goes between pairs, and a fleet's requests see its mean)."""

    memory_gib: float | None = Field(default=None, gt=0)
    """Memory the device offers (empty: this machine's RAM)."""

    price_per_hour: float = Field(default=0.10, gt=0)
    """Rental price of this device in US$/h (the same 2-vCPU machine as ``profile_device``)."""

    output_dir: str = "data/vllm_profile"
    """Folder of ``steps.parquet`` (measured points, with the fit's predictions) and ``device.yaml``."""

    @model_validator(mode="after")
    def _contexts_fit(self) -> ProfileVllmParams:
        if sorted(set(self.neighbour_batches)) != self.neighbour_batches:
            raise ValueError(f"profile_vllm.neighbour_batches must increase; got {self.neighbour_batches}")
        for key, longest in (("contexts", max(self.contexts) + self.tokens),
                             ("prefill_lengths", max(self.prefill_lengths) + 1)):
            if longest > 131_072:
                raise ValueError(f"profile_vllm.{key}: {longest} tokens per request is more than any replica "
                                 "accepts (131,072)")
        return self


class PartialCut(StrictModel):
    """One partial-layer checkpoint: ``model`` cut to its first ``layers`` decoder layers."""

    model: str
    """Fetched model (HF id)."""

    layers: PositiveInt
    """Decoder layers kept (fewer than the model's)."""


class PartialCheckpointsParams(StrictModel):
    """Stage ``partial_checkpoints``: the truncated checkpoints partial (early-exit) vLLM replicas serve: the first
    L layers, the final norm and the head, as an ordinary model (vLLM cannot drop layers of a checkpoint). Every
    partial replica of a plan (a group holding fewer layers than its model) whose model is fetched here gets one,
    and so does every entry of ``cuts``."""

    cuts: list[PartialCut] = Field(default_factory=list)
    """Cuts to write besides the plans' partial replicas."""

    output_dir: str = "data/partial"
    """Folder of the cuts: ``<output_dir>/<hf id>-L<layers>/`` (in ``vllm.dtype``; a DVC output)."""


class SelectCandidatesParams(StrictModel):
    """Stage ``select_candidates``: HELIOS step 1, the Top-K candidates for an SLO on this hardware."""

    top_k: int = Field(default=3, ge=1)
    """Candidates kept (HELIOS: 3)."""

    slo_tpot_ms: float = Field(default=1000.0, gt=0)
    """Largest predicted time per output token (ms) at the candidate's memory-bound batch."""

    lengths_trace: str = "mixed-gamma"
    """Trace whose mean prompt + output length sizes the KV of a sequence."""

    output: str = "data/helios/candidates.json"
    """Ranked candidates (JSON)."""


class LabelQualityParams(StrictModel):
    """Stage ``label_quality``: per-query quality of each candidate, measured by running it (BOUTE's labels)."""

    models: list[str] = Field(min_length=1)
    """Fetched models to label here."""

    datasets: list[DatasetName] = Field(default_factory=lambda: ["gsm8k", "humaneval", "sharegpt", "aclsum",  # type: ignore[arg-type]
                                                                 "mtbench"])
    """Data sets of the query table to label."""

    queries_per_dataset: int = Field(default=16, ge=2)
    """Queries per data set (a seeded sample). Cost: one teacher-forced pass each per model."""

    max_prompt_tokens: int = Field(default=128, ge=8)
    """Prompt tokens kept (the prompt is cut, then wrapped in the chat template)."""

    max_reference_tokens: int = Field(default=64, ge=1)
    """Reference tokens scored."""

    gsm8k_generate: int = Field(default=12, ge=0)
    """GSM8K queries also answered by generation and labelled by exact match (0: reference score only)."""

    max_new_tokens: int = Field(default=320, ge=1)
    """Generation limit for the GSM8K answers."""

    batch_size: int = Field(default=12, ge=1)
    """Generation batch. Decoding is memory-bound here: one batch of 12 answers costs little more per step than 8,
    so the default answers every GSM8K query in one batch (half the decode steps of 8 + 4)."""

    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Dtype the labelling model runs in. bfloat16 is what these models are served in (vLLM's default for Qwen2.5,
    whose weights were trained in it) and, on a CPU with AVX512-BF16, halves the time of a forward pass and of a
    decode step against float32. A half precision runs as float32 on a CPU without bfloat16 kernels (AVX2, or AVX512
    without BF16;
    :mod:`exitplan.cpu_features`)."""

    user_labels: str | None = None
    """CSV of labels for models that cannot run here (columns model, dataset, query_id, quality)."""

    depths: dict[str, list[PositiveInt]] = Field(default_factory=dict)
    """Model -> exits (layers) labelled too, the same way: the model cut there answers through its own final norm
    and head (the truncated checkpoint a partial vLLM replica serves). A planner scenario that plans depth takes
    these per-query labels for that depth instead of the exit profile's rule. Cost: a whole model's labels each."""

    seed: int = Field(default=0, ge=0)
    """Seed of the query sample."""

    output_dir: str = "data/labels"
    """Folder of ``labels.parquet``."""


class AnnotationFile(StrictModel):
    """One model's AlpacaEval annotation file, pinned by its SHA-256 (the stage refuses a file that differs)."""

    name: str = Field(pattern=r"^[^/\\.][^/\\]*$")
    """File name inside ``import_labels.source_dir`` (a plain name)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the file: what the stage's outputs were built from (DVC re-runs the stage when it changes)."""


class ImportLabelsParams(StrictModel):
    """Stage ``import_labels``: per-query labels of models that cannot run here, from AlpacaEval annotation files
    (a judge's preferences on the chat fine-tunes of the catalog's Llama-2 architectures; see
    ``exitplan/routing/alpaca_eval.py``). Token counts use ``prepare_workload.tokenizer_model`` as a proxy.

    The folder lies outside the checkout and may be absent, so it is not a DVC dependency: each file is pinned
    here by its SHA-256 instead, which makes the stage re-run when a pin changes and refuse a file that no longer
    matches its pin."""

    source_dir: str = "../shared/labels/alpaca_eval"
    """Folder of the annotation files (relative to params.yaml). When it is absent the stage writes empty tables
    and the scenarios that need these labels are skipped, naming it."""

    files: dict[str, AnnotationFile] = Field(default_factory=dict)
    """Catalog model -> its annotation file (AlpacaEval's ``results/<model>/alpaca_eval_gpt4/annotations.json``)."""

    output_dir: str = "data/imported_labels"
    """Folder of ``labels.parquet`` (the ``label_quality`` rows), ``queries.parquet`` (the prompts) and
    ``lengths.parquet`` (each model's real answer lengths, for the perf DB)."""


class PlanScenario(StrictModel):
    """One co-optimisation scenario: models, GPUs, budget, load and SLO."""

    name: str = Field(pattern=r"^[a-z0-9-]+$")
    """Scenario id (outputs go to ``<output_dir>/<name>/``)."""

    models: list[str] = Field(min_length=2)
    """Models to route between, smallest first; each needs perf-DB rows and quality labels."""

    gpus: dict[str, PositiveInt] = Field(min_length=1)
    """GPU type -> GPUs available."""

    budget_per_hour: float = Field(gt=0)
    """US$/h cap."""

    load_qps: float = Field(gt=0)
    """Requests per second to serve."""

    max_p95_s: float | None = Field(default=None, gt=0)
    """SLO: P95 end-to-end latency cap in seconds (empty: none)."""

    min_quality: float = Field(default=0.0, ge=0, le=1)
    """SLO: quality floor (mean label of the routed queries)."""

    required: bool = True
    """A scenario that is not required is skipped, with a message naming what to supply, when its inputs (labels)
    are missing."""

    depths: bool = False
    """Plan each model's depth too: its replicas may hold any layer count the perf DB swept for it
    (``build_perf_db.partial_layers``), each of which must be one whose quality was measured - the exit profile's
    (``exit_profile``, identity exits) or ``depth_agreement``'s - or the plan stops naming it. False: full depth."""

    depth_agreement: dict[str, dict[PositiveInt, Probability]] = Field(default_factory=dict)
    """Model -> exit layer -> top-1 agreement of that exit with the full model, from a published early-exit-trained
    model's table (cite it beside the figures): used instead of the exit profile for these models."""

    quality_floor: float = Field(default=0.0, ge=0, le=1)
    """Quality of an answer a partial replica gets wrong, in the quality-by-depth rule
    (:mod:`exitplan.planner.depth`)."""

    traffic: Literal["labelled", "workload"] = "labelled"
    """The queries the plan is for: their routing scores are the router's window (the plan's thresholds are its
    quantiles, so a fraction of the plan is that share of them) and, on this machine's vLLM device, their lengths are
    what each model is routed (:mod:`exitplan.planner.routed`). ``labelled``: the labelled queries (AlpacaEval's, for
    the Llama-2 scenarios); ``workload``: ``plan.workload_sample`` of ``prepare_workload``'s queries, the traffic the
    local fleet is sent (the Qwen labels are 48 queries per data set, the workload is half ShareGPT)."""


class PlanParams(StrictModel):
    """Stage ``plan``: BOUTE's co-optimisation of routing and deployment, per scenario."""

    scenarios: list[PlanScenario] = Field(min_length=1)
    """Scenarios; the first is the one promoted."""

    metric: Literal["e2e_p95_s", "e2e_p99_s", "ttft_p95_s", "tpot_p95_s"] = "e2e_p95_s"
    """Latency metric of the perf DB that is optimised."""

    routing_train_share: float = Field(default=0.5, gt=0, lt=1)
    """Share of the labelled queries that trains the router; the rest measures Q(f)."""

    embedder: str = "sentence-transformers/all-MiniLM-L6-v2"
    """Fetched sentence embedder of the router."""

    fraction_steps: int = Field(default=20, ge=2)
    """Grid of load fractions for Q(f), the exhaustive front and the baselines (1/steps)."""

    budget_points: int = Field(default=12, ge=2)
    """Budgets of the knapsack grid for mixed-GPU candidates."""

    load_shares: list[float] = Field(default=[0.25, 0.5, 0.75, 1.0], min_length=1)
    """Shares of the scenario's load at which each model's candidates are enumerated and Pareto-skimmed (their
    union is kept): a model serves only its routed share, so a layout too small for the whole load can be the
    best for part of it. Each in (0, 1]."""

    workload_sample: int = Field(default=600, ge=16)
    """Workload queries scored for a ``traffic: workload`` scenario (seeded by ``seed``; MiniLM embeds about 11 a
    second here)."""

    routed_shares: list[float] = Field(default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], min_length=1)
    """Shares of the load at which a ``traffic: workload`` scenario's smallest and largest models are simulated on
    the lengths they are routed (this machine's vLLM device only; between two shares the curves are blended). Each in
    (0, 1]."""

    @field_validator("load_shares", "routed_shares")
    @classmethod
    def _shares_in_unit(cls, shares: list[float]) -> list[float]:
        bad = [s for s in shares if not 0 < s <= 1]
        if bad:
            raise ValueError(f"load shares must lie in (0, 1]; got {bad}")
        return sorted(set(shares))

    evaluations: int = Field(default=40, ge=4)
    """MOBO evaluations (perf-DB look-ups)."""

    initial: int = Field(default=8, ge=2)
    """Sobol evaluations before the first GP."""

    batch: int = Field(default=4, ge=1)
    """MOBO evaluations per round."""

    beta: float = Field(default=1.0, ge=0)
    """GPU-preference strength of the deployment kernel."""

    feasibility: Literal["constraint", "penalty"] = "constraint"
    """How MOBO treats plans that cannot carry their load: ``constraint`` models their headroom (log capacity /
    load) with a GP and constrains qLogNEHVI to headroom >= 0 (masking the pool to likely feasible plans);
    ``penalty`` counts them as twice the worst latency (the first design, kept for comparison)."""

    seed: int = Field(default=0, ge=0)
    """Seed of the router split, the Sobol design and the MC samplers."""

    registered_model: str = "exitplan-plan"
    """MLflow registered model the promoted scenario's plan becomes a version of (alias ``challenger``)."""

    output_dir: str = "data/plan"
    """Folder of the fronts and plans."""

    def registered_name(self, scenario: str) -> str:
        """The MLflow registered model of a scenario's plans: ``registered_model`` for the first (promoted)
        scenario, ``<registered_model>-<scenario>`` for the others."""
        return self.registered_model if scenario == self.scenarios[0].name else f"{self.registered_model}-{scenario}"


class HeliosParams(StrictModel):
    """The HELIOS engine (exitplan/engine): candidates, confidence guard, profiling cadence, memory."""

    candidates: list[str] = Field(min_length=1)
    """Models the engine may serve, each with an exit checkpoint from ``train_exits`` (HELIOS step 1 picks the
    Top-K of these)."""

    head_kind: HeadKind = "block"
    """Exit-head kind the engine uses."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights, activations and KV cache of the served models (and their exit heads). ``bfloat16`` halves the
    weight and KV bytes the memory budget counts (vLLM serves Qwen2.5 in it); float32 is what the PHT and the gate
    were measured in. Stage ``exit_profile`` observes the exits in it too (bfloat16 weights packed for oneDNN,
    :meth:`~exitplan.earlyexit.partial_model.EarlyExitLM.for_inference`; float32 is exact; under torch's CPU autocast
    instead the stage took 246 s here instead of 339 s in float32, every observation within 0.02). A half precision runs
    as float32 on a CPU without bfloat16 kernels (AVX2, or AVX512 without BF16; :mod:`exitplan.cpu_features`)."""

    pack_lm_head: bool = True
    """Hold a copy of the LM head packed for oneDNN where bfloat16 packing gains (as vLLM's CPU backend does): a
    decode step's largest matmul then runs ~1.3x faster, at the cost of ``vocab x hidden`` bfloat16 bytes that the
    memory budget counts (272 MB for Qwen2.5-0.5B, whose head is tied to its embeddings, so held twice); off, the KV
    pool gets those bytes (:mod:`exitplan.earlyexit.fused`)."""

    native_kernels: bool = True
    """Run the serving form's norms, rotary, KV-cache writes and decode attention through the C++ kernels
    (:mod:`exitplan.earlyexit.native`, bfloat16; built once per machine, about 30 s): a decode step of 16 sequences
    of Qwen2.5-0.5B 115-136 ms instead of 156-175 ms here. Off, or where no compiler builds them, the torch ops run
    (same maths; greedy answers may differ where bfloat16 rounding ties)."""

    threshold: float = Field(default=0.8, gt=0, le=1)
    """Confidence under which an exited token counts as a breach."""

    confidence: ConfidenceKind = "max_prob"
    """Confidence measure (HELIOS: maximum softmax probability); stage ``exit_profile`` observes under it too."""

    cbc_window: int = Field(default=100, ge=1)
    """Tokens of a request the confidence breach counter remembers (HELIOS: 100)."""

    cbc_max: int = Field(default=50, ge=0)
    """Breaches tolerated in the window before the engine loads layers or switches models (HELIOS: 50)."""

    profile_requests: int = Field(default=5, ge=1)
    """Requests each candidate serves while profiled (HELIOS: 5); they are answered."""

    reprofile_every: int = Field(default=150, ge=1)
    """Finished requests between profilings (HELIOS's RI: 150)."""

    max_num_seqs: int = Field(default=256, ge=1)
    """Largest batch."""

    block_size: int = Field(default=16, ge=1)
    """Token slots per KV block."""

    memory_budget_gib: float = Field(default=12.0, gt=0)
    """Weights + KV + layers being loaded may not exceed this (GiB)."""

    pht_path: str = "data/helios/pht.json"
    """Where the Performance History Table is kept."""

    @field_validator("cbc_max")
    @classmethod
    def _below_window(cls, value: int, info: ValidationInfo) -> int:
        """Fails on ``helios.cbc_max`` itself (its key path named), not on the section."""
        window = info.data.get("cbc_window")
        if window is not None and value >= window:
            raise ValueError(f"must be below cbc_window ({window}), got {value}")
        return value


class OnlineProfileParams(StrictModel):
    """Stage ``online_profile``: HELIOS's online profiling of the candidates on a request sample, into the PHT.

    The sample is the telemetry snapshot's requests when one exists (written by ``reprofile_fleet`` on drift), else
    held-out prompts of the workload (the embedded default).
    """

    requests: int = Field(default=16, ge=2)
    """Held-out prompts served when there is no telemetry snapshot (cycling over the workload's data sets)."""

    max_prompt_tokens: int = Field(default=96, ge=8)
    """Prompt tokens kept (chat template applied first; the prompt's end is kept)."""

    max_new_tokens: int = Field(default=24, ge=1)
    """Tokens generated per request."""

    reference_telemetry: str = "data/helios/reference_telemetry.parquet"
    """Per-request telemetry of the profiling run: the reference that re-profiling compares live traffic with."""


class GatesParams(StrictModel):
    """Stage ``gate`` and promotion: the plan is promoted only if its data and its served quality pass."""

    tolerance_rel: float = Field(default=0.01, ge=0)
    """Largest relative perplexity increase of HELIOS's outputs over full-depth outputs, and over the champion's
    (HELIOS reports +0.01 absolute)."""

    min_rouge2: float = Field(default=0.5, ge=0, le=1)
    """Smallest mean ROUGE-2 F1 of HELIOS's outputs against full-depth outputs of the same prompts."""

    em_tolerance: float = Field(default=0.25, ge=0, le=1)
    """Largest drop of GSM8K exact match under HELIOS against the full-depth labels of the same questions (with the
    default 4 questions: one answer may differ)."""

    requests: int = Field(default=8, ge=2)
    """Held-out prompts served per plan model: the ones after ``online_profile``'s in the same round-robin order
    over the data sets, so the two samples are disjoint."""

    memory_budget_gib: float = Field(default=8.0, gt=0)
    """Engine memory budget of the gate's runs. With one model per engine the PHT's exit depth does not depend on
    it (only the batch does), so it can be below ``helios.memory_budget_gib``; it must hold the largest model."""

    max_prompt_tokens: int = Field(default=96, ge=8)
    """Prompt tokens kept."""

    max_new_tokens: int = Field(default=24, ge=1)
    """Tokens generated per prompt."""

    gsm8k_queries: int = Field(default=4, ge=0)
    """Labelled GSM8K questions answered under HELIOS per plan model (0: no exact-match gate)."""

    gsm8k_max_new_tokens: int = Field(default=320, ge=1)
    """Generation limit of those answers (as ``label_quality.max_new_tokens``)."""

    min_trace_rows: int = Field(default=10, ge=1)
    """Fewest requests a workload trace may hold."""

    min_perf_db_rows: int = Field(default=10, ge=1)
    """Fewest perf-DB rows."""

    min_label_rows: int = Field(default=4, ge=1)
    """Fewest quality labels."""

    output_dir: str = "reports/gates"
    """Folder of ``gate.json`` (every expectation and its result) and the quality gate's engine telemetry."""


class ReprofileParams(StrictModel):
    """Flow ``reprofile_fleet``: drift of live traffic against the profiled reference, and the re-plan it triggers."""

    telemetry: str = "data/telemetry/live-*.parquet"
    """Per-request telemetry the serving engines persist (a glob joins every engine's file; the local fleet writes
    ``live-<port>.parquet``), or a running engine's ``/telemetry`` URL."""

    snapshot: str = "data/telemetry/snapshot/requests.parquet"
    """Where a drifted window is written: a DVC dependency of ``online_profile``, so a re-plan is DVC's decision."""

    window: int = Field(default=200, ge=4)
    """Most recent requests of the telemetry compared with the reference."""

    min_requests: int = Field(default=8, ge=2)
    """Fewer requests than this in the window: no test is run (too little evidence)."""

    alpha: float = Field(default=0.01, gt=0, lt=1)
    """Significance level of each test (chi-square on exit layers, Mann-Whitney on breach rates, KS on
    confidences)."""

    min_effect: float = Field(default=0.05, ge=0)
    """Smallest effect that counts as drift besides significance: total-variation distance of the exit-layer
    distributions, or shift of the mean breach rate or mean confidence."""

    interval_minutes: int = Field(default=60, ge=1)
    """Schedule of the deployed flow (prefect.yaml)."""


class DeployParams(StrictModel):
    """``exitplan deploy`` / flow ``deploy_fleet``: the champion plan as vLLM launch files, and a local fleet."""

    output_dir: str = "data/deploy"
    """Folder of the rendered launch files (one shell script per GPU host), ``replicas.json`` and ``fleet.json``."""

    fleet_name: str = Field(default="exitplan", min_length=1)
    """Model name clients send to the coordinator to be routed (a plan model's name pins it)."""

    host: str = "127.0.0.1"
    """Address the local servers bind (loopback by default)."""

    coordinator_port: int = Field(default=8000, ge=1, le=65535)
    """Port of the coordinator."""

    base_port: int = Field(default=8100, ge=1, le=65535)
    """First port of the replicas (vLLM's on GPU hosts, ours locally); one port per replica from there."""

    local_replicas_per_model: int = Field(default=1, ge=1)
    """Engine servers started here per plan model that runs here (the plan's weights are renormalised over them)."""

    local_kv_gib: float = Field(default=1.0, gt=0)
    """KV memory of each local engine server beyond its model's weights (GiB)."""

    max_context: int = Field(default=2048, ge=16)
    """Prompt + generation tokens a request may reserve on a local engine server."""

    max_queue: int = Field(default=64, ge=1)
    """Requests that may wait in a local engine server before it answers 429."""

    max_in_flight: int = Field(default=256, ge=1)
    """Requests in flight at the coordinator before it answers 429."""

    request_timeout_s: float = Field(default=120.0, gt=0)
    """Per-request time limit at the engine servers and per attempt at the coordinator."""

    cooldown_s: float = Field(default=5.0, gt=0)
    """How long the coordinator keeps a failed replica out of rotation."""

    routing_window: int = Field(default=512, ge=8)
    """Recent routing scores the coordinator re-cuts thresholds from."""

    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the local servers' ``/health``."""

    api_key_env: str = Field(default="EXITPLAN_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable holding the API key the servers require on every route but ``/health`` (unset: no
    key). Never passed on a command line; the rendered vLLM launch scripts read it from this variable too."""

    drain_s: float = Field(default=30.0, gt=0, le=3600)
    """Grace of a server's drain: after SIGTERM new requests get 503 with ``Retry-After`` and running ones may
    finish for this long; what still runs then ends with a clear error (503, or an error event in a stream)."""

    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest request body the servers accept (413 beyond), checked before anything parses or tokenises it."""

    max_attempts: int = Field(default=2, ge=1, le=16)
    """Replicas the coordinator tries for one request that fails on a replica (a 5xx, a lost connection) before
    the first byte reached its client; a replica's 429 moves the request on without counting here."""

    failure_threshold: int = Field(default=3, ge=1, le=1000)
    """Consecutive 5xx answers after which the coordinator takes a replica out of rotation (a lost connection or
    a failed health probe takes it out at once): one bad request cannot take out every replica of a model."""

    health_interval_s: float = Field(default=0.5, gt=0, le=60)
    """Seconds between the coordinator's active health probes of each replica (``GET /health``)."""

    require_api_key: bool = True
    """Rendered launch scripts refuse to start vLLM without the API key in ``api_key_env`` (off: no key)."""

    bind_all: bool = False
    """Rendered launch scripts bind vLLM to 0.0.0.0 (reachable from other hosts) instead of 127.0.0.1. Set it when
    the coordinator runs on another host; the scripts then still require the API key."""

    backend: Literal["exitplan", "vllm"] = "exitplan"
    """What serves the local replicas of ``exitplan deploy``: our HELIOS engine servers (``exitplan``) or vLLM's
    CPU build (``vllm``, from the environment ``vllm.venv``), one replica per plan replica this machine holds."""


class VllmParams(StrictModel):
    """vLLM as a process: its own environment (``make vllm-env``) and the settings of the replicas started here.

    The project never imports vLLM; it starts ``python -m vllm.entrypoints.openai.api_server`` from this
    environment and talks to it over HTTP."""

    venv: str = ".venv-vllm"
    """vLLM's virtual environment (built from ``requirements-vllm-cpu.lock`` by ``make vllm-env``)."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations of the vLLM replicas (``--dtype``). A half precision runs as float32 on a CPU without
    bfloat16 kernels (AVX2, or AVX512 without BF16; :mod:`exitplan.cpu_features`). GPU bundles keep it."""

    max_model_len: int = Field(default=4096, ge=64, le=131_072)
    """Longest prompt + output of a replica here (``--max-model-len``): unset, the CPU backend profiles a batch of
    the model's 32k positions for minutes at every start."""

    max_num_seqs: int = Field(default=16, ge=1, le=1024)
    """Most sequences in one batch of a replica here (``--max-num-seqs``)."""

    kv_cache_gib: int = Field(default=2, ge=1, le=1024)
    """KV cache of each CPU replica in GiB (``VLLM_CPU_KVCACHE_SPACE``): the CPU backend's memory setting."""

    threads_per_replica: int = Field(default=1, ge=1, le=256)
    """Cores pinned to each CPU replica (``VLLM_CPU_OMP_THREADS_BIND``); one was the fastest on 2 shared cores."""

    preload_allocators: bool = True
    """Preload tcmalloc (where installed) and the environment's libiomp5 into the replicas (``LD_PRELOAD``): batch-8
    throughput rose from 62-65 to 84 tok/s here."""

    startup_timeout_s: float = Field(default=1800.0, gt=0, le=7200)
    """How long to wait for a replica's ``/health`` (the CPU backend compiles its model at every start: 1-3 min on
    an AVX512 CPU; on an AVX2-only one the 0.5B took 10 min in bfloat16, beside another replica starting)."""

    memory_overhead_gib: float = Field(default=2.5, ge=0, le=1024)
    """RAM a CPU replica holds beyond its bfloat16 weights and KV cache (engine, compiled graphs, tokenizer), used
    to count the replicas this machine can hold."""


Port = Annotated[int, Field(ge=1024, le=65535)]
"""A TCP port a service of the production profile listens on (unprivileged)."""


class InfraParams(StrictModel):
    """``exitplan infra up|down|status``: the production profile on this machine. A private PostgreSQL cluster, a
    Prefect server and an MLflow tracking server on it, a process work pool and one worker; every service on
    127.0.0.1. Execution settings: no stage depends on them."""

    dir: str = ".infra"
    """Folder (git-ignored) of the profile's state: ``postgres/`` (the cluster and its password), ``mlartifacts/``
    (the artifacts the MLflow server stores), ``prefect/`` (the server's home), ``logs/`` and ``pids/``."""

    postgres_port: Port = 54329
    """Port of the PostgreSQL cluster (not 5432, so a system PostgreSQL can keep its own)."""

    postgres_bin: str | None = None
    """Folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``). Null: the newest ``/usr/lib/postgresql/*/bin``,
    else ``pg_ctl`` on PATH."""

    os_user: str = Field(default="exitplan", pattern=r"^[a-z_][a-z0-9_-]*$")
    """Unprivileged account PostgreSQL runs as when ``infra up`` runs as root (``initdb`` refuses root); created as a
    system user if missing. Ignored when not root: the cluster then runs as the calling user."""

    prefect_port: Port = 4200
    """Port of the Prefect server (API at ``http://127.0.0.1:<port>/api``, UI at the root)."""

    mlflow_port: Port = 5000
    """Port of the MLflow tracking server (``http://127.0.0.1:<port>``)."""

    artifacts_destination: str | None = None
    """Where the MLflow server stores run artifacts, proxied to clients through its ``mlflow-artifacts:`` API (clients
    never write there themselves). Null: ``<dir>/mlartifacts``; an ``s3://bucket/prefix`` URI works as well, with
    the server's AWS credentials in its environment."""

    work_pool: str = Field(default="exitplan-local", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    """The Prefect process work pool the deployments of prefect.yaml run on."""

    pool_concurrency: int = Field(default=1, ge=1, le=64)
    """Flow runs the work pool runs at once. 1: runs that call ``dvc repro`` on one checkout never overlap."""

    startup_timeout_s: float = Field(default=180.0, gt=0, le=3600)
    """How long ``infra up`` waits for each service's health check."""


class CalibrateParams(StrictModel):
    """``exitplan calibrate``: the reference probe re-run here, and how old a calibration may grow
    (:mod:`exitplan.profiling.calibration`)."""

    output_dir: str = "data/calibration"
    """Folder of the calibrations, one ``<stage>.yaml`` per profiled device (machine-local state: neither in git nor
    a DVC output, so a calibration never re-runs the pipeline)."""

    repeats: int = Field(default=7, ge=3, le=101)
    """Timed runs of each probe kind (the median is taken); 7 take about 6 s for Qwen2.5-1.5B's layer in float32."""

    max_age_h: float = Field(default=24.0, gt=0, le=8760)
    """Hours after which the last probe (the profiling's or the last calibration's) is reported stale."""


class Params(StrictModel):
    """The whole ``params.yaml``."""

    catalog: str = "model_repository/catalog.yaml"
    """The Model Repository catalog (GPUs, models, sources)."""

    tracking: TrackingParams = Field(default_factory=TrackingParams)
    """Experiment tracking (MLflow)."""

    runtime: RuntimeParams = Field(default_factory=RuntimeParams)
    """Execution settings (threads) of the stages that run the real models."""

    dask: DaskParams = Field(default_factory=DaskParams)
    """Execution settings of the parallel sweeps (Dask)."""

    fetch_models: FetchModelsParams
    """Stage ``fetch_models``."""

    prepare_workload: PrepareWorkloadParams
    """Stage ``prepare_workload``."""

    simulator: SimulatorParams = Field(default_factory=SimulatorParams)
    """The inference simulator."""

    build_perf_db: BuildPerfDbParams
    """Stage ``build_perf_db``."""

    train_exits: TrainExitsParams
    """Stage ``train_exits``."""

    exit_profile: ExitProfileParams
    """Stage ``exit_profile``."""

    helios: HeliosParams
    """The HELIOS serving engine."""

    profile_device: ProfileDeviceParams
    """Stage ``profile_device``."""

    select_candidates: SelectCandidatesParams = Field(default_factory=SelectCandidatesParams)
    """Stage ``select_candidates``."""

    profile_vllm: ProfileVllmParams
    """Stage ``profile_vllm``."""

    partial_checkpoints: PartialCheckpointsParams = Field(default_factory=PartialCheckpointsParams)
    """Stage ``partial_checkpoints``."""

    label_quality: LabelQualityParams
    """Stage ``label_quality``."""

    import_labels: ImportLabelsParams = Field(default_factory=ImportLabelsParams)
    """Stage ``import_labels``."""

    plan: PlanParams
    """Stage ``plan``."""

    online_profile: OnlineProfileParams = Field(default_factory=OnlineProfileParams)
    """Stage ``online_profile``."""

    gates: GatesParams = Field(default_factory=GatesParams)
    """Stage ``gate`` and promotion."""

    reprofile: ReprofileParams = Field(default_factory=ReprofileParams)
    """Flow ``reprofile_fleet``."""

    deploy: DeployParams = Field(default_factory=DeployParams)
    """Deployment of the champion plan."""

    vllm: VllmParams = Field(default_factory=VllmParams)
    """vLLM's environment and the vLLM replicas started here."""

    infra: InfraParams = Field(default_factory=InfraParams)
    """The production profile: PostgreSQL, Prefect and MLflow servers, a work pool and its worker."""

    calibrate: CalibrateParams = Field(default_factory=CalibrateParams)
    """``exitplan calibrate`` (the machine's drift since profiling)."""

    _root: Path = PrivateAttr(default_factory=Path.cwd)

    @model_validator(mode="after")
    def _profiled_models_have_exits(self) -> Params:
        missing = [m for m in self.exit_profile.models if m not in self.train_exits.models]
        if missing:
            raise ValueError(f"exit_profile.models {missing} are not in train_exits.models")
        return self

    @model_validator(mode="after")
    def _candidates_have_exits(self) -> Params:
        missing = [m for m in self.helios.candidates if m not in self.train_exits.models]
        if missing:
            raise ValueError(f"helios.candidates {missing} are not in train_exits.models (they need exit heads)")
        return self

    @model_validator(mode="after")
    def _helios_threshold_is_profiled(self) -> Params:
        if self.helios.threshold not in self.exit_profile.thresholds:
            raise ValueError(f"helios.threshold {self.helios.threshold} is not one of exit_profile.thresholds "
                             f"{self.exit_profile.thresholds} (candidate selection reads that profile)")
        if self.helios.head_kind not in self.exit_profile.head_kinds:
            raise ValueError(f"helios.head_kind '{self.helios.head_kind}' is not in exit_profile.head_kinds")
        missing = [m for m in self.helios.candidates if m not in self.exit_profile.models]
        if missing:
            raise ValueError(f"helios.candidates {missing} are not in exit_profile.models")
        traces = [t.name for t in self.prepare_workload.traces]
        if self.select_candidates.lengths_trace not in traces:
            raise ValueError(f"select_candidates.lengths_trace '{self.select_candidates.lengths_trace}' is not one "
                             f"of the prepare_workload traces {traces}")
        return self

    @model_validator(mode="after")
    def _perf_db_trace_exists(self) -> Params:
        traces = [t.name for t in self.prepare_workload.traces]
        if self.build_perf_db.lengths_trace not in traces:
            raise ValueError(f"build_perf_db.lengths_trace '{self.build_perf_db.lengths_trace}' is not one of the "
                             f"prepare_workload traces {traces}")
        return self

    @property
    def root(self) -> Path:
        """Folder of the ``params.yaml`` this tree was loaded from; relative paths resolve against it."""
        return self._root

    def path(self, relative: str) -> Path:
        """Resolve a path from the params against :attr:`root`."""
        p = Path(relative)
        return p if p.is_absolute() else self._root / p

    def checkpoint_path(self, model: str) -> Path:
        """Folder of the fetched checkpoint of ``model`` (a Hugging Face id)."""
        return self.path(self.fetch_models.checkpoint_dir) / model

    def fetched(self, model: str) -> Path:
        """The checkpoint folder of ``model``, which must have been fetched.

        Raises:
            ExitplanError: naming the model and the command that fetches it.
        """
        from exitplan.checkpoints import require_checkpoint

        return require_checkpoint(self.checkpoint_path(model), model)


def catalog_problems(params: Params, catalog: Catalog) -> list[str]:
    """Problems with what ``params`` names in the catalog: unknown models or GPUs, models with nothing to fetch."""
    from exitplan.catalog import Model

    problems = []
    for i, name in enumerate(params.fetch_models.models):
        entry = catalog.find_model(name)
        if entry is None:
            problems.append(f"fetch_models.models.{i}: '{name}' is not in the catalog")
        elif entry.source is None:
            problems.append(f"fetch_models.models.{i}: '{name}' has no source to fetch (simulated only)")
    for i, name in enumerate(params.build_perf_db.models):
        if not isinstance(catalog.find_model(name), Model):
            problems.append(f"build_perf_db.models.{i}: '{name}' is not a decoder model of the catalog")
    known = sorted(g.id for g in catalog.gpus)
    local = [params.profile_vllm.device_id] if params.build_perf_db.vllm_device else []
    for i, gpu in enumerate(params.build_perf_db.gpus):
        if not catalog.has_gpu(gpu):
            problems.append(f"build_perf_db.gpus.{i}: unknown GPU '{gpu}'; known: {known}")
    for i, name in enumerate(params.train_exits.models):
        if name not in params.fetch_models.models:
            problems.append(f"train_exits.models.{i}: '{name}' is not in fetch_models.models")
    for i, scenario in enumerate(params.plan.scenarios):
        for name in scenario.models:
            if not isinstance(catalog.find_model(name), Model):
                problems.append(f"plan.scenarios.{i}.models: '{name}' is not a decoder model of the catalog")
        for gpu in scenario.gpus:
            if not catalog.has_gpu(gpu) and gpu not in local:
                problems.append(f"plan.scenarios.{i}.gpus: unknown GPU '{gpu}'; known: {known + local}")
    for i, name in enumerate(params.label_quality.models):
        if name not in params.fetch_models.models:
            problems.append(f"label_quality.models.{i}: '{name}' is not in fetch_models.models")
    for i, name in enumerate(params.profile_device.models):
        if name not in params.fetch_models.models:
            problems.append(f"profile_device.models.{i}: '{name}' is not in fetch_models.models")
    tokenizer = params.prepare_workload.tokenizer_model
    if tokenizer not in params.fetch_models.models:
        problems.append(f"prepare_workload.tokenizer_model: '{tokenizer}' is not in fetch_models.models")
    return problems


def load_params(path: str | Path = DEFAULT_PARAMS, check_catalog: bool = True) -> Params:
    """Load and validate ``params.yaml``; with ``check_catalog``, also check every model it names is in the catalog.

    Raises:
        ConfigError: listing every problem with its YAML key path.
    """
    path = Path(path).resolve()
    params = load_yaml_model(path, Params, ConfigError)
    params._root = path.parent
    if check_catalog:
        from exitplan.catalog import load_catalog

        problems = catalog_problems(params, load_catalog(params.path(params.catalog)))
        if problems:
            raise ConfigError(str(path), problems)
    return params
