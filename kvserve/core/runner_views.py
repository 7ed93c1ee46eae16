"""The scheduler's record of what the runner holds of each request, and the step message
entries built from it (``NewRequestData`` once, then ``CachedRequestData``: the difference).

The runner keeps its own copy of every request it has run (``worker/input_batch.py``) from
the first step that schedules it until it finishes, across preemption (vLLM's rule: the
seeded generator and the output history carry on). The scheduler is the source of truth for
tokens: a stop token, a stop string or a grammar's refusal may cut a run the runner sampled,
so the runner is told the tokens actually appended rather than trusting its own samples
(a few ints per request per step).
"""

from __future__ import annotations

from kvserve.core.request import Request
from kvserve.core.scheduler_output import NewRequestData, SchedulerOutput


class _View:
    __slots__ = ("block_ids", "num_tokens", "resumed")

    def __init__(self, num_tokens: int, block_ids: list[int]) -> None:
        self.num_tokens = num_tokens  # tokens of the request the runner holds
        self.block_ids = block_ids  # the runner's block table (a copy)
        self.resumed = False  # preempted since: the next message replaces its whole table


class RunnerViews:
    """request id -> what the runner was last told (owned by the scheduler)."""

    def __init__(self) -> None:
        self._views: dict[str, _View] = {}

    def __len__(self) -> int:
        return len(self._views)

    def describe(self, out: SchedulerOutput, req: Request, blocks: list[int]) -> None:
        """Add a scheduled request to the step message: everything the first time, then only
        its new tokens, the changed tail of its table and its computed count."""
        rid = req.request_id
        view = self._views.get(rid)
        if view is None:
            out.scheduled_new_reqs.append(NewRequestData.from_request(req, blocks))
            self._views[rid] = _View(req.num_tokens, list(blocks))
            return
        old = view.block_ids
        if view.resumed:
            keep = 0
        elif blocks[: len(old)] == old:
            keep = len(old)  # only appended to: the common case, compared at C speed
        else:  # blocks of rejected proposals were released, and maybe new ones added
            same = (i for i, (a, b) in enumerate(zip(old, blocks, strict=False)) if a != b)
            keep = next(same, min(len(old), len(blocks)))
        if req.num_tokens < view.num_tokens:  # a cut run always finishes its request
            raise RuntimeError(f"request {rid} lost tokens while running")  # a bug
        out.scheduled_cached_reqs.add(
            rid, view.resumed, req.all_token_ids[view.num_tokens :], blocks[keep:],
            len(blocks), req.num_computed_tokens,
        )  # fmt: skip
        view.num_tokens, view.block_ids, view.resumed = req.num_tokens, list(blocks), False

    def preempted(self, req_id: str) -> None:
        """Its blocks go (freed, or swapped out to come back under other ids)."""
        if (view := self._views.get(req_id)) is not None:
            view.resumed = True

    def forget(self, req_id: str) -> None:
        """It finished; the runner drops its state (``finished_req_ids``)."""
        self._views.pop(req_id, None)
