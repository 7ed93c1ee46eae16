"""``kvserve serve``: an OpenAI-compatible server, a drop-in for ``vllm serve``.

uvicorn starts first and answers ``/health`` with 503 while the models load in a background
thread; once every model has loaded ``/health`` turns 200. A model that fails to load stops
the server with exit code 1, and so does an engine that dies later (a killed tensor-parallel
worker: ``kvserve.server.drain``), so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import multiprocessing
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from kvserve.config import parse_bytes
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.vllm_flags import add_vllm_flags
from kvserve.model.hub import parse_hub_model
from kvserve.ray.options import add_ray_args
from kvserve.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerState, build_app
from kvserve.server.batch_args import add_batch_args, batch_service_from_args
from kvserve.server.http_guard import (
    add_http_args,
    cors_from_args,
    http_limits_from_args,
    raise_fd_limit,
    uvicorn_options,
)
from kvserve.server.lora import (
    LoRARegistry,
    load_lora_modules,
    parse_lora_module,
    runtime_updating_allowed,
)
from kvserve.server.metrics import ServerMetrics
from kvserve.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from kvserve.server.responses_store import ResponseStore, add_responses_args, store_limits_from_args
from kvserve.server.serving import Limits
from kvserve.server.stat_logger import StatLogger, log_interval
from kvserve.server.tool_parsers import TOOL_PARSERS
from kvserve.server.tools import ChatOptions
from kvserve.server.tracing import RequestTracer, otlp_protocol

logger = logging.getLogger("kvserve.server")

API_KEY_ENV = "KVSERVE_API_KEY"
# Exiting at once (see _exit_now): how long a killed worker process may take to be reaped.
WORKER_KILL_WAIT_S = 2.0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``serve`` sub-command on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible HTTP API",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_serve_args(p)


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` flags on ``p`` (``run-batch`` takes them too)."""
    p.add_argument(
        "models", nargs="*", default=[],
        help="model folders, .gguf files or Hugging Face Hub ids (org/name, "
             "org/name:file.gguf; from the HF cache, else downloaded unless HF_HUB_OFFLINE=1), "
             "each served as its own model (or one with --model, as vllm serve; none: the "
             "built-in SmolLM2-135M-Instruct)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--grpc-port", type=int, default=None,
        help="also serve the gRPC API (kvserve.v1.Generation, grpc.health.v1, reflection) on "
             "this port of --host, beside HTTP, with the same models, API key and queue caps "
             "(0: a free port; default: no gRPC)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=None,
        help=f"require 'Authorization: Bearer <key>' on /v1/*, /tokenize, /detokenize "
             f"(default: ${API_KEY_ENV} if set)",
    )  # fmt: skip
    p.add_argument(
        "--max-queued-requests", type=int, default=None,
        help="most sequences waiting per model; more get 429 + Retry-After (default: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-queued-tokens", type=int, default=None,
        help="most prompt tokens (x n) waiting per model; more get 429 (default: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--max-request-body-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413 (accepts e.g. 1MiB)",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens-limit", type=int, default=None,
        help="most tokens one request may generate; above: 400 (default: the context)",
    )  # fmt: skip
    p.add_argument(
        "--max-n", type=int, default=Limits.max_n,
        help="most completions (n) one request may ask per prompt; above: 400",
    )  # fmt: skip
    p.add_argument(
        "--max-prompts-per-request", type=int, default=Limits.max_prompts_per_request,
        help="most prompts in one completions request; above: 400",
    )  # fmt: skip
    cost = p.add_argument_group(
        "the cost of one request (above a limit: 400 naming its flag; --max-logprobs is "
        "with the engine's flags)"
    )
    cost.add_argument(
        "--max-num-seqs-per-request", type=int, default=Limits.max_num_seqs_per_request,
        help="most sequences one request may start: prompts x n",
    )  # fmt: skip
    cost.add_argument(
        "--max-tools-per-request", type=int, default=Limits.max_tools_per_request,
        help="most tools in one chat request (/tokenize with messages too)",
    )  # fmt: skip
    cost.add_argument(
        "--max-json-schema-bytes", type=parse_bytes, default=Limits.max_json_schema_bytes,
        help="largest JSON schema a structured output is compiled from (response_format, "
             "guided_json, structured_outputs.json, the schema tool_choice 'required' or a "
             "named tool builds from the tools), as compact JSON; accepts e.g. 64KiB",
    )  # fmt: skip
    cost.add_argument(
        "--max-json-schema-enum-members", type=int,
        default=Limits.max_json_schema_enum_members,
        help="most enum members across that schema; guided_choice's choices count too",
    )  # fmt: skip
    cost.add_argument(
        "--max-grammar-bytes", type=parse_bytes, default=Limits.max_grammar_bytes,
        help="largest regex, grammar or structural tag (guided_regex, guided_grammar, "
             "structured_outputs...), or guided_choice's strings together",
    )  # fmt: skip
    cost.add_argument(
        "--max-chat-messages", type=int, default=Limits.max_chat_messages,
        help="most messages in one conversation (chat, /tokenize)",
    )  # fmt: skip
    cost.add_argument(
        "--max-chat-bytes", type=parse_bytes, default=Limits.max_chat_bytes,
        help="most UTF-8 bytes of text in one conversation: the messages, their tool calls' "
             "arguments and the documents",
    )  # fmt: skip
    cost.add_argument(
        "--max-score-tokens-per-request", type=int,
        default=Limits.max_score_tokens_per_request,
        help="most prompt tokens of one /score or /rerank request in all (a reranker's "
             "template repeats the query in every document's prompt)",
    )  # fmt: skip
    sleep = p.add_argument_group("sleep mode (with --enable-sleep-mode)")
    sleep.add_argument(
        "--sleep-idle-seconds", type=float, default=None,
        help="llama.cpp's flag: a model idle this long sleeps (--sleep-idle-level) and the "
             "next request wakes it (its time to first token pays the wake, logged)",
    )  # fmt: skip
    sleep.add_argument(
        "--sleep-idle-level", type=int, default=1, choices=(1, 2),
        help="the idle sleep's level: 1 frees the KV cache, 2 the weights too (read again "
             "from the model folder on wake, as llama.cpp unloads the model)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout", type=float, default=0.0,
        help="on SIGTERM/SIGINT: seconds the requests in flight may take to finish (new ones "
             "get 503) before the rest are aborted; 0: abort at once",
    )  # fmt: skip
    p.add_argument(
        "--log-level", "--uvicorn-log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the HTTP server's (uvicorn's) log level; --uvicorn-log-level is vLLM's name",
    )  # fmt: skip
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    p.add_argument(
        "--grammar-warm-up", action=argparse.BooleanOptionalAction, default=True,
        help="start the grammar compile workers (structured outputs, tool_choice required or "
             "named) with the server, so that the first grammar does not wait for them; "
             "--no-grammar-warm-up starts them with the first grammar instead (docs/server.md, "
             "Structured outputs: what each way costs)",
    )  # fmt: skip
    add_http_args(p)  # header limits and timeouts, --max-connections, CORS (http_guard.py)
    tools = p.add_argument_group("tool calling and chat templates (vLLM's flags)")
    tools.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="let the model call tools by itself (tool_choice 'auto'); needs --tool-call-parser",
    )  # fmt: skip
    tools.add_argument(
        "--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
        help="how to find tool calls in the model's text for tool_choice 'auto': hermes "
             "(<tool_call>{json}</tool_call>), llama3_json ({\"name\", \"parameters\"}), "
             "pythonic ([f(a=1)])",
    )  # fmt: skip
    tools.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="accept a chat template in the request (chat_template, "
             "chat_template_kwargs.chat_template); refused with 400 otherwise",
    )  # fmt: skip
    tools.add_argument(
        "--exclude-tools-when-tool-choice-none", action="store_true",
        help="do not show the tools to the chat template when tool_choice is 'none'",
    )  # fmt: skip
    add_responses_args(p)  # the /v1/responses store's bounds (responses_store.py)
    tools.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="split the model's thinking (<think>...</think>) from its answer: chat's "
             "reasoning and reasoning_content, Messages' thinking blocks; deepseek_r1 (the "
             "output starts inside the thinking) or qwen3 (it starts with <think>); the "
             "model's tokenizer must have both markers",
    )  # fmt: skip
    lora = p.add_argument_group("LoRA adapters (vLLM's flags; with --enable-lora)")
    lora.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, default=None,
        help="adapters to serve, as name=path or JSON {\"name\": ..., \"path\": ..., "
             "\"base_model_name\": ...}; a request's model field names one",
    )  # fmt: skip
    lora.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 does)",
    )  # fmt: skip
    add_batch_args(p)
    EngineArgs.add_cli_args(p.add_argument_group("engine (applied to every model)"))
    add_ray_args(p)
    add_vllm_flags(p)  # last: vLLM's other flags, accepted or refused by name (vllm_flags.py)
    return p


