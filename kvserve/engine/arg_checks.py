"""Checks of the engine options that need no model, so bad options fail before any loading.

``check_args`` is ``EngineArgs.__post_init__``; ``speculative_config`` and ``lora_config``
parse the composite options (the checks and ``create_engine_config`` both use them);
``check_vllm_options`` refuses the vLLM options whose feature kvserve lacks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from kvserve.config import (
    LoRAConfig,
    SpeculativeConfig,
    parse_bytes,
    parse_device,
    parse_dtype,
    resolve_capture_sizes,
)
from kvserve.engine.arg_fields import EngineArgFields
from kvserve.model.hub import parse_hub_model
from kvserve.sample.custom_processors import load_processor_class

GENERATION_CONFIGS = ("auto", "vllm")

# vLLM options whose feature kvserve lacks: the value that means "not used" (accepted, since
# it changes nothing) and why any other value is refused. Switches that vLLM turns on with a
# bare flag have False here, so the flag itself is refused.
VLLM_UNSUPPORTED: dict[str, tuple[object, str]] = {
    "pipeline_parallel_size": (1, "kvserve shards a model with tensor parallelism only"),
    "data_parallel_size": (1, "kvserve runs one engine per model"),
    "kv_cache_dtype": ("auto", "the KV cache always has the model's dtype"),
    "trust_remote_code": (False, "kvserve never runs a model's own Python code"),
    "cpu_offload_gb": (0, "kvserve does not offload weights"),
}
# Options of `kvserve serve` alone (the HTTP server's tracing and metrics): refused by LLM()
# (and so by `generate`), so an offline run never silently drops them.
SERVER_ONLY = frozenset({"otlp_traces_endpoint", "metrics_prefix"})


def flag_name(name: str) -> str:
    """The CLI flag of field ``name``: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def _refusal(name: str, value: object, reason: str) -> str:
    shown = "" if isinstance(value, bool) else f" {value}"
    return f"{name}={value!r} ({flag_name(name)}{shown}) is not supported: {reason}"


def check_vllm_options(options: Mapping[str, object]) -> None:
    """Refuse vLLM options whose feature kvserve lacks unless given their no-op value."""
    for name, value in options.items():
        noop, reason = VLLM_UNSUPPORTED[name]
        if value != noop and not (noop is not None and value == str(noop)):
            raise ValueError(_refusal(name, value, reason))


def load_chat_template(value: str) -> str:
    """A chat template given inline or as a file (vLLM's rule: braces or a newline mean
    inline, anything else must be a readable file)."""
    if any(c in value for c in "{}\n"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(
            f"chat_template {value!r} (--chat-template) is neither a file nor a Jinja template"
        )
    return path.read_text(encoding="utf-8")


def cpu_cores(args: EngineArgFields) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's cores (``cpu_binding.resolve_cpu_cores``); None: no binding. CPU only:
    a GPU's host threads are left to torch."""
    if parse_device(args.device) != "cpu":
        return None
    from kvserve.worker.cpu_binding import resolve_cpu_cores

    return resolve_cpu_cores(args.cpu_cores, args.tensor_parallel_size, args.num_threads)


def check_args(args: EngineArgFields) -> None:
    """Check everything that needs no model, so bad options fail before any loading."""
    _check_choices(args)
    if args.dtype != "auto":
        parse_dtype(args.dtype)
    _check_quantization(args)
    if args.max_logprobs < -1:
        raise ValueError("max_logprobs (--max-logprobs) must be >= 0, or -1 for no cap, "
                         f"got {args.max_logprobs}")  # fmt: skip
    if args.tensor_parallel_size < 1:
        raise ValueError("tensor_parallel_size (--tensor-parallel-size) must be positive, "
                         f"got {args.tensor_parallel_size}")  # fmt: skip
    if str(args.device) == "cpu":  # needs no model: a bad value fails before any start
        cpu_cores(args)
    _check_cuda_graphs(args)
    for size in (args.kv_cache_memory, args.swap_space):
        if size is not None:
            parse_bytes(size)
    if args.generation_config not in GENERATION_CONFIGS:
        raise ValueError(
            _refusal("generation_config", args.generation_config,
                     "kvserve reads generation_config.json from the model folder only; "
                     "give 'auto' (the model's sampling defaults) or 'vllm' (none)")
        )  # fmt: skip
    _check_memory_options(args)
    if not args.enable_chunked_prefill:
        raise ValueError(
            "enable_chunked_prefill=False (--no-enable-chunked-prefill) is not supported: "
            "kvserve always chunks a prefill longer than --max-num-batched-tokens (there "
            "is no unchunked mode)"
        )
    _check_loadables(args)
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", args.metrics_prefix):
        raise ValueError(
            f"metrics_prefix (--metrics-prefix) must be letters, digits and '_', not "
            f"starting with a digit, got {args.metrics_prefix!r}"
        )


def _check_choices(args: EngineArgFields) -> None:
    """A field with choices holds one of them (an enum, ``KVPolicy.RESERVE``, becomes its
    string)."""
    for f in fields(args):
        choices = f.metadata["choices"]
        if not choices or (f.default is None and getattr(args, f.name) is None):
            continue
        value = getattr(args, f.name)
        value = getattr(value, "value", value)  # enums (KVPolicy.RESERVE) as their string
        if value not in choices:
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        setattr(args, f.name, value)


def _check_cuda_graphs(args: EngineArgFields) -> None:
    if isinstance(args.cuda_graph_sizes, int):  # LLM(cuda_graph_sizes=8): one value
        args.cuda_graph_sizes = [args.cuda_graph_sizes]
    resolve_capture_sizes(  # a bad list fails here, before any loading
        args.cuda_graph_sizes, args.max_cudagraph_capture_size, args.max_num_seqs
    )
    if args.max_seq_len_to_capture < 1:
        raise ValueError("max_seq_len_to_capture (--max-seq-len-to-capture) must be >= 1, "
                         f"got {args.max_seq_len_to_capture}")  # fmt: skip


def _check_loadables(args: EngineArgFields) -> None:
    """The options that name something to read: the tokenizer, the chat template, processor
    classes, the speculative config and the LoRA limits."""
    _check_tokenizer(args)
    if args.chat_template is not None:
        load_chat_template(args.chat_template)
    for spec in args.logits_processors or ():
        load_processor_class(spec)  # an unknown or wrong class fails before loading
    speculative_config(args)  # a bad speculative_config fails before loading
    lora_config(args)  # bad LoRA limits fail before loading


def speculative_config(args: EngineArgFields) -> SpeculativeConfig | None:
    """``speculative_config`` (a dict or its JSON) as a validated ``SpeculativeConfig``."""
    raw = args.speculative_config
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config (--speculative-config) is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object (a dict)")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown keys {unknown}; kvserve takes {sorted(known)}"
        )
    if raw.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
        raw = {k: v for k, v in raw.items() if k != "model"} | {"method": "ngram"}
    if "method" not in raw:  # vLLM infers it: a draft model when one is named
        raw = {**raw, "method": "draft_model" if raw.get("model") else "ngram"}
    if args.logits_processors:
        from kvserve.spec.build import SPEC_WITH_PROCESSORS

        raise ValueError(SPEC_WITH_PROCESSORS)
    try:
        return SpeculativeConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"speculative_config: {e}") from e


