"""Engine configuration: frozen dataclasses, validated on construction.

Each component receives only its own part (the scheduler gets ``SchedulerConfig`` and
``CacheConfig``, the runner gets ``ModelConfig``...), composed in ``EngineConfig``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

import torch


class KVPolicy(enum.Enum):
    """How the scheduler trades KV memory for admission."""

    PREEMPT = "preempt"  # admit while blocks are free; preempt the newest request when out
    RESERVE = "reserve"  # admit only when prompt + max_tokens fit; never preempt


class PreemptionMode(enum.Enum):
    """What happens to a preempted request's KV cache."""

    RECOMPUTE = "recompute"  # drop the blocks, recompute prompt + generated tokens later
    SWAP = "swap"  # copy the blocks to CPU swap space and back when resumed


class SchedulingPolicy(enum.Enum):
    """The order in which waiting requests are admitted (vLLM's ``--scheduling-policy``)."""

    FCFS = "fcfs"  # first come, first served; the newest running request is preempted first
    PRIORITY = "priority"  # lowest ``priority`` value first, then arrival; may preempt


class AttentionBackendEnum(enum.Enum):
    """Which attention backend runs (vLLM's ``--attention-backend`` names where they fit;
    ``kvserve/attention/selector.py`` maps each to its class)."""

    AUTO = "auto"  # the selector's choice for the device and dtype (attention/selector.py)
    TORCH_SDPA = "TORCH_SDPA"  # gather + PyTorch SDPA: the reference backend, any device
    CPU_KERNEL = "CPU_KERNEL"  # C++ decode kernel reading K/V in place (CPU only)
    TRITON_ATTN = "TRITON_ATTN"  # Triton paged kernels (kvserve/ops/triton; CUDA)

    @classmethod
    def parse(cls, value: str | AttentionBackendEnum) -> AttentionBackendEnum:
        """A member from its name, in any case (``torch_sdpa``, ``TORCH_SDPA``, ``auto``)."""
        if isinstance(value, cls):
            return value
        for member in cls:
            if str(value).upper() == member.value.upper():
                return member
        names = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown attention_backend {value!r}; choose from {names}")


class ModelImpl(enum.Enum):
    """Which implementation runs the model (vLLM's ``--model-impl``)."""

    AUTO = "auto"  # kvserve's native class when the architecture has one, else transformers
    KVSERVE = "kvserve"  # native only: an architecture without a native class is refused
    TRANSFORMERS = "transformers"  # transformers' own class on kvserve's paged attention


class CpuLinearKernel(enum.Enum):
    """What a bf16 model's dense linear layers run on a CPU (``--cpu-linear-kernel``)."""

    AUTO = "auto"  # packed where the kernels have AVX512-BF16 and the CPU no AMX, else oneDNN
    ONEDNN = "onednn"  # oneDNN's prepacked weights (ops/packed_linear.py)
    # kvserve's packed layout times bf16 activations: vdpbf16ps where the kernels have
    # AVX512-BF16, else widened to float32 (model/wide_linear.py)
    PACKED = "packed"


class GenerationConfigSource(enum.Enum):
    """Where requests' default sampling values come from (vLLM's ``--generation-config``)."""

    AUTO = "auto"  # the model's generation_config.json (temperature, top_k, ...), as vLLM
    VLLM = "vllm"  # vLLM's neutral defaults; the file's sampling values are ignored


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or a plain number of bytes."""
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size in bytes must be non-negative, got {value}.")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. '2GiB', '512MiB' or bytes.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """``dtype="auto"``: bfloat16 where the device computes it natively, else float32.

    On a CPU without AVX512-BF16/AMX (an AVX2-only AMD EPYC), oneDNN has no bf16 kernels and
    bf16 runs emulated: the built-in model took 10.6 s for a 300-token prefill and 874 ms per
    decode token in bf16, against 4.1 s and 105 ms in float32 (same machine, same load).
    """
    dev = torch.device(device)
    if dev.type != "cpu":
        return torch.bfloat16
    mkldnn = torch.ops.mkldnn
    if hasattr(mkldnn, "_is_mkldnn_bf16_supported"):
        return torch.bfloat16 if mkldnn._is_mkldnn_bf16_supported() else torch.float32
    return torch.bfloat16


def parse_device(value: str | torch.device) -> str:
    """``device`` checked: ``cpu``, ``cuda`` or ``cuda:N`` (N a visible GPU). ValueError
    naming the problem otherwise, before anything is loaded or compiled."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {value!r} is not a torch device: use cpu, cuda or cuda:N"
        ) from exc
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"device {value!r} is not supported: use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {value!r}: CUDA is not available here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {value!r}: only {count} CUDA device(s) are visible")
    return str(dev)


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; choose from {sorted(_DTYPES)}.")
    return _DTYPES[value]


