"""The kvserve Ray Serve application: one engine deployment per model behind one ingress.

``build_openai_app(args)`` is the app builder a Serve config names
(``import_path: kvserve.ray.app:build_openai_app``, as Ray Serve LLM's ``build_openai_app``);
its ``args`` are ``kvserve serve`` option names. ``run_ray_serve`` is ``kvserve serve --ray``.

What runs where (docs/scaling.md): every replica of ``kvserve-engine`` is a Ray actor holding
one engine (its own model copy, KV cache and ``--num-threads`` torch threads, reserving that
many Ray CPUs); ``kvserve-ingress`` (no CPU reserved: it only forwards) and Serve's HTTP
proxy run on the head node by default, the replicas wherever Ray finds their CPUs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from kvserve.engine.arg_utils import EngineArgs
from kvserve.ray.ingress import OpenAIIngress
from kvserve.ray.options import RayServeOptions, replica_threads, serve_namespace
from kvserve.ray.replica import KVServeReplica
from kvserve.ray.router import KVServeRouter
from kvserve.server.cli import API_KEY_ENV, _model_specs

logger = logging.getLogger("kvserve.ray")

APP_NAME = "kvserve"
ENGINE_DEPLOYMENT = "kvserve-engine"
INGRESS_DEPLOYMENT = "kvserve-ingress"
# The ingress only forwards (no CPU reserved); its in-flight cap is Serve's backpressure in
# front of every engine replica together, so it is far above any replica's.
INGRESS_MAX_ONGOING_REQUESTS = 100_000


def build_openai_app(args: Mapping[str, Any] | None = None) -> Application:
    """Serve's app builder: ``args`` are ``kvserve serve`` options by name (``models``,
    ``num_replicas``, ``max_num_seqs``...); unknown names are a ValueError."""
    return build_from_namespace(serve_namespace(dict(args or {})))


def build_from_namespace(args: argparse.Namespace) -> Application:
    """The application for parsed ``kvserve serve`` flags (all checked here, before Ray
    starts anything: a bad option fails on the caller, not in a replica restart loop)."""
    options = RayServeOptions.from_args(args)
    specs = _model_specs(args)
    engine_args = replace(EngineArgs.from_cli_args(args), model=None, served_model_name=None)
    for model, _ in specs:
        replace(engine_args, model=model)  # per-model checks (e.g. --tokenizer)
    threads = replica_threads(args)
    serve_args = {k: v for k, v in vars(args).items() if k != "vllm_options"}
    serve_args["api_key"] = args.api_key or os.environ.get(API_KEY_ENV) or None
    router = RequestRouterConfig(
        request_router_class=KVServeRouter,
        request_router_kwargs={
            "routing_policy": options.routing_policy.value,
            "imbalanced_threshold": options.imbalanced_threshold,
        },
    )
    deployment_options = options.engine_deployment_options(
        threads, getattr(args, "tensor_parallel_size", 1), str(getattr(args, "device", "cpu"))
    )
    engines = []
    for i, (model, name) in enumerate(specs):
        deployment = serve.deployment(KVServeReplica).options(
            name=ENGINE_DEPLOYMENT if len(specs) == 1 else f"{ENGINE_DEPLOYMENT}-{i}",
            request_router_config=router,
            **deployment_options,
        )
        engines.append(deployment.bind(serve_args, model, name))
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        engines,
        max_request_body_bytes=args.max_request_body_bytes,
        prefix_routing_chars=options.prefix_routing_chars,
        metrics_prefix=args.metrics_prefix,
    )


def ray_http_options(args: argparse.Namespace) -> dict[str, Any]:
    """Serve's ``http_options`` from ``kvserve serve`` flags. Ray Serve's proxy is its own
    uvicorn server, so of the HTTP layer's limits (``server/http_guard.py``) only the
    keep-alive timeout carries over (``keep_alive_timeout_s``); header size, count and read
    timeouts and the connection cap are Ray's (docs/scaling.md says what to put in front)."""
    keep_alive = max(1, math.ceil(args.keep_alive_timeout))  # Serve takes whole seconds
    return {"host": args.host, "port": args.port, "keep_alive_timeout_s": keep_alive}


def run_ray_serve(args: argparse.Namespace) -> int:
    """``kvserve serve --ray``: deploy on the Ray cluster (or a local one) and serve until
    interrupted."""
    import ray

    app = build_from_namespace(args)
    ray.init(address=args.ray_address)
    serve.start(http_options=ray_http_options(args))
    logger.info("deploying %s on Ray; the OpenAI API will be http://%s:%d/v1",
                APP_NAME, args.host, args.port)  # fmt: skip
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
