"""Which engine replica gets a request: pure functions, no Ray (``router.py`` applies them).

Two policies (``--routing-policy``):

* ``least_loaded``: every replica is a candidate and Serve's request router takes the one
  with the fewest requests in flight (its queue-length cache, probed when stale).
* ``prefix_aware`` (default): the request's prompt prefix has an *owner* replica, chosen by
  rendezvous (highest-random-weight) hashing of (replica id, prefix); the owner is preferred
  unless it has more than ``imbalanced_threshold`` requests in flight above the least
  loaded replica, in which case all replicas compete as in ``least_loaded``. kvserve caches
  prompt prefixes per engine, so sending a shared system prompt or a growing conversation
  to the same replica turns its prefill into a cache hit; rendezvous hashing keeps every
  surviving prefix on its owner when a replica joins or leaves (only the leaver's prefixes
  move), without any state in the router. This is Ray Serve LLM's PrefixCacheAffinityRouter
  idea (prefix match when balanced, least loaded when not) with a hash instead of a tree.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


class RoutingPolicy(str, enum.Enum):
    PREFIX_AWARE = "prefix_aware"
    LEAST_LOADED = "least_loaded"


# The routes whose body has a prompt, and the field holding it.
_PROMPT_FIELDS = {
    "/v1/chat/completions": "messages",
    "/v1/messages": "messages",  # Anthropic's: text blocks carry "text" as chat's parts do
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
    "/tokenize": "prompt",
}


def request_model_and_prompt(path: str, body: bytes) -> tuple[str | None, str | None]:
    """The ``model`` and the prompt text of an OpenAI request body, as far as they can be
    read (None for what cannot: the replica's own validation answers a bad body with 400)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    model = data.get("model") if isinstance(data.get("model"), str) else None
    field = _PROMPT_FIELDS.get(path)
    if path == "/tokenize" and "messages" in data:
        field = "messages"
    value = data.get(field) if field else None
    text = _messages_text(value) if field == "messages" else _prompt_text(value)
    return model, text


def _messages_text(messages: Any) -> str | None:
    """Chat messages as one string, in order (role and text parts; other parts skipped)."""
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and "text" in p
            )
        parts.append(f"{m.get('role', '')}:{content if isinstance(content, str) else ''}")
    return "\n".join(parts) or None


def _prompt_text(prompt: Any) -> str | None:
    """A completions prompt (text, token ids, or a batch of either: its first) as text."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt keys it
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt)) or None
    return None


def routing_key(model: str | None, prompt: str | None, prefix_chars: int) -> str | None:
    """The prefix key of a request: its model and the first ``prefix_chars`` of its prompt."""
    if prompt is None:
        return None
    return f"{model or ''}\x00{prompt[:prefix_chars]}"


def prefix_owner(key: str, replica_ids: Sequence[str]) -> str:
    """The replica owning ``key``: the highest hash of (replica, key) (rendezvous hashing)."""
    if not replica_ids:
        raise ValueError("prefix_owner needs at least one replica")
    return max(replica_ids, key=lambda r: hashlib.sha256(f"{r}\x00{key}".encode()).digest())


def rank_replicas(
    replica_ids: Sequence[str],
    in_flight: Mapping[str, int | None],
    key: str | None,
    policy: RoutingPolicy,
    imbalanced_threshold: int,
) -> list[list[str]]:
    """Ranks of candidate replicas, most preferred first (Serve's ``choose_replicas`` shape):
    the router takes the least loaded replica of the first rank that has room.
    ``in_flight`` is each replica's known requests in flight (None or absent: unknown, 0)."""
    ids = list(replica_ids)
    if not ids:
        return []
    if policy is RoutingPolicy.LEAST_LOADED or key is None or len(ids) == 1:
        return [ids]
    owner = prefix_owner(key, ids)
    load = {r: in_flight.get(r) or 0 for r in ids}
    if load[owner] - min(load.values()) > imbalanced_threshold:
        return [ids]
    return [[owner], [r for r in ids if r != owner]]


def pinned(replica_ids: Sequence[str], replica_id: str | None) -> list[list[str]] | None:
    """The rank for a request pinned to one replica (a per-replica /metrics scrape), or None
    when it is not pinned or that replica is gone (the caller then routes it normally and
    sees from the answer which replica served it: a pin never waits for a dead replica)."""
    if replica_id is not None and replica_id in replica_ids:
        return [[replica_id]]
    return None
