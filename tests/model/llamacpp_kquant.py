"""The Q4_K_M / Q5_K_M files and llama.cpp's greedy tokens that
``test_gguf_llamacpp_tokens.py`` compares kvserve against, made with llama.cpp's own tools:

* a tiny random Llama (untied head) and Qwen3 (tied head, q/k norms), float32, seeded, with
  every projection's rows a multiple of 256 so that K-quants apply to all of them (a row that
  is not falls back to Q5_0 / Q8_0 in llama-quantize's recipes);
* ``convert_hf_to_gguf.py`` of the llama.cpp tree (``llamacpp_convert.py``: the test files'
  256-token SentencePiece vocabulary in place of a tokenizer folder) writes the F32 GGUF,
  ``llama-quantize`` its Q4_K_M and Q5_K_M files (its default recipes: Q4_K / Q5_K with Q6_K
  for the LM head and for some layers' ``attn_v`` / ``ffn_down``);
* ``llama-server`` gives the greedy tokens of each file: ``/completion`` with the prompt as
  token ids (no tokenizer in the comparison), ``temperature`` 0, ``ignore_eos``, no prompt
  cache, the KV cache in float32 (``--cache-type-k/v f32``, default f16) and flash attention
  off, and the top-2 log-probabilities of each step (``n_probs``) to show how close a step was.

``python -m tests.model.llamacpp_kquant [OUT_DIR]`` rewrites the cached files (default
``tests/model/data/llamacpp_kquant``) from the build ``benchmarks/peers/setup_llamacpp.sh``
made (``.peers/llamacpp``, or ``KVSERVE_LLAMA_CPP_BUILD``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from benchmarks.peers.llamacpp import LlamaCppBuild, server_command

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("data") / "llamacpp_kquant"
BUILD_ROOT = Path(os.environ.get("KVSERVE_LLAMA_CPP_BUILD", ROOT / ".peers" / "llamacpp"))
# the llama.cpp commit llama-cpp-python 0.3.36's sdist vendors (its CHANGELOG): the server's
# own --version says "0 (unknown)", the sdist carries no git metadata
LLAMA_CPP_COMMIT = "0c1e57098"
FAMILIES = ("llama", "qwen3")
QTYPES = ("Q4_K_M", "Q5_K_M")
VOCAB = 256  # the test files' SentencePiece vocabulary (test_gguf_gemma_phi3.add_tiny_tokenizer)
N_PROMPTS, MAX_TOKENS = 10, 16
TRAIN_STEPS = 80
# llama-server flags that keep its float32 paths where it has a choice: the KV cache (f16 by
# default) and attention without flash attention (on "auto" it may run). Its K-quant matmuls
# still quantize the activations to Q8_K (int8, a scale per 256), which no flag turns off.
F32_FLAGS = ("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off")


def prompts() -> list[list[int]]:
    """Ten fixed prompts of 3 to 24 token ids, none of them a special token (ids 0-5)."""
    rng = np.random.default_rng(34)
    return [rng.integers(6, VOCAB, int(n)).tolist() for n in rng.integers(3, 25, N_PROMPTS)]


def make_model(family: str) -> PreTrainedModel:
    """A small float32 ``family`` model: hidden 256, intermediate 256, one layer (the four
    files stay under 1.5 MB in all), 4 heads of 64 (q and o rows of 256), 2 KV heads; the LM
    head untied (Llama) or tied (Qwen3); its norms random, then briefly trained
    (:func:`train`) so that its next-token distributions are peaked as a real model's are."""
    common = {
        "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 256,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 2.0**-10,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    }  # fmt: skip
    torch.manual_seed(0)
    if family == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    rng = np.random.default_rng(1)
    with torch.no_grad():  # norms start at ones: randomised so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    train(model)
    return model.eval()


def train(model: PreTrainedModel, steps: int = TRAIN_STEPS) -> None:
    """A few AdamW steps on a Markov chain over the vocabulary: the next token is one
    of two successors of the previous one, picked by the parity of the one before (so the
    model needs its attention), 1 time in 10 a random one. Why: an untrained model's logits
    are flat, its top two within llama.cpp's Q8_K activation noise at about one step in
    twenty, so the two engines' greedy runs part on most prompts (simulated with Q8_K-rounded
    linear inputs: 2 to 5 of 10 prompts equal for 16 steps); a real model's are peaked.
    After these steps: 10 of 10 in the same simulation, 80 distinct tokens in the 160 steps,
    the closest top two 0.03 (Llama) and 0.16 (Qwen3) logit standard deviations apart."""
    rng = np.random.default_rng(2)
    succ = rng.integers(6, VOCAB, (VOCAB, 2))  # [previous token, parity of the one before]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    threads = torch.get_num_threads()
    # one thread: 0.2 s a step on the loaded 2-core box, 2 s with two threads
    torch.set_num_threads(1)
    for _ in range(steps):
        seq = rng.integers(6, VOCAB, (16, 32))  # [batch, tokens]: the random ones stay
        for t in range(2, seq.shape[1]):
            keep = rng.random(16) < 0.9
            seq[keep, t] = succ[seq[keep, t - 1], seq[keep, t - 2] % 2]
        ids = torch.from_numpy(seq)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


@contextmanager
def llama_server(build: LlamaCppBuild, gguf: Path) -> Iterator[str]:
    """llama-server on ``gguf`` (one slot, two threads, float32 KV): its base URL."""
    port = free_port()
    cmd = [*server_command(build, gguf, port, threads=2, parallel=1, ctx_size=256), *F32_FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {proc.stderr.read()}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("llama-server did not answer /health in 120 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def llamacpp_greedy(build: LlamaCppBuild, gguf: Path) -> list[dict[str, Any]]:
    """llama-server's greedy run of each prompt: ``{"tokens": [16 ids], "top2": [[lp1, lp2],
    ...]}`` (the two largest log-probabilities before sampling, one pair a step)."""
    runs = []
    with llama_server(build, gguf) as url:
        for prompt in prompts():
            body = {
                "prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "n_probs": 2,
            }  # fmt: skip
            out = _post(url + "/completion", body)
            top2 = [[round(p["logprob"], 4) for p in step["top_logprobs"]]
                    for step in out["completion_probabilities"]]  # fmt: skip
            runs.append({"tokens": out["tokens"], "top2": top2})
    return runs


def convert_f32(tree: Path, work: Path) -> None:
    """Each family's model into ``work/<family>-F32.gguf`` by the tree's converter."""
    pairs = []
    for family in FAMILIES:
        make_model(family).save_pretrained(work / family)
        pairs += [str(work / family), str(work / f"{family}-F32.gguf")]
    driver = Path(__file__).with_name("llamacpp_convert.py")
    subprocess.run([sys.executable, str(driver), str(tree), *pairs], check=True,
                   capture_output=True, timeout=600)  # fmt: skip


def write_ggufs(build: LlamaCppBuild, out_dir: Path, work: Path) -> dict[str, Path]:
    """``{"llama-Q4_K_M": path, ...}``: each family's F32 file (converted into ``work``
    unless there) quantized by llama-quantize."""
    if not all((work / f"{f}-F32.gguf").is_file() for f in FAMILIES):
        convert_f32(build.source, work)
    files: dict[str, Path] = {}
    for family in FAMILIES:
        for qtype in QTYPES:
            dst = out_dir / f"{family}-{qtype}.gguf"
            cmd = [str(build.quantize), str(work / f"{family}-F32.gguf"), str(dst), qtype, "2"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            files[f"{family}-{qtype}"] = dst
    return files


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else DATA
    out_dir.mkdir(parents=True, exist_ok=True)
    build = LlamaCppBuild(BUILD_ROOT)
    build.check()
    with tempfile.TemporaryDirectory() as tmp:
        files = write_ggufs(build, out_dir, Path(tmp))
    doc = {
        "llama_cpp_commit": LLAMA_CPP_COMMIT,
        "llama_server_version": build.version(),
        "llama_server_flags": list(F32_FLAGS),
        "prompts": prompts(),
        "runs": {key: llamacpp_greedy(build, path) for key, path in files.items()},
    }
    (out_dir / "llamacpp_tokens.json").write_text(json.dumps(doc, indent=1) + "\n")
    for key, path in files.items():
        print(f"{key}: {path} {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
