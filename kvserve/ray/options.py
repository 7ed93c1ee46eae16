"""The Ray Serve options of ``kvserve serve --ray`` and of a ``serve run`` config's ``args``.

One namespace of option names serves the CLI, the YAML config and Python: a config's ``args``
are ``kvserve serve``'s own option names (``max_num_seqs: 64``, ``num_replicas: 2``), checked
by the same parser, so the three can never drift apart. Nothing here imports Ray.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.ray.routing import RoutingPolicy

# Serve's default is 5 requests in flight per replica, far below what one engine batches;
# kvserve's own queue (--max-queued-requests) answers 429, so Serve's cap only has to be
# above max_num_seqs + the queue for the engine to see the load.
DEFAULT_MAX_ONGOING_REQUESTS = 512
# A replica that does not answer check_health within this is restarted (an engine step of a
# large prefill can hold the replica's GIL for seconds; the check itself reads one flag).
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """The ``Ray Serve`` flag group of ``kvserve serve``."""
    g = parser.add_argument_group("Ray Serve (--ray; docs/scaling.md)")
    g.add_argument(
        "--ray", action="store_true",
        help="serve through Ray Serve: engine replicas behind one OpenAI ingress "
             "(pip install 'kvserve[ray]')",
    )  # fmt: skip
    g.add_argument(
        "--ray-address", default=None,
        help="the Ray cluster to join (e.g. 'auto' or ray://head:10001; default: the local "
             "cluster `ray start` made, else a new one in this process)",
    )  # fmt: skip
    g.add_argument(
        "--num-replicas", type=int, default=None,
        help="engine replicas per model, each its own engine and --num-threads threads "
             "(default 1; not with the autoscaling flags)",
    )  # fmt: skip
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling: fewest replicas per model (default 1)")  # fmt: skip
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas per model (turns autoscaling on)")  # fmt: skip
    g.add_argument(
        "--target-ongoing-requests", type=float, default=None,
        help="autoscaling: requests in flight per replica Serve scales towards "
             "(default: Serve's)",
    )  # fmt: skip
    g.add_argument(
        "--max-ongoing-requests", type=int, default=DEFAULT_MAX_ONGOING_REQUESTS,
        help="Serve's cap of requests in flight on one replica; more wait in the router. "
             "Keep it above --max-num-seqs + --max-queued-requests so kvserve's 429 decides",
    )  # fmt: skip
    g.add_argument(
        "--routing-policy", choices=[p.value for p in RoutingPolicy],
        default=RoutingPolicy.PREFIX_AWARE.value,
        help="prefix_aware: a prompt prefix's owner replica (rendezvous hash) unless it has "
             "--imbalanced-threshold more requests in flight than the least loaded; "
             "least_loaded: the replica with the fewest requests in flight",
    )  # fmt: skip
    g.add_argument(
        "--prefix-routing-chars", type=int, default=256,
        help="prefix_aware: characters of the prompt that key the owner replica",
    )  # fmt: skip
    g.add_argument(
        "--stream-batching-interval-ms", type=float, default=0.0,
        help="a replica sends a stream's chunks to the ingress at most this often after the "
             "first (Ray Serve LLM's stream_batching_interval_ms, 50 there): fewer Ray "
             "objects per token, burstier chunks; 0: each step's chunks at once",
    )  # fmt: skip
    g.add_argument(
        "--imbalanced-threshold", type=int, default=8,
        help="prefix_aware: in-flight difference above which the least loaded replica wins",
    )  # fmt: skip


@dataclass(frozen=True)
class RayServeOptions:
    """How the engine deployments scale and route (validated; ``from_args`` builds it)."""

    num_replicas: int | None = None  # fixed replica count (None: 1, or autoscaling)
    min_replicas: int | None = None
    max_replicas: int | None = None  # set: autoscaling
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    routing_policy: RoutingPolicy = RoutingPolicy.PREFIX_AWARE
    prefix_routing_chars: int = 256
    imbalanced_threshold: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "routing_policy", RoutingPolicy(self.routing_policy))
        autoscaling = (self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        if self.num_replicas is not None:
            if self.num_replicas < 1:
                raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
            if any(v is not None for v in autoscaling):
                raise ValueError(
                    "give either --num-replicas (a fixed count) or the autoscaling flags "
                    "(--min-replicas/--max-replicas/--target-ongoing-requests), not both"
                )
        if any(v is not None for v in autoscaling) and self.max_replicas is None:
            raise ValueError("autoscaling needs --max-replicas")
        lo = 1 if self.min_replicas is None else self.min_replicas
        if self.max_replicas is not None and not 0 <= lo <= self.max_replicas:
            raise ValueError(
                f"need 0 <= --min-replicas <= --max-replicas, got {lo} and {self.max_replicas}"
            )
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError("--max-replicas must be >= 1")
        t = self.target_ongoing_requests
        if t is not None and not t > 0:
            raise ValueError(f"--target-ongoing-requests must be > 0, got {t}")
        for name in ("max_ongoing_requests", "prefix_routing_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.imbalanced_threshold < 0:
            raise ValueError("--imbalanced-threshold must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RayServeOptions:
        return cls(
            num_replicas=args.num_replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            max_ongoing_requests=args.max_ongoing_requests,
            routing_policy=RoutingPolicy(args.routing_policy),
            prefix_routing_chars=args.prefix_routing_chars,
            imbalanced_threshold=args.imbalanced_threshold,
        )

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Serve's ``autoscaling_config`` (None: a fixed ``num_replicas``)."""
        if self.max_replicas is None:
            return None
        config: dict[str, Any] = {
            "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
            "max_replicas": self.max_replicas,
        }
        if self.target_ongoing_requests is not None:
            config["target_ongoing_requests"] = self.target_ongoing_requests
        return config

    def engine_deployment_options(
        self, num_threads: int, tensor_parallel_size: int = 1, device: str = "cpu"
    ) -> dict:
        """``Deployment.options(...)`` of one model's engine deployment, less the router.

        A replica reserves one Ray CPU per torch thread and rank (``num_cpus``), so Ray
        places replicas where their threads fit, and its worker starts with OMP_NUM_THREADS
        set, so OpenMP never spins up a thread per core of a shared node. On CUDA it also
        reserves one GPU per rank (``num_gpus``): Ray shows an actor only the GPUs it
        reserved (``CUDA_VISIBLE_DEVICES``), so without it the replica would see none.
        """
        autoscaling = self.autoscaling_config()
        scale: dict[str, Any] = (
            {"autoscaling_config": autoscaling}
            if autoscaling is not None
            else {"num_replicas": self.num_replicas or 1}
        )
        return {
            **scale,
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
            "ray_actor_options": {
                "num_cpus": num_threads * tensor_parallel_size,
                **({"num_gpus": tensor_parallel_size} if device.startswith("cuda") else {}),
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(num_threads)}},
            },
        }


