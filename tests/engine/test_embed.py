"""``LLM.embed``: embeddings equal a reference pooling of transformers' final hidden states
(float32, the tiny random Llama and Qwen2), through chunked prefill, the prefix cache,
preemption and batches shared with generation requests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine, QueueFullError
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from tests.engine.conftest import TinyModels
from tests.engine.utils import TINY, random_prompts

LENGTHS = [1, 2, 7, 20, 33]
HIDDEN = TINY["hidden_size"]
TOL = 2e-5  # float32: kvserve's and transformers' kernels sum in different orders


def hf_hidden(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states ``[len(ids), H]``: ``hidden_states[-1]`` is after
    the model's final norm (``test_hidden_states_last_is_after_the_final_norm``)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def reference(model: Any, ids: list[int], pooling: str, normalize: bool = True) -> list[float]:
    h = hf_hidden(model, ids).float()
    vec = h[-1] if pooling == "last" else h.mean(dim=0)
    return (F.normalize(vec, dim=-1) if normalize else vec).tolist()


def check(out: EmbeddingRequestOutput, model: Any, ids: list[int], pooling: str) -> None:
    assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.error is None
    assert out.prompt_token_ids == ids
    emb = out.outputs.embedding
    assert len(emb) == out.outputs.hidden_size == HIDDEN
    assert emb == pytest.approx(reference(model, ids, pooling), abs=TOL)
    assert sum(x * x for x in emb) == pytest.approx(1.0, abs=1e-5)


def embed_ids(llm: LLM, prompts: list[list[int]], **kw: Any) -> list[EmbeddingRequestOutput]:
    return llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kw)


def assert_idle(llm: LLM) -> None:
    """Nothing leaks: every block free, no partial mean sum left in the runner."""
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert len(llm.engine.runner.pooler) == 0
    assert stats["num_generation_tokens"] == 0  # an embedding request never samples


def test_hidden_states_last_is_after_the_final_norm(tiny_models: TinyModels) -> None:
    for arch in ("llama", "qwen2"):
        model = tiny_models[arch][1]
        ids = torch.tensor([random_prompts([9])[0]])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
            last = model.model(ids).last_hidden_state  # the decoder stack, norm included
        assert torch.equal(out.hidden_states[-1], last)
        assert torch.allclose(model.lm_head(out.hidden_states[-1]), out.logits, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize(("block_size", "max_batched"), [(16, 2048), (4, 8)])
def test_embed_matches_transformers(
    tiny_models: TinyModels, arch: str, pooling: str, block_size: int, max_batched: int
) -> None:
    """(4, 8): every prompt longer than 8 tokens is prefilled over several steps."""
    path, model = tiny_models[arch]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=block_size,
              max_num_batched_tokens=max_batched, pooling=pooling)  # fmt: skip
    prompts = random_prompts(LENGTHS)
    outs = embed_ids(llm, prompts)
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs, strict=True):
        check(out, model, ids, pooling)
    assert_idle(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_normalize_off_returns_the_raw_pooled_state(tiny_models: TinyModels, pooling: str) -> None:
    path, model = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8,
              block_size=4, pooling=pooling)  # fmt: skip
    ids = random_prompts([19])[0]
    (out,) = embed_ids(llm, [ids], pooling_params=PoolingParams(normalize=False))
    want = reference(model, ids, pooling, normalize=False)
    assert out.outputs.embedding == pytest.approx(want, abs=TOL)
    assert abs(sum(x * x for x in want) - 1.0) > 0.1  # so the test can tell the difference


SYSTEM = random_prompts([24], seed=9)[0]  # a shared prefix: 6 blocks of 4
SHARED = [SYSTEM + t for t in random_prompts([5, 1, 9], seed=10)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_cache_hits_only_where_pooling_allows(tiny_models: TinyModels, pooling: str) -> None:
    """Last pooling takes cache hits (the last position is always computed); mean pooling
    needs every position's hidden state, so it skips the cache."""
    path, model = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, pooling=pooling)
    (first,) = embed_ids(llm, SHARED[:1])
    outs = embed_ids(llm, SHARED)  # the prefix's blocks are cached (free) by now
    check(first, model, SHARED[0], pooling)
    assert first.num_cached_tokens == 0
    for ids, out in zip(SHARED, outs, strict=True):
        check(out, model, ids, pooling)
    cached = [o.num_cached_tokens for o in outs]
    if pooling == "last":
        assert cached[0] == 28  # its own 7 full blocks (never the last token)
        assert cached[1:] == [24, 24]  # the shared prefix's 6 blocks
    else:
        assert cached == [0, 0, 0] and llm.stats()["prefix_cache_hits"] == 0
    assert_idle(llm)


