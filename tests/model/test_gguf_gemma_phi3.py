"""GGUF files of the Gemma 1/2/3 (text) and Phi-3 families, written with the ``gguf`` package
as llama.cpp's ``convert_hf_to_gguf.py`` writes them (its metadata keys, tensor names, Gemma's
``1 + w`` norms, Phi-3's fused q/k/v and gate/up) from tiny random transformers models: the
converted folder holds the original tensors exactly, kvserve's greedy tokens equal
transformers' on the original model, and a Phi-3 file of mixed K/IQ quant types served with
``--quantization gguf`` holds gguf's own values and gives the dequantized file's tokens."""

from __future__ import annotations

import json
import string
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
)

from kvserve.model.gguf_convert import convert_gguf
from kvserve.quantization.gguf_weights import GGUFLinears
from tests.model.test_gguf import _write_gguf
from tests.model.test_gguf_families import FAST

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 256, 64, 128, 4, 2, 32, 5
LAYERS = {"gemma": 2, "gemma2": 2, "gemma3": 6, "phi3": 2}  # gemma3: layer 5 is global
ARCHS = tuple(LAYERS)
PROMPTS = [[5, 17, 200, 33, 9, 120, 64, 3], [1, 2, 3], [250, 42, 7, 99, 12, 5, 180, 100, 17]]
MAX_TOKENS = 16
_GEMMA_BASE = {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM}  # llama.cpp's scale


def make_model(arch: str, hidden: int = HIDDEN, ffn: int = FFN) -> PreTrainedModel:
    """A random float32 model of ``arch`` whose windows, soft-caps and Gemma 3's two RoPEs
    (a local base of their own, linear scaling on the global layers) all bite."""
    common = {
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": LAYERS[arch], "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "max_position_embeddings": 256,
        "rms_norm_eps": 2.0**-10, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "initializer_range": 0.2, "attn_implementation": "eager",
    }  # fmt: skip
    torch.manual_seed(0)
    if arch == "gemma":
        model: PreTrainedModel = GemmaForCausalLM(GemmaConfig(**common, head_dim=HEAD_DIM))
    elif arch == "gemma2":
        caps = {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0}
        config = Gemma2Config(**common, **_GEMMA_BASE, **caps, sliding_window=WINDOW)
        model = Gemma2ForCausalLM(config)
    elif arch == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        }
        config = Gemma3TextConfig(**common, **_GEMMA_BASE, sliding_window=WINDOW,
                                  rope_parameters=rope)  # fmt: skip
        model = Gemma3ForCausalLM(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 50000.0}
        model = Phi3ForCausalLM(Phi3Config(**common, sliding_window=WINDOW, rope_parameters=rope))
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms start at zeros (Gemma) or ones: randomise, in steps of 1/128 so that
            # llama.cpp's Gemma 1 + w and kvserve's (1 + w) - 1 are exact
            if "norm" in name:
                p.copy_(torch.from_numpy(rng.integers(-64, 64, p.shape) / 128.0))
    return model.eval()


# HF name (after `model.layers.{i}.`) -> llama.cpp's (after `blk.{i}.`): gguf.tensor_mapping
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
}  # fmt: skip
_NORMS = {  # gemma2/3 sandwich norms vs llama-style post-attention (pre-MLP) norm
    "gemma2": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}  # fmt: skip
_NORMS["gemma3"] = _NORMS["gemma2"]


def gguf_name(arch: str, hf: str) -> str:
    """llama.cpp's name for HF tensor ``hf`` (``model.layers.0.mlp.up_proj.weight``)."""
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in globals_:
        return globals_[hf]
    _, _, layer, rest = hf.split(".", 3)
    base = rest.removesuffix(".weight")
    names = {**_BLOCK_NAMES, "post_attention_layernorm": "ffn_norm", **_NORMS.get(arch, {})}
    return f"blk.{layer}.{names[base]}.weight"


