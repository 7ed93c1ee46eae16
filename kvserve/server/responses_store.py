"""The in-process store of ``/v1/responses`` answers (``store: true``): what ``GET`` /
``DELETE /v1/responses/{id}`` and ``previous_response_id`` read.

Bounded three ways, each a ``kvserve serve`` flag: at most ``--responses-store-max-entries``
responses, at most ``--responses-store-max-bytes`` bytes of them together (each entry counted
as its response JSON plus its conversation JSON), and each kept at most
``--responses-store-ttl`` seconds after it was stored. Past a count or byte bound the oldest
entries go first (insertion order); an entry alone larger than the byte bound is not kept.
``--responses-store-max-entries 0`` turns the store off.

Each entry holds its whole conversation (the messages the next turn starts from), so that an
evicted entry never breaks another: a chain of k turns costs O(k^2) bytes, which the byte bound
caps. The store lives in one server process: behind several Ray replicas (``--ray``) a later
request may reach another replica, so the store is off there (``RAY_STORE_OFF``).

One owner: the ``ResponseStore`` on ``ServerState.responses``; every access runs on the event
loop (no lock), and ``clock`` is injectable so that tests of the TTL do not sleep.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import parse_bytes

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 3600.0
RAY_STORE_OFF = (
    "this server runs on Ray (--ray): its engine replicas share no memory, so a stored response "
    "could not be found again by a later request; send the whole conversation in `input` with "
    "`store: false`"
)
STORE_OFF = "the responses store is off on this server (--responses-store-max-entries 0)"


@dataclass(frozen=True)
class StoreLimits:
    """The store's bounds (flags); ``max_entries == 0`` or ``disabled_reason``: no store."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    ttl_s: float = DEFAULT_TTL_S
    disabled_reason: str | None = None  # set: why the store is off (e.g. RAY_STORE_OFF)

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError(f"--responses-store-max-entries must be >= 0, got {self.max_entries}")
        if self.max_bytes < 1:
            raise ValueError(f"--responses-store-max-bytes must be >= 1, got {self.max_bytes}")
        if not self.ttl_s > 0:  # also refuses nan
            raise ValueError(f"--responses-store-ttl must be > 0 seconds, got {self.ttl_s}")

    @property
    def off_reason(self) -> str | None:
        """Why nothing is stored, or None when the store is on."""
        if self.disabled_reason is not None:
            return self.disabled_reason
        return STORE_OFF if self.max_entries == 0 else None


@dataclass(frozen=True)
class StoredResponse:
    """One stored answer: the response object as JSON text (``GET`` returns it as is) and the
    conversation the next turn continues (chat messages as dicts, the output included)."""

    response_json: str
    conversation: tuple[dict[str, Any], ...]
    size: int  # bytes counted against --responses-store-max-bytes


@dataclass
class ResponseStore:
    limits: StoreLimits = field(default_factory=StoreLimits)
    clock: Callable[[], float] = time.monotonic
    # id -> (expiry time, entry), oldest first
    _entries: OrderedDict[str, tuple[float, StoredResponse]] = field(default_factory=OrderedDict)
    _bytes: int = 0
    evicted: int = 0  # entries dropped for a bound or the TTL (not by DELETE)

    @property
    def enabled(self) -> bool:
        return self.limits.off_reason is None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def bytes(self) -> int:
        self._expire()
        return self._bytes

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep ``entry``; False when the store is off or the entry alone is over the bytes."""
        if not self.enabled or entry.size > self.limits.max_bytes:
            return False
        self._expire()
        self._drop(response_id)
        self._entries[response_id] = (self.clock() + self.limits.ttl_s, entry)
        self._bytes += entry.size
        while len(self._entries) > self.limits.max_entries or self._bytes > self.limits.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._entries.get(response_id)
        return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is None:
            return False
        self._bytes -= found[1].size
        return True

    def _expire(self) -> None:
        """Drop the entries past their TTL (all stored with the same TTL: the oldest first)."""
        now = self.clock()
        while self._entries:
            oldest, (expiry, _) = next(iter(self._entries.items()))
            if expiry > now:
                return
            self._drop(oldest)
            self.evicted += 1


def add_responses_args(parser: argparse.ArgumentParser) -> None:
    """The store's ``kvserve serve`` flags."""
    g = parser.add_argument_group("/v1/responses store (store: true, previous_response_id, GET)")
    g.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="most stored responses; the oldest are evicted first (0: no store: GET, DELETE "
        "and previous_response_id get 400, and responses are answered with store: false)",
    )
    g.add_argument(
        "--responses-store-max-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_BYTES,
        help="most bytes of stored responses (each: its response and conversation as JSON); "
        "accepts e.g. 64MiB",
    )
    g.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds a stored response is kept",
    )


def store_limits_from_args(args: argparse.Namespace) -> StoreLimits:
    """The store's limits from the flags (defaults for a namespace without them)."""
    return StoreLimits(
        max_entries=getattr(args, "responses_store_max_entries", DEFAULT_MAX_ENTRIES),
        max_bytes=getattr(args, "responses_store_max_bytes", DEFAULT_MAX_BYTES),
        ttl_s=getattr(args, "responses_store_ttl", DEFAULT_TTL_S),
    )
