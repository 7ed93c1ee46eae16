"""Per-request use of a reasoning parser: whether it runs, and one choice's stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvserve.server.reasoning.base import ReasoningParser, ReasoningSplit


def thinking_enabled(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """False when the request turned thinking off (``{"enable_thinking": false}``, Qwen3's
    template variable, or ``{"thinking": false}``, DeepSeek-V3.1's): the template then opens
    no thinking and the whole output is the answer, so no parser runs."""
    kwargs = chat_template_kwargs or {}
    return all(kwargs.get(k, True) is not False for k in ("enable_thinking", "thinking"))


class ReasoningStreamer:
    """One streamed choice: the new thinking of each step and the answer so far."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of thinking sent

    def step(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """(thinking not sent yet, the whole answer so far) for the output ``text`` (and its
        ``token_ids``) so far."""
        split: ReasoningSplit = self.parser.split(text, final, token_ids)
        reasoning = split.reasoning or ""
        new = reasoning[self.sent :]
        self.sent = max(self.sent, len(reasoning))
        return new, split.content
