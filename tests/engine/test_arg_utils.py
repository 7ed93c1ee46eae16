"""``EngineArgs``: one declaration per engine option, its CLI flags, vLLM's names, refusals."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.config import (
    AttentionBackendEnum,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    GenerationConfigSource,
    KVPolicy,
    ModelConfig,
    PoolingType,
    PreemptionMode,
    Quantization,
    QuantizedActivations,
    SchedulerConfig,
    SchedulingPolicy,
    auto_dtype,
)
from kvserve.engine import arg_utils
from kvserve.engine.arg_utils import VLLM_UNSUPPORTED, EngineArgs, available_memory
from kvserve.server.cli import _model_specs, add_serve_parser, run_serve
from tests.server.conftest import TINY, start_server, tiny_model_dir  # noqa: F401 (fixture)

FIELDS = [f.name for f in fields(EngineArgs)]
MiB, GiB = 2**20, 2**30


def engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def kvserve_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The "kvserve" logger's records (it does not propagate to the root, caplog's home)."""
    logger = logging.getLogger("kvserve")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_every_field_has_exactly_one_flag_with_help() -> None:
    actions = [a for a in engine_parser()._actions if a.dest != "help"]
    by_dest = {name: [a for a in actions if a.dest == name] for name in FIELDS}
    assert all(len(found) == 1 for found in by_dest.values()), by_dest
    for name, (action,) in by_dest.items():
        flag = "--" + name.replace("_", "-")
        bool_field = isinstance(action, argparse.BooleanOptionalAction)
        assert action.option_strings == ([flag, flag.replace("--", "--no-", 1)] if bool_field
                                          else [flag]), name  # fmt: skip
        assert action.help and action.help != argparse.SUPPRESS, name
    # Everything else the helper adds is a hidden refusal of a vLLM option kvserve lacks.
    assert {a.dest for a in actions} - set(FIELDS) == set(VLLM_UNSUPPORTED)


def test_flag_defaults_are_the_dataclass_defaults() -> None:
    parser = engine_parser()
    for f in fields(EngineArgs):
        assert parser.get_default(f.name) == f.default, f.name
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    assert EngineArgs().llm_kwargs() == {"model": None}


ALL_FLAGS = [
    "--served-model-name", "m1", "--dtype", "float32", "--max-model-len", "64",
    "--seed", "7", "--device", "cpu", "--kv-cache-memory", "8MiB", "--block-size", "8",
    "--swap-space", "2", "--no-enable-prefix-caching", "--max-num-seqs", "3",
    "--max-num-batched-tokens", "100", "--kv-policy", "reserve", "--preemption-mode", "swap",
    "--scheduling-policy", "priority", "--priority-scheduling-preemption-threshold", "2",
    "--attention-backend", "torch_sdpa", "--no-fused-ops", "--no-prepack-weights", "--no-warmup",
    "--num-threads", "1", "--chat-template", "<{{ messages[0]['content'] }}>",
    "--generation-config", "auto", "--tensor-parallel-size", "1", "--enforce-eager",
    "--disable-log-requests", "--pooling", "mean", "--quantization-activations", "none",
    "--quantization", "int8", "--quantization-lm-head", "--cuda-graph-sizes", "2",
    "--max-cudagraph-capture-size", "2",
]  # fmt: skip


def test_cli_to_engine_args_to_engine_config(tmp_path: Path) -> None:
    model = str(tmp_path)
    args = EngineArgs.from_cli_args(
        engine_parser().parse_args(["--model", model, "--tokenizer", model, *ALL_FLAGS])
    )
    template = "<{{ messages[0]['content'] }}>"
    assert args == EngineArgs(
        model=model, tokenizer=model, served_model_name=["m1"], dtype="float32",
        max_model_len=64, seed=7, device="cpu", kv_cache_memory="8MiB", block_size=8,
        swap_space="2GiB", enable_prefix_caching=False, max_num_seqs=3,
        max_num_batched_tokens=100, kv_policy="reserve", preemption_mode="swap",
        scheduling_policy="priority", priority_scheduling_preemption_threshold=2,
        attention_backend="TORCH_SDPA", fused_ops=False, prepack_weights=False, warmup=False,
        num_threads=1, chat_template=template, generation_config="auto",
        tensor_parallel_size=1, enforce_eager=True, disable_log_requests=True, pooling="mean",
        quantization_activations="none", quantization="int8", quantization_lm_head=True,
        cuda_graph_sizes=[2], max_cudagraph_capture_size=2,
    )  # fmt: skip
    expected = EngineConfig(
        model=ModelConfig(
            path=model, dtype=torch.float32, max_model_len=64, seed=7, served_name="m1",
            prepack_weights=False, fused_ops=False,
            attention_backend=AttentionBackendEnum.TORCH_SDPA,
            enforce_eager=True, warmup=False, chat_template=template, pooling=PoolingType.MEAN,
            quantization_activations=QuantizedActivations.NONE,
            quantization=Quantization.INT8, quantization_lm_head=True,
        ),
        cache=CacheConfig(block_size=8, kv_cache_memory=8 * MiB, num_kv_blocks=None,
                          swap_space=2 * GiB, enable_prefix_caching=False),
        scheduler=SchedulerConfig(3, 100, KVPolicy.RESERVE, PreemptionMode.SWAP,
                                  SchedulingPolicy.PRIORITY, 2),
        device="cpu",
        compilation=CompilationConfig(cudagraph_capture_sizes=(1, 2)),
    )  # fmt: skip
    assert args.create_engine_config() == expected
    # The same options as LLM keyword arguments build the same config.
    assert EngineArgs.from_kwargs(**args.llm_kwargs()).create_engine_config() == expected


