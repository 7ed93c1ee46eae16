"""``qwen3``: Qwen3 (and other models whose output opens with ``<think>``). An output that
starts with ``<think>`` is thinking up to ``</think>``, then the answer; any other output is
all answer (``enable_thinking: false``: the template closes an empty thinking in the prompt).

One difference from vLLM, so that a stream always adds up to the unary answer: vLLM's unary
parser calls an output without ``</think>`` all answer while its stream has already sent it as
thinking; here a thinking that started and never ended is thinking both ways (as
``deepseek_r1``), and an output that does not open with ``<think>`` is answer both ways.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.server.reasoning.base import ReasoningParser, ReasoningSplit, pending_start


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_output = True

    def split(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> ReasoningSplit:
        if pending_start(text, self.start, final):
            return ReasoningSplit(None, "")
        if not text.startswith(self.start):
            return ReasoningSplit(None, text)
        return self._thinking(text[len(self.start) :], final)
