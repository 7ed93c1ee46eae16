"""Adapters through the engine (float32): greedy tokens per request equal peft's merged
model, with four adapters and the base model in one batch, under preemption, with prefix
caching, and across LRU swaps of the device slots and host memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.engine.llm import build_engine_config
from kvserve.engine.llm_engine import LLMEngine
from kvserve.lora.manager import LoRAManager
from kvserve.lora.punica import LoRAKernel
from kvserve.ops import cpu_kernels
from tests.engine.utils import random_prompts
from tests.lora.utils import hf_greedy, merged_model

MAX_TOKENS = 10
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
NAMES = ["all8", "qv4", "mlp16rs", "mixed2"]
PROMPTS = random_prompts([5, 11, 3, 17, 8, 13, 6, 9, 21, 4], seed=3)
# prompt i runs adapter NAMES[i % 5] (the 5th: the base model)
CHOICE = [NAMES[i % 5] if i % 5 < 4 else None for i in range(len(PROMPTS))]


def lora_requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {n: LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(NAMES)}


@pytest.fixture(scope="module")
def expected(lora_base: Path, adapters: dict[str, Path]) -> list[list[int]]:
    """peft's merged model's greedy tokens for every prompt under its adapter."""
    models = {n: merged_model(lora_base, adapters[n]) for n in NAMES}
    models[None] = merged_model(lora_base, None)  # type: ignore[index]
    out = [hf_greedy(models[c], p, MAX_TOKENS) for c, p in zip(CHOICE, PROMPTS, strict=True)]
    base = [hf_greedy(models[None], p, MAX_TOKENS) for p in PROMPTS]  # type: ignore[index]
    # every adapter changes the tokens: a dropped slice or scaling would show
    assert all(o != b for o, b, c in zip(out, base, CHOICE, strict=True) if c is not None)
    return out


def generate(llm: LLM, adapters: dict[str, Path]) -> list[list[int]]:
    lrs = lora_requests(adapters)
    loras = [None if c is None else lrs[c] for c in CHOICE]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)  # type: ignore[arg-type]
    return [list(o.outputs[0].token_ids) for o in outs]


def manager(llm: LLM) -> LoRAManager:
    runner = llm.engine.runner
    assert runner is not None and runner.lora is not None
    return runner.lora


@pytest.mark.parametrize("backend", ["CPU_KERNEL", "TORCH_SDPA"])
def test_four_adapters_and_base_in_one_batch(
    lora_base: Path, adapters: dict[str, Path], expected: list[list[int]], backend: str
) -> None:
    llm = LLM(
        str(lora_base), dtype="float32", num_kv_blocks=128, attention_backend=backend,
        enable_lora=True, max_loras=4, max_lora_rank=16,
    )  # fmt: skip
    assert generate(llm, adapters) == expected
    stats = llm.engine.scheduler.stats
    assert stats.max_num_running == len(PROMPTS)  # all ten ran together
    assert stats.num_steps == MAX_TOKENS  # one prefill step, then decode steps
    assert stats.num_steps_by_running == {len(PROMPTS): MAX_TOKENS}  # every step held all ten
    assert manager(llm).num_slot_loads == 4
    loop = llm.engine.runner.model.decode_loop  # type: ignore[union-attr]
    if backend == "CPU_KERNEL" and cpu_kernels.available():
        # adapter steps stay on the C++ decode loop (kvserve::lora_add per linear)
        assert loop is not None and loop.has_lora and loop.lora_steps == MAX_TOKENS - 1
        assert manager(llm).layers[0].qkv.kernel is LoRAKernel.CPU


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_under_preemption(
    lora_base: Path, adapters: dict[str, Path], expected: list[list[int]], mode: str
) -> None:
    # 16 blocks x 4 tokens for ten requests of up to 31 tokens each
    llm = LLM(
        str(lora_base), dtype="float32", block_size=4, num_kv_blocks=16,
        preemption_mode=mode, enable_lora=True, max_loras=4,
    )  # fmt: skip
    assert generate(llm, adapters) == expected
    assert llm.stats()["num_preemptions"] > 0


def test_prefix_caching_keys_blocks_by_adapter(lora_base: Path, adapters: dict[str, Path]) -> None:
    """The same 12-token prompt (3 full blocks) on the base model and two adapters: nine
    distinct blocks; a repeat on an adapter hits that adapter's blocks only."""
    lrs = lora_requests(adapters)
    engine = LLMEngine(build_engine_config(
        str(lora_base), dtype="float32", block_size=4, num_kv_blocks=64,
        enable_lora=True, max_loras=2,
    ))  # fmt: skip
    prompt = {"prompt_token_ids": random_prompts([13], seed=5)[0]}
    for rid, lr in (("base", None), ("one", lrs["all8"]), ("two", lrs["qv4"])):
        engine.add_request(rid, prompt, PARAMS, lora_request=lr)
    engine.step()
    tables = {rid: engine.kv.block_ids(rid)[:3] for rid in ("base", "one", "two")}
    assert tables == {"base": [0, 1, 2], "one": [4, 5, 6], "two": [8, 9, 10]}
    hashes = {rid: engine.kv.block_hashes(engine.scheduler.requests[rid], 12) for rid in tables}
    assert len({h for hs in hashes.values() for h in hs}) == 9
    engine.add_request("one-again", prompt, PARAMS, lora_request=lrs["all8"])
    engine.step()
    again = engine.scheduler.requests["one-again"]
    assert engine.kv.block_ids("one-again")[:3] == [4, 5, 6]
    assert again.num_cached_tokens == 12
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["one-again"] == done["one"] != done["base"]


