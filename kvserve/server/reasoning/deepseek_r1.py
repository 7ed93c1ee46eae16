"""``deepseek_r1``: DeepSeek-R1 and its distills. The chat template opens ``<think>`` in the
prompt, so the output is thinking from its first token (a repeated ``<think>`` is dropped)
until ``</think>``, then the answer. Without ``</think>`` the whole output is thinking (vLLM's
rule: the thinking was cut before it ended)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.server.reasoning.base import ReasoningParser, ReasoningSplit, pending_start


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> ReasoningSplit:
        if pending_start(text, self.start, final):
            return ReasoningSplit("", "")
        return self._thinking(self._after_start(text), final)