def serve_namespace(overrides: Mapping[str, Any]) -> argparse.Namespace:
    """``kvserve serve``'s parsed defaults with ``overrides`` (option names, as a config's
    ``args``) applied as the flags would be: a string goes through the flag's type (``"1MiB"``
    for a byte size), a choice is checked, a single value of a list option becomes a list.
    An unknown name is a ValueError naming the closest option."""
    from kvserve.server.cli import add_serve_parser  # the server stack, not Ray

    parser = argparse.ArgumentParser(prog="kvserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = add_serve_parser(sub)
    args = parser.parse_args(["serve"])
    actions = {a.dest: a for a in serve._actions if a.dest != argparse.SUPPRESS}
    for key, value in overrides.items():
        action = actions.get(key)
        if action is None or key == "help":
            close = difflib.get_close_matches(key, list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown kvserve serve option {key!r}{hint}")
        setattr(args, key, _as_flag_value(action, value))
    return args


def _as_flag_value(action: argparse.Action, value: Any) -> Any:
    if action.nargs in ("+", "*") and isinstance(value, (str, int, float)):
        value = [value]
    if isinstance(value, list):
        return [_as_flag_value(_one(action), v) for v in value]
    if isinstance(value, str) and callable(action.type):
        value = action.type(value)
    if action.choices is not None and value is not None and value not in action.choices:
        raise ValueError(f"{action.dest} must be one of {list(action.choices)}, got {value!r}")
    return value


def _one(action: argparse.Action) -> argparse.Action:
    """``action`` for one element of its list."""
    return argparse.Action(action.option_strings, action.dest, type=action.type,
                           choices=action.choices)  # fmt: skip


def replica_threads(args: argparse.Namespace) -> int:
    """torch threads of one replica: ``--num-threads``, else 1 (a replica is a unit of
    scale-out: more throughput comes from more replicas, each on its own cores)."""
    threads = args.num_threads or 1
    if threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {threads}")
    return int(threads)
