"""The synchronous engine: add requests, call ``step()``, collect ``RequestOutput``s.

One step = schedule -> (swap copies) -> forward -> sample -> scheduler update ->
detokenize / stop strings -> outputs. ``LLM`` (offline) and ``AsyncLLMEngine`` (server)
both drive this class.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.config import EngineConfig, PreemptionMode
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_for
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler
from kvserve.engine.output_processor import CompletionState, ParentRequest, update_text
from kvserve.model.loader import load_hf_config, load_model, model_max_len
from kvserve.model.packed_linear import packing_supported
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.worker.malloc_tuning import keep_freed_memory
from kvserve.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = logging.getLogger("kvserve")

DEFAULT_KV_CACHE_MEMORY = 1024**3  # 1 GiB when neither a size nor a block count is given

# A prompt: text, token ids, or vLLM's dict forms.
PromptType = str | list[int] | dict[str, Any]


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _eos_ids(path: Path, tokenizer: PreTrainedTokenizerBase | None, hf_config: Any) -> list[int]:
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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(config.device)
        path = Path(mc.path)
        self.hf_config = load_hf_config(path)
        self.max_model_len = min(
            mc.max_model_len or model_max_len(self.hf_config), model_max_len(self.hf_config)
        )
        self.model_name = mc.served_name or path.name
        self.tokenizer = load_tokenizer(path)
        # DecodeStream works on the Rust tokenizer behind the transformers wrapper.
        self._backend_tokenizer = self.tokenizer.backend_tokenizer if self.tokenizer else None
        self.eos_token_ids = _eos_ids(path, self.tokenizer, self.hf_config)
        t0 = time.perf_counter()
        model = load_model(
            path, mc.dtype, self.device, self.max_model_len, mc.prepack_weights, mc.fused_ops
        )
        per_block = kv_bytes_per_block(model, cc.block_size, mc.dtype)
        num_blocks = cc.num_kv_blocks or max(
            1, (cc.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) // per_block
        )
        swap = config.scheduler.preemption_mode is PreemptionMode.SWAP
        # More swap than twice the device cache is never useful here (a full swap space
        # falls back to recompute), and capping keeps a tiny model from a huge block list.
        num_swap = min(cc.swap_space // per_block, 2 * num_blocks) if swap else 0
        self.kv = KVCacheManager(num_blocks, cc.block_size, num_swap)
        self.runner = ModelRunner(
            model,
            cc.block_size,
            num_blocks,
            num_swap,
            mc.dtype,
            self.device,
            mc.seed,
            mc.attention_backend,
        )
        if self.device.type == "cpu":
            # After the weights and KV cache exist, so only step-time buffers are affected.
            keep_freed_memory()
        self.warmup_tokens = 0  # tokens of the start-up dummy prefill (0: none)
        if mc.warmup and mc.prepack_weights and packing_supported(self.device, mc.dtype):
            # After the malloc tuning, so the warm-up's buffers stay in the heap for reuse.
            t1 = time.perf_counter()
            max_tokens = config.scheduler.max_num_batched_tokens
            self.warmup_tokens = self.runner.warm_up(max_tokens, self.max_model_len)
            logger.info(
                "warm-up: %d-token dummy prefill in %.2fs",
                self.warmup_tokens,
                time.perf_counter() - t1,
            )
        self.scheduler = Scheduler(config.scheduler, cc, self.kv)
        self.kv_info = {
            "num_blocks": num_blocks,
            "block_size": cc.block_size,
            "num_tokens": num_blocks * cc.block_size,
            "bytes": num_blocks * per_block,
            "num_swap_blocks": num_swap,
        }
        logger.info(
            "loaded %s in %.1fs; KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB; "
            "decode attention: %s; fused ops: %s",
            self.model_name,
            time.perf_counter() - t0,
            num_blocks,
            cc.block_size,
            num_blocks * cc.block_size,
            num_blocks * per_block / 2**20,
            "cpu_kernel" if self.runner.use_decode_kernel else "sdpa",
            "on" if model.norm.fused else "off",
        )
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, ParentRequest] = {}
        self._child_state: dict[str, CompletionState] = {}

    # -- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) for any accepted prompt form; raises ValueError if bad."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; send prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check a request can ever run; returns its resolved max_tokens."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary (size {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                f"tokens, which leaves no room to generate"
            )
        capacity = self.kv.num_tokens_capacity
        room = min(self.max_model_len, capacity) - n
        max_tokens = min(params.max_tokens, self.max_model_len - n) if params.max_tokens else room
        if (
            max_tokens < 1
            or blocks_for(n + max_tokens, self.kv.block_size) > self.kv.pool.num_blocks
        ):
            raise ValueError(
                f"the request needs {n} prompt + {max_tokens or 1} output tokens but the KV cache "
                f"holds only {capacity} tokens ({self.kv.pool.num_blocks} blocks); it can never "
                f"fit: raise kv_cache_memory / num_kv_blocks or lower max_tokens"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(ids, params)
        parent = ParentRequest(request_id, text, ids, params)
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Distinct but reproducible streams per completion, as vLLM does.
                child_params = dataclasses.replace(params, seed=params.seed + i)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                cid, ids, child_params, max_tokens, self.eos_token_ids, arrival_time, self.device
            )
            stream = None
            if self.tokenizer is not None and params.detokenize:
                stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
            state = CompletionState(i, req, stream)
            parent.children.append(state)
            self._child_parent[cid] = parent
            self._child_state[cid] = state
        self._parents[request_id] = parent
        for state in parent.children:
            self.scheduler.add_request(state.request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Cancel requests; their KV blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            cids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(cids, RequestStatus.FINISHED_ABORTED)
            for cid in cids:
                self._child_parent.pop(cid, None)
                self._child_state.pop(cid, None)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (a request larger than this can never run)."""
        return self.kv.num_tokens_capacity

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    def num_waiting(self) -> int:
        """Requests queued and not yet running (preempted-with-recompute ones included)."""
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        timings = self.runner.timings
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        timings.schedule += time.perf_counter() - t0
        out = self.runner.execute(sched)
        t1 = time.perf_counter()
        updated, finished = self.scheduler.update_from_output(sched, out.sampled)
        now = time.monotonic()
        stopped: list[str] = []
        for req in updated:
            rid = req.request_id
            state = self._child_state[rid]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if rid in out.sampled_logprob:
                req.cumulative_logprob += out.sampled_logprob[rid]
                req.logprobs.append(out.top_logprobs.get(rid, {}))
            parent = self._child_parent[rid]
            if update_text(state, self._backend_tokenizer, parent.params):
                if req.status.finished:
                    req.status = RequestStatus.FINISHED_STOPPED  # the stop string wins
                else:
                    stopped.append(rid)
        finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for req in finished:
            state = self._child_state[req.request_id]
            state.finish_reason = req.status.finish_reason
            if state.stop_reason is None:
                state.stop_reason = req.stop_reason
            req.metrics.finished_time = now
        outputs = self._collect(
            {self._child_parent[r.request_id].request_id: None for r in updated}
        )
        timings.output += time.perf_counter() - t1
        return outputs

    def _collect(self, parent_ids: dict[str, None]) -> list[RequestOutput]:
        outputs = []
        for pid in parent_ids:
            parent = self._parents[pid]
            outputs.append(parent.output())
            if parent.finished:
                del self._parents[pid]
                for c in parent.children:
                    self._child_parent.pop(c.request.request_id, None)
                    self._child_state.pop(c.request.request_id, None)
        return outputs

    def stats(self) -> dict[str, Any]:
        """Totals and the current batch state (plain numbers, for users and /metrics)."""
        s = dataclasses.asdict(self.scheduler.stats)
        s["num_kv_blocks"] = self.kv.pool.num_blocks
        s["num_free_kv_blocks"] = self.kv.pool.num_free_blocks
        s["step_time"] = self.runner.timings.as_dict()
        return s
