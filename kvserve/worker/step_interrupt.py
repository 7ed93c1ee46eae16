"""Background steps given up between layers when an online request arrives.

A step that computes only background rows (Batch API lines, ``Request.background``) delays
every online request that arrives while it runs: on the 2-core AVX2 machine a decode step of
the built-in model in float32 takes 40-60 ms, so an online request waited ~25 ms on average
before its prefill could start, 14% of its ~180 ms TTFT (``benchmarks/batch_ttft.py``,
docs/server.md). Such a step is therefore *interruptible*: the scheduler marks it so
(``SchedulerOutput.interruptible``), the runner hands the engine's ``StepInterrupt`` to the
model in its ``ForwardBatch``, and the layer loops (Python and the C++ decode loop) look at
the flag between layers and give the step up (``StepInterrupted``) once an online request
was queued. Nothing of the step is kept: no token is sampled, no seeded generator advances
and the scheduler applies no update, so the rows run again next step, after the online
request's prefill, with the same numbers they would have had (the K/V slots the given-up
layers wrote are written again, as a failed step's per-request retry does).

The flag is a one-element int32 tensor so the C++ loop reads it without the GIL; Python
writes it through a NumPy view of the same memory (a plain store, safe from any thread).
The async engine sets it when it queues an online request and clears it when its engine
thread takes the queued commands (both under its lock), so it is set exactly when an online
request waits for the step in flight. A lost race costs one step's wait, as before; a
given-up step costs the layers it ran (measured in docs/server.md).
"""

from __future__ import annotations

import torch

__all__ = ["StepInterrupt", "StepInterrupted"]


class StepInterrupted(Exception):  # a signal between layers, not an error
    """An interruptible step was given up between layers (see the module doc)."""


class StepInterrupt:
    """The engine's one flag: set from any thread, read between layers."""

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32)  # [1]: 0 clear, 1 set (the C++ loop reads it)
        self._view = self.flag.numpy()  # the same memory: a store, no torch op, no GIL wait
        self.count = 0  # steps given up so far (the engine's stat)

    def set(self) -> None:
        self._view[0] = 1

    def clear(self) -> None:
        self._view[0] = 0

    def is_set(self) -> bool:
        return bool(self._view[0])

    def check(self) -> None:
        """Raise ``StepInterrupted`` when set (called between layers)."""
        if self._view[0]:
            raise StepInterrupted
