"""Where the model runner lives: in the engine's process (``UniProcExecutor``) or in one
worker process per rank (``MultiprocExecutor``). The engine talks to either through the
``Executor`` interface with plain-data step messages (see docs/ARCHITECTURE.md, "Life of a
step across processes")."""

from __future__ import annotations

from kvserve.config import EngineConfig, ExecutorBackend
from kvserve.executor.abstract import Executor, RankFailedError, WorkerDiedError

__all__ = ["Executor", "RankFailedError", "WorkerDiedError", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config.parallel.distributed_executor_backend`` names (built: the
    runners exist, their models are loaded and warmed up)."""
    if config.parallel.distributed_executor_backend is ExecutorBackend.MP:
        from kvserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from kvserve.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
