"""The whole engine on a CUDA GPU: tokens against transformers, the server with the official
client, and a Llama-3.2-1B-shaped model timed beside transformers' ``generate`` and the memory
floor (issues 29 and 35's GPU check; ``check.py`` beside this one covers the kernels alone).

Steps, each recorded in one JSON even when another fails (a failure keeps its traceback):

1. ``tokens``: tiny random Llama, Qwen2 and Mistral (sliding window) models in float32, built
   on the device with transformers; kvserve's greedy tokens for prompts of several lengths
   against ``model.generate`` on the same GPU, with and without ``--enforce-eager``, and the
   attention backend kvserve chose.
2. ``serve``: ``kvserve serve --device cuda`` on the tiny Llama in bfloat16, asked with the
   official ``openai`` client (chat, then a streamed completion).
3. ``bench``: the Llama-3.2-1B shape (16 layers, hidden 2048, 32/8 heads, vocab 128256, tied
   embeddings) with random bf16 weights: the decode step at batch 1 ((time for 129 tokens -
   time for 1) / 128), batch 64 at 128 in / 128 out in output tokens/s, each with and without
   ``enforce_eager``; transformers' static-batch ``generate`` on the same weights and GPU; the
   floor (weight bytes / the copy bandwidth measured here); kernel launches and GPU kernel
   time per decode step from ``torch.profiler`` (launches of 41 tokens minus those of 1).
4. ``lora`` (``e2e_lora.py``): a batch mixing the base model and two peft adapters against
   peft's merged models token for token, then 32 rows on the bench shape with the base model
   alone and over 4 rank-16 adapters (issue 32's GPU figure).
5. ``moe`` (``e2e_moe.py``): tiny random Qwen3-MoE and OLMoE models' greedy tokens against
   transformers' on the device (the Triton experts op), then 32 decode rows of the
   OLMoE-1B-7B layer shape with the Triton op and with the grouped PyTorch path (issue 33's).

No weights come from a hub: the models are random, the tokenizer is SmolLM2's (``--tokenizer``,
a folder with ``tokenizer.json``; the bench prompts are token ids, ``detokenize=False``).

    python benchmarks/gpu/e2e.py --tokenizer .gpu/tok --out benchmarks/results/gpu_e2e.json
    python benchmarks/gpu/e2e.py --device cpu --small --tokenizer .gpu/tok --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.e2e_lora import step_lora  # noqa: E402, F401  (found by name in main)
from benchmarks.gpu.e2e_moe import step_moe  # noqa: E402, F401  (found by name in main)

LAUNCH_EVENTS = (
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
    "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync",
)  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "tie_word_embeddings": False}  # fmt: skip
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": True}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_model(config: Any, folder: Path, tokenizer: Path, dtype: torch.dtype,
               device: torch.device) -> Any:  # fmt: skip
    """A random transformers model of ``config`` on ``device``, saved with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.eval()
    model.save_pretrained(folder)
    for f in tokenizer.iterdir():
        if f.is_file() and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    return model


def tiny_config(family: str, vocab: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama":
        return LlamaConfig(vocab_size=vocab, **TINY)
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab, **TINY)
    return MistralConfig(vocab_size=vocab, sliding_window=48, **TINY)


def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (no padding effects)."""
    out = []
    dev = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(g[0, len(p) :].tolist())
    return out


def graph_facts(llm: Any) -> dict[str, Any]:
    """Whether decode steps ran as CUDA graphs: captured sizes, steps replayed, pool bytes."""
    g = getattr(llm.engine.runner, "decode_graphs", None)
    if g is None:
        return {"captured": False}
    return {"captured": g.captured, "sizes": list(g.sizes), "steps": g.steps,
            "pool_mib": round(g.pool_bytes / 2**20, 1)}  # fmt: skip


def kv_greedy(folder: Path, prompts: list[list[int]], n: int, **kw: Any
              ) -> tuple[list[list[int]], str]:  # fmt: skip
    """kvserve's greedy tokens (all prompts in one batch) and its attention backend."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(folder), **kw)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        backend = llm.engine.runner.attn_backend.name.value if llm.engine.runner else "?"
        print(f"  graphs: {graph_facts(llm)}")
        return [list(o.outputs[0].token_ids) for o in outs], backend
    finally:
        llm.engine.close()


