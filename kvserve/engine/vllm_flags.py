"""Every ``vllm serve`` flag, and what kvserve does with it: one table, one place.

A command line copied from vLLM's docs must never die in argparse's generic "unrecognized
arguments": each vLLM flag is either kvserve's own with vLLM's meaning (``KVSERVE``:
declared by ``EngineArgs`` or the ``serve`` parser), accepted although it changes nothing
here (``INERT``: the reason is logged), an alias of a kvserve flag (``ALIAS``), or refused
by name with a one-line reason (``REFUSED``; the values in ``noop`` are accepted since they
ask for what kvserve does anyway). ``add_vllm_flags`` registers the INERT, ALIAS and REFUSED
ones a parser does not have yet; ``check_vllm_kwargs`` applies the engine ones to ``LLM()``
keywords; ``tests/engine/test_vllm_flags.py`` walks the whole table.

The list is vLLM's ``vllm serve --help`` (``vllm/engine/arg_utils.py`` and
``vllm/entrypoints/openai/cli_args.py``, the 0.6-0.11 releases: older flags that copied
command lines still carry are kept). The LoRA flags (``--enable-lora``, ``--lora-modules``,
``--max-loras``, ``--max-lora-rank``, ...) are not in this table: they belong to the LoRA
adapters' own code.
"""

from __future__ import annotations

import argparse
import enum
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvserve")


class FlagUse(enum.Enum):
    KVSERVE = "kvserve"  # kvserve's own flag, vLLM's meaning
    ALIAS = "alias"  # another spelling of a kvserve flag (``reason`` names it)
    INERT = "inert"  # accepted; changes nothing here (``reason`` says why)
    REFUSED = "refused"  # refused by name, unless given one of ``noop``


class Takes(enum.Enum):
    SWITCH = "switch"  # a bare flag
    VALUE = "value"  # one value
    VALUES = "values"  # one or more values


@dataclass(frozen=True)
class VLLMFlag:
    use: FlagUse
    reason: str = ""  # INERT/REFUSED: why; ALIAS: the kvserve flag it spells
    takes: Takes = Takes.VALUE
    noop: tuple[str, ...] = ()  # REFUSED: values accepted because they change nothing
    sample: str = "1"  # a value the table's test gives the flag (VALUE/VALUES)
    engine: bool = True  # an engine option (LLM() takes it), not the HTTP server's


S, V, VS = Takes.SWITCH, Takes.VALUE, Takes.VALUES
_NO_GPU = "kvserve has no custom GPU kernels or all-reduce to tune"
_NO_MM = "kvserve serves text-only models (no images, audio or video)"
_NO_DP = "kvserve runs one engine per model (no data parallelism)"
_NO_EP = "kvserve has no expert parallelism"
_NO_KV_XFER = "kvserve has no disaggregated prefill / KV transfer"
_ONE_API = "kvserve runs one API server process per engine"
_REMOTE = "kvserve never runs a model's own Python code"
_PLUGINS = "kvserve loads no plugins; its parsers are built in"


def _k(takes: Takes = V, sample: str = "1", engine: bool = True) -> VLLMFlag:
    return VLLMFlag(FlagUse.KVSERVE, takes=takes, sample=sample, engine=engine)


def _i(reason: str, takes: Takes = V, sample: str = "1", engine: bool = True) -> VLLMFlag:
    return VLLMFlag(FlagUse.INERT, reason, takes, sample=sample, engine=engine)


def _r(
    reason: str,
    takes: Takes = V,
    noop: tuple[str, ...] = (),
    sample: str = "x",
    engine: bool = True,
) -> VLLMFlag:
    return VLLMFlag(FlagUse.REFUSED, reason, takes, noop, sample, engine)


def _a(target: str, engine: bool = True, sample: str = "1") -> VLLMFlag:
    takes = S if target in ("--no-access-log",) else V
    return VLLMFlag(FlagUse.ALIAS, target, takes, sample=sample, engine=engine)


