"""What the engine reads and says at start-up: the tokenizer, the EOS token ids and the
start-up log lines (the model, the KV cache, the execution paths)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import EngineConfig
from kvserve.worker.runner_output import RunnerInfo

logger = logging.getLogger("kvserve")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def eos_token_ids(
    path: Path, tokenizer: PreTrainedTokenizerBase | None, hf_config: Any
) -> list[int]:
    """The EOS token ids: generation_config.json's, else the tokenizer's, else
    config.json's; an empty list when none names one."""
    gen = path / "generation_config.json"
    eos: Any = None
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def log_engine_start(model_name: str, config: EngineConfig, info: RunnerInfo) -> None:
    """The start-up lines: what was loaded and how it runs (rank 0's execution paths)."""
    cc = config.cache
    logger.info(
        "loaded %s in %.1fs (%s executor, %d rank(s)); KV cache: %d blocks x %d tokens = "
        "%d tokens, %.1f MiB; attention backend: %s; fused ops: %s; C++ decode loop: %s%s",
        model_name,
        info.load_seconds,
        config.parallel.distributed_executor_backend.value,  # type: ignore[union-attr]
        config.parallel.world_size,
        info.num_blocks,
        cc.block_size,
        info.num_blocks * cc.block_size,
        info.num_blocks * info.bytes_per_block / 2**20,
        info.attention_backend,
        "on" if info.fused_ops else "off",
        "on" if info.decode_loop else "off",
        f"; CUDA graphs: {len(info.paths.cuda_graphs)} decode batch sizes up to "
        f"{info.paths.cuda_graphs[-1]}"
        if info.paths.cuda_graphs
        else "",
    )
    paths = info.paths
    logger.info(
        "execution paths: CPU capability %s, %s math, %s weights, linears %s, %d thread(s) "
        "per rank, OpenMP threads on cores %s, OMP_WAIT_POLICY %s",
        paths.cpu_capability, paths.dtype, paths.weight_dtype, paths.linears or "(unread)",
        paths.num_threads,
        "|".join(",".join(map(str, c)) for c in paths.thread_cores) or "(unknown)",
        paths.omp_wait_policy or "unset",
    )  # fmt: skip
    if paths.batch_invariant:
        logger.info("batch-invariant mode: on (each row in a fixed order: linears, "
                    "attention per query on CPU_KERNEL, norms, sampling)")  # fmt: skip