def test_defaults_build_the_documented_config(tmp_path: Path) -> None:
    cfg = EngineArgs(model=str(tmp_path)).create_engine_config()
    assert cfg == EngineConfig(
        model=ModelConfig(path=str(tmp_path), dtype=auto_dtype("cpu"), served_name=tmp_path.name),
        cache=CacheConfig(block_size=16, kv_cache_memory=None, swap_space=4 * GiB),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
    )


def test_gpu_memory_utilization_is_a_fraction_of_the_free_memory(tmp_path: Path) -> None:
    asked: list[str] = []

    def free(device: str) -> int:
        asked.append(device)
        return 8 * GiB

    args = EngineArgs(model=str(tmp_path), gpu_memory_utilization=0.5)
    assert args.create_engine_config(free_memory=free).cache.kv_cache_memory == 4 * GiB
    args = EngineArgs(model=str(tmp_path), gpu_memory_utilization=0.3)
    assert args.create_engine_config(free_memory=lambda d: 1000).cache.kv_cache_memory == 300
    assert asked == ["cpu"]
    # The real reader: /proc/meminfo's MemAvailable, at most the machine's memory.
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < available_memory("cpu") <= total


def test_gpu_memory_utilization_refusals() -> None:
    with pytest.raises(ValueError) as e:
        EngineArgs(gpu_memory_utilization=0.5, kv_cache_memory="1GiB")
    assert str(e.value) == (
        "give only one of gpu_memory_utilization (--gpu-memory-utilization) and "
        "kv_cache_memory (--kv-cache-memory): both size the KV cache"
    )
    with pytest.raises(ValueError, match=r"and num_kv_blocks \(--num-kv-blocks\)"):
        EngineArgs(gpu_memory_utilization=0.5, num_kv_blocks=10)
    with pytest.raises(ValueError) as e:
        EngineArgs(gpu_memory_utilization=1.5)
    assert str(e.value) == (
        "gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got 1.5"
    )


def test_vllm_refusals_name_the_option(tmp_path: Path) -> None:
    parse = engine_parser().parse_args
    cases = {
        ("--tensor-parallel-size", "0"): "tensor_parallel_size (--tensor-parallel-size) must "
        "be positive, got 0",
        ("--trust-remote-code",): "trust_remote_code=True (--trust-remote-code) is not "
        "supported: kvserve never runs a model's own Python code",
        ("--generation-config", "/m"): "generation_config='/m' (--generation-config /m) is not "
        "supported: kvserve reads generation_config.json from the model folder only; give "
        "'auto' (the model's sampling defaults) or 'vllm' (none)",
        ("--model", str(tmp_path), "--tokenizer", "/tok"): "tokenizer '/tok' (--tokenizer) is "
        "neither a local folder nor a Hugging Face Hub id (org/name)",
        ("--chat-template", "no/such.jinja"): "chat_template 'no/such.jinja' (--chat-template) "
        "is neither a file nor a Jinja template",
    }
    for argv, message in cases.items():
        with pytest.raises(ValueError) as e:
            EngineArgs.from_cli_args(parse(list(argv)))
        assert str(e.value) == message, argv
    # Their no-op values are accepted: they change nothing.
    ok = ["--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto", "--cpu-offload-gb", "0"]
    assert EngineArgs.from_cli_args(parse(ok)) == EngineArgs()


