"""LoRA adapters over HTTP (vLLM's interface): ``--lora-modules``, adapters in `/v1/models`
with ``parent`` = their base model, chosen by a request's ``model`` on every endpoint, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` when runtime updating is on
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, vLLM's variable, or ``--allow-runtime-lora-updating``).

``LoRARegistry`` (on ``ServerState``) is the server's one table of served adapter names; each
engine keeps what it has loaded (``LLMEngine.add_lora``). A request naming an adapter gets a
``LoRAEngine``: its engine as that adapter's requests see it (``generate`` runs the adapter,
``model_name`` is the adapter's name, as vLLM reports it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from kvserve.lora.request import LoRARequest
from kvserve.server.errors import APIError
from kvserve.server.openapi import error_responses

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncLLMEngine, RequestStream
    from kvserve.server.app import ServerState

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_ERROR_REF = "#/components/schemas/ErrorResponse"


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModuleSpec:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` (argparse type)."""
    if value.lstrip().startswith("{"):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {value!r} is not JSON: {e}") from e
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"})
        if unknown or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules: {value!r} needs string 'name' and 'path' (and "
                             f"optionally 'base_model_name'); unknown keys: {unknown}")  # fmt: skip
        return LoRAModuleSpec(raw["name"], raw["path"], raw.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {value!r} is not name=path or a JSON object")
    return LoRAModuleSpec(name, path)


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


@dataclass(frozen=True)
class ServedLoRA:
    request: LoRARequest
    base: str  # the served name of the model it runs on


class LoRARegistry:
    """Served adapter name -> adapter and base model; ids are handed out here, never reused,
    so a prefix-cache block of an unloaded adapter is never found by a later one."""

    def __init__(self, allow_runtime_updates: bool = False) -> None:
        self.allow_runtime_updates = allow_runtime_updates
        self.adapters: dict[str, ServedLoRA] = {}  # copy-on-write: readers never lock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new_request(self, name: str, path: str, base: str) -> LoRARequest:
        with self._lock:
            return LoRARequest(name, next(self._ids), path, base_model_name=base)

    def add(self, served: ServedLoRA) -> None:
        with self._lock:
            self.adapters = {**self.adapters, served.request.lora_name: served}

    def remove(self, name: str) -> ServedLoRA | None:
        with self._lock:
            served = self.adapters.get(name)
            if served is not None:
                self.adapters = {k: v for k, v in self.adapters.items() if k != name}
            return served


class LoRAEngine:
    """An engine as the requests naming one of its adapters see it (everything else is the
    engine's own)."""

    def __init__(self, engine: AsyncLLMEngine, served: ServedLoRA, registry: LoRARegistry):
        self._engine = engine
        self._served = served
        self._registry = registry

    @property
    def model_name(self) -> str:
        return self._served.request.lora_name

    @property
    def base_model_name(self) -> str:
        """The served model it runs on (what the metrics' model_name label names)."""
        return self._served.base

    def generate(
        self,
        prompt: Any,
        params: Any = None,
        request_id: str | None = None,
        priority: int = 0,
        background: bool = False,
    ) -> RequestStream:
        name = self._served.request.lora_name
        if self._registry.adapters.get(name) is not self._served:  # unloaded meanwhile
            raise not_found(name)
        return self._engine.generate(
            prompt, params, request_id, priority, self._served.request, background
        )

    def encode(self, *args: Any, **kwargs: Any) -> RequestStream:
        raise APIError(400, f"`{self.model_name}` is a LoRA adapter; embeddings run the base "
                       f"model `{self._served.base}`", param="model")  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                    code="model_not_found")  # fmt: skip


def load_lora_modules(state: ServerState, specs: list[LoRAModuleSpec]) -> None:
    """Load the ``--lora-modules`` adapters at start-up (after the models); a bad adapter
    stops the server with its reason."""
    for spec in specs:
        engine = state.engines.get(spec.base_model_name or next(iter(state.engines)))
        if engine is None:
            raise ValueError(f"--lora-modules {spec.name}: base model {spec.base_model_name!r} "
                             f"is not served ({', '.join(state.engines)})")  # fmt: skip
        _check_name(state, spec.name)
        req = state.loras.new_request(spec.name, spec.path, engine.model_name)
        try:
            engine.call(lambda e, req=req: e.add_lora(req)).result()  # on the engine thread
        except ValueError as e:
            raise ValueError(f"--lora-modules {spec.name}: {e}") from e
        state.loras.add(ServedLoRA(req, engine.model_name))


def _check_name(state: ServerState, name: str) -> None:
    if name in state.engines:
        raise ValueError(f"LoRA adapter name {name!r} is a served model's name")
    if name in state.loras.adapters:
        raise ValueError(f"The lora adapter '{name}' has already been loaded.")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body; ``base_model_name`` (kvserve's): the served model it runs on (default:
    the first)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of the same name (vLLM's field)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name decides here


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    # The success is vLLM's plain text, the errors the API's JSON: each documented with its
    # own media type (a response_class would give every status text/plain).
    errors: dict[int | str, dict[str, Any]] = {
        s: {"description": e["description"],
            "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}}}
        for s, e in error_responses(400, 403, 404, 413, 500, 503).items()
    }  # fmt: skip
    errors[200] = {
        "description": "Success",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=errors)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        _check_allowed(state)
        engine = state.engine_for(req.base_model_name)
        if req.base_model_name in state.loras.adapters:
            raise APIError(400, "base_model_name names a LoRA adapter", param="base_model_name")
        if req.load_inplace and req.lora_name in state.loras.adapters:
            await _unload(state, req.lora_name)
        try:
            _check_name(state, req.lora_name)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_name") from e
        lora = state.loras.new_request(req.lora_name, req.lora_path, engine.model_name)
        try:
            await asyncio.wrap_future(engine.call(lambda e: e.add_lora(lora)))
        except ValueError as e:  # a bad adapter: the reason, and the server goes on
            raise APIError(400, f"LoRA adapter '{req.lora_name}': {e}", param="lora_path") from e
        state.loras.add(ServedLoRA(lora, engine.model_name))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=errors)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        _check_allowed(state)
        state.engine_for(None)  # 503 while loading
        await _unload(state, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _unload(state: ServerState, name: str) -> None:
    """New requests stop finding it at once; those in flight finish on it."""
    served = state.loras.remove(name)
    if served is None:
        raise not_found(name)
    engine = state.engines[served.base]
    lid = served.request.lora_int_id
    await asyncio.wrap_future(engine.call(lambda e: e.remove_lora(lid)))


def _check_allowed(state: ServerState) -> None:
    if not state.loras.allow_runtime_updates:
        raise APIError(
            403, f"loading and unloading LoRA adapters at run time is off; start the server "
            f"with {RUNTIME_UPDATING_ENV}=1 or --allow-runtime-lora-updating",
        )  # fmt: skip
