"""The interface the engine drives its runners through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.worker.runner_output import ModelRunnerOutput, RunnerInfo

if TYPE_CHECKING:
    from kvserve.worker.model_runner import ModelRunner


class WorkerDiedError(RuntimeError):
    """A worker process exited (killed, crashed, out of memory): the engine cannot go on."""


class RankFailedError(WorkerDiedError):
    """A call raised on one rank of a tensor-parallel model. The other ranks may be waiting
    in a collective that rank never reaches, and retrying would pair the ranks' collectives
    wrongly, so the workers are stopped: like a dead worker, the engine cannot go on."""


class Executor(ABC):
    """Runs each step message on every rank's ``ModelRunner``; rank 0's output comes back."""

    info: RunnerInfo  # what the runners built (rank 0's): block counts for the engine's pool
    infos: list[RunnerInfo]  # every rank's, in rank order (each its own paths and cores)
    # the runner itself when it lives in this process (uni), else None
    runner: ModelRunner | None = None

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank (``ModelRunner.execute``)."""
        out = self.collective_rpc("execute", sched)
        assert isinstance(out, ModelRunnerOutput)
        return out

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> Any:
        """Call ``ModelRunner.<method>(*args)`` on every rank; returns rank 0's result."""

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, from another thread, when a runner dies while no
        call is running (an idle engine would otherwise notice only at its next step). A
        runner in the engine's own process dies with it: nothing to watch by default."""
        del callback

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the runners and free their processes (idempotent)."""
