"""``EngineArgs`` -> ``EngineConfig``: resolving the model and tokenizer (local, GGUF, Ollama,
Hugging Face Hub), sizing the KV cache, and building each component's frozen config.

``build_engine_config`` is ``EngineArgs.create_engine_config``; the options were checked
already (``arg_checks.py``), so what fails here needs the model or the device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    auto_dtype,
    parse_bytes,
    parse_device,
    parse_dtype,
    resolve_capture_sizes,
)
from kvserve.engine.arg_checks import cpu_cores, load_chat_template, lora_config, speculative_config
from kvserve.engine.arg_fields import EngineArgFields
from kvserve.model.hub import (
    is_offline,
    parse_hub_model,
    resolve_hub_model,
    resolve_hub_tokenizer,
)
from kvserve.ops.batch_invariant import BATCH_INVARIANT_ENV, batch_invariant_from_env
from kvserve.sample.custom_processors import load_processor_class

logger = logging.getLogger("kvserve")


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


def build_engine_config(args: EngineArgFields, free_memory: Callable[[str], int]) -> EngineConfig:
    """The engine's config. ``free_memory(device)`` gives the free bytes
    ``gpu_memory_utilization`` is a fraction of."""
    parse_device(args.device)  # before anything is loaded: a clear error for a bad device
    tokenizer = resolve_tokenizer(args)  # before the model: a bad one fails first
    path, name, gguf_file, source_defaults = resolve_model(args)
    if tokenizer is not None and Path(tokenizer) == path.resolve():
        tokenizer = None  # the model folder itself
    _log_vllm_noops(args)
    served = args.served_model_name
    if isinstance(served, list):
        if len(served) > 1:
            raise ValueError(f"served_model_name: one name per engine, got {served}")
        served = served[0] if served else None
    model = _model_config(args, path, served or name, gguf_file, source_defaults, tokenizer)
    return EngineConfig(
        model=model,
        cache=_cache_config(args, free_memory),
        scheduler=_scheduler_config(args),
        device=args.device,
        speculative=speculative_config(args),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,  # type: ignore[arg-type]
            num_threads=args.num_threads,
            cpu_cores=cpu_cores(args),
        ),
        structured_outputs=StructuredOutputsConfig(
            compile_timeout=args.grammar_compile_timeout,
            compile_max_memory=parse_bytes(args.grammar_compile_max_memory),
            cache_memory=parse_bytes(args.grammar_cache_memory),
        ),
        lora=lora_config(args),
        compilation=CompilationConfig(
            cudagraph_capture_sizes=resolve_capture_sizes(
                args.cuda_graph_sizes, args.max_cudagraph_capture_size, args.max_num_seqs
            ),
            max_seq_len_to_capture=args.max_seq_len_to_capture,
        ),
    )


def _model_config(
    args: EngineArgFields,
    path: Path,
    served_name: str,
    gguf_file: str | None,
    source_defaults: dict[str, Any],
    tokenizer: str | None,
) -> ModelConfig:
    return ModelConfig(
        path=str(path),
        dtype=auto_dtype(args.device) if args.dtype == "auto" else parse_dtype(args.dtype),
        max_model_len=args.max_model_len,
        seed=args.seed,
        served_name=served_name,
        prepack_weights=args.prepack_weights,
        cpu_linear_kernel=args.cpu_linear_kernel,  # type: ignore[arg-type]
        weight_dtype=None if args.weight_dtype == "auto" else parse_dtype(args.weight_dtype),
        attention_backend=args.attention_backend,  # type: ignore[arg-type]
        fused_ops=args.fused_ops,
        enforce_eager=args.enforce_eager,
        warmup=args.warmup,
        chat_template=None
        if args.chat_template is None
        else load_chat_template(args.chat_template),
        logits_processors=tuple(load_processor_class(p) for p in args.logits_processors or ()),
        pooling=args.pooling,  # type: ignore[arg-type]
        task=args.task,
        enable_sleep_mode=args.enable_sleep_mode,
        quantization=args.quantization,  # type: ignore[arg-type]
        quantization_group_size=args.quantization_group_size,
        quantization_activations=args.quantization_activations,  # type: ignore[arg-type]
        quantization_lm_head=args.quantization_lm_head,
        gguf_file=gguf_file,
        model_impl=args.model_impl,  # type: ignore[arg-type]
        generation_config=args.generation_config,  # type: ignore[arg-type]
        source_sampling_defaults=tuple(source_defaults.items()),
        max_logprobs=args.max_logprobs,
        max_beam_width=args.max_beam_width,
        tokenizer=tokenizer,
        batch_invariant=_batch_invariant(args),
    )


def _cache_config(args: EngineArgFields, free_memory: Callable[[str], int]) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=_kv_cache_bytes(args, free_memory),
        gpu_memory_utilization=_cuda_utilization(args),
        swap_space=parse_bytes(args.swap_space),
        enable_prefix_caching=args.enable_prefix_caching,
    )


def _scheduler_config(args: EngineArgFields) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_policy=args.kv_policy,  # type: ignore[arg-type]
        preemption_mode=args.preemption_mode,  # type: ignore[arg-type]
        scheduling_policy=args.scheduling_policy,  # type: ignore[arg-type]
        priority_scheduling_preemption_threshold=args.priority_scheduling_preemption_threshold,
    )


def _batch_invariant(args: EngineArgFields) -> bool:
    """``--batch-invariant``, or vLLM's switch for the mode, ``$VLLM_BATCH_INVARIANT=1``."""
    if args.batch_invariant:
        return True
    if batch_invariant_from_env():
        logger.info("batch-invariant mode: on (%s=1)", BATCH_INVARIANT_ENV)
        return True
    return False