# The engine's flags (vLLM's EngineArgs): LLM() takes them too.
ENGINE_FLAGS: dict[str, VLLMFlag] = {
    # model
    "--model": _k(sample="m"),
    "--tokenizer": _k(sample="org/tok"),
    "--revision": _k(sample="main"),
    "--tokenizer-revision": _k(sample="main"),
    "--download-dir": _k(sample="/tmp"),
    "--dtype": _k(sample="float32"),
    "--seed": _k(),
    "--max-model-len": _k(sample="64"),
    "--served-model-name": _k(VS, "m"),
    "--quantization": _k(sample="int8"),
    "-q": _a("--quantization", sample="int8"),
    "--enforce-eager": _k(S),
    "--max-logprobs": _k(sample="5"),
    "--generation-config": _k(sample="vllm"),
    "--model-impl": _k(sample="transformers"),
    "--logits-processors": _k(VS, "tests.engine.test_custom_processors:ForceToken"),
    "--trust-remote-code": _r(_REMOTE, S),
    "--task": _k(sample="score"),
    "--runner": _r(
        "kvserve serves generation and embeddings from every model; there is no other runner",
        noop=("auto", "generate", "pooling"),
    ),
    "--convert": _r(
        "kvserve converts no model into a classifier or reward model",
        noop=("auto", "none", "embed"),
    ),
    "--tokenizer-mode": _r(
        "kvserve loads the fast (Rust) tokenizer of the model", noop=("auto", "hf")
    ),
    "--skip-tokenizer-init": _r(
        "kvserve always loads the model's tokenizer (a folder "
        "without one takes token-id prompts only)",
        S,
    ),
    "--hf-config-path": _r("kvserve reads config.json from the model folder"),
    "--code-revision": _r(_REMOTE),
    "--hf-token": _r("set HF_TOKEN in the environment instead (huggingface_hub reads it)"),
    "--hf-overrides": _r("kvserve loads the model's config.json as it is", sample="{}"),
    "--config-format": _r("kvserve reads Hugging Face config.json only", noop=("auto", "hf")),
    "--rope-scaling": _r("kvserve applies the model's own rope_scaling (config.json)"),
    "--rope-theta": _r("kvserve applies the model's own rope_theta (config.json)"),
    "--max-seq-len-to-capture": _k(sample="8192"),
    "--logprobs-mode": _r(
        "kvserve's logprobs are the log-softmax of the raw logits (vLLM's default)",
        noop=("raw_logprobs",),
    ),
    "--disable-sliding-window": _r("kvserve applies the model's sliding windows", S),
    "--disable-cascade-attn": _i("kvserve has no cascade attention", S),
    "--enable-prompt-embeds": _r("kvserve takes text or token-id prompts only", S),
    "--override-generation-config": _r(
        "edit the model's generation_config.json or pass the sampling fields per request",
        sample="{}",
    ),
    "--enable-sleep-mode": _k(S),
    "--override-pooler-config": _r("kvserve pools by --pooling (last or mean)", sample="{}"),
    "--pooler-config": _r("kvserve pools by --pooling (last or mean)", sample="{}"),
    "--logits-processor-pattern": _r(
        "kvserve takes logits processors at start-up only (--logits-processors), not per request"
    ),
    "--override-attention-dtype": _r("attention runs in the model's --dtype"),
    "--io-processor-plugin": _r(_PLUGINS),
    "--allowed-local-media-path": _r(_NO_MM, sample="/tmp"),
    "--allowed-media-domains": _r(_NO_MM, VS),
    # loading
    "--load-format": _r(
        "kvserve loads safetensors folders and GGUF files only (never pickles)",
        noop=("auto", "safetensors", "gguf"),
    ),
    "--model-loader-extra-config": _r("kvserve's loader takes no extra options", sample="{}"),
    "--ignore-patterns": _r("kvserve fetches only config, tokenizer and safetensors files"),
    "--use-tqdm-on-load": _i("kvserve logs its load steps instead of a progress bar", S),
    "--safetensors-load-strategy": _i(
        "kvserve reads each tensor through its own memory map", sample="lazy"
    ),
    "--pt-load-map-location": _r("kvserve loads no PyTorch pickles", sample="cpu"),
    # parallelism
    "--tensor-parallel-size": _k(),
    "-tp": _a("--tensor-parallel-size"),
    "--distributed-executor-backend": _k(sample="uni"),
    "--pipeline-parallel-size": _k(),  # refused above 1 (EngineArgs' VLLM_UNSUPPORTED)
    "-pp": _a("--pipeline-parallel-size"),
    "--data-parallel-size": _k(),  # refused above 1 (EngineArgs' VLLM_UNSUPPORTED)
    "-dp": _a("--data-parallel-size"),
    "--decode-context-parallel-size": _r("kvserve has no context parallelism", noop=("1",)),
    "-dcp": _r("kvserve has no context parallelism", noop=("1",)),
    "--data-parallel-rank": _r(_NO_DP, noop=("0",)),
    "--data-parallel-start-rank": _r(_NO_DP, noop=("0",)),
    "--data-parallel-size-local": _r(_NO_DP, noop=("1",)),
    "--data-parallel-address": _r(_NO_DP),
    "--data-parallel-rpc-port": _r(_NO_DP),
    "--data-parallel-backend": _r(_NO_DP),
    "--data-parallel-hybrid-lb": _r(_NO_DP, S),
    "--data-parallel-external-lb": _r(_NO_DP, S),
    "--enable-expert-parallel": _r(_NO_EP, S),
    "--enable-eplb": _r(_NO_EP, S),
    "--eplb-config": _r(_NO_EP, sample="{}"),
    "--expert-placement-strategy": _r(_NO_EP),
    "--num-redundant-experts": _r(_NO_EP, noop=("0",)),
    "--all2all-backend": _r(_NO_EP),
    "--enable-dbo": _r("kvserve has no dual-batch overlap", S),
    "--enable-multimodal-encoder-data-parallel": _r(_NO_MM, S),
    "--max-parallel-loading-workers": _i(
        "each tensor-parallel rank loads its own shard", sample="2"
    ),
    "--ray-workers-use-nsight": _r(
        "kvserve's workers are processes, not Ray actors (see --ray for Ray Serve replicas)", S
    ),
    "--disable-custom-all-reduce": _i(_NO_GPU, S),
    "--worker-cls": _r(_PLUGINS, noop=("auto",)),
    "--worker-extension-cls": _r(_PLUGINS, noop=("",)),
    # KV cache
    "--block-size": _k(sample="16"),
    "--gpu-memory-utilization": _k(sample="0.5"),
    "--kv-cache-memory-bytes": _a("--kv-cache-memory", sample="1GiB"),
    "--swap-space": _k(sample="2"),
    "--kv-cache-dtype": _k(sample="auto"),  # refused but auto (VLLM_UNSUPPORTED)
    "--num-gpu-blocks-override": _a("--num-kv-blocks", sample="64"),
    "--enable-prefix-caching": _k(S),
    "--prefix-caching-hash-algo": _i(
        "kvserve keys prefix blocks by their token ids", sample="sha256"
    ),
    "--cpu-offload-gb": _k(sample="0"),  # refused but 0 (VLLM_UNSUPPORTED)
    "--calculate-kv-scales": _r("the KV cache has the model's dtype (no fp8 scales)", S),
    "--kv-sharing-fast-prefill": _r("kvserve shares no KV cache across layers", S),
    "--mamba-cache-dtype": _r("kvserve runs no Mamba models", noop=("auto",)),
    "--mamba-ssm-cache-dtype": _r("kvserve runs no Mamba models", noop=("auto",)),
    "--kv-offloading-size": _r("kvserve offloads KV blocks only by --preemption-mode swap"),
    "--kv-offloading-backend": _r("kvserve offloads KV blocks only by --preemption-mode swap"),
    # multimodal
    "--limit-mm-per-prompt": _r(_NO_MM, sample="image=2"),
    "--media-io-kwargs": _r(_NO_MM, sample="{}"),
    "--mm-processor-kwargs": _r(_NO_MM, sample="{}"),
    "--mm-processor-cache-gb": _i(_NO_MM, sample="4"),
    "--disable-mm-preprocessor-cache": _i(_NO_MM, S),
    "--mm-processor-cache-type": _i(_NO_MM, sample="lru"),
    "--mm-shm-cache-max-object-size-mb": _i(_NO_MM, sample="128"),
    "--mm-encoder-tp-mode": _i(_NO_MM, sample="weights"),
    "--interleave-mm-strings": _r(_NO_MM, S),
    "--skip-mm-profiling": _i(_NO_MM, S),
    "--video-pruning-rate": _r(_NO_MM),
    # scheduler
    "--max-num-batched-tokens": _k(sample="512"),
    "--max-num-seqs": _k(sample="8"),
    "--enable-chunked-prefill": _k(S),  # always on; --no-enable-chunked-prefill is refused
    "--scheduling-policy": _k(sample="priority"),
    "--preemption-mode": _k(sample="swap"),
    "--max-num-partial-prefills": _r(
        "kvserve chunks one long prefill at a time in each step's token budget", noop=("1",)
    ),
    "--max-long-partial-prefills": _r(
        "kvserve chunks one long prefill at a time in each step's token budget", noop=("1",)
    ),
    "--long-prefill-token-threshold": _r(
        "kvserve chunks prefills by --max-num-batched-tokens only", noop=("0",)
    ),
    "--num-lookahead-slots": _r("speculative decoding is set by --speculative-config", noop=("0",)),
    "--scheduler-delay-factor": _r("kvserve schedules every step without delay", noop=("0", "0.0")),
    "--num-scheduler-steps": _r("kvserve schedules every step", noop=("1",)),
    "--multi-step-stream-outputs": _i("kvserve schedules every step (no multi-step)", S),
    "--disable-chunked-mm-input": _i(_NO_MM, S),
    "--scheduler-cls": _r(_PLUGINS),
    "--disable-hybrid-kv-cache-manager": _i("kvserve has one KV cache manager", S),
    "--async-scheduling": _r("kvserve's scheduler runs in step with the model", S),
    "--stream-interval": _r(
        "kvserve streams every token (the server batches SSE frames by "
        "--stream-batching-interval-ms)",
        noop=("1",),
    ),
    "--cuda-graph-sizes": _k(VS, "8"),
    "--max-cudagraph-capture-size": _k(sample="8"),
    "--use-v2-block-manager": _i("vLLM's own no-op (v2 is the only block manager)", S),
    # speculative decoding and compilation
    "--speculative-config": _k(sample='{"method": "ngram", "num_speculative_tokens": 2}'),
    "--speculative-model": _r("give it in --speculative-config '{\"model\": ...}'"),
    "--num-speculative-tokens": _r(
        "give it in --speculative-config '{\"num_speculative_tokens\": ...}'"
    ),
    "--ngram-prompt-lookup-max": _r(
        "give it in --speculative-config '{\"prompt_lookup_max\": ...}'"
    ),
    "--ngram-prompt-lookup-min": _r(
        "give it in --speculative-config '{\"prompt_lookup_min\": ...}'"
    ),
    "--compilation-config": _i(
        "kvserve compiles nothing with torch.compile; its C++ kernels are built once; CUDA "
        "graph sizes are --cuda-graph-sizes / --max-cudagraph-capture-size here",
        sample="{}",
    ),
    "-O": _i(
        "kvserve compiles nothing with torch.compile; its C++ kernels are built once", sample="3"
    ),
    "--kv-transfer-config": _r(_NO_KV_XFER, sample="{}"),
    "--kv-events-config": _r("kvserve publishes no KV cache events", sample="{}"),
    "--ec-transfer-config": _r(_NO_KV_XFER, sample="{}"),
    "--additional-config": _r("kvserve has no platform plugins", sample="{}"),
    "--structured-outputs-config": _r(
        "kvserve compiles structured outputs with xgrammar; its limits are the --grammar-* flags",
        sample="{}",
    ),
    "--guided-decoding-backend": _r(
        "kvserve compiles structured outputs with xgrammar", noop=("auto", "xgrammar")
    ),
    "--reasoning-parser": _k(sample="qwen3", engine=False),
    "--reasoning-parser-plugin": _r(_PLUGINS, engine=False),
    # device, attention, logging and observability
    "--device": _k(sample="cpu"),
    "--attention-backend": _k(sample="TORCH_SDPA"),
    "--disable-log-stats": _k(S),
    "--disable-log-requests": _k(S),
    "--enable-log-requests": _r(
        "kvserve never logs request contents (privacy); each "
        "request's timings are in /metrics and traces",
        S,
    ),
    "--max-log-len": _i("kvserve never logs prompts", sample="100"),
    "--otlp-traces-endpoint": _k(sample="http://127.0.0.1:4317", engine=False),
    "--collect-detailed-traces": _r(
        "kvserve's spans carry vLLM's llm_request attributes only", sample="all"
    ),
    "--show-hidden-metrics-for-version": _i("kvserve exports its whole metric set", sample="0.10"),
}

