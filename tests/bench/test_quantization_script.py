"""``benchmarks/quantization.py``, ``quant_quality.py`` and ``peers/llamacpp.py`` without real
engines: option parsing, weight bytes, the report on made-up runs (exact medians, ratios,
verdicts), GGUF bookkeeping on a tiny GGUF written here, and one setting's whole loop (start,
warm up, probe, measure, peak RSS, stop) on the fake server run as a subprocess."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks import int8_peak, quant_quality, quantization
from benchmarks.peers import llamacpp
from kvserve.outputs import Logprob

FAKE = str(Path(__file__).with_name("fake_server.py"))
# A tiny Llama shape: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, intermediate 128.
CFG = SimpleNamespace(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, head_dim=None,
)  # fmt: skip


def test_settings_parsing_and_defaults() -> None:
    args = quantization.build_parser().parse_args([])
    assert [s.key for s in args.settings] == [s.key for s in quantization.SETTINGS]
    assert (args.concurrency, args.repeats, args.input_len, args.output_len) == (
        [1, 8, 64],
        2,
        128,
        128,
    )
    args = quantization.build_parser().parse_args(
        ["--settings", "llamacpp-q4_0,kvserve-bf16,llamacpp-q4_0", "--concurrency", "1,8"]
    )
    assert [s.key for s in args.settings] == ["llamacpp-q4_0", "kvserve-bf16"]
    assert args.concurrency == [1, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="kvserve-int3"):
        quantization.parse_settings("kvserve-bf16,kvserve-int3")


def test_server_commands() -> None:
    args = quantization.build_parser().parse_args(["--quantization-group-size", "64"])
    args.build = llamacpp.LlamaCppBuild(Path("/x"))
    args.model_cfg = CFG
    model = quantization.Model("m", Path("/models/m"))
    ggufs = {"Q4_0": Path("/g/model-Q4_0.gguf"), "Q8_0": Path("/g/model-Q8_0.gguf")}
    by_key = {s.key: s for s in quantization.SETTINGS}
    cmd = quantization.server_command(args, by_key["kvserve-int4"], model, ggufs, 8123)
    assert cmd[cmd.index("serve") + 1] == "/models/m"
    assert cmd[cmd.index("--quantization") + 1] == "int4"
    assert cmd[cmd.index("--quantization-group-size") + 1] == "64"
    assert "--quantization-activations" not in cmd  # the server's default (auto)
    cmd = quantization.server_command(args, by_key["kvserve-int4-a16"], model, ggufs, 8123)
    assert cmd[cmd.index("--quantization-activations") + 1] == "none"
    assert "--quantization-lm-head" not in cmd and cmd.count("--no-quantization-lm-head") == 1
    cmd = quantization.server_command(args, by_key["kvserve-int4-lmhead"], model, ggufs, 8123)
    assert cmd.count("--quantization-lm-head") == 1
    assert cmd[cmd.index("--quantization") + 1] == "int4"
    assert "--enforce-eager" not in cmd
    eager = quantization.server_command(
        args, by_key["kvserve-int4-lmhead-eager"], model, ggufs, 8123
    )
    assert eager == [*cmd, "--enforce-eager"]
    cmd = quantization.server_command(args, by_key["kvserve-int4"], model, ggufs, 8123)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64" and "--dtype" in cmd
    assert cmd[cmd.index("--max-model-len") + 1] == "320"  # 128 in + 128 out + 64
    # llama.cpp's KV tokens, 64 x 320, at 2 x 2 layers x 2 KV heads x 16 x 2 bytes a token
    assert cmd[cmd.index("--kv-cache-memory") + 1] == str(64 * 320 * 256)
    cmd = quantization.server_command(args, by_key["kvserve-gguf-q8_0"], model, ggufs, 8123)
    assert cmd[cmd.index("serve") + 1] == "/g/model-Q8_0.gguf"
    assert "--quantization-group-size" not in cmd and cmd[cmd.index("--quantization") + 1] == "gguf"
    cmd = quantization.server_command(args, by_key["llamacpp-q4_0"], model, ggufs, 8123)
    assert cmd[:3] == ["/x/build/bin/llama-server", "-m", "/g/model-Q4_0.gguf"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # loopback only
    assert cmd[cmd.index("-np") + 1] == "64" and cmd[cmd.index("-c") + 1] == str(64 * 320)
    assert cmd[cmd.index("--threads") + 1] == "2" and cmd[cmd.index("-ngl") + 1] == "0"
    assert "--cont-batching" in cmd
    # issue 34: both engines serve the same K-quant file, kvserve keeping its blocks
    ggufs["Q5_K_M"] = Path("/g/model-Q5_K_M.gguf")
    ours = quantization.server_command(args, by_key["kvserve-gguf-q5_k_m"], model, ggufs, 8123)
    theirs = quantization.server_command(args, by_key["llamacpp-q5_k_m"], model, ggufs, 8123)
    assert ours[ours.index("serve") + 1] == theirs[theirs.index("-m") + 1] == str(ggufs["Q5_K_M"])
    assert ours[ours.index("--quantization") + 1] == "gguf"
    assert quantization.PEER_OF["kvserve-gguf-q5_k_m"] == "llamacpp-q5_k_m"
    bench = quantization.bench_args(args, model, 8, 16, 3)
    assert (bench.max_concurrency, bench.num_prompts, bench.seed) == (8, 16, 3)
    assert (bench.ignore_eos, bench.random_input_len, bench.random_output_len) == (True, 128, 128)
    assert bench.header == ["Connection=close"] and bench.temperature == 0


def test_weight_bytes_and_floor() -> None:
    body, head = quantization.linear_params(CFG)
    # per layer: q 64x64, k and v 64x32 each, o 64x64, gate/up/down 64x128 each
    assert body == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) and head == 6400
    by_key = {s.key: s for s in quantization.SETTINGS}
    assert quantization.setting_weight_bytes(by_key["kvserve-bf16"], CFG, {}) == 2 * (body + head)
    int8 = quantization.setting_weight_bytes(by_key["kvserve-int8"], CFG, {})
    assert int8 == int(body * (1 + 2 / 64) + 2 * head)  # a float16 scale per row of K = 64
    int4 = quantization.setting_weight_bytes(by_key["kvserve-int4"], CFG, {})
    assert int4 == int(body * (0.5 + 4 / 32) + 2 * head)  # scale and zero per 32 by default
    assert quantization.setting_weight_bytes(by_key["kvserve-int4"], CFG, {}, 64) == int(
        body * (0.5 + 4 / 64) + 2 * head
    )
    # the LM head in int8 with a float16 scale per row of K = 64
    int4_head = quantization.setting_weight_bytes(by_key["kvserve-int4-lmhead"], CFG, {})
    assert int4_head == int(body * (0.5 + 4 / 32) + head * (1 + 2 / 64))
    roof = {"bandwidth_bytes_s": 1e9, "bf16_matmul_flop_s": 1e15}  # memory-bound
    kv = 1 * 10 * 2 * 2 * 2 * 16 * 2  # batch x context x (K, V) x layers x KV heads x dim x 2 B
    floor = quantization.step_floor_ms(CFG, 1, 10, roof, int4)
    assert floor == pytest.approx((int4 + kv) / 1e9 * 1e3)
    # compute-bound: int8 settings at the int8 dot-product rate, others at the bf16 one
    roof = {"bandwidth_bytes_s": 1e15, "bf16_matmul_flop_s": 1e9, "int8_dot_ops_s": 4e9}
    ops = 2 * 64 * (body + head) + 4 * 64 * 10 * 4 * 16 * 2  # linears, attention (4 heads)
    assert quantization.step_floor_ms(CFG, 64, 10, roof, int4) == pytest.approx(ops / 1e9 * 1e3)
    assert quantization.step_floor_ms(CFG, 64, 10, roof, int4, True) == pytest.approx(
        ops / 4e9 * 1e3
    )
    # no int8 rate measured: no floor rather than one at another unit's rate
    no_rate = {**roof, "int8_dot_ops_s": None}
    assert quantization.step_floor_ms(CFG, 64, 10, no_rate, int4, True) is None
    # float32 settings at the float32 matmul rate, and bf16 ones too where bf16 is emulated
    roof32 = {**roof, "f32_matmul_flop_s": 5e8}
    assert quantization.step_floor_ms(CFG, 64, 10, roof32, int4, False, "float32") == (
        pytest.approx(ops / 5e8 * 1e3)
    )
    assert quantization.step_floor_ms(CFG, 64, 10, roof32, int4) == pytest.approx(ops / 1e9 * 1e3)
    emulated = {**roof32, "bf16_matmul_flop_s": None}
    assert quantization.step_floor_ms(CFG, 64, 10, emulated, int4) == pytest.approx(ops / 5e8 * 1e3)
    int8_dots = {s.key for s in quantization.SETTINGS if quantization.int8_dots(s)}
    assert {"kvserve-int4", "kvserve-gguf-q4_k_m-lmhead", "llamacpp-q4_0"} <= int8_dots
    assert not {"kvserve-bf16", "kvserve-int4-a16", "kvserve-int8-a16"} & int8_dots
    # without VNNI, auto takes int8 for 4-bit codes only; 8-bit codes where asked for
    avx2 = {s.key for s in quantization.SETTINGS if quantization.int8_dots(s, vnni=False)}
    assert {"kvserve-gguf-q4_0-lmhead-f32-a8", "kvserve-int4-lmhead-f32-a8"} <= avx2
    assert {"kvserve-int4", "kvserve-gguf-q4_0-lmhead-f32", "kvserve-gguf-q4_k_m"} <= avx2
    assert not {"kvserve-int8", "kvserve-int4-a16", "kvserve-bf16"} & avx2
    assert "kvserve-gguf-q4_0-lmhead-f32" not in int8_dots  # float32: auto is not int8


def _run(setting: str, c: int, rep: int, tput: float, ttft: float, ok: bool = True) -> dict:
    return {"setting": setting, "concurrency": c, "repeat": rep, "output_throughput": tput,
            "median_ttft_ms": ttft, "median_tpot_ms": 1000 / tput, "failed": 0,
            "tokens_ok": ok}  # fmt: skip


def test_summary_ratios_table_and_targets() -> None:
    runs = [
        _run("kvserve-bf16", 1, 0, 10.0, 100), _run("kvserve-bf16", 1, 1, 12.0, 120),
        _run("kvserve-int4", 1, 0, 30.0, 50), _run("kvserve-int4", 1, 1, 26.0, 70),
        _run("llamacpp-q4_0", 1, 0, 25.0, 40), _run("llamacpp-q4_0", 1, 1, 31.0, 60),
        _run("kvserve-bf16", 64, 0, 100.0, 900),
        _run("kvserve-int4", 64, 0, 300.0, 800, ok=False),
    ]  # fmt: skip
    servers = [
        {"setting": "kvserve-bf16", "peak_rss_mib": 500.0},
        {"setting": "kvserve-bf16", "peak_rss_mib": 700.0},
        {"setting": "kvserve-int4", "peak_rss_mib": None},  # did not start once
        {"setting": "kvserve-int4", "peak_rss_mib": 300.0},
    ]
    settings = quantization.parse_settings("kvserve-bf16,kvserve-int4,llamacpp-q4_0")
    rows = quantization.summarize(runs, servers, settings, [1, 64])
    assert [(r["concurrency"], r["setting"]) for r in rows] == [
        (1, "kvserve-bf16"), (1, "kvserve-int4"), (1, "llamacpp-q4_0"),
        (64, "kvserve-bf16"), (64, "kvserve-int4"),
    ]  # fmt: skip
    bf16, int4, q4 = rows[:3]
    assert (bf16["output_tok_s"], bf16["median_ttft_ms"], bf16["peak_rss_mib"]) == (11.0, 110, 700)
    assert bf16["x_bf16"] is None and bf16["x_llamacpp"] is None
    assert int4["x_bf16"] == 28.0 / 11.0 and int4["x_llamacpp"] == 28.0 / 28.0
    assert q4["x_bf16"] == 28.0 / 11.0 and q4["x_llamacpp"] is None
    assert rows[4]["x_llamacpp"] is None and not rows[4]["tokens_ok"]
    goals = quantization.targets(rows)
    assert [(g["numerator"], g["denominator"], g["concurrency"], g["met"]) for g in goals] == [
        ("kvserve-int4", "kvserve-bf16", 1, True),  # 2.55x >= 2.5x
        ("kvserve-int4", "llamacpp-q4_0", 1, True),  # a tie meets ">= llama.cpp"
        ("kvserve-int4", "kvserve-bf16", 64, True),
    ]
    table = quantization.markdown(rows, None, CFG, 192)
    assert "| 1 | kvserve-int4 | 28.0 | 2.55 | 1.00 | 60 | 35.9 | - | - | 300 |" in table
    assert "| 64 | kvserve-int4 (!) | 300.0 | 3.00 | - | 800 | 3.3 | - | - | 300 |" in table


def test_check_tokens() -> None:
    good = {"failed": 0, "completed": 4, "num_prompts": 4, "total_output_tokens": 4 * 128}
    assert quantization.check_tokens(good, 128)
    assert not quantization.check_tokens({**good, "total_output_tokens": 4 * 128 - 1}, 128)
    assert not quantization.check_tokens({**good, "completed": 3, "failed": 1}, 128)


def _write_gguf(path: Path, tied: bool) -> dict[str, int]:
    """A tiny GGUF: an F32 embedding, a Q8_0 and a Q4_0 matrix, an F32 norm, maybe an LM head.
    Returns each tensor's bytes."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    tensors = {
        "token_embd.weight": (rng.standard_normal((100, 64), dtype=np.float32), T.F32),
        "blk.0.attn_q.weight": (rng.standard_normal((64, 64), dtype=np.float32), T.Q8_0),
        "blk.0.ffn_down.weight": (rng.standard_normal((64, 128), dtype=np.float32), T.Q4_0),
        "output_norm.weight": (np.ones(64, dtype=np.float32), T.F32),
    }
    if not tied:
        tensors["output.weight"] = (rng.standard_normal((100, 64), dtype=np.float32), T.Q8_0)
    sizes = {}
    for name, (x, kind) in tensors.items():
        data = x if kind == T.F32 else quantize(x, kind)
        w.add_tensor(name, data, raw_dtype=kind if kind != T.F32 else None)
        sizes[name] = data.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sizes


