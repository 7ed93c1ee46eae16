"""What crosses between a caller's thread and ``AsyncLLMEngine``'s engine thread: the
commands a caller hands over (a request to add, a function to run on the engine thread, or a
request id to abort) and the errors a caller gets back."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.input_processor import ValidatedRequest
from kvserve.lora.request import LoRARequest
from kvserve.outputs import EngineOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.request_stream import RequestStream


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine was shut down, or failed repeatedly and stopped accepting requests."""


class EngineStepError(RuntimeError):
    """An engine step failed; every request that was in flight is failed with this error."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request's own data; other requests were not affected."""


@dataclass
class AddCommand:
    request_id: str
    request: ValidatedRequest  # checked at the door; the engine thread admits it as is
    arrival_time: float
    num_tokens: int = 0  # prompt tokens x n: what the request adds to the queued-token count
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model

    @property
    def n(self) -> int:
        """Sequences the request adds to the queue (an embedding request is one)."""
        if self.request.beam_search is not None:
            return self.request.beam_search.beam_width  # one running request per beam
        params = self.request.params
        return params.n if isinstance(params, SamplingParams) else 1


@dataclass
class CallCommand:
    """Run ``fn(engine)`` on the engine thread between steps (``AsyncLLMEngine.call``)."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


Command = AddCommand | CallCommand | str  # str: a request id to abort


def run_call(cmd: CallCommand, engine: LLMEngine) -> None:
    """Run a ``CallCommand`` on the engine thread; its future gets the result or the
    exception (a cancelled one is skipped)."""
    if not cmd.future.set_running_or_notify_cancel():
        return
    try:
        cmd.future.set_result(cmd.fn(engine))
    except Exception as exc:  # the caller's problem, not the engine's
        cmd.future.set_exception(exc)


def put_all(batch: list[tuple[RequestStream, EngineOutput | BaseException]]) -> None:
    """Each item into its stream (runs in the streams' event loop)."""
    for stream, item in batch:
        stream.put(item)
