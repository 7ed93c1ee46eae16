"""The engine's options as fields: each one's default, help text and what its CLI flag takes.

``EngineArgFields`` only declares; ``EngineArgs`` (``arg_utils.py``) is this class with the
behaviour: the flags (``add_cli_args``), ``LLM``'s keywords (``from_kwargs``), the checks
(``arg_checks.py``) and the ``EngineConfig`` (``arg_config.py``). The field order is the
order of ``--help``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import AttentionBackendEnum


def _opt(
    default: Any,
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    nargs: str | None = None,
    switch: bool = False,
) -> Any:
    """A field with what its CLI flag needs (booleans, and ``switch`` ones whose default is
    None, become ``--x/--no-x``)."""
    meta = {"help": help, "type": type, "choices": choices, "nargs": nargs, "switch": switch}
    return field(default=default, metadata=meta)


def _size_gib_if_bare(value: str) -> str:
    """``--swap-space``: vLLM's unit is GiB, so a bare number means GiB ("4" -> "4GiB")."""
    return f"{value}GiB" if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", value) else value


def _attention_backend_name(value: str) -> str:
    """``--attention-backend``: vLLM's names in any case (``torch_sdpa`` = ``TORCH_SDPA``)."""
    return AttentionBackendEnum.parse(value).value


@dataclass
class EngineArgFields:
    """Every engine option, declared once (no behaviour: see ``EngineArgs``)."""

    # -- the model, its tokenizer and where they come from ------------------------------------
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
    # -- the KV cache -------------------------------------------------------------------------
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
    # -- scheduling ---------------------------------------------------------------------------
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
    # -- kernels and CPU threads --------------------------------------------------------------
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
    prepack_weights: bool = _opt(
        True,
        "CPU: linear weights repacked at load for a faster kernel "
        "(bf16: --cpu-linear-kernel's; float32: oneDNN's, LM head and "
        "gate/up)",
    )
    cpu_linear_kernel: str = _opt(
        "auto", "CPU bf16: the dense linears' kernel: packed (kvserve's layout, vdpbf16ps on "
        "AVX512-BF16), onednn (prepacked), auto (packed where the CPU has AVX512-BF16 and no "
        "AMX, else onednn)",
        choices=("auto", "onednn", "packed"),
    )  # fmt: skip
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
    # -- what the model does (templates, processors, spec decoding, quantization) -------------
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
        "found from its config.json without the flag), or mxfp4 (a gpt-oss checkpoint's MXFP4 "
        "experts kept as stored; without it they are dequantized at load); the embeddings "
        "stay unquantized, the LM head too unless --quantization-lm-head", type=str,
        choices=("int8", "int4", "gguf", "compressed-tensors", "awq", "gptq", "mxfp4"),
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
        "keeps --dtype (exact products with the dequantized weights); auto is int8 where it is "
        "the faster kernel (bf16 on a CPU with VNNI; 4-bit codes and GGUF Q5/Q6 codes on an "
        "AVX2 CPU without VNNI), else none",
        choices=("auto", "int8", "none"),
    )  # fmt: skip
    quantization_lm_head: bool | None = _opt(
        None, "with --quantization: quantize the LM head too (a separate copy when it is tied "
        "to the embeddings): int8 per output channel, or with --quantization gguf the file's "
        "own output tensor (llama.cpp's Q6_K for a Q4_0 model) where kvserve has its type; "
        "native model classes only. Unset: on for --quantization gguf where the file's head "
        "is of such a type and the model is native and unsharded (as llama.cpp runs the "
        "file), else off",
        switch=True,
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
    # -- parallelism and CUDA graphs ----------------------------------------------------------
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
    # -- per-request limits and vLLM's logging switches ---------------------------------------
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
