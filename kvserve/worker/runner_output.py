"""What a runner returns to the engine: one step's ``ModelRunnerOutput``, the runner's step
timings, and at start-up its ``RunnerInfo``. All plain data: they cross back from a worker
process as they are."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.outputs import TokenLogprobs
from kvserve.sample.rejection import SpecSamplerOutput
from kvserve.sample.sampler import SamplerOutput
from kvserve.worker.execution_paths import ExecutionPaths
from kvserve.worker.input_batch import CachedRequestState


@dataclass
class StepTimings:
    """Seconds spent in each phase of engine steps (accumulated)."""

    schedule: float = 0.0  # Scheduler.schedule
    prepare: float = 0.0  # building input tensors and metadata (incl. swap copies)
    forward: float = 0.0  # the model's forward pass and logits
    sample: float = 0.0  # the sampler (and speculative verification)
    propose: float = 0.0  # speculative proposals for the next step (n-gram or draft model)
    output: float = 0.0  # scheduler update, detokenization, stop checks, outputs
    steps: int = 0  # steps measured

    def as_dict(self) -> dict[str, float]:
        return {
            k: getattr(self, k)
            for k in ("schedule", "prepare", "forward", "sample", "propose", "output", "steps")
        }

    def add(self, phases: dict[str, float]) -> None:
        """Add one runner call's seconds per phase (``ModelRunnerOutput.timings``)."""
        for k, v in phases.items():
            setattr(self, k, getattr(self, k) + v)


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner built from the config, for the engine's block pool, logs and stats."""

    num_blocks: int  # device KV blocks
    num_swap_blocks: int  # CPU swap blocks
    bytes_per_block: int  # K and V of every layer (and the draft's) per block
    attention_backend: str  # the selected backend's name (AttentionBackendEnum value)
    paths: ExecutionPaths  # fused ops, decode loop, kernel ISA, weight dtype, threads
    warmup_tokens: int  # tokens of the start-up dummy prefill (0: none)
    load_seconds: float  # loading, KV allocation and warm-up

    @property
    def fused_ops(self) -> bool:
        """The model runs the fused C++ ops."""
        return self.paths.fused_ops

    @property
    def decode_loop(self) -> bool:
        """Decode-only steps run the layers in one C++ call (decode_loop.py)."""
        return self.paths.decode_loop


@dataclass
class ModelRunnerOutput:
    """Per sampled request: its new tokens (one, or 1..k + 1 with speculation), their
    logprobs when asked, and the proposals for its next step."""

    sampled: dict[str, list[int]]  # request id -> new token ids, in order
    # request id -> per new token: its logprob, its top-n (+ itself) dict, its 1-based rank
    sampled_logprob: dict[str, list[float]] = field(default_factory=dict)
    top_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    sampled_rank: dict[str, list[int]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, one TokenLogprobs per prompt token
    # from there): the prompt logprobs computed this step (prompt_logprobs requests only)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> why sampling its row failed (the others' rows were sampled without it)
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> tokens proposed to follow its new ones (speculative decoding)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> its embedding (float32 values, normalised unless asked not to): the
    # embedding requests whose prompt this step finished computing
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # seconds of this call per phase (prepare, forward, sample, propose), for the engine's
    # StepTimings (the runner may live in another process)
    timings: dict[str, float] = field(default_factory=dict)
    # the step was given up between layers for an online request (worker/step_interrupt.py):
    # nothing above is set and the engine applies nothing
    interrupted: bool = False

    def update(self, other: ModelRunnerOutput) -> None:
        """Merge the output of a part of the batch (per-request retries)."""
        self.sampled.update(other.sampled)
        self.sampled_logprob.update(other.sampled_logprob)
        self.top_logprobs.update(other.top_logprobs)
        self.sampled_rank.update(other.sampled_rank)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.failed.update(other.failed)
        self.spec_token_ids.update(other.spec_token_ids)
        self.pooled.update(other.pooled)


def sampler_output_to_runner(
    reqs: list[CachedRequestState], res: SamplerOutput
) -> ModelRunnerOutput:
    out = ModelRunnerOutput(
        {r.request_id: [t] for r, t in zip(reqs, res.sampled_token_ids, strict=True)}
    )
    if res.sampled_logprobs is not None:
        for i, r in enumerate(reqs):
            if r.params.logprobs is not None:
                out.sampled_logprob[r.request_id] = [res.sampled_logprobs[i]]
                top = res.top_logprobs[i] if res.top_logprobs else None
                out.top_logprobs[r.request_id] = [top or {}]
                if res.sampled_ranks is not None:
                    out.sampled_rank[r.request_id] = [res.sampled_ranks[i]]
    return out


def spec_output_to_runner(
    reqs: list[CachedRequestState], res: SpecSamplerOutput
) -> ModelRunnerOutput:
    out = ModelRunnerOutput({r.request_id: t for r, t in zip(reqs, res.token_ids, strict=True)})
    if res.logprobs is not None and res.top_logprobs is not None and res.ranks is not None:
        for i, r in enumerate(reqs):
            if r.params.logprobs is not None:
                out.sampled_logprob[r.request_id] = res.logprobs[i]
                out.top_logprobs[r.request_id] = [t or {} for t in res.top_logprobs[i]]
                out.sampled_rank[r.request_id] = res.ranks[i]
    return out
