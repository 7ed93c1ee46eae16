"""Multi-turn chat workload: conversations replayed turn by turn against a chat endpoint.

Modelled on vLLM's ``benchmarks/multi_turn``: turn k of a conversation sends the whole history
(system prompt, the user turns before it *and the server's own answers to them*) plus the new
user turn, so a server with a prefix cache can reuse the KV of everything but the new turn.
The turns of one conversation are sequential (turn k+1 needs turn k's answer); up to
``--max-concurrency`` conversations are in flight at once, each starting at its arrival time
(``--request-rate``, ``--burstiness``), so the cap is both conversations and requests in flight.

Conversations come from the packaged chatterbot corpus (its conversations with two user turns
or more; lines alternate user / bot and the bot lines are only reference answers) or are
synthetic: ``--multi-turn-num-turns`` user turns of ``--multi-turn-user-len`` random tokens
after a ``--multi-turn-system-prompt-len``-token system prompt shared by every conversation.
A turn that fails ends its conversation: the turns after it are recorded as failed, unsent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvserve.bench.client import RequestInput, RequestRecord
from kvserve.bench.datasets import count_tokens, fill_to, load_chatterbot_dialogues
from kvserve.bench.metrics import summarize
from kvserve.bench.runner import RunResult, SendFunc, launch_at
from kvserve.bench.synthetic import allowed_token_ids, random_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_NUM_TURNS = 5
DEFAULT_USER_LEN = 128
DEFAULT_OUTPUT_LEN = 64
DEFAULT_SYSTEM_PROMPT_LEN = 0
SOURCES = ("synthetic", "chatterbot")
Messages = list[dict[str, str]]
MakeInput = Callable[["Conversation", int, Messages], RequestInput]


@dataclass
class Conversation:
    """The user side of one conversation; the assistant side comes from the server."""

    conv_id: int
    user_turns: list[str]
    output_lens: list[int]  # max_tokens of each turn (exact with ignore_eos)
    system_prompt: str | None = None
    reference_answers: list[str | None] = field(default_factory=list)

    def messages_for(self, turn: int, answers: Sequence[str]) -> Messages:
        """What turn ``turn`` (0-based) sends: the history with the server's ``answers``."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}.")
        messages: Messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        for k in range(turn):
            messages.append({"role": "user", "content": self.user_turns[k]})
            messages.append({"role": "assistant", "content": answers[k]})
        messages.append({"role": "user", "content": self.user_turns[turn]})
        return messages


def synthetic_conversations(
    num_conversations: int,
    tokenizer: PreTrainedTokenizerBase,
    num_turns: int = DEFAULT_NUM_TURNS,
    system_prompt_len: int = DEFAULT_SYSTEM_PROMPT_LEN,
    user_len: int = DEFAULT_USER_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    seed: int = 0,
) -> list[Conversation]:
    """Random-token conversations: one system prompt shared by all (an application's), then
    ``num_turns`` user turns of ``user_len`` tokens, each asking for ``output_len`` tokens."""
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("multi_turn needs at least one conversation and one turn.")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer)
    system = random_text(tokenizer, system_prompt_len, rng, allowed) or None
    return [
        Conversation(
            conv_id=c,
            user_turns=[random_text(tokenizer, user_len, rng, allowed) for _ in range(num_turns)],
            output_lens=[output_len] * num_turns,
            system_prompt=system,
        )
        for c in range(num_conversations)
    ]


def chatterbot_conversations(
    num_conversations: int,
    tokenizer: PreTrainedTokenizerBase,
    max_turns: int | None = None,
    system_prompt_len: int = DEFAULT_SYSTEM_PROMPT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    seed: int = 0,
    oversample: bool = True,
) -> list[Conversation]:
    """The chatterbot conversations with at least two user turns (79 in the corpus), shuffled
    with ``seed``; the even lines are the user turns, at most ``max_turns`` of them."""
    rng = random.Random(seed)
    dialogues = [d for d in load_chatterbot_dialogues() if len(d) >= 3]
    rng.shuffle(dialogues)
    np_rng = np.random.default_rng(seed)
    system = random_text(tokenizer, system_prompt_len, np_rng, allowed_token_ids(tokenizer))
    convs = []
    for lines in dialogues[:num_conversations]:
        users = lines[0::2][:max_turns] if max_turns else lines[0::2]
        answers: list[str | None] = list(lines[1::2][: len(users)])
        answers += [None] * (len(users) - len(answers))
        convs.append(
            Conversation(len(convs), users, [output_len] * len(users), system or None, answers)
        )
    convs = fill_to(convs, num_conversations, rng, oversample, "multi_turn chatterbot")
    # Repeats get their own ids: results are grouped by conversation id.
    return [dataclasses.replace(c, conv_id=i) for i, c in enumerate(convs)]


