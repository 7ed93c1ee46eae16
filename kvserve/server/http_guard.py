"""A guarded HTTP/1.1 layer: uvicorn's httptools protocol plus the limits it lacks.

Why a protocol subclass: uvicorn (0.54, with httptools, which ``http="auto"`` picks and kvserve
depends on) bounds nothing before a request reaches the app. llhttp takes any number of headers
of any size and httptools concatenates a header value in Python until it ends (1 GB of headers
was held, then answered 200); no timer runs while a request's head arrives, so a client that
sends half a request holds its socket forever (uvicorn's keep-alive timer starts only after a
response); and ``limit_concurrency`` is checked only once a head is complete, so connections
that never finish one are never counted, and at the file-descriptor limit every new client was
refused. h11's ``max_incomplete_event_size`` bounds bytes only: no count, no timer either.
No ASGI middleware can help, since the app sees a request only once its head is complete.

Per connection (``HttpLimits``):

- ``max_header_bytes``: the request line and headers must end within this many bytes; the
  parser is never fed more (431, then close), so a head costs at most that much memory;
- ``max_header_count``: more headers get 431 (the extra ones are not stored meanwhile);
- ``header_read_timeout``: from the accept, or from a kept-alive connection's next first
  byte, to the end of the head; then 408 (or a silent close if nothing came) and close.

Per server: ``max_connections``. When full, a new connection closes the oldest one that has no
request in flight (idle between requests, or a head still arriving) and takes its place, so
slow or idle clients cannot lock out a new one; when every connection has a request in flight
the new one gets 503 and is closed. Requests in flight are never cut.
"""

from __future__ import annotations

import argparse
import asyncio
import http
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserve.config import parse_bytes

logger = logging.getLogger("kvserve.server")

DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # nginx's default head buffers are 32 KiB; Node's 16 KiB
DEFAULT_MAX_HEADER_COUNT = 256  # vLLM's --h11-max-header-count default
DEFAULT_HEADER_READ_TIMEOUT = 10.0  # seconds
DEFAULT_BODY_READ_TIMEOUT = 60.0  # seconds for a whole body (at most --max-request-body-bytes)
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # seconds: uvicorn's and vLLM's (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_BACKLOG = 2048  # uvicorn's


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP layer's limits (``kvserve serve`` flags of the same names)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT  # enforced by the app's guard
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    backlog: int = DEFAULT_BACKLOG

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1024:
            raise ValueError("--max-header-bytes must be at least 1KiB")
        if self.max_header_count < 1 or self.max_connections < 1 or self.backlog < 1:
            raise ValueError("--max-header-count, --max-connections and --backlog must be >= 1")
        timeouts = (self.header_read_timeout, self.body_read_timeout, self.keep_alive_timeout)
        if not all(t > 0 for t in timeouts):  # also rejects nan
            raise ValueError(
                "--header-read-timeout, --body-read-timeout and --keep-alive-timeout must be > 0"
            )


LOG_EVERY_SECONDS = 10.0  # an attack must not flood the log: one line per kind this often