class Quantization(enum.Enum):
    """Weight-only quantization of the linear layers (vLLM's ``--quantization``)."""

    INT8 = "int8"  # round-to-nearest at load: int8 codes, a scale per channel (or group)
    INT4 = "int4"  # round-to-nearest at load: int4 codes, a scale and zero per group of 32
    GGUF = "gguf"  # a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors kept as they are
    # a pre-quantized checkpoint's own weights (found from its config.json, as vLLM does):
    COMPRESSED_TENSORS = "compressed-tensors"  # llm-compressor's W4A16 / W8A16
    AWQ = "awq"  # AutoAWQ's int4 GEMM layout (qweight / qzeros / scales)
    GPTQ = "gptq"  # AutoGPTQ / GPTQModel's int4 / int8 layout (qweight / qzeros / scales / g_idx)
    # gpt-oss's MXFP4 experts kept in their blocks (exact 8-bit codes and a power-of-two scale
    # per 32), the rest in the model dtype; without it they dequantize at load (vLLM's name)
    MXFP4 = "mxfp4"


class QuantizedActivations(enum.Enum):
    """What quantized linear layers multiply their weights with (``--quantization-activations``)."""

    # int8 where it is the faster kernel (a bf16 model on a CPU with AVX512-VNNI; 4-bit codes
    # and byte codes within 6 bits on an AVX2 CPU without VNNI: qlinear.a8_auto_supports),
    # else the dtype
    AUTO = "auto"
    # x quantized per row in blocks of 32 (int8, a float scale each: llama.cpp's Q8_0), then
    # integer dot products (VNNI for bf16; AVX2 vpmaddubsw for float32 and bf16); without a
    # kernel, the (slow) pure-PyTorch reference
    INT8 = "int8"
    NONE = "none"  # the model dtype: exact products with the dequantized weights


# int4's default group: llama.cpp's Q4_1 block; 5 bits a weight with float16 scale and zero
DEFAULT_INT4_GROUP_SIZE = 32


class PoolingType(enum.Enum):
    """How an embedding request's hidden states become one vector (vLLM's pooling_type)."""

    LAST = "last"  # the last prompt position's hidden state (a decoder's summary token)
    MEAN = "mean"  # the average over every prompt position


