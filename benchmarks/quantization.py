"""Quantized weights side by side (issue 16): kvserve bf16 / int8 / int4 / GGUF kept quantized
and llama.cpp's llama-server on Q8_0 / Q4_0 GGUFs of the same model, over HTTP.

One model per run (``--model``): ``builtin`` (SmolLM2-135M-Instruct, the float32 folder kvserve
converts from its Q4_1 GGUF), ``tinyllama`` (a random-weight Llama of TinyLlama-1.1B's shape,
bf16, seeded, SmolLM2's BPE cut to 32000 tokens; built once under
``~/.cache/kvserve/bench-models/tinyllama-random``), ``qwen3-0.6b`` (Qwen3-0.6B's config with
random weights and SmolLM2's whole BPE, the vocabulary padded to Qwen3's 151,936 as Qwen's own
is; ``qwen3-0.6b-random`` there) or a model folder. The GGUFs are converted
from that folder once by ``benchmarks/peers/llamacpp.py`` (llama-quantize's default recipes).

For each repeat the settings take turns (the order reversed every other repeat); each one's
server runs alone: started, warmed up, probed (one request checks the server's own prompt and
completion token counts), driven by ``kvserve bench serve`` at every concurrency (random
prompts of ``--input-len`` tokens, exactly ``--output-len`` tokens out via ``ignore_eos``,
greedy, closed loop), its peak RSS read (``VmHWM``), then stopped. Every setting gets the same
prompts in a repeat, and both engines the same KV room: one slot of input + output + 64
tokens per concurrent request (llama-server ``-np``/``-c``; kvserve ``--kv-cache-memory`` for
as many bf16 tokens, ``--max-model-len`` one slot). Prints one markdown table (medians over
repeats; output tok/s, TTFT, TPOT, the roofline floor of a decode step beside the TPOT (its
compute part at the int8 dot-product rate for int8 settings, ``int8_dots``), peak RSS, ratios
to kvserve bf16 and to llama.cpp of the same bits) and the issue's targets; writes
everything to ``benchmarks/results/quantization-<model>-<date>.json``.

    bash benchmarks/peers/setup_llamacpp.sh                    # once: .peers/llamacpp
    python benchmarks/quantization.py --model tinyllama        # all settings, c = 1, 8, 64
    python benchmarks/quantization.py --model builtin --settings kvserve-bf16,llamacpp-q4_0 \\
        --concurrency 1,8 --repeats 1 --output-len 32 --out /tmp/q.json   # a quick check

llama-server quirks met here: it takes the client's body as is (``ignore_eos``, ``max_tokens``,
``stream_options.include_usage`` give exact counts in a final usage chunk), but it drops a
kept-alive connection after a streamed answer (hence ``Connection: close``, see
:func:`bench_args`), and its own BPE splits some random-token texts one token shorter than the
Hugging Face tokenizer (the probe records it: 127 of 128 on the built-in model).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # benchmarks.*; roofline's `peers.*`

from benchmarks.peers import llamacpp  # noqa: E402

SERVED_NAME = "m"
WARMUP_SEED, PROBE_SEED = 10_000, 20_000  # measured runs use 1000 * concurrency + repeat
TINYLLAMA = {
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "seed": 0,
}  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """One server configuration of the side by side."""

    key: str
    engine: str  # "kvserve", "llamacpp" or "vllm" (benchmarks/moe.py)
    quantization: str | None = None  # kvserve serve --quantization (None: bf16 weights)
    gguf_type: str | None = None  # the GGUF served (llama.cpp; kvserve --quantization gguf)
    # kvserve --quantization-activations (None: the default, auto: int8 for bf16 on VNNI
    # CPUs, for 4-bit codes on AVX2 CPUs without VNNI)
    activations: str | None = None
    lm_head: bool = False  # kvserve --quantization-lm-head (int8, or a GGUF's output type)
    eager: bool = False  # kvserve --enforce-eager (the Python layer loop on decode steps too)
    dtype: str = "bfloat16"  # kvserve / vLLM --dtype (the KV cache's too)


SETTINGS = (
    Setting("kvserve-bf16", "kvserve"),
    Setting("kvserve-int8", "kvserve", "int8"),
    Setting("kvserve-int4", "kvserve", "int4"),
    Setting("kvserve-int8-a16", "kvserve", "int8", activations="none"),
    Setting("kvserve-int4-a16", "kvserve", "int4", activations="none"),
    Setting("kvserve-int8-lmhead", "kvserve", "int8", lm_head=True),
    Setting("kvserve-int4-lmhead", "kvserve", "int4", lm_head=True),
    Setting("kvserve-gguf-q8_0", "kvserve", "gguf", "Q8_0"),
    Setting("kvserve-gguf-q4_0", "kvserve", "gguf", "Q4_0"),
    Setting("kvserve-gguf-q4_0-lmhead", "kvserve", "gguf", "Q4_0", lm_head=True),
    # the Python layer loop on every step, beside the C++ decode loop of the settings above
    Setting("kvserve-bf16-eager", "kvserve", eager=True),
    Setting("kvserve-int4-lmhead-eager", "kvserve", "int4", lm_head=True, eager=True),
    Setting("kvserve-gguf-q4_0-lmhead-eager", "kvserve", "gguf", "Q4_0", lm_head=True, eager=True),
    Setting("llamacpp-q8_0", "llamacpp", None, "Q8_0"),
    Setting("llamacpp-q4_0", "llamacpp", None, "Q4_0"),
    # issue 34: llama-quantize's mixed K-quant files, kept quantized by kvserve
    Setting("kvserve-gguf-q4_k_m", "kvserve", "gguf", "Q4_K_M"),
    Setting("kvserve-gguf-q5_k_m", "kvserve", "gguf", "Q5_K_M"),
    # the file's own LM head (Q6_K), as llama-server runs it, not a bf16 one
    Setting("kvserve-gguf-q4_k_m-lmhead", "kvserve", "gguf", "Q4_K_M", lm_head=True),
    Setting("kvserve-gguf-q5_k_m-lmhead", "kvserve", "gguf", "Q5_K_M", lm_head=True),
    Setting("llamacpp-q4_k_m", "llamacpp", None, "Q4_K_M"),
    Setting("llamacpp-q5_k_m", "llamacpp", None, "Q5_K_M"),
    # IQ4_NL: its levels as 4-bit table indices on AVX512-VNNI (quantization/a8_table.py)
    Setting("kvserve-gguf-iq4_nl-lmhead", "kvserve", "gguf", "IQ4_NL", lm_head=True),
    Setting("llamacpp-iq4_nl", "llamacpp", None, "IQ4_NL"),
    # IQ4_XS: the same levels under two levels of scales; table codes on per-group records
    Setting("kvserve-gguf-iq4_xs-lmhead", "kvserve", "gguf", "IQ4_XS", lm_head=True),
    Setting("llamacpp-iq4_xs", "llamacpp", None, "IQ4_XS"),
    # float32 (dtype auto on AVX2-only CPUs): the weight-only kernel's table codes
    Setting(
        "kvserve-gguf-iq4_nl-lmhead-f32", "kvserve", "gguf", "IQ4_NL", lm_head=True, dtype="float32"
    ),
    # issue 31, AVX2-only CPUs (float32): auto (int8 activations for 4-bit codes and Q5/Q6
    # bytes there, float32 for full-range bytes), and int8 activations on every layer, the
    # vpmaddubsw kernel (llama.cpp's own Q8_0 x Q4_0 scheme)
    Setting("kvserve-gguf-q4_0-lmhead-f32", "kvserve", "gguf", "Q4_0", lm_head=True,
            dtype="float32"),
    Setting("kvserve-gguf-q4_0-lmhead-f32-a8", "kvserve", "gguf", "Q4_0", activations="int8",
            lm_head=True, dtype="float32"),
    Setting("kvserve-int4-lmhead-f32-a8", "kvserve", "int4", activations="int8", lm_head=True,
            dtype="float32"),
    Setting("kvserve-gguf-q4_k_m-lmhead-f32-a8", "kvserve", "gguf", "Q4_K_M",
            activations="int8", lm_head=True, dtype="float32"),
    Setting("kvserve-gguf-q4_k_m-lmhead-f32", "kvserve", "gguf", "Q4_K_M", lm_head=True,
            dtype="float32"),
    Setting("kvserve-gguf-q5_k_m-lmhead-f32", "kvserve", "gguf", "Q5_K_M", lm_head=True,
            dtype="float32"),
)  # fmt: skip
BASELINE = "kvserve-bf16"
PEER_OF = {  # llama.cpp's setting of the same bits, for the "x llama.cpp" column
    "kvserve-int8": "llamacpp-q8_0", "kvserve-gguf-q8_0": "llamacpp-q8_0",
    "kvserve-int4": "llamacpp-q4_0", "kvserve-gguf-q4_0": "llamacpp-q4_0",
    "kvserve-int8-a16": "llamacpp-q8_0", "kvserve-int4-a16": "llamacpp-q4_0",
    "kvserve-int8-lmhead": "llamacpp-q8_0", "kvserve-int4-lmhead": "llamacpp-q4_0",
    "kvserve-gguf-q4_0-lmhead": "llamacpp-q4_0", "kvserve-int4-lmhead-eager": "llamacpp-q4_0",
    "kvserve-gguf-q4_0-lmhead-eager": "llamacpp-q4_0",
    "kvserve-gguf-q4_k_m": "llamacpp-q4_k_m", "kvserve-gguf-q5_k_m": "llamacpp-q5_k_m",
    "kvserve-gguf-q4_k_m-lmhead": "llamacpp-q4_k_m",
    "kvserve-gguf-q5_k_m-lmhead": "llamacpp-q5_k_m",
    "kvserve-gguf-iq4_nl-lmhead": "llamacpp-iq4_nl",
    "kvserve-gguf-iq4_nl-lmhead-f32": "llamacpp-iq4_nl",
    "kvserve-gguf-iq4_xs-lmhead": "llamacpp-iq4_xs",
    "kvserve-gguf-q4_0-lmhead-f32": "llamacpp-q4_0",
    "kvserve-gguf-q4_0-lmhead-f32-a8": "llamacpp-q4_0",
    "kvserve-int4-lmhead-f32-a8": "llamacpp-q4_0",
    "kvserve-gguf-q4_k_m-lmhead-f32-a8": "llamacpp-q4_k_m",
    "kvserve-gguf-q4_k_m-lmhead-f32": "llamacpp-q4_k_m",
    "kvserve-gguf-q5_k_m-lmhead-f32": "llamacpp-q5_k_m",
}  # fmt: skip
# The issue's targets: (numerator, denominator, concurrency, least ratio of output tok/s).
TARGETS = (
    ("kvserve-int8", "kvserve-bf16", 1, 1.7),
    ("kvserve-int4", "kvserve-bf16", 1, 2.5),
    ("kvserve-int4", "llamacpp-q4_0", 1, 1.0),
    ("kvserve-int4", "llamacpp-q4_0", 64, 3.0),
    ("kvserve-int8", "kvserve-bf16", 64, 1.0),
    ("kvserve-int4", "kvserve-bf16", 64, 1.0),
    # the same with the LM head quantized too (int8), as llama.cpp's files have it (Q6_K)
    ("kvserve-int8-lmhead", "kvserve-bf16", 1, 1.7),
    ("kvserve-int4-lmhead", "kvserve-bf16", 1, 2.5),
    ("kvserve-int4-lmhead", "llamacpp-q4_0", 1, 1.0),
    ("kvserve-int4-lmhead", "llamacpp-q4_0", 64, 3.0),
    # issue 34: the same K-quant file on both engines, at least llama.cpp at 1, 2x at 64
    ("kvserve-gguf-q4_k_m", "llamacpp-q4_k_m", 1, 1.0),
    ("kvserve-gguf-q4_k_m", "llamacpp-q4_k_m", 64, 2.0),
    ("kvserve-gguf-q5_k_m", "llamacpp-q5_k_m", 1, 1.0),
    ("kvserve-gguf-q5_k_m", "llamacpp-q5_k_m", 64, 2.0),
    ("kvserve-gguf-q4_k_m-lmhead", "llamacpp-q4_k_m", 1, 1.0),
    ("kvserve-gguf-q4_k_m-lmhead", "llamacpp-q4_k_m", 64, 2.0),
    ("kvserve-gguf-q5_k_m-lmhead", "llamacpp-q5_k_m", 1, 1.0),
    ("kvserve-gguf-q5_k_m-lmhead", "llamacpp-q5_k_m", 64, 2.0),
    # issue 31 on AVX2-only CPUs: int4 and GGUF Q4_0 at least llama.cpp Q4_0 at 1, 2x at 64
    ("kvserve-gguf-q4_0-lmhead-f32-a8", "llamacpp-q4_0", 1, 1.0),
    ("kvserve-gguf-q4_0-lmhead-f32-a8", "llamacpp-q4_0", 64, 2.0),
    ("kvserve-int4-lmhead-f32-a8", "llamacpp-q4_0", 1, 1.0),
    ("kvserve-int4-lmhead-f32-a8", "llamacpp-q4_0", 64, 2.0),
)


def parse_settings(text: str) -> list[Setting]:
    """``all`` or a comma list of setting keys, in the given order."""
    by_key = {s.key: s for s in SETTINGS}
    if text == "all":
        return list(SETTINGS)
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in by_key]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown settings {unknown or [text]}; choose from {', '.join(by_key)} or all"
        )
    return [by_key[k] for k in dict.fromkeys(keys)]


def check_tokens(record: dict[str, Any], output_len: int) -> bool:
    """Every request answered with exactly ``output_len`` tokens."""
    done = record.get("completed") or 0
    return (
        record.get("failed") == 0
        and done == record.get("num_prompts")
        and record.get("total_output_tokens") == done * output_len
    )


def linear_params(cfg: Any) -> tuple[int, int]:
    """(parameters of the decoder layers' linears, of the LM head), as roofline.step_floor."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * (heads * d + 2 * kv_heads * d) + heads * d * h + 3 * h * inter
    return layers * per_layer, h * cfg.vocab_size


def setting_weight_bytes(
    setting: Setting, cfg: Any, ggufs: dict[str, Path], group_size: int | None = None
) -> int:
    """Weight bytes one decode step streams. GGUF settings: the file's own tensors. kvserve
    int8 (symmetric: a float16 scale per output channel or per ``group_size`` weights) and int4
    (a float16 scale and zero per group, 32 by default): the LM head stays bf16, or with
    ``lm_head`` int8 with a float16 scale per row."""
    if setting.gguf_type:
        return llamacpp.streamed_weight_bytes(ggufs[setting.gguf_type])
    body, head = linear_params(cfg)
    if setting.quantization is None:
        return 2 * (body + head)
    bits = {"int8": 8, "int4": 4}[setting.quantization]
    group = group_size or (32 if bits == 4 else cfg.hidden_size)  # per channel: K weights
    per_group = 2 if bits == 8 else 4  # int4 has a zero point beside its scale
    head_bytes = head * (1 + 2 / cfg.hidden_size) if setting.lm_head else 2 * head
    return int(body * (bits / 8 + per_group / group) + head_bytes)


# Weights whose (most) layers have 4-bit codes: auto's int8 activations on AVX2 without VNNI
# GGUF types whose layers all take int8 activations under auto on AVX2 (4-bit codes, and the
# Q5/Q6 bytes within 6 bits beside them: qlinear.a8_auto_supports)
AVX2_AUTO_INT8 = ("Q4_0", "Q4_1", "Q4_K_M", "Q4_K_S", "Q5_0", "Q5_1", "Q5_K_M", "Q5_K_S", "Q6_K")


def int8_dots(setting: Setting, vnni: bool = True) -> bool:
    """Whether the setting's linears run int8 dot products: kvserve's quantized weights with
    int8 activations (asked for, or ``auto``'s choice: bf16 on a CPU with AVX512-VNNI,
    ``vnni``; 4-bit codes and Q5/Q6 bytes without it, ``qlinear.a8_auto_supports``) and
    llama.cpp's quantized files (Q8_0 / Q8_K activations)."""
    if setting.engine == "llamacpp":
        return setting.gguf_type not in (None, "BF16", "F16", "F32")
    if setting.quantization is None or setting.activations == "none":
        return False
    if setting.activations == "int8":
        return True
    if vnni:
        return setting.dtype == "bfloat16"
    return setting.quantization == "int4" or setting.gguf_type in AVX2_AUTO_INT8


def step_floor_ms(
    cfg: Any,
    batch: int,
    context: int,
    roof: dict[str, Any],
    weight_bytes: int,
    int8: bool = False,
    dtype: str = "bfloat16",
) -> float | None:
    """roofline.step_floor with ``weight_bytes`` in place of the bf16 weights (KV stays 16-bit).
    The compute floor runs at the measured int8 dot-product rate where ``int8`` (AVX512-VNNI's
    ``vpdpbusd`` or AVX2's ``vpmaddubsw``, ``int8_peak``), else at the matmul rate of ``dtype``
    (float32's where no bf16 rate was measured: AVX2-only CPUs emulate bf16). At 64 rows an
    int8 setting's step was once set beside the bf16 floor, 2.2x the int8 one on a Zen 5 VM
    (0.42 TFLOP/s against 0.94 T int8 ops/s), which read as "at the floor" while it was not;
    on an AVX2 CPU the bf16 rate (0.0003 TFLOP/s) once put every floor at seconds. None where
    the rate it needs was not measured."""
    from roofline import step_floor

    bw = roof["bandwidth_bytes_s"]
    bf16, f32 = roof.get("bf16_matmul_flop_s"), roof.get("f32_matmul_flop_s")
    rate = f32 if dtype == "float32" or not bf16 else bf16
    if int8:
        rate = roof.get("int8_dot_ops_s")
    if not rate:
        return None
    mem_bf16, compute, bf16_bytes = step_floor(cfg, batch, context, bw, rate, 2)
    return max(mem_bf16 + (weight_bytes - bf16_bytes) / bw, compute) * 1e3


def _median(values: Sequence[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def summarize(
    runs: Sequence[dict[str, Any]],
    servers: Sequence[dict[str, Any]],
    settings: Sequence[Setting],
    concurrency: Sequence[int],
    peer_of: dict[str, str] = PEER_OF,
) -> list[dict[str, Any]]:
    """One row per (concurrency, setting) measured: medians over repeats, ratios (to kvserve
    bf16, and to ``peer_of`` the setting's peer), peak RSS."""
    rows = []
    for c in concurrency:
        for s in settings:
            mine = [r for r in runs if r["setting"] == s.key and r["concurrency"] == c]
            if not mine:
                continue
            peaks = [v["peak_rss_mib"] for v in servers if v["setting"] == s.key]
            psss = [v.get("pss_mib") for v in servers if v["setting"] == s.key]
            rows.append({
                "concurrency": c, "setting": s.key, "repeats": len(mine),
                "output_tok_s": _median([r["output_throughput"] for r in mine]),
                "median_ttft_ms": _median([r["median_ttft_ms"] for r in mine]),
                "median_tpot_ms": _median([r["median_tpot_ms"] for r in mine]),
                "failed": sum(r["failed"] or 0 for r in mine),
                "tokens_ok": all(r["tokens_ok"] for r in mine),
                "peak_rss_mib": max((p for p in peaks if p is not None), default=None),
                "pss_mib": max((p for p in psss if p is not None), default=None),
            })  # fmt: skip
    tput = {(r["setting"], r["concurrency"]): r["output_tok_s"] for r in rows}
    for row in rows:
        for name, other in (("x_bf16", BASELINE), ("x_llamacpp", peer_of.get(row["setting"]))):
            den = tput.get((other, row["concurrency"])) if other else None
            ok = den and row["output_tok_s"] is not None and other != row["setting"]
            row[name] = row["output_tok_s"] / den if ok else None
    return rows


def markdown(
    rows: Sequence[dict[str, Any]],
    roof: dict[str, Any] | None,
    cfg: Any,
    context: int,
    peer: str = "llama.cpp",
    settings: Sequence[Setting] = SETTINGS,
) -> str:
    """The result table; the floor is the roofline's least decode step at the mean context
    (int8 settings at the int8 dot-product rate, ``int8_dots``); ``peer`` names the
    ``x_llamacpp`` column's peer."""
    lines = [
        f"| c | setting | output tok/s | x bf16 | x {peer} | TTFT p50 ms | TPOT p50 ms "
        "| floor ms | floor / TPOT | peak RSS MiB | PSS MiB at the end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for r in rows:
        floor = None
        if roof is not None:
            setting = next((s for s in settings if s.key == r["setting"]), None)
            int8 = setting is not None and int8_dots(setting, bool(roof.get("vnni", True)))
            dtype = "bfloat16" if setting is None else setting.dtype
            floor = step_floor_ms(cfg, r["concurrency"], context, roof,
                                  roof["weight_bytes"][r["setting"]], int8, dtype)  # fmt: skip
        tpot = r["median_tpot_ms"]
        share = floor / tpot if floor is not None and tpot else None
        flag = "" if r["tokens_ok"] else " (!)"
        lines.append(
            f"| {r['concurrency']} | {r['setting']}{flag} | {f(r['output_tok_s'], '.1f')} | "
            f"{f(r['x_bf16'], '.2f')} | {f(r['x_llamacpp'], '.2f')} | "
            f"{f(r['median_ttft_ms'], '.0f')} | {f(tpot, '.1f')} | {f(floor, '.1f')} | "
            f"{f(share, '.0%')} | {f(r['peak_rss_mib'], '.0f')} | {f(r.get('pss_mib'), '.0f')} |"
        )
    return "\n".join(lines)


def targets(
    rows: Sequence[dict[str, Any]], goals: Sequence[tuple[str, str, int, float]] = TARGETS
) -> list[dict[str, Any]]:
    """The issue's speed targets (``goals``) that this run can judge, each with its ratio."""
    tput = {(r["setting"], r["concurrency"]): r["output_tok_s"] for r in rows}
    out = []
    for num, den, c, least in goals:
        a, b = tput.get((num, c)), tput.get((den, c))
        if a is None or not b:
            continue
        ratio = a / b
        met = ratio >= least
        verdict = "met" if met else "NOT met"
        text = f"{num} / {den} at c={c}: {ratio:.2f}x (target >= {least}x): {verdict}"
        out.append({"numerator": num, "denominator": den, "concurrency": c, "target": least,
                    "ratio": ratio, "met": met, "text": text})  # fmt: skip
    return out


@dataclass(frozen=True)
class Model:
    """The model under test: its HF folder, a short tag, the converter's pre-tokenizer name."""

    tag: str
    path: Path
    pre_tokenizer: str | None = None


def ensure_tinyllama() -> Path:
    """The TinyLlama-shaped random Llama with a tokenizer, built once (about 2 minutes)."""
    from benchmarks.peers.run_peers import add_truncated_tokenizer
    from benchmarks.study.workloads import RandomLlamaSpec, build_random_llama

    folder = llamacpp.bench_models_dir() / "tinyllama-random"
    build_random_llama(RandomLlamaSpec(**TINYLLAMA), folder)
    if not (folder / "tokenizer.json").is_file():
        add_truncated_tokenizer(folder, TINYLLAMA["vocab_size"])
    return folder


def ensure_qwen3() -> Path:
    """The Qwen3-0.6B-shaped random model (benchmarks/model_families.py's), built once."""
    from benchmarks.model_families import QWEN3_06B, ensure_model, make_qwen3

    folder = llamacpp.bench_models_dir() / "qwen3-0.6b-random"
    return Path(ensure_model(folder, make_qwen3, QWEN3_06B["vocab_size"]))


def resolve_model(name: str, pre_tokenizer: str | None) -> Model:
    from benchmarks.moe_model import SHAPES, ensure_moe_model

    if name in SHAPES:  # random OLMoE-layout models (benchmarks/moe.py) with SmolLM2's BPE
        return Model(name, ensure_moe_model(name), "smollm")
    if name == "builtin":
        from kvserve.model.builtin import builtin_model_path

        return Model("builtin", builtin_model_path())
    if name == "tinyllama":
        # The cut vocabulary hides SmolLM2's BPE from the converter's hash (see llamacpp.py).
        return Model("tinyllama", ensure_tinyllama(), "smollm")
    if name == "qwen3-0.6b":
        return Model(name, ensure_qwen3(), "smollm")
    path = Path(name).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name!r}: expected builtin, tinyllama, qwen3-0.6b, "
                         f"{', '.join(SHAPES)} "
                         "or a model folder")  # fmt: skip
    return Model(path.name, path, pre_tokenizer)


def slot_tokens(args: argparse.Namespace) -> int:
    """KV tokens each concurrent request gets on both engines: its prompt, its answer and a
    margin (the probe and warm-up fit too)."""
    return args.input_len + args.output_len + 64


def kv_cache_bytes(cfg: Any, tokens: int, elem_bytes: int = 2) -> int:
    """Bytes of a KV cache holding ``tokens`` tokens (K and V of every layer), 16-bit unless
    ``elem_bytes`` says."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return tokens * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem_bytes


def server_command(
    args: argparse.Namespace, setting: Setting, model: Model, ggufs: dict[str, Path], port: int
) -> list[str]:
    """The command line of one setting's server on ``port``. Both engines get one KV slot of
    :func:`slot_tokens` per concurrent request (llama.cpp: ``-np`` slots sharing ``-c``;
    kvserve: ``--kv-cache-memory`` for as many tokens unless given), so the peak RSS compares
    weights and runtimes, not KV pools of different sizes."""
    slots, tokens = max(args.concurrency), slot_tokens(args)
    if setting.engine == "llamacpp":
        assert setting.gguf_type is not None
        cmd = llamacpp.server_command(
            args.build, ggufs[setting.gguf_type], port, args.threads, slots, slots * tokens,
            SERVED_NAME,
        )  # fmt: skip
        return [*cmd, *shlex.split(args.llamacpp_args)]
    served = str(ggufs[setting.gguf_type]) if setting.gguf_type else str(model.path)
    elem = 4 if setting.dtype == "float32" else 2
    kv = args.kv_cache_memory or str(kv_cache_bytes(args.model_cfg, slots * tokens, elem))
    size = args.quantization_group_size
    group = ["--quantization-group-size", str(size)] if size else []
    return [
        sys.executable, "-m", "kvserve.cli", "serve", served,
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", setting.dtype, "--num-threads", str(args.threads),
        "--max-num-seqs", str(slots), "--max-model-len", str(tokens),
        "--kv-cache-memory", kv, "--no-access-log",
        *(["--quantization", setting.quantization] if setting.quantization else []),
        *(group if setting.quantization in ("int8", "int4") else []),
        *(["--quantization-activations", setting.activations] if setting.activations else []),
        # explicit both ways: unset, a GGUF's own head is kept quantized (lm_head.py)
        *(["--quantization-lm-head" if setting.lm_head else "--no-quantization-lm-head"]
          if setting.quantization else []),
        *(["--enforce-eager"] if setting.eager else []),
        *shlex.split(args.kvserve_args),
    ]  # fmt: skip


def bench_args(
    args: argparse.Namespace, model: Model, concurrency: int, num_prompts: int, seed: int
) -> argparse.Namespace:
    """``kvserve bench serve``'s options for one run (the URL is added by ``run_bench``).

    ``Connection: close`` on every request, for every server alike: llama-server drops a
    kept-alive connection after a streamed answer, and the client's next request on it failed
    with ServerDisconnectedError (1-2 of 6 sequential requests, every time); a new loopback
    connection per request costs about 0.1 ms."""
    from kvserve.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_serve_args(parser)
    return parser.parse_args([
        "--backend", "openai", "--tokenizer", str(model.path),
        "--served-model-name", SERVED_NAME, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
        "--metrics-interval", "5", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--header", "Connection=close",
    ])  # fmt: skip


def run_bench(bench: argparse.Namespace, url: str) -> dict[str, Any]:
    import asyncio

    from kvserve.bench import serve

    bench.base_url = url
    samples, tokenizer = serve.prepare(bench)
    return asyncio.run(serve.benchmark(bench, samples, tokenizer))


def probe(args: argparse.Namespace, model: Model, url: str) -> dict[str, Any]:
    """One streamed completion of a workload-like prompt (another seed: nothing measured is
    cached by it), read as the benchmark reads it: the server's own usage counts beside the
    benchmark tokenizer's, so a server that tokenizes differently or stops early shows."""
    import json

    import httpx

    from kvserve.bench import serve

    bench = bench_args(args, model, 1, 1, PROBE_SEED)
    samples, _ = serve.prepare(bench)
    want = min(16, args.output_len)
    body = {
        "model": SERVED_NAME, "prompt": samples[0].prompt, "max_tokens": want,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    usage: dict[str, Any] = {}
    url = f"{url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=600, trust_env=False) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]":
                usage = json.loads(data).get("usage") or usage
    return {
        "expected_prompt_tokens": samples[0].prompt_len,
        "prompt_tokens": usage.get("prompt_tokens"),
        "expected_completion_tokens": want,
        "completion_tokens": usage.get("completion_tokens"),
    }


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (vLLM serves from an engine-core child process)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):  # the process ended meanwhile
                pids += [int(c) for c in task.read_text().split()]
        i += 1
    return pids


def memory_mib(pid: int) -> dict[str, float | None]:
    """Peak (VmHWM) and current (VmRSS) resident memory of ``pid`` and its descendants in MiB:
    each process's own, summed (for a server of several processes, the peaks' sum bounds the
    peak of the whole from above: vLLM's engine core and worker, kvserve's grammar compile
    workers, ~0.2 GB each), and ``pid``'s alone (``main_peak_rss_mib``). ``pss_mib``: the
    tree's current proportional set size (each shared page split among its sharers), what
    the tree holds now without counting twice the pages forked processes share: kvserve's
    grammar zygote and its forked compile workers added ~650 MiB of summed RSS to a
    TinyLlama-1.1B server on an AVX512-BF16 EPYC (main process 1.9 GB of 2.6 GB)."""
    out: dict[str, float | None] = {"peak_rss_mib": None, "rss_mib": None}
    tree = process_tree(pid)
    for p in tree:
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        pss = _pss_kib(p)
        if pss is not None:
            out["pss_mib"] = (out.get("pss_mib") or 0.0) + pss / 1024
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                name = "peak_rss_mib" if key == "VmHWM" else "rss_mib"
                out[name] = (out[name] or 0.0) + int(value.split()[0]) / 1024
        if p == pid:
            out["main_peak_rss_mib"] = out["peak_rss_mib"]
    return out


def _pss_kib(pid: int) -> int | None:
    """``pid``'s proportional set size in KiB (``/proc/<pid>/smaps_rollup``), None if unread."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def with_server(
    args: argparse.Namespace,
    key: str,
    command: Callable[[int], list[str]],
    rep: int,
    measure: Callable[[str, dict[str, Any], list[dict[str, Any]]], None],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start one server (``command(port)``) alone, ``measure(url, record, runs)`` it, read its
    memory into the record (:func:`memory_mib`), stop it. A server that does not start, or a
    run that fails with a server error, is recorded in ``record["error"]`` (with the runs
    measured before it), not raised. Shared by this script, moe.py and lora_serve.py."""
    import httpx

    from kvserve.bench.sweep import ServerProcess, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = command(port)
    log = args.log_dir / f"{key}-rep{rep}.log"
    server: dict[str, Any] = {"setting": key, "repeat": rep, "command": cmd, "log": str(log)}
    proc = ServerProcess(cmd, log)
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    proc.start()
    try:
        proc.wait_healthy(url, args.start_timeout)
        server["start_s"] = time.monotonic() - t0
        measure(url, server, runs)
        server.update(memory_mib(proc.proc.pid) if proc.proc else {})
    except (RuntimeError, TimeoutError, OSError, ValueError, httpx.HTTPError) as e:
        server["error"] = f"{e}"
        print(f"  rep={rep} {key}: failed: {e}", flush=True)
    finally:
        proc.stop()
    return server, runs


def serve_setting(
    args: argparse.Namespace, key: str, command: Callable[[int], list[str]], model: Model, rep: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One setting's server: a warm-up, the probe, every concurrency (:func:`with_server`)."""

    def measure(url: str, server: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        run_bench(bench_args(args, model, 2, 2, WARMUP_SEED), url)  # first kernels, slots
        server["probe"] = probe(args, model, url)
        for c in args.concurrency:
            n = max(args.min_prompts, args.waves * c)
            load = os.getloadavg()[0]
            result = run_bench(bench_args(args, model, c, n, 1000 * c + rep), url)
            record = {"setting": key, "repeat": rep, "concurrency": c}
            record.update(loadavg_1min=[load, os.getloadavg()[0]])
            record.update({k: result.get(k) for k in RESULT_KEYS})
            record["tokens_ok"] = check_tokens(record, args.output_len)
            runs.append(record)
            print(
                f"  rep={rep} {key:<18} c={c:<3} {record['output_throughput']:8.1f} "
                f"tok/s  TTFT p50 {record['median_ttft_ms'] or 0:7.0f} ms  TPOT p50 "
                f"{record['median_tpot_ms'] or 0:6.1f} ms  failed {record['failed']}"
                + ("" if record["tokens_ok"] else "  TOKEN COUNT MISMATCH"),
                flush=True,
            )

    return with_server(args, key, command, rep, measure)


def measure(
    args: argparse.Namespace,
    settings: Sequence[Setting],
    command: Callable[..., list[str]],
    model: Model,
    ggufs: dict[str, Path],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every setting's server in turn, ``args.repeats`` times (the order reversed every other
    repeat); ``command(setting, model, ggufs, port)`` is a server's command line."""
    servers, runs = [], []
    for rep in range(args.repeats):
        for setting in settings if rep % 2 == 0 else settings[::-1]:
            cmd = partial(command, setting, model, ggufs)
            server, mine = serve_setting(args, setting.key, cmd, model, rep)
            servers.append(server)
            runs.extend(mine)
    return servers, runs


RESULT_KEYS = (
    "completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens",
    "duration", "output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
    "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
    "median_e2el_ms",
)  # fmt: skip


def roofline(args: argparse.Namespace, model: Model, ggufs: dict[str, Path]) -> dict[str, Any]:
    """The machine's read bandwidth, float32 and (where bf16 is native) bf16 matmul rates, int8
    dot-product peak (AVX512-VNNI or AVX2) and each setting's streamed weight bytes (what a
    decode step must read at least once)."""
    import torch
    from int8_peak import int8_peak_isa, measure_int8_peak, vnni_available
    from roofline import measure_bandwidth, measure_matmul

    from kvserve.quantization.qlinear import bf16_native

    bw, f32 = measure_bandwidth(), measure_matmul(dtype=torch.float32)
    mm = measure_matmul() if bf16_native() else None  # emulated bf16: seconds a call
    isa = int8_peak_isa()
    dots = measure_int8_peak() if isa else None
    weights = {
        s.key: setting_weight_bytes(s, args.model_cfg, ggufs, args.quantization_group_size)
        for s in args.settings
    }
    peak = f", int8 dot peak ({isa}) {dots / 1e12:.2f} T ops/s" if dots else ""
    bf16 = f", bf16 matmul {mm / 1e12:.2f} TFLOP/s" if mm else ""
    print(f"roofline: read bandwidth {bw / 1e9:.1f} GB/s, float32 matmul {f32 / 1e12:.2f} "
          f"TFLOP/s{bf16}{peak}")  # fmt: skip
    return {"bandwidth_bytes_s": bw, "bf16_matmul_flop_s": mm, "f32_matmul_flop_s": f32,
            "int8_dot_ops_s": dots, "int8_dot_isa": isa, "vnni": vnni_available(),
            "weight_bytes": weights}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default="builtin",
        help="builtin, tinyllama, qwen3-0.6b, olmoe-* (moe_model.py) or a folder",
    )
    ap.add_argument(
        "--settings",
        type=parse_settings,
        default=parse_settings("all"),
        help="comma list of setting keys (see SETTINGS) or all",
    )
    ap.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64]
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="requests per run = waves x c ...")
    ap.add_argument("--min-prompts", type=int, default=4, help="... but at least this many")
    ap.add_argument("--threads", type=int, default=2, help="server threads, both engines")
    ap.add_argument(
        "--kv-cache-memory", default=None, help="kvserve's KV cache (default: llama.cpp's tokens)"
    )
    ap.add_argument("--kvserve-args", default="", help="extra kvserve serve flags")
    ap.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    ap.add_argument("--llamacpp-dir", type=Path, default=llamacpp.DEFAULT_ROOT)
    ap.add_argument(
        "--pure-gguf",
        action="store_true",
        help="every GGUF matrix in the named type (llama-quantize --pure)",
    )
    ap.add_argument("--pre-tokenizer", default=None, help="converter's BPE name, PATH models")
    ap.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="kvserve int8/int4 group (default: kvserve's, int8 per channel, int4 32)",
    )
    ap.add_argument("--no-roofline", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="server start, s")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.machine import machine_info
    from kvserve.bench.serve import save_result
    from kvserve.model.loader import load_hf_config

    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    model = resolve_model(args.model, args.pre_tokenizer)
    args.model_cfg = load_hf_config(model.path)
    args.build = llamacpp.LlamaCppBuild(args.llamacpp_dir)
    types = tuple(sorted({s.gguf_type for s in args.settings if s.gguf_type}))
    ggufs = llamacpp.ensure_ggufs(args.build, model.path, types, args.pure_gguf,
                                  pre_tokenizer=model.pre_tokenizer) if types else {}  # fmt: skip
    date = datetime.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"quantization-{model.tag}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args.log_dir = Path(tempfile.gettempdir()) / "kvserve-quantization" / out.stem  # server logs
    args.log_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"benchmark": "quantization", "machine": machine_info()}
    doc["model"] = {"tag": model.tag, "path": str(model.path), "pre_tokenizer": model.pre_tokenizer}
    doc["ggufs"] = {
        k: {"path": str(p), "tensor_types": llamacpp.tensor_types(p)} for k, p in ggufs.items()
    }
    if any(s.engine == "llamacpp" for s in args.settings):
        doc["llamacpp_version"] = args.build.version()
    roof = None if args.no_roofline else roofline(args, model, ggufs)
    servers, runs = measure(args, args.settings, partial(server_command, args), model, ggufs)
    summary = summarize(runs, servers, args.settings, args.concurrency)
    context = args.input_len + args.output_len // 2  # mean tokens per request while decoding
    table = markdown(summary, roof, args.model_cfg, context)
    goals = targets(summary)
    print(f"\n{model.tag}: {args.input_len} in / {args.output_len} out, {args.threads} threads\n")
    print(table)
    for goal in goals:
        print(f"- {goal['text']}")
    settings = {k: v for k, v in vars(args).items() if k not in ("model_cfg", "build")}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    settings["settings"] = [asdict(s) for s in args.settings]
    doc.update(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        wall_time_s=time.monotonic() - t0, settings=settings, roofline=roof,
        servers=servers, runs=runs, summary=summary, targets=goals, markdown=table,
    )  # fmt: skip
    save_result(doc, out)
    print(f"\nSaved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