def _lora_module(value: str) -> object:
    try:
        return parse_lora_module(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _model_specs(args: argparse.Namespace) -> list[tuple[str | None, str | None]]:
    """(model, served name) pairs; raises ValueError for inconsistent flags."""
    models: list[str | None] = list(args.models) or [None]
    if args.model is not None:  # vllm serve --model M: the same as the positional M
        if args.models and args.models != [args.model]:
            raise ValueError(
                f"--model {args.model!r} and the positional models {args.models} disagree; "
                "give the model one way"
            )
        models = [args.model]
    for m in models:
        if m is not None and not Path(m).expanduser().exists() and parse_hub_model(m) is None:
            raise ValueError(
                f"model {m!r} does not exist; give a model folder, a .gguf file or a Hugging "
                "Face Hub id (org/name, org/name:file.gguf)"
            )
    names = args.served_model_name
    if names is not None and len(names) != len(models):
        raise ValueError(
            f"--served-model-name got {len(names)} names for {len(models)} models; "
            f"give one per model"
        )
    names = names or [None] * len(models)
    if len(set(n for n in names if n)) != len([n for n in names if n]):
        raise ValueError("--served-model-name values must be distinct")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ValueError("--max-tokens-limit must be >= 1")
    if args.max_num_queued_tokens is not None and args.max_num_queued_tokens < 0:
        raise ValueError("--max-num-queued-tokens must be >= 0")
    if args.max_n < 1 or args.max_prompts_per_request < 1:
        raise ValueError("--max-n and --max-prompts-per-request must be >= 1")
    _check_cost_limits(args)
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    store_limits_from_args(args)  # the /v1/responses store's flags (ValueError if bad)
    if args.grpc_port is not None and not (
        0 <= args.grpc_port <= 65535 and args.grpc_port != args.port
    ):
        raise ValueError("--grpc-port must be in 0-65535 and differ from --port")
    if not args.shutdown_timeout >= 0:  # also rejects nan
        raise ValueError("--shutdown-timeout must be >= 0")
    return list(zip(models, names, strict=True))


# The request-cost flags: (attribute, flag) pairs; each must be >= 1.
_COST_FLAGS = (
    ("max_num_seqs_per_request", "--max-num-seqs-per-request"),
    ("max_tools_per_request", "--max-tools-per-request"),
    ("max_json_schema_bytes", "--max-json-schema-bytes"),
    ("max_json_schema_enum_members", "--max-json-schema-enum-members"),
    ("max_grammar_bytes", "--max-grammar-bytes"),
    ("max_chat_messages", "--max-chat-messages"),
    ("max_chat_bytes", "--max-chat-bytes"),
    ("max_score_tokens_per_request", "--max-score-tokens-per-request"),
)


def _check_cost_limits(args: argparse.Namespace) -> None:
    for attr, flag in _COST_FLAGS:
        if getattr(args, attr) < 1:
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, attr)}")
    idle = args.sleep_idle_seconds
    if idle is not None and not (idle > 0 and args.enable_sleep_mode):
        raise ValueError(f"--sleep-idle-seconds {idle}: needs --enable-sleep-mode and a "
                         "positive number of seconds")  # fmt: skip