def step_tokens(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    lens = (5, 37, 80, 130)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in lens]
    n = 32
    for family in ("llama", "qwen2", "mistral"):
        folder = work / f"tiny-{family}"
        model = save_model(tiny_config(family, args.vocab), folder, args.tokenizer,
                           torch.float32, args.device)  # fmt: skip
        want = hf_greedy(model, prompts, n)
        del model
        fam: dict[str, Any] = {}
        for eager in args.modes:
            got, backend = kv_greedy(folder, prompts, n, device=str(args.device),
                                     dtype="float32", kv_cache_memory="512MiB",
                                     max_model_len=1024, enforce_eager=eager)  # fmt: skip
            same = [sum(1 for _ in _prefix(a, b)) for a, b in zip(got, want, strict=True)]
            fam["eager" if eager else "graphs"] = {
                "backend": backend, "equal": got == want, "matching_prefix": same,
            }  # fmt: skip
            print(
                f"tokens {family} enforce_eager={eager} backend={backend}: "
                f"{'EQUAL' if got == want else 'DIFFER'} (matching prefix {same} of {n})"
            )
        res[family] = fam
    return res


def _prefix(a: list[int], b: list[int]) -> Iterator[int]:
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def step_serve(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import httpx
    import openai

    folder = work / "tiny-llama"
    if not folder.exists():
        save_model(tiny_config("llama", args.vocab), folder, args.tokenizer, torch.float32,
                   args.device)  # fmt: skip
    port = free_port()
    dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", str(folder), "--port", str(port),
           "--device", str(args.device), "--dtype", dtype, "--served-model-name", "tiny",
           "--max-model-len", "1024"]  # fmt: skip
    if args.device.type == "cuda":
        cmd += ["--gpu-memory-utilization", "0.2"]
    log = open(work / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError("server did not become healthy in 180 s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=8, temperature=0,
        )  # fmt: skip
        stream = client.completions.create(
            model="tiny", prompt="The GPU says", max_tokens=8, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in stream if c.choices]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        res = {
            "chat_finish_reason": chat.choices[0].finish_reason,
            "chat_completion_tokens": chat.usage.completion_tokens if chat.usage else None,
            "stream_chunks": len(pieces),
            "stream_text_chars": len("".join(pieces)),
            "metrics_lines": sum(1 for ln in metrics.splitlines() if ln.startswith("kvserve")),
        }
        print(f"serve: {res}")
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        tail = (work / "serve.log").read_text().splitlines()[-25:]
        print("serve log tail:\n  " + "\n  ".join(tail))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device copy (median of 20)."""
    x = torch.empty(1 << 30 if device.type == "cuda" else 1 << 26, dtype=torch.uint8,
                    device=device)  # fmt: skip
    y = torch.empty_like(x)
    times = []
    for i in range(25):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 5:
            times.append(time.perf_counter() - t)
    return 2 * x.numel() / sorted(times)[len(times) // 2]


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls (after the caller's warm-up; keep it odd)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def launches(fn: Callable[[], object], device: torch.device) -> tuple[int, int, float]:
    """(host-side launches of kernels, copies and graphs; kernels and copies the GPU ran;
    their GPU ms) during ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    n, kernels, gpu_us = 0, 0, 0.0
    for ev in prof.events():
        if ev.name in LAUNCH_EVENTS:
            n += 1
        if device.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            gpu_us += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
    return n, kernels, gpu_us / 1e3


def host_profile(fn: Callable[[], object], path: Path) -> None:
    """Where a batch-1 generate spends host time: cProfile's top functions, and the Python
    lines that synchronise with the GPU (``torch.cuda.set_sync_debug_mode("warn")``)."""
    import cProfile
    import io
    import pstats
    import warnings

    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        torch.cuda.set_sync_debug_mode(0)
        sites: dict[str, int] = {}
        for w in caught:
            key = f"{w.filename}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
        buf.write("\nsyncs (41 tokens, batch 1):\n")
        for key, n in sorted(sites.items(), key=lambda kv: -kv[1]):
            buf.write(f"{n:6d} {key}\n")
    path.write_text(buf.getvalue())
    print(buf.getvalue()[:6000])


def step_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import LlamaConfig

    from kvserve import LLM, SamplingParams

    dev = args.device
    shape = dict(LLAMA_1B)
    if args.small:  # the dry run on a CPU: the same steps on a small shape
        shape.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     vocab_size=4096)  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    folder = work / "llama-1b-shape"
    model = save_model(LlamaConfig(**shape), folder, args.tokenizer, dtype, dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(dev)
    batch, plen, olen = (64, 128, 128) if not args.small else (8, 16, 16)
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(10, 4000, (batch, plen), generator=g)
    res: dict[str, Any] = {
        "shape": shape, "dtype": str(dtype), "weight_bytes": weight_bytes,
        "copy_bandwidth_gbs": bw / 1e9, "floor_step_ms": weight_bytes / bw * 1e3,
        "batch": batch, "prompt_len": plen, "output_len": olen,
    }  # fmt: skip
    # transformers' static-batch generate: every row prompt plen, exactly olen new tokens
    ids = prompts.to(dev)

    def hf(rows: int, n: int) -> None:
        with torch.no_grad():
            model.generate(ids[:rows], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           attention_mask=torch.ones_like(ids[:rows]))  # fmt: skip

    if not args.skip_hf:
        hf(batch, 4)  # warm-up
        hf(1, 4)
        t_b = timed(lambda: hf(batch, olen), dev)
        # batch 1 over 32 steps: transformers' eager step is slow enough that 128 cost 30 s
        t1_1, t1_n = timed(lambda: hf(1, 1), dev), timed(lambda: hf(1, 33), dev)
        res["transformers"] = {
            "batch_tok_s": batch * olen / t_b,
            "batch1_step_ms": (t1_n - t1_1) / 32 * 1e3,
        }  # fmt: skip
        print(f"bench transformers: {res['transformers']}")
    model = None  # the GPU copy freed before kvserve loads its own
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for eager in args.modes:
        llm = LLM(str(folder), device=str(dev), dtype=str(dtype).removeprefix("torch."),
                  max_model_len=1024, max_num_seqs=max(batch, 64), kv_cache_memory="8GiB"
                  if dev.type == "cuda" else "256MiB", enforce_eager=eager)  # fmt: skip
        try:

            def gen(rows: int, n: int, llm: Any = llm) -> None:
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                    detokenize=False)  # fmt: skip
                llm.generate([{"prompt_token_ids": p} for p in prompts[:rows].tolist()], sp,
                             use_tqdm=False)  # fmt: skip

            gen(batch, olen)  # warm-up: kernels compiled for every size the run meets
            gen(1, 4)
            t_b = timed(lambda: gen(batch, olen), dev)
            t1_1 = timed(lambda: gen(1, 1), dev)
            t1_n = timed(lambda: gen(1, olen + 1), dev)
            l1, k1, g1 = launches(lambda: gen(1, 1), dev)
            l41, k41, g41 = launches(lambda: gen(1, 41), dev)
            if args.profile:
                host_profile(lambda: gen(1, 41), args.out.parent / f"host-{int(eager)}.txt")
            step_ms = (t1_n - t1_1) / olen * 1e3
            r = {
                "backend": llm.engine.runner.attn_backend.name.value if llm.engine.runner else "?",
                "batch_tok_s": batch * olen / t_b,
                "batch1_step_ms": step_ms,
                "batch1_step_over_floor": step_ms / res["floor_step_ms"],
                "batch_over_transformers": batch * olen / t_b / res["transformers"]["batch_tok_s"]
                if "transformers" in res
                else None,
                "launches_per_decode_step": (l41 - l1) / 40,
                "gpu_ops_per_decode_step": (k41 - k1) / 40,
                "gpu_kernel_ms_per_decode_step": (g41 - g1) / 40,
                "graphs": graph_facts(llm),
            }
        finally:
            llm.engine.close()
        res["eager" if eager else "graphs"] = r
        print(f"bench kvserve enforce_eager={eager}: {r}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_e2e.json")
    ap.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json")
    ap.add_argument("--vocab", type=int, default=49152, help="the tiny models' vocabulary")
    ap.add_argument("--small", action="store_true", help="a small bench shape (dry runs)")
    ap.add_argument("--steps", default="tokens,serve,bench,lora,moe")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    ap.add_argument("--profile", action="store_true", help="host profile of a batch-1 run")
    ap.add_argument("--modes", default="eager,graphs", help="eager (enforce_eager), graphs")
    args = ap.parse_args()
    args.modes = [m == "eager" for m in args.modes.split(",")]
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    print(info)
    work = Path(tempfile.mkdtemp(prefix="kvserve-gpu-e2e-"))
    for step in args.steps.split(","):
        t = time.perf_counter()
        try:
            info[step] = globals()[f"step_{step}"](args, work)
        except Exception:  # recorded, and the other steps still run
            info[step] = {"error": traceback.format_exc()}
            print(f"step {step} FAILED:\n{info[step]['error']}")
        info[f"{step}_seconds"] = round(time.perf_counter() - t, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(info, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
