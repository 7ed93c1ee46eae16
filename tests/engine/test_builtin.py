"""The built-in SmolLM2-135M-Instruct through the offline API: chat, sampling, stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(builtin_model_dir: Path) -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=16)


def test_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=30),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>
    assert out.outputs[0].token_ids[-1] == 2


def test_greedy_matches_transformers_on_builtin(llm: LLM, builtin_model_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(builtin_model_dir, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def test_stop_string_cuts_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, stop=["."])
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.text == " Paris"
    assert (out.finish_reason, out.stop_reason) == ("stop", ".")
    params = SamplingParams(
        temperature=0, max_tokens=40, stop=["."], include_stop_str_in_output=True
    )
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.text == " Paris."


def test_detokenize_false_gives_same_ids_and_no_text(llm: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with_text = llm.generate(prompts, params, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
    ids_only = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(with_text, ids_only, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert a.outputs[0].text != "" and b.outputs[0].text == ""


def test_stop_token_ids(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    paris = tok.encode(" Paris")[0]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[paris])
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [paris]
    assert (out.finish_reason, out.stop_reason) == ("stop", paris)


def test_seed_reproducible_alone_or_batched(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    alone = llm.generate("Tell me a story", seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate(
        ["Hello there", "Tell me a story", "Why is the sky blue?"],
        [other, seeded, other],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True)
    assert (
        llm.generate("Tell me a story", different, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


def test_n_completions_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=2, ignore_eos=True)
    out = llm.generate("Hello", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == 6
        tok = llm.get_tokenizer()
        for tok_id, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert next(iter(lp)) == tok_id and 2 <= len(lp) <= 3  # sampled first (vLLM)
            assert all(v.logprob <= 0 for v in lp.values())
            # the top-2 carry ranks 1 and 2; every token its text decoded alone
            assert sorted(v.rank or 0 for v in lp.values())[:2] == [1, 2]
            assert all(v.decoded_token == tok.decode([t]) for t, v in lp.items())
        assert c.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        )
    again = llm.generate("Hello", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_prefix_caching_changes_no_greedy_output(llm: LLM, builtin_model_dir: Path) -> None:
    """Chats one after another share the chat template's system prompt: with caching on they
    reuse its blocks, and every greedy output is what it is with caching off (float32; in
    bf16, SDPA's CPU kernel rounds a row differently with a different number of query rows,
    so outputs may drift, as in vLLM)."""
    questions = ["What is the capital of France?", "Tell me a joke.", "What is your name?",
                 "Who wrote Hamlet?", "Do you like music?", "What is 2 + 2?"]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40)
    off = LLM(dtype="float32", kv_cache_memory="256MiB", enable_prefix_caching=False)
    llm.reset_prefix_cache()
    hits0 = llm.stats()["prefix_cache_hits"]
    for q in questions:
        conv = [{"role": "user", "content": q}]
        (on_out,) = llm.chat(conv, params, use_tqdm=False)
        (off_out,) = off.chat(conv, params, use_tqdm=False)
        assert on_out.outputs[0].token_ids == off_out.outputs[0].token_ids
        assert off_out.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hits"] - hits0 >= 16 * (len(questions) - 1)