def lora_config(args: EngineArgFields) -> LoRAConfig | None:
    """The LoRA limits when ``enable_lora``; None (and no LoRA option changed) otherwise."""
    if not args.enable_lora:
        defaults = {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}
        changed = [n for n, d in defaults.items() if getattr(args, n) != d]
        if changed:
            raise ValueError(f"{changed[0]} ({flag_name(changed[0])}) needs enable_lora "
                             "(--enable-lora)")  # fmt: skip
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def _check_quantization(args: EngineArgFields) -> None:
    if args.quantization_group_size is not None and args.quantization not in ("int8", "int4"):
        raise ValueError(
            "quantization_group_size (--quantization-group-size) goes with --quantization "
            "int8 or int4"
        )
    if args.quantization == "gguf" and args.model is not None:
        path = Path(args.model)
        hub = parse_hub_model(args.model)
        if hub is not None and hub.gguf is not None:
            return  # org/name:file.gguf or org/name:Q4_K_M
        from kvserve.model import ollama

        if ollama.is_ollama_ref(args.model) or ollama.is_manifest_path(args.model):
            return  # Ollama's model layers are GGUF files (model/ollama.py)
        if path.is_dir() or (path.suffix.lower() != ".gguf" and hub is None):
            raise ValueError(
                f"quantization 'gguf' (--quantization gguf) needs a .gguf model file, got "
                f"{args.model!r}; for a Hugging Face folder use int8 or int4"
            )


def _check_memory_options(args: EngineArgFields) -> None:
    util = args.gpu_memory_utilization
    if util is None:
        return
    if not 0 < util <= 1:
        raise ValueError(
            f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got {util}"
        )
    for other in ("kv_cache_memory", "num_kv_blocks"):
        if getattr(args, other) is not None:
            raise ValueError(
                f"give only one of gpu_memory_utilization (--gpu-memory-utilization) and "
                f"{other} ({flag_name(other)}): both size the KV cache"
            )


def _check_tokenizer(args: EngineArgFields) -> None:
    """``tokenizer``: the model itself, a local folder, or a Hub id (resolved later)."""
    tok = args.tokenizer
    if tok is None or tok == args.model or Path(tok).expanduser().is_dir():
        return
    if parse_hub_model(tok) is None:
        raise ValueError(
            f"tokenizer {tok!r} (--tokenizer) is neither a local folder nor a Hugging Face "
            "Hub id (org/name)"
        )
