"""Embeddings: an embedding request's final hidden states (after the model's last norm,
the rows the LM head would read) pooled into one vector.

``pool`` is the whole computation for a prompt computed in one piece. A prompt longer than
``max_num_batched_tokens`` is prefilled over several steps, so ``Pooler`` (the runner's) keeps
what mean pooling needs between them: per request, the float32 sum of its hidden states so far
and the number of positions it covers. The state lives in the runner, not in ``Request``: it
is a tensor the runner makes and reads, and the scheduler, which owns ``Request``, never needs
it. A chunk starting at position 0 starts a new sum, so a request preempted with recompute
(which computes its prompt again from 0: mean pooling skips the prefix cache) is pooled
afresh; a swapped request keeps its sum and resumes where it stopped. Updates are staged and
committed only once the step can no longer fail, so a step retried request by request
(``fault_isolation``) adds nothing twice. Last pooling needs no state: the step that computes
the last prompt position has its row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from kvserve.config import PoolingType
from kvserve.core.scheduler import SchedulerOutput
from kvserve.worker.input_batch import StepRows

# request id -> (sum of its hidden states so far [H] float32, positions covered), or None:
# the request's sum is done with
SumUpdates = dict[str, tuple[torch.Tensor, int] | None]
# the model's compute_logits: [N, H] -> [N, V] (None on tensor-parallel ranks > 0)
LogitsFn = Callable[[torch.Tensor], torch.Tensor | None]


def pool(hidden: torch.Tensor, pooling: PoolingType, normalize: bool = True) -> torch.Tensor:
    """One prompt's embedding ``[H]`` (float32) from its final hidden states ``[n, H]``, one
    row per prompt position in order: the last row or the mean of all rows, then L2-normalised
    unless ``normalize`` is False."""
    x = hidden.float()
    vec = x[-1] if pooling is PoolingType.LAST else x.mean(dim=0)
    return finish(vec, normalize)


def finish(vec: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The pooled vector as returned: float32, unit L2 norm when ``normalize``."""
    vec = vec.float()
    # F.normalize divides by max(norm, 1e-12): an all-zero vector stays zero, never NaN.
    return F.normalize(vec, p=2.0, dim=-1) if normalize else vec


def token_logits(
    last: torch.Tensor, token_ids: tuple[int, ...], logits_fn: LogitsFn
) -> list[float]:
    """The LM head's float32 logits of ``token_ids`` for one final hidden state ``[1, H]``
    (empty on tensor-parallel ranks > 0, whose output is dropped)."""
    logits = logits_fn(last)  # [1, V]
    if logits is None:
        return []
    return logits[0, list(token_ids)].float().tolist()


class Pooler:
    """Pools the embedding requests that a step finishes; see the module docstring."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    def __len__(self) -> int:
        return len(self._sums)  # requests with a partial sum (tests: nothing leaks)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the sums of finished or aborted requests."""
        for rid in req_ids:
            self._sums.pop(rid, None)

    def step(
        self,
        sched: StepRows | SchedulerOutput,
        hidden: torch.Tensor,
        logits_fn: LogitsFn | None = None,
    ) -> tuple[dict[str, list[float]], SumUpdates]:
        """This step's embeddings (request id -> vector) and the mean-pooling sums to
        ``commit`` once the step has succeeded. ``hidden``: ``[T, H]``, the step's flat
        batch (each scheduled request's rows in order). ``sched``: the runner's rows (or the
        scheduler's view: the same fields). ``logits_fn``: the model's ``compute_logits``,
        for requests whose spec has ``token_ids`` (every rank calls it for the same rows)."""
        pooled: dict[str, list[float]] = {}
        updates: SumUpdates = {}
        offset = 0
        for req in sched.scheduled:
            rid = req.request_id
            n = sched.num_scheduled_tokens[rid]
            spec = req.pooling
            if spec is not None:
                rows = hidden[offset : offset + n]  # [n, H]
                done = sched.pools(req)
                if spec.token_ids:
                    if done:
                        assert logits_fn is not None, "token-logit pooling needs the LM head"
                        pooled[rid] = token_logits(rows[-1:], spec.token_ids, logits_fn)
                elif spec.type is PoolingType.LAST:
                    if done:
                        pooled[rid] = finish(rows[-1], spec.normalize).tolist()
                else:
                    start = req.num_computed_tokens
                    total = self._sum_before(rid, start) + rows.float().sum(dim=0)  # [H]
                    if done:
                        mean = total / req.num_prompt_tokens
                        pooled[rid] = finish(mean, spec.normalize).tolist()
                        updates[rid] = None
                    else:
                        updates[rid] = (total, start + n)
            offset += n
        return pooled, updates

    def commit(self, updates: SumUpdates) -> None:
        for rid, state in updates.items():
            if state is None:
                self._sums.pop(rid, None)
            else:
                self._sums[rid] = state

    def _sum_before(self, rid: str, start: int) -> torch.Tensor | float:
        """The sum of the request's positions before ``start`` (0 when it starts afresh)."""
        if start == 0:
            return 0.0
        total, covered = self._sums.get(rid, (None, 0))
        if total is None or covered != start:
            # A bug, never the request's data: failing the request beats a wrong embedding.
            raise RuntimeError(
                f"mean pooling of {rid}: its prefill resumes at position {start} but the "
                f"running sum covers {covered} positions"
            )
        return total