def test_gguf_tensor_types_and_streamed_bytes(tmp_path: Path) -> None:
    sizes = _write_gguf(tmp_path / "untied.gguf", tied=False)
    # Q8_0: 34 bytes per 32 weights; Q4_0: 18 bytes per 32 weights
    assert sizes["blk.0.attn_q.weight"] == 64 * 64 // 32 * 34
    assert sizes["blk.0.ffn_down.weight"] == 64 * 128 // 32 * 18
    types = llamacpp.tensor_types(tmp_path / "untied.gguf")
    assert types == {"F32": 2, "Q8_0": 2, "Q4_0": 1}
    streamed = llamacpp.streamed_weight_bytes(tmp_path / "untied.gguf")
    assert streamed == sum(sizes.values()) - sizes["token_embd.weight"]  # rows gathered only
    sizes = _write_gguf(tmp_path / "tied.gguf", tied=True)
    assert llamacpp.streamed_weight_bytes(tmp_path / "tied.gguf") == sum(sizes.values())


def test_llamacpp_build_checks(tmp_path: Path) -> None:
    build = llamacpp.LlamaCppBuild(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"setup_llamacpp\.sh"):
        build.check()
    with pytest.raises(ValueError, match="Q5_1"):
        llamacpp.ensure_ggufs(build, tmp_path, ("Q8_0", "Q5_1"))
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert llamacpp.base_outtype(tmp_path) == "bf16"
    (tmp_path / "config.json").write_text('{"torch_dtype": "float32"}')
    assert llamacpp.base_outtype(tmp_path) == "f32"
    assert llamacpp.gguf_name("Q4_0", pure=True) == "model-Q4_0-pure.gguf"
    assert llamacpp.gguf_name("BF16", pure=True) == "model-BF16.gguf"