def test_llm_refuses_unknown_and_unsupported_keywords() -> None:
    # Refused before anything is loaded (the built-in model is never touched).
    with pytest.raises(TypeError) as e:
        LLM(max_num_seq=4)
    assert str(e.value) == "unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'?"
    with pytest.raises(TypeError) as e:
        LLM(uvicorn_log_level="warning")  # a server option, as in vLLM's LLM
    assert str(e.value) == "unknown engine argument 'uvicorn_log_level'"
    with pytest.raises(ValueError) as e:
        LLM(tensor_parallel_size=0)
    assert str(e.value).startswith("tensor_parallel_size (--tensor-parallel-size) must be")
    with pytest.raises(ValueError) as e:
        LLM(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert str(e.value) == "max_cpu_loras (2) must be >= max_loras (4)"
    assert EngineArgs.from_kwargs(pipeline_parallel_size=1, quantization=None) == EngineArgs()
    with pytest.raises(ValueError) as e:  # a quantization kvserve does not run
        LLM(quantization="bitsandbytes")
    assert str(e.value) == (
        "quantization must be one of ['int8', 'int4', 'gguf', 'compressed-tensors', 'awq', "
        "'gptq', 'mxfp4'], got 'bitsandbytes'"
    )


def test_chat_template_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    from_file = EngineArgs(model=str(tmp_path), chat_template=str(path))
    assert from_file.create_engine_config().model.chat_template == "{{ messages }}"
    inline = EngineArgs(model=str(tmp_path), chat_template="{% if x %}y{% endif %}")
    assert inline.create_engine_config().model.chat_template == "{% if x %}y{% endif %}"


def test_inert_vllm_options_are_logged(
    tmp_path: Path, kvserve_logs: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos": 2}))
    args = EngineArgs(model=str(tmp_path), enforce_eager=True, disable_log_requests=True)
    # generation_config is vLLM's 'auto' by default: applied by the engine, not refused.
    assert args.create_engine_config().model.generation_config is GenerationConfigSource.AUTO
    assert kvserve_logs.messages == [
        "disable_log_requests: kvserve never logs request contents",
    ]
    # enforce_eager is not inert: it keeps every step's layers in Python
    assert args.create_engine_config().model.enforce_eager
    vllm = EngineArgs(model=str(tmp_path), generation_config="vllm").create_engine_config()
    assert vllm.model.generation_config is GenerationConfigSource.VLLM


def test_serve_takes_the_vllm_names(tmp_path: Path) -> None:
    model = str(tmp_path)
    args = serve_args("--model", model, "--uvicorn-log-level", "warning")
    assert (args.log_level, _model_specs(args)) == ("warning", [(model, None)])
    assert _model_specs(serve_args(model, "--model", model)) == [(model, None)]
    with pytest.raises(ValueError) as e:
        _model_specs(serve_args("/a", "--model", model))
    assert str(e.value) == (
        f"--model {model!r} and the positional models ['/a'] disagree; give the model one way"
    )
    # An engine option is checked before the server starts (exit code 2 through main).
    with pytest.raises(ValueError, match=r"^tensor_parallel_size \(--tensor-parallel-size\)"):
        run_serve(serve_args(model, "--tensor-parallel-size", "0"))


def test_llm_takes_the_vllm_keywords(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arg_utils, "available_memory", lambda device: 64 * MiB)
    model = str(tiny_llama)
    llm = LLM(
        model=model, tokenizer=model, gpu_memory_utilization=0.5, enable_prefix_caching=True,
        tensor_parallel_size=1, enforce_eager=True, disable_log_requests=True,
        generation_config="auto", dtype="float32", block_size=4,
    )  # fmt: skip
    engine = llm.engine
    assert engine.config.cache.kv_cache_memory == 32 * MiB
    hf = engine.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_block = 2 * hf.num_hidden_layers * 4 * hf.num_key_value_heads * head_dim * 4  # fp32
    assert engine.kv_info["num_blocks"] == 32 * MiB // per_block
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.slow
def test_vllm_style_serve_command_line(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """``kvserve serve`` started as a vLLM user would, on the tiny model. The KV cache takes
    2% of the free memory, not vLLM's 0.5: the test box is shared (the sizing itself is
    checked exactly above)."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    folder = str(tiny_model_dir)
    server = start_server(
        ["--model", folder, "--tokenizer", folder, "--gpu-memory-utilization", "0.02",
         "--enable-prefix-caching", "--tensor-parallel-size", "1", "--enforce-eager",
         "--disable-log-requests", "--uvicorn-log-level", "warning",
         "--generation-config", "auto", "--chat-template", str(template)],
        tmp_path / "server.log",
    )  # fmt: skip
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == [TINY]
        body = {"model": TINY, "prompt": "hello there", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("hello there"))
        assert r.json()["usage"]["completion_tokens"] == 3
        body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        # Rendered with --chat-template, not the tokenizer's own template.
        expected = len(tok.encode("<user>hi", add_special_tokens=False))
        assert r.json()["usage"]["prompt_tokens"] == expected
    finally:
        server.stop()
    log = server.log.read_text()
    assert "gpu_memory_utilization 0.02: KV cache" in log
    assert "fused ops: on; C++ decode loop: off" in log  # --enforce-eager


def test_auto_dtype_is_bf16_only_where_it_is_native() -> None:
    assert auto_dtype("cuda") == torch.bfloat16  # a device string is enough: nothing runs
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert auto_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert EngineArgs().create_engine_config(free_memory=lambda _: 2**30).model.dtype == (
        auto_dtype("cpu")
    )
