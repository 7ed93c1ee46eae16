"""The tool parser interface (vLLM's ``ToolParser`` shape) and the streaming bookkeeping.

A parser reads a model's text and says which part is content for the user and which parts
are tool calls. Each parser implements one method, ``parse(text, final)``, returning a
``PartialParse``: the content so far and the calls so far, each with its name (once the name
is complete) and its arguments text so far. Two promises make streaming simple and exact:
as the text grows, the content and every call's arguments only ever grow at their end (each
is a prefix of what it will be), and calls appear in order. ``ToolCallStreamer`` then turns
successive parses into OpenAI's deltas by sending what is new.

On top of ``parse`` the base class gives vLLM's two entry points:
``extract_tool_calls(model_output, request)`` for a finished output and
``extract_tool_calls_streaming(previous_text, current_text, delta_text, ...)`` for a stream,
plus ``finish_streaming(text)`` for the last chunk. Any output that is not a well-formed set of
tool calls is returned as plain content; a parser never raises on a model's output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvserve.server.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from kvserve.server.tool_parsers.partial_json import is_json_object

logger = logging.getLogger("kvserve.server")


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has been generated
    arguments: str  # the arguments text so far: a prefix of the final arguments
    complete: bool = False  # the call's text is closed


@dataclass
class PartialParse:
    content: str = ""  # text for the user so far: a prefix of the final content
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ExtractedToolCallInformation:
    """vLLM's result type: whether tools were called, the calls, the content beside them."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def not_called(text: str) -> ExtractedToolCallInformation:
    return ExtractedToolCallInformation(False, [], text)


def holdback(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``: text
    that must not be sent as content yet, since the next token may complete the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallStreamer:
    """Turns successive ``PartialParse``s of one choice into OpenAI's streaming deltas.

    A call is announced (``id``, ``type``, ``function.name`` and the arguments so far) once
    its name is complete; after that each delta carries the new end of its arguments.
    ``max_calls`` drops the calls after the first ones (``parallel_tool_calls: false``).
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.sent_content = 0  # characters of content sent
        self.sent_args: list[str] = []  # per announced call, the arguments sent

    @property
    def announced(self) -> int:
        return len(self.sent_args)

    def update(self, parse: PartialParse) -> DeltaMessage | None:
        content = parse.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(parse.content))
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(parse.calls):
            if self.max_calls is not None and i >= self.max_calls:
                break
            if i < len(self.sent_args):
                sent = self.sent_args[i]
                new = call.arguments[len(sent) :] if call.arguments.startswith(sent) else ""
                if new:
                    self.sent_args[i] = sent + new
                    deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
            elif call.name is not None:
                self.sent_args.append(call.arguments)
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                )
            else:
                break  # calls are announced in order
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    def finish(self, info: ExtractedToolCallInformation, text: str) -> DeltaMessage | None:
        """The last delta: the rest of the calls if ``info`` found calls, else the text not
        yet sent as content, so that the content adds up to the non-streamed answer's (calls
        already announced cannot be taken back; the finish reason is not ``tool_calls``)."""
        if info.tools_called:
            calls = [
                PartialCall(c.function.name, c.function.arguments, True) for c in info.tool_calls
            ]
            return self.update(PartialParse(info.content or "", calls))
        rest = text[self.sent_content :]
        self.sent_content = len(text)
        return DeltaMessage(content=rest) if rest else None


class ToolParser:
    """Base class of the tool-call parsers; one instance per choice of one request."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any = None, max_calls: int | None = None) -> None:
        self.model_tokenizer = tokenizer
        self.max_calls = max_calls
        self.streamer = ToolCallStreamer(max_calls)

    # -- what a parser implements --------------------------------------------------------------
    def parse(self, text: str, final: bool) -> PartialParse:
        """Content and calls in ``text``. ``final``: the text is complete, so nothing is
        held back in case the next token completes a marker. May raise on malformed text."""
        raise NotImplementedError

    # -- vLLM's interface ----------------------------------------------------------------------
    def extract_tool_calls(
        self, model_output: str, request: Any = None
    ) -> ExtractedToolCallInformation:
        """The tool calls of a finished output, or the whole output as content if it is not
        a well-formed set of calls (each complete, named, with a JSON object of arguments)."""
        try:
            parse = self.parse(model_output, final=True)
        except Exception:
            logger.debug("not a tool call (malformed): %r", model_output[:200])
            return not_called(model_output)
        if not parse.calls:
            return not_called(model_output)
        calls: list[ToolCall] = []
        for call in parse.calls:
            arguments = call.arguments or "{}"
            if not call.complete or call.name is None or not is_json_object(arguments):
                return not_called(model_output)
            calls.append(ToolCall(function=FunctionCall(name=call.name, arguments=arguments)))
        if self.max_calls is not None:
            calls = calls[: self.max_calls]
        return ExtractedToolCallInformation(True, calls, parse.content or None)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        request: Any = None,
    ) -> DeltaMessage | None:
        """The delta to send after the output grew to ``current_text`` (None: nothing yet)."""
        try:
            parse = self.parse(current_text, final=False)
        except Exception:
            return None  # malformed so far: ``finish_streaming`` decides what it was
        return self.streamer.update(parse)

    def finish_streaming(self, text: str) -> tuple[DeltaMessage | None, bool]:
        """The last delta of a stream whose whole output is ``text``, and whether it called
        tools (then the finish reason is ``tool_calls``)."""
        info = self.extract_tool_calls(text)
        return self.streamer.finish(info, text), info.tools_called
