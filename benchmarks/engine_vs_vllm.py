"""Our engine at full depth vs vLLM's CPU build: the same model, prompts, dtype (bfloat16) and one core each.

Both servers run at once, each pinned to a core of its own: vLLM (``python -m vllm.entrypoints.openai.api_server``
from ``.venv-vllm``, the command ``exitplan deploy`` renders for a CPU replica) and our engine server (``python -m
serving.server --mode full``, ``helios.dtype: bfloat16``, one torch thread). Each gets the same real HumanEval
prompts (code: answers run to the token limit) at concurrency 1, 8 and 16, whole answers of ``max_tokens`` tokens;
throughput is the completion tokens (as each server's usage counts them) over the wall time of the level. This
machine's speed drifts by up to 2x within minutes (``benchmarks/machine_noise.py``) and its two cores need not run
alike, so the levels alternate between the servers and the servers swap cores every round; a level's ratio is the
geometric mean of its rounds' ratios (an even number of rounds: each server as long on each core). Every (round,
level) sends its own prompts (:func:`slices`): vLLM's prefix cache must not answer a prompt it has already
prefilled. The idle server's CPU seconds during the other's levels, and vLLM's prefix-cache hits, are printed.
Start-up (vLLM compiles its model for 1-2 minutes) is not timed.

``--quick``: 32 tokens per answer, 2 / 8 / 16 requests per level, 4 rounds (the 105 shortest prompts; about 6
minutes with both start-ups); without it 96 tokens and 4 / 16 / 32 requests, 2 rounds (105 prompts). Model:
Qwen2.5-Coder-0.5B-Instruct (``--model``).

Last line: ``RESULT engine_vs_vllm_c1=... engine_vs_vllm_c8=... engine_vs_vllm_c16=... vllm_tok_s_c16=...
engine_tok_s_c16=...`` (ratios: our tok/s over vLLM's; targets >= 1.0 at 1, >= 0.9 at 16).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
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
from exitplan.infra.processes import family
from exitplan.vllm import replica as vllm_replica

LEVELS = (1, 8, 16)
QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def prompts(count: int) -> list[str]:
    """Real HumanEval prompts (function stubs: a code model writes to the limit), the shortest first."""
    from exitplan.workload.sources import read_queries

    texts = sorted((q.prompt for q in read_queries("humaneval")), key=len)
    if count > len(texts):
        raise SystemExit(f"{count} distinct prompts asked; HumanEval has {len(texts)}")
    return texts[:count]


def slices(texts: list[str], counts: dict[int, int], rounds: int) -> dict[tuple[int, int], list[str]]:
    """(round, level) -> its own prompts: no prompt is sent twice to a server. vLLM caches the KV of prompts it has
    seen (automatic prefix caching, on by default): the same 16 prompts sent again hit 704 of their 933 tokens, its
    mean time to first token fell from 2.15 s to 0.31-0.55 s and its rate from 63 to 116-137 tok/s (16 clients), a
    gain real traffic does not repeat. Shared prefixes within a level (``from typing import List``) may still hit
    its cache, as they would in production. Each level's prompts are dealt round-robin, so every round gets the
    same lengths."""
    out: dict[tuple[int, int], list[str]] = {}
    start = 0
    for c in LEVELS:
        block = texts[start:start + counts[c] * rounds]
        start += counts[c] * rounds
        for r in range(rounds):
            out[(r, c)] = block[r::rounds]
    return out


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


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and its children (0 once it is gone)."""
    import psutil

    total = 0.0
    for proc in family(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def pin(pid: int, core: int) -> None:
    """Move every thread of process ``pid`` and of its children to ``core``."""
    for proc in family(pid):
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task.name), {core})


def alternate(servers: dict[str, tuple[str, int]], model: str, texts: list[str], tokens: int,
              counts: dict[int, int], rounds: int) -> tuple[dict[str, dict[int, list[dict]]], dict[str, float]]:
    """Every level on every server, the servers alternating, ``rounds`` times (one warm-up request each first);
    the servers swap cores every round (round ``r``: server ``i`` on core ``(i + r) % 2``).

    Returns:
        Server -> level -> one result per round, and server -> its CPU seconds while the others ran.
    """
    for url, _ in servers.values():
        asyncio.run(level(url, model, texts[-1:], 4, 1))  # a prompt no level sends
    asked = slices(texts, counts, rounds)
    results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in LEVELS} for name in servers}
    idle = dict.fromkeys(servers, 0.0)
    for r in range(rounds):
        for i, (_, pid) in enumerate(servers.values()):
            pin(pid, (i + r) % 2)
        for c in LEVELS:
            for name, (url, _) in servers.items():
                before = {other: tree_cpu_s(pid) for other, (_, pid) in servers.items() if other != name}
                results[name][c].append(asyncio.run(level(url, model, asked[(r, c)], tokens, c)))
                for other, cpu in before.items():
                    idle[other] += tree_cpu_s(servers[other][1]) - cpu
    return results, idle


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def start_vllm(params, model: str, core: int, out: Path) -> vllm_replica.Started:
    spec = replace(vllm_replica.cpu_replica(params, model, "127.0.0.1", free_port()), dtype="bfloat16")
    started = vllm_replica.start(params, params.checkpoint_path(model), spec, [core], out / "vllm.log")
    vllm_replica.wait_ready(started, params.vllm.startup_timeout_s)
    return started


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


