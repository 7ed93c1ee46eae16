"""llama.cpp as a peer: the build of ``setup_llamacpp.sh``, GGUF files of a model, llama-server.

* :class:`LlamaCppBuild`: where ``setup_llamacpp.sh`` put llama-server, llama-quantize and the
  sdist's ``convert_hf_to_gguf.py`` (run by the ``convert-venv`` python: the project venv's
  packages plus ``sentencepiece``, which the converter imports for every Llama);
* :func:`ensure_ggufs`: a Hugging Face folder converted once to an unquantized GGUF (F32 for
  float32 weights, BF16 for bf16 ones: both exact) and quantized from it with llama-quantize
  to Q8_0 / Q4_0 / Q4_K_M / Q5_K_M, cached under ``~/.cache/kvserve/bench-models/gguf/<folder>/``;
* :func:`server_command`: llama-server on the loopback with continuous batching and one KV
  slot per concurrent request.

llama-quantize's default Q4_0 recipe is not all-Q4_0: the LM head becomes Q6_K (TinyLlama's
``output.weight``), or Q8_0 where Q6_K's 256-weight blocks do not fit (SmolLM2's tied
``token_embd.weight``, rows of 576). That is what llama.cpp users run, so it is the default
here; ``pure=True`` (``--pure``) makes every matrix the named type. :func:`tensor_types`
records which types a file holds.

The converter recognises a BPE tokenizer by the hash of its output on a fixed text. The
TinyLlama-shaped random model uses SmolLM2's BPE cut to 32000 tokens, whose hash is unknown to
it; ``pre_tokenizer="smollm"`` (this module's ``convert`` command) names the pre-tokenizer
instead of guessing it, which is right because the cut changes the vocabulary, not the
pre-tokenizer.

    python benchmarks/peers/llamacpp.py ggufs MODEL_DIR [--types Q8_0,Q4_0] [--pure]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# setup_llamacpp.sh's folder; $KVSERVE_LLAMACPP_DIR points at one built elsewhere (a worktree)
DEFAULT_ROOT = Path(os.environ.get("KVSERVE_LLAMACPP_DIR") or REPO / ".peers" / "llamacpp")
# Q8_0 / Q4_0: issue 16's side by side; Q4_K_M / Q5_K_M: issue 34's (llama-quantize's mixed
# recipes: Q4_K / Q5_K with Q6_K for the LM head and some layers' attn_v / ffn_down); IQ4_NL:
# 16 non-linear levels (kvserve's table codes on AVX512-VNNI; no importance matrix needed)
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "IQ4_NL", "IQ4_XS")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class LlamaCppBuild:
    """Paths inside one ``setup_llamacpp.sh`` folder."""

    root: Path = DEFAULT_ROOT

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "build" / "bin" / "llama-quantize"

    @property
    def source(self) -> Path:
        return self.root / "src" / "vendor" / "llama.cpp"

    @property
    def convert_python(self) -> Path:
        return self.root / "convert-venv" / "bin" / "python"

    def check(self) -> None:
        """Raise FileNotFoundError naming what is missing and the command that makes it."""
        for path in (self.server, self.quantize, self.source / "convert_hf_to_gguf.py"):
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: run `bash benchmarks/peers/setup_llamacpp.sh "
                    f"{self.root}` first"
                )
        if not self.convert_python.exists():
            raise FileNotFoundError(
                f"{self.convert_python} is missing (setup_llamacpp.sh makes it): the converter "
                f"needs sentencepiece, kept out of the project venv"
            )

    def version(self) -> str:
        out = subprocess.run(
            [str(self.server), "--version"], capture_output=True, text=True, timeout=30
        )
        lines = (out.stdout + out.stderr).strip().splitlines()
        return next((line for line in lines if line.startswith("version")), " ".join(lines[:1]))


def bench_models_dir() -> Path:
    """``$KVSERVE_CACHE_DIR/bench-models`` or ``~/.cache/kvserve/bench-models``."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "bench-models"


def base_outtype(model_dir: Path) -> str:
    """The converter's exact output type for the folder's weights: bf16 or f32."""
    cfg = json.loads((model_dir / "config.json").read_text())
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return "bf16" if dtype == "bfloat16" else "f32"


def gguf_name(qtype: str, pure: bool) -> str:
    return f"model-{qtype}{'-pure' if pure and qtype in QUANT_TYPES else ''}.gguf"