def test_memory_of_this_process() -> None:
    mem = quantization.memory_mib(os.getpid())
    assert mem["peak_rss_mib"] is not None and mem["rss_mib"] is not None
    assert 0 < mem["rss_mib"] <= mem["peak_rss_mib"]
    # one process: its PSS is at most its RSS (shared library pages split), and well above 0
    assert mem["pss_mib"] is not None and mem["rss_mib"] / 4 < mem["pss_mib"] <= mem["rss_mib"]
    assert quantization.memory_mib(2**22 + 12345) == {"peak_rss_mib": None, "rss_mib": None}


def test_one_setting_on_the_fake_server(byte_tokenizer_dir: Path, tmp_path: Path) -> None:
    args = quantization.build_parser().parse_args(
        ["--concurrency", "1,2", "--output-len", "3", "--input-len", "20", "--waves", "2",
         "--min-prompts", "3", "--start-timeout", "60"]
    )  # fmt: skip
    args.log_dir = tmp_path
    model = quantization.Model("bytes", byte_tokenizer_dir)

    def fake(port: int) -> list[str]:
        return [sys.executable, FAKE, "--port", str(port), "--delay", "0.005"]

    server, runs = quantization.serve_setting(args, "kvserve-bf16", fake, model, 1)
    assert "error" not in server and server["peak_rss_mib"] > 0
    # the fake server streams 3 tokens whatever is asked and reports 7 prompt tokens
    assert server["probe"] == {"expected_prompt_tokens": 20, "prompt_tokens": 7,
                               "expected_completion_tokens": 3, "completion_tokens": 3}  # fmt: skip
    assert [(r["concurrency"], r["num_prompts"], r["completed"]) for r in runs] == [
        (1, 3, 3), (2, 4, 4),
    ]  # fmt: skip
    assert all(r["tokens_ok"] and r["repeat"] == 1 for r in runs)
    server, runs = quantization.serve_setting(
        args, "kvserve-int8", lambda port: [sys.executable, "-c", "exit(3)"], model, 0
    )
    assert runs == [] and "exited with 3" in server["error"]


