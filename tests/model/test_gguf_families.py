"""GGUF files of the Qwen2 and Qwen3 families (``general.architecture`` ``qwen2`` / ``qwen3``)
and Mistral-shaped ``llama`` files (head_dim != hidden / heads, as Mistral-Nemo), written with
the ``gguf`` package as llama.cpp's ``convert_hf_to_gguf.py`` writes them (its metadata keys
and tensor names; q/k rows permuted for ``llama`` only, as llama.cpp does)
from tiny random transformers models: kvserve's greedy tokens equal transformers' on the
original model, and a Q8_0 file's projections equal ``gguf``'s own dequantizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ4_NL, dequantize, quantize
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvserve.config import Quantization
from kvserve.model.builtin import find_builtin_gguf
from kvserve.model.gguf_convert import convert_gguf, unpermute_rotary
from kvserve.model.loader import load_model
from kvserve.quantization import streaming
from kvserve.quantization.a8_table import TABLE_OFFSET
from kvserve.quantization.apply import QuantOptions
from kvserve.quantization.gguf_weights import GGUFLinears
from kvserve.quantization.qlinear import QuantLinear
from tests.model.test_gguf import (
    PROMPT_IDS,
    TINY_VOCAB,
    _copy_tokenizer_metadata,
    _write_gguf,
    llama_cpp_permute,
)

# TINY_VOCAB: the first 8192 of SmolLM2's 49152 tokens (and the merges among them), so every
# GGUF read parses 6x fewer strings: the module took 158 s with the whole vocabulary on the
# loaded 2-core box, 20 s with this one.
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = TINY_VOCAB, 32, 64, 2, 4, 2
# Qwen3's head_dim differs from hidden / heads (8), as in the real Qwen3 models, and so does
# "mistral"'s: a Mistral-Nemo-shaped llama file (llama.cpp writes Mistral as `llama`, with
# llama.attention.key_length 128 != 5120 / 32).
HEAD_DIM = {"qwen2": HIDDEN // HEADS, "qwen3": 16, "mistral": 16}
PROMPTS = [PROMPT_IDS, [1, 2, 3], [7999, 42, 7, 3000, 12, 5, VOCAB - 1, 100, 17]]
MAX_TOKENS = 16
# kvserve's options for a tiny float32 model that builds no C++ kernel (as tests/model/test_hub.py)
FAST = {
    "dtype": "float32",
    "num_kv_blocks": 64,
    "attention_backend": "TORCH_SDPA",
    "fused_ops": False,
    "prepack_weights": False,
    "warmup": False,
}


def make_model(arch: str, rope: dict[str, object] | None = None) -> PreTrainedModel:
    """A random float32 Qwen2 (untied, q/k/v biases) or Qwen3 (tied, q/k norms, head_dim 16);
    ``rope``: its ``rope_parameters`` (default: plain RoPE, base 50000)."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256,
        # exact in float32 (GGUF stores them as f32), so the configs compare equal
        "rms_norm_eps": 2.0**-10,
        "rope_parameters": rope or {"rope_type": "default", "rope_theta": 50000.0},
        "bos_token_id": 1,
        "eos_token_id": 2,
        # 10x transformers' 0.02: at 0.02 these tiny models mostly repeat one token (Qwen3,
        # tied, echoes the prompt's last one), which would let a wrong layer pass unnoticed
        "initializer_range": 0.2,
    }
    torch.manual_seed(0)
    if arch == "qwen2":
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif arch == "mistral":
        config = MistralConfig(**common, head_dim=HEAD_DIM[arch], tie_word_embeddings=False)
        model = MistralForCausalLM(config)
    else:
        config = Qwen3Config(**common, head_dim=HEAD_DIM["qwen3"], tie_word_embeddings=True)
        model = Qwen3ForCausalLM(config)
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms start at ones and biases at zeros: randomise so a dropped or misplaced
            # one cannot hide
            if name.endswith("norm.weight"):
                p.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
            elif name.endswith("bias"):
                p.copy_(torch.from_numpy(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return model.eval()


def kvserve_greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """kvserve's greedy ``MAX_TOKENS`` tokens after each prompt (``FAST``, ``ignore_eos``)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model, **FAST)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.close()
    return [list(o.outputs[0].token_ids) for o in outs]


def transformers_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' greedy ``MAX_TOKENS`` tokens after ``prompt`` (EOS masked until then)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


# HF name (after `model.layers.{i}.`) -> llama.cpp's (after `blk.{i}.`): gguf.tensor_mapping
_BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def gguf_name(hf: str) -> str:
    """llama.cpp's name for HF tensor ``hf``, checked against gguf's own tensor-name map."""
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in globals_:
        return globals_[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_BLOCK_NAMES[rest]}"


def quantize_rows(data: np.ndarray, qtype: T) -> np.ndarray:
    """``data [rows, cols]`` float32 as ``qtype`` blocks: gguf's quantizer, or for IQ4_NL
    (which gguf cannot write) llama.cpp's simplest rule: per block of 32 the scale maps the
    value of largest magnitude to the first level (-127), each value its nearest level."""
    if qtype != T.IQ4_NL:
        return quantize(data, qtype)
    levels = np.array(IQ4_NL.kvalues, dtype=np.float32)  # [16]
    blocks = data.reshape(-1, 32)  # [B, 32]
    peak = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]  # [B] signed
    d = (peak / levels[0]).astype(np.float16)  # [B]
    safe = np.where(d == 0, 1, d).astype(np.float32)[:, None, None]  # [B, 1, 1]
    idx = np.abs(blocks[..., None] / safe - levels).argmin(-1).astype(np.uint8)  # [B, 32]
    nibbles = idx[:, :16] | (idx[:, 16:] << 4)  # element j low, j + 16 high
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), nibbles], axis=1)  # [B, 18]
    return raw.reshape(data.shape[0], -1)


def write_family_gguf(
    model: PreTrainedModel,
    arch: str,
    path: Path,
    tokenizer_source: Path | None,
    qtype: T = T.F32,
    extra: dict[str, np.ndarray] | None = None,
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """``model`` as llama.cpp's converter writes an ``arch`` GGUF; 2-D projections in ``qtype``
    (norms, biases and the embedding stay F32, as llama-quantize leaves 1-D tensors).
    ``tokenizer_source``: the GGUF whose tokenizer metadata it carries (None: none, for files
    only the quantized-layer reader opens; parsing tokens and merges takes seconds).
    ``extra``: more tensors by llama.cpp name (``rope_freqs.weight``); ``metadata``: writes
    more keys."""
    gguf_arch = "llama" if arch == "mistral" else arch
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if gguf_arch == "llama":  # LlamaModel.modify_tensors: q/k rows in GGML's rotary order
        for name in state:
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = HEADS if "q_proj" in name else KV_HEADS
                state[name] = llama_cpp_permute(state[name], heads)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # llama.cpp writes no output.weight for a tied head

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_context_length(256)
        w.add_embedding_length(HIDDEN)
        w.add_block_count(LAYERS)
        w.add_feed_forward_length(FFN)
        w.add_rope_freq_base(50000.0)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_layer_norm_rms_eps(2.0**-10)
        if arch != "qwen2":  # TextModel.set_gguf_parameters: written when config has head_dim
            w.add_key_length(HEAD_DIM[arch])
            w.add_value_length(HEAD_DIM[arch])
        if metadata is not None:
            metadata(w)
        if tokenizer_source is not None:
            _copy_tokenizer_metadata(w, tokenizer_source, VOCAB)
        for hf, data in state.items():
            name = gguf_name(hf)
            if qtype != T.F32 and data.ndim == 2 and name != "token_embd.weight":
                w.add_tensor(name, quantize_rows(data, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(name, data)
        for name, data in (extra or {}).items():
            w.add_tensor(name, data)

    return _write_gguf(path, gguf_arch, fill)


def test_gguf_names_match_gguf_package() -> None:
    """The test's name map is gguf's own: every block tensor of each arch maps back to HF."""
    for arch, model_arch in (("qwen2", gguf.MODEL_ARCH.QWEN2), ("qwen3", gguf.MODEL_ARCH.QWEN3)):
        tmap = gguf.get_tensor_name_map(model_arch, LAYERS)
        for hf in make_model(arch).state_dict():
            base, suffix = hf.rsplit(".", 1)
            assert gguf_name(hf) == f"{tmap.get_name(base)}.{suffix}", hf


@pytest.fixture(scope="module")
def tokenizer_source() -> Path:
    """The built-in SmolLM2 GGUF, whose tokenizer metadata the tiny files carry."""
    return find_builtin_gguf()


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral"])
def family(
    request: pytest.FixtureRequest,
    tokenizer_source: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, PreTrainedModel, Path]:
    """(arch, the original transformers model, its F32 GGUF)."""
    arch = request.param
    model = make_model(arch)
    out = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    path = write_family_gguf(model, arch, out, tokenizer_source)
    return arch, model, path


@pytest.fixture(scope="module")
def q8_0_path(
    family: tuple[str, PreTrainedModel, Path],
    tokenizer_source: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The family's model as a Q8_0 GGUF (with the tokenizer), written once for both Q8_0
    tests."""
    arch, original, _ = family
    out = tmp_path_factory.mktemp(f"{arch}-q8_0") / f"{arch}-q8_0.gguf"
    return write_family_gguf(original, arch, out, tokenizer_source, T.Q8_0)


def test_converted_folder_equals_original(
    family: tuple[str, PreTrainedModel, Path], tmp_path: Path
) -> None:
    arch, original, path = family
    out = convert_gguf(path, tmp_path / "out")
    raw = json.loads((out / "config.json").read_text())
    # a mistral GGUF is a llama one: served by the same native class, whose layers match
    want = ("llama", "LlamaForCausalLM") if arch == "mistral" else (arch, type(original).__name__)
    assert (raw["model_type"], raw["architectures"]) == (want[0], [want[1]])
    config = AutoConfig.from_pretrained(str(out))
    for key in ("num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(config, key) == getattr(original.config, key), key
    if arch != "qwen2":  # Qwen2Config has no head_dim (always hidden / heads)
        assert config.head_dim == HEAD_DIM[arch] != HIDDEN // HEADS
        assert config.attention_bias is False
    assert config.rope_parameters["rope_theta"] == 50000.0
    ours = load_file(str(out / "model.safetensors"))
    ref = original.state_dict()
    tied = original.config.tie_word_embeddings
    assert set(ours) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.items():
        # exact, and q/k rows in HF order: qwen files are not permuted, so none are unpermuted
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(
    family: tuple[str, PreTrainedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, original, path = family
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got = kvserve_greedy(str(path), PROMPTS)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == transformers_greedy(original, prompt), (arch, prompt)


def test_q8_0_projections_equal_gguf_dequantizer(
    family: tuple[str, PreTrainedModel, Path], q8_0_path: Path
) -> None:
    """``--quantization gguf``'s layers of a Q8_0 file: gguf's dequantized values, fused, rows
    in the file's order for qwen (not unpermuted), q/k rows unpermuted for llama."""
    arch, original, _ = family
    path = q8_0_path
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def want(name: str) -> torch.Tensor:
        t = tensors[name]
        assert t.tensor_type == T.Q8_0
        return torch.from_numpy(dequantize(t.data, T.Q8_0).astype(np.float32))

    source = GGUFLinears(path, original.config)
    assert sorted(source.modules) == sorted(
        f"layers.{i}.{m}" for i in range(LAYERS)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    )  # fmt: skip
    for i in range(LAYERS):
        qkv = source.take(f"layers.{i}.self_attn.qkv_proj").dequantize(torch.float32)
        q, k, v = (want(f"blk.{i}.attn_{p}.weight") for p in "qkv")
        if arch == "mistral":  # a llama file: its q/k rows are unpermuted, codes and scales
            q, k = unpermute_rotary(q, HEADS), unpermute_rotary(k, KV_HEADS)
        expect = torch.cat([q, k, v])
        assert torch.equal(qkv, expect)
        gate_up = source.take(f"layers.{i}.mlp.gate_up_proj").dequantize(torch.float32)
        assert torch.equal(
            gate_up, torch.cat([want(f"blk.{i}.ffn_{p}.weight") for p in ("gate", "up")])
        )
        down = source.take(f"layers.{i}.mlp.down_proj").dequantize(torch.float32)
        assert torch.equal(down, want(f"blk.{i}.ffn_down.weight"))


def test_layers_built_side_by_side_equal_one_at_a_time(
    q8_0_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization gguf`` builds the layers on ``load_workers()`` threads and puts them
    in place when the load ends: the same layers, byte for byte, and the same report as one
    thread building each as it completes."""
    out = convert_gguf(q8_0_path, tmp_path / "out")
    keep = QuantOptions(Quantization.GGUF, None, str(q8_0_path), lm_head=None)
    built, submitted = {}, []

    class Pool(ThreadPoolExecutor):  # counts the layers sent to the threads
        def submit(self, *args: Any, **kw: Any) -> Any:
            submitted.append(args)
            return super().submit(*args, **kw)

    monkeypatch.setattr(streaming, "ThreadPoolExecutor", Pool)
    for workers in (1, 3):
        monkeypatch.setattr(streaming, "load_workers", lambda w=workers: w)
        model = load_model(out, torch.float32, "cpu", 64, quant=keep)
        assert len(submitted) == (0 if workers == 1 else 4 * LAYERS)
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        report = model.quant_report  # type: ignore[attr-defined]
        built[workers] = (layers, (report.layers, report.weight_bytes, report.dense_bytes))
    (one, one_report), (three, three_report) = built[1], built[3]
    assert one_report[0] == 4 * LAYERS and one_report == three_report  # (and the LM head)
    assert len(one) == len(three) >= 4 * LAYERS
    for (name_a, a), (name_b, b) in zip(one, three, strict=True):
        assert name_a == name_b and a.offset == b.offset
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales_t, b.scales_t)


@pytest.mark.slow
def test_q8_0_kept_quantized_gives_the_dequantized_tokens(
    q8_0_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 file served with ``--quantization gguf`` (its blocks on the quantized
    kernels' packing, Qwen2's biases beside them) gives the greedy tokens of the same file
    dequantized to float32."""
    from kvserve import LLM, SamplingParams

    path = q8_0_path
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = {}
    for quantization in (None, "gguf"):
        llm = LLM(model=str(path), quantization=quantization, **FAST)
        if quantization == "gguf":  # q/k/v, o, gate/up, down of each layer, from the file
            assert llm.engine.runner.model.quant_report.layers == 4 * LAYERS
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()
        tokens[quantization] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["gguf"] == tokens[None]
    assert len({t[0] for t in tokens[None]}) == len(PROMPTS)  # not one repeated token


@pytest.mark.slow
def test_table_codes_run_in_the_decode_loop(
    tokenizer_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IQ4_NL Qwen3 file served at float32 with ``--quantization gguf``: every projection
    streams 4-bit table codes on the weight-only kernel (float16 scales, as the file's), and
    the C++ decode loop (fused ops, the CPU attention kernel) gives the Python layers'
    tokens (``enforce_eager``) on the same file."""
    from kvserve import LLM, SamplingParams

    model = make_model("qwen3")
    w = model.model.layers[0].mlp.down_proj.weight.detach().numpy()  # [HIDDEN, FFN]
    back = dequantize(quantize_rows(w, T.IQ4_NL), T.IQ4_NL)  # gguf's own reading
    assert back.shape == w.shape and np.abs(back - w).max() < 0.1 * np.abs(w).max()
    path = write_family_gguf(model, "qwen3", tmp_path / "iq4_nl.gguf", tokenizer_source,
                             T.IQ4_NL)  # fmt: skip
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens, loop_steps = {}, 0
    for eager in (True, False):
        llm = LLM(model=str(path), quantization="gguf", dtype="float32", num_kv_blocks=64,
                  enforce_eager=eager, warmup=False)  # fmt: skip
        try:
            model = llm.engine.runner.model
            assert model.quant_report.layers == 4 * LAYERS
            for layer in model.layers:
                for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
                    assert (lin.path, lin.code_bits, lin.offset) == ("kernel", 4, TABLE_OFFSET)
            assert (model.decode_loop is None) == eager
            outputs = llm.generate(prompts, params, use_tqdm=False)
            loop_steps = 0 if eager else model.decode_loop.steps
        finally:
            llm.engine.close()
        tokens[eager] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens[False] == tokens[True]
    assert loop_steps >= MAX_TOKENS - 2  # the decode steps ran in C++
    assert len({t[0] for t in tokens[True]}) > 1  # not one repeated token


def test_unsupported_architecture_refused_by_name(tmp_path: Path) -> None:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)

    path = _write_gguf(tmp_path / "falcon.gguf", "falcon", fill)
    want = (r"architecture 'falcon': kvserve can only convert \['gemma', 'gemma2', 'gemma3', "
            r"'gpt-oss', 'llama', 'olmoe', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', "
            r"'qwen3moe'\]")  # fmt: skip
    with pytest.raises(ValueError, match=want):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_yarn_rope_scaling_from_metadata(
    tokenizer_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A qwen3 file with YaRN (``rope.scaling.type yarn``, factor, original context, betas, as
    llama.cpp's converter writes a Qwen3 config's ``rope_scaling``) is served with that YaRN:
    the config's parameters and transformers' greedy tokens (plain RoPE gives others)."""
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 64}  # fmt: skip
    model = make_model("qwen3", yarn)

    def keys(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)

    path = write_family_gguf(model, "qwen3", tmp_path / "yarn.gguf", tokenizer_source,
                             metadata=keys)  # fmt: skip
    out = convert_gguf(path, tmp_path / "out")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {**yarn, "truncate": True}  # transformers' default: llama.cpp's rounding
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    got = kvserve_greedy(str(path), PROMPTS)
    assert got == [transformers_greedy(model, p) for p in PROMPTS]
    assert got != [transformers_greedy(make_model("qwen3"), p) for p in PROMPTS]
