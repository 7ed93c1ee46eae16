"""Queues of requests waiting for the running batch, one class per scheduling policy.

The scheduler keeps its waiting and swapped requests in a ``RequestQueue`` and asks the policy
which running request to preempt (``pick_victim``), so FCFS and priority scheduling differ only
here (the shape of vLLM's ``request_queue.py``):

- ``FCFSQueue``: arrival order; a preempted request goes back to the front, and the newest
  running request is the one preempted.
- ``PriorityQueue``: ordered by ``(priority, arrival_time, request_id)``, lower first (vLLM's
  convention); a preempted request re-enters at its own key, so it keeps its place in line;
  the victim is the running request with the largest key (lowest priority, newest).
"""

from __future__ import annotations

import abc
import heapq
from collections import deque
from collections.abc import Iterator

from kvserve.config import SchedulingPolicy
from kvserve.core.request import Request


def priority_key(req: Request) -> tuple[int, float, str]:
    """Sort key of the priority policy: lower priority value first, then earlier arrival."""
    return (req.priority, req.metrics.arrival_time, req.request_id)


class RequestQueue(abc.ABC):
    """Requests in the order the scheduler should admit them."""

    @abc.abstractmethod
    def add(self, req: Request) -> None:
        """A new request joins the queue."""

    @abc.abstractmethod
    def prepend(self, req: Request) -> None:
        """A preempted request comes back: it keeps (at least) its old place in line."""

    @abc.abstractmethod
    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""

    @abc.abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abc.abstractmethod
    def remove(self, req: Request) -> None:
        """Remove a request from anywhere in the queue (abort, finish)."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests, in no particular order."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self)

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


class PriorityQueue(RequestQueue):
    """A binary heap on ``priority_key``: O(log n) add/pop, O(n) remove (aborts only)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (priority_key(req), req))

    def prepend(self, req: Request) -> None:
        self.add(req)  # its key already puts it ahead of everything that arrived later

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        for i, (_, r) in enumerate(self._heap):
            if r is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {req.request_id} is not in the queue")

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in self._heap)

    def __len__(self) -> int:
        return len(self._heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy is SchedulingPolicy.PRIORITY else FCFSQueue()


def pick_victim(running: list[Request], policy: SchedulingPolicy) -> Request:
    """The running request to preempt when blocks run out: the newest (FCFS) or the one with
    the largest priority key (PRIORITY). ``running`` is in admission order, non-empty."""
    if policy is SchedulingPolicy.PRIORITY:
        return max(running, key=priority_key)
    return running[-1]
