"""The FastAPI application: routes, API-key check, body-size limit, readiness.

``build_app(state)`` is all a caller needs; ``ServerState`` holds the engines (added as they
finish loading) and the limits. Nothing here is module-global, so several apps can live in one
process (tests).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.server.anthropic.routes import add_anthropic_routes
from kvserve.server.batch_routes import add_batch_routes
from kvserve.server.batch_service import BatchService
from kvserve.server.body_check import invalid_unicode_error
from kvserve.server.chat import chat_prompt, create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from kvserve.server.errors import APIError, bad_request, error_response, install_error_handlers
from kvserve.server.http_guard import DEFAULT_BODY_READ_TIMEOUT, CorsOptions
from kvserve.server.lora import LoRAEngine, LoRARegistry, add_lora_routes
from kvserve.server.metrics import ServerMetrics
from kvserve.server.openapi import error_responses, generation_responses, install_openapi
from kvserve.server.openapi_limits import PublishedLimits
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.request_limits import check_chat, check_tools
from kvserve.server.responses import add_responses_routes
from kvserve.server.responses_store import ResponseStore
from kvserve.server.score import add_score_routes
from kvserve.server.serving import Limits, tokenize
from kvserve.server.sleep import add_sleep_routes
from kvserve.server.tools import ChatOptions, template_args
from kvserve.server.tracing import RequestTracer

logger = logging.getLogger("kvserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 1024 * 1024
# health, metrics and the OpenAPI document stay open
_PROTECTED_PREFIXES = (
    "/v1/", "/v2/", "/tokenize", "/detokenize", "/reset_prefix_cache", "/score", "/rerank",
    "/sleep", "/wake_up", "/is_sleeping",
)  # fmt: skip
SHUTTING_DOWN = "the server is shutting down"
# room for a /v1/files upload's multipart boundaries and form fields beside the file itself
_MULTIPART_OVERHEAD = 64 * 1024


@dataclass
class ServerState:
    """Everything the routes need; engines are added by the loader as they become ready."""

    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT  # seconds (--body-read-timeout)
    limits: Limits = field(default_factory=Limits)
    chat_options: ChatOptions = field(default_factory=ChatOptions)  # tool calling, templates
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses store: true
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint: a span per request
    cors: CorsOptions = field(default_factory=CorsOptions)  # --allowed-origins etc.
    # engine options the published document states (openapi_limits.py)
    max_logprobs: int = 20  # --max-logprobs
    priority_scheduling: bool = False  # --scheduling-policy priority
    engines: dict[str, AsyncLLMEngine] = field(default_factory=dict)  # served name -> engine
    model_paths: dict[str, str] = field(default_factory=dict)  # served name -> folder
    ready: bool = False  # every model has loaded
    load_error: str | None = None
    # Set on SIGTERM/SIGINT (kvserve.server.drain): API requests get 503, /health 503 "draining"
    draining: bool = False
    # Set when an engine dies once serving (kvserve.server.drain): /health 503 with it, the
    # requests in flight fail, and the server exits with code 1 for a supervisor to restart it
    fatal_error: str | None = None
    grpc_in_flight: int = 0  # gRPC calls being answered; the drain waits for them too
    loras: LoRARegistry = field(default_factory=LoRARegistry)  # served LoRA adapters (lora.py)
    batches: BatchService = field(default_factory=BatchService)  # /v1/files, /v1/batches
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_engine(self, engine: AsyncLLMEngine, path: str | None = None) -> None:
        """Register a loaded engine under its served name (thread-safe: the loader calls it)."""
        with self._lock:
            name = engine.model_name
            if name in self.engines:
                raise ValueError(f"two models are served as {name!r}; use --served-model-name")
            self.metrics.attach(name, engine)
            self.engines = {**self.engines, name: engine}  # copy-on-write: readers never lock
            self.model_paths[name] = path or name

    def engine_for(self, model: str | None) -> AsyncLLMEngine:
        """The engine serving ``model`` (None/"" -> the first model, like vLLM); a LoRA
        adapter's name gives its base model's engine running that adapter."""
        if not self.ready:
            raise APIError(503, self.load_error or "the server is still loading its models")
        engines = self.engines
        if not model:
            return next(iter(engines.values()))
        engine = engines.get(model)
        if engine is None and (served := self.loras.adapters.get(model)) is not None:
            view = LoRAEngine(engines[served.base], served, self.loras)
            return view  # type: ignore[return-value]  # the engine's interface, adapter-bound
        if engine is None:
            served_names = [*engines, *self.loras.adapters]
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served models: {', '.join(served_names)}",
                param="model",
                code="model_not_found",
            )
        return engine

    def observe_streams(
        self,
        engine: AsyncLLMEngine,
        params: SamplingParams,
        streams: Sequence[RequestStream],
        headers: Mapping[str, str],
    ) -> None:
        """Observability of an admitted API request's engine requests: vLLM's
        request_params_* histograms and, with tracing on, each one's span when it finishes
        (a child of the ``traceparent`` in ``headers``, HTTP headers or gRPC metadata)."""
        # an adapter's requests count under its base model (the metrics' model_name label)
        base = getattr(engine, "base_model_name", engine.model_name)
        self.metrics.observe_params(base, params, len(streams))
        if self.tracer is not None:
            self.tracer.watch(streams, engine.model_name, params, headers)

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # export the spans still queued


class GuardMiddleware:
    """API-key check, request-body size limit and invalid-Unicode check, before any parsing.

    The body is buffered (it is small by construction) and replayed to the app; after the
    replay, ``receive`` is passed through so disconnect detection keeps working.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        key = self.state.api_key
        if key and path.startswith(_PROTECTED_PREFIXES):
            refused = _auth_error(scope, key)
            if refused is not None:
                headers = {"WWW-Authenticate": "Bearer"}
                if _has_body(scope):  # closed, so that the body is never read
                    headers["Connection"] = "close"
                resp = error_response(
                    401, refused, code="invalid_api_key", headers=headers, path=path
                )
                await resp(scope, receive, send)
                return
        if self.state.draining and path.startswith(_PROTECTED_PREFIXES):
            # Connection: close, so that a client (or load balancer) reconnects elsewhere.
            resp = error_response(503, SHUTTING_DOWN, headers={"Connection": "close"}, path=path)
            await resp(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        timeout = self.state.body_read_timeout
        try:
            # bounded in time too: a body that trickles in would hold its connection (which
            # has a request in flight, so --max-connections never evicts it) for ever
            body = await asyncio.wait_for(self._read_body(scope, receive), timeout)
        except asyncio.TimeoutError:
            resp = error_response(
                408, f"the request body took longer than {timeout:g}s (--body-read-timeout)",
                headers={"Connection": "close"}, path=path,
            )  # fmt: skip
            await resp(scope, receive, send)
            return
        if body is None:
            limit, flag = self._body_limit(path)
            resp = error_response(
                413, f"the request body is larger than this server's limit of {limit} bytes "
                f"({flag})",
                code="request_too_large", headers={"Connection": "close"}, path=path,
            )  # fmt: skip
            await resp(scope, receive, send)
            return
        invalid = invalid_unicode_error(body)
        if invalid is not None:
            await invalid.response(path)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _body_limit(self, path: str) -> tuple[int, str]:
        """The most bytes a body to ``path`` may have, and the flag that sets it: a batch
        input file's upload has its own (its multipart envelope on top)."""
        if path == "/v1/files":
            limit = self.state.batches.limits.max_file_bytes + _MULTIPART_OVERHEAD
            return max(limit, self.state.max_request_body_bytes), "--max-batch-file-bytes"
        return self.state.max_request_body_bytes, "--max-request-body-bytes"

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it exceeds the limit (Content-Length or actual)."""
        limit, _ = self._body_limit(scope["path"])
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


def _auth_error(scope: Scope, key: str) -> str | None:
    """Why the request's ``Authorization`` (or Anthropic's ``x-api-key``) does not grant
    access, or None if it does; either header with the key grants it."""
    values = [value for name, value in scope["headers"] if name == b"authorization"]
    api_keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
    for header, given in (("Authorization", values), ("x-api-key", api_keys)):
        if len(given) > 1:
            # A singleton field (RFC 9110): which copy a proxy or the app would read differs,
            # so neither counts.
            return f"the request has {len(given)} {header} headers; send exactly one"
    if values and bearer_matches(values[0], key):
        return None
    # Constant-time, on bytes, as bearer_matches
    if api_keys and hmac.compare_digest(api_keys[0].strip(), key.encode()):
        return None
    return "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


def bearer_matches(value: bytes, key: str) -> bool:
    """An ``Authorization`` value (HTTP header or gRPC metadata) is ``Bearer <key>``."""
    scheme, _, token = value.partition(b" ")
    # Constant-time comparison: no timing side channel on the key. On bytes, because
    # compare_digest refuses non-ASCII str and a header may carry any byte.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


def published_limits(state: ServerState) -> PublishedLimits:
    """What ``/openapi.json`` states of this server's limits."""
    limits = state.limits
    return PublishedLimits(
        max_tokens=limits.max_tokens_limit,
        max_n=limits.max_n,
        max_prompts=limits.max_prompts_per_request,
        max_logprobs=state.max_logprobs,
        max_tools=limits.max_tools_per_request,
        max_messages=limits.max_chat_messages,
        priority_scheduling=state.priority_scheduling,
        request_chat_template=state.chat_options.trust_request_chat_template,
        auto_tool_choice=bool(
            state.chat_options.enable_auto_tool_choice and state.chat_options.tool_call_parser
        ),
        reasoning=state.chat_options.reasoning_parser is not None,
    )