def load_models(
    state: ServerState,
    specs: list[tuple[str | None, str | None]],
    args: argparse.Namespace,
    engine_args: EngineArgs,
) -> None:
    """Build each engine and register it; then mark the server ready. Raises on failure."""
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine

    for model, name in specs:
        config = replace(engine_args, model=model, served_model_name=name).create_engine_config()
        engine = LLMEngine(config)
        if state.chat_options.reasoning_parser is not None:  # a model that thinks, or refused
            parser = get_reasoning_parser(state.chat_options.reasoning_parser)
            parser.check_tokenizer(engine.tokenizer, engine.model_name)
        if engine.tokenizer is not None and args.grammar_warm_up:
            engine.grammar_compiler.warm_up()  # fork the compile workers before any grammar
        queue = AsyncLLMEngine(
            engine, args.max_queued_requests, max_queued_tokens=args.max_num_queued_tokens,
            sleep_idle_seconds=getattr(args, "sleep_idle_seconds", None),
            sleep_idle_level=getattr(args, "sleep_idle_level", 1),
        )  # fmt: skip
        state.add_engine(queue, config.model.path)
        logger.info("serving %s (max_model_len %d)", engine.model_name, engine.max_model_len)
    load_lora_modules(state, getattr(args, "lora_modules", None) or [])
    state.ready = True