@dataclass(frozen=True)
class ModelConfig:
    path: str  # a Hugging Face model directory (config.json + safetensors + tokenizer)
    dtype: torch.dtype = torch.bfloat16  # weights, activations and KV cache
    max_model_len: int | None = None  # context limit; None takes the model's own
    seed: int = 0  # seeds the engine's generator for unseeded sampling
    served_name: str | None = None  # the name clients use; None derives one from the path
    prepack_weights: bool = True  # CPU: linear weights repacked at load for a faster kernel
    # CPU bf16: which kernel the dense linears run (auto: model/wide_linear.py's pick)
    cpu_linear_kernel: CpuLinearKernel = CpuLinearKernel.AUTO
    # float32 on a CPU: linear weights stored in bfloat16/float16, widened in registers (half
    # the bytes a decode step reads); None: auto (the checkpoint's 16-bit dtype where that
    # applies, model/wide_linear.py); float32 (= dtype): off
    weight_dtype: torch.dtype | None = None
    fused_ops: bool = True  # RMSNorm, SiLU*up, RoPE+KV write fused: C++ on CPU, Triton on CUDA
    # True: every step's layers run in Python; False: decode-only steps of native Llama-family
    # models run their layers in one C++ call (model/decode_loop.py; same numbers)
    enforce_eager: bool = False
    attention_backend: AttentionBackendEnum = AttentionBackendEnum.AUTO  # attention/selector.py
    warmup: bool = True  # prepacked (CPU bf16): a dummy max-size prefill before serving
    chat_template: str | None = None  # Jinja text for chat prompts; None: the tokenizer's
    # custom batch-level logits processor classes (vLLM v1's interface; kvserve.sample.
    # custom_processors.LogitsProcessor subclasses), one instance each per engine
    logits_processors: tuple[type, ...] = ()
    pooling: PoolingType = PoolingType.LAST  # embedding requests (LLM.embed, /v1/embeddings)
    # vLLM's --task: "score" makes score/rerank a causal-LM reranker's (kvserve/scoring.py)
    task: str = "auto"
    # vLLM's flag: sleep()/wake_up() (free the KV cache, and the weights at level 2)
    enable_sleep_mode: bool = False
    quantization: Quantization | None = None  # weight-only quantized linears; None: dtype
    # weights per scale along K for int8/int4; None: int8 per channel, int4 32
    quantization_group_size: int | None = None
    # how quantized linears take activations (int8 per 32 on CPUs with VNNI, or the dtype)
    quantization_activations: QuantizedActivations = QuantizedActivations.AUTO
    # the LM head quantized too (int8 per channel, or a GGUF's own output tensor type); None:
    # auto, the file's own head for gguf where it can (quantization/lm_head.wants_quantized_head)
    quantization_lm_head: bool | None = None
    gguf_file: str | None = None  # the GGUF the model folder was converted from, if any
    model_impl: ModelImpl = ModelImpl.AUTO  # native class or transformers' (model/registry.py)
    # the defaults of the sampling fields a request leaves unset (engine/generation_defaults.py)
    generation_config: GenerationConfigSource = GenerationConfigSource.AUTO
    # defaults the model's source gives besides generation_config.json (Ollama's params
    # layer, model/ollama.py), as (SamplingParams field, value) pairs; they win over the file's
    source_sampling_defaults: tuple[tuple[str, Any], ...] = ()
    # most logprobs a request may ask per token, sampled (logprobs) or prompt
    # (prompt_logprobs); vLLM's max_logprobs, -1: no cap (the vocabulary)
    max_logprobs: int = 20
    # most beams one beam search may keep (--max-beam-width): each is a batch row and KV
    max_beam_width: int = 16
    # a folder with the tokenizer files when they are not the model folder's (--tokenizer);
    # None: the model folder's
    tokenizer: str | None = None
    # --batch-invariant (or $VLLM_BATCH_INVARIANT=1): every row is computed in a fixed order,
    # so a request's tokens and logprobs do not depend on its batch (model/batch_invariant.py)
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.max_beam_width < 1:
            raise ValueError(f"max_beam_width (--max-beam-width) must be >= 1, got "
                             f"{self.max_beam_width}")  # fmt: skip
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs (--max-logprobs) must be >= 0, or -1 for no cap, got "
                f"{self.max_logprobs}"
            )
        object.__setattr__(self, "model_impl", ModelImpl(self.model_impl))
        object.__setattr__(self, "cpu_linear_kernel", CpuLinearKernel(self.cpu_linear_kernel))
        source = GenerationConfigSource(self.generation_config)
        object.__setattr__(self, "generation_config", source)
        backend = AttentionBackendEnum.parse(self.attention_backend)
        object.__setattr__(self, "attention_backend", backend)
        object.__setattr__(self, "pooling", PoolingType(self.pooling))
        if self.quantization is not None:
            object.__setattr__(self, "quantization", Quantization(self.quantization))
        acts = QuantizedActivations(self.quantization_activations)
        object.__setattr__(self, "quantization_activations", acts)
        if self.quantization_group_size is not None and self.quantization not in (
            Quantization.INT8,
            Quantization.INT4,
        ):
            raise ValueError(
                "quantization_group_size is for quantization 'int8' or 'int4' (a GGUF file "
                "brings its own groups)"
            )
        if self.quantization_group_size is not None and (
            self.quantization_group_size < 2 or self.quantization_group_size % 2
        ):
            raise ValueError(
                "quantization_group_size must be a positive even number (e.g. 32, 64, 128), "
                f"got {self.quantization_group_size}."
            )
        if self.quantization_lm_head and self.quantization is Quantization.MXFP4:
            raise ValueError(
                "quantization_lm_head is not for quantization 'mxfp4' (it keeps gpt-oss's MXFP4 "
                "experts as stored; the checkpoint's LM head is not MXFP4)"
            )
        if self.quantization_lm_head and self.quantization is None:
            raise ValueError(
                "quantization_lm_head quantizes the LM head along with the linear layers: it "
                "needs quantization 'int8', 'int4', 'gguf', 'compressed-tensors', 'awq' or 'gptq'"
            )
        if self.quantization is Quantization.GGUF and self.gguf_file is None:
            raise ValueError(
                "quantization 'gguf' keeps a GGUF file's quantized tensors: give a .gguf "
                "model (or the built-in model, a Q4_1 GGUF)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache; used when num_kv_blocks is None
    num_kv_blocks: int | None = None  # exact number of blocks; wins over kv_cache_memory
    # CUDA only: the fraction of the device's total memory the engine may use (vLLM's
    # meaning); the KV cache gets what the weights and a profiled dummy step leave of it
    # (kvserve/worker/memory_profile.py). On a CPU the engine args turn the flag into
    # kv_cache_memory instead.
    gpu_memory_utilization: float | None = None
    swap_space: int = 4 * 1024**3  # bytes of CPU swap space for PreemptionMode.SWAP
    # Reuse the K/V of full blocks across requests with the same prefix (vLLM's automatic
    # prefix caching, on by default there too).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}.")
        util = self.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # most requests in the running batch (the study's batch size)
    max_num_batched_tokens: int = 2048  # most tokens computed in one step (prefill chunking)
    kv_policy: KVPolicy = KVPolicy.PREEMPT
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # Under PRIORITY + PREEMPT, a waiting request preempts a running one only when its
    # priority value is lower by at least this much (SGLang's flag), so that near-equal
    # priorities do not evict each other back and forth.
    priority_scheduling_preemption_threshold: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}."
            )
        # Accept the strings users type ("reserve", "swap") as well as the enums.
        object.__setattr__(self, "kv_policy", KVPolicy(self.kv_policy))
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        if self.priority_scheduling_preemption_threshold < 1:
            raise ValueError(
                "priority_scheduling_preemption_threshold must be at least 1, got "
                f"{self.priority_scheduling_preemption_threshold}."
            )


