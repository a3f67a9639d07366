"""One engine server process: ``python -m serving.server --model <hf id> --port <port>``.

Builds the HELIOS engine for one model (with its exit heads and the PHT when it is a HELIOS candidate, else at full
depth), its worker and the OpenAI-compatible app, and serves it with uvicorn on 127.0.0.1 (graceful shutdown on
SIGTERM / SIGINT: new requests get 503 while in-flight ones finish).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exitplan.config import DEFAULT_PARAMS, Params, load_params


def make_app(candidate: Any, config: Any, pht: Any, settings: Any, max_queue: int, telemetry: Path | None = None,
             drain_s: float = 30.0) -> Any:
    """The app serving one candidate with an engine of ``config`` (worker started by the app's lifespan)."""
    from transformers import AutoTokenizer

    from serving.api import create_app
    from serving.engine.engine import Engine
    from serving.engine.served import num_layers
    from serving.metrics import ServerMetrics
    from serving.worker import EngineWorker

    engine = Engine([candidate], config, pht)
    tokenizer = AutoTokenizer.from_pretrained(str(candidate.checkpoint))
    worker = EngineWorker(engine, max_queue, ServerMetrics(num_layers(candidate.checkpoint)), telemetry)
    return create_app(worker, tokenizer, settings, drain_s)


def build(params: Params, model: str, max_context: int, max_queue: int, request_timeout_s: float,
          api_key: str | None, telemetry: Path | None, memory_gib: float | None = None, mode: str | None = None,
          served_name: str | None = None):
    """The app serving ``model`` as params say (not yet started)."""
    from exitplan.profiling.pht import PerformanceHistoryTable
    from serving.api import ServerSettings
    from serving.engine.factory import GIB, candidates, engine_config

    (candidate,) = candidates(params, [model])
    helios = model in params.helios.candidates and candidate.exits_dir is not None
    pht = PerformanceHistoryTable(params.path(params.helios.pht_path))
    pht.path = None  # the PHT is a pipeline output: read here, never written
    overrides = {"mode": mode or ("helios" if helios else "full")}
    if memory_gib is not None:
        overrides["memory_budget_bytes"] = int(memory_gib * GIB)
    settings = ServerSettings(served_name or model, max_context, request_timeout_s, api_key)
    return make_app(candidate, engine_config(params, **overrides), pht, settings, max_queue, telemetry)


def main() -> None:
    """Parse arguments, build the app, serve it."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="Fetched model to serve (HF id).")
    parser.add_argument("--served-name", default=None, help="Name clients use (default: the model's id).")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--params", type=Path, default=Path(DEFAULT_PARAMS))
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--memory-gib", type=float, default=None, help="Engine memory budget (default: params).")
    parser.add_argument("--mode", choices=["helios", "full"], default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--telemetry", type=Path, default=None, help="Persist per-request telemetry here.")
    args = parser.parse_args()
    app = build(load_params(args.params), args.model, args.max_context, args.max_queue, args.request_timeout,
                args.api_key, args.telemetry, args.memory_gib, args.mode, args.served_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