def test_lru_swap_of_slots_and_host_memory(lora_base: Path, adapters: dict[str, Path]) -> None:
    """max_loras=2, max_cpu_loras=2, three adapters in turn: each still gives peft's tokens;
    the least recently used adapter leaves its slot and host memory, and is read again."""
    lrs = lora_requests(adapters)
    llm = LLM(
        str(lora_base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2,
        max_cpu_loras=2,
    )  # fmt: skip
    m = manager(llm)
    prompt = PROMPTS[1]
    states = []
    for name in ["all8", "qv4", "mlp16rs", "all8"]:
        out = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False,
                           lora_request=lrs[name])  # fmt: skip
        want = hf_greedy(merged_model(lora_base, adapters[name]), prompt, MAX_TOKENS)
        assert list(out[0].outputs[0].token_ids) == want, name
        states.append((m.cpu_ids(), m.slot_ids(), m.num_loads))
    assert states == [
        ([1], {1: 0}, 1),
        ([1, 2], {1: 0, 2: 1}, 2),
        ([2, 3], {2: 1, 3: 0}, 3),  # adapter 1 dropped (LRU): adapter 3 took its slot
        ([3, 1], {3: 0, 1: 1}, 4),  # adapter 1 read again, into adapter 2's slot
    ]


def test_remove_lets_running_requests_finish(
    lora_base: Path, adapters: dict[str, Path], expected: list[list[int]]
) -> None:
    lrs = lora_requests(adapters)
    engine = LLMEngine(build_engine_config(
        str(lora_base), dtype="float32", num_kv_blocks=64, enable_lora=True,
    ))  # fmt: skip
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, PARAMS, lora_request=lrs["all8"])
    engine.step()
    assert engine.remove_lora(1) is True
    assert engine.list_loras() == set()
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    assert tokens == expected[0]  # CHOICE[0] is all8
    engine.step()  # the runner hears the request finished, then forgets the adapter
    runner = engine.runner
    assert runner is not None and runner.lora is not None
    assert runner.lora.cpu_ids() == [] and runner.lora.slot_ids() == {}


def test_bad_adapter_and_lora_off(
    lora_base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    llm = LLM(str(lora_base), dtype="float32", num_kv_blocks=32, enable_lora=True,
              max_lora_rank=8)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    too_big = LoRARequest("big", 7, str(adapters["mlp16rs"]))
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank 8"):
        llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[None, too_big])
    assert not llm.engine.has_unfinished_requests() and llm.list_loras() == set()
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(prompts[0], PARAMS, lora_request=LoRARequest("x", 8, str(tmp_path / "no")))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate(prompts[0], PARAMS, lora_request=[None, None])
    off = LLM(str(lora_base), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="LoRA adapters are off"):
        off.generate(prompts[0], PARAMS, lora_request=LoRARequest("a", 1, str(adapters["qv4"])))
    with pytest.raises(ValueError, match=r"max_loras \(--max-loras\) needs enable_lora"):
        LLM(str(lora_base), max_loras=2)