def build_app(state: ServerState) -> FastAPI:
    """The ASGI app serving ``state``'s engines."""
    # /openapi.json is served (no key needed, like /health); the HTML docs are not.
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.kvserve = state
    install_error_handlers(app)
    install_openapi(app, _PROTECTED_PREFIXES if state.api_key else None, published_limits(state))
    app.add_middleware(GuardMiddleware, state=state)  # type: ignore[arg-type]
    if state.cors.enabled:
        # Added last, so outermost: a preflight (OPTIONS) is answered before the key check,
        # and every answer, a 401 included, carries the CORS headers a browser needs to read it.
        app.add_middleware(
            CORSMiddleware,  # type: ignore[arg-type]
            allow_origins=list(state.cors.allowed_origins),
            allow_methods=list(state.cors.allowed_methods),
            allow_headers=list(state.cors.allowed_headers),
            allow_credentials=state.cors.allow_credentials,
        )
    _add_openai_routes(app, state)
    add_responses_routes(app, state)  # /v1/responses (responses.py)
    add_anthropic_routes(app, state)  # /v1/messages (kvserve/server/anthropic/)
    add_lora_routes(app, state)  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora.py)
    add_batch_routes(app, state)  # /v1/files, /v1/batches and the batch loop (batch_*.py)
    add_score_routes(app, state)  # /score, /v1/score, /rerank, /v1/rerank, /v2/rerank
    add_sleep_routes(app, state)  # /sleep, /wake_up, /is_sleeping (sleep.py)
    _add_ops_routes(app, state)
    return app


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_completion(req, raw, engine, state.limits)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_chat_completion(req, raw, engine, state.limits, state.chat_options)

    errors = error_responses(400, 404, 413, 429, 500, 503)  # a generation route's, no SSE

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **errors})
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        engine = state.engine_for(req.model)
        return await create_embedding(req, raw, engine, state.limits)

    @app.get("/v1/models", responses=error_responses(500, 503))
    async def list_models() -> ModelList:
        state.engine_for(None)  # 503 while loading
        names = [*state.engines, *state.loras.adapters]
        return ModelList(data=[_card(state, name) for name in names])

    @app.get("/v1/models/{model_id:path}", responses=error_responses(404, 500, 503))
    async def get_model(model_id: str) -> ModelCard:
        return _card(state, state.engine_for(model_id).model_name)