def ensure_ggufs(
    build: LlamaCppBuild,
    model_dir: Path,
    types: tuple[str, ...] = QUANT_TYPES,
    pure: bool = False,
    out_dir: Path | None = None,
    pre_tokenizer: str | None = None,
    keep_base: bool = True,
) -> dict[str, Path]:
    """GGUF files of ``model_dir``, made once: ``{"base": unquantized, "Q8_0": ..., ...}``.
    The unquantized file is converted only while a quantized one is missing; ``keep_base=False``
    deletes it once they are all made (the OLMoE-1B-7B shape's is 13.8 GB), and "base" is then
    left out of the answer."""
    bad = [t for t in types if t not in QUANT_TYPES]
    if bad:
        raise ValueError(f"unsupported GGUF types {bad}; choose from {QUANT_TYPES}")
    build.check()
    out_dir = out_dir or bench_models_dir() / "gguf" / model_dir.resolve().name
    out_dir.mkdir(parents=True, exist_ok=True)
    outtype = base_outtype(model_dir)
    base = out_dir / gguf_name(outtype.upper(), pure)
    files = {qtype: out_dir / gguf_name(qtype, pure) for qtype in types}
    missing = [q for q, path in files.items() if not path.is_file()]
    if (missing or keep_base) and not base.is_file():
        convert(build, model_dir, base, outtype, pre_tokenizer)
    for qtype in missing:
        quantize(build, base, files[qtype], qtype, pure)
    if not keep_base:
        base.unlink(missing_ok=True)
        return files
    return {"base": base, **files}


def convert(
    build: LlamaCppBuild, model_dir: Path, out: Path, outtype: str, pre_tokenizer: str | None
) -> None:
    """``convert_hf_to_gguf.py`` into ``out`` (written under a temporary name, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    cmd = [str(build.convert_python), str(Path(__file__).resolve()), "convert"]
    cmd += ["--source", str(build.source), "--pre-tokenizer", pre_tokenizer or ""]
    cmd += ["--", str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
    subprocess.run(cmd, check=True)
    tmp.rename(out)


def quantize(
    build: LlamaCppBuild, src: Path, dst: Path, qtype: str, pure: bool, requantize: bool = False
) -> None:
    """``llama-quantize [--pure] [--allow-requantize] src dst qtype`` with two threads
    (``requantize``: ``src`` is itself quantized, e.g. Q8_0)."""
    tmp = dst.with_name(dst.name + ".tmp")
    flags = [*(["--pure"] if pure else []), *(["--allow-requantize"] if requantize else [])]
    cmd = [str(build.quantize), *flags, str(src), str(tmp), qtype, "2"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tmp.rename(dst)


def tensor_types(path: Path) -> dict[str, int]:
    """Tensor count per GGUF type, e.g. ``{"Q4_0": 154, "F32": 45, "Q6_K": 1}``."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def streamed_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table, of which
    a step reads a few rows; when the model ties its LM head to it (no ``output.weight``), the
    table is the LM head and is read whole."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def server_command(
    build: LlamaCppBuild,
    gguf: Path,
    port: int,
    threads: int,
    parallel: int,
    ctx_size: int,
    alias: str = "m",
) -> list[str]:
    """llama-server on the loopback, CPU only: ``parallel`` slots of ``ctx_size / parallel``
    tokens of KV cache each, continuous batching, ``threads`` threads for decode and prompts.
    ``--cache-ram 0``: no host-memory copies of finished prompts' KV (up to 8 GiB by default),
    which a random-prompt workload never reuses and which would count in the peak RSS."""
    return [
        str(build.server), "-m", str(gguf), "--host", LOOPBACK, "--port", str(port),
        "--alias", alias, "--threads", str(threads), "--threads-batch", str(threads),
        "-np", str(parallel), "--cont-batching", "-c", str(ctx_size), "-ngl", "0",
        "--cache-ram", "0", "--no-webui",
    ]  # fmt: skip


def _convert_main(argv: list[str]) -> None:
    """Run the sdist's converter in this process, naming the BPE pre-tokenizer if asked."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--pre-tokenizer", default="")
    args, rest = ap.parse_known_args(argv)
    sys.path.insert(0, args.source)
    import convert_hf_to_gguf  # type: ignore[import-not-found]
    from conversion.base import TextModel  # type: ignore[import-not-found]

    if args.pre_tokenizer:
        TextModel.get_vocab_base_pre = lambda self, tokenizer: args.pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", *[a for a in rest if a != "--"]]
    convert_hf_to_gguf.main()


def main() -> None:
    if sys.argv[1:2] == ["convert"]:
        _convert_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["ggufs"])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--types", default=",".join(QUANT_TYPES))
    ap.add_argument("--pure", action="store_true", help="every matrix in the named type")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="setup_llamacpp.sh's DIR")
    ap.add_argument("--pre-tokenizer", default=None, help="e.g. smollm (see the docstring)")
    args = ap.parse_args()
    files = ensure_ggufs(
        LlamaCppBuild(args.root), args.model_dir, tuple(args.types.split(",")), args.pure,
        pre_tokenizer=args.pre_tokenizer,
    )  # fmt: skip
    for key, path in files.items():
        print(f"{key}: {path} {tensor_types(path)}")


if __name__ == "__main__":
    main()
