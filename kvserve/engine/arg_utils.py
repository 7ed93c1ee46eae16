"""Every engine option, declared once: ``EngineArgs`` (the shape of vLLM's ``arg_utils``).

Each field carries its default and help text (``arg_fields.py``); ``add_cli_args`` turns the
fields into the flags of ``kvserve generate``, ``serve`` and ``bench throughput``,
``LLM(model, **kwargs)`` takes the same names as keyword arguments, and
``create_engine_config`` builds the frozen ``EngineConfig`` (``arg_config.py``). vLLM's names
are accepted wherever their meaning carries over; a vLLM option whose feature kvserve lacks is
refused with a message naming it, never dropped (``arg_checks.py``).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvserve.config import EngineConfig, LoRAConfig, SpeculativeConfig
from kvserve.engine import arg_checks, arg_config
from kvserve.engine.arg_checks import (
    GENERATION_CONFIGS,
    SERVER_ONLY,
    VLLM_UNSUPPORTED,
    check_vllm_options,
    flag_name,
    load_chat_template,
)
from kvserve.engine.arg_config import available_memory
from kvserve.engine.arg_fields import EngineArgFields
from kvserve.engine.vllm_flags import check_vllm_kwargs

__all__ = [
    "GENERATION_CONFIGS",
    "SERVER_ONLY",
    "VLLM_UNSUPPORTED",
    "EngineArgs",
    "available_memory",
    "check_vllm_options",
    "field_choices",
    "flag_name",
    "load_chat_template",
]


class _VLLMOptionAction(argparse.Action):
    """Collects a :data:`VLLM_UNSUPPORTED` flag's value for ``from_cli_args`` to check."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        given = dict(getattr(namespace, "vllm_options", {}))
        given[self.dest] = True if self.nargs == 0 else values
        namespace.vllm_options = given


@dataclass
class EngineArgs(EngineArgFields):
    """The engine's options: ``LLM`` keyword arguments and the engine CLI flags."""

    def __post_init__(self) -> None:
        """Check everything that needs no model, so bad options fail before any loading."""
        arg_checks.check_args(self)

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` (a dict or its JSON) as a validated ``SpeculativeConfig``."""
        return arg_checks.speculative_config(self)

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits when ``enable_lora``; None (and no LoRA option changed) otherwise."""
        return arg_checks.lora_config(self)

    def check_hub_cache(self) -> None:
        """With HF_HUB_OFFLINE, resolve the Hub ids (tokenizer, model) now: from the cache
        only, so at once, and a ValueError naming the id and the cache if one is missing."""
        arg_config.check_hub_cache(self)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """``LLM(model, **kwargs)``'s options; an unknown keyword is a ``TypeError`` naming it."""
        names = [f.name for f in fields(cls)]
        kwargs = check_vllm_kwargs(kwargs, set(names) | set(VLLM_UNSUPPORTED))
        vllm = {k: kwargs.pop(k) for k in list(kwargs) if k in VLLM_UNSUPPORTED}
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine argument {key!r}{hint}")
        check_vllm_options(vllm)
        server_only = sorted(SERVER_ONLY & set(kwargs))
        if server_only:
            key = server_only[0]
            raise ValueError(
                f"{key} ({flag_name(key)}) is an option of `kvserve serve` (the HTTP server's "
                f"observability); LLM does not take it"
            )
        return cls(model=model, **kwargs)

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser | Any, exclude: frozenset[str] = frozenset()
    ) -> Any:
        """One flag per field (except ``exclude``d ones), plus the refused vLLM flags."""
        for f in fields(cls):
            if f.name in exclude:
                continue
            meta = f.metadata
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
            if isinstance(f.default, bool) or meta.get("switch"):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = meta["type"] or type(f.default)
                if meta["choices"]:
                    kw["choices"] = meta["choices"]
                if meta["nargs"]:
                    kw["nargs"] = meta["nargs"]
            parser.add_argument(flag_name(f.name), **kw)
        for name, (noop, _) in VLLM_UNSUPPORTED.items():
            parser.add_argument(
                flag_name(name), dest=name, action=_VLLMOptionAction,
                nargs=0 if noop is False else None, default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )  # fmt: skip
        return parser

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, exclude: frozenset[str] = frozenset()
    ) -> EngineArgs:
        """The fields found on ``args``, except ``exclude`` (a flag of the same name that
        means something else); the rest keep their defaults. Refused vLLM flags raise."""
        check_vllm_options(getattr(args, "vllm_options", {}))
        names = [f.name for f in fields(cls) if f.name not in exclude and hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})

    def llm_kwargs(self) -> dict[str, Any]:
        """``LLM(**...)`` arguments that rebuild these args: the model and every changed field."""
        changed = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "model" and getattr(self, f.name) != f.default
        }
        return {"model": self.model, **changed}

    def create_engine_config(self, free_memory: Callable[[str], int] | None = None) -> EngineConfig:
        """The engine's config. ``free_memory(device)`` (default: :func:`available_memory`)
        gives the free bytes ``gpu_memory_utilization`` is a fraction of."""
        # `available_memory` is looked up here, in this module, so a test can replace it.
        return arg_config.build_engine_config(self, free_memory or available_memory)

    def _resolve_model(self) -> tuple[Path, str, str | None, dict[str, Any]]:
        """(model folder, default served name, GGUF file, sampling defaults): see
        ``arg_config.resolve_model``."""
        return arg_config.resolve_model(self)


def field_choices(name: str) -> tuple[str, ...]:
    """The allowed values of a field with choices (``kv_policy`` -> preempt, reserve)."""
    return next(f.metadata["choices"] for f in fields(EngineArgs) if f.name == name)
