"""gpt-oss's MXFP4 experts kept as stored (``--quantization mxfp4``) against dequantized at
load (the default), issue 33: memory and decode speed on this CPU.

Writes (once) a random checkpoint of gpt-oss-20b's layer shape (hidden 2880, 32 experts of
2880, top-4, 64 query / 8 KV heads of 64, alternating 128-token sliding windows), ``--layers``
of its 24 layers, SmolLM2's 49,152-token tokenizer in place of its 201,088-token one, the
experts as OpenAI stores them (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``; random
codes, scales 2^-7 .. 2^-4), the rest random bf16. Then, per setting and in a fresh process:
load time, the process's peak RSS (VmHWM) and RSS after loading, and output tok/s of one
``generate`` of ``c`` random 32-token prompts, 32 tokens each (greedy, ``ignore_eos``), at
each ``--concurrency``, best of ``--repeats``; plus the first prompt's tokens (the settings'
weights are the same values; with int8 activations, auto on VNNI CPUs for bf16, the tokens
part; ``mxfp4-act-none`` multiplies the exact weights by the bf16 activations).

    python benchmarks/gpt_oss_mxfp4.py --layers 4 --out benchmarks/results/gpt_oss_mxfp4.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

# name -> (--quantization, --quantization-activations)
SETTINGS = {"dequantized": (None, "auto"), "mxfp4": ("mxfp4", "auto"),
            "mxfp4-act-none": ("mxfp4", "none")}  # fmt: skip
STD = 0.02


SMOLLM2_VOCAB = 49152
GPT_OSS_VOCAB = 201088  # gpt-oss-20b's o200k_harmony ids


def config(layers: int, vocab: int = SMOLLM2_VOCAB) -> dict[str, Any]:
    """gpt-oss-20b's config.json with ``layers`` layers and ``vocab`` ids (SmolLM2's tokenizer;
    ids past its 49,152 are padding, as llama.cpp's converter writes them)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": layers,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "attention_bias": True, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 0,
        "pad_token_id": 0, "quantization_config": {"quant_method": "mxfp4"},
    }  # fmt: skip


def write_checkpoint(folder: Path, layers: int, vocab: int = SMOLLM2_VOCAB) -> Path:
    """The random checkpoint (one shard per layer, each saved as it is drawn: the whole
    gpt-oss-20b shape is ~14 GB), written once."""
    import torch
    from safetensors.torch import save_file

    from kvserve.model.builtin import builtin_model_path

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = config(layers, vocab)
    h, i, e, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], vocab
    q, kv = cfg["num_attention_heads"] * 64, cfg["num_key_value_heads"] * 64
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=gen) * STD).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def save(n: int, t: dict[str, torch.Tensor]) -> None:
        fname = f"model-{n:05d}.safetensors"
        save_file(t, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, fname))

    save(0, {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})  # fmt: skip
    for n in range(layers):
        p = f"model.layers.{n}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.sinks": rand(cfg["num_attention_heads"]),
             p + "mlp.router.weight": rand(e, h), p + "mlp.router.bias": rand(e)}  # fmt: skip
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[p + f"self_attn.{name}.weight"], t[p + f"self_attn.{name}.bias"] = (
                rand(rows, h),
                rand(rows),
            )
        t[p + "self_attn.o_proj.weight"], t[p + "self_attn.o_proj.bias"] = rand(h, q), rand(h)
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            name = p + f"mlp.experts.{proj}"
            t[name + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen,
                                                dtype=torch.uint8)  # fmt: skip
            t[name + "_scales"] = torch.randint(120, 124, (e, rows, cols // 32), generator=gen,
                                                dtype=torch.uint8)  # fmt: skip
            t[name + "_bias"] = rand(e, rows)
        save(n + 1, t)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    src = builtin_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def measure(path: str, quant: tuple[str | None, str], concurrency: list[int], repeats: int) -> dict:
    """One setting, in this (fresh) process."""
    import torch

    from kvserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", quantization=quant[0], quantization_activations=quant[1],
              max_model_len=128,
              kv_cache_memory="512MiB", max_num_seqs=max(concurrency))  # fmt: skip
    load_s = time.perf_counter() - t0
    status = Path("/proc/self/status").read_text()
    mib = {k: int(line.split()[1]) / 1024 for line in status.splitlines()
           for k in ("VmHWM", "VmRSS") if line.startswith(k + ":")}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(10, 4000, (32,), generator=gen).tolist()}
               for _ in range(max(concurrency))]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    out: dict[str, Any] = {"load_s": load_s, "peak_rss_mib": mib["VmHWM"],
                           "rss_after_load_mib": mib["VmRSS"]}  # fmt: skip
    report = getattr(llm.engine.runner.model, "quant_report", None)
    out["quantized_mib"] = report.weight_bytes / 2**20 if report is not None else None
    out["paths"] = str(llm.execution_paths)
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
    for c in concurrency:
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            done = llm.generate(prompts[:c], sp, use_tqdm=False)
            best = max(best, c * 32 / (time.perf_counter() - t))
        out[f"tok_s_c{c}"] = best
        out.setdefault("first_tokens", list(done[0].outputs[0].token_ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one setting
    args = ap.parse_args()
    from benchmarks.peers.llamacpp import bench_models_dir

    folder = write_checkpoint(bench_models_dir() / f"gpt-oss-20b-{args.layers}l-mxfp4",
                              args.layers)  # fmt: skip
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.one is not None:
        print(json.dumps(measure(str(folder), SETTINGS[args.one], conc, args.repeats)))
        return
    results: dict[str, Any] = {"layers": args.layers, "checkpoint": str(folder)}
    for name in SETTINGS:
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--concurrency",
               args.concurrency, "--repeats", str(args.repeats), "--one", name]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
        r = results[name]
        print(
            f"{name}: load {r['load_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, RSS "
            f"{r['rss_after_load_mib']:.0f} MiB, "
            + ", ".join(f"c={c} {r[f'tok_s_c{c}']:.1f} tok/s" for c in conc),
            flush=True,
        )
    for name in ("mxfp4", "mxfp4-act-none"):
        same = results["dequantized"]["first_tokens"] == results[name]["first_tokens"]
        results[f"first_tokens_equal_{name}"] = same
        print(f"first prompt's tokens, {name} == dequantized: {same}")
    if args.out is not None:
        from benchmarks.machine import machine_info

        results["machine"] = machine_info()
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