def test_int4_base(lora_base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """Adapters over an int4 base (the C++ int4 kernel): peft's merged model over the
    dequantized base gives the same tokens, four adapters and the base in one batch."""
    from tests.engine.test_quantization import dequantized_copy

    dq = dequantized_copy(lora_base, tmp_path / "dq", 4, 32)
    models = {n: merged_model(dq, adapters[n]) for n in NAMES}
    models[None] = merged_model(dq, None)  # type: ignore[index]
    want = [hf_greedy(models[c], p, MAX_TOKENS) for c, p in zip(CHOICE, PROMPTS, strict=True)]
    llm = LLM(
        str(lora_base), dtype="float32", num_kv_blocks=128, quantization="int4",
        quantization_group_size=32, enable_lora=True, max_loras=4,
    )  # fmt: skip
    from kvserve.quantization.qlinear import QuantLinear

    assert llm.engine.runner is not None
    layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    assert isinstance(layer, QuantLinear) and layer.bits == 4 and layer.use_kernel
    assert generate(llm, adapters) == want


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])
def test_qwen2_mistral_and_qwen3(arch: str, tmp_path: Path) -> None:
    """Adapters on the other Llama-family layouts (Qwen2: q/k/v biases, tied embeddings;
    Qwen3: q/k norms, head_dim 32 with hidden 64 and 4 heads):
    two adapters and the base model in one batch give peft's merged model's tokens."""
    from tests.engine.utils import make_tiny_model
    from tests.lora.utils import SPECS, make_adapter

    make_tiny_model(arch, tmp_path / "base")
    base = tmp_path / "base"
    ads = {n: make_adapter(base, tmp_path / n, SPECS[n], seed=i + 5)
           for i, n in enumerate(("all8", "mixed2"))}  # fmt: skip
    choice = ["all8", None, "mixed2", "all8"]
    prompts = PROMPTS[:4]
    models = {c: merged_model(base, None if c is None else ads[c]) for c in set(choice)}
    want = [hf_greedy(models[c], p, MAX_TOKENS) for c, p in zip(choice, prompts, strict=True)]
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    lrs = {n: LoRARequest(n, i + 1, str(ads[n])) for i, n in enumerate(ads)}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                        lora_request=[None if c is None else lrs[c] for c in choice])  # fmt: skip
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert want[0] != hf_greedy(models[None], prompts[0], MAX_TOKENS)  # the adapter matters


def test_gguf_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapters over a Q8_0 GGUF base kept quantized (``quantization="gguf"``): two adapters
    and the base model in one batch give peft's merged model over the dequantized file (the
    GGUF converted to a float32 folder) token for token."""
    from gguf import GGMLQuantizationType

    from kvserve.model.builtin import find_builtin_gguf
    from kvserve.model.gguf_convert import convert_gguf
    from tests.lora.utils import SPECS, make_adapter
    from tests.model.test_gguf_families import PROMPTS as GGUF_PROMPTS
    from tests.model.test_gguf_families import make_model, write_family_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_family_gguf(make_model("qwen2"), "qwen2", tmp_path / "q8.gguf",
                             find_builtin_gguf(), GGMLQuantizationType.Q8_0)  # fmt: skip
    dq = convert_gguf(path, tmp_path / "dq")  # the file's values, dequantized to float32
    ads = {n: make_adapter(dq, tmp_path / n, SPECS[n], seed=i + 7)
           for i, n in enumerate(("all8", "qv4"))}  # fmt: skip
    choice = ["all8", "qv4", None]
    models = {c: merged_model(dq, None if c is None else ads[c]) for c in set(choice)}
    want = [hf_greedy(models[c], p, MAX_TOKENS) for c, p in zip(choice, GGUF_PROMPTS, strict=True)]
    llm = LLM(str(path), quantization="gguf", dtype="float32", num_kv_blocks=64,
              enable_lora=True, max_loras=2, warmup=False)  # fmt: skip
    assert llm.engine.runner.model.quant_report.layers == 8  # type: ignore[union-attr]
    lrs = {n: LoRARequest(n, i + 1, str(ads[n])) for i, n in enumerate(ads)}
    outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], PARAMS, use_tqdm=False,
                        lora_request=[None if c is None else lrs[c] for c in choice])  # fmt: skip
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    base_first = hf_greedy(models[None], GGUF_PROMPTS[0], MAX_TOKENS)
    assert want[0] != base_first  # the adapter changes the tokens