def _cuda_utilization(args: EngineArgFields) -> float | None:
    """vLLM's ``gpu_memory_utilization`` on CUDA: the given value, else 0.9 when no other
    KV size is given (vLLM's default); None on a CPU."""
    if parse_device(args.device) == "cpu":
        return None
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    if args.kv_cache_memory is None and args.num_kv_blocks is None:
        return 0.9
    return None


def _kv_cache_bytes(args: EngineArgFields, free_memory: Callable[[str], int]) -> int | None:
    if parse_device(args.device) != "cpu":  # CUDA: sized by the runner after the load
        return None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory)
    if args.gpu_memory_utilization is None:
        return None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory)
    free = free_memory(args.device)
    size = int(args.gpu_memory_utilization * free)
    logger.info(
        "gpu_memory_utilization %.3g: KV cache %.1f MiB of %.1f MiB free on %s",
        args.gpu_memory_utilization, size / 2**20, free / 2**20, args.device,
    )  # fmt: skip
    return size


def _log_vllm_noops(args: EngineArgFields) -> None:
    """Say what the accepted-but-inert vLLM options do here, so none is silently dropped."""
    if args.disable_log_requests:
        logger.info("disable_log_requests: kvserve never logs request contents")


def check_hub_cache(args: EngineArgFields) -> None:
    """With HF_HUB_OFFLINE, resolve the Hub ids (tokenizer, model) now: from the cache
    only, so at once, and a ValueError naming the id and the cache if one is missing."""
    if is_offline():
        resolve_tokenizer(args)
        hub = parse_hub_model(args.model) if args.model else None
        if hub is not None:
            resolve_hub_model(hub, args.revision, args.download_dir)


def resolve_tokenizer(args: EngineArgFields) -> str | None:
    """The tokenizer folder when it is not the model folder's: a local folder, or a Hub
    id's tokenizer files (fetched before the model, so a bad id fails first)."""
    tok = args.tokenizer
    if tok is None or tok == args.model:
        return None
    local = Path(tok).expanduser()
    if local.is_dir():
        if args.model is not None and local.resolve() == Path(args.model).resolve():
            return None  # the model folder, spelled another way
        if not any((local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"tokenizer {tok!r} (--tokenizer) has no tokenizer.json or "
                             "tokenizer_config.json")  # fmt: skip
        return str(local.resolve())
    hub = parse_hub_model(tok)
    assert hub is not None  # check_args checked it
    try:
        folder = resolve_hub_tokenizer(hub, args.tokenizer_revision, args.download_dir)
    except ValueError as e:
        raise ValueError(f"tokenizer {tok!r} (--tokenizer): {e}") from e
    return str(folder)


def resolve_model(args: EngineArgFields) -> tuple[Path, str, str | None, dict[str, Any]]:
    """(model folder, default served name, the GGUF file behind it if any, the source's
    sampling defaults): a local folder, a .gguf file (converted into kvserve's cache),
    the built-in model, a model of Ollama's store (``ollama:name:tag`` or a manifest's
    path, ``model/ollama.py``; served under Ollama's name) or a Hugging Face Hub id
    (``model/hub.py``; served under the id, as vLLM does)."""
    from kvserve.model import builtin, ollama

    model = args.model
    if model is None:
        path, name = builtin.resolve_model(None)
        return path, name, str(builtin.find_builtin_gguf()), {}
    if ollama.is_ollama_ref(model) or ollama.is_manifest_path(model):
        found = ollama.resolve_ollama(model)
        ollama.log_unapplied(found)
        folder = builtin.converted_gguf_path(found.gguf, content_id=found.content_id)
        return folder, found.name, str(found.gguf), found.sampling_defaults()
    hub = parse_hub_model(model)
    if hub is None:
        if args.revision is not None:
            raise ValueError(f"revision {args.revision!r} (--revision) is for Hugging Face "
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
        return (*builtin.resolve_model(model), gguf, {})
    fetched = resolve_hub_model(hub, args.revision, args.download_dir)
    if fetched.suffix.lower() == ".gguf":
        return builtin.resolve_model(str(fetched))[0], model, str(fetched.resolve()), {}
    return fetched, model, None, {}
