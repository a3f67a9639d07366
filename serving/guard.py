"""What every request meets before a route: the API key, the drain, the body-size limit (one ASGI middleware).

Both servers (an engine server and the coordinator) install :class:`Guard` in front of every route, FastAPI's own
``/docs`` and ``/openapi.json`` included, so a route cannot be left open by forgetting a check in it:

- **API key.** When a key is set, every path but an explicit allowlist (``/health``) needs
  ``Authorization: Bearer <key>`` (compared in constant time); else 401.
- **Drain.** While the server drains (:class:`Drain`), every guarded path answers 503 with ``Retry-After``.
- **Body size.** A body over ``max_body_bytes`` (by its ``Content-Length``, or counted while it arrives when
  chunked) answers 413 before anything parses or tokenises it.

The key comes from an environment variable or a file (:func:`read_api_key`), never from the command line, where
``ps`` shows it to every user of the machine.
"""

from __future__ import annotations

import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exitplan.config import DeployParams
from exitplan.errors import ExitplanError
from serving.openai_schema import error_body

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the API key and during a drain (a load balancer's probe)."""

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted (1 MiB: a prompt far longer than any context these servers hold)."""

API_KEY_ENV: str = DeployParams.model_fields["api_key_env"].default
"""Environment variable the servers read their API key from by default: ``deploy.api_key_env``'s default."""


def read_api_key(env_var: str = API_KEY_ENV, file: Path | None = None) -> str | None:
    """The API key: from ``file`` when given (its first line), else from ``$env_var`` (None: no key).

    Raises:
        ExitplanError: when the file is missing, unreadable or empty.
    """
    if file is not None:
        try:
            key = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ExitplanError(f"API key file {file}: cannot be read ({exc})") from exc
        if not key:
            raise ExitplanError(f"API key file {file} is empty")
        return key
    return os.environ.get(env_var) or None


@dataclass
class Drain:
    """A server's shutdown in two steps: refuse new requests, then let the running ones finish for ``grace_s``.

    Attributes:
        grace_s: How long running requests may take after the drain starts.
        retry_after_s: ``Retry-After`` of the 503 new requests get.
        started_at: ``time.monotonic()`` when the drain began (None: serving).
        in_flight: Requests still running (the server's count).
        abort: Ends what still runs when the grace is over (each request gets a clear error, never a bare 500).
    """

    grace_s: float = 30.0
    retry_after_s: int = 1
    started_at: float | None = None
    in_flight: Callable[[], int] = lambda: 0
    abort: Callable[[], Awaitable[None] | None] = lambda: None
    aborted: bool = False

    @property
    def draining(self) -> bool:
        """The drain has begun."""
        return self.started_at is not None

    def begin(self) -> None:
        """Start draining (idempotent)."""
        if self.started_at is None:
            self.started_at = time.monotonic()

    def done(self) -> bool:
        """Nothing runs any more, or the grace is over."""
        return self.started_at is not None and (self.in_flight() == 0
                                                or time.monotonic() - self.started_at >= self.grace_s)

    async def finish(self) -> None:
        """Abort what still runs (once); call when :meth:`done`."""
        if not self.aborted and self.in_flight():
            self.aborted = True
            result = self.abort()
            if result is not None:
                await result


async def _answer(send: Callable, status: int, body: dict[str, Any], headers: Iterable[tuple[str, str]] = ()) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *((k.encode(), v.encode()) for k, v in headers)]})
    await send({"type": "http.response.body", "body": raw})


class Guard:
    """ASGI middleware: API key, drain and body limit in front of every route (see the module docstring).

    Args:
        app: The wrapped ASGI app.
        api_key: Bearer token required on every path outside ``open_paths`` (None: none).
        drain: The server's drain.
        max_body_bytes: Largest body accepted.
        open_paths: Paths that need no key and stay open while draining.
    """

    def __init__(self, app: Callable, api_key: str | None = None, drain: Drain | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app, self.drain, self.max_body_bytes, self.open_paths = app, drain or Drain(), max_body_bytes, open_paths
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            await _answer(send, 401, error_body("invalid or missing API key", "authentication_error",
                                                "invalid_api_key"))
            return
        if self.drain.draining:
            await _answer(send, 503, error_body("the server is shutting down: retry on another replica", "server_error",
                                                "shutting_down"), [("retry-after", str(self.drain.retry_after_s))])
            return
        body = await self._read_body(headers, receive, send)
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Callable, send: Callable) -> bytes | None:
        """The whole body, or None after answering 413 (over the limit) or when the client left."""
        declared = headers.get(b"content-length")
        too_large = error_body(f"request body over {self.max_body_bytes} bytes", "invalid_request_error",
                               "request_too_large")
        if declared is not None and not declared.isdigit():
            await _answer(send, 400, error_body("bad Content-Length", "invalid_request_error"))
            return None
        if declared is not None and int(declared) > self.max_body_bytes:
            await _answer(send, 413, too_large)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _answer(send, 413, too_large)
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that hands the app the body read already, then passes on the client's later messages (its
    disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
