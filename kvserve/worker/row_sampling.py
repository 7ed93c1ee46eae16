"""The runner's sampling of a step's logits rows, from its own request states.

Rows without proposals go through ``sample()``, verification rows (k + 1 logits rows each)
through ``rejection_sample``. A failure is narrowed to the rows that cause it: the batch is
sampled again row by row, each seeded generator rewound to where the step found it, so the
other rows draw exactly what they would have drawn.
"""

from __future__ import annotations

import logging

import torch

from kvserve.sample.custom_processors import BatchProcessors, LogitsProcessor
from kvserve.sample.rejection import expand_for_verification, rejection_sample
from kvserve.sample.sampler import NoTokenAllowedError, SamplingMetadata, sample
from kvserve.worker.input_batch import CachedRequestState, StepRows
from kvserve.worker.runner_output import (
    ModelRunnerOutput,
    sampler_output_to_runner,
    spec_output_to_runner,
)

logger = logging.getLogger("kvserve.runner")

Grammar = tuple[torch.Tensor | None, dict[str, int]]  # (bitmask [G, W], request id -> row)


def _failure(exc: Exception) -> str:
    why = str(exc) if isinstance(exc, NoTokenAllowedError) else repr(exc)
    return f"sampling failed: {why}"


class RowSampler:
    """Samples the rows of a step; owns the custom batch processors' view of the batch."""

    def __init__(
        self, processors: list[LogitsProcessor], default_generator: torch.Generator
    ) -> None:
        self.batch_processors = BatchProcessors(processors)  # vLLM v1's interface
        self.generator = default_generator  # noise of the unseeded rows (engine seed)

    def sample_all(
        self,
        reqs: list[CachedRequestState],
        logits: torch.Tensor,
        rows: StepRows,
        grammar: Grammar,
    ) -> ModelRunnerOutput:
        """``logits``: one row per plain request, k + 1 per verification row, in order."""
        if not rows.scheduled_spec_decode_tokens:
            return self._sample(reqs, logits, grammar)
        plain_reqs: list[CachedRequestState] = []
        plain_rows: list[int] = []
        spec_reqs: list[CachedRequestState] = []
        spec_rows: list[int] = []
        row = 0
        for r in reqs:
            k = rows.num_spec_tokens(r)
            (spec_reqs if k else plain_reqs).append(r)
            (spec_rows if k else plain_rows).extend(range(row, row + k + 1))
            row += k + 1
        out = ModelRunnerOutput({})
        if plain_reqs:
            out.update(self._sample(plain_reqs, logits[plain_rows], grammar))
        if spec_reqs:
            drafts = [rows.scheduled_spec_decode_tokens[r.request_id] for r in spec_reqs]
            out.update(self._verify(spec_reqs, logits[spec_rows], drafts, grammar))
        return out

    def _verify(
        self,
        reqs: list[CachedRequestState],
        logits: torch.Tensor,
        drafts: list[list[int]],
        grammar: Grammar,
    ) -> ModelRunnerOutput:
        """Accept or reject each request's proposals; a failure is narrowed to one request."""
        md = expand_for_verification(self.metadata(reqs, grammar), drafts)
        states = [None if r.generator is None else r.generator.get_state() for r in reqs]
        default_state = self.generator.get_state()
        try:
            return spec_output_to_runner(reqs, rejection_sample(logits, md, drafts))
        except Exception:
            logger.exception("verifying %d requests failed; retrying one by one", len(reqs))
        # The failed call may have drawn (a dead row is found after sampling): rewind.
        self.generator.set_state(default_state)
        out = ModelRunnerOutput({})
        row = 0
        for r, draft, state in zip(reqs, drafts, states, strict=True):
            one = expand_for_verification(self.metadata([r], grammar), [draft])
            if r.generator is not None and state is not None:
                r.generator.set_state(state)
            try:
                res = rejection_sample(logits[row : row + len(draft) + 1], one, [draft])
                out.update(spec_output_to_runner([r], res))
            except Exception as exc:
                out.failed[r.request_id] = _failure(exc)
            row += len(draft) + 1
        return out

    def _sample(
        self, reqs: list[CachedRequestState], logits: torch.Tensor, grammar: Grammar
    ) -> ModelRunnerOutput:
        """Sample one token per row; a failure is narrowed to the rows that cause it."""
        md = self.metadata(reqs, grammar)
        md.batch_processors = self._tell_processors(reqs)
        # Seeded rows: keep their generator states, so that a retry draws the same noise.
        states = [None if g is None else g.get_state() for g in md.generators]
        default_state = self.generator.get_state()  # unseeded rows' noise, rewound the same way
        try:
            return sampler_output_to_runner(reqs, sample(logits, md))
        except NoTokenAllowedError as exc:
            # A request's own constraints left no token: its fault, not the engine's (no
            # traceback in the server log; the retry below fails just that row).
            logger.warning("%s; retrying the batch of %d rows row by row", exc, len(reqs))
        except Exception:
            logger.exception("sampling a batch of %d rows failed; retrying row by row", len(reqs))
        # The sampler finds a row with no allowed token only after drawing: rewind the noise.
        self.generator.set_state(default_state)
        out = ModelRunnerOutput({})
        for i, r in enumerate(reqs):
            gen, state = md.generators[i], states[i]
            if gen is not None and state is not None:
                gen.set_state(state)
            try:
                row = md.row(i)
                row.batch_processors = self._tell_processors([r])
                res = sample(logits[i : i + 1], row)  # [1, V]
            except Exception as exc:
                out.failed[r.request_id] = _failure(exc)
                continue
            out.update(sampler_output_to_runner([r], res))
        return out

    def _tell_processors(self, reqs: list[CachedRequestState]) -> list[LogitsProcessor]:
        """Report the rows to the custom batch processors; returns them (none: []). The
        output lists handed over are the runner's own, which grow as tokens arrive."""
        added = [(r.params, r.prompt_token_ids, r.output_token_ids) for r in reqs]
        return self.batch_processors.update([r.request_id for r in reqs], added)

    def metadata(self, reqs: list[CachedRequestState], grammar: Grammar) -> SamplingMetadata:
        # Structured outputs: the bitmask rows of the constrained requests, in logits-row order.
        bitmask_all, grammar_rows = grammar
        mask_rows = [i for i, r in enumerate(reqs) if r.request_id in grammar_rows]
        bitmask = None
        if mask_rows and bitmask_all is not None:
            picks = [grammar_rows[reqs[i].request_id] for i in mask_rows]
            bitmask = bitmask_all[picks]  # [G, W]
        return SamplingMetadata(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            min_tokens_stop_ids=[r.min_tokens_stop_ids() for r in reqs],
            default_generator=self.generator,
            token_bitmask=bitmask,
            token_bitmask_rows=mask_rows if bitmask is not None else [],
        )
