"""Step times of one replica from the GPU's specs: a roofline of compute and memory, plus TP and PP communication.

Prefill is compute-bound (FLOPs / effective TFLOPS), decode memory-bound (weight bytes + KV bytes read / effective
bandwidth); a step costs the larger of the two (the roofline), or their sum on a device that does not overlap them
(``Efficiency.overlap``: a fitted CPU core). Attention's query-key pairs and the KV-cache reads run at their own
rates (``Efficiency.attention``, ``Efficiency.kv_memory``: a CPU's attention kernels and paged KV gathers run well
below its GEMMs and weight streams), and a device fitted to several models holds each one's compute multiplier
(``Gpu.model_compute``). Tensor parallelism splits both over ``tp`` GPUs and
adds two all-reduces of the activations per layer (``comm``: vLLM's custom all-reduce or NCCL's ring, from the
GPU's link); pipeline parallelism splits layers over ``pp`` stages that a
token crosses one after another, with a send between stages (no micro-batch overlap: PP buys memory, not speed).
A replica may hold only ``layers`` of the model's layers (a partial early-exit model) plus an exit block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from exitplan.catalog import Gpu, Model
from exitplan.errors import SimulationError
from exitplan.simulator.comm import Interconnect

PARTIAL_EXIT_LAYERS = 0
"""Exit-block layers of a partial replica as ``exitplan deploy`` serves it: none. It is a truncated checkpoint
(:mod:`exitplan.vllm.truncate`) answering through the model's own final norm and head at the cut (the identity exit),
not an EE-Tuning exit block (:attr:`ReplicaSpec.exit_head_layers`' default, our HELIOS engine's block heads)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica runs on.

    Attributes:
        model: The model (architecture numbers).
        gpu: The GPU type; all ``tp * pp`` GPUs of the replica are of it.
        tp: Tensor-parallel degree (inside one node).
        pp: Pipeline-parallel degree.
        layers: Decoder layers held (a partial early-exit model when below ``model.num_layers``).
        exit_head_layers: Extra transformer layers of the exit head of a partial model (EE-Tuning's exit block).
    """

    model: Model
    gpu: Gpu
    tp: int = 1
    pp: int = 1
    layers: int | None = None
    exit_head_layers: int = 1

    def __post_init__(self) -> None:
        problems = validate_parallelism(self.model, self.gpu, self.tp, self.pp, self.held_layers)
        if problems:
            raise SimulationError("; ".join(problems))

    @property
    def held_layers(self) -> int:
        """Layers held, all of them by default."""
        return self.model.num_layers if self.layers is None else self.layers

    @property
    def effective_layers(self) -> int:
        """Layers that cost weights, KV and compute: the held ones plus the exit block of a partial model."""
        partial = self.held_layers < self.model.num_layers
        return self.held_layers + (self.exit_head_layers if partial else 0)

    @property
    def num_gpus(self) -> int:
        """GPUs of the replica."""
        return self.tp * self.pp

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weight bytes each GPU holds (layers split over TP x PP; embeddings and head split too, roughly)."""
        return self.model.weight_bytes(self.effective_layers) / self.num_gpus

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies over the whole replica."""
        return self.model.kv_bytes_per_token(self.effective_layers)


def validate_parallelism(model: Model, gpu: Gpu, tp: int, pp: int, layers: int | None = None) -> list[str]:
    """Problems with running ``model`` at (tp, pp) on ``gpu``; empty when the layout is valid."""
    layers = model.num_layers if layers is None else layers
    problems = []
    if tp < 1 or pp < 1:
        problems.append(f"tp and pp must be >= 1 (got tp={tp}, pp={pp})")
        return problems
    if model.num_attention_heads % tp:
        problems.append(f"TP {tp} does not divide the {model.num_attention_heads} attention heads of {model.name}")
    if tp > gpu.max_tensor_parallel:
        problems.append(f"TP {tp} exceeds the {gpu.max_tensor_parallel} GPUs of one {gpu.id} node's "
                        f"{gpu.link.kind} domain")
    if not 1 <= layers <= model.num_layers:
        problems.append(f"layers {layers} outside 1..{model.num_layers} for {model.name}")
    elif pp > layers:
        problems.append(f"PP {pp} exceeds the {layers} layers held")
    return problems


@dataclass(frozen=True)
class CostModel:
    """Step times of one replica.

    Attributes:
        spec: The replica.
        step_overhead_s: Fixed engine cost per iteration (scheduling, sampling, kernel launches).
        seq_overhead_s: Engine cost per sequence that samples in an iteration (per-sequence host work).
        prompt_overhead_s: Engine cost per request, paid in the iteration that starts its prompt (the API server's
            work on a request, on a host where it shares the engine's core).
    """

    spec: ReplicaSpec
    step_overhead_s: float = 1e-3
    seq_overhead_s: float = 0.0
    prompt_overhead_s: float = 0.0
    _c: dict[str, float] = field(init=False, repr=False, compare=False)
    _scale: tuple[np.ndarray, np.ndarray] | None = field(init=False, repr=False, compare=False)
    _link: Interconnect = field(init=False, repr=False, compare=False)
    _overlap: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s, m, g = self.spec, self.spec.model, self.spec.gpu
        layers = s.effective_layers
        dtype = m.dtype_bytes
        object.__setattr__(self, "_c", {
            # FLOPs of the layers per token, and of the LM head per sampled token.
            "layer_flops": 2.0 * layers * m.layer_params,
            "head_flops": 2.0 * m.vocab_size * m.hidden_size,
            # Attention score + value FLOPs per (query token, context token) pair.
            "attn_flops": 4.0 * layers * m.num_attention_heads * m.head_dim,
            # Bytes read per step: every held layer's weights, and the LM head when a token is sampled (the
            # embedding table is only gathered from, a few rows per token).
            "weight_bytes": float(layers * m.layer_params * dtype),
            "head_bytes": float(m.vocab_size * m.hidden_size * dtype),
            "kv_bytes": float(s.kv_bytes_per_token),
            # PP stages work one after another on a batch, so only the tp GPUs of one stage work at a time.
            "flops_per_s": g.bf16_tflops * 1e12 * g.efficiency.compute * g.model_compute.get(m.name, 1.0) * s.tp,
            # Attention pairs and KV reads at their own rates (CPU kernels: below the GEMMs' and weight streams').
            "attn_scale": 1.0 / g.efficiency.attention,
            "kv_scale": 1.0 / g.efficiency.kv_memory,
            "bytes_per_s": g.hbm_bandwidth_gbps * 1e9 * g.efficiency.memory * s.tp,
            "act_bytes": float(m.hidden_size * dtype),
            "layers": float(layers),
        })
        object.__setattr__(self, "_link", Interconnect.of(g))
        object.__setattr__(self, "_overlap", g.efficiency.overlap)  # the roofline's max, else the sum
        scale = sorted((g.efficiency.memory_scale or {}).items())
        object.__setattr__(self, "_scale", (np.asarray([k for k, _ in scale], float),
                                            np.asarray([v for _, v in scale], float)) if scale else None)

    def _bandwidth(self, new_tokens: np.ndarray | float) -> np.ndarray | float:
        """Memory bytes/s of a step carrying ``new_tokens`` tokens (the device's ``memory_scale`` applied)."""
        if self._scale is None:
            return self._c["bytes_per_s"]
        return self._c["bytes_per_s"] * np.interp(new_tokens, *self._scale)

    def comm_time(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """TP all-reduces (2 per layer) and PP sends for a step that carries ``tokens`` tokens."""
        if self.spec.tp == 1 and self.spec.pp == 1:
            return 0.0
        return self._link.step_s(tokens * self._c["act_bytes"], self._c["layers"], self.spec.tp, self.spec.pp)

    def step_time(self, new_tokens: float, attn_pairs: float, kv_tokens_read: float, sampled: float) -> float:
        """Seconds of one iteration (scalar twin of :meth:`step_times`, kept in plain floats for speed).

        Args:
            new_tokens: Tokens processed this step (prefill chunk tokens + one per decoding sequence).
            attn_pairs: Sum over new tokens of the context each attends to (query x key pairs).
            kv_tokens_read: Tokens of KV cache read from memory (the contexts of the sequences in the step).
            sampled: Sequences that sample a token this step (each pays the LM head).
        """
        c = self._c
        flops = new_tokens * c["layer_flops"] + sampled * c["head_flops"]
        flops = flops + attn_pairs * c["attn_flops"] * c["attn_scale"]
        memory = c["weight_bytes"] + (c["head_bytes"] if sampled > 0 else 0.0)
        memory += (kv_tokens_read * c["kv_scale"] + new_tokens) * c["kv_bytes"]
        compute, traffic = flops / c["flops_per_s"], memory / float(self._bandwidth(new_tokens))
        roofline = max(compute, traffic) if self._overlap else compute + traffic
        return roofline + float(self.comm_time(new_tokens)) + self.step_overhead_s + sampled * self.seq_overhead_s

    def step_times(self, new_tokens: np.ndarray, attn_pairs: np.ndarray, kv_tokens_read: np.ndarray,
                   sampled: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`step_time` over ``k`` steps; every argument has shape ``k``."""
        c = self._c
        flops = new_tokens * c["layer_flops"] + sampled * c["head_flops"]
        flops = flops + attn_pairs * c["attn_flops"] * c["attn_scale"]
        head_bytes = np.where(sampled > 0, c["head_bytes"], 0.0)
        memory = c["weight_bytes"] + head_bytes + (kv_tokens_read * c["kv_scale"] + new_tokens) * c["kv_bytes"]
        compute, traffic = flops / c["flops_per_s"], memory / self._bandwidth(new_tokens)
        roofline = np.maximum(compute, traffic) if self._overlap else compute + traffic
        return roofline + self.comm_time(new_tokens) + self.step_overhead_s + sampled * self.seq_overhead_s

    def decode_times(self, num_seqs: int, context_sum: float, steps: int) -> np.ndarray:
        """Times of ``steps`` pure decode steps of ``num_seqs`` sequences whose contexts sum to ``context_sum``.

        Each step adds one token to every sequence, so step ``i`` reads ``context_sum + i * num_seqs`` KV tokens.
        Returns shape ``steps``.
        """
        kv = context_sum + num_seqs * np.arange(steps, dtype=float)
        n = np.full(steps, float(num_seqs))
        return self.step_times(n, kv + n, kv, n)

    def prefill_time(self, chunk_lengths: np.ndarray, chunk_starts: np.ndarray, decode_contexts_sum: float = 0.0,
                     num_decodes: int = 0, sampled_prefills: int | None = None) -> float:
        """One iteration with prefill chunks (and optionally decodes, for chunked prefill); each chunk that starts a
        prompt (at position 0) adds the per-request overhead.

        Args:
            chunk_lengths: Tokens of each prefill chunk.
            chunk_starts: Position where each chunk starts (tokens of the prompt already in the KV cache).
            decode_contexts_sum: Sum of the contexts of the decoding sequences in the same step.
            num_decodes: Decoding sequences in the same step.
            sampled_prefills: Chunks that finish their prompt and sample (all of them by default).
        """
        lengths = np.asarray(chunk_lengths, dtype=float)
        starts = np.asarray(chunk_starts, dtype=float)
        pairs = float(np.sum(lengths * starts + lengths * (lengths + 1) / 2.0))
        sampled = len(lengths) if sampled_prefills is None else sampled_prefills
        step = self.step_time(float(lengths.sum()) + num_decodes, pairs + decode_contexts_sum + num_decodes,
                              float(starts.sum()) + decode_contexts_sum, float(sampled + num_decodes))
        return step + float(np.count_nonzero(starts == 0)) * self.prompt_overhead_s
