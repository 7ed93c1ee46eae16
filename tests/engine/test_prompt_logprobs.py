"""Logprobs as vLLM's ``Logprob`` objects, and ``prompt_logprobs``, against transformers'
float32 logits on the tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import Logprob, RequestOutput
from tests.engine.conftest import TinyModels
from tests.engine.utils import random_prompts

LENGTHS = [1, 2, 7, 20, 33]
TOP = 3


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]`` float32 log_softmax of transformers' logits (row p predicts p + 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    return torch.log_softmax(logits.float(), dim=-1)


def expected_rank(row: torch.Tensor, token: int) -> int:
    """vLLM's rank: how many tokens are at least as likely as ``token``."""
    return int((row >= row[token]).sum())


def check_position(entry: dict[int, Logprob], row: torch.Tensor, token: int, k: int) -> None:
    """One position's dict: the chosen token first, then the top-k in torch's order."""
    top_v, top_i = row.topk(k)
    assert next(iter(entry)) == token
    want = [token] + [t for t in top_i.tolist() if t != token]
    assert list(entry) == want
    if token not in top_i.tolist():
        assert entry[token].rank == expected_rank(row, token)
    for r, (v, t) in enumerate(zip(top_v.tolist(), top_i.tolist(), strict=True)):
        assert entry[t].rank == r + 1
        assert entry[t].logprob == pytest.approx(v, abs=2e-5)
    assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-5)
    assert entry[token].rank == expected_rank(row, token)
    assert all(lp.decoded_token is None for lp in entry.values())  # no tokenizer


def check_prompt_logprobs(out: RequestOutput, ref: torch.Tensor, k: int) -> None:
    prompt = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt)
    assert lps[0] is None
    for j in range(1, len(prompt)):
        entry = lps[j]
        assert entry is not None
        check_position(entry, ref[j - 1], prompt[j], k)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("block_size", "max_batched"), [(16, 2048), (4, 8)])
def test_prompt_and_sample_logprobs_match_transformers(
    tiny_models: TinyModels, arch: str, block_size: int, max_batched: int
) -> None:
    """(4, 8) chunks every prompt over several steps, beside other requests' decodes."""
    path, hf_model = tiny_models[arch]
    prompts = random_prompts(LENGTHS)
    llm = LLM(
        str(path),
        dtype="float32",
        num_kv_blocks=128,
        block_size=block_size,
        max_num_batched_tokens=max_batched,
    )
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=TOP
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt + c.token_ids)  # [P + 4, V]
        check_prompt_logprobs(out, ref, TOP)
        # Generated tokens: greedy, so each is rank 1, and its position's top-2 follows it.
        assert c.logprobs is not None and len(c.logprobs) == 4
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert entry[tok].rank == 1
            check_position(entry, ref[len(prompt) - 1 + i], tok, 2)
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
        )


def test_zero_top_and_sampled_ranks(tiny_models: TinyModels) -> None:
    """prompt_logprobs=0 gives the prompt's token alone; a sampled token's rank is exact."""
    path, hf_model = tiny_models["llama"]
    (prompt,) = random_prompts([9], seed=3)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(
        temperature=1.5, seed=7, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    c = out.outputs[0]
    ref = hf_logprobs(hf_model, prompt + c.token_ids)
    assert out.prompt_logprobs is not None
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert entry is not None and list(entry) == [prompt[j]]
        assert entry[prompt[j]].rank == expected_rank(ref[j - 1], prompt[j])
    assert c.logprobs is not None
    ranks = []
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert list(entry) == [tok]
        assert entry[tok].rank == expected_rank(ref[len(prompt) - 1 + i], tok)
        ranks.append(entry[tok].rank)
    assert max(ranks) > 1  # temperature 1.5 on a random model: not every token is the argmax


def test_no_prompt_logprobs_unless_asked(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    (out,) = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(tiny_models: TinyModels) -> None:
    """A prompt whose blocks are cached is computed again when prompt logprobs are asked:
    the second identical request gets every position, equal to the first."""
    path, hf_model = tiny_models["llama"]
    (prompt,) = random_prompts([26], seed=5)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4)
    assert llm.engine.kv.enable_caching
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    ref = hf_logprobs(hf_model, prompt)
    check_prompt_logprobs(first, ref, 2)
    check_prompt_logprobs(second, ref, 2)
    plain = SamplingParams(temperature=0, max_tokens=2)
    third = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
    assert third.num_cached_tokens == 24  # the others still hit the cache (6 whole blocks)
    assert third.outputs[0].token_ids == second.outputs[0].token_ids


def test_n_siblings_report_prompt_logprobs_once(tiny_models: TinyModels) -> None:
    path, hf_model = tiny_models["llama"]
    (prompt,) = random_prompts([11], seed=2)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(n=3, seed=1, max_tokens=3, prompt_logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(out.outputs) == 3
    check_prompt_logprobs(out, hf_logprobs(hf_model, prompt), 1)


def test_preemption_by_recompute_adds_nothing_twice(tiny_llama: Path) -> None:
    """A cache too small for the batch preempts requests (some in the middle of a chunked
    prompt); recomputing them must not add prompt logprobs again or change them."""
    prompts = random_prompts([3, 7, 12, 5, 20, 9, 1, 15])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)

    def run(num_blocks: int) -> tuple[dict[str, RequestOutput], int]:
        e = LLMEngine(
            build_engine_config(
                str(tiny_llama),
                dtype="float32",
                block_size=4,
                num_kv_blocks=num_blocks,
                max_num_batched_tokens=8,
            )
        )
        for i, p in enumerate(prompts):
            e.add_request(str(i), {"prompt_token_ids": p}, params)
        done = {}
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out
            e.kv.check_integrity()
        return done, e.stats()["num_preemptions"]

    roomy, none = run(200)
    tight, some = run(14)
    assert none == 0 and some > 0
    for rid, out in tight.items():
        assert out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(prompts[int(rid)])
        want = roomy[rid].prompt_logprobs
        assert want is not None
        assert out.prompt_logprobs[0] is None and want[0] is None
        for got, ref in zip(out.prompt_logprobs[1:], want[1:], strict=True):
            # Other batches group the attention differently: equal up to float rounding.
            assert got is not None and ref is not None and list(got) == list(ref)
            assert [lp.rank for lp in got.values()] == [lp.rank for lp in ref.values()]
            assert [lp.logprob for lp in got.values()] == pytest.approx(
                [lp.logprob for lp in ref.values()], abs=1e-5
            )
        assert out.outputs[0].token_ids == roomy[rid].outputs[0].token_ids


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_prompt_logprobs_validated_like_logprobs(bad: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
