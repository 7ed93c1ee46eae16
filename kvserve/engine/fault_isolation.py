"""Keeping a fault inside a step with the request that caused it.

Requests are validated at the door, so a step should never fail on a request's data; when one
does anyway (a bug, a value no check foresaw), failing the whole batch would let one client
kill every other client's stream, and a few such steps would take the engine down. Instead:

1. The swap copies run first and alone: if they fail, K/V is lost and the fault is the
   engine's (it propagates).
2. The forward pass of the whole batch runs; if it raises, each request runs again alone
   (``execute_isolating``). Re-running is safe: a failed step advanced no
   ``num_computed_tokens``, and each request's K/V slots are simply written again.
3. The sampler narrows its own failures to rows (``ModelRunner._sample``).
4. Requests that fail alone are failed by the engine with finish reason ``error``. When every
   request of the step failed, a one-token probe (``engine_works``) tells a broken engine (out
   of memory, a broken kernel) from a batch of bad requests: only a failed probe is the
   engine's fault.
"""

from __future__ import annotations

import logging

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request
from kvserve.core.scheduler import SchedulerOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("kvserve.engine")

_PROBE_ID = "__kvserve_engine_probe__"


class EngineFaultError(RuntimeError):
    """A step failed for reasons that are not about one request (the probe failed too)."""


def execute_isolating(runner: ModelRunner, sched: SchedulerOutput) -> ModelRunnerOutput:
    """Run the step; if the batch's forward pass raises, run each request alone.

    The returned output's ``failed`` maps each request that failed on its own to the reason.
    """
    runner.swap(sched)
    try:
        return runner.execute(sched, swap=False)
    except Exception:
        logger.exception(
            "a step of %d requests failed; retrying each request alone", len(sched.scheduled)
        )
    out = ModelRunnerOutput({})
    for req in sched.scheduled:
        rid = req.request_id
        alone = SchedulerOutput(
            [req],
            {rid: sched.num_scheduled_tokens[rid]},
            {rid: sched.block_tables[rid]},
            # the grammar's rows are looked up by request id: a retried row stays constrained
            grammar_bitmask=sched.grammar_bitmask,
            structured_output_rows=sched.structured_output_rows,
            scheduled_spec_decode_tokens={
                k: v for k, v in sched.scheduled_spec_decode_tokens.items() if k == rid
            },
            propose=sched.propose,
        )
        try:
            out.update(runner.execute(alone, swap=False))
        except Exception as exc:
            out.failed[rid] = f"the forward pass failed: {exc!r}"
    return out


def engine_works(runner: ModelRunner, kv: KVCacheManager) -> bool:
    """A one-token greedy step in a free block: False if the engine itself is broken (or no
    block is free to try). Holds no block afterwards."""
    if kv.allocate_slots(_PROBE_ID, 1) is None:
        return False
    try:
        probe = Request(_PROBE_ID, [0], SamplingParams(temperature=0.0, max_tokens=1), 1, [])
        sched = SchedulerOutput([probe], {_PROBE_ID: 1}, {_PROBE_ID: kv.block_ids(_PROBE_ID)})
        out = runner.execute(sched, swap=False)
        return _PROBE_ID in out.sampled
    except Exception:
        logger.exception("the engine probe failed: the engine itself is broken")
        return False
    finally:
        kv.free(_PROBE_ID)
