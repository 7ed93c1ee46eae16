"""The engine's output as Responses API output items and stream events.

One translator, ``OutputBuilder``, serves both ways of answering: a stream feeds it each
cumulative output and sends the events it returns; a unary answer feeds it the final output
once and keeps only the items. So a streamed answer's items are exactly the unary one's for
the same tokens (greedy), and the deltas of each item add up to its final text.

Events, in OpenAI's documented order: ``response.created``, ``response.in_progress``; per
item ``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, or for a function call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``;
then ``response.output_item.done``; last ``response.completed`` (``response.incomplete``
when ``max_output_tokens`` cut the answer). Every event has a ``sequence_number`` from 0.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.reasoning.base import ReasoningParser
from kvserve.server.serving import to_json
from kvserve.server.tools import ChoiceToolStream, ToolPlan


def item_id(prefix: str) -> str:
    """OpenAI's item ids: ``msg_`` / ``fc_`` / ``rs_`` + 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    kind: str  # "message", "function_call" or "reasoning"
    id: str
    text: str = ""  # the message's text, the call's arguments, the reasoning
    name: str = ""  # function_call
    call_id: str = ""  # function_call
    open: bool = True
    status: str = "in_progress"  # its final status once closed

    def body(self, status: str) -> dict[str, Any]:
        """The item as it appears in ``output`` (``status``: in_progress / completed /
        incomplete)."""
        if self.kind == "message":
            content = [] if self.open and status == "in_progress" else [_text_part(self.text)]
            return {
                "id": self.id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            }
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
            }
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": self.text}]
        return {
            "id": self.id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class OutputBuilder:
    """Output items (and stream events) from one choice's cumulative text."""

    plan: ToolPlan
    # --reasoning-parser's, unless the request turned thinking off (chat_pipeline.reasoning_for):
    # the thinking becomes a ``reasoning`` item before the answer's items
    reasoning: ReasoningParser | None = None
    sequence: int = 0
    items: list[_Item] = field(default_factory=list)
    _message: _Item | None = None  # the message being written
    _reasoning: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)  # tool-call index -> its item
    _sent_answer: int = 0  # characters of the answer handed to the tool stream / content
    _tools: ChoiceToolStream | None = None

    def __post_init__(self) -> None:
        if self.plan.streams_tools:
            self._tools = self.plan.streamer()

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event (``event:`` line, then the JSON with ``type`` and the number)."""
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(data)}\n\n"

    def step(
        self, text: str, finish_reason: str | None, token_ids: Sequence[int] = ()
    ) -> list[str]:
        """The events for the output grown to ``text`` / ``token_ids`` (``finish_reason``: it
        is complete)."""
        events: list[str] = []
        reasoning, answer = None, text
        if self.reasoning is not None:  # both parts only grow at their end (reasoning/base.py)
            split = self.reasoning.split(text, finish_reason is not None, token_ids)
            reasoning, answer = split.reasoning, split.content
        if reasoning:
            events += self._reasoning_delta(reasoning)
        if self._tools is not None:
            delta, _ = self._tools.step(answer, finish_reason)
        else:
            new = answer[self._sent_answer :]
            self._sent_answer = len(answer)
            delta = {"content": new} if new else {}
        if delta.get("content"):
            events += self._content(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if finish_reason is not None:
            events += self._close_all("incomplete" if finish_reason == "length" else "completed")
        return events

    def output(self, status: str) -> list[dict[str, Any]]:
        """The items as ``output`` holds them (``status``: of the items still open)."""
        return [i.body(status if i.open else i.status) for i in self.items]

    def _open(self, item: _Item) -> str:
        self.items.append(item)
        return self.event(
            "response.output_item.added",
            output_index=len(self.items) - 1,
            item=item.body("in_progress"),
        )

    def _reasoning_delta(self, reasoning: str) -> list[str]:
        events = []
        if self._reasoning is None:
            self._reasoning = _Item("reasoning", item_id("rs"))
            events.append(self._open(self._reasoning))
        new = reasoning[len(self._reasoning.text) :]
        if new:
            self._reasoning.text = reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self._reasoning.id,
                    output_index=self.items.index(self._reasoning),
                    content_index=0,
                    delta=new,
                )
            )
        return events

    def _content(self, text: str) -> list[str]:
        events = []
        if self._reasoning is not None and self._reasoning.open:
            events += self._close(self._reasoning, "completed")  # the answer has begun
        if self._message is None:
            self._message = _Item("message", item_id("msg"))
            events.append(self._open(self._message))
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message.id,
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        if not text:
            return events
        self._message.text += text
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message.id,
                output_index=self.items.index(self._message),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        fn = call.get("function") or {}
        item = self._calls.get(call["index"])
        if item is None:  # a new call: its id and name come first
            for open_item in (self._reasoning, self._message):
                if open_item is not None and open_item.open:
                    events += self._close(open_item, "completed")
            self._message = None  # text after the call starts a new message
            item = _Item(
                "function_call",
                item_id("fc"),
                name=fn.get("name") or "",
                call_id=call.get("id") or item_id("call"),
            )
            self._calls[call["index"]] = item
            events.append(self._open(item))
        fragment = fn.get("arguments") or ""
        if fragment:
            item.text += fragment
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=self.items.index(item),
                    delta=fragment,
                )
            )
        return events

    def _close_all(self, status: str) -> list[str]:
        events = [] if self.items else self._content("")  # an empty answer: one empty message
        for item in list(self.items):
            if item.open:
                events += self._close(item, status)
        return events

    def _close(self, item: _Item, status: str) -> list[str]:
        index = self.items.index(item)
        events = []
        if item.kind == "message":
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=_text_part(item.text),
                )
            )
        elif item.kind == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.text,
                )
            )
        else:
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                )
            )
        item.open, item.status = False, status
        events.append(
            self.event("response.output_item.done", output_index=index, item=item.body(status))
        )
        return events


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat messages (for the stored conversation): the text and the
    calls of one turn in one assistant message, as a chat template reads them back."""
    content = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return [message]
