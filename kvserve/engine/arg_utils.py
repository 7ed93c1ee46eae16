"""Every engine option, declared once: ``EngineArgs`` (the shape of vLLM's ``arg_utils``).

Each field carries its default and help text; ``add_cli_args`` turns the fields into the
flags of ``kvserve generate``, ``serve`` and ``bench throughput``, ``LLM(model, **kwargs)``
takes the same names as keyword arguments, and ``create_engine_config`` builds the frozen
``EngineConfig``. vLLM's names are accepted wherever their meaning carries over; a vLLM
option whose feature kvserve lacks is refused with a message naming it, never dropped.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvserve.config import (
    AttentionBackendEnum,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    auto_dtype,
    parse_bytes,
    parse_device,
    parse_dtype,
    resolve_capture_sizes,
)
from kvserve.engine.vllm_flags import check_vllm_kwargs
from kvserve.model.hub import (
    is_offline,
    parse_hub_model,
    resolve_hub_model,
    resolve_hub_tokenizer,
)
from kvserve.ops.batch_invariant import BATCH_INVARIANT_ENV, batch_invariant_from_env
from kvserve.sample.custom_processors import load_processor_class

logger = logging.getLogger("kvserve")

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


def _opt(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    nargs: str | None = None,
) -> Any:
    """A field with what its CLI flag needs (booleans become ``--x/--no-x``)."""
    meta = {"help": help, "type": type, "choices": choices, "nargs": nargs}
    return field(default=default, metadata=meta)


def _size_gib_if_bare(value: str) -> str:
    """``--swap-space``: vLLM's unit is GiB, so a bare number means GiB ("4" -> "4GiB")."""
    return f"{value}GiB" if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", value) else value


def _attention_backend_name(value: str) -> str:
    """``--attention-backend``: vLLM's names in any case (``torch_sdpa`` = ``TORCH_SDPA``)."""
    return AttentionBackendEnum.parse(value).value


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


class _VLLMOptionAction(argparse.Action):
    """Collects a :data:`VLLM_UNSUPPORTED` flag's value for ``from_cli_args`` to check."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        given = dict(getattr(namespace, "vllm_options", {}))
        given[self.dest] = True if self.nargs == 0 else values
        namespace.vllm_options = given


def available_memory(device: str) -> int:
    """Free memory for ``device`` now, in bytes: on CUDA the free device memory, on the CPU
    the kernel's MemAvailable (free pages plus caches it can reclaim, what a new
    allocation can get without swapping)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        raise ValueError(
            f"gpu_memory_utilization cannot measure the free memory of device {device!r}; "
            "size the KV cache with kv_cache_memory or num_kv_blocks instead"
        )
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass  # not Linux: the free pages, a lower bound
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


