"""The engine's memory accounting against the process's measured memory, on the real SmolLM2 (fresh processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

PROBE = """
import gc, json, sys
import psutil
from pathlib import Path
from exitplan.engine.served import Candidate, ServedModel

def rss():
    gc.collect()
    return psutil.Process().memory_info().rss

candidate = Candidate(sys.argv[1], Path(sys.argv[2]), dtype=sys.argv[4], pack_head=sys.argv[5] == "1")
layers = int(sys.argv[3])
warm, _ = ServedModel.open(candidate, 1, exits=[])  # imports, allocator arenas and the file cache
del warm
before = rss()
served, _ = ServedModel.open(candidate, layers, exits=[])
served.build_pool(64 * 2**20, block_size=16)
for blocks in (served.pool.keys, served.pool.values):
    blocks.fill_(1.0)  # touch every page: the pool is allocated, not promised
print(json.dumps({"grown": rss() - before, "accounted": served.weight_bytes() + served.pool.nbytes,
                  "held": served.model.held_layers, "weights": served.weight_bytes(),
                  "kv_dtype": str(served.pool.keys.dtype), "head": served.model.model.lm_head.weight.nbytes}))
"""


def probe(checkpoint_of, layers: int, dtype: str, pack_head: bool = True) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, SMOLLM2, str(checkpoint_of(SMOLLM2)), str(layers), dtype,
                          str(int(pack_head))],
                         capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1", **_env()})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("layers", "dtype"), [(6, "float32"), (30, "float32"), (30, "bfloat16")])
def test_accounted_weights_and_pool_match_the_process_memory(checkpoint_of, layers: int, dtype: str) -> None:
    measured = probe(checkpoint_of, layers, dtype)
    assert measured["held"] == layers and measured["kv_dtype"] == f"torch.{dtype}"
    assert measured["accounted"] == pytest.approx(measured["grown"], rel=0.15), measured


def test_bfloat16_weights_are_half_of_float32(checkpoint_of) -> None:
    half = probe(checkpoint_of, 30, "bfloat16", pack_head=False)["weights"]
    assert half * 2 == probe(checkpoint_of, 30, "float32")["weights"]


def test_a_packed_lm_head_is_accounted_as_one_more_copy_of_the_head(checkpoint_of) -> None:
    import torch

    from exitplan.earlyexit.packed import can_pack

    packed = probe(checkpoint_of, 30, "bfloat16", pack_head=True)
    plain = probe(checkpoint_of, 30, "bfloat16", pack_head=False)
    copy = packed["head"] if can_pack(torch.bfloat16) else 0  # where packing does not gain, no copy is made
    assert packed["weights"] == plain["weights"] + copy


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
