"""One engine server process: ``python -m serving.server --model <hf id> --port <port>``.

Builds the HELIOS engine for one model (with its exit heads and the PHT when it is a HELIOS candidate, else at full
depth), its worker and the OpenAI-compatible app, and serves it with uvicorn on 127.0.0.1. SIGTERM / SIGINT drains
(:mod:`serving.lifecycle`): new requests get 503 with ``Retry-After`` while in-flight ones finish, for at most
``deploy.drain_s``. The API key comes from ``$EXITPLAN_API_KEY`` (``deploy.api_key_env``) or ``--api-key-file``,
never from the command line. Defaults of the flags are the ``deploy`` section of the params. Bad input (params, an
unfetched model, a key file) is one line naming it and exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from exitplan.config import DEFAULT_PARAMS, Params, load_params
from exitplan.errors import ExitplanError


def make_app(candidate: Any, config: Any, pht: Any, settings: Any, max_queue: int,
             telemetry: Path | None = None) -> Any:
    """The app serving one candidate with an engine of ``config`` (worker started by the app's lifespan)."""
    from transformers import AutoTokenizer

    from exitplan.engine.engine import Engine
    from exitplan.engine.served import num_layers
    from serving.api import create_app
    from serving.metrics import ServerMetrics
    from serving.worker import EngineWorker

    engine = Engine([candidate], config, pht)
    tokenizer = AutoTokenizer.from_pretrained(str(candidate.checkpoint))
    worker = EngineWorker(engine, max_queue, ServerMetrics(num_layers(candidate.checkpoint)), telemetry)
    return create_app(worker, tokenizer, settings)


def build(params: Params, model: str, max_context: int, max_queue: int, request_timeout_s: float,
          api_key: str | None, telemetry: Path | None, memory_gib: float | None = None, mode: str | None = None,
          served_name: str | None = None):
    """The app serving ``model`` as params say (not yet started)."""
    from dataclasses import replace

    from exitplan.engine.factory import GIB, candidates, engine_config
    from exitplan.profiling.pht import PerformanceHistoryTable
    from serving.api import ServerSettings

    (candidate,) = candidates(params, [model])
    params.fetched(model)
    helios = model in params.helios.candidates and candidate.exits_dir is not None
    pht = PerformanceHistoryTable(params.path(params.helios.pht_path))
    pht.path = None  # the PHT is a pipeline output: read here, never written
    overrides = {"mode": mode or ("helios" if helios else "full")}
    if overrides["mode"] == "full":  # full depth reads no exit heads: it serves before train_exits has run
        candidate = replace(candidate, exits_dir=None)
    if memory_gib is not None:
        overrides["memory_budget_bytes"] = int(memory_gib * GIB)
    settings = ServerSettings(served_name or model, max_context, request_timeout_s, api_key,
                              max_body_bytes=params.deploy.max_body_bytes, drain_s=params.deploy.drain_s)
    return make_app(candidate, engine_config(params, **overrides), pht, settings, max_queue, telemetry)


def main() -> None:
    """Parse arguments, build the app, serve it until SIGTERM (draining first)."""
    from exitplan.runtime import preload_tcmalloc
    from serving.guard import read_api_key
    from serving.lifecycle import serve_forever
    from serving.process import COUNT, PORT, POSITIVE, arguments, fail, number

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="Fetched model to serve (HF id).")
    parser.add_argument("--served-name", default=None, help="Name clients use (default: the model's id).")
    parser.add_argument("--port", type=PORT, default=None, help="Port (default: deploy.base_port).")
    parser.add_argument("--host", default=None, help="Address (default: deploy.host).")
    parser.add_argument("--params", type=Path, default=Path(DEFAULT_PARAMS))
    parser.add_argument("--max-context", type=number(int, 16), default=None, help="Default: deploy.max_context.")
    parser.add_argument("--max-queue", type=COUNT, default=None, help="Default: deploy.max_queue.")
    parser.add_argument("--request-timeout", type=POSITIVE, default=None, help="Default: deploy.request_timeout_s.")
    parser.add_argument("--memory-gib", type=POSITIVE, default=None, help="Engine memory budget (default: params).")
    parser.add_argument("--mode", choices=["helios", "full"], default=None)
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="File holding the API key (default: the variable deploy.api_key_env names).")
    parser.add_argument("--telemetry", type=Path, default=None, help="Persist per-request telemetry here.")
    try:
        args = arguments(parser)
        params = load_params(args.params)
        preload_tcmalloc(params, "serve")  # re-executes with tcmalloc first, before any work (exitplan.runtime)
        d = params.deploy
        app = build(params, args.model, args.max_context or d.max_context, args.max_queue or d.max_queue,
                    args.request_timeout or d.request_timeout_s, read_api_key(d.api_key_env, args.api_key_file),
                    args.telemetry, args.memory_gib, args.mode, args.served_name)
    except ExitplanError as exc:
        fail(exc)
    serve_forever(app, app.state.drain, args.host or d.host, args.port or d.base_port)


if __name__ == "__main__":
    main()
