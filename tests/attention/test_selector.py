"""The selector: AUTO's choice per device and dtype, an explicit choice honoured, and the
error (naming the reason) when the chosen backend cannot run the model."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, GptOssConfig, LlamaConfig, Qwen2Config

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_kernel import CpuKernelBackend
from kvserve.attention.selector import (
    AUTO_ORDER,
    BACKENDS,
    BackendUnavailable,
    backend_class,
    model_attention_features,
    select_attention_backend,
)
from kvserve.attention.torch_sdpa import TorchSDPABackend
from kvserve.config import AttentionBackendEnum as Name
from kvserve.config import ModelConfig
from tests.attention.utils import CPU, HAS_COMPILER

needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
CUDA = torch.device("cuda")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_takes_the_cpu_kernel_on_a_cpu(dtype: torch.dtype) -> None:
    backend = select_attention_backend(Name.AUTO, CPU, dtype, 64, sliding_window=True)
    assert type(backend) is CpuKernelBackend and backend.device == CPU


@pytest.mark.parametrize(("dtype", "head"), [(torch.float16, 64), (torch.float32, 72)])
def test_auto_falls_back_to_sdpa_where_the_kernel_does_not_fit(
    dtype: torch.dtype, head: int
) -> None:
    assert type(select_attention_backend(Name.AUTO, CPU, dtype, head)) is TorchSDPABackend


def test_auto_on_cuda_skips_a_missing_triton_backend() -> None:
    """Without the Triton backend installed, AUTO on CUDA is TORCH_SDPA; no C++ build is
    asked for (CPU_KERNEL is not in CUDA's order at all)."""
    assert Name.CPU_KERNEL not in AUTO_ORDER["cuda"]
    assert AUTO_ORDER["cuda"][-1] is Name.TORCH_SDPA
    try:
        backend_class(Name.TRITON_ATTN)
    except BackendUnavailable:
        chosen = select_attention_backend(Name.AUTO, CUDA, torch.bfloat16, 64)
        assert type(chosen) is TorchSDPABackend and chosen.device == CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_explicit_torch_sdpa_is_honoured(dtype: torch.dtype) -> None:
    for device in (CPU, CUDA):
        backend = select_attention_backend(Name.TORCH_SDPA, device, dtype, 72, soft_cap=True)
        assert type(backend) is TorchSDPABackend


@pytest.mark.parametrize(
    ("device", "dtype", "head", "reason"),
    [
        (CUDA, torch.float32, 64, "runs on ['cpu'] devices, not cuda"),
        (CPU, torch.float16, 64, "computes ['bfloat16', 'float32'], not float16"),
        (CPU, torch.float32, 72, "head size must be a multiple of 16, the model's is 72"),
    ],
)
def test_explicit_cpu_kernel_that_does_not_fit_names_the_reason(
    device: torch.device, dtype: torch.dtype, head: int, reason: str
) -> None:
    with pytest.raises(ValueError) as err:
        select_attention_backend(Name.CPU_KERNEL, device, dtype, head)
    prefix = f"attention_backend CPU_KERNEL cannot run this model on {device}"
    assert str(err.value).startswith(prefix)
    assert str(err.value).endswith(reason)


def test_cpu_kernel_checks_the_device_before_building() -> None:
    """On CUDA the answer comes from the device check: ``available`` (the C++ build) is
    never asked."""
    calls = []

    class Probe(CpuKernelBackend):
        @classmethod
        def available(cls) -> str | None:
            calls.append(1)
            return None

    assert Probe.supports(CUDA, torch.bfloat16, 64) is not None
    assert Probe.supports(CPU, torch.float16, 64) is not None
    assert calls == []
    assert Probe.supports(CPU, torch.float32, 64) is None and calls == [1]


def test_a_backend_without_windows_or_soft_caps_is_refused_for_such_models() -> None:
    class NoFeatures(TorchSDPABackend):
        supports_sliding_window = False
        supports_soft_cap = False

    assert NoFeatures.supports(CPU, torch.float32, 64) is None
    assert "sliding-window" in str(NoFeatures.supports(CPU, torch.float32, 64, sliding_window=True))
    assert "soft-caps" in str(NoFeatures.supports(CPU, torch.float32, 64, soft_cap=True))


def test_a_backend_without_sinks_is_refused_for_gpt_oss() -> None:
    """Every built-in backend computes sinks; one that declares it does not is refused for
    a gpt-oss config, by name."""

    class NoSinks(TorchSDPABackend):
        supports_sinks = False

    assert NoSinks.supports(CPU, torch.float32, 64) is None
    assert "attention sinks (gpt-oss)" in str(NoSinks.supports(CPU, torch.float32, 64, sinks=True))
    assert model_attention_features(GptOssConfig(sliding_window=8)) == (True, False, True)


def test_unavailable_triton_backend_is_a_clear_error() -> None:
    try:
        backend_class(Name.TRITON_ATTN)
    except BackendUnavailable:
        with pytest.raises(ValueError, match="attention_backend TRITON_ATTN is not available: "):
            select_attention_backend(Name.TRITON_ATTN, CUDA, torch.bfloat16, 64)
    else:
        pytest.skip("the Triton backend is installed")


def test_registry_names_every_backend_once() -> None:
    assert set(BACKENDS) == set(Name) - {Name.AUTO}
    for name in (Name.TORCH_SDPA, Name.CPU_KERNEL):
        cls = backend_class(name)
        assert issubclass(cls, AttentionBackend) and cls.name is name


@pytest.mark.parametrize(
    ("value", "member"),
    [("auto", Name.AUTO), ("TORCH_SDPA", Name.TORCH_SDPA), ("torch_sdpa", Name.TORCH_SDPA),
     ("cpu_kernel", Name.CPU_KERNEL), ("Triton_Attn", Name.TRITON_ATTN)],
)  # fmt: skip
def test_names_parse_in_any_case(value: str, member: Name) -> None:
    assert Name.parse(value) is member
    assert ModelConfig(path="m", attention_backend=value).attention_backend is member  # type: ignore[arg-type]


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown attention_backend 'sdpa'; choose from auto, "):
        ModelConfig(path="m", attention_backend="sdpa")  # type: ignore[arg-type]


def test_model_features_from_the_config() -> None:
    assert model_attention_features(LlamaConfig()) == (False, False, False)
    gemma2 = Gemma2Config(sliding_window=16, attn_logit_softcapping=50.0)
    assert model_attention_features(gemma2) == (True, True, False)
    assert model_attention_features(Qwen2Config(sliding_window=32)) == (False, False, False)
    assert model_attention_features(Qwen2Config(sliding_window=32, use_sliding_window=True))[0]
