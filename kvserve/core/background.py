"""Background work's place in a step: the rules that keep Batch API lines out of online
requests' way (``Request.background``; the scheduler applies them).

A step's cost grows with every row in it, so a batch job's decode rows sharing the step that
computes an online request's prompt delay that request's first token. The scheduler therefore
schedules background rows last, and not at all in a step that computes an online prompt;
they keep their blocks and resume the next step. No deadlock follows: a step holds background
rows back only when online prompt tokens are computed in it, and a prompt is finite.

A step of background rows only is *interruptible*: an online request that arrives while it
runs has it given up between layers (``worker/step_interrupt.py``), so it waits for one
layer instead of a whole step; so is a step whose online rows were all aborted since it began.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.core.request import Request
from kvserve.core.scheduler_output import SchedulerOutput

__all__ = [
    "computes_prompt",
    "holds_background_back",
    "may_give_up",
    "online_ids",
    "online_prefill_scheduled",
]


def computes_prompt(req: Request) -> bool:
    """Whether a step that schedules ``req`` computes prompt tokens (or recomputes tokens lost
    to preemption) rather than decoding one new token: before the step's update, a decode row
    has every token but its last computed and has sampled before."""
    return req.num_computed_tokens + 1 < req.num_tokens or req.num_output_tokens == 0


def online_prefill_scheduled(out: SchedulerOutput) -> bool:
    """Whether the step so far computes an online request's prompt."""
    return any(not r.background and computes_prompt(r) for r in out.scheduled)


def holds_background_back(out: SchedulerOutput, waiting: Iterable[Request]) -> bool:
    """Whether a waiting background request stays out of this step: an online request's
    prompt is computed in it or an online request waits (it goes first; background requests
    hold no blocks while waiting, so holding them back blocks nothing)."""
    return online_prefill_scheduled(out) or any(not r.background for r in waiting)


def may_give_up(out: SchedulerOutput, waiting: Iterable[Request]) -> bool:
    """Whether the step may be given up for an online request that arrives while it runs
    (``SchedulerOutput.interruptible``, worker/step_interrupt.py): it schedules rows and no
    online request already waits (one that waits was not admitted this step, so giving the
    step up would not start it sooner). Its online rows (``online_ids``) must also all have
    been aborted by then; a background-only step has none."""
    return bool(out.scheduled) and not any(not r.background for r in waiting)


def online_ids(out: SchedulerOutput) -> frozenset[str]:
    """The step's online rows (``SchedulerOutput.online_ids``): the step is given up only once
    each of them was aborted while it ran."""
    return frozenset(r.request_id for r in out.scheduled if not r.background)
