"""Batch-invariant mode (``--batch-invariant``, ``LLM(batch_invariant=True)``): 32 requests
run alone, then in shuffled batches of 3, 7 and 22 under two chunked-prefill budgets (so
their prompts are split differently), give bitwise the same token ids, logprobs and prompt
logprobs, greedy and seeded, in bfloat16 and float32; without the mode they do not; the
combinations that cannot hold it are refused by name (quantized models hold it:
``tests/model/test_batch_invariant.py``)."""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvserve.config import CpuLinearKernel, batch_invariant_refusal
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.model.wide_linear import WideLinear, bf16_kernel_linears
from kvserve.ops import cpu_kernels
from kvserve.sampling_params import SamplingParams
from tests.engine.utils import random_prompts

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

NUM = 32
# 3..94 tokens: under a 40-token budget most prompts take two or three chunks, cut where
# their batch neighbours leave room
LENGTHS = [3 + (i * 37) % 92 for i in range(NUM)]
MAX_TOKENS = 6
Result = tuple[list[int], list[dict[int, float]], list[dict[int, float] | None] | None]


def _params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded sampling; every fourth asks prompt logprobs."""
    # top-n of 1..5: a row's top-n must not depend on the n its neighbours ask
    kw: dict[str, Any] = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1 + i % 5}
    if i % 4 == 0:
        kw["prompt_logprobs"] = 2
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, **kw)
    return SamplingParams(temperature=0.0, **kw)


def _llm(path: Path, dtype: str, budget: int, invariant: bool = True) -> LLM:
    return LLM(
        str(path), dtype=dtype, batch_invariant=invariant, num_kv_blocks=256, block_size=16,
        max_num_batched_tokens=budget, max_num_seqs=32,
    )  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]], ids: list[int]) -> dict[int, Result]:
    """Requests ``ids`` in one ``generate`` call (one batch), with a cold prefix cache."""
    llm.reset_prefix_cache()
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in ids], [_params(i) for i in ids],
        use_tqdm=False,
    )  # fmt: skip
    got: dict[int, Result] = {}
    for i, out in zip(ids, outs, strict=True):
        c = out.outputs[0]
        assert c.logprobs is not None
        lps = [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]
        plps = None
        if out.prompt_logprobs is not None:
            plps = [None if p is None else {t: lp.logprob for t, lp in p.items()}
                    for p in out.prompt_logprobs]  # fmt: skip
        got[i] = (list(c.token_ids), lps, plps)
    return got


def _batches(sizes: list[int], seed: int) -> list[list[int]]:
    order = list(range(NUM))
    random.Random(seed).shuffle(order)
    out, start = [], 0
    for n in sizes:
        out.append(order[start : start + n])
        start += n
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, seed=5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_outputs_do_not_depend_on_the_batch(
    tiny_llama: Path, prompts: list[list[int]], dtype: str
) -> None:
    big = _llm(tiny_llama, dtype, budget=512)
    assert big.execution_paths.batch_invariant
    # bf16 where the kernels have AVX512-BF16 (and no AMX): the packed layout's vdpbf16ps
    # kernel, one order per row (wide_linear.py); elsewhere the plain fixed-order kernel
    wide = dtype == "bfloat16" and bf16_kernel_linears(
        CpuLinearKernel.AUTO, torch.bfloat16, torch.device("cpu"), native=True, quantized=False,
        tp=1,
    )  # fmt: skip
    model = big.engine.runner.model
    kinds = {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
    assert kinds == ({"WideLinear"} if wide else {"BatchInvariantLinear"}), kinds
    assert all(m.direct_rows == 0 for m in model.modules() if isinstance(m, WideLinear))
    # decode-only steps (the requests alone) run the C++ decode loop, mixed ones the Python
    # layers: both call the same fixed-order kernels
    assert big.execution_paths.decode_loop
    alone: dict[int, Result] = {}
    for i in range(NUM):
        alone.update(_run(big, prompts, [i]))
    small = _llm(tiny_llama, dtype, budget=40)
    for llm, sizes, seed in ((big, [3, 7, 22], 1), (small, [22, 7, 3], 2)):
        for batch in _batches(sizes, seed):
            got = _run(llm, prompts, batch)
            for i in batch:
                assert got[i] == alone[i], (dtype, i, len(batch))
    assert small.stats()["max_num_running"] > 1  # batches really shared steps
    loop = big.engine.runner.model.decode_loop
    assert loop is not None and loop.steps > 0


def test_without_the_mode_outputs_depend_on_the_batch(
    tiny_llama: Path, prompts: list[list[int]]
) -> None:
    """The reason for the mode: off, on this CPU, some logprob of some request changes when it
    runs in a batch (float32; the probe behind the docs found bf16 differences too)."""
    llm = _llm(tiny_llama, "float32", budget=40, invariant=False)
    ids = list(range(8))
    alone: dict[int, Result] = {}
    for i in ids:
        alone.update(_run(llm, prompts, [i]))
    got = _run(llm, prompts, ids)
    assert any(got[i] != alone[i] for i in ids)  # some logprob (sampled, top-n or prompt)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_backend": "TORCH_SDPA"}, "needs the CPU_KERNEL attention backend"),
        ({"tensor_parallel_size": 2}, "needs tensor_parallel_size 1"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "speculative decoding"),
        ({"enable_lora": True}, "LoRA adapters"),
    ],
)  # fmt: skip
def test_refused_combinations(tiny_llama: Path, kwargs: dict[str, Any], match: str) -> None:
    args = EngineArgs.from_kwargs(str(tiny_llama), batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match=match) as err:
        args.create_engine_config(free_memory=lambda _: 2**34)
    assert "batch-invariant mode (--batch-invariant)" in str(err.value)


def test_refused_on_cuda(tiny_llama: Path) -> None:
    """The GPU backends (cuBLAS, TRITON_ATTN) have no fixed-order path: refused by name (the
    config's own check, reached here without a GPU; with one, ``--device cuda`` meets it)."""
    config = EngineArgs.from_kwargs(str(tiny_llama)).create_engine_config()
    on_cuda = SimpleNamespace(**{f.name: getattr(config, f.name) for f in fields(config)})
    on_cuda.device = "cuda"
    reason = batch_invariant_refusal(on_cuda)  # type: ignore[arg-type]
    assert reason is not None and "runs on the CPU only, not on cuda" in reason


def test_env_var_turns_it_on(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs.from_kwargs(str(tiny_llama)).create_engine_config().model.batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineArgs.from_kwargs(str(tiny_llama)).create_engine_config().model.batch_invariant
