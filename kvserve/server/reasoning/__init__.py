"""Reasoning parsers (``--reasoning-parser``, vLLM's names): split a reasoning model's
thinking from its answer. ``deepseek_r1`` and ``qwen3``; see ``base.py``.

``gpt_oss`` (the harmony format's ``analysis`` / ``final`` channels) is not provided: its
markers are special tokens that the detokenizer drops, so it needs a token-level parser.
"""

from __future__ import annotations

from kvserve.server.reasoning.base import ReasoningParser, ReasoningSplit
from kvserve.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvserve.server.reasoning.qwen3 import Qwen3ReasoningParser
from kvserve.server.reasoning.stream import ReasoningStreamer, thinking_enabled

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStreamer",
    "get_reasoning_parser",
    "thinking_enabled",
]
