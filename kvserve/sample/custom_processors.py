"""Custom batch-level logits processors, shaped like vLLM v1's ``LogitsProcessor``.

A processor class is given to the engine (``LLM(logits_processors=[MyProcessor])`` or
``--logits-processors package.module:MyProcessor``); the engine builds one instance with
``(config, device, is_pin_memory)``. Before each sampler call the runner tells every instance
which requests sit in which logits row (``update_state(BatchUpdate)``; ``None`` when the batch
is the same as in the last call), and the sampler calls ``apply(logits)`` on the float32
``[B, V]`` logits after the per-request seam (bias, allowed ids, bad words) and before
min_tokens and the penalties. Per-request settings travel in ``SamplingParams.extra_args``;
``validate_params`` refuses a request at the door. A processor that declares itself
argmax-invariant is skipped for an all-greedy batch, as vLLM allows.

kvserve rebuilds its batch every step instead of keeping vLLM's persistent batch, so a changed
batch is reported as "every old row removed, every row added" (``moved`` is always empty);
the output token lists handed over in ``added`` are the requests' live lists, which grow as
tokens are appended (vLLM's contract too).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.sampling_params import SamplingParams

# (row index, the request's params, its prompt ids, its live output ids), vLLM's tuple
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last ``update_state`` (vLLM's ``BatchUpdate``)."""

    batch_size: int  # rows of the logits ``apply`` will get
    removed: Sequence[int] = ()  # row indices that no longer hold their request
    added: Sequence[AddedRequest] = ()  # rows that now hold a new request
    moved: Sequence[tuple[int, int, str]] = field(default=())  # always empty in kvserve


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM v1's interface)."""

    def __init__(  # noqa: B027 (subclasses take what they need from the arguments)
        self, config: Any, device: torch.device, is_pin_memory: bool
    ) -> None:
        """``config`` is the engine's ``EngineConfig``."""

    @classmethod  # noqa: B027 (an optional hook: most processors accept every request)
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request this processor cannot serve (a 400)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes a row's argmax (then greedy batches skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track which request is in which row; ``None``: same batch as last time."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the processed float32 ``[B, V]`` logits (in place or new)."""


def load_processor_class(spec: str | type) -> type[LogitsProcessor]:
    """A class, or its qualified name ``package.module:Class`` / ``package.module.Class``."""
    if isinstance(spec, type):
        cls: Any = spec
    else:
        module, sep, name = spec.partition(":")
        if not sep:
            module, _, name = spec.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"logits_processors: cannot import {spec!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(
            f"logits_processors: {spec!r} is not a subclass of "
            "kvserve.sample.custom_processors.LogitsProcessor"
        )
    return cls


class BatchProcessors:
    """The engine's processor instances and the batch they were last told about."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self._rows: list[str] = []  # request id per row at the last update

    def update(
        self, request_ids: list[str], added: Sequence[tuple[SamplingParams, list[int], list[int]]]
    ) -> list[LogitsProcessor]:
        """Report this call's rows (``added[i]`` describes row i) and return the processors."""
        if not self.processors:
            return []
        update: BatchUpdate | None = None
        if request_ids != self._rows:
            update = BatchUpdate(
                batch_size=len(request_ids),
                removed=list(range(len(self._rows))),
                added=[(i, p, prompt, out) for i, (p, prompt, out) in enumerate(added)],
            )
            self._rows = list(request_ids)
        for proc in self.processors:
            proc.update_state(update)
        return self.processors
