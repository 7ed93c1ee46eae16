"""Where one sequence stands relative to its thinking: the engine's side of a reasoning model.

A reasoning model writes its thinking, then an end marker (``</think>``; gpt-oss's
``<|channel|>final<|message|>``), then the answer. Two request fields act on that split
(vLLM's rules):

- ``structured_outputs`` constrain the answer only: the thinking is free, the grammar's
  bitmask applies from the first token after the end marker (the marker itself is free too);
- ``thinking_token_budget``: after that many thinking tokens the end marker is forced, token
  by token (``forced_end_ids``), and the answer follows freely.

``ReasoningMarkers`` is the contract (token ids, from the server's ``--reasoning-parser``);
``ReasoningState`` follows one sequence's output tokens. Both are pure Python: the bitmask
rows are written by ``grammar.StructuredOutputRequest``, which owns one ``ReasoningState``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvserve.sampling_params import ParamError


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning model's markers as token ids of its tokenizer.

    ``start_ids`` empty: the output is thinking from its first token (DeepSeek-R1, whose
    template opens ``<think>`` in the prompt). Else, with ``start_required``, the output
    thinks only when it opens with them (Qwen3's ``<think>``), otherwise it is all answer;
    without, it thinks either way and the start is only not counted against the budget
    (gpt-oss's ``<|channel|>analysis<|message|>`` header). ``forced_end_ids``: what a spent
    budget forces; it must end with ``end_ids`` (empty: ``end_ids`` alone).
    """

    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()
    forced_end_ids: tuple[int, ...] = ()
    start_required: bool = True

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ParamError("reasoning_markers", "reasoning markers need end token ids")
        forced = self.forced
        if forced[len(forced) - len(self.end_ids) :] != self.end_ids:
            raise ParamError("reasoning_markers", "forced_end_ids must end with end_ids")

    @property
    def forced(self) -> tuple[int, ...]:
        return self.forced_end_ids or self.end_ids


class Phase(enum.Enum):
    OPENING = "opening"  # start_ids given and not yet decided: does the output open with them?
    THINKING = "thinking"
    ANSWER = "answer"  # after the end marker, or an output that did not open the thinking


class ReasoningState:
    """One sequence's phase, thinking-token count and forced-end progress.

    ``accept`` takes each output token and says whether it belongs to the answer (the grammar
    takes only those); ``forced_token`` is the one token a spent budget allows next.
    """

    def __init__(self, markers: ReasoningMarkers, budget: int | None) -> None:
        self.markers = markers
        self.budget = budget
        self.tokens: list[int] = []  # the output so far (kept for rollback)
        opening = markers.start_ids and markers.start_required
        self.phase = Phase.OPENING if opening else Phase.THINKING
        self.thinking_tokens = 0  # counted against the budget (not the markers)
        self._forced = 0  # tokens of the forced end already written

    def accept(self, token: int) -> bool:
        """Advance over one output token; True when it is an answer token."""
        self.tokens.append(token)
        m = self.markers
        if self.phase is Phase.ANSWER:
            return True
        if self.phase is Phase.OPENING:
            if m.start_ids[: len(self.tokens)] != tuple(self.tokens):
                self.phase = Phase.ANSWER
                return True
            if len(self.tokens) == len(m.start_ids):
                self.phase = Phase.THINKING
            return False
        n = len(self.tokens)
        if self.forced_token() is not None:
            self._forced += 1
        elif not (n <= len(m.start_ids) and m.start_ids[:n] == tuple(self.tokens)):
            self.thinking_tokens += 1  # the start marker is not thinking
        if tuple(self.tokens[-len(m.end_ids) :]) == m.end_ids:
            self.phase = Phase.ANSWER
        return False

    def forced_token(self) -> int | None:
        """The token the budget forces next, or None (no budget, or not spent yet)."""
        if self.phase is not Phase.THINKING or self.budget is None:
            return None
        if self.thinking_tokens < self.budget:
            return None
        forced = self.markers.forced
        return forced[self._forced] if self._forced < len(forced) else None

    def may_open(self) -> int | None:
        """While undecided: the single start token that would open the thinking."""
        if self.phase is Phase.OPENING and len(self.markers.start_ids) == 1:
            return self.markers.start_ids[0]
        return None

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` output tokens (replayed from the start: rare)."""
        kept = self.tokens[: len(self.tokens) - num_tokens]
        self.__init__(self.markers, self.budget)  # type: ignore[misc]
        for t in kept:
            self.accept(t)
