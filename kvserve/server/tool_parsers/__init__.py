"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``, vLLM's names).

``hermes``, ``llama3_json`` and ``pythonic``; each turns a model's text into OpenAI tool
calls, whole (``extract_tool_calls``) or as streaming deltas. See ``base.py``.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import (
    ExtractedToolCallInformation,
    PartialCall,
    PartialParse,
    ToolCallStreamer,
    ToolParser,
)
from kvserve.server.tool_parsers.hermes import HermesToolParser
from kvserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "PartialCall",
    "PartialParse",
    "PythonicToolParser",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
]
