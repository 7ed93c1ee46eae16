"""Every vLLM serve flag in ``kvserve/engine/vllm_flags.py``'s table does what the table says:
kvserve's own and aliases parse, inert ones parse (and change nothing), refused ones exit
naming the flag; and ``LLM()`` takes the engine ones the same way."""

from __future__ import annotations

import contextlib
import io

import pytest

from kvserve.cli import build_parser
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.vllm_flags import (
    ENGINE_FLAGS,
    VLLM_SERVE_FLAGS,
    FlagUse,
    Takes,
    VLLMFlag,
    check_vllm_kwargs,
    flag_field,
)

# The LoRA flags: the LoRA adapters' own code owns them, not this table.
LORA = ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank")


def serve_outcome(argv: list[str]) -> str | None:
    """None if ``kvserve serve ARGV`` parses and its engine options check out, else the
    error message (argparse's or the checks')."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(["serve", *argv])
        EngineArgs.from_cli_args(args)
    except SystemExit:
        return err.getvalue()
    except ValueError as e:
        return str(e)
    return None


def argv_of(flag: str, spec: VLLMFlag, value: str | None = None) -> list[str]:
    return [flag] if spec.takes is Takes.SWITCH else [flag, spec.sample if value is None else value]


@pytest.mark.parametrize("flag", sorted(VLLM_SERVE_FLAGS))
def test_each_vllm_flag_does_what_the_table_says(flag: str) -> None:
    spec = VLLM_SERVE_FLAGS[flag]
    outcome = serve_outcome(argv_of(flag, spec))
    if spec.use is FlagUse.REFUSED:
        assert outcome is not None and flag in outcome and spec.reason in outcome, outcome
        assert "unrecognized arguments" not in outcome
        for value in spec.noop:  # the values that ask for what kvserve does anyway
            assert serve_outcome(argv_of(flag, spec, value)) is None, (flag, value)
    else:
        assert outcome is None, outcome


def test_the_table_has_no_lora_flags_and_every_flag_is_spelled_as_vllm() -> None:
    assert not set(LORA) & set(VLLM_SERVE_FLAGS)  # the LoRA adapters' own code owns them
    for flag, spec in VLLM_SERVE_FLAGS.items():
        assert flag.startswith("-") and (flag == flag.lower() or flag == "-O"), flag
        assert spec.use is FlagUse.KVSERVE or spec.reason, flag


def test_aliases_set_the_kvserve_option() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "-tp", "3"]).tensor_parallel_size == 3
    assert parse(["serve", "-q", "int4"]).quantization == "int4"
    assert parse(["serve", "--disable-uvicorn-access-log"]).no_access_log is True
    assert parse(["serve", "--num-gpu-blocks-override", "64"]).num_kv_blocks == 64
    assert parse(["serve", "--kv-cache-memory-bytes", "2GiB"]).kv_cache_memory == "2GiB"
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2\) is not supported"):
        EngineArgs.from_cli_args(parse(["serve", "-pp", "2"]))


def test_chunked_prefill_and_log_stats() -> None:
    parse = build_parser().parse_args
    args = parse(["serve", "--enable-chunked-prefill", "--disable-log-stats"])
    engine = EngineArgs.from_cli_args(args)
    assert engine.enable_chunked_prefill is True and engine.disable_log_stats is True
    assert EngineArgs.from_cli_args(parse(["serve"])).disable_log_stats is False
    message = serve_outcome(["--no-enable-chunked-prefill"])
    assert message == (
        "enable_chunked_prefill=False (--no-enable-chunked-prefill) is not supported: kvserve "
        "always chunks a prefill longer than --max-num-batched-tokens (there is no unchunked "
        "mode)"
    )


def test_generate_takes_the_engine_flags_only() -> None:
    parse = build_parser().parse_args
    args = parse(["generate", "hi", "--max-seq-len-to-capture", "8192", "-tp", "2"])
    assert args.tensor_parallel_size == 2
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse(["generate", "hi", "--load-format", "pt"])
    assert "--load-format pt is a vLLM option kvserve does not support" in err.getvalue()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse(["generate", "hi", "--ssl-keyfile", "k.pem"])  # a server flag: argparse's
    assert "unrecognized arguments: --ssl-keyfile" in err.getvalue()


@pytest.mark.parametrize(
    "flag",
    sorted(
        f for f, s in ENGINE_FLAGS.items() if f.startswith("--") and s.use is not FlagUse.KVSERVE
    ),
)
def test_llm_keywords_follow_the_table(flag: str) -> None:
    spec = ENGINE_FLAGS[flag]
    key = flag_field(flag)
    value: object = True if spec.takes is Takes.SWITCH else spec.sample
    names = {"model", "num_kv_blocks", "kv_cache_memory", "quantization"}
    if spec.use is FlagUse.REFUSED:
        with pytest.raises(ValueError) as e:
            check_vllm_kwargs({key: value}, names)
        assert flag in str(e.value) and spec.reason in str(e.value)
        for noop in spec.noop:
            assert check_vllm_kwargs({key: noop}, names) == {}
    elif spec.use is FlagUse.INERT:
        assert check_vllm_kwargs({key: value}, names) == {}
    else:  # an alias: renamed to kvserve's keyword
        assert check_vllm_kwargs({key: value}, names) == {flag_field(spec.reason): value}


def test_llm_refuses_a_vllm_option_before_loading() -> None:
    from kvserve import LLM

    with pytest.raises(ValueError, match="--limit-mm-per-prompt is a vLLM option"):
        LLM(limit_mm_per_prompt={"image": 2})
    assert EngineArgs.from_kwargs(max_seq_len_to_capture=8192) == EngineArgs()
