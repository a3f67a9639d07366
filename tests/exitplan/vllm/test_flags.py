"""``vllm serve`` flags per platform: what the CPU backend refuses is never rendered for it."""

from __future__ import annotations

import pytest

from exitplan.config import EngineParams
from exitplan.errors import ExitplanError
from exitplan.vllm.flags import Platform, Replica, block_size, serve_flags


def value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize(("requested", "cpu"), [(1, 32), (16, 32), (32, 32), (33, 64), (128, 128)])
def test_cpu_blocks_are_multiples_of_32_and_cuda_keeps_the_simulated_size(requested: int, cpu: int) -> None:
    assert block_size(Platform.CPU, requested) == cpu
    assert block_size(Platform.CUDA, requested) == requested


def test_a_cpu_replica_gets_its_length_and_no_gpu_flags() -> None:
    flags = serve_flags(Platform.CPU, Replica("m", "127.0.0.1", 8100, max_model_len=4096), EngineParams())
    assert value(flags, "--block-size") == "32" and value(flags, "--max-model-len") == "4096"
    assert value(flags, "--dtype") == "bfloat16" and value(flags, "--host") == "127.0.0.1"
    assert value(flags, "--served-model-name") == "m"
    assert int(value(flags, "--max-num-batched-tokens")) >= 4096  # prefill-first needs a whole prompt per step
    assert not [f for f in flags if "parallel" in f or "gpu-memory" in f]


def test_a_cuda_replica_keeps_the_simulated_knobs() -> None:
    engine = EngineParams(block_size=16, max_num_seqs=128, gpu_memory_utilization=0.85, enable_chunked_prefill=True)
    flags = serve_flags(Platform.CUDA, Replica("m", "0.0.0.0", 9000, tp=2, pp=2), engine)
    assert value(flags, "--block-size") == "16" and value(flags, "--tensor-parallel-size") == "2"
    assert value(flags, "--pipeline-parallel-size") == "2" and value(flags, "--gpu-memory-utilization") == "0.85"
    assert "--enable-chunked-prefill" in flags and "--max-model-len" not in flags


def test_a_cpu_replica_refuses_parallelism_and_a_missing_length() -> None:
    with pytest.raises(ExitplanError, match="tp=2"):
        serve_flags(Platform.CPU, Replica("m", "127.0.0.1", 1, tp=2, max_model_len=64), EngineParams())
    with pytest.raises(ExitplanError, match="max model length"):
        serve_flags(Platform.CPU, Replica("m", "127.0.0.1", 1), EngineParams())
