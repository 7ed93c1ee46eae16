"""A model's own packaging through the engine (issue 15, item 3): Qwen3 and Gemma 3 folders
with their chat template in the tokenizer (chat_template.jinja, tokenizer_config.json), their
EOS id lists in generation_config.json, and (Qwen3) sampling defaults there, which
``generation_config="auto"`` (vLLM's default) applies to requests that do not set them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.engine.chat_models import END, FAMILIES, START, make_chat_model
from tests.model.tiny_hf import EOS

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
PROMPTS = {  # CONV through each family's own template
    "qwen3": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "<|endoftext|><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
    "<start_of_turn>model\n",
}
DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.3}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for arch in FAMILIES:
        out[arch] = tmp_path_factory.mktemp(arch)
        make_chat_model(arch, out[arch])
    return out


def llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, **kw)


@pytest.mark.parametrize("arch", FAMILIES)
def test_chat_uses_the_models_template(models: dict[str, Path], arch: str) -> None:
    """The template saved with the tokenizer (Qwen3: chat_template.jinja, Gemma:
    tokenizer_config.json), its turn markers single special tokens; --chat-template wins."""
    out = llm(models[arch]).chat(CONV, GREEDY, use_tqdm=False)[0]
    assert out.prompt == PROMPTS[arch]
    turns = 3 if arch == "qwen3" else 2  # Gemma folds the system turn into the user's
    assert (out.prompt_token_ids.count(START), out.prompt_token_ids.count(END)) == (
        turns, turns - 1
    )  # fmt: skip
    assert len(out.outputs[0].token_ids) == 4
    own = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    out = llm(models[arch], chat_template=own).chat(CONV, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "[system]Be brief.[user]hi"


@pytest.mark.parametrize("arch", FAMILIES)
def test_generation_config_eos_ids_stop(models: dict[str, Path], arch: str) -> None:
    """Every id of generation_config.json's eos_token_id list ends a request (the tokenizer
    knows only <|endoftext|>); the logit bias makes the model emit it first."""
    engine = llm(models[arch], generation_config="vllm")
    assert engine.engine.eos_token_ids == FAMILIES[arch][3]["eos_token_id"]
    assert engine.get_tokenizer().eos_token_id == EOS
    for eos in (END, EOS):
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100})
        (out,) = engine.generate([[5, 6, 7]], params, use_tqdm=False)
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == ([eos], "stop")
        assert out.outputs[0].stop_reason is None
    ignored = SamplingParams(temperature=0, max_tokens=8, logit_bias={END: 100}, ignore_eos=True)
    assert (
        engine.generate([[5, 6, 7]], ignored, use_tqdm=False)[0].outputs[0].token_ids == [END] * 8
    )


def test_generation_config_defaults(models: dict[str, Path]) -> None:
    """'auto' (the default): generation_config.json's sampling values and max_new_tokens are
    what a request without parameters gets, in LLM.generate and LLM.chat; explicit values
    win; 'vllm' ignores the file."""
    auto = llm(models["qwen3"])
    assert auto.engine.default_sampling_params == {**DEFAULTS, "max_tokens": 6}
    assert auto.get_default_sampling_params() == SamplingParams(**DEFAULTS, max_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10]]
    unset = [o.outputs[0].token_ids for o in auto.generate(prompts, use_tqdm=False)]
    # The same draws from a fresh engine (same seed) with the values spelled out.
    explicit = SamplingParams(**DEFAULTS, max_tokens=6)
    spelled = [
        o.outputs[0].token_ids
        for o in llm(models["qwen3"]).generate(prompts, explicit, use_tqdm=False)
    ]
    assert unset == spelled and all(len(t) <= 6 for t in unset)
    neutral = llm(models["qwen3"]).generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in neutral] != unset
    chat = auto.chat(CONV, use_tqdm=False)[0].outputs[0]
    assert len(chat.token_ids) == 6 or chat.finish_reason == "stop"
    vllm = llm(models["qwen3"], generation_config="vllm")
    assert vllm.engine.default_sampling_params == {}
    assert vllm.get_default_sampling_params() == SamplingParams()


def test_invalid_generation_defaults_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(models["qwen3"], path)
    (path / "generation_config.json").write_text(json.dumps({"top_p": 0.0, "eos_token_id": 1}))
    with pytest.raises(ValueError) as e:
        llm(path)
    assert str(e.value) == (
        f"{path / 'generation_config.json'} sets default sampling values {{'top_p': 0.0}} that "
        "are not valid: top_p must be in (0, 1], got 0.0. Fix the file, or give "
        "--generation-config vllm to ignore it"
    )
    assert llm(path, generation_config="vllm").engine.default_sampling_params == {}


def test_pickle_only_checkpoints_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    """Safetensors only: a folder whose weights are a pickle is refused, never unpickled."""
    path = tmp_path / "m"
    shutil.copytree(models["gemma3"], path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="has only pickle checkpoints; kvserve loads safetensors"):
        llm(path)