def test_quality_helpers() -> None:
    assert quant_quality.parse_configs("int4,float32") == ["bfloat16", "int4", "float32"]
    with pytest.raises(argparse.ArgumentTypeError, match="int2"):
        quant_quality.parse_configs("int2")
    ids = list(range(10))
    assert quant_quality.windows(ids, 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quant_quality.windows(ids, 3, 7) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="fewer than one window"):
        quant_quality.windows(ids, 16, 100)
    prompts = [[5, 6, 7], [8, 9, 5]]
    lps: list[list[Any]] = [
        [None, {6: Logprob(-1.0, 1)}, {7: Logprob(-2.0, 3), 1: Logprob(-0.5, 1)}],
        [None, {9: Logprob(-0.25, 1)}, {5: Logprob(-0.75, 2)}],
    ]
    out = quant_quality.perplexity(lps, prompts)
    assert out["scored_tokens"] == 4 and out["perplexity"] == pytest.approx(np.exp(4.0 / 4))
    with pytest.raises(ValueError, match="prompt logprobs"):
        quant_quality.perplexity([lps[0][1:]], prompts[:1])
    agree = quant_quality.agreement([[1, 2, 3], [1, 2, 4], [9]], [[1, 2, 3], [1, 2, 3], [1]])
    assert agree == {"identical_fraction": 1 / 3, "mean_identical_prefix": (3 + 2 + 0) / 3}


