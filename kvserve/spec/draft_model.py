"""Draft-model proposals: a smaller model with the target's tokenizer runs k greedy steps.

The draft keeps its own paged K/V, in tensors of its own shape but indexed by the target's
block ids: a request's blocks hold both models' K/V for its positions, so the draft needs no
block accounting. The scheduler holds k lookahead slots past each request's tokens (best
effort); the draft writes its proposals' K/V there and never past the blocks a request holds.

The draft computes each request's positions it has not seen yet (all of a new request's
prompt on its first proposal, then the tokens the last step accepted) and then k one-token
steps, all requests batched. Its K/V for a request is valid up to ``computed[request]``; the
proposals' own K/V is written again next time (they may be rejected). A preempted request
lost its blocks, so the draft starts it over.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.model.base import CausalLM, ForwardBatch
from kvserve.sample.sampler import greedy_ids
from kvserve.spec.proposer import ProposalInput, Proposer
from kvserve.worker.inputs import allocate_kv_caches, build_metadata


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: CausalLM,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attn_backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.attn_backend = attn_backend  # the draft's own (its gather buffers, head size)
        # One (K, V) pair per draft layer, indexed by the target's block ids.
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, device)
        self.computed: dict[str, int] = {}  # request id -> positions whose draft K/V is valid

    def forget(self, finished: Iterable[str], preempted: Iterable[str]) -> None:
        for rid in (*finished, *preempted):
            self.computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, batch: list[ProposalInput]) -> dict[str, list[int]]:
        items: list[tuple[ProposalInput, int]] = []  # (request, its number of proposals)
        for item in batch:
            room = len(item.block_table) * self.block_size - len(item.token_ids) + 1
            k = min(self.num_speculative_tokens, item.max_tokens, room)
            if k > 0:
                items.append((item, k))
        if not items:
            return {}
        # Step 0: every position the draft has not computed, up to the last token.
        rows, ids = [], []
        for item, _ in items:
            length = len(item.token_ids)
            start = min(self.computed.get(item.request_id, 0), length - 1)
            rows.append((item.block_table, start, length - start))
            ids.extend(item.token_ids[start:])
            self.computed[item.request_id] = length
        last = self._step(rows, ids)  # [N] the first proposal of each request
        proposals = [[t] for t in last]
        for j in range(1, self.num_speculative_tokens):
            live = [i for i, (_, k) in enumerate(items) if k > j]
            if not live:
                break
            rows = [(items[i][0].block_table, len(items[i][0].token_ids) + j - 1, 1) for i in live]
            nxt = self._step(rows, [proposals[i][-1] for i in live])
            for i, t in zip(live, nxt, strict=True):
                proposals[i].append(t)
        return {item.request_id: p for (item, _), p in zip(items, proposals, strict=True)}

    def _step(self, rows: list[tuple[list[int], int, int]], ids: list[int]) -> list[int]:
        """One draft forward over ``rows``; the argmax token after each row's last position."""
        md, positions = build_metadata(rows, self.block_size, self.device)
        md = self.attn_backend.build_metadata(md)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        batch = ForwardBatch(input_ids, positions, self.kv_caches, md, self.attn_backend)
        hidden = self.model(batch)  # [T, hidden]
        last = [qsl - 1 for qsl in md.query_start_loc[1:]]
        logits = self.model.compute_logits(hidden[last])  # [N, V]
        return greedy_ids(logits).tolist()
