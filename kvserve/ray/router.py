"""``KVServeRouter``: Serve's request router for the engine deployments.

It runs inside the caller of the deployment handle (the ingress replica), once per engine
deployment, and ranks candidate replicas with ``routing.rank_replicas``; Serve's base class
then takes the least loaded replica of the first rank whose in-flight count is below
``max_ongoing_requests`` (from its queue-length cache, probing replicas when it is stale),
falling back to the next rank, and retries with backoff while every replica is full.

The ingress passes the routing inputs as keyword arguments of the handle call:
``routing_key`` (the prompt prefix key) and ``replica_id`` (a pin, for per-replica scrapes).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.ray.routing import RoutingPolicy, pinned, rank_replicas


class KVServeRouter(RequestRouter):
    """Prefix-aware or least-loaded routing over one deployment's replicas (``routing.py``)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``request_router_kwargs`` of the deployment: routing_policy, imbalanced_threshold."""
        self.policy = RoutingPolicy(kwargs.get("routing_policy", RoutingPolicy.PREFIX_AWARE))
        self.imbalanced_threshold = int(kwargs.get("imbalanced_threshold", 8))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ids = list(by_id)
        kwargs = pending_request.kwargs if pending_request is not None else {}
        ranks = pinned(ids, kwargs.get("replica_id"))
        if ranks is None:
            cache = self.replica_queue_len_cache
            in_flight = {rid: cache.get(r.replica_id) for rid, r in by_id.items()}
            ranks = rank_replicas(
                ids, in_flight, kwargs.get("routing_key"), self.policy, self.imbalanced_threshold
            )
        return [[by_id[rid] for rid in rank] for rank in ranks]
