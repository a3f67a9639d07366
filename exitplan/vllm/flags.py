"""The ``vllm serve`` flags of one replica, valid for the platform it runs on.

The perf DB simulated vLLM's engine knobs (:class:`~exitplan.config.EngineParams`); this module says them in
vLLM's flags, adjusted where a platform refuses a value: the CPU backend's attention needs blocks of a multiple of
32 tokens (``No common block size for 16 (CPU_ATTN: [MultipleOf(32)])``), has no tensor or pipeline parallelism
across our pinned cores and no ``--gpu-memory-utilization`` (its KV cache is ``VLLM_CPU_KVCACHE_SPACE``), and
must be told ``--max-model-len`` (else it profiles a batch of the model's 32k positions at every start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from exitplan.config import EngineParams
from exitplan.errors import ExitplanError

CPU_BLOCK_MULTIPLE = 32
"""The CPU attention backend's block sizes are multiples of this."""


class Platform(StrEnum):
    """Where a vLLM replica runs."""

    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class Replica:
    """What one ``vllm serve`` needs beyond the engine knobs.

    Attributes:
        served_name: Model name clients (the coordinator) send: the plan's model id.
        host: Address it binds.
        port: Its port.
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        dtype: ``--dtype``.
        max_model_len: ``--max-model-len`` (None: the engine's, else the model's own).
    """

    served_name: str
    host: str
    port: int
    tp: int = 1
    pp: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None


def block_size(platform: Platform, requested: int) -> int:
    """The KV block size a platform accepts that is nearest ``requested`` from above."""
    if platform is Platform.CPU:
        return max(CPU_BLOCK_MULTIPLE, math.ceil(requested / CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE)
    return requested


def serve_flags(platform: Platform, replica: Replica, engine: EngineParams) -> list[str]:
    """The flags after ``vllm serve <model>`` (or the API server module's ``--model <path>``).

    Raises:
        ExitplanError: for a CPU replica with tensor or pipeline parallelism, or one without a max model length.
    """
    flags = ["--served-model-name", replica.served_name, "--host", replica.host, "--port", str(replica.port),
             "--dtype", replica.dtype, "--max-num-seqs", str(engine.max_num_seqs),
             "--block-size", str(block_size(platform, engine.block_size))]
    max_len = replica.max_model_len or engine.max_model_len
    if platform is Platform.CPU:
        if replica.tp * replica.pp != 1:
            raise ExitplanError(f"{replica.served_name}: a CPU replica runs on its pinned cores, without tensor or "
                                f"pipeline parallelism (asked tp={replica.tp}, pp={replica.pp})")
        if max_len is None:
            raise ExitplanError(f"{replica.served_name}: a CPU replica needs a max model length (vllm.max_model_len)")
    else:
        flags += ["--tensor-parallel-size", str(replica.tp), "--pipeline-parallel-size", str(replica.pp),
                  "--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    if max_len:
        flags += ["--max-model-len", str(max_len)]
    batched = engine.max_num_batched_tokens
    if batched is not None or (platform is Platform.CPU and max_len):
        flags += ["--max-num-batched-tokens", str(engine.batched_tokens(max_len or 0))]
    flags += ["--enable-chunked-prefill"] if engine.enable_chunked_prefill else ["--no-enable-chunked-prefill"]
    return flags
