"""The sampler's step path never reads a tensor on the host before its one read of the results
(issue 35): every branch is decided from the requests' ``SamplingParams``.

On the CPU a ``TorchFunctionMode`` stands in for the device: it raises on each operation that
would wait for an accelerator (``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()``,
``.nonzero()``, a boolean-mask index, ...) while ``sample_on_device`` / ``verify_on_device``
run with ``sync_free=True`` (what every device but the CPU gets by default); the results are
then read outside the mode and must equal ``sample`` / ``rejection_sample``. On CUDA,
``torch.cuda.set_sync_debug_mode("error")`` checks the real thing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvserve.sample.rejection import expand_for_verification, rejection_sample, verify_on_device
from kvserve.sample.sampler import SamplingMetadata, sample, sample_on_device
from kvserve.sample.top_k_top_p import apply_top_k_top_p
from kvserve.sampling_params import SamplingParams

# Tensor operations that copy a value to the host (and so wait for the device's queue).
SYNCING = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "argwhere",
    "cpu",
    "numpy",
    "masked_select",
    "unique",
    "unique_consecutive",
}
V = 1500  # above top-p's 1024 candidates, so the CPU shortcut would need its fallback


class HostSyncError(AssertionError):
    pass


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class NoHostSync(TorchFunctionMode):
    """Raises on every operation that would read a device tensor back on the host."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            raise HostSyncError(f"host sync: {name}")
        if name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
            raise HostSyncError(f"host sync: boolean-mask {name} (a nonzero)")
        return func(*args, **(kwargs or {}))


def _params() -> list[SamplingParams]:
    """One row per sampler feature: every branch of the step path runs."""
    bad_words = SamplingParams(temperature=0.0, min_tokens=4)
    bad_words.bad_words_token_ids = [[5], [2, 6]]  # the engine's tokenization of bad_words
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),  # a flat row: nucleus > 1024
        SamplingParams(temperature=0.7, min_p=0.1, top_k=50, top_p=0.8),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={3: 5.0, 9: -2.0}),
        SamplingParams(temperature=0.9, allowed_token_ids=[1, 4, 7, 11], seed=3, logprobs=3),
        bad_words,
        SamplingParams(temperature=1.2, logprobs=0),
    ]