def start_engine(params, model: str, core: int, out: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(params.root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "serving.server", "--model", model, "--port", str(port),
           "--params", str(engine_params(params, out)), "--mode", "full", "--memory-gib",
           str(2 + params.vllm.kv_cache_gib), "--max-context", "1024", "--max-queue", "256"]
    process = subprocess.Popen(cmd, cwd=params.root, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, process)
    return process, url


def prefix_cache(url: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters so far: (tokens queried, tokens hit)."""
    import re

    text = httpx.get(f"{url}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def main() -> None:
    args, params = start(__doc__, {"--model": {"default": QWEN, "help": "Fetched model to serve on both."}})
    tokens, counts = (32, {1: 2, 8: 8, 16: 16}) if args.quick else (96, {1: 4, 8: 16, 16: 32})
    rounds = 4 if args.quick else 2
    texts = prompts(sum(counts.values()) * rounds + 1)
    with tempfile.TemporaryDirectory(prefix="engine-vs-vllm-") as tmp:
        vllm = start_vllm(params, args.model, 0, Path(tmp))
        engine = None
        try:
            engine, url = start_engine(params, args.model, 1, Path(tmp))
            servers = {"vllm": (vllm.url, vllm.process.pid), "ours": (url, engine.pid)}
            cache_before = prefix_cache(vllm.url)
            results, idle = alternate(servers, args.model, texts, tokens, counts, rounds)
            queried, hit = (a - b for a, b in zip(prefix_cache(vllm.url), cache_before, strict=True))
        finally:
            if engine is not None:
                stop(engine)
            vllm_replica.stop(vllm.process)
    v, o = results["vllm"], results["ours"]
    ratio = {c: statistics.geometric_mean([b["tok_s"] / a["tok_s"] for a, b in zip(v[c], o[c], strict=True)])
             for c in LEVELS}
    tok_s = {name: {c: statistics.median([r["tok_s"] for r in runs[c]]) for c in LEVELS}
             for name, runs in results.items()}
    print(f"{args.model}, bfloat16, one core each (swapped every round, vLLM on core 0 first), {tokens} tokens per "
          f"answer (HumanEval prompts), {rounds} alternating rounds; ratio: geometric mean of the rounds'; tok/s and "
          f"latency: medians")
    print(f"{'clients':>8}{'requests':>10}{'vLLM tok/s':>12}{'ours tok/s':>12}{'ours/vLLM':>11}{'per round':>22}"
          f"{'vLLM lat s':>12}{'ours lat s':>12}")
    for c in LEVELS:
        rounds_text = " ".join(f"{b['tok_s'] / a['tok_s']:.2f}" for a, b in zip(v[c], o[c], strict=True))
        print(f"{c:>8}{counts[c]:>10}{tok_s['vllm'][c]:>12.1f}{tok_s['ours'][c]:>12.1f}{ratio[c]:>11.2f}"
              f"{rounds_text:>22}{statistics.median([r['latency_s'] for r in v[c]]):>12.2f}"
              f"{statistics.median([r['latency_s'] for r in o[c]]):>12.2f}")
    print(f"CPU seconds of the idle server while the other ran: vLLM {idle['vllm']:.1f}, ours {idle['ours']:.1f}; "
          f"vLLM's prefix cache hit {hit:.0f} of {queried:.0f} prompt tokens ({hit / max(queried, 1):.1%}; "
          f"our engine has no prefix cache)")
    print(f"RESULT engine_vs_vllm_c1={ratio[1]:.2f} engine_vs_vllm_c8={ratio[8]:.2f} "
          f"engine_vs_vllm_c16={ratio[16]:.2f} vllm_tok_s_c16={tok_s['vllm'][16]:.1f} "
          f"engine_tok_s_c16={tok_s['ours'][16]:.1f}")


if __name__ == "__main__":
    main()
