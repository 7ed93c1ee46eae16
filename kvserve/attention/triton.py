"""``TRITON_ATTN``: the Triton paged-attention kernels (``kvserve/ops/triton``).

Every row of a step in at most two launches per layer: decode rows and speculative
verification rows (one entry per query) through the decode kernel, which reads K/V in place
through the block tables with split-K over long contexts, and every other multi-token row
through the variable-length prefill kernel (causal with the cached context as offset, no
padding, no mask tensors). The step's plan (rows split between the kernels, one host-to-device
copy of the lists) is built once per step and GQA group and reused by every layer.

On CUDA this is the fast backend (``auto``'s first choice there). On a CPU it runs only under
Triton's interpreter (``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets where there is
no CUDA): that is how CI checks it against the reference, token for token on a whole engine,
at ~3 ms per kernel program, so ``auto`` never picks it on a CPU. The interpreter computes
bf16 ``tl.dot`` wrongly (triton-lang/triton#11584), so bf16 is refused there.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.paged import AttentionMetadata
from kvserve.config import AttentionBackendEnum


class TritonAttentionBackend(AttentionBackend):
    name = AttentionBackendEnum.TRITON_ATTN
    device_types = frozenset({"cuda", "cpu"})  # cpu: under the interpreter only
    dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supports_static_decode = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # GQA group -> (the step's metadata, its plan); cleared every step, and checked
        # against the metadata it was built for (a path that skips build_metadata replans)
        self._plans: dict[int, tuple[AttentionMetadata, object]] = {}

    @classmethod
    def supports(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        *,
        sliding_window: bool = False,
        soft_cap: bool = False,
        sinks: bool = False,
    ) -> str | None:
        reason = super().supports(
            device, dtype, head_size, sliding_window=sliding_window, soft_cap=soft_cap,
            sinks=sinks,
        )  # fmt: skip
        if reason is not None or device.type != "cpu":
            return reason
        from kvserve.ops.triton.paged_attention import interpreted

        if not interpreted():
            return "on a CPU its kernels run only in Triton's interpreter (TRITON_INTERPRET=1)"
        if dtype == torch.bfloat16:
            return "Triton's interpreter computes bfloat16 dots wrongly (triton#11584)"
        return None

    @classmethod
    def available(cls) -> str | None:
        try:
            import kvserve.ops.triton.paged_attention  # noqa: F401
        except ImportError as exc:  # no triton package (it is in the test extra)
            return f"Triton cannot be imported ({exc})"
        return None

    def build_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """No row split or gather buffers: the plan is built at the first layer (it needs
        the GQA group, which the query's shape gives) and kept for the step's other layers."""
        self._plans.clear()
        return md

    def static_decode_metadata(
        self,
        slot_mapping: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        seq_lens: torch.Tensor,  # [B] int32 on the device
        block_size: int,
        max_len: int,
    ) -> AttentionMetadata:
        from kvserve.ops.triton.paged_attention import static_decode_plan

        b = slot_mapping.shape[0]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=list(range(b + 1)),  # one query per row
            seq_lens=[],  # on the device only (static_plan)
            block_tables=block_tables,
            block_size=block_size,
            prefill_rows=[],
            static_plan=static_decode_plan(block_tables, seq_lens, max_len),
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] (the step's K/V already written)
        k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from kvserve.ops.triton.paged_attention import plan_attention, run_attention

        group = q.shape[1] // k_cache.shape[1]  # query heads per KV head
        cached = self._plans.get(group)
        if md.static_plan is not None:  # decode only: the same plan for every group
            plan = md.static_plan
        elif cached is not None and cached[0] is md:
            plan = cached[1]
        else:
            plan = plan_attention(md, group, q.device)
            self._plans[group] = (md, plan)
        out = torch.empty_like(q)  # [T, H, D]
        run_attention(
            plan, q, k_cache, v_cache, scale, out,  # type: ignore[arg-type]
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        )  # fmt: skip
        return out
