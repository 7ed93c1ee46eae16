"""Prompt logprobs (``SamplingParams.prompt_logprobs``) from a step's hidden states."""

from __future__ import annotations

import torch

from kvserve.model.base import CausalLM
from kvserve.outputs import Logprob, TokenLogprobs
from kvserve.worker.input_batch import CachedRequestState, StepRows

# Prompt logprobs are computed this many positions at a time: a [rows, V] float32 block
# (512 x 49152 x 4 bytes = 96 MiB) instead of one as large as a whole prefill chunk.
PROMPT_LOGPROB_ROWS = 512


Rows = list[tuple[CachedRequestState, int, int, int]]


def prompt_logprob_rows(sched: StepRows) -> Rows:
    """(request, its first row in the flat batch, first position, number of positions) of the
    positions whose logits give prompt logprobs this step. Position p predicts prompt token
    p + 1, so the last prompt position (it predicts the first output token) is not one; the
    positions whose token already has its entry (a recompute after preemption) are skipped."""
    rows = []
    offset = 0
    for req in sched.scheduled:
        n = sched.num_scheduled_tokens[req.request_id]
        have = req.num_prompt_logprobs  # entries the engine holds
        if have is not None:
            start = req.num_computed_tokens
            first = max(start, have - 1)
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > first:
                rows.append((req, offset + first - start, first, end - first))
        offset += n
    return rows


def compute_prompt_logprobs(
    model: CausalLM, rows: Rows, hidden: torch.Tensor
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Prompt logprobs from the hidden states of this step's prompt positions (vLLM's
    semantics: log_softmax of the raw logits in float32; each entry holds the prompt's
    own token first, with its rank, then the top ``prompt_logprobs`` with ranks 1..k).

    Under tensor parallelism every rank calls this (``compute_logits`` is a collective);
    ranks > 0 get no logits and return {}."""
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    for req, row, pos, count in rows:
        targets = req.all_token_ids[pos + 1 : pos + 1 + count]
        entries: list[TokenLogprobs] = []
        for s in range(0, count, PROMPT_LOGPROB_ROWS):
            e = min(count, s + PROMPT_LOGPROB_ROWS)
            logits = model.compute_logits(hidden[row + s : row + e])  # [R, V]
            if logits is None:  # a rank > 0: its part of the collective is done
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V] float32
            k = min(req.params.prompt_logprobs or 0, lp.shape[1])
            tgt = torch.tensor(targets[s:e], dtype=torch.long, device=lp.device)  # [R]
            chosen = lp.gather(1, tgt.unsqueeze(1))  # [R, 1]
            ranks = (lp >= chosen).sum(dim=-1).tolist()  # vLLM's rank, as the sampler's
            top_v: list[list[float]] = [[] for _ in range(e - s)]
            top_i: list[list[int]] = [[] for _ in range(e - s)]
            if k:
                values, ids = lp.topk(k, dim=-1)  # [R, k] x 2, descending
                top_v, top_i = values.tolist(), ids.tolist()
            chosen_lps = chosen.squeeze(1).tolist()
            for j, t in enumerate(targets[s:e]):
                # The prompt's token first; among the top-k it takes its top-k rank.
                entry = {t: Logprob(chosen_lps[j], ranks[j])}
                for r, (v, i) in enumerate(zip(top_v[j], top_i[j], strict=True)):
                    entry[i] = Logprob(v, r + 1)
                entries.append(entry)
        if len(entries) == count:
            out[req.request_id] = (pos + 1, entries)
    return out


def commit_prompt_logprobs(rows: Rows) -> None:
    """The step succeeded: the engine now holds these entries too (a recompute after
    preemption computes none of them again). Counted from ``rows``, not from the entries,
    so that every tensor-parallel rank (only rank 0 has entries) keeps the same count and
    so makes the same ``compute_logits`` calls later."""
    for req, _, pos, count in rows:
        if req.num_prompt_logprobs:
            req.num_prompt_logprobs = max(req.num_prompt_logprobs, pos + 1 + count)
