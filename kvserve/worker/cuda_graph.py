"""CUDA graphs for decode-only steps (vLLM's full CUDA graphs of decode batches).

A GPU decode step of a small model is bound by launches and host work, not by the GPU: each
layer issues a dozen or more kernels, each a few microseconds of Python and driver time.
Captured once per batch size at start-up, a step replays the whole forward as one launch.

What is captured: the model's forward (embeddings to the final norm) for ``B`` rows of one
decode token each, ``B`` in ``CompilationConfig.cudagraph_capture_sizes``, largest first, into
one shared memory pool. What stays outside, as in vLLM: the logits (``compute_logits`` of the
real rows) and sampling. Which steps replay (``decode_rows``): every row one query token that
samples, no speculative proposals, no LoRA adapter, no context past ``max_len``; a batch pads
up to the next captured size, and a larger one, or any other step, runs eager
(``ModelRunner._run``).

Static inputs (``StaticDecodeInputs``): token ids, positions, slots, context lengths and block
tables ``[B, ceil(max_len / block_size)]`` (``max_len``: min(max_model_len,
max_seq_len_to_capture), vLLM's 8,192 by default; a longer context runs eager) live at fixed
device addresses, laid out per batch size in one int64 buffer that each step fills from one
pinned host buffer with one non-blocking copy. The attention plan is the backend's static one
(``AttentionBackend.static_decode_metadata``): read from those tensors alone, with split-K
sized from ``max_len``, so the launch grid depends on ``B`` only.

Padding rows: token ``PAD_TOKEN_ID`` at position 0 with a one-token context in the scratch
block, block ``num_blocks`` of the KV tensors (one past the blocks the engine's pool hands
out, allocated only when graphs may run): no padded K/V lands in a request's block, whatever
writes the cache (the fused Triton or C++ kernels, ``write_kv``), and every padded row reads
the slot it wrote this step, so its numbers are finite. Rows never mix (each row's attention
reads its own block table), so a real row gets what it would in an eager batch of ``B`` rows
(a matmul library may round ``B`` rows differently from ``n``).

Fail-safe: a capture, or a graph step, that raises is logged once as a warning and the runner
runs every step eager from then on.
Without a GPU, ``capture=False`` runs the very callable that would be captured (``forward``)
eagerly, which is how CI holds this path to the eager one (``tests/worker/test_cuda_graph.py``,
Triton's interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.model.base import CausalLM, ForwardBatch, KVCaches
from kvserve.worker.input_batch import StepRows

logger = logging.getLogger("kvserve.runner")

PAD_TOKEN_ID = 0  # a padding row's token (any valid id: its output is never read)

DecodeRow = tuple[int, int, list[int]]  # (token id, its position, the request's block table)


def decode_rows(rows: StepRows) -> list[DecodeRow] | None:
    """The step's rows when a captured graph can run it: every row one query token that
    samples (so its hidden state is the row's logits row, as eager), no proposals, no LoRA
    adapter; else None (eager)."""
    out: list[DecodeRow] = []
    for r in rows.scheduled:
        rid = r.request_id
        if (
            rows.num_scheduled_tokens[rid] != 1
            or rows.scheduled_spec_decode_tokens.get(rid)
            or r.lora_request is not None
            or not rows.samples(r)
        ):
            return None
        p = r.num_computed_tokens
        out.append((r.all_token_ids[p], p, r.block_ids))
    return out


def graphs_off_reason(
    device: torch.device,
    enforce_eager: bool,
    backend: AttentionBackend,
    model: CausalLM,
    world_size: int,
) -> str | None:
    """Why decode steps will not run as CUDA graphs (None: they will)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if enforce_eager:
        return "enforce_eager"
    if not backend.supports_static_decode:
        return f"attention backend {backend.name.value} plans on the host (use TRITON_ATTN)"
    if world_size > 1:
        return "tensor parallelism (its collectives are not captured)"
    if not getattr(model, "supports_cuda_graphs", False):
        return f"{type(model).__name__} is not known to be capturable (host syncs)"
    return None


class StaticDecodeInputs:
    """Decode step inputs of up to ``max_size`` rows at fixed device addresses.

    One int64 buffer holds, for a batch of ``B`` rows, ids ``[B]``, positions ``[B]``, slots
    ``[B]``, context lengths ``[B]`` and block tables ``[B, max_blocks]`` one after another
    (``_split``): a step copies just its ``B * (4 + max_blocks)`` values, once, from a pinned
    host buffer of the same layout. The kernels read lengths as int32 (``seq_lens32``,
    converted on the device inside the captured forward).
    """

    def __init__(
        self,
        max_size: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.max_size, self.max_blocks = max_size, max_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        self.width = 4 + max_blocks  # values per row
        cuda = device.type == "cuda"
        n = max_size * self.width
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=cuda)  # [max_size * width]
        self._host_np = self.host.numpy()
        self.device_buf = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens32 = torch.ones(max_size, dtype=torch.int32, device=device)  # [max_size]
        # the last copy's completion: the host buffer is not rewritten before it (it is,
        # in practice, since sampling reads the step's results back before the next fill)
        self._copied = torch.cuda.Event() if cuda else None

    def _split(self, buf, size: int):  # type: ignore[no-untyped-def]  # numpy or torch
        """(ids, positions, slots, lengths ``[size]`` each, block tables
        ``[size, max_blocks]``): views of ``buf`` laid out for ``size`` rows."""
        ids, pos, slots, lens = (buf[i * size : (i + 1) * size] for i in range(4))
        tables = buf[4 * size : size * self.width].reshape(size, self.max_blocks)
        return ids, pos, slots, lens, tables

    def device_views(
        self, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._split(self.device_buf, size)  # type: ignore[no-any-return]

    def fill(self, rows: list[DecodeRow], size: int) -> None:
        """Write ``rows`` and ``size - len(rows)`` padding rows, then queue the one copy."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        ids, pos, slots, lens, tables = self._split(self._host_np, size)
        bs, scratch, n = self.block_size, self.scratch_block, len(rows)
        tables.fill(scratch)  # past a row's blocks: never read (its length stops the kernel)
        if n:
            ids[:n] = [token for token, _, _ in rows]
            pos[:n] = [p for _, p, _ in rows]
            lens[:n] = pos[:n] + 1
            slots[:n] = [blocks[p // bs] * bs + p % bs for _, p, blocks in rows]
        for i, (_, _, blocks) in enumerate(rows):
            # the blocks of its p + 1 tokens fit (p < max_len); any after them (lookahead
            # slots of a draft model) are never read
            used = blocks[: self.max_blocks]
            tables[i, : len(used)] = used
        ids[n:], pos[n:], slots[n:], lens[n:] = PAD_TOKEN_ID, 0, scratch * bs, 1
        count = size * self.width
        self.device_buf[:count].copy_(self.host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """The runner's decode-only steps through static inputs, replayed as CUDA graphs once
    ``capture`` ran (without it, the same ``forward`` runs eagerly: the CPU tests' path)."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_caches: KVCaches,
        sizes: tuple[int, ...],
        *,
        block_size: int,
        max_len: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        """``max_len``: the longest context a replayed step may have (min(max_model_len,
        max_seq_len_to_capture)); it sizes the block tables and the static split-K."""
        if not backend.supports_static_decode:
            raise ValueError(f"attention backend {backend.name.value} has no static decode plan")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        self.model, self.device = model, device
        self.sizes = tuple(sorted(set(sizes)))
        self.max_len = max_len
        max_blocks = -(-max_len // block_size)
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks, block_size, scratch_block,
                                         device)  # fmt: skip
        self._batches: dict[int, ForwardBatch] = {}
        for size in self.sizes:
            ids, pos, slots, _, tables = self.inputs.device_views(size)
            lens = self.inputs.seq_lens32[:size]
            md = backend.static_decode_metadata(slots, tables, lens, block_size, max_len)
            self._batches[size] = ForwardBatch(ids, pos, kv_caches, md, backend)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states [size, hidden]
        self.pool: object | None = None  # the graphs' shared memory pool
        self.pool_bytes = 0  # device memory the captured graphs hold (measured)
        self.steps = 0  # steps run through here (the tests read it)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size holding ``n`` rows; None: more than the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def prepare(self, rows: list[DecodeRow]) -> int | None:
        """Fill the static inputs with ``rows``, padded; returns the padded size, or None
        (nothing written) when the step must run eager: more rows than the largest size, or
        a context longer than ``max_len``."""
        size = self.padded_size(len(rows))
        if size is None or any(p >= self.max_len for _, p, _ in rows):
            return None
        self.inputs.fill(rows, size)
        return size

    def forward(self, size: int) -> torch.Tensor:
        """What is captured for ``size`` rows: the model over the static inputs. Returns the
        hidden states ``[size, hidden]``."""
        lens = self.inputs.device_views(size)[3]
        self.inputs.seq_lens32[:size].copy_(lens)  # int64 -> int32, on the device
        return self.model(self._batches[size])

    def run(self, size: int, n: int) -> torch.Tensor:
        """The prepared step: the graph's replay (or ``forward``, uncaptured); the hidden
        states of the ``n`` real rows ``[n, hidden]`` (valid until the next step)."""
        graph = self._graphs.get(size)
        if graph is None:
            out = self.forward(size)
        else:
            graph.replay()
            out = self._outputs[size]
        self.steps += 1
        return out[:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse its pool memory), after
        one eager warm-up of each on a side stream (Triton compiles, cuBLAS picks its
        kernels; none of that may happen while capturing). The inputs hold padding rows
        only, so nothing is written outside the scratch block. Raises on any failure,
        leaving nothing captured."""
        dev = self.device
        t0 = time.perf_counter()
        free0 = 0
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for size in reversed(self.sizes):
                    self.inputs.fill([], size)
                    self.forward(size)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # the warm-up's buffers: not the graphs' memory
            free0 = torch.cuda.mem_get_info(dev)[0]
            self.pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = self.forward(size)
                self._graphs[size], self._outputs[size] = graph, out
            torch.cuda.synchronize(dev)
        except BaseException:
            self.release()
            raise
        self.pool_bytes = max(0, free0 - torch.cuda.mem_get_info(dev)[0])
        logger.info(
            "CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1fs (warm-up "
            "included), graph pool %.0f MiB", len(self.sizes), self.sizes[0],
            self.sizes[-1], time.perf_counter() - t0, self.pool_bytes / 2**20,
        )  # fmt: skip

    def release(self) -> None:
        """Drop the graphs and their pool (sleep mode, a failed capture)."""
        self._graphs.clear()
        self._outputs.clear()
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
