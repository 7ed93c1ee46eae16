"""Llama 3.1/3.2 GGUF files: their rope scaling is stored only as ``rope_freqs.weight``
(llama.cpp's converter's divisors); kvserve solves Llama 3's parameters back from it
(``gguf_rope``) and serves the file with transformers' greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.model.builtin import find_builtin_gguf
from kvserve.model.gguf_convert import convert_gguf
from kvserve.model.gguf_rope import llama3_rope_scaling, rope_divisors
from tests.model.test_gguf_families import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    PROMPTS,
    VOCAB,
    kvserve_greedy,
    transformers_greedy,
    write_family_gguf,
)

ROOT = Path(__file__).resolve().parents[2]
THETA = 50000.0  # what write_family_gguf writes
# head_dim 16: wavelengths 6, 25, 99, 391, 1550, 6140, 24300, 96400; with these parameters
# two are on the ramp (16 < wavelength < 256), one keeps 1 and five get the factor: enough
# for the tokens of these short prompts to change (12-15 of 16 differ from unscaled rope)
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0,
        "original_max_position_embeddings": 256}  # fmt: skip


def converter_inv_freq(theta: float, dim: int) -> np.ndarray:
    """The unscaled frequencies as llama.cpp's converter computes them."""
    return (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))).numpy()


@pytest.mark.parametrize(
    ("theta", "dim", "params"),
    [
        # Llama 3.1 8B and Llama 3.2 1B/3B as their config.json have them
        (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ],
)
def test_real_llama3_parameters_come_back_exactly(
    theta: float, dim: int, params: dict[str, float]
) -> None:
    want = {"rope_type": "llama3", **params, "original_max_position_embeddings": 8192}
    inv = converter_inv_freq(theta, dim)
    divisors = rope_divisors(inv, want).astype(np.float32)  # as the file stores them
    assert llama3_rope_scaling(divisors, inv) == want


def test_small_heads_and_no_scaling() -> None:
    """One ramp frequency (or none) leaves the line free: the solution reproduces the
    divisors; all ones is no scaling; a tensor no llama3 parameters give is refused."""
    inv = converter_inv_freq(10000.0, 8)
    for params in ({**ROPE, "original_max_position_embeddings": 64, "high_freq_factor": 4.0},
                   {**ROPE, "high_freq_factor": 1.5}):  # fmt: skip
        divisors = rope_divisors(inv, params).astype(np.float32)
        ramp = int(((divisors > 1.00001) & (divisors < params["factor"] * 0.99999)).sum())
        solved = llama3_rope_scaling(divisors, inv)
        # (the second reaches no frequency with the whole factor: the largest divisor is its
        # factor then, other parameters giving the same divisors)
        assert solved is not None
        np.testing.assert_allclose(rope_divisors(inv, solved), divisors, rtol=1e-5)
        assert ramp <= 1
    assert llama3_rope_scaling(np.ones(4, np.float32), inv) is None
    with pytest.raises(ValueError, match="is not Llama 3 rope scaling"):
        llama3_rope_scaling(np.array([1.0, 3.0, 1.0, 8.0], np.float32), inv)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """A tiny random Llama with Llama 3 rope scaling and its F32 GGUF with rope_freqs."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM["mistral"],
        max_position_embeddings=512, rms_norm_eps=2.0**-10, bos_token_id=1, eos_token_id=2,
        rope_parameters={**ROPE, "rope_theta": THETA}, tie_word_embeddings=False,
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    inv = converter_inv_freq(THETA, HEAD_DIM["mistral"])
    divisors = rope_divisors(inv, ROPE).astype(np.float32)
    path = tmp_path_factory.mktemp("llama3") / "llama3.gguf"
    write_family_gguf(model, "mistral", path, find_builtin_gguf(),
                      extra={"rope_freqs.weight": divisors})  # fmt: skip
    return model, path


def test_config_has_the_rope_scaling(llama3: tuple[PreTrainedModel, Path], tmp_path: Path) -> None:
    _, path = llama3
    out = convert_gguf(path, tmp_path / "out")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    # solved with the converter's 8192 as the original context (the file does not say; only
    # its ratio to the frequency factors counts): the same divisors as ROPE's 256, 1 and 16
    assert rope == {**ROPE, "rope_theta": THETA, "original_max_position_embeddings": 8192,
                    "low_freq_factor": 32.0, "high_freq_factor": 512.0}  # fmt: skip
    # the frequencies kvserve's rotary computes from it are llama.cpp's (theta / divisor)
    config = LlamaConfig.from_pretrained(str(out))
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    divisors = rope_divisors(converter_inv_freq(THETA, HEAD_DIM["mistral"]), ROPE)
    want = converter_inv_freq(THETA, HEAD_DIM["mistral"]) / divisors
    np.testing.assert_allclose(inv.numpy(), want, rtol=1e-6)
    assert (divisors > 1).sum() == 7  # the scaling changes all frequencies but the first


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(
    llama3: tuple[PreTrainedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, path = llama3
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got = kvserve_greedy(str(path), PROMPTS)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == transformers_greedy(original, prompt), prompt
    assert len({t[0] for t in got}) == len(PROMPTS)  # not one repeated token
    # and the rope scaling shows in them: unscaled rope gives other tokens
    unscaled = LlamaForCausalLM(
        LlamaConfig(
            **{
                **original.config.to_dict(),
                "rope_parameters": {"rope_type": "default", "rope_theta": THETA},
            }
        )
    )
    unscaled.load_state_dict(original.state_dict())
    assert transformers_greedy(unscaled.eval(), PROMPTS[0]) != got[0]


LLAMA_CPP = Path(os.environ.get("KVSERVE_LLAMA_CPP",
                                ROOT / ".peers/llamacpp/src/vendor/llama.cpp"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"no llama.cpp tree at {LLAMA_CPP} (KVSERVE_LLAMA_CPP)")  # fmt: skip
def test_llama_cpp_converters_file_gives_the_same_config(
    llama3: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    """llama.cpp's own ``convert_hf_to_gguf.py`` on the same model writes the divisors the
    tests write, and kvserve reads its file into the same rope parameters."""
    original, ours = llama3
    original.save_pretrained(tmp_path / "hf")
    theirs = tmp_path / "theirs.gguf"
    driver = Path(__file__).with_name("llamacpp_convert.py")
    subprocess.run([sys.executable, str(driver), str(LLAMA_CPP), str(tmp_path / "hf"),
                    str(theirs)], check=True, capture_output=True, timeout=600)  # fmt: skip
    divisors = {}
    for path in (ours, theirs):
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        divisors[path] = np.asarray(tensors["rope_freqs.weight"].data)
    # (within an ulp: the converter computes in Python floats, the tests in float64)
    np.testing.assert_allclose(divisors[theirs], divisors[ours], rtol=2e-7)
    configs = [json.loads((convert_gguf(p, tmp_path / p.stem) / "config.json").read_text())
               for p in (ours, theirs)]  # fmt: skip
    assert configs[0]["rope_parameters"] == configs[1]["rope_parameters"]