@dataclass
class EngineArgs:
    """The engine's options: ``LLM`` keyword arguments and the engine CLI flags."""

    model: str | None = _opt(
        None,
        "model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct); "
        "`serve` also takes models as positional arguments",
        type=str,
    )
    tokenizer: str | None = _opt(
        None, "vLLM's flag: the tokenizer, a local folder or a Hugging Face Hub id (its "
        "tokenizer files only are fetched; default: the model's)", type=str,
    )  # fmt: skip
    revision: str | None = _opt(
        None, "vLLM's flag: the branch, tag or commit of a Hub model (default: main)", type=str
    )
    tokenizer_revision: str | None = _opt(
        None, "vLLM's flag: the branch, tag or commit of a Hub --tokenizer", type=str
    )
    download_dir: str | None = _opt(
        None, "vLLM's flag: the Hugging Face cache Hub models are read from and downloaded to "
        "(default: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)", type=str,
    )  # fmt: skip
    served_model_name: str | list[str] | None = _opt(  # noqa: RUF009 (_opt is a field())
        None, "the name clients use (serve: one per model; default: the folder or file name)",
        type=str, nargs="+",
    )  # fmt: skip
    dtype: str = _opt(
        "auto",
        "auto (bfloat16 where the device computes it natively, else float32), "
        "bfloat16, float16 or float32",
    )
    max_model_len: int | None = _opt(None, "cap on the context length (default: the model's)",
                                     type=int)  # fmt: skip
    seed: int = _opt(0, "seeds the engine's generator for requests without a seed")
    device: str = _opt("cpu", "torch device: cpu, cuda or cuda:N (checked: CUDA must be available)")
    kv_cache_memory: int | str | None = _opt(
        None,
        "KV cache size, e.g. 2GiB (a bare number is bytes; default: 1GiB on a CPU, on CUDA "
        "--gpu-memory-utilization 0.9 sizes it)",
        type=str,
    )
    num_kv_blocks: int | None = _opt(
        None, "KV cache size in blocks (wins over --kv-cache-memory)", type=int
    )
    gpu_memory_utilization: float | None = _opt(
        None,
        "vLLM's flag. CUDA: the fraction of the device's total memory the engine may use "
        "(default 0.9 there); the KV cache gets what the weights and a profiled largest step "
        "leave. CPU: the KV cache is this fraction of MemAvailable at start-up. Not with "
        "--kv-cache-memory or --num-kv-blocks",
        type=float,
    )
    block_size: int = _opt(16, "tokens per KV block")
    swap_space: int | str = _opt(
        "4GiB", "CPU swap space for --preemption-mode swap, e.g. 4GiB (a bare number is GiB, "
        "as in vLLM)", type=_size_gib_if_bare,
    )  # fmt: skip
    enable_prefix_caching: bool = _opt(
        True, "reuse the KV blocks of prompt prefixes across requests (vLLM's flag)"
    )
    max_num_seqs: int = _opt(256, "most requests per batch")
    max_num_batched_tokens: int = _opt(
        2048, "most tokens computed per step (longer prefills are chunked)"
    )
    kv_policy: str = _opt(
        "preempt", "preempt: admit while blocks are free, preempt the newest when out; "
        "reserve: admit only when prompt + max_tokens fit", choices=("preempt", "reserve"),
    )  # fmt: skip
    preemption_mode: str = _opt(
        "recompute", "what happens to a preempted request's KV cache",
        choices=("recompute", "swap"),
    )  # fmt: skip
    scheduling_policy: str = _opt(
        "fcfs", "admission order: first come first served, or by the request's priority "
        "(lower first; with --kv-policy preempt a waiting request may preempt a running one)",
        choices=("fcfs", "priority"),
    )  # fmt: skip
    priority_scheduling_preemption_threshold: int = _opt(
        1, "with --scheduling-policy priority: how much lower a waiting request's priority "
        "must be to preempt a running request",
    )  # fmt: skip
    attention_backend: str = _opt(
        "auto", "attention backend (vLLM's names): auto (CPU: CPU_KERNEL where the C++ "
        "kernels build, else TORCH_SDPA; CUDA: TRITON_ATTN where installed, else TORCH_SDPA), "
        "TORCH_SDPA (gather + SDPA, any device), CPU_KERNEL, TRITON_ATTN",
        type=_attention_backend_name,
        choices=tuple(m.value for m in AttentionBackendEnum),
    )  # fmt: skip
    fused_ops: bool = _opt(
        True, "RMSNorm, SiLU*up and RoPE + KV write as fused kernels (same rounding): C++ on "
        "the CPU (bf16, float32), Triton on CUDA; --no-fused-ops keeps the PyTorch op chains",
    )  # fmt: skip
    prepack_weights: bool = _opt(True, "CPU bf16: oneDNN-prepacked linear weights (same numbers)")
    weight_dtype: str = _opt(
        "auto", "CPU float32: linear weights stored in bfloat16 or float16 and widened to "
        "float32 in registers (half the bytes per decode step); auto: the checkpoint's 16-bit "
        "dtype where kvserve computes in float32 (AVX2-only CPUs), else off; float32: off",
        choices=("auto", "bfloat16", "float16", "float32"),
    )  # fmt: skip
    warmup: bool = _opt(True, "CPU bf16 with prepacked weights: a dummy max-size prefill at start")
    num_threads: int | None = _opt(
        None,
        "torch CPU threads, set by the engine (each worker process with --distributed-"
        "executor-backend mp) before the model loads (default: torch's choice; serve: one "
        "per core)",
        type=int,
    )
    cpu_cores: str | None = _opt(
        None, "CPU cores each rank's OpenMP threads are pinned to, one thread per core: "
        "'auto' (the process's affinity mask; with tensor parallelism one NUMA node per rank "
        "where there are enough nodes, else equal slices), 'nobind' (threads float, only "
        "--num-threads is set), or core lists like '0-3' or, one group per rank, '0-3|4-7' "
        "(default: $VLLM_CPU_OMP_THREADS_BIND, else auto)",
        type=str,
    )  # fmt: skip
    chat_template: str | None = _opt(
        None, "vLLM's flag: a chat template file, or the template itself, for the chat "
        "endpoint and LLM.chat (default: the tokenizer's)", type=str,
    )  # fmt: skip
    logits_processors: list[str] | None = _opt(  # noqa: RUF009 (_opt is a field())
        None, "vLLM's flag: custom logits processor classes, as package.module:Class "
        "(subclasses of kvserve.sample.custom_processors.LogitsProcessor); LLM() also takes "
        "the classes", type=str, nargs="+",
    )  # fmt: skip
    speculative_config: dict[str, Any] | str | None = _opt(  # noqa: RUF009 (_opt is a field())
        None, "vLLM's flag: speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or '{\"method\": "
        "\"draft_model\", \"model\": \"path\", \"num_speculative_tokens\": 4}'; also "
        "prompt_lookup_min and disable_by_batch_size", type=str,
    )  # fmt: skip
    quantization: str | None = _opt(
        None, "vLLM's flag: weight-only quantized linear layers (activations: see "
        "--quantization-activations): "
        "int8 or int4 (round-to-nearest at load, from any checkpoint), or gguf (a .gguf "
        "model's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors kept quantized; without it a GGUF is "
        "dequantized at load), or compressed-tensors / awq / gptq (a pre-quantized "
        "checkpoint: llm-compressor's W4A16/W8A16, AutoAWQ's int4 GEMM layout or GPTQ's, "
        "found from its config.json without the flag); the embeddings stay unquantized, "
        "the LM head too unless --quantization-lm-head", type=str,
        choices=("int8", "int4", "gguf", "compressed-tensors", "awq", "gptq"),
    )  # fmt: skip
    quantization_group_size: int | None = _opt(
        None, "with --quantization int8/int4: weights per scale along the input dimension "
        "(even, dividing every layer's input size; default: int8 one scale per output "
        "channel, int4 32)", type=int,
    )  # fmt: skip
    quantization_activations: str = _opt(
        "auto", "with --quantization: int8 quantizes each linear's input per row in blocks of "
        "32 (a scale each, as llama.cpp does) and multiplies with integer dot products "
        "(AVX512-VNNI for bf16; AVX2 vpmaddubsw for float32, and for bf16 without VNNI); none "
        "keeps --dtype (exact products with the dequantized weights); auto is int8 where the "
        "VNNI kernel runs (bf16 on a CPU with VNNI), else none",
        choices=("auto", "int8", "none"),
    )  # fmt: skip
    quantization_lm_head: bool = _opt(
        False, "with --quantization: quantize the LM head too (a separate copy when it is tied "
        "to the embeddings): int8 per output channel, or with --quantization gguf the file's "
        "own output tensor (llama.cpp's Q6_K for a Q4_0 model) where kvserve has its type; "
        "native model classes only",
    )  # fmt: skip
    task: str = _opt(
        "auto", "vLLM's flag: 'score' serves a causal-LM reranker (Qwen3-Reranker): /score, "
        "/rerank and LLM.score read each pair in its yes/no template and score P(yes) of the "
        "last position; 'auto' does so when config.json says the model is one "
        "(is_original_qwen3_reranker or classifier_from_token), else scores by the cosine of "
        "embeddings. Every model still generates and embeds",
        choices=("auto", "generate", "embed", "embedding", "score"),
    )  # fmt: skip
    enable_sleep_mode: bool = _opt(
        False, "vLLM's flag: LLM.sleep()/wake_up() and the server's POST /sleep?level=1|2, "
        "POST /wake_up, GET /is_sleeping (level 1 frees the KV cache, level 2 the weights "
        "too, read again from the model folder on wake)",
    )  # fmt: skip
    pooling: str = _opt(
        "last", "embeddings (LLM.embed, /v1/embeddings): the last prompt token's final hidden "
        "state, or the mean over the prompt's (vLLM's pooling_type LAST / MEAN)",
        choices=("last", "mean"),
    )  # fmt: skip
    model_impl: str = _opt(
        "auto", "vLLM's flag: 'kvserve' runs the native implementation (Llama, Qwen2, "
        "Mistral), 'transformers' the model's own transformers class on kvserve's paged "
        "attention, 'auto' the native one when the architecture has it, else transformers",
        choices=("auto", "kvserve", "transformers"),
    )  # fmt: skip
    generation_config: str = _opt(
        "auto", "vLLM's flag: 'auto' makes the temperature, top_p, top_k, min_p, repetition/"
        "presence/frequency penalties and max_new_tokens (as max_tokens) of the model's "
        "generation_config.json the defaults of requests that do not set them; 'vllm' "
        "ignores the file (vLLM's neutral defaults)",
    )  # fmt: skip
    tensor_parallel_size: int = _opt(
        1, "vLLM's flag: shard the model over N ranks, one worker process each "
        "(torch.distributed: gloo on CPU, nccl on CUDA); native Llama/Qwen2/Qwen3/Mistral "
        "models whose heads divide by N; int8/int4 quantization shards (not GGUF or "
        "pre-quantized checkpoints), no draft model; the KV cache size is per rank",
    )  # fmt: skip
    distributed_executor_backend: str | None = _opt(
        None, "vLLM's flag: where the model runner lives: 'uni' in the engine's process, "
        "'mp' in worker processes (one per rank); default uni for one rank, mp for more",
        type=str, choices=("uni", "mp"),
    )  # fmt: skip
    enforce_eager: bool = _opt(
        False, "vLLM's flag: run every step's layers in Python; without it, decode-only steps "
        "of native Llama-family models run as captured CUDA graphs on CUDA (TRITON_ATTN) and "
        "their layers in one C++ call on CPU (same tokens)",
    )  # fmt: skip
    batch_invariant: bool = _opt(
        False, "every request's tokens and logprobs are bitwise the same whatever it is "
        "batched with (vLLM's batch-invariant mode, also $VLLM_BATCH_INVARIANT=1): linears, "
        "attention, norms and sampling compute each row in a fixed order; CPU only, "
        "CPU_KERNEL attention, dense native models, no tensor parallelism, speculative "
        "decoding or LoRA (docs/server.md)",
    )  # fmt: skip
    cuda_graph_sizes: list[int] | None = _opt(  # noqa: RUF009 (_opt is a field())
        None, "vLLM's flag: the decode batch sizes captured as CUDA graphs: one value is the "
        "largest (1, 2, 4, then every 8 to 256, every 16 above, up to it), several are the "
        "exact list (default: that pattern up to --max-cudagraph-capture-size); a decode "
        "batch pads to the next captured size, a larger one runs eager", type=int, nargs="+",
    )  # fmt: skip
    max_cudagraph_capture_size: int | None = _opt(
        None, "vLLM's flag: the largest decode batch captured as a CUDA graph (default "
        "min(--max-num-seqs, 512))", type=int,
    )  # fmt: skip
    max_seq_len_to_capture: int = _opt(
        8192, "vLLM's flag: the longest context a CUDA-graph decode step covers; a step with "
        "a longer one runs eager (it sizes the block tables copied every step)",
    )  # fmt: skip
    max_logprobs: int = _opt(
        20, "vLLM's flag: most logprobs one request may ask per token, counted for logprobs, "
        "top_logprobs and prompt_logprobs (echo with logprobs too); above: 400 (-1: no cap)",
    )  # fmt: skip
    max_beam_width: int = _opt(
        16, "most beams one beam search may keep (LLM.beam_search's beam_width, use_beam_search's "
        "best_of / n); above: 400. Each beam holds KV blocks and a batch row",
    )  # fmt: skip
    disable_log_requests: bool = _opt(
        False, "vLLM's flag: no effect, kvserve never logs request contents"
    )
    disable_log_stats: bool = _opt(
        False, "vLLM's flag: no periodic stats line (throughput, running and waiting "
        "requests, KV cache use; every VLLM_LOG_STATS_INTERVAL seconds, default 10)",
    )  # fmt: skip
    enable_chunked_prefill: bool = _opt(
        True, "vLLM's flag: kvserve always chunks prefills longer than "
        "--max-num-batched-tokens; --no-enable-chunked-prefill is refused",
    )  # fmt: skip
    # -- grammar compilation limits (structured outputs, tool_choice required) --------------
    grammar_compile_timeout: float = _opt(
        10.0, "seconds one grammar compile (structured outputs, tool_choice required or "
        "named) may run; its worker process is then killed and the request fails with 400",
    )  # fmt: skip
    grammar_compile_max_memory: str = _opt(
        "512MiB", "memory one grammar compile may add to its worker process, e.g. 512MiB; "
        "past it the worker is killed and the request fails with 400", type=str,
    )  # fmt: skip
    grammar_cache_memory: str = _opt(
        "64MiB", "compiled grammars kept for reuse, in bytes (e.g. 64MiB; least recently "
        "used dropped first; vLLM's VLLM_XGRAMMAR_CACHE_MB)", type=str,
    )  # fmt: skip
    # -- LoRA adapters (vLLM's flags; kvserve/lora, docs/lora.md) -------------------------
    enable_lora: bool = _opt(
        False, "serve PEFT LoRA adapters over the base model, mixed in one batch "
        "(LLM.generate(lora_request=...), serve --lora-modules)",
    )  # fmt: skip
    max_loras: int = _opt(1, "adapters in device slots at once: most distinct adapters per step")
    max_lora_rank: int = _opt(16, "the largest LoRA rank accepted (slots are this wide)")
    max_cpu_loras: int | None = _opt(
        None, "adapters kept in host memory, least recently used dropped (default: max_loras)",
        type=int,
    )  # fmt: skip
    # -- serve only (SERVER_ONLY): observability of the HTTP server -----------------------
    otlp_traces_endpoint: str | None = _opt(
        None, "vLLM's flag: send an OpenTelemetry span per request (vLLM's llm_request with "
        "its gen_ai.* attributes, joined to the caller's W3C traceparent) to this OTLP "
        "endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL choose "
        "grpc (default) or http/protobuf; needs pip install 'kvserve[tracing]'", type=str,
    )  # fmt: skip
    metrics_prefix: str = _opt(
        "kvserve", "the prefix of every /metrics name (kvserve:num_requests_running); 'vllm' "
        "gives vLLM's names, so vLLM dashboards and alerts work unchanged",
    )  # fmt: skip

    def __post_init__(self) -> None:
        """Check everything that needs no model, so bad options fail before any loading."""
        for f in fields(self):
            choices = f.metadata["choices"]
            if not choices or (f.default is None and getattr(self, f.name) is None):
                continue
            value = getattr(self, f.name)
            value = getattr(value, "value", value)  # enums (KVPolicy.RESERVE) as their string
            if value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
            setattr(self, f.name, value)
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        self._check_quantization()
        if self.max_logprobs < -1:
            raise ValueError("max_logprobs (--max-logprobs) must be >= 0, or -1 for no cap, "
                             f"got {self.max_logprobs}")  # fmt: skip
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size (--tensor-parallel-size) must be positive, "
                             f"got {self.tensor_parallel_size}")  # fmt: skip
        if str(self.device) == "cpu":  # needs no model: a bad value fails before any start
            self._cpu_cores()
        if isinstance(self.cuda_graph_sizes, int):  # LLM(cuda_graph_sizes=8): one value
            self.cuda_graph_sizes = [self.cuda_graph_sizes]
        resolve_capture_sizes(  # a bad list fails here, before any loading
            self.cuda_graph_sizes, self.max_cudagraph_capture_size, self.max_num_seqs
        )
        if self.max_seq_len_to_capture < 1:
            raise ValueError("max_seq_len_to_capture (--max-seq-len-to-capture) must be >= 1, "
                             f"got {self.max_seq_len_to_capture}")  # fmt: skip
        for size in (self.kv_cache_memory, self.swap_space):
            if size is not None:
                parse_bytes(size)
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                _refusal("generation_config", self.generation_config,
                         "kvserve reads generation_config.json from the model folder only; "
                         "give 'auto' (the model's sampling defaults) or 'vllm' (none)")
            )  # fmt: skip
        self._check_memory_options()
        if not self.enable_chunked_prefill:
            raise ValueError(
                "enable_chunked_prefill=False (--no-enable-chunked-prefill) is not supported: "
                "kvserve always chunks a prefill longer than --max-num-batched-tokens (there "
                "is no unchunked mode)"
            )
        self._check_tokenizer()
        if self.chat_template is not None:
            load_chat_template(self.chat_template)
        for spec in self.logits_processors or ():
            load_processor_class(spec)  # an unknown or wrong class fails before loading
        self.speculative()  # a bad speculative_config fails before loading
        self.lora_config()  # bad LoRA limits fail before loading
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(
                f"metrics_prefix (--metrics-prefix) must be letters, digits and '_', not "
                f"starting with a digit, got {self.metrics_prefix!r}"
            )

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` (a dict or its JSON) as a validated ``SpeculativeConfig``."""
        raw = self.speculative_config
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"speculative_config (--speculative-config) is not JSON: {e}"
                ) from e
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
        if self.logits_processors:
            from kvserve.spec.build import SPEC_WITH_PROCESSORS

            raise ValueError(SPEC_WITH_PROCESSORS)
        try:
            return SpeculativeConfig(**raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"speculative_config: {e}") from e

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits when ``enable_lora``; None (and no LoRA option changed) otherwise."""
        if not self.enable_lora:
            defaults = {"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": None}
            changed = [n for n, d in defaults.items() if getattr(self, n) != d]
            if changed:
                raise ValueError(f"{changed[0]} ({flag_name(changed[0])}) needs enable_lora "
                                 "(--enable-lora)")  # fmt: skip
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora (--enable-lora) with tensor_parallel_size > 1 is not "
                             "supported yet")  # fmt: skip
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _check_quantization(self) -> None:
        if self.quantization_group_size is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(
                "quantization_group_size (--quantization-group-size) goes with --quantization "
                "int8 or int4"
            )
        if self.quantization == "gguf" and self.model is not None:
            path = Path(self.model)
            hub = parse_hub_model(self.model)
            if hub is not None and hub.gguf is not None:
                return  # org/name:file.gguf or org/name:Q4_K_M
            from kvserve.model import ollama

            if ollama.is_ollama_ref(self.model) or ollama.is_manifest_path(self.model):
                return  # Ollama's model layers are GGUF files (model/ollama.py)
            if path.is_dir() or (path.suffix.lower() != ".gguf" and hub is None):
                raise ValueError(
                    f"quantization 'gguf' (--quantization gguf) needs a .gguf model file, got "
                    f"{self.model!r}; for a Hugging Face folder use int8 or int4"
                )

    def _check_memory_options(self) -> None:
        util = self.gpu_memory_utilization
        if util is None:
            return
        if not 0 < util <= 1:
            raise ValueError(
                f"gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got {util}"
            )
        for other in ("kv_cache_memory", "num_kv_blocks"):
            if getattr(self, other) is not None:
                raise ValueError(
                    f"give only one of gpu_memory_utilization (--gpu-memory-utilization) and "
                    f"{other} ({flag_name(other)}): both size the KV cache"
                )

    def _check_tokenizer(self) -> None:
        """``tokenizer``: the model itself, a local folder, or a Hub id (resolved later)."""
        tok = self.tokenizer
        if tok is None or tok == self.model or Path(tok).expanduser().is_dir():
            return
        if parse_hub_model(tok) is None:
            raise ValueError(
                f"tokenizer {tok!r} (--tokenizer) is neither a local folder nor a Hugging Face "
                "Hub id (org/name)"
            )

    def check_hub_cache(self) -> None:
        """With HF_HUB_OFFLINE, resolve the Hub ids (tokenizer, model) now: from the cache
        only, so at once, and a ValueError naming the id and the cache if one is missing."""
        if is_offline():
            self._resolve_tokenizer()
            hub = parse_hub_model(self.model) if self.model else None
            if hub is not None:
                resolve_hub_model(hub, self.revision, self.download_dir)

    def _resolve_tokenizer(self) -> str | None:
        """The tokenizer folder when it is not the model folder's: a local folder, or a Hub
        id's tokenizer files (fetched before the model, so a bad id fails first)."""
        tok = self.tokenizer
        if tok is None or tok == self.model:
            return None
        local = Path(tok).expanduser()
        if local.is_dir():
            if self.model is not None and local.resolve() == Path(self.model).resolve():
                return None  # the model folder, spelled another way
            if not any((local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise ValueError(f"tokenizer {tok!r} (--tokenizer) has no tokenizer.json or "
                                 "tokenizer_config.json")  # fmt: skip
            return str(local.resolve())
        hub = parse_hub_model(tok)
        assert hub is not None  # __post_init__ checked it
        try:
            folder = resolve_hub_tokenizer(hub, self.tokenizer_revision, self.download_dir)
        except ValueError as e:
            raise ValueError(f"tokenizer {tok!r} (--tokenizer): {e}") from e
        return str(folder)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """``LLM(model, **kwargs)``'s options; an unknown keyword is a ``TypeError`` naming it."""
        names = [f.name for f in fields(cls)]
        kwargs = check_vllm_kwargs(kwargs, set(names) | set(VLLM_UNSUPPORTED))
        vllm = {k: kwargs.pop(k) for k in list(kwargs) if k in VLLM_UNSUPPORTED}
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine argument {key!r}{hint}")
        check_vllm_options(vllm)
        server_only = sorted(SERVER_ONLY & set(kwargs))
        if server_only:
            key = server_only[0]
            raise ValueError(
                f"{key} ({flag_name(key)}) is an option of `kvserve serve` (the HTTP server's "
                f"observability); LLM does not take it"
            )
        return cls(model=model, **kwargs)

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser | Any, exclude: frozenset[str] = frozenset()
    ) -> Any:
        """One flag per field (except ``exclude``d ones), plus the refused vLLM flags."""
        for f in fields(cls):
            if f.name in exclude:
                continue
            meta = f.metadata
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
            if isinstance(f.default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = meta["type"] or type(f.default)
                if meta["choices"]:
                    kw["choices"] = meta["choices"]
                if meta["nargs"]:
                    kw["nargs"] = meta["nargs"]
            parser.add_argument(flag_name(f.name), **kw)
        for name, (noop, _) in VLLM_UNSUPPORTED.items():
            parser.add_argument(
                flag_name(name), dest=name, action=_VLLMOptionAction,
                nargs=0 if noop is False else None, default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )  # fmt: skip
        return parser

    @classmethod
    def from_cli_args(
        cls, args: argparse.Namespace, exclude: frozenset[str] = frozenset()
    ) -> EngineArgs:
        """The fields found on ``args``, except ``exclude`` (a flag of the same name that
        means something else); the rest keep their defaults. Refused vLLM flags raise."""
        check_vllm_options(getattr(args, "vllm_options", {}))
        names = [f.name for f in fields(cls) if f.name not in exclude and hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})

    def llm_kwargs(self) -> dict[str, Any]:
        """``LLM(**...)`` arguments that rebuild these args: the model and every changed field."""
        changed = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "model" and getattr(self, f.name) != f.default
        }
        return {"model": self.model, **changed}

    def _batch_invariant(self) -> bool:
        """``--batch-invariant``, or vLLM's switch for the mode, ``$VLLM_BATCH_INVARIANT=1``."""
        if self.batch_invariant:
            return True
        if batch_invariant_from_env():
            logger.info("batch-invariant mode: on (%s=1)", BATCH_INVARIANT_ENV)
            return True
        return False

    def create_engine_config(self, free_memory: Callable[[str], int] | None = None) -> EngineConfig:
        """The engine's config. ``free_memory(device)`` (default: :func:`available_memory`)
        gives the free bytes ``gpu_memory_utilization`` is a fraction of."""
        parse_device(self.device)  # before anything is loaded: a clear error for a bad device
        tokenizer = self._resolve_tokenizer()  # before the model: a bad one fails first
        path, name, gguf_file, source_defaults = self._resolve_model()
        if tokenizer is not None and Path(tokenizer) == path.resolve():
            tokenizer = None  # the model folder itself
        self._log_vllm_noops(path)
        served = self.served_model_name
        if isinstance(served, list):
            if len(served) > 1:
                raise ValueError(f"served_model_name: one name per engine, got {served}")
            served = served[0] if served else None
        return EngineConfig(
            model=ModelConfig(
                path=str(path),
                dtype=auto_dtype(self.device) if self.dtype == "auto" else parse_dtype(self.dtype),
                max_model_len=self.max_model_len,
                seed=self.seed,
                served_name=served or name,
                prepack_weights=self.prepack_weights,
                weight_dtype=None
                if self.weight_dtype == "auto"
                else parse_dtype(self.weight_dtype),
                attention_backend=self.attention_backend,  # type: ignore[arg-type]
                fused_ops=self.fused_ops,
                enforce_eager=self.enforce_eager,
                warmup=self.warmup,
                chat_template=None
                if self.chat_template is None
                else load_chat_template(self.chat_template),
                logits_processors=tuple(
                    load_processor_class(p) for p in self.logits_processors or ()
                ),
                pooling=self.pooling,  # type: ignore[arg-type]
                task=self.task,
                enable_sleep_mode=self.enable_sleep_mode,
                quantization=self.quantization,  # type: ignore[arg-type]
                quantization_group_size=self.quantization_group_size,
                quantization_activations=self.quantization_activations,  # type: ignore[arg-type]
                quantization_lm_head=self.quantization_lm_head,
                gguf_file=gguf_file,
                model_impl=self.model_impl,  # type: ignore[arg-type]
                generation_config=self.generation_config,  # type: ignore[arg-type]
                source_sampling_defaults=tuple(source_defaults.items()),
                max_logprobs=self.max_logprobs,
                max_beam_width=self.max_beam_width,
                tokenizer=tokenizer,
                batch_invariant=self._batch_invariant(),
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory=self._kv_cache_bytes(free_memory),
                gpu_memory_utilization=self._cuda_utilization(),
                swap_space=parse_bytes(self.swap_space),
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                kv_policy=self.kv_policy,  # type: ignore[arg-type]
                preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
                scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
                priority_scheduling_preemption_threshold=(
                    self.priority_scheduling_preemption_threshold
                ),
            ),
            device=self.device,
            speculative=self.speculative(),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,  # type: ignore[arg-type]
                num_threads=self.num_threads,
                cpu_cores=self._cpu_cores(),
            ),
            structured_outputs=StructuredOutputsConfig(
                compile_timeout=self.grammar_compile_timeout,
                compile_max_memory=parse_bytes(self.grammar_compile_max_memory),
                cache_memory=parse_bytes(self.grammar_cache_memory),
            ),
            lora=self.lora_config(),
            compilation=CompilationConfig(
                cudagraph_capture_sizes=resolve_capture_sizes(
                    self.cuda_graph_sizes, self.max_cudagraph_capture_size, self.max_num_seqs
                ),
                max_seq_len_to_capture=self.max_seq_len_to_capture,
            ),
        )

    def _cpu_cores(self) -> tuple[tuple[int, ...], ...] | None:
        """Each rank's cores (``cpu_binding.resolve_cpu_cores``); None: no binding. CPU only:
        a GPU's host threads are left to torch."""
        if parse_device(self.device) != "cpu":
            return None
        from kvserve.worker.cpu_binding import resolve_cpu_cores

        return resolve_cpu_cores(self.cpu_cores, self.tensor_parallel_size, self.num_threads)

    def _resolve_model(self) -> tuple[Path, str, str | None, dict[str, Any]]:
        """(model folder, default served name, the GGUF file behind it if any, the source's
        sampling defaults): a local folder, a .gguf file (converted into kvserve's cache),
        the built-in model, a model of Ollama's store (``ollama:name:tag`` or a manifest's
        path, ``model/ollama.py``; served under Ollama's name) or a Hugging Face Hub id
        (``model/hub.py``; served under the id, as vLLM does)."""
        from kvserve.model import ollama
        from kvserve.model.builtin import converted_gguf_path, find_builtin_gguf, resolve_model

        model = self.model
        if model is None:
            path, name = resolve_model(None)
            return path, name, str(find_builtin_gguf()), {}
        if ollama.is_ollama_ref(model) or ollama.is_manifest_path(model):
            found = ollama.resolve_ollama(model)
            ollama.log_unapplied(found)
            folder = converted_gguf_path(found.gguf, content_id=found.content_id)
            return folder, found.name, str(found.gguf), found.sampling_defaults()
        hub = parse_hub_model(model)
        if hub is None:
            if self.revision is not None:
                raise ValueError(f"revision {self.revision!r} (--revision) is for Hugging Face "
                                 f"Hub ids; {model!r} is a local path")  # fmt: skip
            if Path(model).is_dir():
                return Path(model), Path(model).name, None, {}
            local = Path(model).expanduser()
            if not local.exists():
                raise ValueError(
                    f"model {model!r} is neither a local model folder, a .gguf file nor a "
                    "Hugging Face Hub id (org/name, org/name:file.gguf)"
                )
            gguf = str(local.resolve()) if local.suffix.lower() == ".gguf" else None
            return (*resolve_model(model), gguf, {})
        fetched = resolve_hub_model(hub, self.revision, self.download_dir)
        if fetched.suffix.lower() == ".gguf":
            return resolve_model(str(fetched))[0], model, str(fetched.resolve()), {}
        return fetched, model, None, {}

    def _cuda_utilization(self) -> float | None:
        """vLLM's ``gpu_memory_utilization`` on CUDA: the given value, else 0.9 when no other
        KV size is given (vLLM's default); None on a CPU."""
        if parse_device(self.device) == "cpu":
            return None
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        if self.kv_cache_memory is None and self.num_kv_blocks is None:
            return 0.9
        return None

    def _kv_cache_bytes(self, free_memory: Callable[[str], int] | None) -> int | None:
        if parse_device(self.device) != "cpu":  # CUDA: sized by the runner after the load
            return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
        if self.gpu_memory_utilization is None:
            return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
        free = (free_memory or available_memory)(self.device)
        size = int(self.gpu_memory_utilization * free)
        logger.info(
            "gpu_memory_utilization %.3g: KV cache %.1f MiB of %.1f MiB free on %s",
            self.gpu_memory_utilization, size / 2**20, free / 2**20, self.device,
        )  # fmt: skip
        return size

    def _log_vllm_noops(self, path: Path) -> None:
        """Say what the accepted-but-inert vLLM options do here, so none is silently dropped."""
        if self.disable_log_requests:
            logger.info("disable_log_requests: kvserve never logs request contents")


def field_choices(name: str) -> tuple[str, ...]:
    """The allowed values of a field with choices (``kv_policy`` -> preempt, reserve)."""
    return next(f.metadata["choices"] for f in fields(EngineArgs) if f.name == name)
