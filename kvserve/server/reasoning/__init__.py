"""Reasoning parsers (``--reasoning-parser``, vLLM's names): split a reasoning model's
thinking from its answer. ``deepseek_r1`` and ``qwen3`` read the output text (``base.py``);
``gpt_oss`` reads the harmony format's ``analysis`` / ``final`` channels from the output's
token ids, since its markers are special tokens the detokenizer drops (``gpt_oss.py``).
vLLM names the last one ``openai_gptoss``; kvserve takes both names.
"""

from __future__ import annotations

from kvserve.server.reasoning.base import ReasoningParser, ReasoningSplit
from kvserve.server.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from kvserve.server.reasoning.gpt_oss import GptOssReasoningParser
from kvserve.server.reasoning.qwen3 import Qwen3ReasoningParser
from kvserve.server.reasoning.stream import ReasoningStreamer, thinking_enabled

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)
}
REASONING_PARSERS["openai_gptoss"] = GptOssReasoningParser  # vLLM's name


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
    "GptOssReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStreamer",
    "get_reasoning_parser",
    "thinking_enabled",
]