# The OpenAI server's flags (vLLM's FrontendArgs and serve's own): `kvserve serve` only.
FRONTEND_FLAGS: dict[str, VLLMFlag] = {
    "--host": _k(sample="127.0.0.1", engine=False),
    "--port": _k(sample="8001", engine=False),
    "--uvicorn-log-level": _k(sample="warning", engine=False),
    "--disable-uvicorn-access-log": _a("--no-access-log", engine=False),
    "--allow-credentials": _k(S, engine=False),
    "--allowed-origins": _k(sample="http://a.example", engine=False),
    "--allowed-methods": _k(sample="GET", engine=False),
    "--allowed-headers": _k(sample="x-a", engine=False),
    "--api-key": _k(sample="k", engine=False),
    "--chat-template": _k(sample="{{ messages }}", engine=False),
    "--trust-request-chat-template": _k(S, engine=False),
    "--enable-auto-tool-choice": _k(S, engine=False),
    "--tool-call-parser": _k(sample="hermes", engine=False),
    "--exclude-tools-when-tool-choice-none": _k(S, engine=False),
    "--h11-max-incomplete-event-size": _k(sample="65536", engine=False),
    "--h11-max-header-count": _k(sample="64", engine=False),
    "--uds": _r("kvserve listens on TCP (--host, --port)", engine=False),
    "--chat-template-content-format": _r(
        "kvserve renders message content as the model's template expects",
        noop=("auto",),
        engine=False,
    ),
    "--default-chat-template-kwargs": _r(
        "pass chat_template_kwargs per request", sample="{}", engine=False
    ),
    "--response-role": _r("kvserve answers as the assistant", noop=("assistant",), engine=False),
    "--ssl-keyfile": _r("kvserve serves plain HTTP; terminate TLS in a proxy", engine=False),
    "--ssl-certfile": _r("kvserve serves plain HTTP; terminate TLS in a proxy", engine=False),
    "--ssl-ca-certs": _r("kvserve serves plain HTTP; terminate TLS in a proxy", engine=False),
    "--ssl-cert-reqs": _r(
        "kvserve serves plain HTTP; terminate TLS in a proxy", noop=("0",), engine=False
    ),
    "--ssl-ciphers": _r("kvserve serves plain HTTP; terminate TLS in a proxy", engine=False),
    "--enable-ssl-refresh": _r(
        "kvserve serves plain HTTP; terminate TLS in a proxy", S, engine=False
    ),
    "--root-path": _r("kvserve serves at /; strip the prefix in the proxy", engine=False),
    "--middleware": _r("kvserve loads no ASGI middleware", VS, engine=False),
    "--return-tokens-as-token-ids": _r("kvserve returns logprob tokens as text", S, engine=False),
    "--disable-frontend-multiprocessing": _i(_ONE_API, S, engine=False),
    "--api-server-count": _r(_ONE_API, noop=("1",), engine=False),
    "-asc": _r(_ONE_API, noop=("1",), engine=False),
    "--headless": _r(_NO_DP, S, engine=False),
    "--config": _r(
        "give the flags on the command line (or a Ray Serve config's args)",
        sample="c.yaml",
        engine=False,
    ),
    "--enable-request-id-headers": _r("kvserve does not echo X-Request-Id", S, engine=False),
    "--tool-parser-plugin": _r(_PLUGINS, engine=False),
    "--tool-server": _r(
        "kvserve runs no built-in tools (the client runs tool calls)", engine=False
    ),
    "--log-config-file": _r(
        "kvserve logs through Python's logging as configured by --log-level", engine=False
    ),
    "--disable-fastapi-docs": _i(
        "kvserve serves /openapi.json only, no HTML docs", S, engine=False
    ),
    "--enable-offline-docs": _r("kvserve serves /openapi.json only, no HTML docs", S, engine=False),
    "--enable-prompt-tokens-details": _i(
        "kvserve's usage always has prompt_tokens_details (cached_tokens)", S, engine=False
    ),
    "--enable-server-load-tracking": _r(
        "kvserve's load is in /metrics (num_requests_running/waiting)", S, engine=False
    ),
    "--enable-force-include-usage": _r(
        "ask for usage per request (stream_options.include_usage)", S, engine=False
    ),
    "--enable-tokenizer-info-endpoint": _r(
        "kvserve has /tokenize and /detokenize only", S, engine=False
    ),
    "--enable-log-outputs": _r("kvserve never logs request contents (privacy)", S, engine=False),
    "--log-error-stack": _i("kvserve logs the stack of every 500 already", S, engine=False),
    "--disable-access-log-for-endpoints": _r(
        "kvserve's access log is all or nothing (--no-access-log)", engine=False
    ),
    "--tokens-only": _r("kvserve serves its whole API", S, engine=False),
    "--enable-per-request-metrics": _r(
        "per-request timings are in /metrics and traces", S, engine=False
    ),
}

