"""The OpenAI-compatible API of one engine server (FastAPI), served by the HELIOS engine through its worker.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``/telemetry`` (per-request exit layers and confidences, what
``reprofile_fleet`` reads; prompt token ids only when asked for with ``?include_prompts=true``). Every malformed
request gets a 4xx in OpenAI's error format: bad JSON or fields (400), a wrong API key (401, every route but
``/health``: :mod:`serving.guard`), an unknown model (404), a body over the limit (413), a prompt over the context
(400, by a character bound before tokenising when it cannot fit); a full queue gets 429 with ``Retry-After``, a
draining server 503 with ``Retry-After``, a request over its time limit 504, a request still running when the drain's
grace ends 503. Tokenising runs on a thread of its own, never on the event loop; a client that goes away cancels
its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exitplan.engine.request import Request
from serving.guard import DEFAULT_MAX_BODY_BYTES, Drain, Guard
from serving.openai_schema import ChatRequest, CompletionRequest, completion, error_body, new_id, usage_chunk
from serving.worker import EngineWorker, Failure, QueueFull, ShuttingDown

T = TypeVar("T")


@dataclass
class ServerSettings:
    """Knobs of one engine server.

    Attributes:
        model: The model id clients name.
        max_context: Prompt + generation tokens a request may reserve.
        request_timeout_s: A request still unfinished after this is cancelled (504).
        api_key: Bearer token required on every route but ``/health`` when set.
        retry_after_s: ``Retry-After`` of a 429 or a draining 503.
        max_body_bytes: Largest request body (413 beyond).
        drain_s: Grace of a drain: how long running requests may take after SIGTERM.
    """

    model: str
    max_context: int
    request_timeout_s: float = 120.0
    api_key: str | None = None
    retry_after_s: int = 1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_s: float = 30.0


class ApiError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


def error_response(exc: ApiError) -> JSONResponse:
    """The JSON response of an :class:`ApiError`."""
    return JSONResponse(error_body(exc.message, exc.kind, exc.code), status_code=exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's format; validation errors are 400 with the field named (never a 5xx)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse(error_body(f"invalid request: {problems}", "invalid_request_error"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


def failure_error(failure: Failure) -> ApiError:
    """The :class:`ApiError` of a request the worker ended without an answer."""
    kind = "invalid_request_error" if failure.status < 500 else "server_error"
    headers = {"Retry-After": "1"} if failure.status == 503 else None
    return ApiError(failure.status, failure.message, kind, failure.code, headers)


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def until_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the client of this request disconnects (ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless(work: Awaitable[T], stop: Awaitable[Any], interrupted: Exception) -> T:
    """``work``'s result; when ``stop`` completes first, ``work`` is cancelled (and awaited) and ``interrupted`` is
    raised. Cancelling the caller cancels ``work`` too."""
    task, stopper = asyncio.ensure_future(work), asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise interrupted
    return task.result()


async def unless_disconnected(http: HttpRequest, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`ClientGone` (with ``work`` cancelled) when the client leaves first."""
    return await unless(work, until_disconnected(http.receive), ClientGone())