def test_names_match_gguf_package() -> None:
    models = {"gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2,
              "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}  # fmt: skip
    for arch, model_arch in models.items():
        tmap = gguf.get_tensor_name_map(model_arch, LAYERS[arch])
        for hf in make_model(arch).state_dict():
            if hf == "lm_head.weight" and arch != "phi3":
                continue  # tied
            assert gguf_name(arch, hf) == f"{tmap.get_name(hf.removesuffix('.weight'))}.weight"


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> None:
    """A 256-token SentencePiece vocabulary (``tokenizer.ggml.model`` "llama", as Gemma's and
    Phi-3's files carry), scores ranking its merges: cheap to rebuild, unlike a real one."""
    chars = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'")
    pieces = ["▁", *chars, *(f"▁{c}" for c in chars), "th", "▁th", "▁the", "he", "in", "▁a"]
    tokens = [*SPECIALS, *dict.fromkeys(pieces)]
    tokens += [f"▁w{i}" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(SPECIALS) + [-float(i) for i in range(VOCAB - len(SPECIALS))])
    w.add_token_types([3, 3, 3, 2, 3, 3] + [1] * (VOCAB - len(SPECIALS)))  # 2: unknown, 3: control
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)


SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>{% endfor %}"
)
TEXTS = ["the cat, at the THE", "Hello there!", " two  spaces", "in 1999 a he th"]


def write_gguf(model: PreTrainedModel, arch: str, path: Path, types: dict[str, T] | None = None,
               seed: int = 0, split: int = 0, ollama: bool = False) -> Path:  # fmt: skip
    """``model`` as llama.cpp's converter writes an ``arch`` GGUF (F32). ``types``: llama.cpp
    kind (``attn_qkv``) -> a quant type whose blocks are random bytes instead (gguf-py cannot
    quantize to K or IQ types); ``blk.1.attn_qkv`` then takes IQ2_XXS, a type kept dense.
    ``split``: at most this many tensors a file, as ``--split-max-tensors`` writes them
    (``name-00001-of-0000N.gguf``, metadata in the first; the first file is returned).
    ``ollama``: a gemma3 file as Ollama's converter writes it (``convert_gemma3.go``): its own
    local-base key, the window pattern per layer, no linear scaling (its runtime applies none),
    and the vision tower's tensors in the same file (``v.*``, ``mm.*``)."""
    c = model.config
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if arch != "phi3":
        state.pop("lm_head.weight")  # tied: llama.cpp writes no output.weight
    rng = np.random.default_rng(seed)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_context_length(256)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_layer_norm_rms_eps(2.0**-10)
        if arch == "phi3":
            w.add_rope_dimension_count(c.hidden_size // HEADS)
            w.add_rope_freq_base(50000.0)
            w.add_sliding_window(WINDOW)
        else:
            w.add_key_length(HEAD_DIM)
            w.add_value_length(HEAD_DIM)
        if arch in ("gemma2", "gemma3"):
            w.add_sliding_window(WINDOW)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(3.0)
            w.add_final_logit_softcapping(2.0)
        if arch == "gemma3":
            w.add_rope_freq_base(50000.0)
        if arch == "gemma3" and ollama:
            w.add_float32("gemma3.rope.local.freq_base", 20000.0)
            pattern = [t == "sliding_attention" for t in c.layer_types]
            w.add_array("gemma3.attention.sliding_window_pattern", pattern)
        elif arch == "gemma3":
            w.add_float32("gemma3.rope.freq_base_swa", 20000.0)  # as llama.cpp writes it
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(2.0)
        add_tiny_tokenizer(w)
        for hf, data in state.items():
            name = gguf_name(arch, hf)
            if arch.startswith("gemma") and "norm" in name:
                data = data + np.float32(1)  # Gemma*Model.modify_tensors
            kind = name.split(".")[-2]
            qtype = (types or {}).get(kind)
            if qtype is not None and name == "blk.1.attn_qkv.weight":
                qtype = T.IQ2_XXS
            if qtype is None:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, random_blocks(rng, qtype, data.shape), raw_dtype=qtype)
        if ollama:  # a stand-in vision tower and projector, F16 as Ollama keeps them
            for name, shape in (("v.patch_embd.weight", (8, 3, 2, 2)),
                                ("v.blk.0.attn_q.weight", (8, 8)),
                                ("mm.mm_input_projection.weight", (8, c.hidden_size))):  # fmt: skip
                w.add_tensor(name, rng.normal(size=shape).astype(np.float16))

    if not split:
        return _write_gguf(path, arch, fill)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]


