"""``e2e.py``'s ``moe`` step (issue 33's GPU check): mixture-of-experts models on the device.

1. Equality: tiny random Qwen3-MoE and OLMoE models in float32, built on the device with
   transformers; kvserve's greedy tokens (the Triton experts op, ``ops/triton/moe.py``)
   against ``model.generate`` on the same GPU, per prompt.
2. Figure: 4 layers of OLMoE-1B-7B's shape with random bf16 weights (``--small`` shrinks it), 32
   decode rows, output tok/s with the Triton experts op and with the grouped PyTorch path
   (``FusedExperts.use_triton`` off), and their ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

TINY_MOE = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "max_position_embeddings": 1024}  # fmt: skip
# OLMoE-1B-7B's layers (4 of its 16: the experts op's cost is per layer; 3.5 GB in bf16)
OLMOE_LAYERS = {"hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 4,
               "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
               "num_experts_per_tok": 8, "vocab_size": 50304,
               "max_position_embeddings": 4096}  # fmt: skip


def tiny_moe_config(family: str, vocab: int) -> Any:
    from transformers import OlmoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(vocab_size=vocab, norm_topk_prob=True, **TINY_MOE)
    shape = {k: v for k, v in TINY_MOE.items() if k not in ("moe_intermediate_size", "head_dim")}
    shape["intermediate_size"] = TINY_MOE["moe_intermediate_size"]
    return OlmoeConfig(vocab_size=vocab, **shape)


def set_triton(llm: Any, on: bool) -> int:
    """Switch every layer's experts to the Triton op or the grouped path (never the C++ op,
    which a CPU dry run would otherwise take); how many layers."""
    from kvserve.moe.experts import FusedExperts

    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    for m in layers:
        m.use_triton, m.use_kernel = on, False
    return len(layers)


def step_moe(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import OlmoeConfig

    from benchmarks.gpu.e2e import _prefix, hf_greedy, kv_greedy, save_model, sync
    from kvserve import LLM, SamplingParams

    dev, n = args.device, 24
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 4000, (m,), generator=g).tolist() for m in (6, 33, 70)]
    res: dict[str, Any] = {}
    for family in ("qwen3_moe", "olmoe"):
        folder = work / f"moe-tiny-{family}"
        model = save_model(tiny_moe_config(family, args.vocab), folder, args.tokenizer,
                           torch.float32, dev)  # fmt: skip
        want = hf_greedy(model, prompts, n)
        del model
        got, backend = kv_greedy(folder, prompts, n, device=str(dev), dtype="float32",
                                 kv_cache_memory="512MiB", max_model_len=1024)  # fmt: skip
        same = [sum(1 for _ in _prefix(a, b)) for a, b in zip(got, want, strict=True)]
        res[family] = {"equal": got == want, "matching_prefix": same, "backend": backend}
        print(f"moe tokens {family}: {'EQUAL' if got == want else 'DIFFER'} "
              f"(matching prefix {same} of {n})")  # fmt: skip
    shape = dict(OLMOE_LAYERS)
    if args.small:
        shape.update(hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                     num_experts_per_tok=2, vocab_size=4096)  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    big = work / "moe-bench-shape"
    save_model(OlmoeConfig(**shape), big, args.tokenizer, dtype, dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows, olen = 32, 64 if not args.small else 8
    batch = [{"prompt_token_ids": torch.randint(10, 4000, (64,), generator=g).tolist()}
             for _ in range(rows)]  # fmt: skip
    kv = "4GiB" if dev.type == "cuda" else "256MiB"
    llm = LLM(str(big), device=str(dev), dtype=str(dtype).removeprefix("torch."),
              max_model_len=512, kv_cache_memory=kv)  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True, detokenize=False)
        outs = {}
        for name, on in (("triton", True), ("grouped", False), ("triton_again", True)):
            res["moe_layers"] = set_triton(llm, on)
            llm.generate(batch[:2], sp, use_tqdm=False)  # warm-up (Triton compiles once)
            sync(dev)
            t0 = time.perf_counter()
            done = llm.generate(batch, sp, use_tqdm=False)
            sync(dev)
            res[f"{name}_tok_s"] = rows * olen / (time.perf_counter() - t0)
            outs[name] = [list(o.outputs[0].token_ids) for o in done]
    finally:
        llm.engine.close()
    res["triton_over_grouped"] = res["triton_tok_s"] / res["grouped_tok_s"]
    # bf16 sums in another order: tokens may part ways; count the rows that stayed equal
    res["rows_equal_triton_vs_grouped"] = sum(
        a == b for a, b in zip(outs["triton"], outs["grouped"], strict=True)
    )
    print(f"moe bench: {res}")
    return res