def _tracer(endpoint: str | None) -> RequestTracer | None:
    """--otlp-traces-endpoint's tracer (ValueError without OpenTelemetry: exit code 2)."""
    if not endpoint:
        return None
    tracer = RequestTracer(endpoint)
    logger.info("tracing: a span per request to %s (OTLP %s)", endpoint, otlp_protocol())
    return tracer


def build_state(args: argparse.Namespace, engine_args: EngineArgs) -> ServerState:
    """The server's state from its flags, before any model loads (also each Ray replica's)."""
    return ServerState(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        body_read_timeout=args.body_read_timeout,
        limits=Limits(
            max_tokens_limit=args.max_tokens_limit,
            max_n=args.max_n,
            max_prompts_per_request=args.max_prompts_per_request,
            **{attr: getattr(args, attr) for attr, _ in _COST_FLAGS},
        ),
        chat_options=ChatOptions(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            trust_request_chat_template=args.trust_request_chat_template,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            reasoning_parser=getattr(args, "reasoning_parser", None),
        ),
        metrics=ServerMetrics(engine_args.metrics_prefix),
        tracer=_tracer(engine_args.otlp_traces_endpoint),
        cors=cors_from_args(args),
        max_logprobs=engine_args.max_logprobs,
        priority_scheduling=engine_args.scheduling_policy == "priority",
        responses=ResponseStore(store_limits_from_args(args)),
        loras=LoRARegistry(
            runtime_updating_allowed(getattr(args, "allow_runtime_lora_updating", False))
        ),
        batches=batch_service_from_args(args),
    )


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 0 on a clean stop (SIGTERM/SIGINT drain the requests
    in flight first: ``kvserve.server.drain``), 1 if a model failed to load."""
    import uvicorn

    from kvserve.server.drain import UVICORN_GRACE_SECONDS, DrainingServer

    if args.ray and getattr(args, "batch_dir", None):
        raise ValueError("--batch-dir does not apply with --ray: the Batch API is off there "
                         "(its replicas share no disk); use kvserve run-batch")  # fmt: skip
    if args.ray:  # Ray Serve replicas behind one OpenAI ingress (kvserve/ray/)
        check_ray_installed()
        from kvserve.ray.app import run_ray_serve

        return run_ray_serve(args)
    specs = _model_specs(args)
    # Built before uvicorn starts, so a bad engine option exits with code 2 and a message.
    engine_args = replace(EngineArgs.from_cli_args(args), model=None, served_model_name=None)
    for model, _ in specs:
        # per-model checks (e.g. --tokenizer); offline, a Hub id must be in the cache: a
        # clear exit code 2 now rather than a failed load later (online it downloads then)
        replace(engine_args, model=model).check_hub_cache()
    http_limits = raise_fd_limit(http_limits_from_args(args))
    state = build_state(args, engine_args)
    config = uvicorn.Config(
        build_app(state),
        host=args.host,
        port=args.port,
        log_config=None,  # keep the process's logging setup
        log_level=args.log_level,
        access_log=not args.no_access_log,
        # uvicorn's own wait comes after the drain, which has finished or failed every request.
        timeout_graceful_shutdown=UVICORN_GRACE_SECONDS,
        **uvicorn_options(http_limits),  # the guarded HTTP layer (http_guard.py)
    )
    server = DrainingServer(config, state, args.shutdown_timeout)
    if args.grpc_port is not None:
        from kvserve.server.grpc.server import add_grpc_server

        def grpc_failed(message: str) -> None:
            state.load_error = message  # exit code 1, as a model that fails to load
            server.should_exit = True

        add_grpc_server(config.app, state, args.host, args.grpc_port, grpc_failed)

    interval = None if engine_args.disable_log_stats else log_interval()

    def loader() -> None:
        try:
            load_models(state, specs, args, engine_args)
            if interval is not None:  # vLLM's periodic stats line (--disable-log-stats: off)
                engines = {name: e.stats for name, e in state.engines.items()}
                StatLogger(lambda: engines, interval).start()
            logger.info(
                "ready: http://%s:%d/v1 (%s)", args.host, args.port, ", ".join(state.engines)
            )
        except Exception as e:
            logger.exception("loading the models failed; stopping the server")
            state.load_error = f"loading the models failed: {e}"
            server.should_exit = True

    loading = threading.Thread(target=loader, name="kvserve-loader", daemon=True)
    loading.start()
    try:
        server.run()
    finally:
        if loading.is_alive():
            _exit_now(state, 1 if state.load_error else 0, "stopped while loading the models")
        if state.fatal_error:
            _exit_now(state, 1, "an engine died")
        state.shutdown()
        logger.info("engines stopped; exiting")
        # No interpreter finalization after a stop, orderly or forced: a daemon thread still in
        # C++ with the GIL released (a tokenizer or grammar worker of an aborted request) is
        # unwound by pthread_exit when it takes the GIL back, and a noexcept frame on the way
        # turns that into "terminate called without an active exception", exit -6 (a CI run,
        # --shutdown-timeout 0 with 9 requests aborted; 2 runs in 5 after a second signal).
        # The atexit handlers (span export, child processes) still run.
        _leave(1 if state.load_error or state.fatal_error else 0, run_atexit=True)


def check_ray_installed() -> None:
    """``--ray`` needs Ray Serve, an optional extra: say which, not a traceback."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"--ray needs Ray Serve, which is not installed ({e}); install the extra: "
            "pip install 'kvserve[ray]'"
        ) from e


