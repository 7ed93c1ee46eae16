"""Sleep mode (vLLM's ``--enable-sleep-mode``, ``LLM.sleep``/``wake_up``; llama.cpp's
``--sleep-idle-seconds``): release an idle model's memory to the OS and take it back later.

Level 1 frees the KV cache and the swap space (the weights stay in host memory); level 2
frees the weights too, which ``wake_up`` reads again from the model folder. The engine owns
the state (``LLMEngine.sleep_level``); each runner frees and reallocates its own tensors
(``ModelRunner.sleep``/``wake_up``) and hands the freed heap back (``malloc_trim``).

A sleeping engine cannot run requests. After an explicit ``sleep`` a request is refused
(``EngineSleepingError``; HTTP 503 naming ``/wake_up``), as vLLM's fix for requests to a
sleeping model does; after an idle sleep (``wake_on_request``) the next request wakes the
engine first, and its time to first token pays the wake. An engine with unfinished requests
refuses to sleep (vLLM's rule since its sleep-with-active-requests fix): freeing their KV
would lose them.
"""

from __future__ import annotations

from kvserve.config import EngineConfig

SLEEP_LEVELS = (1, 2)


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep explicitly; ``wake_up`` first."""


class SleepRefusedError(RuntimeError):
    """``sleep`` was asked for while the engine cannot sleep (requests still running)."""


def check_sleep(config: EngineConfig, level: object, num_unfinished: int) -> int:
    """The level to sleep at; raises ValueError for a bad level or a disabled mode and
    ``SleepRefusedError`` while requests are unfinished."""
    if not config.model.enable_sleep_mode:
        raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                         "(--enable-sleep-mode)")  # fmt: skip
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (and the weights), "
                         f"got {level!r}")  # fmt: skip
    if level == 2 and config.lora is not None:
        raise ValueError("sleep level 2 with LoRA adapters is not supported (the adapters "
                         "wrap the loaded weights); use level 1")  # fmt: skip
    if level == 2 and config.speculative is not None:
        raise ValueError("sleep level 2 with speculative decoding is not supported (the "
                         "proposer holds the loaded model); use level 1")  # fmt: skip
    if num_unfinished:
        raise SleepRefusedError(
            f"{num_unfinished} request(s) are still unfinished; the engine sleeps only when "
            "idle (their KV cache would be lost)"
        )
    return int(level)  # type: ignore[call-overload]