@dataclass
class _Registry:
    """One server's connections: how many are open, and which are idle, oldest first."""

    limits: HttpLimits
    open: set[GuardedHttpProtocol] = field(default_factory=set)  # not yet closed by us
    idle: dict[GuardedHttpProtocol, None] = field(default_factory=dict)  # insertion-ordered
    _logged: dict[str, tuple[float, int]] = field(default_factory=dict)  # kind -> (at, count)

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` at most once per LOG_EVERY_SECONDS per ``kind``, with a count."""
        now = time.monotonic()
        at, count = self._logged.get(kind, (-LOG_EVERY_SECONDS, 0))
        if now - at < LOG_EVERY_SECONDS:
            self._logged[kind] = (at, count + 1)
            return
        self._logged[kind] = (now, 0)
        more = f" (and {count} more like it in {now - at:.0f}s)" if count else ""
        logger.warning("%s%s", message, more)


def _error_bytes(status: int, message: str, extra: str = "") -> bytes:
    """A complete ``Connection: close`` response with OpenAI's error body."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    phrase = http.HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``HttpLimits``; made per server by ``guarded_protocol``."""

    limits: ClassVar[HttpLimits]
    registry: ClassVar[_Registry]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request's head
        self._head_bytes = 0
        self._head_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._closed = False  # closed by the guard: ignore whatever still arrives

    # -- connections ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        reg = self.registry
        if len(reg.open) >= self.limits.max_connections and not self._evict_idle():
            reg.warn("refused", f"--max-connections {len(reg.open)} reached: a client got 503")
            message = (
                f"the server has {len(reg.open)} connections with requests in flight "
                f"(--max-connections); retry later"
            )
            self._close(_error_bytes(503, message, "retry-after: 1\r\n"))
            return
        reg.open.add(self)
        reg.idle[self] = None
        self._arm_head_timer()

    def _evict_idle(self) -> bool:
        """Close the oldest connection with no request in flight; False if there is none."""
        if not self.registry.idle:
            return False
        victim = next(iter(self.registry.idle))
        victim._close(b"")
        self.registry.warn("evicted", "--max-connections reached: closed the oldest idle one")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def _forget(self) -> None:
        self.registry.open.discard(self)
        self.registry.idle.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _close(self, response: bytes) -> None:
        """Send ``response`` (if any) and close; the connection stops counting at once."""
        self._closed = True
        self._forget()
        self._unset_keepalive_if_required()
        if not self.transport.is_closing():
            if response:
                self.transport.write(response)
            self.transport.close()

    # -- the head -------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_read_timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # a response is still being sent (a stream) while the next head trickles in:
            # the request in flight is not cut; the head is timed again after it
            self._arm_head_timer()
            return
        if self._in_head and not self._closed:
            timeout = self.limits.header_read_timeout
            message = f"the request's headers took longer than {timeout:g}s (--header-read-timeout)"
            # nothing of a request arrived (a preconnect, an idle socket): close without a word
            self._close(_error_bytes(408, message) if self._head_bytes else b"")

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        if not self._in_head:
            super().data_received(data)
            return
        if self._head_timer is None:  # the first byte of a kept-alive connection's next head
            self._arm_head_timer()
        room = self.limits.max_header_bytes - self._head_bytes
        self._head_bytes += min(len(data), room)
        if len(data) <= room:
            super().data_received(data)
            return
        super().data_received(data[:room])  # the parser never holds more than the limit
        if self._closed or self.transport.is_closing():
            return
        if self._in_head:
            limit = self.limits.max_header_bytes
            self._too_large(f"the request's line and headers exceed {limit} bytes", "bytes")
            return
        self.data_received(data[room:])  # the body, or the next request's head

    def _too_large(self, message: str, limit: str) -> None:
        self.registry.warn("431", f"431: {message}")
        self._close(_error_bytes(431, f"{message} (--max-header-{limit})"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_count += 1
        if self._head_count <= self.limits.max_header_count:  # the rest are not stored
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._closed:  # the rest of a chunk after a 431: nothing more is answered
            return
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._head_count > self.limits.max_header_count:
            self._too_large(f"the request has {self._head_count} headers", "count")
            return
        self.registry.idle.pop(self, None)  # a request in flight: never evicted
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._closed:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._closed:
            return
        super().on_message_complete()
        self._in_head, self._head_bytes, self._head_count = True, 0, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn arms its keep-alive timer only when no pipelined request is waiting
        if self.timeout_keep_alive_task is not None and not self._closed:
            self.registry.idle[self] = None  # idle again, and now the newest


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for one server (uvicorn's ``http=``): its own connection registry."""
    attrs = {"limits": limits, "registry": _Registry(limits)}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), attrs)


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for ``limits``.

    ``limit_concurrency`` stays unset: it answers 503 once a request's head is complete when
    connections *or* tasks reach it (counting the asking connection itself), which the
    connection cap above already bounds, earlier and without cutting requests in flight.
    """
    return {
        "http": guarded_protocol(limits),
        "ws": "none",  # no WebSocket routes: an Upgrade header is not acted on
        "timeout_keep_alive": limits.keep_alive_timeout,
        "backlog": limits.backlog,
    }


@dataclass(frozen=True)
class CorsOptions:
    """vLLM's CORS flags. Off unless ``allowed_origins`` is given (vLLM's default is ``*``:
    any web page could then call the API from its visitors' browsers)."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)


def _str_list(value: str) -> tuple[str, ...]:
    """A flag's list: JSON (vLLM's form, ``'["https://a.example"]'``) or comma-separated."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return tuple(items)
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_http_args(parser: argparse.ArgumentParser) -> None:
    """``kvserve serve``'s HTTP connection and CORS flags."""
    g = parser.add_argument_group("HTTP connections (limits applied before any request runs)")
    g.add_argument(
        "--max-header-bytes", "--h11-max-incomplete-event-size", type=parse_bytes,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="most bytes of a request's line and headers; more: 431 and the connection is "
             "closed (vLLM's name: --h11-max-incomplete-event-size)",
    )  # fmt: skip
    g.add_argument(
        "--max-header-count", "--h11-max-header-count", type=int,
        default=DEFAULT_MAX_HEADER_COUNT,
        help="most headers in a request; more: 431 (vLLM's name: --h11-max-header-count)",
    )  # fmt: skip
    g.add_argument(
        "--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT,
        help="seconds a request's line and headers may take to arrive; then 408 and close",
    )  # fmt: skip
    g.add_argument(
        "--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
        help="seconds a request's body may take to arrive once its headers are in; then 408",
    )  # fmt: skip
    g.add_argument(
        "--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
        help="seconds an idle connection is kept open between requests",
    )  # fmt: skip
    g.add_argument(
        "--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
        help="most open HTTP connections; when full, the oldest idle one (no request in "
             "flight) is closed for a new one, or the new one gets 503 if none is idle",
    )  # fmt: skip
    g.add_argument(
        "--backlog", type=int, default=DEFAULT_BACKLOG,
        help="connections the OS may queue before they are accepted (uvicorn's backlog)",
    )  # fmt: skip
    cors = parser.add_argument_group("CORS (vLLM's flags; off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins", type=_str_list, default=(),
        help="origins a browser may call the API from: a JSON list as vLLM takes it "
             "('[\"https://app.example\"]') or comma-separated; '*' for any",
    )  # fmt: skip
    cors.add_argument(
        "--allowed-methods", type=_str_list, default=("*",),
        help="methods allowed cross-origin (JSON list or comma-separated)",
    )  # fmt: skip
    cors.add_argument(
        "--allowed-headers", type=_str_list, default=("*",),
        help="request headers allowed cross-origin (JSON list or comma-separated)",
    )  # fmt: skip
    cors.add_argument(
        "--allow-credentials", action="store_true",
        help="let cross-origin requests carry cookies and HTTP authentication",
    )  # fmt: skip


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from ``add_http_args``' flags (ValueError names a bad flag)."""
    return HttpLimits(
        max_header_bytes=args.max_header_bytes,
        max_header_count=args.max_header_count,
        header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        backlog=args.backlog,
    )


def cors_from_args(args: argparse.Namespace) -> CorsOptions:
    return CorsOptions(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )


def raise_fd_limit(limits: HttpLimits) -> HttpLimits:
    """Raise the soft file-descriptor limit toward the hard one (as vLLM's ``set_ulimit``
    does), so that --max-connections, not the OS, is what turns clients away; if the hard
    limit is too low, lower the cap to fit with a warning (out of descriptors, asyncio's accept
    loop fails and pauses, turning every client away, innocent or not)."""
    try:
        import resource
    except ImportError:  # Windows
        return limits
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limits.max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            logger.warning("could not raise the file-descriptor limit from %d: %s", soft, e)
    if soft != resource.RLIM_INFINITY and soft < want:
        cap = max(1, soft - _FD_RESERVE)
        logger.warning(
            "--max-connections %d lowered to %d: the file-descriptor limit is %d (ulimit -n)",
            limits.max_connections, cap, soft,
        )  # fmt: skip
        return replace(limits, max_connections=cap)
    return limits


# descriptors kept for everything but client connections: model files, the engine's pipes
# and sockets (tensor-parallel workers, gRPC), logs
_FD_RESERVE = 256
