"""The test files' GGUF writers against llama.cpp's own ``convert_hf_to_gguf.py``: for each
family the other GGUF tests write by hand (Gemma 1/2/3, Phi-3, Qwen2-MoE, Qwen3-MoE, Mixtral,
OLMoE, and gpt-oss from a checkpoint with MXFP4 experts),
llama.cpp's converter, run on the same tiny model, writes the same tensors (names, types,
shapes, values) and the same architecture metadata, so what those tests show holds for files
llama.cpp writes.

Needs a llama.cpp tree (``KVSERVE_LLAMA_CPP``, else the one ``benchmarks/peers/setup_llamacpp.sh``
unpacks: ``.peers/llamacpp/src/vendor/llama.cpp``); skipped without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.model.test_gguf_gemma_phi3 import make_model, write_gguf
from tests.model.test_gguf_gpt_oss import write_gpt_oss_gguf
from tests.model.test_gguf_moe import ARCHS as MOE_ARCHS
from tests.model.test_gguf_moe import EPS, write_moe_gguf
from tests.model.test_gpt_oss import write_mxfp4
from tests.model.tiny_moe import GPT_OSS, make_moe_model

ROOT = Path(__file__).resolve().parents[2]
TREE = Path(os.environ.get("KVSERVE_LLAMA_CPP", ROOT / ".peers/llamacpp/src/vendor/llama.cpp"))
_NO_TREE = f"no llama.cpp tree at {TREE} (KVSERVE_LLAMA_CPP)"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TREE / "convert_hf_to_gguf.py").is_file(), reason=_NO_TREE),
]
FAMILIES = ("gemma", "gemma2", "gemma3", "phi3", *MOE_ARCHS, GPT_OSS)
# metadata llama.cpp writes that the hand-written files leave out, none read by kvserve:
# Phi-3's original context (LongRoPE only), llama's rope dimension and vocab size (implied)
EXTRA_KEYS = {"phi3.rope.scaling.original_context_length", "llama.rope.dimension_count",
              "llama.vocab_size"}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (llama.cpp's GGUF, the test writer's GGUF) of one tiny model."""
    work = tmp_path_factory.mktemp("llamacpp")
    pairs: dict[str, tuple[Path, Path]] = {}
    for family in FAMILIES:
        folder = work / family
        if family == GPT_OSS:  # the converter repacks the MXFP4 blocks as they are
            make_moe_model(family, work / "gpt_oss_dense", swiglu_limit=7.0)
            folder.mkdir()
            write_mxfp4(work / "gpt_oss_dense", folder)
            ours = write_gpt_oss_gguf(folder, work / f"{family}.ours.gguf")
        elif family in MOE_ARCHS:
            gguf_arch, _, overrides = MOE_ARCHS[family]
            make_moe_model(family, folder, **{"rms_norm_eps": EPS, **overrides})
            ours = write_moe_gguf(folder, gguf_arch, work / f"{family}.ours.gguf")
        else:
            model = make_model(family)
            model.save_pretrained(folder)
            ours = write_gguf(model, family, work / f"{family}.ours.gguf")
        if family == "gemma3":  # its converter counts the vocabulary in tokenizer.json
            vocab = {"model": {"vocab": {f"t{i}": i for i in range(256)}}, "added_tokens": []}
            (folder / "tokenizer.json").write_text(json.dumps(vocab))
        pairs[family] = (work / f"{family}.llamacpp.gguf", ours)
    args = [str(p) for f in FAMILIES for p in (work / f, pairs[f][0])]
    driver = Path(__file__).with_name("llamacpp_convert.py")
    subprocess.run([sys.executable, str(driver), str(TREE), *args], check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    return pairs


def _metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    skip = ("GGUF.", "general.", "tokenizer.")
    return {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith(skip) and k not in EXTRA_KEYS}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_writes_what_the_tests_write(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    theirs, ours = (gguf.GGUFReader(p) for p in files[family])
    assert theirs.fields["general.architecture"].contents() == (
        ours.fields["general.architecture"].contents()
    )
    assert _metadata(theirs) == _metadata(ours)
    want = {t.name: t for t in ours.tensors}
    assert sorted(t.name for t in theirs.tensors) == sorted(want)
    for t in theirs.tensors:
        o = want[t.name]
        assert (t.tensor_type, t.shape.tolist()) == (o.tensor_type, o.shape.tolist()), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(o.data)), t.name