def _card(state: ServerState, name: str) -> ModelCard:
    served = state.loras.adapters.get(name)
    if served is not None:  # an adapter: its folder, and the model it runs on (vLLM's card)
        engine = state.engines[served.base]
        lora = served.request
        return ModelCard(id=name, root=lora.lora_path, parent=served.base,
                         max_model_len=engine.max_model_len)  # fmt: skip
    engine = state.engines[name]
    return ModelCard(id=name, root=state.model_paths.get(name), max_model_len=engine.max_model_len)


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        if state.fatal_error:
            return error_response(503, state.fatal_error)
        if state.draining:
            return error_response(503, f"draining: {SHUTTING_DOWN}")
        if not state.ready:
            return error_response(503, state.load_error or "loading models")
        dead = {n: e.dead_reason for n, e in state.engines.items() if not e.is_healthy}
        if dead:
            return error_response(503, f"unhealthy engines: {dead}")
        return JSONResponse({"status": "ok"})

    @app.get("/ping", responses=error_responses(503))
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.post("/ping", responses=error_responses(503))
    async def ping_post() -> Response:
        """``POST /ping``, as SageMaker sends it: /health's answer."""
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        """vLLM's version endpoint: kvserve's version."""
        from kvserve import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=PlainTextResponse)  # documents text/plain
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/reset_prefix_cache", responses=error_responses(404, 500, 503))
    async def reset_prefix_cache(model: str | None = None) -> JSONResponse:
        """Forget the cached prefix blocks of every model (or of ``?model=``), as vLLM's
        endpoint does; running requests are not affected."""
        state.engine_for(None)  # 503 while loading
        served = state.loras.adapters.get(model or "")
        base = served.base if served is not None else None  # an adapter's: its model's cache
        names = [base or state.engine_for(model).model_name] if model else list(state.engines)
        dropped = {n: await state.engines[n].reset_prefix_cache() for n in names}
        return JSONResponse({"status": "ok", "num_blocks_dropped": dropped})

    @app.post("/tokenize", responses=error_responses(400, 404, 413, 500, 503))
    async def tokenize_route(req: TokenizeRequest) -> TokenizeResponse:
        engine = state.engine_for(req.model)  # exactly one of prompt / messages: the model's check
        if req.messages is not None:
            check_chat(state.limits, req.messages)
            check_tools(state.limits, req.tools)
            template = template_args(
                state.chat_options,
                tools=[t.model_dump(exclude_none=True) for t in req.tools or []] or None,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            prompt = await chat_prompt(engine, req.messages, req.add_generation_prompt, template)
            ids = prompt.token_ids
        else:
            ids = await tokenize(engine, req.prompt or "", req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize", responses=error_responses(400, 404, 413, 500, 503))
    async def detokenize_route(req: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.engine_for(req.model)
        if engine.tokenizer is None:
            raise bad_request("this model has no tokenizer", "model")
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is out of the vocabulary (size {vocab})", "tokens"
            )
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))