_F16_AT = {T.Q5_K: (0, 2), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ4_XS: (0,), T.IQ4_NL: (0,),
           T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ2_XXS: (0,), T.Q8_1: (0, 2), T.Q8_0: (0,),
           T.Q4_0: (0,), T.Q4_1: (0, 2)}  # fmt: skip


def random_blocks(rng: np.random.Generator, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Random ``qtype`` blocks for a ``[rows, cols]`` weight, small float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        d = (rng.standard_normal(len(raw)) * 0.004).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(shape[0], -1)


@pytest.fixture(scope="module", params=ARCHS)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, PreTrainedModel, Path]:
    """(arch, the original transformers model, its F32 GGUF)."""
    arch = request.param
    model = make_model(arch)
    return arch, model, write_gguf(model, arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf")


def _split_phi3(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's fused q/k/v and gate/up as Llama's parts (what kvserve's folder holds)."""
    out = {}
    q, kv = HEADS * (HIDDEN // HEADS), KV_HEADS * (HIDDEN // HEADS)
    for name, t in state.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            parts = zip("qkv", t.split([q, kv, kv]), strict=True)
            out |= {f"{base}{p}_proj.weight": w for p, w in parts}
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out |= dict(zip([f"{base}gate_proj.weight", f"{base}up_proj.weight"], t.chunk(2),
                            strict=True))  # fmt: skip
        else:
            out[name] = t
    return out


def test_converted_folder_equals_original(
    family: tuple[str, PreTrainedModel, Path], tmp_path: Path
) -> None:
    arch, original, path = family
    out = convert_gguf(path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    want = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM", "phi3": "MistralForCausalLM"}[arch]  # fmt: skip
    assert config["architectures"] == [want]
    if arch == "phi3":
        assert config["sliding_window"] == WINDOW
    else:
        assert config["head_dim"] == HEAD_DIM
    if arch in ("gemma2", "gemma3"):
        assert config["sliding_window"] == WINDOW
        assert config["query_pre_attn_scalar"] == HEAD_DIM
        assert config["layer_types"] == original.config.layer_types
    if arch == "gemma2":
        assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (3.0, 2.0)
    if arch == "gemma3":
        assert config["rope_parameters"] == original.config.rope_parameters
    ours = load_file(str(out / "model.safetensors"))
    ref = original.state_dict()
    ref = (
        _split_phi3(ref)
        if arch == "phi3"
        else {k: v for k, v in ref.items() if k != "lm_head.weight"}
    )
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name  # Gemma's norms: (1 + w) - 1 == w exactly
    # the saved tokenizer is the one transformers builds from the GGUF, template and ids too
    saved = AutoTokenizer.from_pretrained(str(out))
    built = type(saved).from_pretrained(str(path.parent), gguf_file=path.name)
    assert [saved.encode(t) for t in TEXTS] == [built.encode(t) for t in TEXTS]
    assert (saved.bos_token_id, saved.eos_token_id, saved.unk_token_id) == (2, 1, 3)
    assert saved.chat_template == TEMPLATE
    assert saved.encode("at the") == [2, *built.encode("at the", add_special_tokens=False)]


def _generate(model: str, quantization: str | None = None) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``PROMPTS``, and how many layers were kept quantized."""
    from kvserve import LLM, SamplingParams

    # exact products with the kept weights (auto takes int8 activations on AVX2 for 4-bit and
    # 6-bit-span codes: Q5_K, Q5_0, Q4_1 here)
    acts = {"quantization_activations": "none"} if quantization else {}
    llm = LLM(model=model, quantization=quantization, **FAST, **acts)
    try:
        report = getattr(llm.engine.runner.model, "quant_report", None)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outputs], 0 if report is None else report.layers


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(
    family: tuple[str, PreTrainedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, original, path = family
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got, _ = _generate(str(path))
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = original.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0,
            )[0, len(prompt) :]  # fmt: skip
        assert tokens == want.tolist(), (arch, prompt)
    assert len({t[0] for t in got}) > 1  # not one repeated token


# Phi-3 with the types llama.cpp's K-quant mixes use, on its fused tensors (K-quant rows are
# 256-value super-blocks: hidden and FFN 256); Gemma 2 with the 32-value block types, mixed
# inside its fused q/k/v and gate/up
MIXED = {
    "phi3": {"attn_qkv": T.Q5_K, "attn_output": T.Q3_K, "ffn_up": T.Q2_K, "ffn_down": T.IQ4_XS},
    "gemma2": {"attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.IQ4_NL, "attn_output": T.Q8_0,
               "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q5_1},
}  # fmt: skip
_SIZES = {"phi3": (256, 256), "gemma2": (HIDDEN, FFN)}


@pytest.fixture(scope="module", params=list(MIXED))
def mixed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    arch = request.param
    path = tmp_path_factory.mktemp(f"{arch}-mixed") / f"{arch}-mixed.gguf"
    return arch, write_gguf(make_model(arch, *_SIZES[arch]), arch, path, MIXED[arch])


def test_mixed_types_equal_gguf_dequantizer(mixed: tuple[str, Path]) -> None:
    """Each kept projection holds gguf's values, fused across types (Gemma 2) or read a run of
    rows per part and fused back (Phi-3's fused tensors); Phi-3's layer with an IQ2_XXS part
    stays dense."""
    arch, path = mixed
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def want(*names: str) -> torch.Tensor:
        parts = [dequantize(tensors[n].data, tensors[n].tensor_type) for n in names]
        return torch.from_numpy(np.concatenate(parts).astype(np.float32))

    source = GGUFLinears(path, make_model(arch, *_SIZES[arch]).config)
    if arch == "phi3":
        assert source.dense_types == {"IQ2_XXS"}
        assert "layers.1.self_attn.qkv_proj" not in source.modules
        assert "model.layers.1.self_attn.q_proj.weight" not in source.checkpoint_names
        cases = {"layers.0.self_attn.qkv_proj": ["blk.0.attn_qkv"],
                 "layers.1.self_attn.o_proj": ["blk.1.attn_output"],
                 "layers.1.mlp.gate_up_proj": ["blk.1.ffn_up"],
                 "layers.0.mlp.down_proj": ["blk.0.ffn_down"]}  # fmt: skip
    else:
        assert source.dense_types == set() and len(source.modules) == 4 * LAYERS[arch]
        cases = {"layers.1.self_attn.qkv_proj": ["blk.1.attn_q", "blk.1.attn_k", "blk.1.attn_v"],
                 "layers.0.mlp.gate_up_proj": ["blk.0.ffn_gate", "blk.0.ffn_up"],
                 "layers.1.mlp.down_proj": ["blk.1.ffn_down"],
                 "layers.0.self_attn.o_proj": ["blk.0.attn_output"]}  # fmt: skip
    for module, names in cases.items():
        got = source.take(module).dequantize(torch.float32)
        assert torch.equal(got, want(*(f"{n}.weight" for n in names))), module


@pytest.mark.slow
def test_mixed_types_kept_quantized_give_the_dequantized_tokens(
    mixed: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, path = mixed
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    dense, _ = _generate(str(path))
    tokens, layers = _generate(str(path), "gguf")
    assert tokens == dense
    assert layers == 4 * LAYERS[arch] - (1 if arch == "phi3" else 0)  # phi3: one stays dense
    assert len({t[0] for t in dense}) > 1


def test_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(make_model("gemma"), "gemma", tmp_path / "q8_1.gguf",
                      {"attn_output": T.Q8_1})  # fmt: skip
    want = r"'blk\.0\.attn_output\.weight' has type Q8_1, which kvserve cannot load"
    with pytest.raises(ValueError, match=want):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
