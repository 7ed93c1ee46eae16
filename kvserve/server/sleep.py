"""vLLM's sleep-mode routes: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``
(``kvserve/engine/sleep_mode.py`` says what each level frees).

They act on every served model, or on ``?model=`` alone; behind the API key like every
route that changes the server. A server without ``--enable-sleep-mode`` answers 404 (vLLM
does not register them then). While a model sleeps after ``/sleep``, its generation,
embedding and score requests get 503 naming ``/wake_up`` (vLLM's fix for requests to a
sleeping model); after an idle sleep (``--sleep-idle-seconds``) the next request wakes it.
A model with requests in flight refuses to sleep: 409.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.sleep_mode import SleepRefusedError
from kvserve.server.errors import APIError, bad_request
from kvserve.server.openapi import error_responses

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

SLEEP_OFF = "sleep mode is off: start the server with --enable-sleep-mode"


def _engines(state: ServerState, model: str | None) -> list[AsyncLLMEngine]:
    """The engines a sleep route acts on; 404 when sleep mode is off."""
    state.engine_for(None)  # 503 while loading
    if not any(e.config.model.enable_sleep_mode for e in state.engines.values()):
        raise APIError(404, SLEEP_OFF)
    if model:
        view = state.engine_for(model)  # an adapter's name: its base model
        return [state.engines[getattr(view, "base_model_name", view.model_name)]]
    return list(state.engines.values())


def add_sleep_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/sleep", responses=error_responses(400, 404, 409, 503))
    async def sleep(level: int = 1, model: str | None = None) -> JSONResponse:
        """Free the KV cache (level 1), and the weights too (level 2)."""
        engines = _engines(state, model)
        seconds = {}
        for engine in engines:
            try:
                seconds[engine.model_name] = round(await engine.sleep(level), 3)
            except SleepRefusedError as e:
                raise APIError(409, f"{engine.model_name}: {e}") from e
            except ValueError as e:
                raise bad_request(str(e), "level") from e
        return JSONResponse({"status": "ok", "level": level, "seconds": seconds})

    @app.post("/wake_up", responses=error_responses(400, 404, 503))
    async def wake_up(
        model: str | None = None, tags: Annotated[list[str] | None, Query()] = None
    ) -> JSONResponse:
        """Allocate the KV cache again (and read the weights again after level 2)."""
        if tags:  # vLLM's partial wake (weights first, then the KV cache)
            raise bad_request("kvserve wakes a model whole: send /wake_up without tags", "tags")
        engines = _engines(state, model)
        seconds = {e.model_name: round(await e.wake_up(), 3) for e in engines}
        return JSONResponse({"status": "ok", "seconds": seconds})

    @app.get("/is_sleeping", responses=error_responses(404, 503))
    async def is_sleeping(model: str | None = None) -> JSONResponse:
        """vLLM's answer, ``{"is_sleeping": bool}``: whether the model (every model: any) is
        asleep."""
        engines = _engines(state, model)
        return JSONResponse({"is_sleeping": any(e.is_sleeping for e in engines)})