class SpecMethod(enum.Enum):
    """Where speculative tokens come from (vLLM's ``speculative_config["method"]``)."""

    NGRAM = "ngram"  # prompt lookup: copy what followed the last n tokens' earlier occurrence
    DRAFT_MODEL = "draft_model"  # a smaller model with the same tokenizer, k greedy steps


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: k proposed tokens verified in one target forward."""

    method: SpecMethod = SpecMethod.NGRAM
    num_speculative_tokens: int = 4  # k: tokens proposed per request per step
    model: str | None = None  # the draft model's folder (draft_model only)
    prompt_lookup_min: int = 1  # ngram: shortest suffix to match (vLLM's default)
    prompt_lookup_max: int = 4  # ngram: longest suffix to match, tried first
    # Speculation is skipped in steps with more running requests than this (a big batch
    # already uses the compute a decode step leaves idle); None: never skipped.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", SpecMethod(self.method))
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}."
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )
        if self.method is SpecMethod.DRAFT_MODEL and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft's folder.")
        if self.method is SpecMethod.NGRAM and self.model:
            raise ValueError("speculative method 'ngram' takes no 'model'.")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be positive, got {self.disable_by_batch_size}."
            )

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the verified tokens that proposing writes: a draft model writes the
        K/V of its first k - 1 proposals there; n-gram lookup writes nothing."""
        return self.num_speculative_tokens if self.method is SpecMethod.DRAFT_MODEL else 0