def longest_token_chars(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry spans (its byte-level spelling: an upper bound on the text any one
    token covers), so that ``len(text) > tokens x this`` proves a text has more than ``tokens`` tokens."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


class EngineApi:
    """The routes of one engine server.

    Args:
        worker: The engine worker (started by the app's lifespan).
        tokenizer: The served model's tokenizer.
        settings: Server knobs.
    """

    def __init__(self, worker: EngineWorker, tokenizer: Any, settings: ServerSettings) -> None:
        from exitplan.engine.factory import stop_ids

        self.worker, self.tokenizer, self.settings = worker, tokenizer, settings
        self.stop = stop_ids(tokenizer)
        self.max_prompt_chars = settings.max_context * longest_token_chars(tokenizer)
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._count = 0

    def prompt_ids(self, body: CompletionRequest | ChatRequest) -> list[int]:
        """Token ids of the prompt (chat template for chat requests)."""
        if isinstance(body, ChatRequest):
            ids = self.tokenizer.apply_chat_template([m.model_dump() for m in body.messages],
                                                     add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(body.prompt))

    async def make_request(self, body: CompletionRequest | ChatRequest) -> Request:
        """Validate against this server (model, context) and build the engine request (tokenised off the event
        loop, after a character bound refused what cannot fit)."""
        if body.model != self.settings.model:
            raise ApiError(404, f"model '{body.model}' is not served here (serving '{self.settings.model}')",
                           code="model_not_found")
        chars = sum(len(m.content) for m in body.messages) if isinstance(body, ChatRequest) else len(body.prompt)
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt ({chars} characters) cannot fit the context of "
                                f"{self.settings.max_context} tokens", code="context_length_exceeded")
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.prompt_ids, body)
        limit = body.limit() if isinstance(body, ChatRequest) else body.max_tokens
        if not ids:
            raise ApiError(400, "the prompt has no tokens")
        if len(ids) + limit > self.settings.max_context:
            raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({limit}) exceeds the context of "
                                f"{self.settings.max_context} tokens", code="context_length_exceeded")
        self._count += 1
        return Request(f"r{self._count}-{new_id('x')[-8:]}", ids, limit, temperature=body.temperature,
                       stop_ids=self.stop, seed=body.seed or 0)

    def submit(self, request: Request) -> asyncio.Queue:
        """Hand the request to the worker; its events arrive on the returned queue."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            self.worker.submit(request, lambda kind, value: loop.call_soon_threadsafe(events.put_nowait,
                                                                                        (kind, value)))
        except QueueFull as exc:
            self.worker.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"server busy: {exc}", "rate_limit_error", "queue_full",
                           {"Retry-After": str(self.settings.retry_after_s)}) from exc
        except ShuttingDown as exc:
            self.worker.metrics.rejected.labels("draining").inc()
            raise ApiError(503, str(exc), "server_error", "shutting_down") from exc
        return events

    async def events(self, request: Request, queue: asyncio.Queue) -> AsyncIterator[tuple[str, Any]]:
        """The request's events until done; cancels it in the engine on timeout or when the client goes away."""
        deadline = time.monotonic() + self.settings.request_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                kind, value = await asyncio.wait_for(queue.get(), timeout=remaining)
                yield kind, value
                if kind in ("done", "error"):
                    return
        except (TimeoutError, asyncio.CancelledError, GeneratorExit):
            self.worker.cancel(request.request_id)
            raise

    async def answer(self, body: CompletionRequest | ChatRequest, http: HttpRequest) -> Any:
        """Serve one request, streamed or whole (a whole one is cancelled in the engine if its client leaves)."""
        chat = isinstance(body, ChatRequest)
        request = await self.make_request(body)
        queue = self.submit(request)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return StreamingResponse(self._stream(rid, body.model, request, queue, chat, body.include_usage),
                                     media_type="text/event-stream")
        try:
            finish = await unless_disconnected(http, self._whole(request, queue))
        except ClientGone:  # the waiting task may be cancelled before it ran: cancel here, not only in events()
            self.worker.cancel(request.request_id)
            self.worker.metrics.rejected.labels("client_gone").inc()
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        text = self.tokenizer.decode(request.output, skip_special_tokens=True)
        return completion(rid, body.model, text, finish, chat, (len(request.prompt), len(request.output)))

    async def _whole(self, request: Request, queue: asyncio.Queue) -> str:
        """Wait for a whole answer; its finish reason."""
        finish = "stop"
        try:
            async for kind, value in self.events(request, queue):
                if kind == "error":
                    raise failure_error(value)
                if kind == "done":
                    finish = "length" if value == "length" else "stop"
        except TimeoutError as exc:
            raise ApiError(504, f"request timed out after {self.settings.request_timeout_s} s", "server_error",
                           "timeout") from exc
        return finish

    async def _stream(self, rid: str, model: str, request: Request, queue: asyncio.Queue,
                      chat: bool, include_usage: bool = False) -> AsyncIterator[str]:
        sent = ""
        try:
            async for kind, value in self.events(request, queue):
                if kind == "error":
                    error = failure_error(value)
                    yield sse(error_body(error.message, error.kind, error.code))
                    break
                text = self.tokenizer.decode(request.output, skip_special_tokens=True)
                if kind == "tokens" and len(text) > len(sent) and text.startswith(sent):
                    yield sse(completion(rid, model, text[len(sent):], None, chat, chunk=True))
                    sent = text
                if kind == "done":
                    finish = "length" if value == "length" else "stop"
                    yield sse(completion(rid, model, text[len(sent):], finish, chat,
                                         (len(request.prompt), len(request.output)), chunk=True))
                    if include_usage:
                        yield sse(usage_chunk(rid, model, chat, (len(request.prompt), len(request.output))))
        except TimeoutError:
            yield sse(error_body(f"request timed out after {self.settings.request_timeout_s} s", "server_error",
                                 "timeout"))
        yield sse("[DONE]")


def create_app(worker: EngineWorker, tokenizer: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app of one engine server behind its :class:`~serving.guard.Guard` (``app.state.drain`` is the
    drain a :class:`~serving.lifecycle.DrainingServer` starts); its lifespan starts the worker and stops it."""
    from contextlib import asynccontextmanager

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    api = EngineApi(worker, tokenizer, settings)
    drain = Drain(settings.drain_s, settings.retry_after_s, in_flight=lambda: worker.in_flight, abort=worker.abort)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        drain.begin()
        await asyncio.to_thread(worker.stop, max(settings.drain_s - (time.monotonic() - drain.started_at), 0.0))

    app = FastAPI(title="exitplan engine", lifespan=lifespan)
    app.state.drain = drain
    app.add_middleware(Guard, api_key=settings.api_key, drain=drain, max_body_bytes=settings.max_body_bytes)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Any:
        return await api.answer(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest) -> Any:
        return await api.answer(body, http)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "owned_by": "exitplan"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = worker.healthy and not drain.draining
        return JSONResponse({"status": "ok" if ok else "draining", "model": settings.model,
                             "in_flight": worker.in_flight}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        worker.metrics.queue_depth.set(worker.queue_depth())
        return PlainTextResponse(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/telemetry")
    async def telemetry(include_prompts: bool = False) -> list[dict[str, Any]]:
        rows = list(worker.telemetry)
        return rows if include_prompts else [{k: v for k, v in row.items() if k != "prompt"} for row in rows]

    return app
