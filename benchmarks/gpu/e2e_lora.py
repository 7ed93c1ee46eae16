"""``e2e.py``'s ``lora`` step (issue 32's GPU check): multi-LoRA on the device.

1. Equality: a tiny random Llama in float32 and two peft adapters (rank 8 on all seven
   projections, random non-zero A and B); kvserve's greedy tokens for a batch mixing the base
   model and both adapters against peft's merged model on the same device, per request.
2. Figure: the bench shape (Llama-3.2-1B's, random bf16 weights; ``--small`` shrinks it) at
   a batch of 32 decode rows, output tok/s with the base model alone and with the rows spread
   over 4 rank-16 adapters (the Triton shrink/expand kernels on CUDA), and their ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    """peft's folder over ``base`` with A and B drawn at random (peft starts B at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                     init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3 / rank**0.5)
    peft_model.save_pretrained(out)
    return out


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int,
                  device: torch.device) -> list[int]:  # fmt: skip
    """peft's merged model's greedy tokens (EOS not special) on ``device``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model = model.to(device).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def step_lora(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import LlamaConfig

    from benchmarks.gpu.e2e import LLAMA_1B, save_model, sync, tiny_config
    from kvserve import LLM, LoRARequest, SamplingParams

    dev, n = args.device, 16
    tiny = work / "lora-tiny-llama"
    save_model(tiny_config("llama", args.vocab), tiny, args.tokenizer, torch.float32, dev)
    ads = [make_adapter(tiny, work / f"lora-a{i}", 8, seed=30 + i) for i in range(2)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 4000, (m,), generator=g).tolist() for m in (7, 40, 90)]
    reqs = [None, LoRARequest("a0", 1, str(ads[0])), LoRARequest("a1", 2, str(ads[1]))]
    want = [merged_greedy(tiny, None if r is None else Path(r.lora_path), p, n, dev)
            for p, r in zip(prompts, reqs, strict=True)]  # fmt: skip
    llm = LLM(str(tiny), device=str(dev), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, kv_cache_memory="512MiB", max_model_len=1024)  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=reqs,
                            use_tqdm=False)  # fmt: skip
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.close()
    res: dict[str, Any] = {"equal": got == want, "adapters_differ": len({*map(tuple, want)}) == 3}
    print(f"lora tokens: {'EQUAL' if got == want else 'DIFFER'} to peft's merged models")
    shape = dict(LLAMA_1B)
    if args.small:
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     vocab_size=4096)  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    big = work / "lora-bench-shape"
    save_model(LlamaConfig(**shape), big, args.tokenizer, dtype, dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    bads = [LoRARequest(f"b{i}", i + 1, str(make_adapter(big, work / f"lora-b{i}", 16, 40 + i)))
            for i in range(4)]  # fmt: skip
    rows, olen = 32, 64 if not args.small else 8
    batch = [{"prompt_token_ids": torch.randint(10, 4000, (64,), generator=g).tolist()}
             for _ in range(rows)]  # fmt: skip
    llm = LLM(str(big), device=str(dev), dtype=str(dtype).removeprefix("torch."),
              enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=512,
              kv_cache_memory="4GiB" if dev.type == "cuda" else "256MiB")  # fmt: skip
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True, detokenize=False)
        for name, lr in (("base", None), ("4 adapters", [bads[i % 4] for i in range(rows)])):
            llm.generate(batch, sp, lora_request=lr, use_tqdm=False)  # warm-up, loads slots
            sync(dev)
            t0 = time.perf_counter()
            llm.generate(batch, sp, lora_request=lr, use_tqdm=False)
            sync(dev)
            res[f"{name}_tok_s"] = rows * olen / (time.perf_counter() - t0)
    finally:
        llm.engine.close()
    res["four_adapters_over_base"] = res["4 adapters_tok_s"] / res["base_tok_s"]
    print(f"lora bench: {res}")
    return res
