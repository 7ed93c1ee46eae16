"""``benchmarks/moe.py`` and ``moe_model.py`` without real engines: the random OLMoE checkpoint
(every tensor transformers' OlmoeForCausalLM expects, seeded, counted), the server commands of
each engine, the targets on made-up rows, a server's memory summed over its processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from benchmarks import moe, moe_model, quantization
from benchmarks.peers import llamacpp

# a shape that writes in well under a second: hidden 16, 2 layers, 4 experts of 8, top-2
SHAPE = moe_model.MoeShape("t", 16, 2, 2, 4, 2, 8, vocab_size=300, seed=3)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(str(folder / file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_random_olmoe_checkpoint(tmp_path: Path) -> None:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    folder = moe_model.write_random_olmoe(SHAPE, tmp_path / "a")
    tensors = _tensors(folder)
    cfg = OlmoeConfig.from_pretrained(folder)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (4, 2, 8)
    with torch.device("meta"):
        want = OlmoeForCausalLM(cfg)
    # the names transformers' loader maps onto the model (per-expert names, as published)
    assert len(tensors) == 3 + 2 * (9 + 3 * 4)
    assert sum(t.numel() for t in tensors.values()) == SHAPE.parameters()[0]
    assert sum(p.numel() for p in want.parameters()) == SHAPE.parameters()[0]
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.layers.1.self_attn.k_norm.weight"], torch.ones(16).bfloat16())
    assert 0.015 < tensors["lm_head.weight"].float().std().item() < 0.025
    assert (folder / "tokenizer.json").is_file() and json.loads(
        (folder / moe_model.SPEC_FILE).read_text()
    )["num_experts"] == 4
    again = _tensors(moe_model.write_random_olmoe(SHAPE, tmp_path / "b"))
    assert all(torch.equal(again[k], t) for k, t in tensors.items())  # seeded
    other = _tensors(moe_model.write_random_olmoe(replace(SHAPE, seed=4), tmp_path / "c"))
    assert not torch.equal(other["lm_head.weight"], tensors["lm_head.weight"])


def test_shapes() -> None:
    total, active = moe_model.SHAPES["olmoe-7b"].parameters()
    assert round(total / 1e9, 2) == 6.91 and round(active / 1e9, 2) == 1.28
    total, active = moe_model.SHAPES["olmoe-16e"].parameters()
    assert round(total / 1e9, 2) == 2.08 and round(active / 1e9, 2) == 1.28


def test_server_commands() -> None:
    args = moe.build_parser().parse_args(["--vllm-python", "/v/python", "--threads", "2"])
    assert (args.concurrency, args.output_len, args.model) == ([1, 8, 32], 64, "olmoe-7b")
    args.build = llamacpp.LlamaCppBuild(Path("/x"))
    args.model_cfg = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, head_dim=None)  # fmt: skip
    model = quantization.Model("m", Path("/models/m"))
    ggufs = {"Q4_0": Path("/g/q4_0.gguf"), "Q4_K_M": Path("/g/q4_k_m.gguf")}
    by_key = {s.key: s for s in (*moe.LLAMACPP_SETTINGS, *moe.VLLM_SETTINGS)}
    ours = moe.server_command(args, by_key["kvserve-gguf-q4_k_m-lmhead"], model, ggufs, 1)
    theirs = moe.server_command(args, by_key["llamacpp-q4_k_m"], model, ggufs, 1)
    assert ours[ours.index("serve") + 1] == theirs[theirs.index("-m") + 1] == "/g/q4_k_m.gguf"
    assert "--quantization-lm-head" in ours
    f32 = moe.server_command(args, by_key["kvserve-f32"], model, ggufs, 1)
    assert f32[f32.index("--dtype") + 1] == "float32"
    # 32 slots of 128 + 64 + 64 tokens, float32: 2 layers x K and V x 64 x 4 bytes a token
    assert f32[f32.index("--kv-cache-memory") + 1] == str(32 * 256 * 2 * 2 * 64 * 4)
    vllm = moe.server_command(args, by_key["vllm-f32"], model, ggufs, 1)
    # vLLM's variables for its process only: 8 MiB of KV in whole GiB, threads on cores 0-1
    assert vllm[:6] == ["env", "VLLM_CPU_OMP_THREADS_BIND=0-1", "VLLM_CPU_KVCACHE_SPACE=1",
                        "/v/python", "-m", "vllm.entrypoints.openai.api_server"]  # fmt: skip
    assert vllm[vllm.index("--dtype") + 1] == "float32"
    assert vllm[vllm.index("--max-num-seqs") + 1] == "32"
    assert vllm[vllm.index("--max-model-len") + 1] == "256"
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # this process's environment untouched


def test_targets_and_rss() -> None:
    rows = [
        {"setting": "kvserve-gguf-q4_0-lmhead", "concurrency": 1, "output_tok_s": 12.0,
         "peak_rss_mib": 5000.0},
        {"setting": "llamacpp-q4_0", "concurrency": 1, "output_tok_s": 10.0,
         "peak_rss_mib": 4000.0},
        {"setting": "kvserve-gguf-q4_0-lmhead", "concurrency": 32, "output_tok_s": 50.0,
         "peak_rss_mib": 5000.0},
        {"setting": "llamacpp-q4_0", "concurrency": 32, "output_tok_s": 30.0,
         "peak_rss_mib": 4000.0},
        {"setting": "kvserve-f32", "concurrency": 8, "output_tok_s": 13.0, "peak_rss_mib": 1.0},
        {"setting": "vllm-f32", "concurrency": 8, "output_tok_s": 10.0, "peak_rss_mib": 9.0},
    ]  # fmt: skip
    goals = {(g["numerator"], g["concurrency"]): g["met"] for g in quantization.targets(
        rows, moe.TARGETS)}  # fmt: skip
    assert goals == {("kvserve-gguf-q4_0-lmhead", 1): True,
                     ("kvserve-gguf-q4_0-lmhead", 32): False, ("kvserve-f32", 8): True}  # fmt: skip
    rss = moe.rss_targets(rows)
    assert [(r["numerator"], r["ratio"], r["met"]) for r in rss] == [
        ("kvserve-gguf-q4_0-lmhead", 1.25, True)
    ]  # only against llama.cpp
    summary = quantization.summarize(rows_to_runs(rows), [], moe.VLLM_SETTINGS, [8], moe.PEER_OF)
    assert summary[0]["x_llamacpp"] == pytest.approx(1.3)
    table = quantization.markdown(summary, None, None, 0, "vLLM")
    assert "| x vLLM |" in table and "| 1.30 |" in table


def rows_to_runs(rows: list[dict]) -> list[dict]:
    return [{"setting": r["setting"], "concurrency": r["concurrency"], "output_throughput":
             r["output_tok_s"], "median_ttft_ms": 1.0, "median_tpot_ms": 1.0, "failed": 0,
             "tokens_ok": True} for r in rows]  # fmt: skip


def test_memory_of_a_process_tree() -> None:
    """A server of several processes (vLLM's API server, engine core, worker) counts whole."""
    child = "import time; b = b'x' * (200 << 20); time.sleep(120)"  # 200 MiB touched
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
    code += "time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60  # the child up and its 200 MiB touched (loaded box)
        while True:
            tree = quantization.process_tree(parent.pid)
            one = quantization.memory_mib(tree[-1])["peak_rss_mib"] or 0
            if (len(tree) == 2 and one > 200) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(tree) == 2 and tree[0] == parent.pid
        one = quantization.memory_mib(tree[1])["peak_rss_mib"]
        assert one is not None and one > 200
        # The tree read after the child's own: VmHWM never falls, so the sum holds the child's
        # peak as read above plus the parent's (read before it, the child could still grow
        # past the sum: 206.7 vs 210.6 MiB in a CI run).
        mem = quantization.memory_mib(parent.pid)
        assert mem["peak_rss_mib"] is not None and mem["peak_rss_mib"] > one
        assert mem["pss_mib"] is not None and mem["pss_mib"] > 200  # the child's own pages
    finally:
        for pid in quantization.process_tree(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()


def test_gpt_oss_part_sizes() -> None:
    """The gpt-oss part's default is 4 layers in SmolLM2's ids; ``--gpt-oss-layers 24
    --gpt-oss-vocab 201088`` is the whole gpt-oss-20b shape, named so."""
    from benchmarks import gpt_oss_mxfp4

    args = moe.build_parser().parse_args([])
    assert (args.gpt_oss_layers, args.gpt_oss_vocab) == (4, 49152)
    assert moe.gpt_oss_name(4, 49152) == "gpt-oss-20b-4l"
    assert moe.gpt_oss_name(24, 201088) == "gpt-oss-20b"
    assert moe.gpt_oss_name(2, 1000) == "gpt-oss-20b-2l-v1000"
    cfg = gpt_oss_mxfp4.config(24, gpt_oss_mxfp4.GPT_OSS_VOCAB)
    assert (cfg["vocab_size"], cfg["num_hidden_layers"]) == (201088, 24)
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * 64
    layer = e * 3 * h * i + 2 * h * q + 2 * h * kv + e * h  # experts, attention, router
    total = 24 * layer + 2 * cfg["vocab_size"] * h  # + embeddings and the untied head
    assert round(total / 1e9, 1) == 20.9  # gpt-oss-20b's published 20.9B (21B)
