"""``device`` is checked when the config is built: a clear error before anything loads."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig, ModelConfig, parse_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_cpu_is_accepted() -> None:
    assert parse_device("cpu") == "cpu"
    assert parse_device(torch.device("cpu")) == "cpu"
    assert EngineConfig(model=ModelConfig(path="m"), device="cpu").device == "cpu"


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused(device: str) -> None:
    with pytest.raises(ValueError, match=f"device '{device}': CUDA is not available here"):
        EngineConfig(model=ModelConfig(path="m"), device=device)


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("tpu", "is not a torch device"),
        ("cuda:x", "is not a torch device"),
        ("mps", "is not supported: use cpu, cuda or cuda:N"),
        ("meta", "is not supported: use cpu, cuda or cuda:N"),
    ],
)
def test_other_devices_are_refused(device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_device(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_visible_gpus_is_refused() -> None:
    n = torch.cuda.device_count()
    assert parse_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=f"only {n} CUDA device"):
        parse_device(f"cuda:{n}")


@no_cuda
def test_engine_args_check_the_device_before_the_model() -> None:
    """The device error comes first, even for a model folder that does not exist."""
    from kvserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="CUDA is not available here"):
        EngineArgs(model="/nonexistent/model", device="cuda:1").create_engine_config()