VLLM_SERVE_FLAGS: dict[str, VLLMFlag] = {**ENGINE_FLAGS, **FRONTEND_FLAGS}


def flag_field(flag: str) -> str:
    """``--max-seq-len-to-capture`` -> ``max_seq_len_to_capture`` (the LLM() keyword)."""
    return flag.lstrip("-").replace("-", "_")


def refusal(flag: str, value: object, reason: str) -> str:
    shown = "" if value is None else f" {value}"
    return f"{flag}{shown} is a vLLM option kvserve does not support: {reason}"


class _TableAction(argparse.Action):
    """An INERT or REFUSED flag: refused by name at parse time, or logged as accepted."""

    def __init__(self, option_strings: list[str], dest: str, flag: VLLMFlag, **kw: Any) -> None:
        nargs = {Takes.SWITCH: 0, Takes.VALUE: None, Takes.VALUES: "+"}[flag.takes]
        super().__init__(
            option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        self.flag = flag

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        value = None if self.flag.takes is Takes.SWITCH else values
        if self.flag.use is FlagUse.INERT:
            logger.info("%s: accepted, no effect (%s)", option, self.flag.reason)
        elif value is not None and str(value) in self.flag.noop:
            logger.info("%s %s: accepted (what kvserve does anyway)", option, value)
        else:
            parser.error(refusal(option, value, self.flag.reason))


class _AliasAction(argparse.Action):
    """vLLM's other spelling of a kvserve flag: does what the kvserve flag does."""

    def __init__(
        self, option_strings: list[str], dest: str, target: argparse.Action, **kw: Any
    ) -> None:
        super().__init__(
            option_strings,
            target.dest,
            nargs=target.nargs,
            type=target.type,
            choices=target.choices,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.target = target

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        self.target(parser, namespace, values, self.target.option_strings[0])


def add_vllm_flags(parser: argparse.ArgumentParser | Any, engine_only: bool = False) -> None:
    """Register the table's INERT, ALIAS and REFUSED flags that ``parser`` lacks (a flag it
    has already, from kvserve or another part of it, is left to that owner)."""
    known = parser._option_string_actions  # shared by a parser and its argument groups
    for flag, spec in VLLM_SERVE_FLAGS.items():
        if flag in known or spec.use is FlagUse.KVSERVE or (engine_only and not spec.engine):
            continue
        if spec.use is FlagUse.ALIAS:
            if spec.reason in known:
                parser.add_argument(flag, action=_AliasAction, target=known[spec.reason])
            continue
        parser.add_argument(flag, dest=f"vllm_{flag_field(flag)}", action=_TableAction, flag=spec)


def check_vllm_kwargs(kwargs: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """``LLM()`` keywords that are the table's engine flags, not ``EngineArgs`` fields:
    INERT ones dropped (logged), ALIAS ones renamed, REFUSED ones a ValueError unless no-op.
    Returns the rest."""
    by_field = {flag_field(f): (f, s) for f, s in ENGINE_FLAGS.items() if f.startswith("--")}
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in fields or key not in by_field or by_field[key][1].use is FlagUse.KVSERVE:
            out[key] = value
            continue
        flag, spec = by_field[key]
        if spec.use is FlagUse.ALIAS:
            out[flag_field(spec.reason)] = value
            continue
        noop = (
            value is False
            or value is None
            or (not isinstance(value, bool) and str(value) in spec.noop)
        )
        if spec.use is FlagUse.REFUSED and not noop:
            raise ValueError(f"{key}={value!r}: " + refusal(flag, None, spec.reason))
        logger.info("%s=%r: accepted, no effect (%s)", key, value, spec.reason or "no-op")
    return out
