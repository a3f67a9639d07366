"""Our engine at full depth vs vLLM's CPU build: the same model, prompts, dtype (bfloat16) and one core each.

One run, on this machine, one server at a time (nothing else running): vLLM (``python -m
vllm.entrypoints.openai.api_server`` from ``.venv-vllm``, the command ``exitplan deploy`` renders for a CPU replica,
pinned to one core) and our engine server (``python -m serving.server --mode full``, ``helios.dtype: bfloat16``,
one torch thread on one core). Each gets the same real HumanEval prompts (code: answers run to the token limit)
at concurrency 1, 8 and 16, whole answers of ``max_tokens`` tokens; throughput is the completion tokens
(as each server's usage counts them) over the wall time of the level. Start-up (vLLM compiles its model for 1-2
minutes) is not timed.

``--quick``: 32 tokens per answer, 2 / 8 / 16 requests per level (about 4 minutes with both start-ups); without it
96 tokens and 4 / 16 / 32 requests. Model: Qwen2.5-Coder-0.5B-Instruct (``--model`` to change).

Last line: ``RESULT engine_vs_vllm_c1=... engine_vs_vllm_c16=... vllm_tok_s_c16=...`` (ratios: our tok/s over
vLLM's; target >= 0.5 at 16, goal 1.0).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import yaml
from common import free_port, start

from exitplan.deploy import wait_healthy
from exitplan.vllm import replica as vllm_replica

LEVELS = (1, 8, 16)
QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def prompts(count: int) -> list[str]:
    """Real HumanEval prompts (function stubs: a code model writes to the limit), the shortest first."""
    from exitplan.workload.sources import read_queries

    texts = sorted((q.prompt for q in read_queries("humaneval")), key=len)
    return texts[:count]


async def level(url: str, model: str, texts: list[str], tokens: int, concurrency: int) -> dict:
    """Whole answers of ``texts`` with ``concurrency`` clients: tokens, seconds, tok/s, mean latency."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(text: str) -> tuple[int, float]:
            async with gate:
                began = time.perf_counter()
                reply = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": text, "max_tokens": tokens, "temperature": 0})
                reply.raise_for_status()
                return reply.json()["usage"]["completion_tokens"], time.perf_counter() - began

        started = time.perf_counter()
        done = await asyncio.gather(*(one(t) for t in texts))
    seconds = time.perf_counter() - started
    made = sum(n for n, _ in done)
    return {"tokens": made, "seconds": seconds, "tok_s": made / seconds,
            "latency_s": sum(s for _, s in done) / len(done)}


def measure(url: str, model: str, texts: list[str], tokens: int, counts: dict[int, int]) -> dict[int, dict]:
    """Every concurrency level against one server (one warm-up request first)."""
    asyncio.run(level(url, model, texts[:1], 4, 1))
    return {c: asyncio.run(level(url, model, texts[:counts[c]], tokens, c)) for c in LEVELS}


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def run_vllm(params, model: str, texts: list[str], tokens: int, counts: dict[int, int], out: Path) -> dict:
    spec = replace(vllm_replica.cpu_replica(params, model, "127.0.0.1", free_port()), dtype="bfloat16")
    started = vllm_replica.start(params, params.checkpoint_path(model), spec, [0], out / "vllm.log")
    try:
        vllm_replica.wait_ready(started, params.vllm.startup_timeout_s)
        return measure(started.url, model, texts, tokens, counts)
    finally:
        vllm_replica.stop(started.process)


def engine_params(params, out: Path) -> Path:
    """A params file for our server: the repo's, with bfloat16 serving and no tracking."""
    tree = yaml.safe_load((params.root / "params.yaml").read_text())
    tree["catalog"] = str(params.path(params.catalog))
    tree["tracking"]["enabled"] = False
    tree["fetch_models"]["checkpoint_dir"] = str(params.path(params.fetch_models.checkpoint_dir))
    tree["train_exits"]["output_dir"] = str(params.path(params.train_exits.output_dir))
    tree["helios"]["dtype"] = "bfloat16"
    path = out / "params.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run_engine(params, model: str, texts: list[str], tokens: int, counts: dict[int, int], out: Path) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(params.root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "serving.server", "--model", model, "--port", str(port),
           "--params", str(engine_params(params, out)), "--mode", "full", "--memory-gib",
           str(2 + params.vllm.kv_cache_gib), "--max-context", "1024", "--max-queue", "256"]
    process = subprocess.Popen(cmd, cwd=params.root, env=env, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 600, process)
        return measure(url, model, texts, tokens, counts)
    finally:
        stop(process)


def main() -> None:
    args, params = start(__doc__, {"--model": {"default": QWEN, "help": "Fetched model to serve on both."}})
    tokens, counts = (32, {1: 2, 8: 8, 16: 16}) if args.quick else (96, {1: 4, 8: 16, 16: 32})
    texts = prompts(max(counts.values()))
    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        vllm = run_vllm(params, args.model, texts, tokens, counts, Path(tmp))
        ours = run_engine(params, args.model, texts, tokens, counts, Path(tmp))
    print(f"{args.model}, bfloat16, one core each, {tokens} tokens per answer (HumanEval prompts)")
    print(f"{'clients':>8}{'requests':>10}{'vLLM tok/s':>12}{'ours tok/s':>12}{'ours/vLLM':>11}"
          f"{'vLLM lat s':>12}{'ours lat s':>12}")
    for c in LEVELS:
        print(f"{c:>8}{counts[c]:>10}{vllm[c]['tok_s']:>12.1f}{ours[c]['tok_s']:>12.1f}"
              f"{ours[c]['tok_s'] / vllm[c]['tok_s']:>11.2f}{vllm[c]['latency_s']:>12.2f}{ours[c]['latency_s']:>12.2f}")
    print(f"RESULT engine_vs_vllm_c1={ours[1]['tok_s'] / vllm[1]['tok_s']:.2f} "
          f"engine_vs_vllm_c8={ours[8]['tok_s'] / vllm[8]['tok_s']:.2f} "
          f"engine_vs_vllm_c16={ours[16]['tok_s'] / vllm[16]['tok_s']:.2f} vllm_tok_s_c16={vllm[16]['tok_s']:.1f} "
          f"engine_tok_s_c16={ours[16]['tok_s']:.1f}")


if __name__ == "__main__":
    main()
