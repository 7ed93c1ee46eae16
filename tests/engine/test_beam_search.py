"""Beam search (``LLM.beam_search``): equal to a brute-force reference on a tiny float32 model,
beams sharing KV blocks (exact ids and ref counts after fork, copy and prune; integrity every
step), the same hypotheses under preemption, width 1 equal to greedy, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve.beam_search import BeamSearchParams, get_beam_search_score
from kvserve.engine.llm import LLM
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import ParamError, SamplingParams
from tests.engine.conftest import TinyModels
from tests.engine.utils import random_prompts

PROMPTS = random_prompts([6, 11], seed=3)
EOS = 1  # the tiny models' EOS

Hypothesis = tuple[list[int], float]  # prompt + output tokens, cumulative logprob


@torch.inference_mode()
def reference_beam_search(
    model: PreTrainedModel,
    prompt: list[int],
    width: int,
    max_tokens: int,
    length_penalty: float,
    eos: int,
    ignore_eos: bool = False,
) -> list[Hypothesis]:
    """vLLM's loop, brute force: every beam's whole sequence through transformers at every
    step, its top 2 * width next tokens from the full log-softmax."""

    def score(h: Hypothesis) -> float:
        return get_beam_search_score(h[0], h[1], [eos], length_penalty)

    beams: list[Hypothesis] = [(list(prompt), 0.0)]
    completed: list[Hypothesis] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two OpenMP threads stall whenever the shared box is busy
    try:
        for _ in range(max_tokens):
            # the live beams all have the same length: one forward for all of them
            logits = model(torch.tensor([t for t, _ in beams])).logits[:, -1].float()  # [B, V]
            values, ids = torch.log_softmax(logits, dim=-1).topk(2 * width)  # [B, 2w] x 2
            new: list[Hypothesis] = []
            for (tokens, cum), row_ids, row_lps in zip(
                beams, ids.tolist(), values.tolist(), strict=True
            ):
                for t, lp in zip(row_ids, row_lps, strict=True):
                    h = ([*tokens, t], cum + lp)
                    (completed if t == eos and not ignore_eos else new).append(h)
            beams = sorted(new, key=score, reverse=True)[:width]
            if not beams:
                break
    finally:
        torch.set_num_threads(threads)
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def llama(tiny_models: TinyModels) -> tuple[Path, PreTrainedModel]:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def eos_model(
    llama: tuple[Path, PreTrainedModel], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, int]:
    """The tiny llama with a likely token as its EOS, so hypotheses do end early: the second
    greedy token of the first prompt (always among the top candidates)."""
    path, model = llama
    with torch.inference_mode():
        first = int(model(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
        eos = int(model(torch.tensor([[*PROMPTS[0], first]])).logits[0, -1].argmax())
    out = tmp_path_factory.mktemp("eos_llama")
    for f in path.iterdir():
        shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out, eos


@pytest.fixture(scope="module")
def llm(eos_model: tuple[Path, int]) -> LLM:
    return LLM(str(eos_model[0]), dtype="float32", block_size=4, num_kv_blocks=200)


@pytest.mark.parametrize(
    ("width", "length_penalty"), [(1, 1.0), (2, 1.0), (4, 1.0), (4, 0.0), (2, 2.0)]
)
def test_equals_brute_force_reference(
    llm: LLM,
    llama: tuple[Path, PreTrainedModel],
    eos_model: tuple[Path, int],
    width: int,
    length_penalty: float,
) -> None:
    params = BeamSearchParams(beam_width=width, max_tokens=7, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ended = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = reference_beam_search(llama[1], prompt, width, 7, length_penalty, eos_model[1])
        assert [s.tokens for s in out.sequences] == [h[0] for h in ref]
        for seq, (_, cum) in zip(out.sequences, ref, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            ended += seq.finish_reason == "stop"
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos_model[1] else "length")
    if width > 1:
        assert ended > 0  # the EOS path is exercised
    assert llm.engine.kv.pool.num_free_blocks == 200  # every beam's blocks came back


def test_width_one_is_greedy(llm: LLM) -> None:
    # length_penalty 0: the score is the cumulative logprob. (With a penalty, vLLM's score
    # shortens a sequence ending in EOS by one even under ignore_eos, so an EOS candidate can
    # rank below a less likely token; this model's EOS is a likely token.)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    params = BeamSearchParams(beam_width=1, max_tokens=9, ignore_eos=True, length_penalty=0.0)
    beams = llm.beam_search(prompts, params)
    for g, b, p in zip(greedy, beams, PROMPTS, strict=True):
        assert b.sequences[0].tokens == p + g.outputs[0].token_ids


def test_forks_share_blocks_and_copy_on_write(eos_model: tuple[Path, int]) -> None:
    """Step by step on a 6-token prompt, block size 4, in a fresh engine (blocks handed out
    from 0): the prompt fills block 0 and half of block 1. The fork shares both; the first
    write into block 1 copies it; prunes free."""
    engine: LLMEngine = LLM(str(eos_model[0]), dtype="float32", block_size=4,
                            num_kv_blocks=16).engine  # fmt: skip
    kv, pool = engine.kv, engine.kv.pool
    copies: list[list[tuple[int, int]]] = []
    execute = engine.executor.execute_model

    def recording(sched):  # the step message as it goes to the runner
        copies.append(list(sched.blocks_to_copy))
        return execute(sched)

    engine.executor.execute_model = recording  # type: ignore[method-assign]
    try:
        req = engine.processor.validate_beam_search(
            PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
        )
        engine.add_validated("b", req)
        group = engine._beam_groups["b"]
        engine.step()  # the prefill: one beam's top candidates give two beams
        a, c = group.beam_ids
        assert (a, c) == ("b#beam0", "b#beam1")
        assert kv.block_ids(a) == kv.block_ids(c) == [0, 1]  # shared, not copied
        assert [pool.ref_count(b) for b in (0, 1)] == [2, 2]
        assert pool.num_used_blocks == 2
        kv.check_integrity()
        engine.step()  # both write position 6, in block 1: the first to write copies it
        assert copies[-1] == [(1, 2)]
        assert pool.ref_count(0) >= 1 and pool.num_used_blocks <= 4
        kv.check_integrity()
        while engine.has_unfinished_requests():
            live = set(group.beam_ids)
            engine.step()
            kv.check_integrity()
            # every block held is held by a live beam, each reference counted once
            held = [b for rid in group.beam_ids for b in kv.block_ids(rid)]
            assert sorted(set(held)) == sorted(
                b for b in range(pool.num_blocks) if not pool.is_free(b)
            )
            assert all(pool.ref_count(b) == held.count(b) for b in set(held))
            assert len(live) <= 2
    finally:
        engine.executor.execute_model = execute  # type: ignore[method-assign]
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_same_hypotheses(llm: LLM, eos_model: tuple[Path, int], mode: str) -> None:
    """A cache too small for two width-4 searches at once: beams are preempted and come
    back, and every hypothesis is the roomy engine's."""
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    roomy = llm.beam_search(prompts, params)
    small = LLM(str(eos_model[0]), dtype="float32", block_size=4, num_kv_blocks=18,
                preemption_mode=mode)  # fmt: skip
    engine = small.engine
    for i, p in enumerate(prompts):
        engine.add_validated(str(i), engine.processor.validate_beam_search(
            p["prompt_token_ids"], params))  # fmt: skip
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        engine.kv.check_integrity()
    assert engine.stats()["num_preemptions"] > 0
    for i, r in enumerate(roomy):
        got = done[str(i)].outputs
        assert [PROMPTS[i] + c.token_ids for c in got] == [s.tokens for s in r.sequences]
        assert [c.cumulative_logprob for c in got] == pytest.approx(
            [s.cum_logprob for s in r.sequences], abs=1e-4
        )
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_limits(llm: LLM) -> None:
    with pytest.raises(ParamError, match="max_beam_width, --max-beam-width"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=17, max_tokens=4))
    with pytest.raises(ValueError, match=r"beam_width 16 and 300 output tokens .* 200"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=16, max_tokens=300))
    reserve = LLM(str(llm.engine.config.model.path), dtype="float32", block_size=4,
                  num_kv_blocks=32, kv_policy="reserve")  # fmt: skip
    with pytest.raises(ValueError, match=r"beam search needs kv_policy 'preempt'"):
        reserve.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ParamError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ParamError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