def test_generation_in_the_same_batch_is_unchanged(tiny_models: TinyModels) -> None:
    path, model = tiny_models["qwen2"]
    gen_prompts = random_prompts([3, 11, 6], seed=3)
    emb_prompts = random_prompts([30, 2, 17], seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def engine() -> LLMEngine:
        return LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4,
                                             num_kv_blocks=96, max_num_batched_tokens=10,
                                             pooling="mean"))  # fmt: skip

    alone = engine()
    for i, p in enumerate(gen_prompts):
        alone.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
    expected = run(alone)
    mixed = engine()
    kinds: list[set[bool]] = []  # per step: embedding (True) / generation (False) rows
    execute = mixed.runner.execute

    def recording(sched: Any, swap: bool = True) -> Any:
        kinds.append({r.pooling is not None for r in sched.scheduled})
        return execute(sched, swap)

    mixed.runner.execute = recording  # type: ignore[method-assign]
    for i, p in enumerate(gen_prompts):
        mixed.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
        mixed.add_request(f"e{i}", {"prompt_token_ids": emb_prompts[i]}, PoolingParams())
    got = run(mixed)
    assert sum(k == {True, False} for k in kinds) >= 3  # steps that mixed both kinds
    for i, p in enumerate(emb_prompts):
        out = got.pop(f"e{i}")
        assert isinstance(out, EmbeddingRequestOutput)
        check(out, model, p, "mean")
    assert tokens(got) == tokens(expected) and len(got) == len(gen_prompts)
    assert mixed.stats()["num_generation_tokens"] == 12 * len(gen_prompts)


def tokens(outs: dict[str, RequestOutput | EmbeddingRequestOutput]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rid, o in outs.items():
        assert isinstance(o, RequestOutput)
        out[rid] = o.outputs[0].token_ids
    return out


def run(engine: LLMEngine) -> dict[str, RequestOutput | EmbeddingRequestOutput]:
    """Step to the end, checking KV integrity each step; each request's one final output."""
    done: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in done  # nothing after the final output
            if out.finished:
                done[out.request_id] = out
            else:
                assert isinstance(out, RequestOutput)  # an embedding has one output
        engine.kv.check_integrity()
    return done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_preempted_mid_prefill_still_pools_right(
    tiny_models: TinyModels, mode: str, pooling: str
) -> None:
    """2 tokens a step and 14 blocks: the generation request (older) outgrows the cache while
    the 40-token embedding prompt is still being prefilled, preempting it (recompute: its mean
    sum restarts from position 0; swap: it resumes with its sum)."""
    path, model = tiny_models["llama"]
    engine = LLMEngine(build_engine_config(str(path), dtype="float32", block_size=4,
                                           num_kv_blocks=14, max_num_batched_tokens=2,
                                           preemption_mode=mode, pooling=pooling))  # fmt: skip
    gen, emb = random_prompts([4, 40], seed=5)
    engine.add_request("g", {"prompt_token_ids": gen},
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))  # fmt: skip
    engine.add_request("e", {"prompt_token_ids": emb}, PoolingParams())
    done = run(engine)
    out = done["e"]
    assert isinstance(out, EmbeddingRequestOutput)
    assert out.metrics is not None and out.metrics.num_preemptions > 0
    check(out, model, emb, pooling)
    assert len(engine.runner.pooler) == 0


def test_validation(tiny_models: TinyModels) -> None:
    path, model = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=40)
    with pytest.raises(ValueError, match="empty"):
        llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        embed_ids(llm, [[5, 256]])
    with pytest.raises(ValueError, match=r"dimensions is 32 .* 64") as e:
        embed_ids(llm, [[5, 6]], pooling_params=PoolingParams(dimensions=32))
    assert getattr(e.value, "param", None) == "dimensions"
    (out,) = embed_ids(llm, [[5, 6]], pooling_params=PoolingParams(dimensions=HIDDEN))
    check(out, model, [5, 6], "last")
    # A prompt may fill the whole context: nothing is generated after it.
    full = random_prompts([40])[0]
    check(embed_ids(llm, [full])[0], model, full, "last")
    with pytest.raises(ValueError, match="41 tokens"):
        embed_ids(llm, [[*full, 7]])
    (cut,) = embed_ids(llm, [[*full, 7]], truncate_prompt_tokens=10)
    check(cut, model, [*full, 7][-10:], "last")
    (cut,) = embed_ids(llm, [[*full, 7]], truncate_prompt_tokens=-1)  # the context length
    check(cut, model, [*full, 7][-40:], "last")
    assert_idle(llm)


def test_async_encode_streams_one_output_and_counts_in_the_queue(
    tiny_models: TinyModels,
) -> None:
    path, model = tiny_models["llama"]
    cfg = build_engine_config(str(path), dtype="float32", block_size=4, num_kv_blocks=64)
    engine = AsyncLLMEngine(LLMEngine(cfg), max_queued_requests=2, start=False)
    prompts = random_prompts([6, 13], seed=7)

    async def main() -> list[list[Any]]:
        streams = [engine.encode({"prompt_token_ids": p}) for p in prompts]
        with pytest.raises(QueueFullError):  # an embedding input is one queued sequence
            engine.encode({"prompt_token_ids": [5]})
        engine.start()
        results = []
        for s in streams:
            results.append([out async for out in s])
        return results

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for ids, outs in zip(prompts, results, strict=True):
        assert len(outs) == 1  # one output, the final one
        check(outs[0], model, ids, "last")
