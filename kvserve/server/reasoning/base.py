"""The reasoning parser interface: split a reasoning model's thinking from its answer.

Reasoning models (DeepSeek-R1, Qwen3...) write their thinking between two marker tokens,
``<think>`` and ``</think>``, before the answer. A parser reads the output text and says which
part is thinking (``reasoning`` / ``reasoning_content`` on chat, ``thinking`` blocks on
Messages) and which part is the answer (``content``, where tool calls are then looked for).

Each parser implements ``split(text, final)``. As with the tool parsers, one promise makes
streaming exact: as the text grows, the reasoning and the content only ever grow at their end
(each is a prefix of what it will be once the output is finished), so a stream sends what is
new and its pieces add up to exactly the unary answer. Text that might still turn out to be
(part of) a marker is held back until the next token decides, or the output ends (``final``).

Parsing is on text, so the markers must survive detokenization: they are added tokens that are
not *special* (``skip_special_tokens`` would drop them), as in DeepSeek-R1's and Qwen3's
tokenizers. ``check_tokenizer`` refuses a tokenizer without them at startup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvserve.server.tool_parsers.base import holdback
from kvserve.structured_output.reasoning import ReasoningMarkers


@dataclass(frozen=True)
class ReasoningSplit:
    """One output split: the thinking so far (None: no thinking) and the answer so far."""

    reasoning: str | None
    content: str


class ReasoningParser:
    """Base class: the markers, the tokenizer check and the split. A parser holds the
    tokenizer (token-level parsers decode with it) and no per-output state."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether the output opens the thinking itself (Qwen3: ``<think>``); False: the output
    # is thinking from its first token (the template opened it in the prompt)
    opens_in_output: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def markers(self) -> ReasoningMarkers:
        """The markers as token ids, for the engine: the grammar starts after ``end`` and a
        thinking budget forces it (``structured_output/reasoning.py``)."""
        tok = self.tokenizer
        end = tuple(tok.convert_tokens_to_ids([self.end]))
        start = tuple(tok.convert_tokens_to_ids([self.start])) if self.opens_in_output else ()
        return ReasoningMarkers(end_ids=end, start_ids=start)

    @classmethod
    def check_tokenizer(cls, tokenizer: Any, model: str) -> None:
        """ValueError unless both markers are single, non-special tokens of ``tokenizer``."""
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        missing = [m for m in (cls.start, cls.end) if m not in vocab]
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        if missing:
            raise ValueError(
                f"--reasoning-parser {cls.name}: the tokenizer of {model} has no "
                f"{' or '.join(missing)} token, so this model does not write its thinking "
                f"between {cls.start} and {cls.end}; serve a reasoning model or drop the flag"
            )
        skipped = [m for m in (cls.start, cls.end) if m in special]
        if skipped:
            raise ValueError(
                f"--reasoning-parser {cls.name}: {' and '.join(skipped)} is a special token "
                f"of {model}'s tokenizer, so it is dropped from the output text"
            )

    def split(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> ReasoningSplit:
        """The output so far (``text``; its ``token_ids`` for token-level parsers) split in
        thinking and answer; ``final``: the output is complete."""
        raise NotImplementedError

    def _after_start(self, text: str) -> str:
        """``text`` without the start marker it opens with, if any (DeepSeek-R1's template
        opens ``<think>`` in the prompt, so the output may or may not repeat it)."""
        return text[len(self.start) :] if text.startswith(self.start) else text

    def _thinking(self, body: str, final: bool) -> ReasoningSplit:
        """``body`` is thinking up to the end marker, the answer after it; a thinking that
        never ends (cut by max_tokens) is all thinking."""
        reasoning, marker, content = body.partition(self.end)
        if marker:
            return ReasoningSplit(reasoning, content)
        keep = len(body) if final else len(body) - holdback(body, self.end)
        return ReasoningSplit(body[:keep], "")


def pending_start(text: str, start: str, final: bool) -> bool:
    """True while ``text`` could still grow into ``start`` (decide nothing yet)."""
    return not final and len(text) < len(start) and start.startswith(text)
