"""Keeping a fault inside a step with the request that caused it.

Requests are validated at the door, so a step should never fail on a request's data; when one
does anyway (a bug, a value no check foresaw), failing the whole batch would let one client
kill every other client's stream, and a few such steps would take the engine down. Instead:

1. The swap copies run first and alone (``ModelRunner.execute``): if they fail, K/V is lost
   and the fault is the engine's (it propagates).
2. The forward pass of the whole batch runs; if it raises, the runner runs each request again
   alone. Re-running is safe: a failed step advanced no ``num_computed_tokens``, each
   request's K/V slots are simply written again, seeded generators are rewound, and the
   runner commits its per-request results (pooling sums, prompt logprob counts) only for a
   run that succeeded. The retry lives in the runner, beside the batch it retries, so it
   works the same when the runner is in a worker process. Not under tensor parallelism:
   the ranks' collectives must pair up, so a step that raises on any rank is an engine
   fault (``RankFailedError``, the workers are stopped) instead of a per-request retry.
3. The sampler narrows its own failures to rows (``worker/row_sampling.py``).
4. Requests that fail alone are failed by the engine with finish reason ``error``. When every
   request of the step failed, a one-token probe (``engine_works``) tells a broken engine (out
   of memory, a broken kernel) from a batch of bad requests: only a failed probe is the
   engine's fault.
"""

from __future__ import annotations

import logging

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler_output import NewRequestData, SchedulerOutput
from kvserve.executor.abstract import Executor, WorkerDiedError
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine")

_PROBE_ID = "__kvserve_engine_probe__"


class EngineFaultError(RuntimeError):
    """A step failed for reasons that are not about one request (the probe failed too)."""


def engine_works(executor: Executor, kv: KVCacheManager) -> bool:
    """A one-token greedy step in a free block: False if the engine itself is broken (or no
    block is free to try). Holds no block afterwards, and the runner keeps no state of it."""
    if kv.allocate_slots(_PROBE_ID, 1) is None:
        return False
    try:
        probe = NewRequestData(
            req_id=_PROBE_ID, prompt_token_ids=[0], output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=1), eos_token_ids=[],
            max_tokens=1, pooling=None, block_ids=kv.block_ids(_PROBE_ID),
            num_computed_tokens=0, num_prompt_logprobs=None,
        )  # fmt: skip
        sched = SchedulerOutput([], {_PROBE_ID: 1}, {}, scheduled_new_reqs=[probe])
        out = executor.execute_model(sched)
        return _PROBE_ID in out.sampled
    except WorkerDiedError:
        raise
    except Exception:
        logger.exception("the engine probe failed: the engine itself is broken")
        return False
    finally:
        kv.free(_PROBE_ID)
        try:  # the runner forgets the probe (an empty step)
            executor.execute_model(SchedulerOutput([], {}, {}, finished_req_ids={_PROBE_ID}))
        except WorkerDiedError:
            raise
        except Exception:
            logger.exception("the runner could not drop the engine probe")
