"""Steps given up between layers when an online request arrives.

A step that computes only background rows (Batch API lines, ``Request.background``) delays
every online request that arrives while it runs: on the 2-core AVX2 machine a decode step of
the built-in model in float32 takes 40-60 ms, so an online request waited ~25 ms on average
before its prefill could start, 14% of its ~180 ms TTFT (``benchmarks/batch_ttft.py``,
docs/server.md). Such a step is therefore given up: the scheduler marks a step that may be
(``SchedulerOutput.interruptible``: no online request already waits) with its online rows
(``SchedulerOutput.online_ids``), the runner hands the engine's ``StepInterrupt`` to the
model in its ``ForwardBatch`` for the step's length (``begin`` / ``end``), and the layer loops
(Python and the C++ decode loop) look at the flag between layers and give the step up
(``StepInterrupted``) once it is set. Nothing of the step is kept: no token is sampled, no
seeded generator advances and the scheduler applies no update, so the rows run again next
step, after the online request's prefill, with the same numbers they would have had (the K/V
slots the given-up layers wrote are written again, as a failed step's per-request retry does).

The flag is set exactly when an online request was queued since the engine thread last took
its commands (``set``; ``clear`` at the take) *and* the step in flight has no online row left
that anyone still wants: every online row in it was aborted since the take (``aborted``). So
a background-only step gives way at once, and so does a step whose online rows belong to
requests their clients have already closed: a chat client that reads the first token and
closes the stream (an agent's router, a TTFT probe) leaves that request decoding until the
abort is applied at the next take, and the request sent right after it used to wait for that
whole step (docs/server.md: 1.19x TTFT back to back on the AVX2 kind, 0-1 of 8 steps given
up). Aborts name the request, so rows of ``n > 1`` completions and beams (other ids) are never
counted as aborted: their steps run to the end, as before.

The flag is a one-element int32 tensor so the C++ loop reads it without the GIL; Python
writes it through a NumPy view of the same memory (a plain store, safe from any thread), under
this object's lock so the three writers (the submitting thread, the aborting thread and the
engine thread) agree. A lost race costs one step's wait, as before; a given-up step costs the
layers it ran (measured in docs/server.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["StepInterrupt", "StepInterrupted"]


class StepInterrupted(Exception):  # a signal between layers, not an error
    """An interruptible step was given up between layers (see the module doc)."""


class StepInterrupt:
    """The engine's one flag: told of arrivals, aborts and steps from any thread, read
    between layers."""

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32)  # [1]: 0 clear, 1 set (the C++ loop reads it)
        self._view = self.flag.numpy()  # the same memory: a store, no torch op, no GIL wait
        self._lock = threading.Lock()
        self._online_waits = False  # an online request was queued since the last take
        self._aborted: set[str] = set()  # requests aborted since the last take (not yet applied)
        self._live: set[str] | None = None  # the step in flight's online rows still wanted

    def set(self) -> None:
        """An online request was queued (the submitting thread)."""
        with self._lock:
            self._online_waits = True
            self._update()

    def aborted(self, request_id: str) -> None:
        """``request_id``'s abort was queued (the aborting thread): its rows are unwanted."""
        with self._lock:
            self._aborted.add(request_id)
            if self._live is not None:
                self._live.discard(request_id)
                self._update()

    def clear(self) -> None:
        """The engine thread took the queued commands: nothing waits, the aborts apply."""
        with self._lock:
            self._online_waits = False
            self._aborted.clear()
            self._view[0] = 0

    def begin(self, online_ids: Iterable[str]) -> None:
        """An interruptible step starts (the runner) with these online rows."""
        with self._lock:
            self._live = set(online_ids) - self._aborted
            self._update()

    def end(self) -> None:
        """The step ended, run out or given up: the flag is the next step's to set."""
        with self._lock:
            self._live = None
            self._view[0] = 0

    def is_set(self) -> bool:
        return bool(self._view[0])

    def check(self) -> None:
        """Raise ``StepInterrupted`` when set (called between layers)."""
        if self._view[0]:
            raise StepInterrupted

    def _update(self) -> None:  # lock held
        self._view[0] = int(self._online_waits and self._live is not None and not self._live)