class ExecutorBackend(enum.Enum):
    """Where the model runner lives (vLLM's ``distributed_executor_backend``)."""

    UNI = "uni"  # in the engine's process (UniProcExecutor)
    MP = "mp"  # one worker process per rank (MultiprocExecutor)


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model and where (vLLM's names)."""

    tensor_parallel_size: int = 1  # ranks sharing one model (world size)
    # None: "uni" for one rank, "mp" for more; "uni" with several ranks is refused
    distributed_executor_backend: ExecutorBackend | None = None
    # torch CPU threads of each runner's process, set by the engine (uni) or each worker
    # (mp) before the model loads; None leaves torch's default (OMP_NUM_THREADS). A resource,
    # not a result: configs that differ only in it compute the same and compare equal.
    num_threads: int | None = field(default=None, compare=False)
    # The cores of each rank, resolved from --cpu-cores by the engine (cpu_binding.py); each
    # rank runs one OpenMP thread per core of its group, each pinned to its core. None: no
    # binding (nobind, a GPU, or auto beside a --num-threads that differs). A resource too.
    cpu_cores: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}."
            )
        backend = self.distributed_executor_backend
        if backend is None:
            backend = ExecutorBackend.MP if self.tensor_parallel_size > 1 else ExecutorBackend.UNI
        try:
            backend = ExecutorBackend(backend)
        except ValueError:
            choices = [b.value for b in ExecutorBackend]
            raise ValueError(
                f"distributed_executor_backend must be one of {choices}, got {backend!r}"
            ) from None
        if backend is ExecutorBackend.UNI and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one rank in the engine's process; "
                f"tensor_parallel_size {self.tensor_parallel_size} needs 'mp'"
            )
        object.__setattr__(self, "distributed_executor_backend", backend)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}.")
        if self.cpu_cores is not None and (
            len(self.cpu_cores) != self.tensor_parallel_size or not all(self.cpu_cores)
        ):
            raise ValueError(
                f"cpu_cores needs one non-empty core group per rank, got {self.cpu_cores} "
                f"for {self.tensor_parallel_size} rank(s)"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): adapters in device slots and in host memory."""

    max_loras: int = 1  # adapters in device slots at once = most distinct adapters per step
    max_lora_rank: int = 16  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int | None = None  # adapters kept in host memory (LRU); None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        """``max_cpu_loras`` resolved (never None after construction)."""
        return int(self.max_cpu_loras or self.max_loras)


# -- structured outputs: grammar compilation limits ------------------------------------------
@dataclass(frozen=True)
class StructuredOutputsConfig:
    """What one grammar compile (structured outputs, ``tool_choice`` required or named) may
    take: each compiles in a worker process that is killed past these limits, failing only
    its own request (vLLM's class name; its limits are kvserve's own)."""

    compile_timeout: float = 10.0  # seconds one compile may run before it is killed
    compile_max_memory: int = 512 * 2**20  # bytes one compile may add to its worker process
    cache_memory: int = 64 * 2**20  # bytes of compiled grammars kept for reuse (LRU)

    def __post_init__(self) -> None:
        if not self.compile_timeout > 0:  # also rejects nan
            raise ValueError(
                f"grammar_compile_timeout must be positive, got {self.compile_timeout}."
            )
        if self.compile_max_memory <= 0:
            raise ValueError(
                f"grammar_compile_max_memory must be positive, got {self.compile_max_memory}."
            )
        if self.cache_memory < 0:
            raise ValueError(f"grammar_cache_memory must be non-negative, got {self.cache_memory}.")


# vLLM's cap on the default capture list (``max_cudagraph_capture_size``'s default is
# min(max_num_seqs, 512)): a larger batch is compute-bound, where launches no longer matter.
MAX_DEFAULT_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's capture list up to ``max_size``: 1, 2, 4, then every 8 to 256, then every 16
    (a batch pads to the next size: at most 7 wasted rows below 256, 15 above)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += range(8, min(max_size, 255) + 1, 8)
    sizes += range(256, max_size + 1, 16)
    return tuple(sizes)


def resolve_capture_sizes(
    cuda_graph_sizes: tuple[int, ...] | list[int] | None,
    max_cudagraph_capture_size: int | None,
    max_num_seqs: int,
) -> tuple[int, ...]:
    """The batch sizes captured as CUDA graphs, ascending (vLLM's rules): no list, the
    default pattern up to ``max_cudagraph_capture_size`` (default min(max_num_seqs, 512));
    one value, the default pattern up to it; several, exactly those. ValueError for a
    size below 1 or a list that goes past an explicit ``max_cudagraph_capture_size``."""
    if max_cudagraph_capture_size is not None and max_cudagraph_capture_size < 1:
        raise ValueError(
            "max_cudagraph_capture_size (--max-cudagraph-capture-size) must be >= 1, got "
            f"{max_cudagraph_capture_size}"
        )
    sizes = list(cuda_graph_sizes or ())
    if any(int(s) != s or s < 1 for s in sizes):
        raise ValueError(f"cuda_graph_sizes (--cuda-graph-sizes) must be positive integers, "
                         f"got {sizes}")  # fmt: skip
    if len(sizes) > 1:
        out = tuple(sorted(set(sizes)))
        if max_cudagraph_capture_size is not None and out[-1] > max_cudagraph_capture_size:
            raise ValueError(
                f"cuda_graph_sizes {list(out)} go past max_cudagraph_capture_size "
                f"{max_cudagraph_capture_size}; drop the larger sizes or raise the cap"
            )
        return out
    if sizes:
        top = sizes[0]
        if max_cudagraph_capture_size is not None:
            top = min(top, max_cudagraph_capture_size)
    else:
        top = max_cudagraph_capture_size or min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    return default_capture_sizes(top)


@dataclass(frozen=True)
class CompilationConfig:
    """What runs as CUDA graphs (vLLM's ``CompilationConfig``, its graph fields only): the
    decode-only steps of up to the largest of ``cudagraph_capture_sizes`` rows, padded to
    the next captured size, on CUDA with TRITON_ATTN unless ``enforce_eager``
    (``kvserve/worker/cuda_graph.py``). Ignored on a CPU."""

    cudagraph_capture_sizes: tuple[int, ...] = default_capture_sizes(256)
    # vLLM's max_seq_len_to_capture: a step with a longer context runs eager. It bounds the
    # static block tables (copied every step) and the split-K partitions of a graph step.
    max_seq_len_to_capture: int = 8192

    def __post_init__(self) -> None:
        sizes = tuple(sorted(set(self.cudagraph_capture_sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cudagraph_capture_sizes must be positive, got {sizes}")
        object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        if self.max_seq_len_to_capture < 1:
            raise ValueError("max_seq_len_to_capture (--max-seq-len-to-capture) must be >= 1, "
                             f"got {self.max_seq_len_to_capture}")  # fmt: skip

    @property
    def max_cudagraph_capture_size(self) -> int:
        return self.cudagraph_capture_sizes[-1]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"  # torch device string; everything is placed there
    speculative: SpeculativeConfig | None = None  # None: one token per request per step
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig | None = None  # None: LoRA adapters off (--enable-lora turns them on)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)  # CUDA graphs

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        if self.model.batch_invariant:
            reason = batch_invariant_refusal(self)
            if reason is not None:
                raise ValueError(f"batch-invariant mode (--batch-invariant) {reason}")


def batch_invariant_refusal(config: EngineConfig) -> str | None:
    """Why batch-invariant mode cannot hold under ``config`` (the end of a sentence), or
    None. Each refused part reduces in an order that depends on the batch and has no
    fixed-order path in kvserve (docs/server.md, "Batch-invariant mode")."""
    mc = config.model
    device = torch.device(config.device)
    if device.type != "cpu":
        return (f"runs on the CPU only, not on {device.type}: kvserve's GPU matmuls (cuBLAS) "
                "and TRITON_ATTN kernels sum in an order chosen by the batch's shape")  # fmt: skip
    if mc.attention_backend not in (AttentionBackendEnum.AUTO, AttentionBackendEnum.CPU_KERNEL):
        return (f"needs the CPU_KERNEL attention backend, not {mc.attention_backend.value}: "
                "its SDPA calls sum over batches padded to their longest row")  # fmt: skip
    if config.parallel.tensor_parallel_size != 1:
        return ("needs tensor_parallel_size 1: the all-reduce adds the ranks' partial sums in "
                "an order kvserve does not fix")  # fmt: skip
    if config.speculative is not None:
        return ("is not supported with speculative decoding: a verified token is sampled by "
                "the rejection sampler, a plain step's by the sampler")  # fmt: skip
    if config.lora is not None:
        return ("is not supported with LoRA adapters: their deltas are matmuls over the rows "
                "that share an adapter")  # fmt: skip
    return None
