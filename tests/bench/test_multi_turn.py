"""The multi_turn workload: conversations, their turn-by-turn replay and its results.

The fake server answers request i with "ans-i." so that the history each turn sends can be
checked against what the server really said. The byte tokenizer makes every length exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from kvserve.bench import serve
from kvserve.bench.cli import main
from kvserve.bench.client import RequestInput, RequestRecord
from kvserve.bench.datasets import get_samples, load_chatterbot_dialogues
from kvserve.bench.multi_turn import (
    Conversation,
    chat_prompt_len,
    chatterbot_conversations,
    input_factory,
    run_conversations,
    synthetic_conversations,
)
from kvserve.bench.report import format_summary


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_synthetic_conversations_lengths(byte_tokenizer) -> None:
    convs = synthetic_conversations(
        3, byte_tokenizer, num_turns=4, system_prompt_len=20, user_len=10, output_len=7, seed=1
    )
    assert [c.conv_id for c in convs] == [0, 1, 2]
    system = convs[0].system_prompt
    assert system is not None and len(system.encode()) == 20
    for c in convs:
        assert c.system_prompt == system  # one application prompt shared by all
        assert [len(t.encode()) for t in c.user_turns] == [10] * 4
        assert c.output_lens == [7] * 4
    assert len({t for c in convs for t in c.user_turns}) == 12  # no two turns alike
    no_system = synthetic_conversations(1, byte_tokenizer, num_turns=2, system_prompt_len=0)
    assert no_system[0].system_prompt is None
    again = synthetic_conversations(
        3, byte_tokenizer, num_turns=4, system_prompt_len=20, user_len=10, output_len=7, seed=1
    )
    assert again == convs  # seeded


def test_chatterbot_conversations_alternate_lines(byte_tokenizer) -> None:
    dialogues = [d for d in load_chatterbot_dialogues() if len(d) >= 3]
    assert len(dialogues) == 79  # the corpus's conversations with two user turns or more
    convs = chatterbot_conversations(79, byte_tokenizer, output_len=12, seed=3)
    by_first = {d[0]: d for d in dialogues}
    for c in convs:
        lines = by_first[c.user_turns[0]]
        assert c.user_turns == lines[0::2] and len(c.user_turns) >= 2
        assert c.reference_answers[: len(lines[1::2])] == lines[1::2]
        assert c.output_lens == [12] * len(c.user_turns) and c.system_prompt is None
    capped = chatterbot_conversations(5, byte_tokenizer, max_turns=2, seed=3)
    assert [len(c.user_turns) for c in capped] == [2] * 5
    assert [c.user_turns for c in capped] == [c.user_turns[:2] for c in convs[:5]]
    with pytest.warns(UserWarning, match="repeating"):
        more = chatterbot_conversations(81, byte_tokenizer, seed=3)
    assert len(more) == 81 and [c.conv_id for c in more] == list(range(81))


def test_messages_for_puts_answers_between_user_turns() -> None:
    conv = Conversation(0, ["u0", "u1", "u2"], [5, 5, 5], system_prompt="sys")
    assert conv.messages_for(0, []) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u0"},
    ]
    assert conv.messages_for(2, ["a0", "a1"]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    with pytest.raises(ValueError, match="needs 2 earlier answers"):
        conv.messages_for(2, ["a0"])


def test_chat_prompt_len_uses_the_chat_template(byte_tokenizer) -> None:
    msgs = [{"role": "system", "content": "abc"}, {"role": "user", "content": "hello"}]
    assert chat_prompt_len(byte_tokenizer, msgs) == 8  # no template: the contents' bytes
    templated = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer.backend_tokenizer)
    templated.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    # "<system>abc<user>hello<assistant>": 8 + 3 + 6 + 5 + 11 bytes.
    assert chat_prompt_len(templated, msgs) == 33
    assert chat_prompt_len(None, msgs) == 0


async def test_runner_turns_are_sequential_and_a_failure_ends_the_conversation() -> None:
    convs = [Conversation(i, [f"c{i}t{k}" for k in range(3)], [4, 4, 4]) for i in range(3)]
    sent: list[list[dict[str, str]]] = []
    in_flight, peak = 0, 0

    async def send(inp: RequestInput) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        assert inp.chat_messages is not None
        sent.append(inp.chat_messages)
        number = len(sent) - 1
        await asyncio.sleep(0.005)  # in flight for a while, so that overlap would show
        in_flight -= 1
        if inp.chat_messages[-1]["content"] == "c1t1":  # conversation 1 fails at turn 2
            return RequestRecord(error="HTTP 500")
        return RequestRecord(success=True, generated_text=f"a{number}")

    template = RequestInput("http://x", "m", "", 0, 0)
    make = input_factory(template, None, None)
    result = await run_conversations(convs, send, make, [0.0] * 3, max_concurrency=1)
    assert peak == 1
    # One at a time: conversation 0's three turns, conversation 1's two, then conversation 2.
    assert [m[-1]["content"] for m in sent] == ["c0t0", "c0t1", "c0t2", "c1t0", "c1t1", "c2t0",
                                                "c2t1", "c2t2"]  # fmt: skip
    assert [m["content"] for m in sent[2] if m["role"] == "assistant"] == ["a0", "a1"]
    assert [m["content"] for m in sent[7] if m["role"] == "assistant"] == ["a5", "a6"]
    assert len(result.records) == 9 and result.conversation_ids == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert result.turn_indices == [0, 1, 2] * 3
    assert [r.success for r in result.records] == [True] * 4 + [False, False] + [True] * 3
    assert result.records[5].error == "not sent: an earlier turn of conversation 1 failed."
    assert result.records[4].error == "HTTP 500"
    # Conversations 1 and 2 waited for the one slot; that wait is their first turn's.
    assert result.records[3].queue_time >= 0.015 and result.records[6].queue_time >= 0.025
    assert result.records[4].queue_time == 0.0

    sent.clear()
    free = await run_conversations(convs, send, make, [0.0] * 3)
    assert peak == 3 and len(sent) == 8 and len(free.records) == 9
    capped = input_factory(template, None, 9)(convs[0], 1, [{"role": "user", "content": "x"}])
    assert (capped.max_tokens, capped.expected_output_len, capped.prompt) == (9, 4, "x")


def _history_checks(fake_server: Any) -> dict[str, list[int]]:
    """Check every body against the server's earlier answers; return each conversation's
    request numbers (keyed by its first user turn)."""
    by_conv: dict[str, list[int]] = {}
    for number, body in enumerate(fake_server.bodies):
        msgs = body["messages"]
        users = [m["content"] for m in msgs if m["role"] == "user"]
        assistants = [m["content"] for m in msgs if m["role"] == "assistant"]
        earlier = by_conv.setdefault(users[0], [])
        # Turn k holds the k answers the server gave to this conversation's earlier turns.
        assert assistants == [fake_server.answers[i] for i in earlier]
        assert len(users) == len(earlier) + 1
        assert [m["role"] for m in msgs][-1] == "user"
        earlier.append(number)
    return by_conv


async def test_bench_serve_multi_turn_against_the_fake_server(
    fake_server, byte_tokenizer_dir: Path
) -> None:
    fake_server.unique_answers = True
    fake_server.delays = [0.02, 0.01, 0.01]
    fake_server.cache_queries_per_request, fake_server.cache_hits_per_request = 200, 150
    args = _args(
        "--base-url", fake_server.base_url, "--dataset-name", "multi_turn",
        "--multi-turn-num-conversations", "3", "--multi-turn-num-turns", "4",
        "--multi-turn-user-len", "10", "--multi-turn-system-prompt-len", "20",
        "--multi-turn-output-len", "6", "--max-concurrency", "2", "--tokenizer",
        str(byte_tokenizer_dir), "--disable-tqdm", "--save-detailed",
        "--metrics-interval", "0.05",
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    assert args.backend == "openai-chat"
    result = await serve.benchmark(args, samples, tokenizer)
    assert len(fake_server.bodies) == 12  # 3 conversations x 4 turns, nothing else
    by_conv = _history_checks(fake_server)
    assert sorted(len(v) for v in by_conv.values()) == [4, 4, 4]
    for body in fake_server.bodies:
        system = body["messages"][0]
        assert system["role"] == "system" and len(system["content"].encode()) == 20
        assert body["ignore_eos"] is True and body["max_completion_tokens"] == 6
    assert (result["completed"], result["failed"], result["num_prompts"]) == (12, 0, 12)
    assert result["num_conversations"] == 3 and result["max_concurrent_requests"] == 2
    assert result["dataset_name"] == "multi_turn" and result["backend"] == "openai-chat"
    assert [t["turn"] for t in result["turns"]] == [1, 2, 3, 4]
    assert [t["completed"] for t in result["turns"]] == [3, 3, 3, 3]
    assert result["conversation_ids"] == [0] * 4 + [1] * 4 + [2] * 4
    assert result["turn_indices"] == [0, 1, 2, 3] * 3
    # The generated texts are the server's answers, and turn k+1 starts after turn k ended.
    assert sorted(result["generated_texts"]) == sorted(fake_server.answers)
    starts, lats = result["start_times"], result["latencies"]
    for i in range(12):
        if result["turn_indices"][i] > 0:
            assert starts[i] >= starts[i - 1] + lats[i - 1]
    assert (result["prefix_cache_queries"], result["prefix_cache_hits"]) == (2400, 1800)
    assert result["prefix_cache_hit_rate"] == 0.75
    summary = format_summary(result)
    assert "Per turn (3 conversations)" in summary
    assert "Prefix cache hit rate (%):" in summary


async def test_multi_turn_failed_turn_ends_its_conversation(
    fake_server, byte_tokenizer_dir: Path
) -> None:
    fake_server.unique_answers = True
    fake_server.delays = [0.0, 0.0, 0.0]
    fake_server.fail_requests = {1}  # the second request: turn 2 of the only conversation
    args = _args(
        "--base-url", fake_server.base_url, "--dataset-name", "multi_turn",
        "--multi-turn-num-conversations", "1", "--multi-turn-num-turns", "4",
        "--multi-turn-user-len", "5", "--tokenizer", str(byte_tokenizer_dir), "--disable-tqdm",
        "--save-detailed", "--no-server-metrics",
    )  # fmt: skip
    samples, tokenizer = serve.prepare(args)
    result = await serve.benchmark(args, samples, tokenizer)
    assert len(fake_server.bodies) == 2
    assert (result["completed"], result["failed"], result["num_prompts"]) == (1, 3, 4)
    assert result["errors"][1].startswith("HTTP 500")
    assert result["errors"][2:] == ["not sent: an earlier turn of conversation 0 failed."] * 2
    assert [t["completed"] for t in result["turns"]] == [1, 0, 0, 0]


def test_cli_multi_turn_chatterbot_saves_turns(threaded_fake_server, byte_tokenizer_dir, tmp_path):
    threaded_fake_server.unique_answers = True
    code = main(
        ["serve", "--base-url", threaded_fake_server.base_url, "--dataset-name", "multi-turn",
         "--multi-turn-source", "chatterbot", "--multi-turn-num-conversations", "4",
         "--multi-turn-num-turns", "2", "--tokenizer", str(byte_tokenizer_dir),
         "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "mt.json"]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((tmp_path / "mt.json").read_text())
    assert saved["completed"] == 8 and saved["num_conversations"] == 4
    assert [t["completed"] for t in saved["turns"]] == [4, 4]
    assert "conversation_ids" not in saved  # per-request lists only with --save-detailed
    bodies = threaded_fake_server.bodies
    assert len(bodies) == 8 and all("ignore_eos" not in b for b in bodies)  # until EOS
    assert all(b["max_tokens"] == 64 for b in bodies)  # the default output length, a cap


def test_multi_turn_needs_the_chat_backend(byte_tokenizer_dir, capsys) -> None:
    argv = ["serve", "--dataset-name", "multi_turn", "--backend", "openai", "--tokenizer",
            str(byte_tokenizer_dir)]  # fmt: skip
    assert main(argv) == 2
    assert "needs --backend openai-chat" in capsys.readouterr().err
    args = _args("--dataset-name", "multi_turn", "--tokenizer", str(byte_tokenizer_dir))
    with pytest.raises(ValueError, match="use bench serve"):
        get_samples(args, None)