def chat_prompt_len(tokenizer: PreTrainedTokenizerBase | None, messages: Messages) -> int:
    """Prompt tokens of ``messages`` with the tokenizer's chat template (what the server
    sees), else the plain tokens of the contents; the server's ``usage`` overrides it."""
    if tokenizer is None:
        return 0
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5: BatchEncoding
            ids = ids["input_ids"]
        return len(ids)
    return sum(count_tokens(tokenizer, m["content"]) for m in messages)


def input_factory(
    template: RequestInput, tokenizer: PreTrainedTokenizerBase | None, max_tokens: int | None
) -> MakeInput:
    """Turn requests from ``template`` (URL, model, headers, sampling...): the messages so
    far, their prompt length, and ``max_tokens`` or the turn's own output length."""

    def make(conv: Conversation, turn: int, messages: Messages) -> RequestInput:
        return dataclasses.replace(
            template,
            prompt=messages[-1]["content"],
            prompt_len=chat_prompt_len(tokenizer, messages),
            chat_messages=messages,
            max_tokens=max_tokens or conv.output_lens[turn],
            expected_output_len=conv.output_lens[turn],
        )

    return make


@dataclass
class ConversationRunResult(RunResult):
    """Records in conversation order, then turn order, with where each came from."""

    conversation_ids: list[int]
    turn_indices: list[int]  # 0-based


def _unsent(conv: Conversation, turn: int) -> RequestRecord:
    return RequestRecord(
        error=f"not sent: an earlier turn of conversation {conv.conv_id} failed.",
        expected_output_len=conv.output_lens[turn],
    )


async def run_conversations(
    conversations: Sequence[Conversation],
    send: SendFunc,
    make_input: MakeInput,
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> ConversationRunResult:
    """Start conversation ``i`` at ``offsets[i]`` s (at most ``max_concurrency`` at once; the
    wait is the first turn's ``queue_time``) and play its turns one after the other, each
    sending the server's earlier answers back as assistant messages."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be positive, got {max_concurrency}.")
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    )

    def done(record: RequestRecord) -> RequestRecord:
        if on_done is not None:
            on_done(record)
        return record

    async def play(conv: Conversation) -> list[RequestRecord]:
        arrived = time.perf_counter()
        records: list[RequestRecord] = []
        async with slots:
            queued = time.perf_counter() - arrived
            answers: list[str] = []
            for turn in range(len(conv.user_turns)):
                inp = make_input(conv, turn, conv.messages_for(turn, answers))
                record = done(await send(inp))
                records.append(record)
                if not record.success:
                    break
                answers.append(record.generated_text)
        records[0].queue_time = queued
        records += [done(_unsent(conv, t)) for t in range(len(records), len(conv.user_turns))]
        return records

    per_conv, duration, max_lag = await launch_at(conversations, play, offsets)
    records = [r for recs in per_conv for r in recs]
    conv_ids = [c.conv_id for c, recs in zip(conversations, per_conv, strict=True) for _ in recs]
    turns = [t for recs in per_conv for t in range(len(recs))]
    return ConversationRunResult(records, duration, max_lag, conv_ids, turns)


def turn_stats(
    records: Sequence[RequestRecord], turn_indices: Sequence[int]
) -> list[dict[str, Any]]:
    """Per turn number (1-based): completed requests, mean prompt tokens, mean cached tokens
    (when the server reports them) and TTFT statistics, in ms. Without a prefix cache TTFT
    grows with the history; with one it should stay near the first turn's."""
    out = []
    for turn in sorted(set(turn_indices)):
        ok = [r for r, t in zip(records, turn_indices, strict=True) if t == turn and r.success]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        ttft = summarize([r.ttft for r in ok], "ttft", [99.0])
        out.append(
            {
                "turn": turn + 1,
                "completed": len(ok),
                "mean_input_tokens": float(np.mean([r.prompt_len for r in ok])) if ok else None,
                "mean_cached_tokens": float(np.mean(cached)) if cached else None,
                "mean_ttft_ms": ttft["mean_ttft_ms"],
                "median_ttft_ms": ttft["median_ttft_ms"],
                "p99_ttft_ms": ttft["p99_ttft_ms"],
            }
        )
    return out


def get_conversations(args: Any, tokenizer: PreTrainedTokenizerBase) -> list[Conversation]:
    """Build the ``multi_turn`` workload from parsed ``bench serve`` arguments."""
    n = args.multi_turn_num_conversations or args.num_prompts
    if args.multi_turn_source == "chatterbot":
        return chatterbot_conversations(
            n,
            tokenizer,
            max_turns=args.multi_turn_num_turns,
            system_prompt_len=args.multi_turn_system_prompt_len,
            output_len=args.multi_turn_output_len,
            seed=args.seed,
            oversample=not args.no_oversample,
        )
    return synthetic_conversations(
        n,
        tokenizer,
        num_turns=args.multi_turn_num_turns or DEFAULT_NUM_TURNS,
        system_prompt_len=args.multi_turn_system_prompt_len,
        user_len=args.multi_turn_user_len,
        output_len=args.multi_turn_output_len,
        seed=args.seed,
    )