def test_quality_table() -> None:
    results = [
        {"config": "bfloat16", "perplexity": 20.0, "output_token_ids": [[1, 2], [3]]},
        {"config": "int4", "perplexity": 22.0, "output_token_ids": [[1, 5], [3]]},
        {"config": "int8", "error": "ValueError: no int8 here"},
    ]
    table = quant_quality.markdown(results)
    assert "| bfloat16 | 20.000 | +0.00% | 100.0% | 1.5 | 1.5 |" in table
    assert "| int4 | 22.000 | +10.00% | 50.0% | 1.0 | 1.5 |" in table
    assert "| int8 | failed: ValueError: no int8 here | | | | |" in table


@pytest.mark.skipif(not int8_peak.vnni_available(), reason="needs AVX512-VNNI")
def test_int8_peak_probe_runs_every_dot_product() -> None:
    """The probe's loop is not folded away: each of 12 chains per thread adds 4 x 3 x 5 = 60
    per int32 lane per round, from its own index, over 16 lanes."""
    rounds = int8_peak._module().int8_dot_rounds
    assert rounds(10, 2) == 2 * 16 * (66 + 12 * 60 * 10)
    assert rounds(1, 1) == 16 * (66 + 12 * 60)
    assert int8_peak.measure_int8_peak(1, iters=10_000, repeats=1) > 0


@pytest.mark.skipif(
    int8_peak.int8_peak_isa() != "vpmaddubsw", reason="needs AVX2 without AVX512-VNNI"
)
def test_avx2_int8_peak_probe_runs_every_dot_product() -> None:
    """AVX2's probe: each of 12 int16 chains per thread adds 2 x 3 x 5 = 30 per lane per round
    (vpmaddubsw, then vpaddw), from its own index, over 16 lanes; 64 ops per step."""
    mod = int8_peak._module()
    assert mod.int8_dot_ops() == 64
    assert mod.int8_dot_rounds(10, 2) == 2 * 16 * (66 + 12 * 30 * 10)
    assert mod.int8_dot_rounds(1, 1) == 16 * (66 + 12 * 30)
    assert int8_peak.measure_int8_peak(1, iters=10_000, repeats=1) > 0