def _metadata(
    params: list[SamplingParams], device: torch.device, sync_free: bool | None, grammar: bool = True
) -> SamplingMetadata:
    """Seeded generators, an engine seed, output history and, with ``grammar``, a token bitmask
    on row 3."""
    n = len(params)
    gens = [
        None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed)
        for p in params
    ]
    return SamplingMetadata(
        params=params,
        prompt_token_ids=[[1, 2, 3]] * n,
        output_token_ids=[[2, 3, 4][: i % 4] for i in range(n)],
        generators=gens,
        min_tokens_stop_ids=[[0]] * n,
        default_generator=torch.Generator(device=device).manual_seed(7),
        token_bitmask=(
            torch.full((1, -(-V // 32)), 0x0F0F0F0F, dtype=torch.int32) if grammar else None
        ),
        token_bitmask_rows=[3] if grammar else [],
        sync_free=sync_free,
    )


def _logits(rows: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([3.0, 1.0, 0.02] * rows)[:rows].unsqueeze(1)  # row 2: flat
    return (torch.randn(rows, V, generator=g) * scales).to(device)  # [B, V]


def test_the_guard_catches_a_sync() -> None:
    """The guard can fail: the tensor-argument top-k/top-p reads its arguments back, and the
    CPU's own top-p shortcut reads which rows its candidates did not decide."""
    logits = _logits(3, torch.device("cpu"))
    with NoHostSync(), pytest.raises(HostSyncError, match="tolist"):
        apply_top_k_top_p(logits.clone(), torch.tensor([0, 5, 0]), torch.tensor([1.0, 0.9, 0.9]))
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 3
    md = _metadata(params, torch.device("cpu"), sync_free=False, grammar=False)
    with NoHostSync(), pytest.raises(HostSyncError, match="__bool__"):
        sample_on_device(logits, md)


@pytest.mark.parametrize("greedy_only", [False, True])
def test_sample_step_path_has_no_host_sync(greedy_only: bool) -> None:
    params = [SamplingParams(temperature=0.0)] * 4 if greedy_only else _params()
    cpu = torch.device("cpu")
    logits = _logits(len(params), cpu)
    grammar = not greedy_only  # a bitmask leaves the all-greedy hot path
    with NoHostSync():
        on_device = sample_on_device(logits, _metadata(params, cpu, True, grammar))
    got = on_device.to_host(params)
    assert got == sample(logits, _metadata(params, cpu, True, grammar))
    # and the accelerator's code gives the CPU's tokens (same seeds, fresh generators)
    assert got == sample(logits, _metadata(params, cpu, None, grammar))


def test_no_token_allowed_is_found_after_the_read() -> None:
    """A row whose constraints exclude every token is marked on the device and reported by the
    read, for that row only."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=2)]
    md = SamplingMetadata(
        params=params,
        prompt_token_ids=[[1], [1]],
        output_token_ids=[[], []],
        generators=[None, None],
        min_tokens_stop_ids=[[], [0]],
        token_bitmask=torch.tensor([[-1], [1]], dtype=torch.int32),  # row 1: only token 0
        token_bitmask_rows=[0, 1],
        sync_free=True,
    )
    logits = torch.randn(2, 20)
    with NoHostSync():
        on_device = sample_on_device(logits, md)
    with pytest.raises(ValueError, match=r"no token is allowed .*\(rows \[1\]\)"):
        on_device.to_host(params)


def _spec_case() -> tuple[list[SamplingParams], list[list[int]], torch.Tensor]:
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.9, seed=5, top_p=0.95, presence_penalty=0.5),
        SamplingParams(temperature=1.0, logprobs=1),
    ]
    drafts = [[3, 8, 1], [4], [7, 7]]
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(4))
    logits[0, 3] += 8.0  # request 0 accepts its first proposal
    logits[4, 4] += 4.0
    return params, drafts, logits


def _spec_metadata(params: list[SamplingParams], drafts: list[list[int]]) -> SamplingMetadata:
    md = SamplingMetadata(
        params=params,
        prompt_token_ids=[[1, 2]] * len(params),
        output_token_ids=[[9]] * len(params),
        generators=[
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
        ],
        min_tokens_stop_ids=[[]] * len(params),
        default_generator=torch.Generator().manual_seed(11),
    )
    expanded = expand_for_verification(md, drafts)
    expanded.sync_free = True
    return expanded


def test_rejection_step_path_has_no_host_sync() -> None:
    params, drafts, logits = _spec_case()
    q = [None, None, torch.softmax(torch.randn(2, V, generator=torch.Generator()), dim=-1)]
    md = _spec_metadata(params, drafts)
    with NoHostSync():
        on_device = verify_on_device(logits, md, drafts, q)
    got = on_device.to_host(md.params)
    assert got == rejection_sample(logits, _spec_metadata(params, drafts), drafts, q)
    assert got.token_ids[0][0] == 3 and len(got.token_ids) == 3


@contextmanager
def _cuda_sync_errors() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
def test_cuda_sampler_never_syncs_before_the_read() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda = torch.device("cuda")
    params = _params()
    logits = _logits(len(params), cuda)
    md = _metadata(params, cuda, sync_free=None)
    torch.cuda.synchronize()
    with _cuda_sync_errors():
        on_device = sample_on_device(logits, md)
    out = on_device.to_host(params)
    assert all(0 <= t < V for t in out.sampled_token_ids)
    spec_params, drafts, spec_logits = _spec_case()
    spec_md = _spec_metadata(spec_params, drafts)
    spec_md.generators = [
        None if g is None else torch.Generator(device=cuda).manual_seed(5)
        for g in spec_md.generators
    ]
    spec_md.default_generator = torch.Generator(device=cuda).manual_seed(11)
    spec_md.sync_free = None
    spec_logits = spec_logits.to(cuda)
    torch.cuda.synchronize()
    with _cuda_sync_errors():
        verified = verify_on_device(spec_logits, spec_md, drafts)
    assert verified.to_host(spec_md.params).token_ids[0][0] == 3