def _leave(code: int, run_atexit: bool = False) -> NoReturn:
    """Exit with ``code`` now, logs flushed, skipping interpreter finalization (``run_atexit``:
    after the ``atexit`` handlers, which finalization would run first)."""
    if run_atexit:
        atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_now(state: ServerState, code: int, why: str) -> NoReturn:
    """Stop everything and leave without interpreter finalization.

    Used when the models are still loading at SIGTERM / Ctrl-C (a load cannot be interrupted,
    and finalizing under it aborted the process in C++, "terminate called without an active
    exception", exit code 134, leaving the kernel build's compilers running), and when an
    engine died (nothing left is worth an orderly stop: the supervisor is waiting).
    """
    from kvserve.ops import kernel_build

    killed = kernel_build.cancel_builds()  # the compilers too
    for child in multiprocessing.active_children():  # worker processes: loading, or orphaned
        child.kill()
        child.join(WORKER_KILL_WAIT_S)
    state.shutdown()  # the engines loaded so far (their workers are gone: no waiting)
    logger.info("%s (%d C++ kernel build(s) killed); exiting with code %d", why, killed, code)
    _leave(code)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.server.cli [serve flags]`` (the same as ``kvserve serve``)."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = argparse.ArgumentParser(prog="kvserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_serve(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
